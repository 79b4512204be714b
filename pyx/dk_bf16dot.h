/* Activation rounding for the matmul precisions, and the AVX512-BF16 (vdpbf16ps) linear path.

Precision is the number of bf16 parts an fp32 activation is split into (torch's vocabulary in
dflash_kernels/_precision.py): x = x1 + ... + x_parts, each part a bf16.
  3 ("highest"): truncate, truncate, round to nearest even: 3 x 8 significant bits, exact.
  2 ("high"):    truncate, round: 16 significant bits (relative error <= 2^-17).
  1 ("medium"):  round to nearest even: torch's and vLLM's bf16 activations (<= 2^-9).
A product of a part with a bf16 weight is exact in fp32, so every path computes the exact products
of the rounded activations with the weights; paths differ only in summation order.

vdpbf16ps adds two such products per fp32 lane: 32 multiply-adds per instruction against an FMA's
16. With one part it does twice the FMA path's work per instruction and reads bf16 weights without
an upcast; with two parts it equals the FMA rate; with three it would lose, so "highest" stays on
FMA (or AMX tiles). Weights are read in place from their row-major (N, K) storage: a 512-bit load
of row n at k holds the 16 pairs (k, k+1) .. (k+30, k+31), and the activation parts are packed
once per call into the same pair layout, K padded with zeros to a multiple of 32. */
#ifndef DK_BF16DOT_H
#define DK_BF16DOT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t dk_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float dk_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t dk_bf16_rne(uint32_t u) { return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }

#define DK_BAD(u) ((u & 0x7F800000u) == 0x7F800000u)  /* inf or NaN */
#define DK_HI(u) ((u) & 0xFFFF0000u)

/* The bf16 parts of x[0:n] into p0, p1, p2 (see above). One loop per part count, so that gcc
   vectorises each. Returns nonzero when a value is inf or NaN. */
static uint32_t dk_split_run(const float *restrict x, long n, int parts, uint16_t *restrict p0,
                             uint16_t *restrict p1, uint16_t *restrict p2) {
    uint32_t bad = 0;
    if (parts == 1) {
        for (long k = 0; k < n; k++) {
            uint32_t u = dk_f2u(x[k]);
            bad |= DK_BAD(u);
            p0[k] = dk_bf16_rne(u);
        }
    } else if (parts == 2) {
        for (long k = 0; k < n; k++) {
            uint32_t u = dk_f2u(x[k]);
            bad |= DK_BAD(u);
            p0[k] = (uint16_t)(u >> 16);
            p1[k] = dk_bf16_rne(dk_f2u(x[k] - dk_u2f(DK_HI(u))));
        }
    } else {
        for (long k = 0; k < n; k++) {
            uint32_t u = dk_f2u(x[k]);
            bad |= DK_BAD(u);
            float r = x[k] - dk_u2f(DK_HI(u));
            uint32_t m = DK_HI(dk_f2u(r));
            p0[k] = (uint16_t)(u >> 16);
            p1[k] = (uint16_t)(m >> 16);
            p2[k] = dk_bf16_rne(dk_f2u(r - dk_u2f(m)));
        }
    }
    return bad;
}

/* xr = x rounded to `parts` bf16 parts (the sum of the parts, exact in fp32). The FMA paths run on
   it, so that every path and backend computes the same precision. Values that are inf or NaN are
   kept as they are. */
