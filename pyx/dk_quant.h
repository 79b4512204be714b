/* linear over GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), read as they are stored, in panels.

Why: a decode step streams every weight once, so its time is the weights' bytes over the memory
bus. A GGUF Q4_1 weight is 5 bits (a block of 32 weights: a float16 scale d, a float16 offset m and
32 four-bit integers q, w = d q + m), a Q8_0 one 8.5 bits (d and 32 int8, w = d q), against 16 for
bf16. Expanded at load to bf16, SmolLM2-135M's 106 M layer weights stream 212 MB a token; kept
quantized, 66 MB.

Exactness: d q is exact in float32 (11 + 8 significant bits at most), so fma(d, q, m) is the
float32 value that the expansion to float32 computes (ggml's dequantize and gguf-py's:
d * q + m, rounded once), and every tile below sums those values over k exactly as the float32
panel tiles of dk_packed.h do: k ascending within a chunk of DK_PK_KC, chunk sums added to out in
order, the bias after. So linear over a quantized panel is bit-identical to linear over the
float32 expansion of the same weights, for every M, thread count and tier's own tiles; the model
computed is the GGUF's, exactly (the bf16 expansion rounds it).

Layout, per panel of 16 output columns (zero rows beyond N), one record per block of 32 k:
    DK_Q4 (Q4_1, and Q4_0 as m = -8 d): d[16] float16, m[16] float16, then 16 bytes per k-pair
        p = 0..15: byte j = q[2p] of column j | q[2p + 1] << 4                      320 bytes
    DK_Q8 (Q8_0): d[16] float16, then 16 int8 per k = 0..31                       544 bytes
The pairs are re-paired at pack time (dflash_kernels.dense.pack_quantized: GGUF's byte j holds q[j]
and q[j + 16]) so that the low and high nibbles of one byte are consecutive k, in the order of the
float32 sums. K is a multiple of 32 (a GGUF row is whole blocks). */
#ifndef DK_QUANT_H
#define DK_QUANT_H

#include <stdint.h>
#include <string.h>

#include "dk_dense.h"
#include "dk_packed.h"  /* DK_PK_COLS, DK_PK_KC: the float32 panels' chunking, which the sums follow */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

enum { DK_Q4 = 2, DK_Q8 = 3 };  /* linear_packed's weight formats after float32 (0) and bf16 (1) */
#define DK_Q_BLOCK 32
#define DK_Q_VPP (DK_PK_COLS / DK_VW)  /* vectors per panel row */
#if DK_VW == 16
#define DK_Q_MR 8  /* 8 rows x 2 panels: 16 accumulators, 2 scales, 2 offsets, 2 + 2 weights of 32 zmm */
#define DK_Q_NV 2
#define DK_Q_GV 4  /* M = 1: 4 panels a tile, 4 independent sums */
#else
#define DK_Q_MR 4  /* 4 rows x 1 panel (2 ymm): 8 accumulators, 2 + 2 + 2 of 16 ymm */
#define DK_Q_NV 1
#define DK_Q_GV 2  /* M = 1: 1 x 2 panels (its spills cost less than the 1 x 1 tile's latency) */
#endif
#define DK_Q_NVMAX (DK_Q_GV > DK_Q_NV ? DK_Q_GV : DK_Q_NV)
/* From this many rows each K chunk is expanded once for the float32 tiles (dk_q_run); below, the
   direct tiles expand it per row tile. On avx2 the expansion through a buffer cost more than two
   direct 4-row tiles up to 8 rows (5 rows: 1.20x bf16's time through the buffer). */
#define DK_Q_EXPAND_ROWS 9
#define DK_Q_KB (DK_PK_KC / DK_Q_BLOCK)  /* blocks per chunk: the float32 tiles' K chunk */


static inline long dk_q_block_bytes(int fmt) { return fmt == DK_Q4 ? 64 + 256 : 32 + 512; }
static inline long dk_q_panel_bytes(long K, int fmt) { return K / DK_Q_BLOCK * dk_q_block_bytes(fmt); }
/* Panels per work item: the GEMV tile's, the direct tile's, or (M > DK_Q_MR) the float32 tile's */
static inline long dk_q_group(long M) { return M == 1 ? DK_Q_GV : (M >= DK_Q_EXPAND_ROWS ? DK_PK_NV : DK_Q_NV); }

