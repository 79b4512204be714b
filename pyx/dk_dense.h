/* Dense kernels behind pyx/dense.pyx: linear (fp32 / bf16 weights) on FMA, RMSNorm, RoPE, SwiGLU.

The inner loops are written with GCC vector extensions so that the register blocking is explicit and
one source compiles to every tier (setup.py builds it once per tier): AVX2 gives 8-float ymm
vectors and a 3 x 4 register tile, AVX-512 16-float zmm vectors and a 4 x 4 tile. */
#ifndef DK_DENSE_H
#define DK_DENSE_H
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
#define DK_MR_SWITCH(mr, CALL) switch (mr) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; DK_CASE4(CALL) }

static void dk_full(int mr, int nr, int bf16, long K, const float *x, const float *xp2, const void *w,
                    const float *bias, float *out, long ldo) {
#define DK_FULL(MR_) \
    if (bf16) { if (nr == DK_NR) dk_tile_full(MR_, DK_NR, 1, K, x, xp2, w, bias, out, ldo); \
                else dk_tile_full(MR_, 1, 1, K, x, xp2, w, bias, out, ldo); } \
    else { if (nr == DK_NR) dk_tile_full(MR_, DK_NR, 0, K, x, xp2, w, bias, out, ldo); \
           else dk_tile_full(MR_, 1, 0, K, x, xp2, w, bias, out, ldo); }
    DK_MR_SWITCH(mr, DK_FULL)
#undef DK_FULL
}

static void dk_chunk(int mr, int nr, long kc, int first, int last, const float *x, long ldx,
                     const float *w, long ldw, float *accbuf, const float *bias, float *out, long ldo) {
#define DK_CHUNK(MR_) \
    if (nr == DK_NR) dk_tile_chunk(MR_, DK_NR, kc, first, last, x, ldx, w, ldw, accbuf, bias, out, ldo); \
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

/* out[:, nlo:nhi] for larger M (verification, draft blocks, prefill), nhi - nlo <= DK_FB_NB.
   Blocking: for each block of DK_FB_MBLK x rows and each K chunk of DK_KC, the x chunk stays in L1
   while all the block's weight rows pass it, DK_NR at a time: each group's chunk is upcast (bf16)
   into wbuf once and reused from L1 by every DK_MR-row tile, and the tiles' vector partial sums wait
   in accbuf (DK_FB_MBLK / DK_MR x DK_FB_NB / DK_NR tiles of DK_MR x DK_NR vectors, L2) between
   chunks. The earlier loop order (per 4 weight rows, every K chunk of all of x) re-read the whole
   of x from L2 for every 4 weight rows and ran at ~37% of the AVX-512 FMA peak.
   x has row stride ldx: padded by the caller so that its rows do not all fall into the same L1
   sets (a 16 KiB stride would thrash them). The chunking is fixed, so the result does not depend
   on how blocks are spread over threads. */
#define DK_FB_MBLK (4 * DK_MR)
#define DK_FB_NB 64
static long dk_fma_accbuf_floats(void) { return (long)DK_FB_MBLK * DK_FB_NB * DK_VW; }

static void dk_fma_block(long M, long K, long N, long nlo, long nhi, int bf16, const float *x, long ldx,
                         const void *w, const float *bias, float *out, float *wbuf, float *accbuf) {
    for (long m0 = 0; m0 < M; m0 += DK_FB_MBLK) {
        long mb = M - m0 < DK_FB_MBLK ? M - m0 : DK_FB_MBLK;
        for (long k0 = 0; k0 < K; k0 += DK_KC) {
            long kc = K - k0 < DK_KC ? K - k0 : DK_KC;
            int first = k0 == 0, last = k0 + kc == K;
            for (long n0 = nlo; n0 < nhi; n0 += DK_NR) {
                long nr = nhi - n0 < DK_NR ? nhi - n0 : DK_NR;
                const float *panel;
                long ldw;
                if (bf16) {
                    const uint16_t *wh = (const uint16_t *)w + n0 * K + k0;
                    for (long j = 0; j < nr; j++)
                        for (long k = 0; k < kc; k++) wbuf[j * DK_KC + k] = dk_bf16(wh[j * K + k]);
                    /* the next group's chunk, so that it arrives while this one is computed */
                    if (n0 + DK_NR < nhi)
                        for (long j = 0; j < DK_NR && n0 + DK_NR + j < nhi; j++)
                            for (long b = 0; b < 2 * kc; b += 64)
                                __builtin_prefetch((const char *)(wh + (DK_NR + j) * K) + b, 0, 3);
                    panel = wbuf;
                    ldw = DK_KC;
                } else {
                    panel = (const float *)w + n0 * K + k0;
                    ldw = K;
                }
                const float *bg = bias ? bias + n0 : NULL;
                for (long i = m0; i < m0 + mb; i += DK_MR) {
                    int mr = m0 + mb - i < DK_MR ? (int)(m0 + mb - i) : DK_MR;
                    const float *xi = x + i * ldx + k0;
                    float *oi = out + i * N + n0;
                    float *ai = accbuf + (((i - m0) / DK_MR) * (DK_FB_NB / DK_NR) + (n0 - nlo) / DK_NR)
                                         * DK_MR * DK_NR * DK_VW;
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
    }
}

/* ---- exp, SwiGLU, RMSNorm, RoPE rows ------------------------------------------------------- */

#include "dk_exp.h"  /* dk_exp: the shared polynomial exp */

/* The row functions are compiled once, never inlined: with -ffp-contract=fast and
   -fassociative-math an inlined copy may contract or reorder differently at each call site, and the
   fused layers (layers.pxi) must give exactly what the single ops give. */
#define DK_ROW static __attribute__((noinline))

DK_ROW void dk_silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, long n) {
    for (long i = 0; i < n; i++) o[i] = g[i] / (1.0f + dk_exp(-g[i])) * u[i];
}

/* o = x / rms(x) * (offset + w); with res != NULL, x + res is normed and stored into new_res */
DK_ROW void dk_rms_norm_row(const float *restrict x, const float *restrict res, const float *restrict w,
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
DK_ROW void dk_rope_row(const float *x, const float *restrict c, const float *restrict s, long half,
                        long d, float *o) {
    for (long j = 0; j < half; j++) {
        float a = x[j], b = x[j + half];
        o[j] = a * c[j] - b * s[j];
        o[j + half] = b * c[j] + a * s[j];
    }
    if (o != x) for (long j = 2 * half; j < d; j++) o[j] = x[j];
}


/* ---- peak rate: a register-only loop, the ceiling the benchmarks quote -------------------------- */
/* 2 * DK_VW * 12 * iters flops of independent FMA chains (12 accumulators hide the latency). The
   result is returned so that the loop is not removed. */
static float dk_peak_fma(long iters) {
    dk_vf acc[12], a = (dk_vf){0}, b = (dk_vf){0};
    for (int i = 0; i < DK_VW; i++) { a[i] = 1.0f + 1e-7f * i; b[i] = 0.999999f; }
    for (int r = 0; r < 12; r++) acc[r] = a;
    for (long it = 0; it < iters; it++) {
        for (int r = 0; r < 12; r++) acc[r] = acc[r] * b + a;
        __asm__ volatile("" : "+x"(b));
    }
    float s = 0.0f;
    for (int r = 0; r < 12; r++) s += acc[r][0];
    return s;
}

#endif /* DK_DENSE_H */
