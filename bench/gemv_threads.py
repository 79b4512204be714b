"""A decode step's GEMV (M = 1, packed bf16 weights) on one thread against several, alternating in one process.

The matmuls size their team by multiply-adds and by weight bytes (pyx/dk_threads.h,
``dk_matmul_threads``); this measures what the bytes rule is for. Each shape runs twice: from DRAM
(enough copies of the matrix to fill 300 MB, called in turn, as a decode step streams its layers)
and warm (one matrix called over and over, in cache). The default shapes are SmolLM2-135M's (hidden
576: q and o, k and v, gate and up, down) and the stdlib pair's:

    python bench/gemv_threads.py --threads 2 [--shapes 576x576,3072x576]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _time_calls(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def compare(n: int, k: int, threads: int, rounds: int, rng) -> dict:
    """{"dram": (t1, tn), "warm": (t1, tn)} medians in seconds per call, 1 thread and ``threads``."""
    import dflash_kernels as dk

    copies = max(2, int(300e6 // (n * k * 2)))
    ws = [dk.prepare_weight(rng.integers(0x3C00, 0x3C80, size=(n, k), dtype=np.uint16)) for _ in range(copies)]
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = {}
    for where, mats, calls in (("dram", ws, 1), ("warm", ws[:1], 500)):
        times = {1: [], threads: []}
        for _ in range(rounds):
            for nt in times:
                def step(nt=nt, mats=mats):
                    for w in mats:
                        dk.linear(x, w, n_threads=nt)
                times[nt].append(_time_calls(step, calls) / len(mats))
        out[where] = (statistics.median(times[1]), statistics.median(times[threads]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="576x576,192x576,3072x576,576x1536,768x256,256x256",
                    help="comma list of NxK (out x in)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    t = args.threads
    print(f"| N x K (KiB of bf16) | DRAM: 1 / {t} threads (us) | ratio | warm: 1 / {t} threads (us) | ratio |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        r = compare(n, k, args.threads, args.rounds, rng)
        (d1, dn), (w1, wn) = r["dram"], r["warm"]
        print(f"| {n} x {k} ({n * k * 2 // 1024}) | {d1 * 1e6:.1f} / {dn * 1e6:.1f} | {dn / d1:.3f} "
              f"| {w1 * 1e6:.2f} / {wn * 1e6:.2f} | {wn / w1:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
