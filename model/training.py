"""Training the shipped pair on this CPU (docs/dflash.md section 7): tokenizer, Qwen3 target, DFlash drafter.

Commands (`dflash train-tokenizer | train-target | train-drafter`) write checkpoints in the public
layout (bf16 safetensors, config.json, generation_config.json, tokenizer.json), resumable from
`train_state.pt`, with a JSONL loss log and progress bars.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from .config import default_target_layer_ids
from .corpus import read_text, stdlib_files
from .torch_qwen3 import DFlashDrafter, Qwen3LM, block_loss_weights, cosine_lr

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The Qwen2/3 pre-tokenizer regex (docs/models.md 3.1): digits split one by one.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# ----------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(out_dir: str | Path, vocab_size: int = 4096, texts: list[str] | None = None) -> Path:
    """Byte-level BPE in the Qwen layout (NFC, Split(regex, isolated) + ByteLevel, no BOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )
    texts = texts if texts is not None else read_text(stdlib_files("train"))
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids after the BPE vocabulary, like Qwen's added tokens
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


# ------------------------------------------------------------------------------------------- saving
def _save_bf16(state: dict, path: Path, skip: tuple[str, ...] = ()) -> None:
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items() if k not in skip}
    save_file(tensors, str(path), metadata={"format": "pt"})


def target_config(vocab_size: int, eos_id: int, bos_id: int, **over) -> dict:
    cfg = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
        bos_token_id=bos_id, eos_token_id=eos_id, head_dim=64, hidden_act="silu", hidden_size=256,
        initializer_range=0.02, intermediate_size=768, max_position_embeddings=4096, max_window_layers=4,
        num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_scaling=None, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=True,
        torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=vocab_size,
    )
    cfg.update(over)
    return cfg


