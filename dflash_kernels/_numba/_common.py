"""Shared Numba settings and helpers for the kernels.

FASTMATH allows reassociation and contraction (vectorised reductions, FMA) but NOT nnan/ninf: the
attention masks use -inf and the sampling kernels check for NaN.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

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


@intrinsic
def bits_as_f32(typingctx, u):
    """Reinterpret the bits of a 32-bit integer as float32 (vectorises, unlike a view of an array)."""
    if not isinstance(u, types.Integer) or u.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(u), codegen


_F32 = np.float32


@njit(inline="always", **JIT)
def fast_exp(x):
    """float32 exp, the same polynomial as the Cython kernels' dk_exp (pyx/dk_exp.h): Cephes range
    reduction + degree-6 polynomial (~2 ulp); exactly 0 below -87 (and for -inf), clamped above 88,
    NaN for NaN.
    Numba's np.exp is a scalar libm call; this one vectorises."""
    xc = min(max(x, _F32(-87.0)), _F32(88.0))
    fx = np.floor(xc * _F32(1.44269504088896341) + _F32(0.5))
    r = xc - fx * _F32(0.693359375) - fx * _F32(-2.12194440e-4)
    p = _F32(1.9875691500e-4)
    p = p * r + _F32(1.3981999507e-3)
    p = p * r + _F32(8.3334519073e-3)
    p = p * r + _F32(4.1665795894e-2)
    p = p * r + _F32(1.6666665459e-1)
    p = p * r + _F32(5.0000001201e-1)
    y = p * r * r + r + _F32(1.0)
    scale = bits_as_f32(np.int32((np.int32(fx) + np.int32(127)) << np.int32(23)))
    if x >= _F32(-87.0):
        return y * scale
    return x if x != x else _F32(0.0)  # NaN stays NaN, as in dk_exp
