"""Numba kernels for the dense ops: linear (fp32 / bf16 weights), RMSNorm, RoPE, SwiGLU.

Each kernel exists twice: serial (small problems: no thread-pool wake-up) and parallel over rows.
Every output element is computed by one thread in a fixed order, so results do not depend on
n_threads. Elementwise loops are written so LLVM vectorises them: `fast_exp` is a polynomial (Numba's
np.exp is a scalar libm call), bf16 is upcast with an integer shift and a bit cast.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .._threads import numba_threads
from ._common import JIT as _JIT, bits_as_f32, fast_exp

# error_model="numpy": no zero-division checks in float divisions, which would block vectorisation.
JIT = dict(_JIT, error_model="numpy")
F32 = np.float32
PARALLEL_MACS = 1 << 18  # linear: multiply-adds below which one thread is faster
PARALLEL_ELEMS = 1 << 15  # elementwise ops: elements below which one thread is faster


def as_f32(v):  # pragma: no cover - replaced by the overload below inside jitted code
    """A weight element as float32: fp32 as is, bf16 (uint16 bits) shifted into the high half."""
    raise NotImplementedError


@overload(as_f32, inline="always")
def _as_f32(v):
    if v == types.uint16:
        return lambda v: bits_as_f32(np.uint32(np.uint32(v) << np.uint32(16)))
    return lambda v: v


# ---- SwiGLU ---------------------------------------------------------------------------------------

def _silu_and_mul_impl(x, out):
    n = out.shape[1]
    for m in prange(out.shape[0]):  # one row per task
        g, u, o = x[m, :n], x[m, n:], out[m]
        for i in range(n):
            o[i] = g[i] / (F32(1.0) + fast_exp(-g[i])) * u[i]


_silu_and_mul = (njit(**JIT)(_silu_and_mul_impl), njit(parallel=True, **JIT)(_silu_and_mul_impl))


def silu_and_mul(x, out, *, n_threads):
    with numba_threads(n_threads):
        _silu_and_mul[n_threads > 1 and out.size >= PARALLEL_ELEMS](x, out)


# ---- linear ---------------------------------------------------------------------------------------

@njit(**JIT)
def _rows4(xm, w, n0, k_len):
    """Dot products of x row xm with weight rows n0..n0+3 (vectorised along k)."""
    s0 = s1 = s2 = s3 = F32(0.0)
    for k in range(k_len):
        xv = xm[k]
        s0 += xv * as_f32(w[n0, k])
        s1 += xv * as_f32(w[n0 + 1, k])
        s2 += xv * as_f32(w[n0 + 2, k])
        s3 += xv * as_f32(w[n0 + 3, k])
    return s0, s1, s2, s3


@njit(**JIT)
def _rows4_x2(xa, xb, w, k_len):
    """2 x rows times 4 fp32 weight rows: 8 running sums share every load."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = F32(0.0)
    for k in range(k_len):
        u, v = xa[k], xb[k]
        w0, w1, w2, w3 = w[0, k], w[1, k], w[2, k], w[3, k]
        a0 += u * w0
        a1 += u * w1
        a2 += u * w2
        a3 += u * w3
        b0 += v * w0
        b1 += v * w1
        b2 += v * w2
        b3 += v * w3
    return a0, a1, a2, a3, b0, b1, b2, b3


def _linear_impl(x, w, bias, out, n_tasks):
    M, K = x.shape
    N = w.shape[0]
    groups = (N + 3) // 4
    per = (groups + n_tasks - 1) // n_tasks
    for task in prange(n_tasks):  # contiguous runs of 4-row weight groups
        panel = np.empty((4, K), np.float32)  # the group's weights in fp32, reused by every x row
        for g in range(task * per, min(groups, (task + 1) * per)):
            n0 = g * 4
            if n0 + 4 > N:  # ragged last group: one row at a time
                for n in range(n0, N):
                    for m in range(M):
                        s = F32(0.0)
                        for k in range(K):
                            s += x[m, k] * as_f32(w[n, k])
                        out[m, n] = s
            elif M <= 2:  # memory bound: read the weights once, in place
                for m in range(M):
                    s0, s1, s2, s3 = _rows4(x[m], w, n0, K)
                    out[m, n0], out[m, n0 + 1], out[m, n0 + 2], out[m, n0 + 3] = s0, s1, s2, s3
            else:  # upcast the 4 rows once, then 2 x rows at a time
                for r in range(4):
                    for k in range(K):
                        panel[r, k] = as_f32(w[n0 + r, k])
                for m in range(0, M - 1, 2):
                    a0, a1, a2, a3, b0, b1, b2, b3 = _rows4_x2(x[m], x[m + 1], panel, K)
                    oa, ob = out[m, n0:n0 + 4], out[m + 1, n0:n0 + 4]
                    oa[0], oa[1], oa[2], oa[3] = a0, a1, a2, a3
                    ob[0], ob[1], ob[2], ob[3] = b0, b1, b2, b3
                if M % 2:
                    s0, s1, s2, s3 = _rows4(x[M - 1], panel, 0, K)
                    o = out[M - 1, n0:n0 + 4]
                    o[0], o[1], o[2], o[3] = s0, s1, s2, s3
            if bias is not None:
                for m in range(M):
                    for n in range(n0, min(n0 + 4, N)):
                        out[m, n] += bias[n]


