"""Numba kernels for the drafter's token choice: logits = hidden @ lm_head^T streamed over vocab tiles.

Greedy never stores the (T, V) logits: each vocab chunk keeps a running (max, argmax) per row and the
chunks are merged in index order (strict >, so the lowest index wins ties). Chunks have a fixed
size, so the result does not depend on the thread count.
"""

import numpy as np
from numba import njit, prange

from .._threads import numba_threads
from ._common import JIT, load_f32
from .acceptance import BAD_LOGIT, BS, OK, prepare_row, sample_row

CHUNK = 1024  # vocab rows per parallel task
NT, NV = 4, 2  # register tile: 4 hidden rows x 2 vocab rows = 8 accumulators


@njit(inline="always", **JIT)
def _tile(x, wbuf, t0, t_sz, h_sz):
    """Dot products of hidden rows t0..t0+3 (clamped to the last row) with the 2 rows in wbuf."""
    x0, x1, x2, x3 = x[t0], x[min(t0 + 1, t_sz - 1)], x[min(t0 + 2, t_sz - 1)], x[min(t0 + 3, t_sz - 1)]
    w0, w1 = wbuf[0], wbuf[1]
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = np.float32(0.0)
    for h in range(h_sz):
        wa, wb = w0[h], w1[h]
        a00 += x0[h] * wa
        a01 += x0[h] * wb
        a10 += x1[h] * wa
        a11 += x1[h] * wb
        a20 += x2[h] * wa
        a21 += x2[h] * wb
        a30 += x3[h] * wa
        a31 += x3[h] * wb
    return a00, a01, a10, a11, a20, a21, a30, a31


@njit(**JIT)
def _keep_max(best, arg, nan, t, val, v):
    if val > best[t]:
        best[t] = val
        arg[t] = v
    elif val != val:
        nan[t] = 1


@njit(parallel=True, **JIT)
def _chunk_scan(x, w, cbest, carg, cnan, logits, store):
    """Per vocab chunk: running (max, argmax) per hidden row, or (store) the logits themselves."""
    t_sz, h_sz = x.shape
    v_sz = w.shape[0]
    for c in prange(cbest.shape[0]):
        wbuf = np.empty((NV, h_sz), np.float32)  # float32 copy of the vocab tile (bf16 upcast)
        best, arg, nan = cbest[c], carg[c], cnan[c]
        v_end = min(v_sz, (c + 1) * CHUNK)
        for t in range(t_sz):
            best[t] = -np.inf
            arg[t] = c * CHUNK
            nan[t] = 0
        for va in range(c * CHUNK, v_end, NV):
            vb = min(va + 1, v_end - 1)  # tail: repeat the last row (same index, same value)
            load_f32(w[va], wbuf[0])
            load_f32(w[vb], wbuf[1])
            for t0 in range(0, t_sz, NT):
                a00, a01, a10, a11, a20, a21, a30, a31 = _tile(x, wbuf, t0, t_sz, h_sz)
                t1, t2, t3 = min(t0 + 1, t_sz - 1), min(t0 + 2, t_sz - 1), min(t0 + 3, t_sz - 1)
                if store:
                    logits[t0, va], logits[t0, vb] = a00, a01
                    logits[t1, va], logits[t1, vb] = a10, a11
                    logits[t2, va], logits[t2, vb] = a20, a21
                    logits[t3, va], logits[t3, vb] = a30, a31
                else:  # index order inside the tile: va before vb
                    _keep_max(best, arg, nan, t0, a00, va)
                    _keep_max(best, arg, nan, t0, a01, vb)
                    _keep_max(best, arg, nan, t1, a10, va)
                    _keep_max(best, arg, nan, t1, a11, vb)
                    _keep_max(best, arg, nan, t2, a20, va)
                    _keep_max(best, arg, nan, t2, a21, vb)
                    _keep_max(best, arg, nan, t3, a30, va)
                    _keep_max(best, arg, nan, t3, a31, vb)


@njit(**JIT)
def _merge(cbest, carg, cnan, tokens, status):
    """Chunks in index order; a later chunk wins only when strictly greater."""
    for t in range(tokens.shape[0]):
        best = -np.inf
        tokens[t] = 0
        for c in range(cbest.shape[0]):
            if cnan[c, t]:
                status[t] = BAD_LOGIT
            if cbest[c, t] > best:
                best = cbest[c, t]
                tokens[t] = carg[c, t]


@njit(parallel=True, **JIT)
def _sample_rows(logits, uniforms, tokens, status, inv_t, top_k, top_p, work, sums):
    t_sz, v_sz = logits.shape
    n_workers = work.shape[0]
    for wk in prange(n_workers):
        for t in range(wk * t_sz // n_workers, (wk + 1) * t_sz // n_workers):
            e = logits[t]  # processed in place
            total, st = prepare_row(e, v_sz, inv_t, top_k, top_p, e, sums[wk], work[wk])
            status[t] = st
            if st == OK:
                tokens[t] = sample_row(e, v_sz, sums[wk], total, uniforms[t])


def denoise_block(hidden, lm_head, tokens, status, *, n_threads, temperature=0.0, top_k=0, top_p=1.0,
                  uniforms=None):
    t_sz = hidden.shape[0]
    v_sz = lm_head.shape[0]
    n_chunks = (v_sz + CHUNK - 1) // CHUNK
    cbest = np.empty((n_chunks, t_sz), np.float32)
    carg = np.empty((n_chunks, t_sz), np.int64)
    cnan = np.empty((n_chunks, t_sz), np.uint8)
    greedy = temperature == 0
    logits = np.empty((t_sz, v_sz) if not greedy else (1, 1), np.float32)
    with numba_threads(n_threads):
        _chunk_scan(hidden, lm_head, cbest, carg, cnan, logits, not greedy)
        if greedy:
            _merge(cbest, carg, cnan, tokens, status)
            return
        n_workers = max(1, min(n_threads, t_sz))
        work = np.empty((n_workers, v_sz), np.float32)
        sums = np.empty((n_workers, (v_sz + BS - 1) // BS), np.float64)
    with numba_threads(n_workers):
        _sample_rows(logits, uniforms, tokens, status, np.float32(1.0 / temperature), int(top_k),
                     float(top_p), work, sums)
