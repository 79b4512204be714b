"""A GGUF target with its layers' projections kept in their blocks against the same target expanded.

Loads the shipped SmolLM2-135M-Instruct GGUF (Q4_1 layers) once per ``--loads`` entry in one process:
``gguf_dtype="blocks"`` (the kernels read the 4-bit blocks, dk_quant.h), "blocks-int8" (the same
blocks times int8 activations) and the default bf16 expansion, each with the shipped drafter, and
times greedy generation of the held-out chat prompts, autoregressive and DFlash (``-k``), alternating
the loads round by round. Prints median tokens/s per load and mode, and the ratios; checks that each
load's DFlash output equals its own autoregressive output.

    python bench/gguf_blocks.py --threads 2 --rounds 5 [--loads blocks,blocks-int8,bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _tokens_per_s(eng, prompts, max_new_tokens, k):
    """Tokens per second over the prompts (prefill included) and the token ids."""
    t0, n, ids = time.perf_counter(), 0, []
    for p in prompts:
        r = eng.generate(p, max_new_tokens, temperature=0.0, num_speculative_tokens=k)
        n += len(r.token_ids)
        ids.append(r.token_ids)
    return n / (time.perf_counter() - t0), ids


def main(argv=None) -> int:
    from dflash_kernels.model import load
    from dflash_kernels.model.benchmark import load_prompts
    from dflash_kernels.model.defaults import default_model_dirs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", default="auto", help="drafts per round for the DFlash rows (default: auto)")
    ap.add_argument("--loads", default="blocks,blocks-int8,bfloat16",
                    help="comma-separated gguf_dtype values to compare (the last is the baseline)")
    args = ap.parse_args(argv)
    k = args.k if args.k == "auto" else int(args.k)
    target, drafter = default_model_dirs("smollm2")
    loads = args.loads.split(",")
    engines = {dt: load(target, drafter, n_threads=args.threads, gguf_dtype=dt) for dt in loads}
    prompts = load_prompts(None, args.n_prompts, engines[loads[0]])
    times: dict[tuple[str, str], list[float]] = {}
    same = True
    for r in range(args.rounds):
        for dt, eng in engines.items():
            ar, ar_ids = _tokens_per_s(eng, prompts, args.max_new_tokens, 0)
            df, df_ids = _tokens_per_s(eng, prompts, args.max_new_tokens, k)
            same &= ar_ids == df_ids
            times.setdefault((dt, "ar"), []).append(ar)
            times.setdefault((dt, "dflash"), []).append(df)
        print(f"round {r + 1}: " + ", ".join(f"{dt} {m} {v[-1]:.1f}" for (dt, m), v in times.items()),
              file=sys.stderr)
    med = {key: float(np.median(v)) for key, v in times.items()}
    print(f"| load | autoregressive (tokens/s) | DFlash k={args.k} (tokens/s) | DFlash / AR |")
    print("|---|---|---|---|")
    for dt in engines:
        print(f"| {dt} | {med[dt, 'ar']:.1f} | {med[dt, 'dflash']:.1f} | {med[dt, 'dflash'] / med[dt, 'ar']:.2f}x |")
    base = loads[-1]
    for dt in loads[:-1]:
        print(f"\n{dt} / {base}: autoregressive {med[dt, 'ar'] / med[base, 'ar']:.2f}x, "
              f"DFlash {med[dt, 'dflash'] / med[base, 'dflash']:.2f}x")
    print(f"(medians of {args.rounds} alternating rounds, {len(prompts)} prompts, {args.max_new_tokens} new tokens)")
    print(f"greedy DFlash output identical to autoregressive on every load: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
