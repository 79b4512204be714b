"""Thread control shared by all kernels.

torch and Numba each carry an OpenMP runtime: ops run them at the same thread count and never
concurrently. The Cython kernels take the thread count as an argument (OpenMP prange).
"""

from __future__ import annotations

import numbers
import os
from contextlib import contextmanager


def max_threads() -> int:
    """The most threads an op accepts: 4x the CPUs of the machine. OpenMP and torch create every
    requested thread (10**6 exhausted the process and crashed it; Cython scratch is per thread), and
    more threads than cores only wait on each other."""
    return 4 * max(1, os.cpu_count() or 1)


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """DFLASH_NUM_THREADS if set, else the number of CPUs this process may run on."""
    env = os.environ.get("DFLASH_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"DFLASH_NUM_THREADS must be a positive int, got {env!r}") from None
        if not 1 <= n <= max_threads():
            raise ValueError(f"DFLASH_NUM_THREADS must lie in [1, {max_threads()}] (4x the CPUs), got {env!r}")
        return n
    return _cpus()


def resolve_threads(n_threads) -> int:
    """Validate the public `n_threads` argument (an int in [1, max_threads()]); None means
    default_threads()."""
    if n_threads is None:
        return default_threads()
    if isinstance(n_threads, bool) or not isinstance(n_threads, numbers.Integral) or n_threads < 1:
        raise ValueError(f"n_threads must be a positive int or None, got {n_threads!r}")
    if n_threads > max_threads():
        raise ValueError(f"n_threads must be at most {max_threads()} (4x the CPUs), got {n_threads!r}")
    return int(n_threads)


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