def save_target(model: Qwen3LM, out: Path, tokenizer_json: Path, stop_ids: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(model.cfg)
    skip = ("lm_head.weight",) if cfg.get("tie_word_embeddings") else ()
    _save_bf16(model.state_dict(), out / "model.safetensors", skip)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": stop_ids, "do_sample": False}, indent=2) + "\n")
    if Path(tokenizer_json).resolve() != (out / "tokenizer.json").resolve():
        (out / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())


def save_drafter(model: DFlashDrafter, out: Path, target_cfg: dict, taps: list[int], mask_id: int,
                 block_size: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    cfg = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", block_size=block_size,
        num_target_layers=target_cfg["num_hidden_layers"], num_hidden_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], hidden_act="silu", rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"], rope_scaling=None, max_position_embeddings=target_cfg["max_position_embeddings"],
        layer_types=["full_attention"] * c["num_hidden_layers"], sliding_window=None, attention_bias=False,
        vocab_size=target_cfg["vocab_size"], tie_word_embeddings=False, torch_dtype="bfloat16",
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": taps, "block_size": block_size},
    )
    _save_bf16(model.state_dict(), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def default_taps(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """The default tap rule (docs/dflash.md 6), clamped into range for tiny targets (L < 4), each layer
    once: for L = 4 the rule gives [1, 1], and vLLM, which gathers each tapped layer once, then finds
    fewer features than ``fc`` takes and refuses the drafter."""
    ids = [min(max(i, 0), n_target_layers - 1) for i in default_target_layer_ids(n_target_layers, n_draft_layers)]
    return sorted(set(ids))


def merge_repeated_taps(drafter_dir) -> list[int]:
    """Rewrite a drafter whose ``target_layer_ids`` repeat a layer (e.g. [1, 1]) to tap each layer
    once: the ``fc`` column blocks of a repeated layer read the same features, so they are summed
    (in float32, stored bf16). Same function up to that rounding; engines that gather each layer
    once (vLLM) then load it. Returns the new ids."""
    from safetensors.torch import load_file

    d = Path(drafter_dir)
    cfg = json.loads((d / "config.json").read_text())
    ids = cfg["dflash_config"]["target_layer_ids"]
    tensors = load_file(str(d / "model.safetensors"))
    fc = tensors["fc.weight"].float()
    hidden = fc.shape[1] // len(ids)
    merged = sorted(set(ids))
    blocks = [sum(fc[:, i * hidden:(i + 1) * hidden] for i, t in enumerate(ids) if t == layer) for layer in merged]
    tensors["fc.weight"] = torch.cat(blocks, dim=1).to(torch.bfloat16).contiguous()
    cfg["dflash_config"]["target_layer_ids"] = merged
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return merged


# ------------------------------------------------------------------------------------------ helpers
def _log(path: Path, **row) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _resume(state_path: Path, log_path: Path, model, opt) -> int:
    """Load model + optimizer from the last saved state; drop log rows written after it."""
    if not state_path.exists():
        return 0
    st = torch.load(state_path)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    if log_path.exists():
        rows = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= st["step"]]
        log_path.write_text("".join(r + "\n" for r in rows))
    return st["step"]


def save_loss_plot(log_path: Path, png: Path) -> bool:
    """The training and evaluation loss of a train_log.jsonl as a PNG (False without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not Path(log_path).exists():  # no step run (steps=0: an evaluation of the starting weights)
        return False
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in rows]
    # a running mean over 50 steps: single batches are noisy
    loss = np.convolve([r["loss"] for r in rows], np.ones(50) / 50, mode="valid") if len(rows) >= 50 else \
        [r["loss"] for r in rows]
    ax.plot(steps[len(steps) - len(loss):], loss, label="training loss (50-step mean)")
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted cross-entropy (nats)")
    ax.legend()
    ax.set_title(f"{Path(log_path).parent.name}: {steps[-1]} steps")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def _optimize(name: str, model, opt, step: int, steps: int, lr: float, warmup: int, step_loss, eval_every: int,
              on_eval, log_path: Path, quiet: bool) -> int:
    """The loop both trainers run from ``step`` to ``steps``: cosine learning rate (warmup capped at a
    tenth of the run), clipped gradients of ``step_loss()``, a progress bar and a JSONL row per step;
    every ``eval_every`` steps and at the end ``on_eval(row, step)`` adds its metrics and saves."""
    bar = tqdm(total=steps, initial=step, desc=name, disable=quiet)
    t0 = time.time()
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, warmup=min(warmup, steps // 10 + 1))
        loss = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        row = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)}
        if step % eval_every == 0 or step == steps:
            on_eval(row, step)
        _log(log_path, **row)
    bar.close()
    return step


def _save_state(path: Path, model, opt, step: int, extra: dict | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, **(extra or {})}, tmp)
    tmp.replace(path)  # atomic: an interrupted save never loses the previous state


def encode_corpus(tokenizer_json: Path, split: str, eos_id: int) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    for enc in tok.encode_batch(read_text(stdlib_files(split)), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int32)


# ------------------------------------------------------------------------------------------- target
def train_target(out_dir, tokenizer_json, *, steps=6000, batch=16, seq=256, lr=2e-3, seed=0,
                 config_overrides=None, resume=True, eval_every=500, threads=None, quiet=False) -> dict:
    """Next-token training on the stdlib (held-out modules excluded); returns final metrics."""
    from tokenizers import Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    n_tok = tok.get_vocab_size()
    vocab = (n_tok + 1 + 63) // 64 * 64  # padded like Qwen's; row n_tok is the unused mask row
    cfg = target_config(vocab, eos_id=bos, bos_id=bos, **(config_overrides or {}))
    torch.manual_seed(seed)
    model = Qwen3LM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    state_path, log_path = out / "train_state.pt", out / "train_log.jsonl"
    step = _resume(state_path, log_path, model, opt) if resume else 0
    train_ids = torch.from_numpy(encode_corpus(tokenizer_json, "train", bos).astype(np.int64))
    eval_ids = torch.from_numpy(encode_corpus(tokenizer_json, "eval", bos).astype(np.int64))
    gen = torch.Generator().manual_seed(seed + step)

    def batch_of(data):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s: s + seq + 1] for s in starts])
        return x[:, :-1], x[:, 1:]

    def held_out_loss(n=8):
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
                      for x, y in (batch_of(eval_ids) for _ in range(n))]
        model.train()
        return float(np.mean(losses))

    def step_loss():
        x, y = batch_of(train_ids)
        return F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())

    def on_eval(row, step):
        row["held_out_loss"] = round(held_out_loss(), 4)
        _save_state(state_path, model, opt, step)

    step = _optimize("train-target", model, opt, step, steps, lr, 200, step_loss, eval_every, on_eval, log_path,
                     quiet)
    final = {"held_out_loss": held_out_loss(16), "steps": step, "n_params": sum(p.numel() for p in model.parameters())}
    save_target(model, out, Path(tokenizer_json), stop_ids=[eos, bos])
    (out / "train_result.json").write_text(json.dumps(final, indent=2) + "\n")
    return final


def load_torch_target(target) -> Qwen3LM:
    """A target as a trainable-layout torch module (fp32), for drafter data and training: a checkpoint
    directory (Qwen3 or Llama, safetensors) or a GGUF file (dequantized to fp32)."""
    from safetensors.torch import load_file

    from .gguf import is_gguf, read_gguf

    if is_gguf(target):
        ck = read_gguf(target, "float32", with_tokenizer=False)
        cfg, state = ck.config, {k: torch.from_numpy(np.array(v, np.float32)) for k, v in ck.tensors.items()}
    else:
        target = Path(target)
        cfg = json.loads((target / "config.json").read_text())
        state = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    model = Qwen3LM(cfg)
    if cfg.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.eval()


def _target_tokenizer(target):
    """(tokenizers.Tokenizer, chat template or None) of a checkpoint directory or GGUF file."""
    from tokenizers import Tokenizer

    from .gguf import is_gguf, read_gguf_tokenizer
    from .tokenizer import chat_template_of

    if is_gguf(target):
        return read_gguf_tokenizer(target)
    return Tokenizer.from_file(str(Path(target) / "tokenizer.json")), chat_template_of(target)


def fast_bf16() -> bool:
    """torch's bf16 matmuls are fast here (AVX512-BF16 / AMX oneDNN); on AVX2 they are ~100x slower."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# ------------------------------------------------------------------------------------------ drafter
def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the kernel.

    A drafter training step allocates and frees tens of MB of activations; by default glibc maps
    each such block afresh and unmaps it on free, so every step page-faults its working set in again
    (half of the process's CPU time was system time). Blocks up to 32 MiB now come from the heap,
    whose top is kept: 0.74 against 1.20 s a step (SmolLM2-135M drafter, batch 8, 2 threads, Intel
    Xeon with AMX; the same run with MALLOC_MMAP_THRESHOLD_ etc. set, same losses). Process-wide and
    harmless elsewhere; returns False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 16 << 30)
                and mallopt(M_TOP_PAD, 1 << 30))


