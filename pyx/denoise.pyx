# cython: language_level=3
"""Cython kernels for the drafter's token choice: logits = hidden @ lm_head^T streamed over vocab tiles.

Greedy never stores the (T, V) logits: each vocab chunk keeps a running (max, argmax) per row and
the chunks are merged in index order (strict >, so the lowest index wins ties). Chunks have a fixed
size, so the result does not depend on the thread count.
"""

import numpy as np

from cython.parallel cimport prange, threadid
from libc.stdint cimport int64_t

include "_sampling.pxi"

cdef extern from "dk_threads.h" nogil:
    Py_ssize_t DK_PARALLEL_MACS
    int dk_threads(Py_ssize_t work, Py_ssize_t per_thread, int n_threads)

cdef extern from "dk_denoise.h":
    enum:
        VB "DFLASH_VB"
        HC "DFLASH_HC"
    ctypedef float v8f "dflash_v8f"
    void block_dots "dflash_block_dots"(const float *x, Py_ssize_t t_sz, Py_ssize_t h_sz, const float *wf,
                                        const unsigned short *wu, Py_ssize_t v0, Py_ssize_t nv,
                                        v8f *part, float *wbuf, float *res) nogil

cdef enum:
    CHUNK = 1032  # vocab rows per parallel task (a multiple of VB)


cdef void scan_chunk(const float *x, Py_ssize_t t_sz, Py_ssize_t h_sz, const float *wf,
                     const unsigned short *wu, Py_ssize_t v0, Py_ssize_t v1, float *scratch, float *best,
                     int64_t *arg, unsigned char *nan, float *logits, Py_ssize_t v_sz, bint store) noexcept nogil:
    """Vocab rows [v0, v1): running (max, argmax) per hidden row, or (store) the logits themselves."""
    cdef Py_ssize_t vb, nv, t, c
    cdef float val
    cdef float *res = scratch
    cdef float *wbuf = scratch + t_sz * VB
    cdef v8f *part = <v8f *> (wbuf + VB * HC)
    for t in range(t_sz):
        best[t] = -INFINITY
        arg[t] = v0
        nan[t] = 0
    vb = v0
    while vb < v1:
        nv = min(<Py_ssize_t> VB, v1 - vb)
        block_dots(x, t_sz, h_sz, wf, wu, vb, nv, part, wbuf, res)
        for t in range(t_sz):
            for c in range(nv):  # index order
                val = res[t * VB + c]
                if store:
                    logits[t * v_sz + vb + c] = val
                elif val > best[t]:
                    best[t] = val
                    arg[t] = vb + c
                elif val != val:
                    nan[t] = 1
        vb += VB


cdef void scan(const float *x, Py_ssize_t t_sz, Py_ssize_t h_sz, const float *wf, const unsigned short *wu,
               Py_ssize_t v_sz, float[:, ::1] scratch, float[:, ::1] cbest, int64_t[:, ::1] carg,
               unsigned char[:, ::1] cnan, float *logits, bint store, int n_threads) noexcept nogil:
    cdef Py_ssize_t c, n_chunks = cbest.shape[0]
    for c in prange(n_chunks, num_threads=n_threads, schedule="static"):
        scan_chunk(x, t_sz, h_sz, wf, wu, c * CHUNK, min(v_sz, (c + 1) * CHUNK), &scratch[threadid(), 0],
                   &cbest[c, 0], &carg[c, 0], &cnan[c, 0], logits, v_sz, store)


