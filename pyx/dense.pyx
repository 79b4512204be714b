# cython: language_level=3
"""Cython kernels for the dense ops: linear (fp32 / bf16 weights), RMSNorm, RoPE, SwiGLU.

The inner loops live in the C block below, written with GCC vector extensions so that the register
blocking is explicit and one source compiles to AVX2 (8-float ymm) or AVX-512 (16-float zmm). The
Cython functions validate nothing (the public wrappers do), split the work over OpenMP threads and
own the per-thread scratch. Every output element is computed by one thread in a fixed order, so
results do not depend on n_threads.
"""

import os

from cython.parallel cimport parallel, prange
from libc.math cimport cos, pow, sin, sqrtf
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cdef extern from * nogil:
    """
    #include <stdint.h>
    #include <string.h>

    #if defined(__AVX512F__)
    #define DK_VW 16  /* floats per vector register */
    #else
    #define DK_VW 8
    #endif
    /* Register tile: DK_MR x rows times DK_NR weight rows, DK_MR * DK_NR vector accumulators */
    #ifndef DK_MR
    #if DK_VW == 16
    #define DK_MR 4   /* 4 x 4 = 16 of 32 zmm */
    #else
    #define DK_MR 3   /* 3 x 4 = 12 of 16 ymm */
    #endif
    #endif
    #ifndef DK_NR
    #define DK_NR 4
    #endif
    #ifndef DK_KC
    #define DK_KC 512    /* K chunk: a DK_NR x DK_KC fp32 weight panel stays in L1 */
    #endif
    #define DK_MB 64     /* x rows per block: the block's x stays in L2 while W streams */
    #define DK_AI static inline __attribute__((always_inline))

    typedef float dk_vf __attribute__((vector_size(4 * DK_VW)));
    typedef uint32_t dk_vu __attribute__((vector_size(4 * DK_VW)));
    typedef uint16_t dk_vh __attribute__((vector_size(2 * DK_VW)));
    typedef int32_t dk_vi __attribute__((vector_size(4 * DK_VW)));

    DK_AI dk_vf dk_load(const float *p) { dk_vf v; memcpy(&v, p, sizeof v); return v; }
    DK_AI void dk_store(float *p, dk_vf v) { memcpy(p, &v, sizeof v); }
    /* bf16 -> fp32 is exact: a bf16 is the high half of an fp32 */
    DK_AI dk_vf dk_load_bf16(const uint16_t *p) {
        dk_vh h; memcpy(&h, p, sizeof h);
        return (dk_vf)(__builtin_convertvector(h, dk_vu) << 16);
    }
    DK_AI float dk_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
    /* element i of a weight matrix stored as fp32 (bf16 = 0) or bf16 bit patterns (bf16 = 1) */
    DK_AI dk_vf dk_load_w(const void *w, long i, int bf16) {
        return bf16 ? dk_load_bf16((const uint16_t *)w + i) : dk_load((const float *)w + i);
    }
    DK_AI float dk_w(const void *w, long i, int bf16) {
        return bf16 ? dk_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
    }
    DK_AI const void *dk_wrow(const void *w, long i, int bf16) {
        return (const char *)w + i * (bf16 ? 2 : 4);
    }
    DK_AI float dk_hsum(dk_vf v) { float s = 0.0f; for (int i = 0; i < DK_VW; i++) s += v[i]; return s; }

    /* ---- linear: out[m, n] = x[m, :] . w[n, :] + bias[n] ---------------------------------------- */

    /* acc[i][j] += x[i, k0:k1] . w[j, k0:k1], k1 - k0 a multiple of DK_VW (vectors along k) */
    DK_AI void dk_core(const int mr, const int nr, const int bf16, long k0, long k1, const float *x,
                       long ldx, const void *w, long ldw, dk_vf acc[DK_MR][DK_NR]) {
        for (long k = k0; k < k1; k += DK_VW) {
            dk_vf xv[DK_MR];
            for (int i = 0; i < mr; i++) xv[i] = dk_load(x + i * ldx + k);
            for (int j = 0; j < nr; j++) {
                dk_vf wv = dk_load_w(w, j * ldw + k, bf16);
                for (int i = 0; i < mr; i++) acc[i][j] += xv[i] * wv;
            }
        }
    }

    /* out[i, j] = hsum(acc[i][j]) + x[i, kt:ke] . w[j, kt:ke] (the < DK_VW tail) + bias[j] */
    DK_AI void dk_finish(const int mr, const int nr, const int bf16, long kt, long ke, const float *x,
                         long ldx, const void *w, long ldw, dk_vf acc[DK_MR][DK_NR],
                         const float *bias, float *out, long ldo) {
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) {
                float s = dk_hsum(acc[i][j]);
                for (long k = kt; k < ke; k++) s += x[i * ldx + k] * dk_w(w, j * ldw + k, bf16);
                out[i * ldo + j] = bias ? s + bias[j] : s;
            }
    }

    #define DK_PF_STEP 64     /* K elements per prefetch step */
    #ifndef DK_PF_BYTES
    #define DK_PF_BYTES 1024  /* prefetch distance along a weight row */
    #endif

    /* bf16 weights, 2 * DK_VW at a time without a shuffle: a vector of bf16 pairs read as 32-bit
       lanes holds the even-k weights in its low halves (lane << 16 is their fp32) and the odd-k
       weights in its high halves (lane & 0xFFFF0000). xp2 is x with each 2 * DK_VW block stored as
       [even k | odd k] (dk_pair_x). The upcast in dk_load_bf16 (a zero-extending shuffle per
       DK_VW weights) capped the decode GEMV at ~27 GB/s per core even from L2. */
    DK_AI void dk_core_pairs(const int mr, const int nr, long k0, long k1, const float *xp2, long ldx,
                             const uint16_t *w, long ldw, dk_vf acc[DK_MR][DK_NR]) {
        for (long k = k0; k < k1; k += 2 * DK_VW) {
            dk_vf xe[DK_MR], xo[DK_MR];
            for (int i = 0; i < mr; i++) {
                xe[i] = dk_load(xp2 + i * ldx + k);
                xo[i] = dk_load(xp2 + i * ldx + k + DK_VW);
            }
            for (int j = 0; j < nr; j++) {
                dk_vu u;
                memcpy(&u, w + j * ldw + k, sizeof u);
                dk_vf we = (dk_vf)(u << 16), wo = (dk_vf)(u & 0xFFFF0000u);
                for (int i = 0; i < mr; i++) {
                    acc[i][j] += xe[i] * we;
                    acc[i][j] += xo[i] * wo;
                }
            }
        }
    }

    /* x (M, K) -> xp2: every whole 2 * DK_VW block as [even k | odd k]; the tail copied as is */
    static void dk_pair_x(long M, long K, const float *x, float *xp2) {
        long kv = K - K % (2 * DK_VW);
        for (long i = 0; i < M; i++) {
            const float *xr = x + i * K;
            float *o = xp2 + i * K;
            for (long b = 0; b < kv; b += 2 * DK_VW)
                for (int j = 0; j < DK_VW; j++) {
                    o[b + j] = xr[b + 2 * j];
                    o[b + DK_VW + j] = xr[b + 2 * j + 1];
                }
            for (long k = kv; k < K; k++) o[k] = xr[k];
        }
    }

    /* A full-K register tile, weights read in place (the M <= DK_MR path: GEMV-like, memory bound).
       bf16 weights use dk_core_pairs on xp2 (the permuted x). */
    DK_AI void dk_tile_full(const int mr, const int nr, const int bf16, long K, const float *x,
                            const float *xp2, const void *w, const float *bias, float *out, long ldo) {
        dk_vf acc[DK_MR][DK_NR];
        for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) acc[i][j] = (dk_vf){0};
        long kv = bf16 ? K - K % (2 * DK_VW) : K - K % DK_VW;
        /* Weights stream from DRAM in a model step: ask for each row's lines DK_PF_BYTES ahead so
           the short (K * 2 or 4 byte) rows do not wait on the hardware prefetcher's ramp-up. */
        const long esz = bf16 ? 2 : 4;
        for (long k0 = 0; k0 < kv; k0 += DK_PF_STEP) {
            long k1 = k0 + DK_PF_STEP < kv ? k0 + DK_PF_STEP : kv;
            for (int j = 0; j < nr; j++)
                for (long b = 0; b < DK_PF_STEP * esz; b += 64)
                    __builtin_prefetch((const char *) w + (j * K + k0) * esz + DK_PF_BYTES + b, 0, 3);
            if (bf16) dk_core_pairs(mr, nr, k0, k1, xp2, K, (const uint16_t *)w, K, acc);
            else dk_core(mr, nr, 0, k0, k1, x, K, w, K, acc);
        }
        dk_finish(mr, nr, bf16, kv, K, x, K, w, K, acc, bias, out, ldo);
    }

    /* One K chunk of a tile over an fp32 weight panel; the vector partial sums persist in accbuf
       ([mr][DK_NR] vectors, row stride DK_NR) between chunks, and are reduced after the last one */
    DK_AI void dk_tile_chunk(const int mr, const int nr, long kc, int first, int last,
                             const float *x, long ldx, const float *w, long ldw, float *accbuf,
                             const float *bias, float *out, long ldo) {
        dk_vf acc[DK_MR][DK_NR];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++)
                acc[i][j] = first ? (dk_vf){0} : dk_load(accbuf + (i * DK_NR + j) * DK_VW);
        long kv = kc - kc % DK_VW;
        dk_core(mr, nr, 0, 0, kv, x, ldx, w, ldw, acc);
        if (last) {
            dk_finish(mr, nr, 0, kv, kc, x, ldx, w, ldw, acc, bias, out, ldo);
        } else {
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) dk_store(accbuf + (i * DK_NR + j) * DK_VW, acc[i][j]);
        }
    }

    /* Switches that turn the runtime tile sizes into compile-time constants (full unrolling,
       accumulators in registers). nr is DK_NR or 1. */
    #if DK_MR >= 4
    #define DK_CASE4(CALL) case 4: CALL(4); break;
    #else
    #define DK_CASE4(CALL)
    #endif
    #define DK_MR_SWITCH(mr, CALL) switch (mr) { \\
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; DK_CASE4(CALL) }

    static void dk_full(int mr, int nr, int bf16, long K, const float *x, const float *xp2, const void *w,
                        const float *bias, float *out, long ldo) {
    #define DK_FULL(MR_) \\
        if (bf16) { if (nr == DK_NR) dk_tile_full(MR_, DK_NR, 1, K, x, xp2, w, bias, out, ldo); \\
                    else dk_tile_full(MR_, 1, 1, K, x, xp2, w, bias, out, ldo); } \\
        else { if (nr == DK_NR) dk_tile_full(MR_, DK_NR, 0, K, x, xp2, w, bias, out, ldo); \\
               else dk_tile_full(MR_, 1, 0, K, x, xp2, w, bias, out, ldo); }
        DK_MR_SWITCH(mr, DK_FULL)
    #undef DK_FULL
    }

    static void dk_chunk(int mr, int nr, long kc, int first, int last, const float *x, long ldx,
                         const float *w, long ldw, float *accbuf, const float *bias, float *out, long ldo) {
    #define DK_CHUNK(MR_) \\
        if (nr == DK_NR) dk_tile_chunk(MR_, DK_NR, kc, first, last, x, ldx, w, ldw, accbuf, bias, out, ldo); \\
        else dk_tile_chunk(MR_, 1, kc, first, last, x, ldx, w, ldw, accbuf, bias, out, ldo);
        DK_MR_SWITCH(mr, DK_CHUNK)
    #undef DK_CHUNK
    }

    /* out[0:M, n0:n0+nr] for M <= DK_MR: each weight row is read once, straight from memory */
    static void dk_group_direct(long M, long K, long N, long n0, long nr, int bf16, const float *x,
                                const float *xp2, const void *w, const float *bias, float *out) {
        const void *wg = dk_wrow(w, n0 * K, bf16);
        const float *bg = bias ? bias + n0 : NULL;
        if (nr == DK_NR) {
            dk_full(M, DK_NR, bf16, K, x, xp2, wg, bg, out + n0, N);
        } else {
            for (long j = 0; j < nr; j++)
                dk_full(M, 1, bf16, K, x, xp2, dk_wrow(wg, j * K, bf16), bg ? bg + j : NULL, out + n0 + j, N);
        }
    }

    /* out[m0:m0+mb, n0:n0+nr] for larger M: per K chunk, the weight panel (upcast into wbuf when
       bf16) is reused from L1 by every DK_MR-row tile of the block; accbuf holds [mb][DK_NR] vectors.
       x has row stride ldx: padded by the caller so that its rows do not all fall into the same L1
       sets (a 16 KiB stride would thrash them). */
    static void dk_group_chunked(long m0, long mb, long K, long N, long n0, long nr, int bf16,
                                 const float *x, long ldx, const void *w, const float *bias, float *out,
                                 float *wbuf, float *accbuf) {
        const float *bg = bias ? bias + n0 : NULL;
        for (long k0 = 0; k0 < K; k0 += DK_KC) {
            long kc = K - k0 < DK_KC ? K - k0 : DK_KC;
            const float *panel;
            long ldw;
            if (bf16) {
                const uint16_t *wh = (const uint16_t *)w + n0 * K + k0;
                for (long j = 0; j < nr; j++)
                    for (long k = 0; k < kc; k++) wbuf[j * DK_KC + k] = dk_bf16(wh[j * K + k]);
                panel = wbuf;
                ldw = DK_KC;
            } else {
                panel = (const float *)w + n0 * K + k0;
                ldw = K;
            }
            /* bf16: ask for the next weight chunk now, so that it arrives while this one is computed
               (measured +4% at M=16; with fp32 weights, read in place, it cost 15%) */
            long kn = k0 + DK_KC < K ? k0 + DK_KC : 0, nn = k0 + DK_KC < K ? n0 : n0 + nr;
            long kcn = K - kn < DK_KC ? K - kn : DK_KC;
            if (bf16 && nn < N) {
                const char *wn = (const char *)dk_wrow(w, nn * K + kn, bf16);
                long rows = N - nn < DK_NR ? N - nn : DK_NR;
                for (long j = 0; j < rows; j++)
                    for (long b = 0; b < 2 * kcn; b += 64) __builtin_prefetch(wn + 2 * j * K + b, 0, 3);
            }
            int first = k0 == 0, last = k0 + kc == K;
            for (long i = 0; i < mb; i += DK_MR) {
                int mr = mb - i < DK_MR ? mb - i : DK_MR;
                const float *xi = x + (m0 + i) * ldx + k0;
                float *oi = out + (m0 + i) * N + n0;
                float *ai = accbuf + i * DK_NR * DK_VW;
                if (nr == DK_NR) {
                    dk_chunk(mr, DK_NR, kc, first, last, xi, ldx, panel, ldw, ai, bg, oi, N);
                } else {
                    for (long j = 0; j < nr; j++)
                        dk_chunk(mr, 1, kc, first, last, xi, ldx, panel + j * ldw, ldw, ai + j * DK_VW,
                                 bg ? bg + j : NULL, oi + j, N);
                }
            }
        }
    }

    /* ---- exp, SwiGLU, RMSNorm, RoPE rows ------------------------------------------------------- */

    #include "dk_exp.h"  /* dk_exp: the shared polynomial exp */

    static void dk_silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, long n) {
        for (long i = 0; i < n; i++) o[i] = g[i] / (1.0f + dk_exp(-g[i])) * u[i];
    }

    /* o = x / rms(x) * (offset + w); with res != NULL, x + res is normed and stored into new_res */
    static void dk_rms_norm_row(const float *restrict x, const float *restrict res, const float *restrict w,
                                float offset, float eps, long h, float *restrict o, float *restrict new_res) {
        const float *v = x;
        if (res) {
            for (long i = 0; i < h; i++) new_res[i] = x[i] + res[i];
            v = new_res;
        }
        float ss = 0.0f;
        for (long i = 0; i < h; i++) ss += v[i] * v[i];
        float inv = 1.0f / __builtin_sqrtf(ss / (float)h + eps);
        for (long i = 0; i < h; i++) o[i] = v[i] * inv * (offset + w[i]);
    }

    /* NeoX rotate-half over the first 2*half dims of one head; the rest is copied */
    static void dk_rope_row(const float *x, const float *restrict c, const float *restrict s, long half,
                            long d, float *o) {
        for (long j = 0; j < half; j++) {
            float a = x[j], b = x[j + half];
            o[j] = a * c[j] - b * s[j];
            o[j + half] = b * c[j] + a * s[j];
        }
        if (o != x) for (long j = 2 * half; j < d; j++) o[j] = x[j];
    }
    """
    int DK_MR, DK_NR, DK_KC, DK_MB, DK_VW
    void dk_pair_x(long M, long K, const float *x, float *xp2)
    void dk_group_direct(long M, long K, long N, long n0, long nr, int bf16, const float *x,
                         const float *xp2, const void *w, const float *bias, float *out)
    void dk_group_chunked(long m0, long mb, long K, long N, long n0, long nr, int bf16,
                          const float *x, long ldx, const void *w, const float *bias, float *out,
                          float *wbuf, float *accbuf)
    void dk_silu_mul_row(const float *g, const float *u, float *o, long n)

