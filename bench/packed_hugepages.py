"""Streaming packed bf16 weights from DRAM: this library's huge-page allocation against numpy's.

    python bench/packed_hugepages.py                    # as a plain process
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python bench/packed_hugepages.py   # as in vLLM

Packs 24 random (12288, 2048) bf16 weights (1.2 GB, beyond the caches) twice: with ``pack_weight``
(its buffer from ``hugepage_empty``) and with the same values copied into ``np.empty`` memory (numpy's
own allocation, what ``pack_weight`` used before). Then times M = 1 ``linear`` over all of them,
alternating the two sets, and prints the median GB/s of each with the process's AnonHugePages.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import dflash_kernels as dk


def anon_huge_mb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("AnonHugePages"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    n, k = 12288, 2048
    huge, plain = [], []
    for _ in range(args.weights):
        pw = dk.pack_weight(torch.randn(n, k).to(torch.bfloat16))
        copy = np.empty_like(pw.data)
        copy[...] = pw.data
        huge.append(pw)
        plain.append(dk.PackedWeight.from_data(copy, (n, k)))
    x = torch.randn(1, k)
    gb = args.weights * n * k * 2 / 1e9

    def sweep(ws) -> float:
        t = time.perf_counter()
        for w in ws:
            dk.linear(x, w, precision="medium", n_threads=args.threads)
        return time.perf_counter() - t

    times = {"hugepage_empty": [], "np.empty": []}
    for _ in range(args.repeats):
        times["hugepage_empty"].append(sweep(huge))
        times["np.empty"].append(sweep(plain))
    print(f"AnonHugePages {anon_huge_mb()} MB (both sets: {2 * gb * 1e3:.0f} MB)")
    for name, ts in times.items():
        print(f"{name:15s} {gb / statistics.median(ts):5.1f} GB/s ({gb:.2f} GB per sweep)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
