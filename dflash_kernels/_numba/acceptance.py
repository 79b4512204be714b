"""Numba kernels for speculative acceptance, and the per-row sampling helpers denoise shares.

A processed logits row lives in a float32 scratch row `e` (V,): raw logits first, then in place the
unnormalised filtered probabilities e_i = exp((z_i - max) / temperature) (0 where filtered out),
with float64 sums per block of BS entries (`bsum`) so that an inverse-CDF draw rescans one block.
Status codes written per sequence / row: 0 ok, 1 NaN or +inf logit, 2 no finite logit, 3 NaN or
negative draft probability.
"""

import numpy as np
from numba import njit, prange

from .._threads import numba_threads
from ._common import JIT, fast_exp, load_f32

BS = 512  # entries per float64 block sum
STRIP = 64  # lanes of the vectorised max
OK, BAD_LOGIT, NO_FINITE, BAD_Q = 0, 1, 2, 3
_F32 = np.float32


@njit(**JIT)
def row_max(e, n):
    """(max, status) of e[:n]; status BAD_LOGIT on NaN or +inf, NO_FINITE when all are -inf."""
    strip = np.empty(STRIP, np.float32)  # lane-wise maxima: a plain max loop does not vectorise
    strip[:] = -np.inf
    nan = np.int32(0)
    for j in range(n // STRIP):
        blk = e[j * STRIP:(j + 1) * STRIP]
        for k in range(STRIP):
            v, s = blk[k], strip[k]
            strip[k] = v if v > s else s
            nan += np.int32(v != v)
    m = _F32(-np.inf)
    for k in range(STRIP):
        m = strip[k] if strip[k] > m else m
    for i in range(n - n % STRIP, n):
        v = e[i]
        m = v if v > m else m
        nan += np.int32(v != v)
    if nan or m == np.inf:
        return m, BAD_LOGIT
    if m == -np.inf:
        return m, NO_FINITE
    return m, OK


@njit(**JIT)
def row_argmax(src, n):
    """(first index of the max, status) of src[:n] (NaN -> BAD_LOGIT; +inf is a valid max; all -inf ->
    NO_FINITE, as the torch reference and the sampled path raise)."""
    best = -np.inf
    arg = 0
    for i in range(n):
        v = src[i]
        if v > best:
            best = v
            arg = i
        elif v != v:
            return 0, BAD_LOGIT
    if best == -np.inf:
        return arg, NO_FINITE
    return arg, OK


@njit(**JIT)
def kth_largest(e, n, k, heap):
    """The k-th largest of e[:n] (a min-heap of the k largest seen so far in heap[:k])."""
    for i in range(k):  # heapify the first k values
        heap[i] = e[i]
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(heap, i, k)
    for i in range(k, n):
        v = e[i]
        if v > heap[0]:
            heap[0] = v
            _sift_down(heap, 0, k)
    return heap[0]


@njit(**JIT)
def _sift_down(heap, i, k):
    v = heap[i]
    while True:
        c = 2 * i + 1
        if c >= k:
            break
        if c + 1 < k and heap[c + 1] < heap[c]:
            c += 1
        if heap[c] >= v:
            break
        heap[i] = heap[c]
        i = c
    heap[i] = v


@njit(**JIT)
def _exp_span(e, m, inv_t, thr):
    acc = 0.0
    for i in range(e.shape[0]):  # loops from 0 over a slice: Numba drops the wraparound checks and vectorises
        v = e[i]
        w = fast_exp((v - m) * inv_t)
        w = w if v >= thr else _F32(0.0)
        e[i] = w
        acc += np.float64(w)
    return acc


@njit(**JIT)
def exp_pass(e, n, m, inv_t, thr, bsum):
    """e_i <- exp((e_i - m) * inv_t) where e_i >= thr else 0; block sums into bsum; returns the total."""
    total = 0.0
    for j in range((n + BS - 1) // BS):
        acc = _exp_span(e[j * BS:min(n, (j + 1) * BS)], m, inv_t, thr)
        bsum[j] = acc
        total += acc
    return total


@njit(**JIT)
def _sum_span(e):
    acc = 0.0
    for i in range(e.shape[0]):
        acc += np.float64(e[i])
    return acc


@njit(**JIT)
def block_sums(e, n, bsum):
    total = 0.0
    for j in range((n + BS - 1) // BS):
        acc = _sum_span(e[j * BS:min(n, (j + 1) * BS)])
        bsum[j] = acc
        total += acc
    return total


@njit(**JIT)
def mass_threshold(e, n, target, work):
    """Largest value t among e[:n] with sum(e_i for e_i >= t) >= target (weighted quickselect)."""
    cnt = 0
    for i in range(n):  # candidates: the positive weights
        if e[i] > 0:
            work[cnt] = e[i]
            cnt += 1
    lo, hi = 0, cnt
    above = 0.0  # mass of the values already known to be greater than work[lo:hi]
    last = work[0]
    while lo < hi:
        a, b, c = work[lo], work[(lo + hi) // 2], work[hi - 1]  # median of three pivot
        piv = max(min(a, b), min(max(a, b), c))
        # three-way partition of work[lo:hi]: [> piv | == piv | < piv]
        gt, i, lt = lo, lo, hi
        g_mass = 0.0
        eq_mass = 0.0
        while i < lt:
            v = work[i]
            if v > piv:
                work[i] = work[gt]
                work[gt] = v
                gt += 1
                i += 1
                g_mass += v
            elif v < piv:
                lt -= 1
                work[i] = work[lt]
                work[lt] = v
            else:
                eq_mass += v
                i += 1
        last = piv
        if above + g_mass >= target:
            hi = gt  # the threshold lies among the greater values
        elif above + g_mass + eq_mass >= target:
            return piv
        else:
            above += g_mass + eq_mass
            lo = lt
    return last  # rounding left the target unreached: keep everything seen


@njit(**JIT)
def prepare_row(src, n, inv_t, top_k, top_p, e, bsum, work):
    """Filtered unnormalised probabilities of logits row src into e; returns (total, status)."""
    load_f32(src, e)
    m, status = row_max(e, n)
    if status != OK:
        return 0.0, status
    thr = -np.inf
    if 0 < top_k < n:
        thr = kth_largest(e, n, top_k, work)
    total = exp_pass(e, n, m, inv_t, _F32(thr), bsum)
    if top_p < 1.0:
        cut = mass_threshold(e, n, top_p * total, work)
        for i in range(n):
            if e[i] < cut:
                e[i] = _F32(0.0)
        total = block_sums(e, n, bsum)
    return total, OK


@njit(**JIT)
def sample_row(e, n, bsum, total, u):
    """Inverse CDF: first index whose running sum (index order) exceeds u * total."""
    target = u * total
    acc = 0.0
    nb = (n + BS - 1) // BS
    for j in range(nb):
        if acc + bsum[j] > target:
            for i in range(j * BS, min(n, (j + 1) * BS)):
                acc += np.float64(e[i])
                if acc > target:
                    return i
            break  # rounding: the block scan fell short, take the last positive weight
        acc += bsum[j]
    for i in range(n - 1, -1, -1):
        if e[i] > 0:
            return i
    return 0


@njit(**JIT)
def _accept_greedy(drafts, target, num_draft, num_accepted, out):
    for b in range(drafts.shape[0]):
        n = num_draft[b]
        a = 0
        while a < n and drafts[b, a] == target[b, a]:
            out[b, a] = drafts[b, a]
            a += 1
        out[b, a] = target[b, a]
        for i in range(a + 1, out.shape[1]):
            out[b, i] = -1
        num_accepted[b] = a


def accept_greedy(drafts, target, num_draft, num_accepted, out, *, n_threads):
    _accept_greedy(drafts, target, num_draft, num_accepted, out)


@njit(**JIT)
def _argmax_row(src, e, n):
    load_f32(src, e)
    return row_argmax(e, n)


@njit(**JIT)
def _sample_sequence(b, drafts, logits, q, has_q, num_draft, uniforms, num_accepted, out, status,
                     inv_t, greedy, top_k, top_p, e, r, bsum, rsum):
    """Rows 0..n of sequence b until the first rejection; rows after it are never read."""
    n = num_draft[b]
    v_sz = logits.shape[2]
    for i in range(out.shape[1]):
        out[b, i] = -1
    for i in range(n + 1):
        x = drafts[b, i] if i < n else -1
        if greedy:  # temperature 0: p = one-hot(argmax)
            best, st = _argmax_row(logits[b, i], e, v_sz)
            if st != OK:
                status[b] = st
                return
            out[b, i] = best
            if best != x:
                num_accepted[b] = i
                return
            continue
        total, st = prepare_row(logits[b, i], v_sz, inv_t, top_k, top_p, e, bsum, r)
        if st != OK:
            status[b] = st
            return
        if i == n:  # all drafts accepted: bonus token from row n
            out[b, i] = sample_row(e, v_sz, bsum, total, uniforms[b, i, 1])
            num_accepted[b] = n
            return
        u = uniforms[b, i, 0]
        px = np.float64(e[x]) / total
        if has_q:
            load_f32(q[b, i], r)
            qx = r[x]
            if not qx >= 0:
                status[b] = BAD_Q
                return
            accept = u * qx < px
        else:
            accept = u < px
        if accept:
            out[b, i] = x
            continue
        # residual max(0, p - q) (q one-hot: p with x removed), fallback p when it is all zero
        if has_q:
            inv_total = _F32(1.0 / total)
            bad = np.int32(0)
            for j in range(v_sz):
                qj = r[j]
                bad += np.int32(not qj >= _F32(0.0))
                d = e[j] * inv_total - qj
                r[j] = d if d > _F32(0.0) else _F32(0.0)
            if bad:
                status[b] = BAD_Q
                return
            rtotal = block_sums(r, v_sz, rsum)
            w, wsum = r, rsum
        else:
            ex = e[x]
            e[x] = _F32(0.0)
            rtotal = block_sums(e, v_sz, bsum)
            if not rtotal > 0.0:
                e[x] = ex
            w, wsum = e, bsum
        if rtotal > 0.0:
            out[b, i] = sample_row(w, v_sz, wsum, rtotal, uniforms[b, i, 1])
        else:
            out[b, i] = sample_row(e, v_sz, bsum, block_sums(e, v_sz, bsum), uniforms[b, i, 1])
        num_accepted[b] = i
        return


@njit(parallel=True, **JIT)
def _rejection_sample(drafts, logits, q, has_q, num_draft, uniforms, num_accepted, out, status,
                      inv_t, greedy, top_k, top_p, scratch, sums):
    n_workers = scratch.shape[0]
    b_sz = drafts.shape[0]
    for w in prange(n_workers):  # fixed contiguous slices of the batch: thread count cannot matter
        for b in range(w * b_sz // n_workers, (w + 1) * b_sz // n_workers):
            _sample_sequence(b, drafts, logits, q, has_q, num_draft, uniforms, num_accepted, out, status,
                             inv_t, greedy, top_k, top_p, scratch[w, 0], scratch[w, 1], sums[w, 0],
                             sums[w, 1])


def rejection_sample(drafts, logits, draft_probs, num_draft, num_accepted, out, status, *, n_threads,
                     uniforms, temperature, top_k, top_p):
    b_sz, _, v_sz = logits.shape
    n_workers = max(1, min(n_threads, b_sz))
    scratch = np.empty((n_workers, 2, v_sz), np.float32)
    sums = np.empty((n_workers, 2, (v_sz + BS - 1) // BS), np.float64)
    has_q = draft_probs is not None
    q = draft_probs if has_q else np.zeros((1, 1, 1), logits.dtype)
    greedy = temperature == 0
    inv_t = np.float32(0.0 if greedy else 1.0 / temperature)
    with numba_threads(n_workers):
        _rejection_sample(drafts, logits, q, has_q, num_draft, uniforms, num_accepted, out, status,
                          inv_t, greedy, int(top_k), float(top_p), scratch, sums)


@njit(parallel=True, **JIT)
def _sample_filtered(logits, tokens, probs, status, uniforms, draw, inv_t, greedy, top_k, top_p, work, sums):
    t_sz, v_sz = logits.shape
    n_workers = work.shape[0]
    for wk in prange(n_workers):  # fixed contiguous slices of the rows: thread count cannot matter
        for t in range(wk * t_sz // n_workers, (wk + 1) * t_sz // n_workers):
            e = probs[t]  # the row is processed in place in its output
            if greedy:  # temperature 0: one-hot(argmax), first index
                best, st = _argmax_row(logits[t], e, v_sz)
                status[t] = st
                e[:] = 0.0
                e[best] = 1.0
                tokens[t] = best
                continue
            total, st = prepare_row(logits[t], v_sz, inv_t, top_k, top_p, e, sums[wk], work[wk])
            status[t] = st
            if st != OK:
                continue
            tokens[t] = sample_row(e, v_sz, sums[wk], total, uniforms[t]) if draw else -1
            inv_total = np.float32(1.0 / total)
            for j in range(v_sz):
                e[j] = e[j] * inv_total


def sample_filtered(logits, tokens, probs, status, *, n_threads, uniforms, temperature, top_k, top_p):
    t_sz, v_sz = logits.shape
    if t_sz == 0:
        return
    n_workers = max(1, min(n_threads, t_sz))
    work = np.empty((n_workers, v_sz), np.float32)
    sums = np.empty((n_workers, (v_sz + BS - 1) // BS), np.float64)
    draw = uniforms is not None
    greedy = temperature == 0
    inv_t = np.float32(0.0 if greedy else 1.0 / temperature)
    with numba_threads(n_workers):
        _sample_filtered(logits, tokens, probs, status, uniforms if draw else np.zeros(1), draw, inv_t, greedy,
                         int(top_k), float(top_p), work, sums)