@contextlib.contextmanager
def _cast_once(model: torch.nn.Module):
    """Inside one autocast region, cast each weight to bf16 once, not at every matmul.

    autocast keeps its casts of leaf tensors that require grad (and only those), so the frozen
    target's weights are marked as requiring grad for the duration; under torch.no_grad nothing is
    recorded. Generating drafter data (SmolLM2-135M, 64 rows) spent a tenth of each decode step
    re-casting the weights."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


@torch.no_grad()
def generate_drafter_data(target: Qwen3LM, prompts: list, new_tokens: int, taps: list[int], batch: int = 32,
                          stop_ids=(), bf16: bool = False, quiet: bool = False, sampled: float = 0.0,
                          temperature: float = 0.7, seed: int = 0, checkpoint: Path | None = None,
                          checkpoint_every_s: float = 600.0) -> dict:
    """The target's own continuations of ``prompts`` (lists of token ids, any lengths) and its tap
    features at every position, captured while generating (training never runs the target again).

    Continuations are greedy, except for a ``sampled`` fraction of the prompts (chosen at random by
    ``seed``), which are sampled at ``temperature``: the text a drafter meets when the user samples.

    Returns {"tokens" (N, L) int64, "length" (N,) valid tokens per row (up to and including the first
    stop id), "prompt_len" (N,), "sampled" (N,) bool, "feats" (N, L, len(taps) * H) bfloat16,
    "final" (N, L, H) bfloat16: the target's final-normed hidden state, whose LM-head logits are
    its distribution for the next token (the distillation targets)}; rows are left-aligned, zero past
    their length. bf16: run the target under bf16 autocast (fast where fast_bf16()).

    checkpoint: a file the batches done so far are saved to, at most every checkpoint_every_s
    seconds; a later call with the same arguments resumes from it (it holds the sampling generator's
    state too, so the result equals an uninterrupted run's). Generating SmolLM2's 3000 sequences
    takes most of an hour on 2 cores: an interrupted sitting keeps what it made.
    """
    if not 0.0 <= sampled <= 1.0:
        raise ValueError(f"sampled must be a fraction in [0, 1], got {sampled!r}")
    if sampled and not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature!r}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    longest = max(len(p) for p in prompts)
    H = target.cfg["hidden_size"]
    last = target.cfg["num_hidden_layers"] - 1  # its tap is final-normed (Qwen3LM.forward)
    read = list(taps) + [last]
    n = len(prompts)
    gen = torch.Generator().manual_seed(seed)
    is_sampled = torch.rand(n, generator=gen) < sampled
    tokens = torch.zeros(n, longest + new_tokens, dtype=torch.int64)
    feats = torch.zeros(n, longest + new_tokens, len(taps) * H, dtype=torch.bfloat16)
    final = torch.zeros(n, longest + new_tokens, H, dtype=torch.bfloat16)
    length, prompt_len = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    stops = torch.tensor(sorted(set(stop_ids)) or [-1])
    key = [n, new_tokens, list(taps), batch, sampled, temperature, seed, sorted(set(stop_ids)),
           sum(len(p) for p in prompts)]
    done = 0
    if checkpoint is not None and Path(checkpoint).exists():
        part = torch.load(checkpoint)
        if part.get("key") != key:
            raise ValueError(f"{checkpoint}: partial drafter data of another run ({part.get('key')}, this one "
                             f"{key}); delete it to start over")
        done = part["done"]
        tokens, feats, final, length, prompt_len = (part[k] for k in ("tokens", "feats", "final", "length",
                                                                      "prompt_len"))
        gen.set_state(part["rng"])
    saved_at = time.monotonic()
    for i in tqdm(range(done, n, batch), desc="drafter data", disable=quiet, initial=done // batch,
                  total=-(-n // batch)):
        rows = order[i: i + batch]
        P = max(len(prompts[r]) for r in rows)
        pad = torch.tensor([P - len(prompts[r]) for r in rows])
        x = torch.zeros(len(rows), P, dtype=torch.int64)
        for j, r in enumerate(rows):
            x[j, pad[j]:] = torch.as_tensor(prompts[r])
        sample_rows = is_sampled[rows]
        seqs, tapped_all = [x], []
        # autocast runs attention in bf16: a bf16 cache holds the very values it would cast each step
        cache = target.new_cache(len(rows), P + new_tokens, torch.bfloat16 if bf16 else torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), _cast_once(target):
            logits, tapped, cache = target(x, cache=cache, taps=read, pad=pad, last_only=True)
            tapped_all.append(torch.cat(tapped, -1))
            for _ in range(new_tokens):
                last_logits = logits[:, -1].float()
                nxt = last_logits.argmax(-1, keepdim=True)
                if sample_rows.any():
                    drawn = torch.multinomial(torch.softmax(last_logits[sample_rows] / temperature, -1), 1,
                                              generator=gen)
                    nxt[sample_rows] = drawn
                seqs.append(nxt)
                logits, tapped, cache = target(nxt, cache=cache, taps=read, pad=pad, last_only=True)
                tapped_all.append(torch.cat(tapped, -1))
        seq, ft = torch.cat(seqs, 1), torch.cat(tapped_all, 1).to(torch.bfloat16)
        for j, r in enumerate(rows):
            p = int(pad[j])
            out = seq[j, P:]
            hit = torch.isin(out, stops).nonzero()
            valid = P - p + (int(hit[0]) + 1 if len(hit) else new_tokens)
            tokens[r, :valid] = seq[j, p: p + valid]
            feats[r, :valid] = ft[j, p: p + valid, :-H]
            final[r, :valid] = ft[j, p: p + valid, -H:]
            length[r], prompt_len[r] = valid, P - p
        if checkpoint is not None and i + batch < n and time.monotonic() - saved_at >= checkpoint_every_s:
            tmp = Path(checkpoint).with_suffix(".tmp")
            torch.save({"key": key, "done": i + batch, "tokens": tokens, "feats": feats, "final": final,
                        "length": length, "prompt_len": prompt_len, "rng": gen.get_state()}, tmp)
            tmp.replace(checkpoint)  # whole or not at all: an interrupted save leaves the last one
            saved_at = time.monotonic()
    return {"tokens": tokens, "length": length, "prompt_len": prompt_len, "sampled": is_sampled, "feats": feats,
            "final": final}


def _init_drafter(drafter, src: Path, taps: list[int]) -> None:
    """Load a saved drafter's weights (bf16 safetensors) into the trainable module, checking its taps.

    The module may have more layers than the checkpoint: the extra ones start as identities."""
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    src_taps = cfg.get("dflash_config", {}).get("target_layer_ids")
    if src_taps != taps:
        raise ValueError(f"{src / 'config.json'}: target_layer_ids {src_taps} != {taps} for this target")
    state = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}
    n_src = cfg.get("num_hidden_layers", len(drafter.layers))
    grown = range(n_src, len(drafter.layers)) if 0 < n_src < len(drafter.layers) else range(0)
    # a deeper drafter grows from a shallower one: the source's layers come first, and each new layer
    # starts as the identity (its attention and MLP outputs zeroed), so training starts from exactly
    # the source's drafts
    new = {f"layers.{i}.{name}" for i in grown for name in drafter.layers[i].state_dict()}
    state.update({k: v for k, v in drafter.state_dict().items() if k in new})
    try:
        drafter.load_state_dict(state)  # strict: names missing, unexpected or of another shape
    except RuntimeError as err:
        raise ValueError(f"{src / 'model.safetensors'}: does not match the drafter: {err}") from None
    with torch.no_grad():
        for i in grown:
            drafter.layers[i].self_attn.o_proj.weight.zero_()
            drafter.layers[i].mlp.down_proj.weight.zero_()


def _drafter_prompts(tok, template, source: str, n: int, prompt_len: int, eos_id: int, seed: int):
    """Prompt token ids for drafter data: "stdlib" (random corpus windows of prompt_len tokens) or
    "chat" (model/prompts.py user messages through the target's chat template)."""
    if source == "stdlib":
        enc = tok.encode_batch(read_text(stdlib_files("train")), add_special_tokens=False)
        corpus = [t for e in enc for t in (*e.ids, eos_id)]
        rnd = random.Random(seed)
        return [corpus[s: s + prompt_len] for s in (rnd.randrange(len(corpus) - prompt_len) for _ in range(n))]
    if source == "chat":
        from .prompts import chat_prompts
        from .tokenizer import render_chat

        texts = [render_chat(m, template=template) for m in chat_prompts("train", n, seed)]
        return [e.ids[-4 * prompt_len:] for e in tok.encode_batch(texts, add_special_tokens=False)]
    raise ValueError(f"prompts must be 'stdlib' or 'chat', got {source!r}")


def _training_vocab(spec, min_count: int, data: dict, n_eval: int, tcfg: dict, out: Path):
    """The drafting vocabulary train_drafter trains over (sorted int64 ids, saved to out), or None."""
    from . import draft_vocab as dv

    if spec is None:
        return None
    V = tcfg["vocab_size"]
    if spec != "measure":
        ids = dv.read(spec, V)
        source = f"{Path(spec).name}, given to train-drafter"
        counted = 0
    else:
        if min_count < 1:
            raise ValueError(f"draft_vocab_min_count must be >= 1, got {min_count}")
        counts = torch.zeros(V, dtype=torch.int64)
        for r in range(n_eval, data["tokens"].shape[0]):  # the training rows only
            cont = data["tokens"][r, int(data["prompt_len"][r]): int(data["length"][r])]
            counts += torch.bincount(cont, minlength=V)
        eos = tcfg.get("eos_token_id")
        stops = set(eos if isinstance(eos, list) else [eos]) - {None}
        ids = sorted(set(torch.nonzero(counts >= min_count).flatten().tolist()) | stops)
        counted = int(counts.sum())
        source = (f"tokens written at least {min_count} times in the target's continuations of train-drafter's "
                  f"training rows ({counted} tokens), and the stop token")
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    dv.write(out / dv.FILE, ids, vocab_size=V, source=source, tokens_counted=counted)
    return torch.from_numpy(ids)


def mask_token_id(cfg: dict, tok) -> int:
    """The block's mask token: an unused padded embedding row when the embedding has one, else the
    highest-id special token that is not bos / eos / pad (SmolLM2: <empty_output>, id 16)."""
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    if cfg["vocab_size"] > n_tok:
        return cfg["vocab_size"] - 1
    reserved = {cfg.get("bos_token_id"), cfg.get("eos_token_id"), cfg.get("pad_token_id"), 0}
    special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special and i not in reserved]
    if not special:
        raise ValueError("no unused embedding row or special token to serve as the mask token")
    return max(special)


def train_drafter(out_dir, target_dir, *, steps=3000, layers=1, block_size=16, batch=8, anchors=16,
                  prompt_len=64, new_tokens=192, n_sequences=2048, lr=6e-4, seed=0, resume=True,
                  threads=None, quiet=False, init_from=None, taps=None, prompts="stdlib", bf16=None,
                  distill: float = 0.0, sampled: float = 0.0, sample_temperature: float = 0.7,
                  draft_vocab: str | None = None, draft_vocab_min_count: int = 2) -> dict:
    """DFlash drafter on the target's own continuations: random anchors, block mask, decayed loss.

    target_dir: a checkpoint directory or a GGUF file. prompts: "stdlib" (corpus windows of
    prompt_len tokens, the shipped stdlib pair) or "chat" (generated user messages through the
    target's chat template; continuations stop at the target's eos). init_from: a drafter checkpoint
    directory to start from (fine-tuning); ignored when resuming. taps: target layer ids to read
    (default: the default rule, docs/dflash.md 6). bf16: data generation and training under bf16
    autocast (default: where torch's bf16 matmuls are fast, fast_bf16()).

    distill: the weight of distillation in the loss, in [0, 1]: (1 - distill) x cross-entropy to the
    continuation's tokens + distill x soft cross-entropy to the target's own next-token distribution at
    each drafted position (its LM head on its final hidden state, stored with the data). The hard labels
    only say which token the target chose; the distribution also says how likely the others were,
    which is what sampled drafts are accepted by (acceptance min(1, p/q), docs/dflash.md 4).
    sampled: the fraction of continuations sampled at sample_temperature instead of greedy, so the
    drafter also sees the text that sampling produces (generate_drafter_data).

    draft_vocab: train the drafter to choose among a drafting vocabulary (model/draft_vocab.py) only,
    as it will at inference: None (the whole vocabulary), a draft_vocab.json, or "measure": the
    tokens that occur at least draft_vocab_min_count times in the training rows' continuations, plus
    the stop token. The loss then runs over that subset's logits (SmolLM2: 49152 -> a few thousand
    rows of the LM head, most of a step's time) and skips labels outside it, which drafting can never
    propose; the set is saved beside the drafter as draft_vocab.json.
    """
    if not 0.0 <= distill <= 1.0:
        raise ValueError(f"distill must be a weight in [0, 1], got {distill!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()
    bf16 = fast_bf16() if bf16 is None else bool(bf16)
    target = load_torch_target(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.cfg
    n_layers_t = tcfg["num_hidden_layers"]
    if taps is None:
        taps = default_taps(n_layers_t, layers)
    taps = [int(i) for i in taps]
    if not taps or any(not 0 <= i < n_layers_t for i in taps):
        raise ValueError(f"taps must be target layer ids in [0, {n_layers_t}), got {taps}")
    tok, template = _target_tokenizer(target_dir)
    mask_id = mask_token_id(tcfg, tok)
    dcfg = {k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta")}
    dcfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg, n_taps=len(taps))
    data_path = out / "drafter_data.pt"
    if not data_path.exists():
        eos = tcfg.get("eos_token_id")
        eos = eos if isinstance(eos, int) else tcfg.get("bos_token_id", 0)
        ids = _drafter_prompts(tok, template, prompts, n_sequences, prompt_len, eos, seed)
        stops = (eos,) if prompts == "chat" else ()
        partial = out / "drafter_data.partial.pt"
        fresh = generate_drafter_data(target, ids, new_tokens, taps, batch=128, stop_ids=stops, bf16=bf16,
                                      quiet=quiet, sampled=sampled, temperature=sample_temperature, seed=seed,
                                      checkpoint=partial)
        fresh.update(taps=taps, sampled_fraction=sampled, sample_temperature=sample_temperature)
        torch.save(fresh, data_path)
        partial.unlink(missing_ok=True)
        del fresh  # read back memory-mapped below, like a resumed run's
    # memory-mapped, fresh data too: the features are read from the page cache as batches need them
    # (SmolLM2's 6000 continuations are 11.5 GB; held in memory beside training they ran out of 24 GB)
    data = torch.load(data_path, mmap=True)
    if data.get("taps") != taps:
        raise ValueError(f"{data_path}: features of target layers {data.get('taps')}, not {taps}; "
                         "delete it to regenerate")
    made_with = (data.get("sampled_fraction", 0.0), data.get("sample_temperature", sample_temperature))
    if made_with != (sampled, sample_temperature) or (distill and "final" not in data):
        raise ValueError(f"{data_path}: made with sampled={made_with[0]}, temperature={made_with[1]}"
                         f"{'' if 'final' in data else ', without the target distributions'}; this run asks "
                         f"for sampled={sampled}, temperature={sample_temperature}"
                         f"{', distill' if distill else ''}: delete it to regenerate")
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    state_path, log_path = out / "train_state.pt", out / "train_log.jsonl"
    step = _resume(state_path, log_path, drafter, opt) if resume else 0
    if step == 0 and init_from is not None:
        _init_drafter(drafter, Path(init_from), taps)
    elif step == 0:
        # the drafter's rows go through the target's LM head: start its final norm at the target's, so
        # the first logits have the target's scale (a unit norm gave SmolLM2 an initial loss of 44 nats)
        with torch.no_grad():
            drafter.norm.weight.copy_(target.model.norm.weight)
    weights = block_loss_weights(block_size)
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    n_all = data["tokens"].shape[0]
    n_eval = max(1, n_all // 16)
    vocab = _training_vocab(draft_vocab, draft_vocab_min_count, data, n_eval, tcfg, out)
    head = lm_head if vocab is None else lm_head[vocab]  # the rows drafting chooses among
    to_sub = None
    if vocab is not None:  # target id -> row of head, -1 outside the drafting vocabulary
        to_sub = torch.full((lm_head.shape[0],), -1, dtype=torch.int64)
        to_sub[vocab] = torch.arange(len(vocab))
    gen = torch.Generator().manual_seed(seed + step)
    offs = torch.arange(block_size)

    def batch_loss(idx: torch.Tensor, teacher_needed: bool = False):
        """(loss, greedy hits (B, N, Bk-1), the target's logits at the drafted positions or None)"""
        rows, length, plen = data["tokens"][idx], data["length"][idx], data["prompt_len"][idx]
        feats = data["feats"][idx].float()  # (B, L, n*H)
        B, L = rows.shape
        # anchors inside the continuation so the block predicts the target's own output; a block may
        # run past the row's end, where its labels are masked
        lo = (plen - 1).clamp(min=0)
        span = (length - 1 - lo).clamp(min=1)
        anc = lo[:, None] + (torch.rand(B, anchors, generator=gen) * span[:, None]).long()  # (B, N)
        pos = (anc[..., None] + offs).clamp(max=L - 1).flatten(1)  # (B, N*Bk)
        ids = torch.full_like(pos, mask_id)
        ids.view(B, anchors, block_size)[..., 0] = torch.gather(rows, 1, anc)
        valid = ((anc[..., None] + offs) < length[:, None, None])[..., 1:].float()  # (B, N, Bk-1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden = drafter(F.embedding(ids, embed), pos, feats, anc)
            logits = F.linear(hidden.view(B, anchors, block_size, -1)[:, :, 1:], head)
        logits = logits.float()
        labels = torch.gather(rows, 1, pos).view(B, anchors, block_size)[..., 1:]
        if to_sub is not None:
            labels = to_sub[labels]  # -1: a token drafting cannot propose; never accepted, not trained
        known = (labels >= 0).float()
        ce = F.cross_entropy(logits.flatten(0, 2), labels.clamp(min=0).flatten(),
                             reduction="none").view(labels.shape)
        teacher = None
        if (distill or teacher_needed) and "final" in data:
            # the target's distribution for the token at p is its LM head on its state at p - 1
            prev = (pos - 1).clamp(min=0).view(B, anchors, block_size)[..., 1:].flatten(1)
            final = data["final"][idx]
            state = torch.gather(final, 1, prev[..., None].expand(-1, -1, final.shape[-1]))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.no_grad():
                # the eval's acceptance needs the target's probabilities over the whole vocabulary;
                # training only over the drafting vocabulary, where the best q is the target's p
                # renormalised over it
                teacher = F.linear(state.float().view(B, anchors, block_size - 1, -1),
                                   lm_head if teacher_needed else head).float()
        if distill:
            sub = teacher if vocab is None or not teacher_needed else teacher[..., vocab]
            soft = -(torch.softmax(sub, -1) * torch.log_softmax(logits, -1)).sum(-1)
            ce = (1.0 - distill) * ce + distill * soft
        acc = (logits.argmax(-1) == labels).float() * valid
        w = weights * valid * known
        return (ce * w).sum() / w.sum().clamp(min=1e-6), acc, (None if teacher is None else (teacher, logits, valid))

    def tau_estimate(accept: torch.Tensor) -> float:
        # tau = tokens per round. Decoding visits an anchor once per round, so fast (long-accept)
        # stretches get few rounds: the estimate is the harmonic mean of (accepted prefix + 1) over
        # anchors, not the plain mean. On the shipped pair's own continuations: plain mean 6.6,
        # harmonic 3.2, decoding measured 4.1 (the harmonic mean is the conservative one).
        return float(1.0 / (1.0 / (accept.cumprod(-1).sum(-1) + 1)).mean())

    def eval_metrics() -> dict:
        drafter.eval()
        with torch.no_grad():
            loss, acc, dists = batch_loss(torch.arange(min(64, n_eval)), teacher_needed=True)
        drafter.train()
        out = {"eval_loss": float(loss), "eval_tau_estimate": tau_estimate(acc)}
        if dists is not None:
            # sampling at T accepts a draft with probability sum_v min(p_T(v), q_T(v)) (docs/dflash.md 4)
            teacher, logits, valid = dists
            t = sample_temperature
            p = torch.softmax(teacher / t, -1)
            if vocab is not None:
                p = p[..., vocab]  # the drafter's q is zero elsewhere
            accept = torch.minimum(p, torch.softmax(logits / t, -1)).sum(-1) * valid
            out[f"eval_tau_estimate_t{t:g}"] = tau_estimate(accept)
        return out

    def step_loss():
        return batch_loss(torch.randint(n_eval, n_all, (batch,), generator=gen))[0]

    def on_eval(row, step):
        row.update({k: round(v, 4) for k, v in eval_metrics().items()})
        _save_state(state_path, drafter, opt, step)
        save_drafter(drafter, out, tcfg, taps, mask_id, block_size)  # usable while training goes on

    step = _optimize("train-drafter", drafter, opt, step, steps, lr, 100, step_loss, 250, on_eval, log_path, quiet)
    final = {**eval_metrics(), "steps": step, "taps": taps, "distill": distill, "sampled": sampled,
             "draft_vocab": None if vocab is None else len(vocab),
             "n_params": sum(p.numel() for p in drafter.parameters())}
    save_drafter(drafter, out, tcfg, taps, mask_id, block_size)
    (out / "train_result.json").write_text(json.dumps(final, indent=2) + "\n")
    save_loss_plot(log_path, out / "loss.png")
    return final
