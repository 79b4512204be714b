"""The kernels as the model layer calls them: ``dk.BoundOps`` (fixed n_threads, backend and
precision; the public ops' compiled fast path on the model's own buffers), with the time spent inside
counted.

``Ops.kernel_s`` accumulates wall time inside kernel calls, so the engine can report the Python
overhead of a round (round time minus kernel time).
"""

from __future__ import annotations

from time import perf_counter

import dflash_kernels as dk

from .weights import release_pages


def _timed(name: str):
    run = getattr(dk.BoundOps, name)

    def timed(self, *args, **kwargs):
        t = perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            self.kernel_s += perf_counter() - t

    timed.__name__, timed.__doc__ = name, run.__doc__
    return timed


class Ops(dk.BoundOps):
    """``dk.BoundOps`` counting the wall time inside its kernel calls (``kernel_s``), and releasing the
    pages of a memory-mapped weight once ``prepare`` has copied it."""

    def __init__(self, n_threads: int | None = None, backend: str = "auto", precision: str | None = None):
        super().__init__(n_threads, backend, precision)
        self.kernel_s = 0.0

    def with_precision(self, precision: str | None) -> Ops:
        twin = super().with_precision(precision)
        twin.kernel_s = 0.0  # each counts its own calls (Engine.kernel_seconds adds them up)
        return twin

    def prepare(self, w):
        out = super().prepare(w)
        if out is not w:
            release_pages(w)  # a memory-mapped source: its values are in the packed copy now
        return out


for _name in dk.BoundOps.OPS:  # every kernel-running method, timed
    setattr(Ops, _name, _timed(_name))
