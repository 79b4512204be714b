"""Numba kernels for attention: the same algorithm as pyx/attention.pyx.

Keys are the virtual concatenation of two sources (float32 or bf16 uint16 each), query i sits at
position q_off + i and sees keys lo(i) .. hi(i). Work item = (query block, key split); inside it the
key tiles are walked once and every kv head is processed per tile (its `group` query heads packed
with the block's positions into rows), with a flash-style online softmax. Key splits depend on the
shape only and are merged in a fixed order, so results do not depend on n_threads.
"""

import numpy as np
from numba import njit, prange

from .._threads import numba_threads
from ._common import JIT, load_f32

KT = 64  # keys per tile
QROWS = 64  # packed query rows (positions x group heads) per work item
SPLIT_ITEMS = 16  # split key ranges until there are about this many work items ...
SPLIT_MIN_KEYS = 128  # ... but keep at least this many keys per split

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P = [np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                              1.6666665459e-1, 5.0000001201e-1)]
_P0, _P1, _P2, _P3, _P4, _P5 = _P


@njit(inline="always", **JIT)
def _exp_shifted(s, mx, p, pow2_bits, pow2):
    """p[c] = exp(s[c] - mx), polynomial (Cephes-style), vectorisable; arguments < -87 give 0.

    pow2_bits (int32) and pow2 (its float32 view) are scratch for 2^n built from exponent bits."""
    n = s.shape[0]
    for c in range(n):
        x = s[c] - mx
        xc = min(max(x, np.float32(-87.0)), np.float32(88.0))
        k = np.floor(xc * _LOG2E + np.float32(0.5))
        r = xc - k * _LN2_HI
        r = r - k * _LN2_LO
        q = _P0 * r + _P1
        q = q * r + _P2
        q = q * r + _P3
        q = q * r + _P4
        q = q * r + _P5
        q = q * (r * r) + r + np.float32(1.0)
        # below -87 (and -inf): 0; NaN stays NaN, as in dk_exp and IEEE (a NaN key was dropped)
        p[c] = q if x >= np.float32(-87.0) else (x if x != x else np.float32(0.0))
        pow2_bits[c] = (np.int32(k) + np.int32(127)) << np.int32(23)
    for c in range(n):
        p[c] *= pow2[c]


@njit(inline="always", **JIT)
def _exp1(x):
    """Scalar exp for the rare rescale factors (exact enough: np.exp in float32)."""
    return np.float32(np.exp(x)) if x > np.float32(-87.0) else np.float32(0.0)


@njit(inline="always", **JIT)
def _round_bf16(x, fbuf, ibuf):
    """x[:] rounded to bf16, nearest even, inf and NaN kept: the "medium" operands (queries, K, V,
    P; see pyx/dk_attention.h). fbuf: float32 scratch at least as long as x, ibuf its int32 view."""
    n = x.shape[0]
    for i in range(n):
        fbuf[i] = x[i]
    for i in range(n):
        u = ibuf[i]
        if (u & 0x7F800000) != 0x7F800000:
            ibuf[i] = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    for i in range(n):
        x[i] = fbuf[i]


@njit(inline="always", **JIT)
def _interval(t, q_off, t_kv, causal, window):
    """(lo, hi): first and last key positions visible to query t."""
    pos = q_off + t
    lo = max(0, pos - window + 1) if window > 0 else 0
    hi = pos if causal else t_kv - 1
    return lo, hi


