"""Thread control shared by all kernels.

torch and Numba each carry an OpenMP runtime: ops run them at the same thread count and never
concurrently. The Cython kernels take the thread count as an argument (OpenMP prange).
"""

from __future__ import annotations

import numbers
import os
import time
from contextlib import contextmanager

from ._env import EnvSetting

_MAX_THREADS = 4 * max(1, os.cpu_count() or 1)  # read once: os.cpu_count() costs ~2.5 us per public call


def max_threads() -> int:
    """The most threads an op accepts: 4x the CPUs of the machine. OpenMP and torch create every
    requested thread (10**6 exhausted the process and crashed it; Cython scratch is per thread), and
    more threads than cores only wait on each other."""
    return _MAX_THREADS


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _parse_num_threads(env: str | None) -> int | None:
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        raise ValueError(f"DFLASH_NUM_THREADS must be a positive int, got {env!r}") from None
    if not 1 <= n <= max_threads():
        raise ValueError(f"DFLASH_NUM_THREADS must lie in [1, {max_threads()}] (4x the CPUs), got {env!r}")
    return n


_ENV_THREADS = EnvSetting("DFLASH_NUM_THREADS", _parse_num_threads)  # read on every call (cheaply)


def default_threads() -> int:
    """DFLASH_NUM_THREADS if set, else the number of CPUs this process may run on."""
    n = _ENV_THREADS.get()
    return n if n is not None else _cpus()  # the affinity is read every time: a worker may be pinned later


def resolve_threads(n_threads) -> int:
    """Validate the public `n_threads` argument (an int in [1, max_threads()]); None means
    default_threads()."""
    if type(n_threads) is int and 1 <= n_threads <= _MAX_THREADS:  # the common case, first (not bool)
        return n_threads
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


class ContentionGovernor:
    """The thread count to use now: fewer while other processes take the cores, back up when they
    leave.

    Why: an OpenMP region ends at a barrier, so with every core busy each region waits for a thread
    the OS has descheduled, and the waiting threads spin on the cores the others need: with one
    CPU-bound process beside a 2-thread decode on 2 cores, the shipped pair ran ~18x slower than at
    1 thread (docs/benchmarks.md). Passive waiting (OMP_WAIT_POLICY=passive) fixes that but halves
    the idle speed of small models, whose regions are microseconds apart.

    Signal: the calling thread's run delay, the time it was runnable but waited for a CPU (Linux
    schedstat), per second of wall time over windows of ``window_s``. Above ``busy`` the count drops
    by one. Below it, one thread more is tried after ``probe_s``, then after twice that each time a
    try finds the cores still taken (at most ``max_probe_s``). Without /proc (not Linux) the count
    stays at ``n_max``. Results never depend on the thread count, so a change is invisible but for
    speed. Each try runs a window at the contended count, which a k = 15 round of many parallel
    regions pays dearly: beside a busy process on a 2-core Zen 2, tries after 0.5 s doubling up to
    8 s left the stdlib pair's DFlash at 0.70-0.83x of ``--threads 1``; after 1 s up to 32 s,
    0.84-0.94x (docs/benchmarks.md, session 13).
    """

    def __init__(self, n_max: int, *, window_s: float = 0.1, busy: float = 0.2, probe_s: float = 1.0,
                 max_probe_s: float = 32.0, path: str = "/proc/thread-self/schedstat"):
        self.n_max, self.n = n_max, n_max
        self.window_s, self.busy, self.probe_s, self.max_probe_s = window_s, busy, probe_s, max_probe_s
        self._path = path
        self._backoff = probe_s
        self._probe_at = 0.0
        self._trying = False
        self._last = self._sample()
        self.enabled = self._last is not None and n_max > 1

    def _sample(self):
        """(wall seconds, run delay seconds) now, or None where schedstat is not available."""
        try:
            with open(self._path) as f:
                delay_ns = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return time.perf_counter(), delay_ns * 1e-9

    def update(self) -> int:
        """Read the run delay (every ``window_s`` at most) and return the thread count to use."""
        if not self.enabled or time.perf_counter() - self._last[0] < self.window_s:
            return self.n
        now = self._sample()
        if now is None:
            return self.n
        frac = (now[1] - self._last[1]) / (now[0] - self._last[0])
        self._last = now
        self.n = self.decide(self.n, frac, now[0])
        return self.n

    def decide(self, n: int, delay_frac: float, now: float) -> int:
        """The next thread count from the last window's run delay per wall second (the policy, apart
        from the clock and /proc, for tests)."""
        trying, self._trying = self._trying, False
        if delay_frac > self.busy:
            if trying:  # the last window tried one thread more and found the cores still taken
                self._backoff = min(self._backoff * 2, self.max_probe_s)
            self._probe_at = now + self._backoff
            return max(1, n - 1)
        if n < self.n_max and now >= self._probe_at:
            self._trying = True  # judged by the next window
            return n + 1
        if n == self.n_max:
            self._backoff = self.probe_s  # the cores are ours again
        return n
