# cython: language_level=3
"""Cython kernels for speculative acceptance (same algorithm as dflash_kernels/_numba/acceptance.py)."""

import numpy as np

from cython.parallel cimport prange
from libc.stdint cimport int64_t

include "_sampling.pxi"


def _f32(a):
    return a if a.dtype == np.float32 else (a.astype(np.uint32) << 16).view(np.float32)


def accept_greedy(const int64_t[:, ::1] drafts, const int64_t[:, ::1] target, const int64_t[::1] num_draft,
                  int64_t[::1] num_accepted, int64_t[:, ::1] out, *, int n_threads):
    cdef Py_ssize_t b, i, a, n
    for b in range(drafts.shape[0]):
        n = num_draft[b]
        a = 0
        while a < n and drafts[b, a] == target[b, a]:  # longest matching prefix
            out[b, a] = drafts[b, a]
            a += 1
        out[b, a] = target[b, a]  # correction, or the bonus token
        for i in range(a + 1, out.shape[1]):
            out[b, i] = -1
        num_accepted[b] = a


cdef int sample_sequence(Py_ssize_t b, const int64_t[:, ::1] drafts, const wtype *logits, const wtype *q,
                         bint has_q, Py_ssize_t k, Py_ssize_t v_sz, Py_ssize_t n,
                         const double[:, :, ::1] uniforms, int64_t[::1] num_accepted, int64_t[:, ::1] out,
                         float inv_t, bint greedy, Py_ssize_t top_k, double top_p,
                         float *e, float *r, double *bsum, double *rsum) noexcept nogil:
    """Rows 0..n of sequence b until the first rejection (rows after it are never read); the status."""
    cdef Py_ssize_t i, j, x, best
    cdef int status
    cdef double total, rtotal, u, px, qx
    cdef float ex, d, qj, inv_total
    cdef bint accept
    cdef int bad
    cdef const wtype *row
    for i in range(n + 1):
        x = drafts[b, i] if i < n else -1
        row = logits + (b * (k + 1) + i) * v_sz
        load_row(row, e, v_sz)
        if greedy:  # temperature 0: p = one-hot(argmax)
            best = row_argmax(e, v_sz, &status)
            if status != OK:
                return status
            out[b, i] = best
            if best != x:
                num_accepted[b] = i
                return OK
            continue
        status = prepare_row(e, v_sz, inv_t, top_k, top_p, bsum, r, &total)
        if status != OK:
            return status
        if i == n:  # all drafts accepted: bonus token from row n
            out[b, i] = sample_row(e, v_sz, bsum, total, uniforms[b, i, 1])
            num_accepted[b] = n
            return OK
        u = uniforms[b, i, 0]
        px = e[x] / total
        if has_q:
            load_row(q + (b * k + i) * v_sz, r, v_sz)
            qx = r[x]
            if not qx >= 0:
                return BAD_Q
            accept = u * qx < px
        else:
            accept = u < px
        if accept:
            out[b, i] = x
            continue
        # residual max(0, p - q) (q one-hot: p with x removed), fallback p when it is all zero
        if has_q:
            inv_total = <float> (1.0 / total)
            bad = 0
            for j in range(v_sz):
                qj = r[j]
                bad += not qj >= 0
                d = e[j] * inv_total - qj
                r[j] = d if d > 0 else 0.0
            if bad:
                return BAD_Q
            rtotal = block_sums(r, v_sz, rsum)
            if rtotal > 0:
                out[b, i] = sample_row(r, v_sz, rsum, rtotal, uniforms[b, i, 1])
            else:
                out[b, i] = sample_row(e, v_sz, bsum, total, uniforms[b, i, 1])
        else:
            ex = e[x]
            e[x] = 0.0
            rtotal = block_sums(e, v_sz, bsum)
            if not rtotal > 0:
                e[x] = ex
                rtotal = block_sums(e, v_sz, bsum)
            out[b, i] = sample_row(e, v_sz, bsum, rtotal, uniforms[b, i, 1])
        num_accepted[b] = i
        return OK
    return OK