cdef extern from "dk_amx.h" nogil:
    int DK_AMX_BUILT, DK_AMX_GROUP, DK_AMX_KB, DK_AMX_MB
    int dk_amx_ready()
    void dk_amx_begin()
    void dk_amx_end()
    long dk_amx_xsize(long M, long K)
    int dk_amx_pack_block(long mb, long M, long K, const float *x, long ldx, unsigned short *xb)
    void dk_amx_group(long M, long K, long N, long n0, const unsigned short *xb, const unsigned short *w,
                      const float *bias, float *out, float *cacc)
    void dk_rms_norm_row(const float *x, const float *res, const float *w, float offset, float eps,
                         long h, float *o, float *new_res)
    void dk_rope_row(const float *x, const float *c, const float *s, long half, long d, float *o)


ctypedef fused wtype:
    float
    unsigned short  # bf16 bit patterns

# Below this much work (multiply-adds / elements) one thread beats waking the OpenMP pool.
cdef Py_ssize_t PARALLEL_MACS = 1 << 18
cdef Py_ssize_t PARALLEL_ELEMS = 1 << 15


# DFLASH_AMX=0 turns the AMX path off (benchmarks compare it with the FMA path in one process).
cdef int _amx_enabled = os.environ.get("DFLASH_AMX", "1") != "0"


