"""Shared Numba settings and helpers for the kernels.

FASTMATH allows reassociation and contraction (vectorised reductions, FMA) but NOT nnan/ninf: the
attention masks use -inf and the sampling kernels check for NaN.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
JIT = dict(nogil=True, cache=True, fastmath=FASTMATH)


def load_f32(src, dst):  # pragma: no cover - replaced by the overload below inside jitted code
    """Copy a 1-D float32 or bf16 (uint16) row `src` into the float32 row `dst`."""
    raise NotImplementedError


@overload(load_f32, inline="always")
def _load_f32(src, dst):
    if isinstance(src, types.Array) and src.dtype == types.uint16:
        def impl(src, dst):
            u = dst.view(np.uint32)
            for i in range(src.shape[0]):
                u[i] = np.uint32(src[i]) << 16
        return impl

    def impl(src, dst):  # float32
        for i in range(src.shape[0]):
            dst[i] = src[i]
    return impl
