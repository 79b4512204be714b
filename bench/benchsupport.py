"""Benchmark helpers: pinned threads for torch, Numba and BLAS; contenders side by side.

Run: DFLASH_NUM_THREADS=2 python -m pytest bench --benchmark-enable --benchmark-columns=median,iqr,rounds
(without --benchmark-enable every benchmark runs once as a smoke test).
"""

import os

import torch

import dflash_kernels as dk
from dflash_kernels.runtime import default_threads

THREADS = default_threads()
torch.set_num_threads(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

KERNELS = [b for b in ("cython", "numba") if b in dk.available_backends()]
CONTENDERS = ["torch-peer", *KERNELS]


def record(benchmark, *, flops: float = 0.0, bytes_moved: float = 0.0, **extra):
    """Put GFLOP/s and GB/s (from the median) and the thread count into extra_info."""
    benchmark.extra_info["n_threads"] = THREADS
    benchmark.extra_info.update(extra)
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats is not None and getattr(stats, "stats", None) else None
    if median:
        if flops:
            benchmark.extra_info["GFLOP/s"] = round(flops / median / 1e9, 2)
        if bytes_moved:
            benchmark.extra_info["GB/s"] = round(bytes_moved / median / 1e9, 2)