cdef void sample_rows(float[:, ::1] logits, const double[::1] uniforms, int64_t[::1] tokens,
                      int64_t[::1] status, float inv_t, Py_ssize_t top_k, double top_p,
                      float[:, ::1] work, double[:, ::1] sums) noexcept nogil:
    cdef Py_ssize_t wk, t, t_sz = logits.shape[0], v_sz = logits.shape[1], n_workers = work.shape[0]
    cdef double total
    cdef int st
    for wk in prange(n_workers, num_threads=n_workers, schedule="static"):
        for t in range(wk * t_sz // n_workers, (wk + 1) * t_sz // n_workers):
            # assigned in the loop, so Cython makes total private to each thread: passed only by
            # address it was one variable shared by the workers, and a row could be drawn against
            # another row's total (seen as irreproducible samples under the debug build)
            total = 0.0
            st = prepare_row(&logits[t, 0], v_sz, inv_t, top_k, top_p, &sums[wk, 0], &work[wk, 0], &total)
            status[t] = st
            if st == OK:
                tokens[t] = sample_row(&logits[t, 0], v_sz, &sums[wk, 0], total, uniforms[t])


def denoise_block(const float[:, ::1] hidden, lm_head, int64_t[::1] tokens, int64_t[::1] status, *,
                  int n_threads, double temperature=0.0, Py_ssize_t top_k=0, double top_p=1.0, uniforms=None):
    cdef Py_ssize_t t_sz = hidden.shape[0], h_sz = hidden.shape[1], v_sz = lm_head.shape[0]
    cdef Py_ssize_t t, c, n_chunks = (v_sz + CHUNK - 1) // CHUNK
    # the team follows the work (dk_threads.h), and no thread more than there are chunks: 16 threads
    # for the 5 chunks of a 4160-token vocabulary paid every thread's wake-up for nothing
    n_threads = dk_threads(t_sz * v_sz * h_sz, DK_PARALLEL_MACS, <int> min(<Py_ssize_t> n_threads, n_chunks))
    cdef float[:, ::1] cbest = np.empty((n_chunks, t_sz), np.float32)
    cdef int64_t[:, ::1] carg = np.empty((n_chunks, t_sz), np.int64)
    cdef unsigned char[:, ::1] cnan = np.empty((n_chunks, t_sz), np.uint8)
    # per thread: res (T, VB), wbuf (VB, HC), part (T, VB, 8)
    cdef float[:, ::1] scratch = np.empty((n_threads, t_sz * VB * 9 + VB * HC), np.float32)
    cdef bint greedy = temperature == 0
    cdef float[:, ::1] logits = np.empty((1, 1) if greedy else (int(t_sz), int(v_sz)), np.float32)
    cdef const float[:, ::1] wf
    cdef const unsigned short[:, ::1] wu
    cdef float best
    cdef Py_ssize_t n_workers
    if t_sz == 0:
        return
    if lm_head.dtype == np.float32:
        wf = lm_head
        with nogil:
            scan(&hidden[0, 0], t_sz, h_sz, &wf[0, 0], NULL, v_sz, scratch, cbest, carg, cnan, &logits[0, 0],
                 not greedy, n_threads)
    else:
        wu = lm_head
        with nogil:
            scan(&hidden[0, 0], t_sz, h_sz, NULL, &wu[0, 0], v_sz, scratch, cbest, carg, cnan, &logits[0, 0],
                 not greedy, n_threads)
    if greedy:  # merge the chunks in index order: a later chunk wins only when strictly greater
        for t in range(t_sz):
            best = -INFINITY
            tokens[t] = 0
            for c in range(n_chunks):
                if cnan[c, t]:
                    status[t] = BAD_LOGIT
                if cbest[c, t] > best:
                    best = cbest[c, t]
                    tokens[t] = carg[c, t]
        return
    n_workers = max(1, min(n_threads, t_sz))
    cdef float[:, ::1] work = np.empty((n_workers, v_sz), np.float32)
    cdef double[:, ::1] sums = np.empty((n_workers, (v_sz + BS - 1) // BS), np.float64)
    cdef const double[::1] u = uniforms
    cdef float inv_t = <float> (1.0 / temperature)
    with nogil:
        sample_rows(logits, u, tokens, status, inv_t, top_k, top_p, work, sums)