cdef void run_batch(const int64_t[:, ::1] drafts, const wtype[:, :, ::1] logits_v, const wtype[:, :, ::1] q_v, bint has_q,
                    Py_ssize_t v_sz, const int64_t[::1] num_draft, const double[:, :, ::1] uniforms,
                    int64_t[::1] num_accepted, int64_t[:, ::1] out, int64_t[::1] status,
                    float inv_t, bint greedy, Py_ssize_t top_k, double top_p,
                    float[:, :, ::1] scratch, double[:, :, ::1] sums) noexcept nogil:
    cdef Py_ssize_t w, b, i, n_workers = scratch.shape[0], b_sz = drafts.shape[0], k = drafts.shape[1]
    # B = 0 or k = 0: nothing to read
    cdef const wtype *logits = &logits_v[0, 0, 0] if logits_v.shape[0] else NULL
    cdef const wtype *q = &q_v[0, 0, 0] if q_v.shape[0] * q_v.shape[1] else NULL
    for w in prange(n_workers, num_threads=n_workers, schedule="static"):
        # fixed contiguous slices of the batch: the thread count cannot change a result
        for b in range(w * b_sz // n_workers, (w + 1) * b_sz // n_workers):
            for i in range(k + 1):
                out[b, i] = -1
            status[b] = sample_sequence(b, drafts, logits, q, has_q, k, v_sz, num_draft[b], uniforms,
                                        num_accepted, out, inv_t, greedy, top_k, top_p,
                                        &scratch[w, 0, 0], &scratch[w, 1, 0], &sums[w, 0, 0], &sums[w, 1, 0])


def rejection_sample(const int64_t[:, ::1] drafts, logits, draft_probs, const int64_t[::1] num_draft,
                     int64_t[::1] num_accepted, int64_t[:, ::1] out, int64_t[::1] status, *, int n_threads,
                     uniforms, double temperature, Py_ssize_t top_k, double top_p):
    cdef Py_ssize_t b_sz = logits.shape[0], v_sz = logits.shape[2]
    if b_sz == 0:
        return
    if draft_probs is not None and draft_probs.dtype != logits.dtype:  # mixed storage: compute both in fp32
        logits, draft_probs = _f32(logits), _f32(draft_probs)
    cdef Py_ssize_t n_workers = max(1, min(n_threads, b_sz))
    cdef float[:, :, ::1] scratch = np.empty((n_workers, 2, v_sz), np.float32)
    cdef double[:, :, ::1] sums = np.empty((n_workers, 2, (v_sz + BS - 1) // BS), np.float64)
    cdef const double[:, :, ::1] u = uniforms
    cdef bint greedy = temperature == 0
    cdef float inv_t = 0.0 if greedy else <float> (1.0 / temperature)
    cdef bint has_q = draft_probs is not None
    cdef const float[:, :, ::1] lf, qf
    cdef const unsigned short[:, :, ::1] lu, qu
    if logits.dtype == np.float32:
        lf = logits
        qf = draft_probs if has_q else np.zeros((1, 1, 1), np.float32)
        with nogil:
            run_batch(drafts, lf, qf, has_q, v_sz, num_draft, u, num_accepted, out, status, inv_t, greedy, top_k,
                      top_p, scratch, sums)
    else:
        lu = logits
        qu = draft_probs if has_q else np.zeros((1, 1, 1), np.uint16)
        with nogil:
            run_batch(drafts, lu, qu, has_q, v_sz, num_draft, u, num_accepted, out, status, inv_t, greedy, top_k,
                      top_p, scratch, sums)


cdef void filter_rows(const wtype *logits, Py_ssize_t t_sz, Py_ssize_t v_sz, float[:, ::1] probs,
                      const double[::1] uniforms, bint draw, int64_t[::1] tokens, int64_t[::1] status,
                      float inv_t, bint greedy, Py_ssize_t top_k, double top_p,
                      float[:, ::1] work, double[:, ::1] sums) noexcept nogil:
    cdef Py_ssize_t wk, t, j, best, n_workers = work.shape[0]
    cdef double total
    cdef float inv_total
    cdef int st
    cdef float *e
    for wk in prange(n_workers, num_threads=n_workers, schedule="static"):
        # fixed contiguous slices of the rows: the thread count cannot change a result
        for t in range(wk * t_sz // n_workers, (wk + 1) * t_sz // n_workers):
            e = &probs[t, 0]  # the row is processed in place in its output
            load_row(logits + t * v_sz, e, v_sz)
            if greedy:  # temperature 0: one-hot(argmax), first index
                st = OK
                best = row_argmax(e, v_sz, &st)
                status[t] = st
                for j in range(v_sz):
                    e[j] = 0.0
                e[best] = 1.0
                tokens[t] = best
                continue
            total = 0.0  # assigned in the loop: private to each thread (see pyx/denoise.pyx)
            st = prepare_row(e, v_sz, inv_t, top_k, top_p, &sums[wk, 0], &work[wk, 0], &total)
            status[t] = st
            if st != OK:
                continue
            tokens[t] = sample_row(e, v_sz, &sums[wk, 0], total, uniforms[t]) if draw else -1
            inv_total = <float> (1.0 / total)
            for j in range(v_sz):
                e[j] = e[j] * inv_total


def sample_filtered(logits, int64_t[::1] tokens, float[:, ::1] probs, int64_t[::1] status, *, int n_threads,
                    uniforms, double temperature, Py_ssize_t top_k, double top_p):
    cdef Py_ssize_t t_sz = logits.shape[0], v_sz = logits.shape[1]
    if t_sz == 0:
        return
    cdef Py_ssize_t n_workers = max(1, min(n_threads, t_sz))
    cdef float[:, ::1] work = np.empty((n_workers, v_sz), np.float32)
    cdef double[:, ::1] sums = np.empty((n_workers, (v_sz + BS - 1) // BS), np.float64)
    cdef bint draw = uniforms is not None
    cdef const double[::1] u = uniforms if draw else np.zeros(1, np.float64)
    cdef bint greedy = temperature == 0
    cdef float inv_t = 0.0 if greedy else <float> (1.0 / temperature)
    cdef const float[:, ::1] lf
    cdef const unsigned short[:, ::1] lu
    if logits.dtype == np.float32:
        lf = logits
        with nogil:
            filter_rows(&lf[0, 0], t_sz, v_sz, probs, u, draw, tokens, status, inv_t, greedy, top_k, top_p, work,
                        sums)
    else:
        lu = logits
        with nogil:
            filter_rows(&lu[0, 0], t_sz, v_sz, probs, u, draw, tokens, status, inv_t, greedy, top_k, top_p, work,
                        sums)
