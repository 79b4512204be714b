"""Numba kernels for the dense ops."""

import numpy as np
from numba import njit, prange

from .._threads import numba_threads
from ._common import JIT


@njit(parallel=True, **JIT)
def _silu_and_mul(x, out):
    n = out.shape[1]
    for m in prange(out.shape[0]):  # one row per task
        for i in range(n):
            g = x[m, i]
            out[m, i] = g / (np.float32(1.0) + np.exp(-g)) * x[m, n + i]


def silu_and_mul(x, out, *, n_threads):
    with numba_threads(n_threads):
        _silu_and_mul(x, out)