def amx_available():
    """True when linear runs bf16-weight blocks (M > 4 rows) on AMX tiles here."""
    return bool(_amx_enabled and DK_AMX_BUILT and dk_amx_ready())


def set_amx_enabled(enabled):
    """Turn the AMX path on or off for this process (benchmarks); returns the previous setting."""
    global _amx_enabled
    old = bool(_amx_enabled)
    _amx_enabled = bool(enabled)
    return old


cdef int _linear_amx(const float *xp, const unsigned short *wp, const float *bp, float *op, Py_ssize_t M,
                     Py_ssize_t K, Py_ssize_t N, int nt):
    """AMX part of linear (see dk_amx.h): output columns [0, N - N % 32); returns how many were done."""
    cdef Py_ssize_t g, m, finite = 0
    cdef unsigned short *xb
    if not (_amx_enabled and DK_AMX_BUILT and K % DK_AMX_KB == 0 and N >= DK_AMX_GROUP and dk_amx_ready()):
        return 0
    cdef Py_ssize_t nmb = (M + DK_AMX_MB - 1) // DK_AMX_MB
    xb = <unsigned short *> malloc(dk_amx_xsize(M, K) * sizeof(unsigned short))
    if xb == NULL:
        return 0
    for m in prange(nmb, nogil=True, num_threads=min(nt, nmb)):
        finite += dk_amx_pack_block(m, M, K, xp, K, xb)
    if finite != nmb:  # inf / NaN in x
        free(xb)
        return 0
    cdef float *cacc
    with nogil, parallel(num_threads=nt):
        cacc = <float *> malloc(nmb * 2 * 256 * sizeof(float))
        dk_amx_begin()
        # static: a contiguous run of groups per thread, so the group prefetched next is its own
        for g in prange(N // DK_AMX_GROUP, schedule="static"):
            dk_amx_group(M, K, N, g * DK_AMX_GROUP, xb, wp, bp, op, cacc)
        dk_amx_end()
        free(cacc)
    free(xb)
    return N // DK_AMX_GROUP * DK_AMX_GROUP


cdef inline int _threads(Py_ssize_t work, Py_ssize_t threshold, int n_threads) noexcept nogil:
    return n_threads if work >= threshold else 1


def linear(const float[:, ::1] x, const wtype[:, ::1] weight, const float[::1] bias, float[:, ::1] out,
           *, int n_threads):
    """out (M, N) = x (M, K) @ weight (N, K)^T + bias (N,); weight fp32 or bf16 (uint16)."""
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = weight.shape[0]
    cdef Py_ssize_t ngroups = (N + DK_NR - 1) // DK_NR, g, n0, b, m0, mb
    cdef int bf16 = 0 if wtype is float else 1
    cdef const float *xp = &x[0, 0]
    cdef const void *wp = <const void *> &weight[0, 0]
    cdef const float *bp = NULL if bias is None else &bias[0]
    cdef float *op = &out[0, 0]
    cdef float *wbuf
    cdef float *accbuf
    cdef float *xp2
    cdef int nt = _threads(M * N * K, PARALLEL_MACS, n_threads)
    cdef Py_ssize_t g0 = 0  # first column group left to the FMA paths
    if M <= DK_MR:
        # Memory bound: weight rows split over threads, each read once with x in registers/L1.
        # Guided chunks: long contiguous runs per thread first (28.2 GB/s from DRAM over 1 GB of
        # Qwen3-1.7B layer weights, against 26.6 with dynamic 32-row chunks; stream read 34.5),
        # then small ones that keep both threads busy on a shared, noisy machine. Every output is
        # computed by one thread in a fixed order, so the result does not depend on the schedule.
        xp2 = NULL
        if bf16:
            xp2 = <float *> malloc(M * K * sizeof(float))
            if xp2 == NULL:
                raise MemoryError()
            dk_pair_x(M, K, xp, xp2)
        for g in prange(ngroups, nogil=True, num_threads=nt, schedule="guided", chunksize=8):
            n0 = g * DK_NR
            dk_group_direct(M, K, N, n0, min(<Py_ssize_t> DK_NR, N - n0), bf16, xp, xp2, wp, bp, op)
        free(xp2)
        return
    if wtype is not float:
        g0 = _linear_amx(xp, <const unsigned short *> wp, bp, op, M, K, N, nt) // DK_NR
        if g0 == ngroups:
            return
    # Compute bound: blocks of DK_MB rows; inside a block, weight row groups split over threads.
    # x is copied once with a padded row stride (see dk_group_chunked): (M, ldx); ldx = K rounded up
    # to 16 floats plus 16, so a 4 KiB-multiple row stride (K = 1024, 4096, ...) gets 64 bytes more.
    cdef Py_ssize_t ldx = (K + 15) // 16 * 16 + 16, m
    cdef float *xpad = <float *> malloc(M * ldx * sizeof(float))
    if xpad == NULL:
        raise MemoryError()
    for m in range(M):
        memcpy(&xpad[m * ldx], &x[m, 0], K * sizeof(float))
    with nogil, parallel(num_threads=nt):
        wbuf = <float *> malloc(DK_NR * DK_KC * sizeof(float))
        accbuf = <float *> malloc(DK_MB * DK_NR * DK_VW * sizeof(float))
        for b in range((M + DK_MB - 1) // DK_MB):
            m0 = b * DK_MB
            mb = min(<Py_ssize_t> DK_MB, M - m0)
            for g in prange(g0, ngroups, schedule="dynamic", chunksize=4):
                n0 = g * DK_NR
                dk_group_chunked(m0, mb, K, N, n0, min(<Py_ssize_t> DK_NR, N - n0), bf16, xpad, ldx, wp, bp,
                                 op, wbuf, accbuf)
        free(wbuf)
        free(accbuf)
    free(xpad)


def silu_and_mul(const float[:, ::1] x, float[:, ::1] out, *, int n_threads):
    """out (M, I) = silu(x[:, :I]) * x[:, I:]."""
    cdef Py_ssize_t m, n = out.shape[1]
    cdef int nt = _threads(out.shape[0] * n, PARALLEL_ELEMS, n_threads)
    if n == 0:
        return
    for m in prange(out.shape[0], nogil=True, num_threads=nt, schedule="static"):
        dk_silu_mul_row(&x[m, 0], &x[m, n], &out[m, 0], n)


def rms_norm(const float[:, ::1] x, const float[::1] w, float[:, ::1] out, *, int n_threads, float eps,
             float offset=0.0):
    """out (M, H) = x * rsqrt(mean(x^2) + eps) * (offset + w)."""
    cdef Py_ssize_t m, h = x.shape[1]
    cdef int nt = _threads(x.shape[0] * h, PARALLEL_ELEMS, n_threads)
    for m in prange(x.shape[0], nogil=True, num_threads=nt, schedule="static"):
        dk_rms_norm_row(&x[m, 0], NULL, &w[0], offset, eps, h, &out[m, 0], NULL)


def rms_norm_residual(const float[:, ::1] x, const float[:, ::1] residual, const float[::1] w,
                      float[:, ::1] out, float[:, ::1] new_residual, *, int n_threads, float eps,
                      float offset=0.0):
    """new_residual = x + residual; out = rms_norm(new_residual)."""
    cdef Py_ssize_t m, h = x.shape[1]
    cdef int nt = _threads(x.shape[0] * h, PARALLEL_ELEMS, n_threads)
    for m in prange(x.shape[0], nogil=True, num_threads=nt, schedule="static"):
        dk_rms_norm_row(&x[m, 0], &residual[m, 0], &w[0], offset, eps, h, &out[m, 0], &new_residual[m, 0])


def apply_rope(const float[:, :, ::1] x, const long long[::1] positions, float[:, :, ::1] out, *,
               int n_threads, double theta, int rotary_dim):
    """out (T, H, D) = NeoX rotate-half RoPE of x over the first rotary_dim dims (out may be x)."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], D = x.shape[2], half = rotary_dim // 2
    cdef Py_ssize_t t, j, r
    cdef double angle
    cdef float *table = <float *> malloc(2 * T * half * sizeof(float))  # (T, 2, half): cos | sin
    cdef double *inv_freq = <double *> malloc(half * sizeof(double))
    cdef int nt = _threads(T * H * D, PARALLEL_ELEMS, n_threads)
    if table == NULL or inv_freq == NULL:
        free(table)
        free(inv_freq)
        raise MemoryError()
    try:
        with nogil:
            for j in range(half):
                inv_freq[j] = pow(theta, -2.0 * j / rotary_dim)
            # Angles in float64: pos * inv_freq reaches ~2.6e5 rad, where fp32 would be off by ~1e-2.
            for t in range(T):
                for j in range(half):
                    angle = positions[t] * inv_freq[j]
                    table[(2 * t) * half + j] = <float> cos(angle)
                    table[(2 * t + 1) * half + j] = <float> sin(angle)
        for r in prange(T * H, nogil=True, num_threads=nt, schedule="static"):
            t = r // H
            dk_rope_row(&x[t, r % H, 0], &table[2 * t * half], &table[(2 * t + 1) * half], half, D,
                        &out[t, r % H, 0])
    finally:
        free(table)
        free(inv_freq)