_linear = (njit(**JIT)(_linear_impl), njit(parallel=True, **JIT)(_linear_impl))


def linear(x, w, bias, out, *, n_threads, parts=3):
    if parts < 3:  # the precision's activation rounding, as the reference defines it
        import torch

        from ..reference.dense import round_activations

        x = round_activations(torch.from_numpy(x), parts).numpy()
    parallel = n_threads > 1 and x.shape[0] * x.shape[1] * w.shape[0] >= PARALLEL_MACS
    with numba_threads(n_threads):
        _linear[parallel](x, w, bias, out, 4 * n_threads if parallel else 1)


# ---- RMSNorm --------------------------------------------------------------------------------------

@njit(**JIT)
def _norm_row(v, w, offset, eps, o):
    ss = F32(0.0)
    for i in range(v.shape[0]):
        ss += v[i] * v[i]
    inv = F32(1.0) / np.sqrt(ss / F32(v.shape[0]) + eps)
    for i in range(v.shape[0]):
        o[i] = v[i] * inv * (offset + w[i])


def _rms_norm_impl(x, w, out, eps, offset):
    for m in prange(x.shape[0]):
        _norm_row(x[m], w, offset, eps, out[m])


def _rms_norm_residual_impl(x, residual, w, out, new_residual, eps, offset):
    for m in prange(x.shape[0]):
        h = new_residual[m]
        for i in range(h.shape[0]):
            h[i] = x[m, i] + residual[m, i]
        _norm_row(h, w, offset, eps, out[m])


_rms_norm = (njit(**JIT)(_rms_norm_impl), njit(parallel=True, **JIT)(_rms_norm_impl))
_rms_norm_residual = (njit(**JIT)(_rms_norm_residual_impl),
                      njit(parallel=True, **JIT)(_rms_norm_residual_impl))


def rms_norm(x, w, out, *, n_threads, eps, offset=0.0):
    with numba_threads(n_threads):
        _rms_norm[n_threads > 1 and x.size >= PARALLEL_ELEMS](x, w, out, F32(eps), F32(offset))


def rms_norm_residual(x, residual, w, out, new_residual, *, n_threads, eps, offset=0.0):
    with numba_threads(n_threads):
        _rms_norm_residual[n_threads > 1 and x.size >= PARALLEL_ELEMS](
            x, residual, w, out, new_residual, F32(eps), F32(offset))


# ---- RoPE -----------------------------------------------------------------------------------------

@njit(**JIT)
def _rope_table(positions, inv_freq):
    """cos | sin of pos * inv_freq[j] as float32 (T, 2, half); angles in float64."""
    half = inv_freq.shape[0]
    table = np.empty((positions.shape[0], 2, half), np.float32)
    for t in range(positions.shape[0]):
        for j in range(half):
            angle = np.float64(positions[t]) * inv_freq[j]
            table[t, 0, j] = np.cos(angle)
            table[t, 1, j] = np.sin(angle)
    return table


def _rope_impl(x, table, out):
    T, H, D = x.shape
    half = table.shape[2]
    for r in prange(T * H):  # one head of one token per task
        t, h = r // H, r % H
        c, s, v, o = table[t, 0], table[t, 1], x[t, h], out[t, h]
        for j in range(half):  # x' = x cos + rotate_half(x) sin
            a, b = v[j], v[j + half]
            o[j] = a * c[j] - b * s[j]
            o[j + half] = b * c[j] + a * s[j]
        for j in range(2 * half, D):
            o[j] = v[j]


_rope = (njit(**JIT)(_rope_impl), njit(parallel=True, **JIT)(_rope_impl))


def apply_rope(x, positions, out, *, n_threads, theta, rotary_dim, inv_freq=None):
    if inv_freq is None:
        inv_freq = float(theta) ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    table = _rope_table(positions, inv_freq)
    with numba_threads(n_threads):
        _rope[n_threads > 1 and x.size >= PARALLEL_ELEMS](x, table, out)