static void dk_round_rows(long n, const float *restrict x, int parts, float *restrict xr) {
    uint16_t p[3][256];
    for (long k0 = 0; k0 < n; k0 += 256) {
        long c = n - k0 < 256 ? n - k0 : 256;
        dk_split_run(x + k0, c, parts, p[0], p[1], p[2]);
        for (long k = 0; k < c; k++) {
            float s = dk_u2f((uint32_t)p[0][k] << 16);
            if (parts > 1) s += dk_u2f((uint32_t)p[1][k] << 16);
            if (parts > 2) s += dk_u2f((uint32_t)p[2][k] << 16);
            xr[k0 + k] = DK_BAD(dk_f2u(x[k0 + k])) ? x[k0 + k] : s;
        }
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define DK_DP_BUILT 1
#else
#define DK_DP_BUILT 0
#endif
#define DK_DP_MR 4    /* x rows per register tile */
#define DK_DP_NR 4    /* weight rows per register tile: 16 accumulators + 4 weights + 1 x */
#define DK_DP_KB 32   /* k per vdpbf16ps */
#define DK_DP_KC 1024 /* K chunk of dk_dp_block */
#define DK_DP_MBLK 16 /* activation rows per dk_dp_block pass: a K chunk of them is 32 KiB */
#define DK_DP_NB 64   /* weight rows per dk_dp_block call */

static long dk_dp_ldx(long K) { return (K + DK_DP_KB - 1) / DK_DP_KB * DK_DP_KB; }

/* Pack rows [m0, m0 + mb) of x (M, K) into xb: parts planes of (M, ldx) bf16, ldx = dk_dp_ldx(K),
   zeros past K. Returns 0 when a value is inf or NaN (whose parts are NaN: the caller then takes
   the FMA path, which keeps IEEE results). */
static int dk_dp_pack(long m0, long mb, long M, long K, const float *x, int parts, uint16_t *xb) {
    long ldx = dk_dp_ldx(K);
    uint32_t bad = 0;
    for (long i = m0; i < m0 + mb; i++) {
        bad |= dk_split_run(x + i * K, K, parts, xb + i * ldx, xb + (M + i) * ldx, xb + (2 * M + i) * ldx);
        for (int q = 0; q < parts; q++)
            for (long k = K; k < ldx; k++) xb[(q * M + i) * ldx + k] = 0;
    }
    return bad == 0;
}

#if DK_DP_BUILT
#define DK_DP_AI static inline __attribute__((always_inline))
#define DK_DP_PF_BYTES 1024  /* prefetch distance along weight rows (DRAM-resident, small M) */

/* acc[i][j] (16 lanes of partial sums) += sum_q xb_q[i, k0:k1] . w[j, k0:k1] for i < mr, j < nr.
   The partial sums start at zero (first) or from spill, and end in spill, or (last) reduced into
   out[i, j] (+ bias[j]). xb planes are `plane` apart, rows ldx; w rows are K apart (a last partial
   32-step is read with a mask, so nothing past a row is touched). */
DK_DP_AI void dk_dp_tile(const int mr, const int nr, const int parts, long k0, long k1, long K,
                         const uint16_t *xb, long ldx, long plane, const uint16_t *w, __m512 *spill,
                         int first, int last, const float *bias, float *out, long ldo, int prefetch) {
    __m512 acc[DK_DP_MR][DK_DP_NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = first ? _mm512_setzero_ps() : spill[i * DK_DP_NR + j];
    long kfull = K - K % DK_DP_KB;
    for (long k = k0; k < k1; k += DK_DP_KB) {
        __m512bh wv[DK_DP_NR];
        if (k < kfull) {
            for (int j = 0; j < nr; j++) {
                if (prefetch) __builtin_prefetch((const char *)(w + j * K + k) + DK_DP_PF_BYTES, 0, 3);
                wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            }
        } else {
            __mmask32 m = (__mmask32)((1ull << (K - kfull)) - 1);
            for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * K + k);
        }
        for (int q = 0; q < parts; q++)
            for (int i = 0; i < mr; i++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + q * plane + i * ldx + k);
                for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
            }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            if (!last) { spill[i * DK_DP_NR + j] = acc[i][j]; continue; }
            float s = _mm512_reduce_add_ps(acc[i][j]);
            out[i * ldo + j] = bias ? s + bias[j] : s;
        }
}

/* Compile-time tile sizes (full unrolling, accumulators in registers) for the runtime ones. */
#define DK_DP_ARGS k0, k1, K, xb, ldx, plane
#define DK_DP_NR_CASE(MR_, P_) \
    if (nr == DK_DP_NR) dk_dp_tile(MR_, DK_DP_NR, P_, DK_DP_ARGS, w, spill, first, last, bias, out, ldo, pf); \
    else { for (int j = 0; j < nr; j++) \
        dk_dp_tile(MR_, 1, P_, DK_DP_ARGS, w + j * K, spill + j, first, last, bias ? bias + j : NULL, \
                   out + j, ldo, pf); }
#define DK_DP_P_CASE(MR_) \
    switch (parts) { case 1: DK_DP_NR_CASE(MR_, 1) break; case 2: DK_DP_NR_CASE(MR_, 2) break; \
                     default: DK_DP_NR_CASE(MR_, 3) break; }

static void dk_dp_tile_any(int mr, int nr, int parts, long k0, long k1, long K, const uint16_t *xb,
                           long ldx, long plane, const uint16_t *w, __m512 *spill, int first, int last,
                           const float *bias, float *out, long ldo, int pf) {
    switch (mr) {
    case 1: DK_DP_P_CASE(1) break;
    case 2: DK_DP_P_CASE(2) break;
    case 3: DK_DP_P_CASE(3) break;
    default: DK_DP_P_CASE(4) break;
    }
}

/* M <= DK_DP_MR (decode, memory bound): out[:, n0 : n0 + nr], each weight row read once, whole K
   per register tile. */
static void dk_dp_gemv(long M, long K, long N, long n0, long nr, int parts, const uint16_t *xb,
                       const uint16_t *w, const float *bias, float *out) {
    long ldx = dk_dp_ldx(K);
    dk_dp_tile_any((int)M, (int)nr, parts, 0, K, K, xb, ldx, M * ldx, w + n0 * K, NULL, 1, 1,
                   bias ? bias + n0 : NULL, out + n0, N, 1);
}

/* Larger M (verification, drafting, prefill): out[:, nlo : nhi], nhi - nlo <= DK_DP_NB. With whole
   K per tile, the activations (M x K bf16, 128 KiB at M = 16, K = 4096) were re-read from L2 for
   every 4 weight rows and evicted those rows from L1: the kernel ran at the FMA path's speed. Here
   K is cut into DK_DP_KC chunks: a chunk of DK_DP_MBLK activation rows (32 KiB) stays in L1 while
   the weight rows of the block pass it once, each 4-row chunk reused from L1 by every m tile, and
   the partial sums wait in spill (DK_DP_MBLK x DK_DP_NB vectors, 64 KiB, in L2) between chunks.
   The chunking is fixed, so results do not depend on how blocks are spread over threads. */
static void dk_dp_block(long M, long K, long N, long nlo, long nhi, int parts, const uint16_t *xb,
                        const uint16_t *w, const float *bias, float *out, __m512 *spill) {
    long ldx = dk_dp_ldx(K), plane = M * ldx;
    for (long m0 = 0; m0 < M; m0 += DK_DP_MBLK) {
        long mb = M - m0 < DK_DP_MBLK ? M - m0 : DK_DP_MBLK;
        for (long k0 = 0; k0 < K; k0 += DK_DP_KC) {
            long k1 = K - k0 < DK_DP_KC ? K : k0 + DK_DP_KC;
            int first = k0 == 0, last = k1 == K;
            for (long n0 = nlo; n0 < nhi; n0 += DK_DP_NR) {
                int nr = nhi - n0 < DK_DP_NR ? (int)(nhi - n0) : DK_DP_NR;
                for (long i = m0; i < m0 + mb; i += DK_DP_MR) {
                    int mr = m0 + mb - i < DK_DP_MR ? (int)(m0 + mb - i) : DK_DP_MR;
                    __m512 *sp = spill + (((i - m0) / DK_DP_MR) * (DK_DP_NB / DK_DP_NR)
                                          + (n0 - nlo) / DK_DP_NR) * DK_DP_MR * DK_DP_NR;
                    dk_dp_tile_any(mr, nr, parts, k0, k1, K, xb + i * ldx, ldx, plane, w + n0 * K, sp,
                                   first, last, bias ? bias + n0 : NULL, out + i * N + n0, N, 0);
                }
            }
        }
    }
}

/* Bytes of spill dk_dp_block needs per thread. */
static long dk_dp_spill_bytes(void) { return DK_DP_MBLK * DK_DP_NB * 64; }
#else
static void dk_dp_gemv(long M, long K, long N, long n0, long nr, int parts, const uint16_t *xb,
                       const uint16_t *w, const float *bias, float *out) {
    (void)M; (void)K; (void)N; (void)n0; (void)nr; (void)parts; (void)xb; (void)w; (void)bias; (void)out;
}
static void dk_dp_block(long M, long K, long N, long nlo, long nhi, int parts, const uint16_t *xb,
                        const uint16_t *w, const float *bias, float *out, void *spill) {
    (void)M; (void)K; (void)N; (void)nlo; (void)nhi; (void)parts; (void)xb; (void)w; (void)bias;
    (void)out; (void)spill;
}
static long dk_dp_spill_bytes(void) { return 64; }
#endif


/* 64 * 12 * iters flops of independent vdpbf16ps chains (register only), as dk_peak_fma. */
#if DK_DP_BUILT
static float dk_peak_dp(long iters) {
    __m512 acc[12];
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x3F7F3F7F);
    for (int r = 0; r < 12; r++) acc[r] = _mm512_setzero_ps();
    for (long it = 0; it < iters; it++) {
        for (int r = 0; r < 12; r++) acc[r] = _mm512_dpbf16_ps(acc[r], a, b);
        __asm__ volatile("" : "+v"(b));
    }
    float s = 0.0f;
    for (int r = 0; r < 12; r++) s += _mm512_reduce_add_ps(acc[r]);
    return s;
}
#else
static float dk_peak_dp(long iters) { (void)iters; return 0.0f; }
#endif

#endif /* DK_BF16DOT_H */