@njit(**JIT)
def _item(item, q, k1, v1, k2, v2, out, pm, pl, pacc, q_off, causal, window, scale, qb_t, split, rows, medium):
    t_q, h_q, d = q.shape
    t1, h_kv = k1.shape[0], k1.shape[1]
    t_kv = t1 + k2.shape[0]
    group = h_q // h_kv
    dp = pacc.shape[3]
    s = item % split
    b = item // split
    t0 = b * qb_t
    nt = min(qb_t, t_q - t0)
    n_rows = nt * group
    lo_min, _ = _interval(t0, q_off, t_kv, causal, window)
    _, hi_max = _interval(t0 + nt - 1, q_off, t_kv, causal, window)
    n_tiles = (hi_max - lo_min + KT) // KT

    qp = np.zeros((h_kv, rows, d), np.float32)  # scaled queries, row r = (t - t0) * group + head
    for g in range(h_kv):
        for r in range(n_rows):
            t = t0 + r // group
            for i in range(d):
                qp[g, r, i] = q[t, g * group + r % group, i] * scale
    fbuf = np.empty(max(d, KT), np.float32)
    ibuf = fbuf.view(np.int32)
    if medium:
        for g in range(h_kv):
            for r in range(n_rows):
                _round_bf16(qp[g, r], fbuf, ibuf)
    if split == 1:
        m = np.full((h_kv, rows), -np.inf, np.float32)
        lsum = np.zeros((h_kv, rows), np.float32)
        acc = np.zeros((h_kv, rows, dp), np.float32)
    else:
        m, lsum, acc = pm[item], pl[item], pacc[item]
        m[:] = -np.inf
        lsum[:] = 0.0
        acc[:] = 0.0
    vt = np.zeros((KT, dp), np.float32)
    row = np.empty(d, np.float32)
    sc = np.empty((rows, KT), np.float32)
    pw = np.empty(KT, np.int32)
    pwf = pw.view(np.float32)

    for tile in range(s * n_tiles // split, (s + 1) * n_tiles // split):
        j0 = lo_min + tile * KT
        kn = min(KT, hi_max + 1 - j0)
        for g in range(h_kv):  # every head per tile: the tile's rows of all heads share pages
            # per key of the tile: load (and upcast) its K and V rows, S[:, c] = Q k_c as dot
            # products over D, four query rows per pass over the row; padding keys stay zero
            for c in range(kn):
                j = j0 + c
                if j < t1:
                    load_f32(k1[j, g], row)
                    load_f32(v1[j, g], vt[c, :d])
                else:
                    load_f32(k2[j - t1, g], row)
                    load_f32(v2[j - t1, g], vt[c, :d])
                if medium:
                    _round_bf16(row, fbuf, ibuf)
                    _round_bf16(vt[c, :d], fbuf, ibuf)
                for r0 in range(0, rows, 4):
                    q0, q1, q2, q3 = qp[g, r0], qp[g, r0 + 1], qp[g, r0 + 2], qp[g, r0 + 3]
                    s0 = s1 = s2 = s3 = np.float32(0.0)
                    for i in range(d):
                        x = row[i]
                        s0 += q0[i] * x
                        s1 += q1[i] * x
                        s2 += q2[i] * x
                        s3 += q3[i] * x
                    sc[r0, c], sc[r0 + 1, c], sc[r0 + 2, c], sc[r0 + 3, c] = s0, s1, s2, s3
            for c in range(kn, KT):
                vt[c, :] = 0.0
            # mask each row to its interval, online softmax
            for r in range(rows):
                srow = sc[r]
                c_lo, c_hi = 1, 0
                if r < n_rows:
                    lo, hi = _interval(t0 + r // group, q_off, t_kv, causal, window)
                    c_lo, c_hi = max(lo - j0, 0), min(hi - j0, kn - 1)
                if c_hi < c_lo:  # nothing visible here for this row
                    srow[:] = 0.0
                    continue
                srow[:c_lo] = -np.inf
                srow[c_hi + 1:] = -np.inf
                mt = np.float32(-np.inf)
                for c in range(c_lo, c_hi + 1):
                    mt = max(mt, srow[c])
                m_old = m[g, r]
                m_new = max(mt, m_old)
                _exp_shifted(srow, m_new, srow, pw, pwf)
                tot = np.float32(0.0)
                for c in range(KT):
                    tot += srow[c]
                if m_new != m_old:
                    alpha = _exp1(m_old - m_new)  # 0 on the first visible tile
                    lsum[g, r] *= alpha
                    for i in range(dp):
                        acc[g, r, i] *= alpha
                    m[g, r] = m_new
                lsum[g, r] += tot
                if medium:  # P V takes the rounded probabilities; the sum kept them exact
                    _round_bf16(srow, fbuf, ibuf)
            # acc += P V, four rows per pass over V
            for r0 in range(0, rows, 4):
                o0, o1, o2, o3 = acc[g, r0], acc[g, r0 + 1], acc[g, r0 + 2], acc[g, r0 + 3]
                for c in range(KT):
                    vv = vt[c]
                    p0, p1, p2, p3 = sc[r0, c], sc[r0 + 1, c], sc[r0 + 2, c], sc[r0 + 3, c]
                    for i in range(dp):
                        o0[i] += p0 * vv[i]
                        o1[i] += p1 * vv[i]
                        o2[i] += p2 * vv[i]
                        o3[i] += p3 * vv[i]

    if split == 1:
        for g in range(h_kv):
            for r in range(n_rows):
                inv = np.float32(1.0) / lsum[g, r]
                t = t0 + r // group
                h = g * group + r % group
                for i in range(d):
                    out[t, h, i] = acc[g, r, i] * inv


@njit(**JIT)
def _merge(unit, out, pm, pl, pacc, qb_t, split):
    """Combine the key splits of (query block, kv head) `unit` in split order."""
    t_q, h_q, d = out.shape
    h_kv = pm.shape[1]
    group = h_q // h_kv
    b, g = unit // h_kv, unit % h_kv
    t0 = b * qb_t
    nt = min(qb_t, t_q - t0)
    for r in range(nt * group):
        t = t0 + r // group
        h = g * group + r % group
        mx = np.float32(-np.inf)
        for s in range(split):
            mx = max(mx, pm[b * split + s, g, r])
        o = np.zeros(d, np.float32)
        tot = np.float32(0.0)
        for s in range(split):
            it = b * split + s
            if pl[it, g, r] == 0.0:  # this split saw no key of the row
                continue
            w = _exp1(pm[it, g, r] - mx)
            tot += w * pl[it, g, r]
            for i in range(d):
                o[i] += w * pacc[it, g, r, i]
        inv = np.float32(1.0) / tot
        for i in range(d):
            out[t, h, i] = o[i] * inv


@njit(parallel=True, **JIT)
def _attend(q, k1, v1, k2, v2, out, q_off, causal, window, scale, medium, qb_t, split, rows, dp):
    n_qb = (q.shape[0] + qb_t - 1) // qb_t
    h_kv = k1.shape[1]
    n_items = n_qb * split
    if split > 1:
        pm = np.empty((n_items, h_kv, rows), np.float32)
        pl = np.empty((n_items, h_kv, rows), np.float32)
        pacc = np.empty((n_items, h_kv, rows, dp), np.float32)
    else:  # unused placeholders: each item keeps its state locally
        pm = np.empty((1, h_kv, rows), np.float32)
        pl = np.empty((1, h_kv, rows), np.float32)
        pacc = np.empty((1, h_kv, rows, dp), np.float32)
    for it in prange(n_items):
        _item(it, q, k1, v1, k2, v2, out, pm, pl, pacc, q_off, causal, window, scale, qb_t, split, rows, medium)
    if split > 1:
        for u in prange(n_qb * h_kv):
            _merge(u, out, pm, pl, pacc, qb_t, split)


def _plan(t_q, t_kv, h_q, h_kv, d):
    """Work split, from the shape only: (query positions per item, key splits, rows, padded D)."""
    group = h_q // h_kv
    qb_t = max(1, QROWS // group)
    n_qb = -(-t_q // qb_t)
    split = 1
    if n_qb < SPLIT_ITEMS:
        split = max(1, min(-(-SPLIT_ITEMS // n_qb), t_kv // SPLIT_MIN_KEYS))
    rows = -(-(min(qb_t, t_q) * group) // 4) * 4
    dp = -(-d // 16) * 16
    return qb_t, split, rows, dp


def _run(q, k1, v1, k2, v2, out, q_off, causal, window, scale, n_threads, parts):
    t_q, h_q, d = q.shape
    plan = _plan(t_q, k1.shape[0] + k2.shape[0], h_q, k1.shape[1], d)
    with numba_threads(n_threads):
        _attend(q, k1, v1, k2, v2, out, q_off, bool(causal), 0 if window is None else int(window),
                np.float32(scale), parts == 1, *plan)


def injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, out, *, n_threads, scale, causal_block, window, parts=3):
    _run(q, k_ctx, v_ctx, k_blk, v_blk, out, k_ctx.shape[0], causal_block, window, scale, n_threads, parts)


def cached_attention(q, k_cache, v_cache, out, *, n_threads, causal, scale, window, parts=3):
    empty = k_cache[:0]
    _run(q, k_cache, v_cache, empty, empty, out, k_cache.shape[0] - q.shape[0], causal, window, scale,
         n_threads, parts)