/* DK_VW float16 at h as float32 (exact) */
DK_AI dk_vf dk_q_f16(const uint8_t *h) {
#if DK_VW == 16
    return (dk_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#else
    return (dk_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#endif
}

/* DK_VW bytes at p, zero- (u8) or sign-extended (s8) to int32 lanes (gcc 12 left
   __builtin_convertvector from bytes as scalar inserts) */
DK_AI dk_vi dk_q_u8(const uint8_t *p) {
#if DK_VW == 16
    return (dk_vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (dk_vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}
DK_AI dk_vi dk_q_s8(const uint8_t *p) {
#if DK_VW == 16
    return (dk_vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (dk_vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

/* The weights the blocks hold, exactly as their float32 expansion (fma(d, q, m): d q is exact, one
   rounding), the one place every tile and dk_q_expand form them. Q4: the k-pair of DK_VW columns at p
   (even k in the low nibbles); Q8: one k of DK_VW columns at p. */
DK_AI void dk_q4_pair(const uint8_t *p, dk_vf d, dk_vf m, dk_vf *we, dk_vf *wo) {
    dk_vi u = dk_q_u8(p);
    *we = d * __builtin_convertvector(u & 15, dk_vf) + m;
    *wo = d * __builtin_convertvector(u >> 4, dk_vf) + m;
}
DK_AI dk_vf dk_q8_w(const uint8_t *p, dk_vf d) { return d * __builtin_convertvector(dk_q_s8(p), dk_vf); }

/* One tile: rows [0, mr) of x (row stride ldx) times panels [0, nv) of P, blocks [b0, b0 + nb) (one
   chunk), into out (row stride ldo, the first ncols <= nv * 16 columns). first: the chunk's sums are
   stored, else added to out; bias (last chunk only) is added after. As dk_pk_tile's float32 tile. */
DK_AI void dk_q_tile(const int mr, const int nv, const int fmt, long b0, long nb, const float *x, long ldx,
                     const uint8_t *P, long pstride, int first, const float *bias, float *out, long ldo,
                     long ncols) {
    dk_vf acc[DK_Q_MR][DK_Q_NVMAX * DK_Q_VPP];
    const int nvec = nv * DK_Q_VPP;
    const long bb = dk_q_block_bytes(fmt);
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nvec; v++) acc[i][v] = (dk_vf){0};
    for (long b = b0; b < b0 + nb; b++) {
        const float *xb = x + b * DK_Q_BLOCK;
        const uint8_t *blk[DK_Q_NVMAX * DK_Q_VPP];
        dk_vf d[DK_Q_NVMAX * DK_Q_VPP], m[DK_Q_NVMAX * DK_Q_VPP];
        for (int v = 0; v < nvec; v++) {
            blk[v] = P + (v / DK_Q_VPP) * pstride + b * bb;
            d[v] = dk_q_f16(blk[v] + (v % DK_Q_VPP) * 2 * DK_VW);
            if (fmt == DK_Q4) m[v] = dk_q_f16(blk[v] + 32 + (v % DK_Q_VPP) * 2 * DK_VW);
        }
        if (fmt == DK_Q4) {
            for (int p = 0; p < DK_Q_BLOCK / 2; p++) {
                if (mr == 1) {  /* the GEMV tile: each weight vector used once, at once (2 live, not
                                   2 nvec: on avx2 the 1 x 2 panel tile spilled; the same order per
                                   accumulator, even k then odd) */
                    const dk_vf xe = (dk_vf){0} + xb[2 * p], xo = (dk_vf){0} + xb[2 * p + 1];
                    for (int v = 0; v < nvec; v++) {
                        dk_vf we, wo;
                        dk_q4_pair(blk[v] + 64 + p * DK_PK_COLS + (v % DK_Q_VPP) * DK_VW, d[v], m[v], &we, &wo);
                        acc[0][v] += xe * we;
                        acc[0][v] += xo * wo;
                    }
                    continue;
                }
                dk_vf we[DK_Q_NVMAX * DK_Q_VPP], wo[DK_Q_NVMAX * DK_Q_VPP];
                for (int v = 0; v < nvec; v++)
                    dk_q4_pair(blk[v] + 64 + p * DK_PK_COLS + (v % DK_Q_VPP) * DK_VW, d[v], m[v], &we[v], &wo[v]);
                for (int i = 0; i < mr; i++) {
                    dk_vf xe = (dk_vf){0} + xb[i * ldx + 2 * p];
                    for (int v = 0; v < nvec; v++) acc[i][v] += xe * we[v];
                }
                for (int i = 0; i < mr; i++) {
                    dk_vf xo = (dk_vf){0} + xb[i * ldx + 2 * p + 1];
                    for (int v = 0; v < nvec; v++) acc[i][v] += xo * wo[v];
                }
            }
        } else {
            for (int k = 0; k < DK_Q_BLOCK; k++) {
                dk_vf w[DK_Q_NVMAX * DK_Q_VPP];
                for (int v = 0; v < nvec; v++) {
                    w[v] = dk_q8_w(blk[v] + 32 + k * DK_PK_COLS + (v % DK_Q_VPP) * DK_VW, d[v]);
                }
                for (int i = 0; i < mr; i++) {
                    dk_vf xk = (dk_vf){0} + xb[i * ldx + k];
                    for (int v = 0; v < nvec; v++) acc[i][v] += xk * w[v];
                }
            }
        }
    }
    for (int i = 0; i < mr; i++) dk_pk_store_row(acc[i], nvec, out + i * ldo, ncols, first, bias);
}

/* mr, nv and the format as compile-time constants (accumulators in registers) */
static void dk_q_tile_any(int mr, int nv, int fmt, long b0, long nb, const float *x, long ldx, const uint8_t *P,
                          long pstride, int first, const float *bias, float *out, long ldo, long ncols) {
#define DK_Q_T(MR_, NV_) \
    if (fmt == DK_Q4) dk_q_tile(MR_, NV_, DK_Q4, b0, nb, x, ldx, P, pstride, first, bias, out, ldo, ncols); \
    else dk_q_tile(MR_, NV_, DK_Q8, b0, nb, x, ldx, P, pstride, first, bias, out, ldo, ncols);
#if DK_Q_GV > DK_Q_NV
    if (mr == 1 && nv > DK_Q_NV) {  /* a GEMV over up to DK_Q_GV panels */
        if (nv == 4) { DK_Q_T(1, 4) } else if (nv == 3) { DK_Q_T(1, 3) } else { DK_Q_T(1, 2) }
        return;
    }
#endif
#if DK_Q_NV == 2
#define DK_Q_NVS(MR_) if (nv == 2) { DK_Q_T(MR_, 2) } else { DK_Q_T(MR_, 1) }
#else
#define DK_Q_NVS(MR_) DK_Q_T(MR_, 1)
#endif
    switch (mr) {
    case 1: DK_Q_NVS(1) break;
    case 2: DK_Q_NVS(2) break;
    case 3: DK_Q_NVS(3) break;
    case 4: DK_Q_NVS(4) break;
#if DK_Q_MR > 4
    case 5: DK_Q_NVS(5) break;
    case 6: DK_Q_NVS(6) break;
    case 7: DK_Q_NVS(7) break;
    case 8: DK_Q_NVS(8) break;
#endif
    }
#undef DK_Q_NVS
#undef DK_Q_T
}

/* Blocks [b0, b0 + nb) of panels [0, nv) of P as float32 in dk_packed.h's panel layout:
   buf[v * DK_PK_KC * 16 + k * 16 + j], the values the tiles above form (fma(d, q, m)) */
static void dk_q_expand(int nv, int fmt, long b0, long nb, const uint8_t *P, long pstride, float *buf) {
    const long bb = dk_q_block_bytes(fmt);
    for (int v = 0; v < nv * DK_Q_VPP; v++) {
        float *dst = buf + (v / DK_Q_VPP) * DK_PK_KC * DK_PK_COLS + (v % DK_Q_VPP) * DK_VW;
        for (long b = b0; b < b0 + nb; b++) {
            const uint8_t *blk = P + (v / DK_Q_VPP) * pstride + b * bb;
            const dk_vf d = dk_q_f16(blk + (v % DK_Q_VPP) * 2 * DK_VW);
            float *row = dst + (b - b0) * DK_Q_BLOCK * DK_PK_COLS;
            if (fmt == DK_Q4) {
                const dk_vf m = dk_q_f16(blk + 32 + (v % DK_Q_VPP) * 2 * DK_VW);
                for (int p = 0; p < DK_Q_BLOCK / 2; p++) {
                    dk_vf we, wo;
                    dk_q4_pair(blk + 64 + p * DK_PK_COLS + (v % DK_Q_VPP) * DK_VW, d, m, &we, &wo);
                    dk_store(row + 2 * p * DK_PK_COLS, we);
                    dk_store(row + (2 * p + 1) * DK_PK_COLS, wo);
                }
            } else {
                for (int k = 0; k < DK_Q_BLOCK; k++)
                    dk_store(row + k * DK_PK_COLS, dk_q8_w(blk + 32 + k * DK_PK_COLS + (v % DK_Q_VPP) * DK_VW, d));
            }
        }
    }
}

/* out[:, 16 plo : 16 phi] (clipped to N) = x (M, K; row stride ldx) W^T + bias, for the panels
   [plo, phi) of P, dk_q_group(M) at a time; per K chunk every row tile passes the group's chunk.
   M >= DK_Q_EXPAND_ROWS: each chunk is expanded once into a float32 buffer that dk_packed.h's float32 tiles
   run for every row tile (same values, same FMA order: bit-identical). Expanding per row tile cost
   the expansion's ~7 vector ops per pair row again for every DK_Q_MR rows: a 512-row prefill chunk
   spent as much on them as on its FMAs. */
static void dk_q_run(long M, long K, long N, long plo, long phi, int fmt, const float *x, long ldx,
                     const uint8_t *P, const float *bias, float *out) {
    const long pstride = dk_q_panel_bytes(K, fmt), nblk = K / DK_Q_BLOCK, gp = dk_q_group(M);
    if (M >= DK_Q_EXPAND_ROWS) {
        float buf[DK_PK_NV * DK_PK_KC * DK_PK_COLS] __attribute__((aligned(64)));  /* 48 KiB avx512, 16 avx2 */
        for (long p0 = plo; p0 < phi; p0 += gp) {
            int nv = phi - p0 < gp ? (int)(phi - p0) : (int)gp;
            long c0 = p0 * DK_PK_COLS, ncols = N - c0 < nv * DK_PK_COLS ? N - c0 : nv * DK_PK_COLS;
            for (long b0 = 0; b0 < nblk; b0 += DK_Q_KB) {
                long nb = nblk - b0 < DK_Q_KB ? nblk - b0 : DK_Q_KB, k0 = b0 * DK_Q_BLOCK;
                const float *cbias = b0 + nb == nblk && bias ? bias + c0 : NULL;
                dk_q_expand(nv, fmt, b0, nb, P + p0 * pstride, pstride, buf);
                for (long i0 = 0; i0 < M; i0 += DK_PK_MR32) {
                    int mr = M - i0 < DK_PK_MR32 ? (int)(M - i0) : DK_PK_MR32;
                    dk_pk_tile_any(mr, nv, 0, 0, nb * DK_Q_BLOCK, x + i0 * ldx + k0, ldx, buf, DK_PK_KC * DK_PK_COLS,
                                   b0 == 0, cbias, out + i0 * N + c0, N, ncols, 0, 0, NULL);
                }
            }
        }
        return;
    }
    for (long p0 = plo; p0 < phi; p0 += gp) {
        int nv = phi - p0 < gp ? (int)(phi - p0) : (int)gp;
        long c0 = p0 * DK_PK_COLS, ncols = N - c0 < nv * DK_PK_COLS ? N - c0 : nv * DK_PK_COLS;
        const uint8_t *pg = P + p0 * pstride;
        for (long b0 = 0; b0 < nblk; b0 += DK_Q_KB) {
            long nb = nblk - b0 < DK_Q_KB ? nblk - b0 : DK_Q_KB;
            const float *cbias = b0 + nb == nblk && bias ? bias + c0 : NULL;
            for (long i0 = 0; i0 < M; i0 += DK_Q_MR) {
                int mr = M - i0 < DK_Q_MR ? (int)(M - i0) : DK_Q_MR;
                dk_q_tile_any(mr, nv, fmt, b0, nb, x + i0 * ldx, ldx, pg, pstride, b0 == 0, cbias, out + i0 * N + c0,
                              N, ncols);
            }
        }
    }
}

#pragma GCC pop_options

#endif /* DK_QUANT_H */
