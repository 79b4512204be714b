"""Thread control shared by all kernels.

torch and Numba each carry an OpenMP runtime: ops run them at the same thread count and never
concurrently. The Cython kernels take the thread count as an argument (OpenMP prange).
"""

from __future__ import annotations

import os
from contextlib import contextmanager


def default_threads() -> int:
    """DFLASH_NUM_THREADS if set, else the number of CPUs this process may run on."""
    env = os.environ.get("DFLASH_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def resolve_threads(n_threads) -> int:
    """Validate the public `n_threads` argument; None means default_threads()."""
    if n_threads is None:
        return default_threads()
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"n_threads must be a positive int or None, got {n_threads!r}")
    return n_threads


@contextmanager
def numba_threads(n: int):
    """Run a Numba kernel with `n` threads (capped at Numba's pool size), restoring the old count."""
    import numba

    old = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(old)


@contextmanager
def torch_threads(n: int):
    """Run torch ops with `n` intra-op threads, restoring the old count."""
    import torch

    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)
