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

enum { DK_Q4 = 2, DK_Q8 = 3, DK_Q4X = 4, DK_Q8X = 5 };  /* linear_packed's weight formats after float32 (0) and bf16
                                                         (1); DK_Q4X / DK_Q8X: blocks x int8 activations (below) */
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


static inline long dk_q_block_bytes(int fmt) {  /* Q4, Q4X: 320; Q8: 544; Q8X: 576 */
    return fmt == DK_Q8 ? 32 + 512 : (fmt == DK_Q8X ? 64 + 512 : 64 + 256);
}
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

/* DK_VW int16 at p, sign-extended to int32 lanes */
DK_AI dk_vi dk_q_i16(const uint8_t *h) {
#if DK_VW == 16
    return (dk_vi)_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)h));
#else
    return (dk_vi)_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)h));
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

/* ---- Q4 blocks times int8 activations (format DK_Q4X): llama.cpp's arithmetic, integer dot products ----

Why: the float tiles above expand every weight (about 3.5 vector ops per 16 weights) and are bound by
that arithmetic from two rows on, so a verification of k + 1 rows costs much more than a decode step
although it streams the same bytes. Here each row's x is quantized per block of 32 k to int8 (xq =
rint(x 127 / amax), dx = amax / 127: llama.cpp's Q8 activations), and a block's sum over k is an
integer dot product of the 4-bit q with xq (vpdpbusd: 4 products a lane, or vpmaddubsw + vpmaddwd
where the tier has no VNNI: the same integers). Per block and column:
    out += (d dx) S + m sx,   S = sum_k q xq (exact int32), sx = dx sum_k xq,
each product and sum rounded once in float32, blocks in k order, the bias after. Every row is
computed alone the same way whatever M, the thread count or the tier (lossless verification needs
it); the numpy reference (dflash_kernels/quant.py) computes the same bits. Not the float32 expansion's
values: the activations are rounded to about 8 bits (docs/architecture.md).

Layout (the record of one block of one panel): DK_Q4X, 320 bytes like DK_Q4's: d[16] float16, m[16]
float16, then 4 groups of 8 k: group g is 64 bytes, 4 per column j: byte i = q[8g + i] | q[8g + 4 + i]
<< 4, so that one 32-bit lane holds 4 consecutive k of its column, low nibbles then high. DK_Q8X
(Q8_0 blocks, w = d q), 576 bytes: d[16] float16, c[16] int16 = sum_k q (per column), then 8
groups of 4 k: group g is 64 bytes, column j's lane holds q[4g .. 4g + 3] (int8). vpdpbusd takes the
unsigned operand from the activations there: xq + 128, and S = sum (xq + 128) q - 128 c. Without VNNI
(vpmaddubsw's pairs would saturate at 255 x 127 x 2) the unsigned bytes go in two nibbles, the high
one's products weighted by 16: the same integers. */
#if DK_VW == 16
#define DK_QX_MR 6  /* 6 rows x 1 panel: 12 int (two chains a row) + 6 float accumulators, 2 weights */
#else
#define DK_QX_MR 2  /* 2 rows x 1 panel (2 ymm): 4 int (8 for Q8X) + 4 float accumulators of 16 ymm */
#endif
#if DK_VW == 16 && defined(__AVX512VNNI__)
#define DK_QX_VNNI 1
#else
#define DK_QX_VNNI 0
#endif
#define DK_QX_NV 1  /* panels a tile */

/* One panel a tile for every M, a decode step's single row included: a panel's records lie one after
   the other, so a thread streams one sequential run of bytes. A decode step's tile of 4 panels (2 on
   AVX2) read 4 runs at once, interleaved block by block, and streamed SmolLM2's 30 layers of Q4_1
   from DRAM 1.21-1.30x slower on a Zen 4 (1.21-1.44x on its avx2 tier; docs/benchmarks.md, session
   30), although it ran faster warm in cache. */
static inline long dk_qx_group(long M) { (void)M; return DK_QX_NV; }

/* A tile prefetches the record this many ahead (2.5 KiB for Q4X): a layer's matmuls are 0.2-1.1 MB
   each, split over the threads, too short a run for the hardware prefetchers to reach full speed.
   SmolLM2's 120 matmuls of a decode step (Xeon with AMX, its weights in the L3; amx, avx512_bf16 and
   avx2 tiers): 0.75-0.85x the time on one thread, 0.87-0.91x on two; 3-row and 5-row blocks gained
   as much, 16 rows less; 4, 16 and 32 records ahead gained less (docs/benchmarks.md, session 31). */
#define DK_QX_PF 8

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  /* every product and sum rounded once, as numpy does */

/* Rows of x (M, K; row stride ldx) as int8 per block of 32 k: xq (M, K), dx and sx (M, K / 32). A
   block of zeros gets dx = 0; a non-finite one a non-finite dx (its outputs are then NaN). flip
   (DK_Q8X, where vpdpbusd takes the activations as its unsigned operand): xq stored as xq + 128,
   unsigned bytes (the sign bit flipped); dx and sx are the same either way. */
static void dk_qx_quantize(long M, long K, const float *x, long ldx, int flip, int8_t *xq, float *dx, float *sx) {
    const uint8_t fb = flip ? 0x80u : 0;
    const long nb = K / DK_Q_BLOCK;
    enum { NV = DK_Q_BLOCK / DK_VW };  /* vectors per block */
    for (long i = 0; i < M; i++)
        for (long b = 0; b < nb; b++) {
            const float *xb = x + i * ldx + b * DK_Q_BLOCK;
            dk_vf v[NV];
            dk_vi mx = (dk_vi){0}, nan = (dk_vi){0};
            for (int u = 0; u < NV; u++) {
                v[u] = dk_load(xb + u * DK_VW);
                dk_vi a = (dk_vi)v[u] & 0x7FFFFFFF;  /* |x| as bits: ordered like the values */
                nan |= (dk_vi)(v[u] != v[u]);
                dk_vi gt = a > mx;
                mx = (a & gt) | (mx & ~gt);
            }
            int32_t amax_bits = 0, any_nan = 0;
            for (int l = 0; l < DK_VW; l++) {
                amax_bits = mx[l] > amax_bits ? mx[l] : amax_bits;
                any_nan |= nan[l];
            }
            float amax;
            memcpy(&amax, &amax_bits, 4);
            if (any_nan) amax = __builtin_nanf("");
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            dk_vi sum = (dk_vi){0};
            for (int u = 0; u < NV; u++) {
                dk_vf r = v[u] * inv;
#if DK_VW == 16
                r = (dk_vf)_mm512_roundscale_ps((__m512)r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
                r = (dk_vf)_mm256_round_ps((__m256)r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
                r = (dk_vf)((dk_vi)r & (dk_vi)(r == r));  /* NaN (a non-finite block) -> 0 */
                dk_vi hi = r > 127.0f, lo = r < -127.0f;
                r = (dk_vf)(((dk_vi)r & ~(hi | lo)) | ((dk_vi)((dk_vf){0} + 127.0f) & hi) |
                            ((dk_vi)((dk_vf){0} - 127.0f) & lo));
                dk_vi q = __builtin_convertvector(r, dk_vi);
                sum += q;
                for (int l = 0; l < DK_VW; l++) xq[i * K + b * DK_Q_BLOCK + u * DK_VW + l] = (int8_t)((uint8_t)q[l] ^ fb);
            }
            int s = 0;
            for (int l = 0; l < DK_VW; l++) s += sum[l];
            dx[i * nb + b] = d;
            sx[i * nb + b] = d * (float)s;
        }
}

/* A block's integer sums, two chains an accumulator (the low and the high nibbles' products apart).
   With VNNI, int32 lanes: acc += the 4-byte dot products of u (unsigned bytes) and s (signed bytes),
   one vpdpbusd. Without, int16 lanes: acc += vpmaddubsw's pair sums, widened to int32 once a block
   (dk_qx_int32): u <= 15 (a nibble) and |s| <= 128 bound a pair sum by 3840, and a chain adds at most
   8 of them (30720 < 32767), so the int16 sums are exact and the block's integers the same. (Widened
   after every vpmaddubsw, as before session 30, that took 3 instructions a product vector, not 2.) */
DK_AI dk_vi dk_qx_dot(dk_vi acc, dk_vi u, dk_vi s) {
#if DK_QX_VNNI
    return (dk_vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#elif DK_VW == 16
    return (dk_vi)_mm512_add_epi16((__m512i)acc, _mm512_maddubs_epi16((__m512i)u, (__m512i)s));
#else
    return (dk_vi)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16((__m256i)u, (__m256i)s));
#endif
}

/* A chain's int16 lanes as int32 sums of pairs (without VNNI; with, the lanes are int32 already) */
DK_AI dk_vi dk_qx_int32(dk_vi acc) {
#if DK_QX_VNNI
    return acc;
#elif DK_VW == 16
    return (dk_vi)_mm512_madd_epi16((__m512i)acc, _mm512_set1_epi16(1));
#else
    return (dk_vi)_mm256_madd_epi16((__m256i)acc, _mm256_set1_epi16(1));
#endif
}

/* One tile: rows [0, mr) (xq row stride K) times panels [0, nv) of P over every block, into out
   (row stride ldo; the first ncols <= nv * 16 columns), the bias added after. */
DK_AI void dk_qx_tile(const int fmt, const int mr, const int nv, long nblk, long K, const int8_t *xq,
                      const float *dx, const float *sx, const uint8_t *P, long pstride, const float *bias,
                      float *out, long ldo, long ncols) {
    const long bb = dk_q_block_bytes(fmt);
    dk_vf acc[DK_QX_MR][DK_QX_NV * DK_Q_VPP];
    const int nvec = nv * DK_Q_VPP;
    const dk_vi low = (dk_vi){0} + 0x0F0F0F0F;
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nvec; v++) acc[i][v] = (dk_vf){0};
    for (long b = 0; b < nblk; b++) {
        /* integer sums are exact in any order: two chains (dk_qx_dot) */
        dk_vi s[2][DK_QX_MR][DK_QX_NV * DK_Q_VPP];
        const uint8_t *blk[DK_QX_NV * DK_Q_VPP];
        for (int v = 0; v < nvec; v++) blk[v] = P + (v / DK_Q_VPP) * pstride + b * bb;  /* the record */
        for (long o = 0; o < bb; o += 64)  /* the record DK_QX_PF ahead in this thread's one run of bytes */
            __builtin_prefetch(blk[0] + DK_QX_PF * bb + o, 0, 3);
        for (int c = 0; c < 2; c++)
            for (int i = 0; i < mr; i++)
                for (int v = 0; v < nvec; v++) s[c][i][v] = (dk_vi){0};
        for (int g = 0; fmt == DK_Q8X && g < 8; g++) {  /* 4 k a group; the activations unsigned (+ 128) */
            dk_vi w[DK_QX_NV * DK_Q_VPP];
            for (int v = 0; v < nvec; v++) memcpy(&w[v], blk[v] + 64 + g * 64 + (v % DK_Q_VPP) * 4 * DK_VW, sizeof w[v]);
            for (int i = 0; i < mr; i++) {
                int32_t a;  /* xq + 128: quantized with flip (dk_qx_quantize) */
                memcpy(&a, xq + i * K + b * DK_Q_BLOCK + 4 * g, 4);
                const dk_vi xa = (dk_vi){0} + a;
#if DK_QX_VNNI  /* the chains alternate by group */
                for (int v = 0; v < nvec; v++) s[g & 1][i][v] = dk_qx_dot(s[g & 1][i][v], xa, w[v]);
#else  /* vpmaddubsw's unsigned bytes would saturate its pair sums (255 x 127 x 2): the activations'
          low nibbles in chain 0, their high nibbles in chain 1 (weighted by 16 when widened) */
                const dk_vi xlo = xa & low, xhi = (dk_vi)((dk_vu)xa >> 4) & low;
                for (int v = 0; v < nvec; v++) {
                    s[0][i][v] = dk_qx_dot(s[0][i][v], xlo, w[v]);
                    s[1][i][v] = dk_qx_dot(s[1][i][v], xhi, w[v]);
                }
#endif
            }
        }
        for (int g = 0; fmt == DK_Q4X && g < 4; g++) {
            dk_vi lo[DK_QX_NV * DK_Q_VPP], hi[DK_QX_NV * DK_Q_VPP];
            for (int v = 0; v < nvec; v++) {
                dk_vi u;
                memcpy(&u, blk[v] + 64 + g * 64 + (v % DK_Q_VPP) * 4 * DK_VW, sizeof u);
                lo[v] = u & low;
                hi[v] = (dk_vi)((dk_vu)u >> 4) & low;  /* each byte's high nibble, as a logical shift */
            }
            for (int i = 0; i < mr; i++) {
                int32_t a, c;
                memcpy(&a, xq + i * K + b * DK_Q_BLOCK + 8 * g, 4);
                memcpy(&c, xq + i * K + b * DK_Q_BLOCK + 8 * g + 4, 4);
                const dk_vi xa = (dk_vi){0} + a, xc = (dk_vi){0} + c;
                for (int v = 0; v < nvec; v++) {
#if DK_QX_VNNI
                    s[0][i][v] = dk_qx_dot(s[0][i][v], lo[v], xa);
                    s[1][i][v] = dk_qx_dot(s[1][i][v], hi[v], xc);
#else  /* one int16 chain (fewer registers): 8 pair sums of at most 15 x 127 x 2 = 3810 a block */
                    s[0][i][v] = dk_qx_dot(dk_qx_dot(s[0][i][v], lo[v], xa), hi[v], xc);
#endif
                }
            }
        }
        for (int v = 0; v < nvec; v++) {
            const dk_vf d = dk_q_f16(blk[v] + (v % DK_Q_VPP) * 2 * DK_VW);
            if (fmt == DK_Q8X) {
                const dk_vi c = dk_q_i16(blk[v] + 32 + (v % DK_Q_VPP) * 2 * DK_VW) * 128;
                for (int i = 0; i < mr; i++) {
                    const dk_vi si = (DK_QX_VNNI ? s[0][i][v] + s[1][i][v]
                                                 : dk_qx_int32(s[0][i][v]) + dk_qx_int32(s[1][i][v]) * 16) - c;
                    const dk_vf ddx = d * dx[i * nblk + b];
                    acc[i][v] = acc[i][v] + ddx * __builtin_convertvector(si, dk_vf);
                }
                continue;
            }
            const dk_vf m = dk_q_f16(blk[v] + 32 + (v % DK_Q_VPP) * 2 * DK_VW);
            for (int i = 0; i < mr; i++) {
                const dk_vi si = DK_QX_VNNI ? s[0][i][v] + s[1][i][v] : dk_qx_int32(s[0][i][v]);
                const dk_vf ddx = d * dx[i * nblk + b];
                acc[i][v] = acc[i][v] + ddx * __builtin_convertvector(si, dk_vf);
                acc[i][v] = acc[i][v] + m * sx[i * nblk + b];
            }
        }
    }
    for (int i = 0; i < mr; i++) dk_pk_store_row(acc[i], nvec, out + i * ldo, ncols, 1, bias);
}

static void dk_qx_tile_any(int fmt, int mr, int nv, long nblk, long K, const int8_t *xq, const float *dx,
                           const float *sx, const uint8_t *P, long pstride, const float *bias, float *out, long ldo,
                           long ncols) {
#define DK_QX_T(MR_, NV_) \
    do { \
        if (fmt == DK_Q8X) dk_qx_tile(DK_Q8X, MR_, NV_, nblk, K, xq, dx, sx, P, pstride, bias, out, ldo, ncols); \
        else dk_qx_tile(DK_Q4X, MR_, NV_, nblk, K, xq, dx, sx, P, pstride, bias, out, ldo, ncols); \
    } while (0)
    (void)nv;  /* DK_QX_NV */
    switch (mr) {
    case 1: DK_QX_T(1, 1); break;
    case 2: DK_QX_T(2, 1); break;
#if DK_QX_MR > 2
    case 3: DK_QX_T(3, 1); break;
    case 4: DK_QX_T(4, 1); break;
    case 5: DK_QX_T(5, 1); break;
    default: DK_QX_T(6, 1);
#endif
    }
#undef DK_QX_T
}

/* out[:, 16 plo : 16 phi] (clipped to N) = the DK_Q4X product of the quantized rows (dk_qx_quantize)
   and panels [plo, phi) of P, dk_qx_group(M) panels at a time, every row tile over each group. */
static void dk_qx_run(long M, long K, long N, long plo, long phi, int fmt, const int8_t *xq, const float *dx,
                      const float *sx, const uint8_t *P, const float *bias, float *out) {
    const long nblk = K / DK_Q_BLOCK, pstride = nblk * dk_q_block_bytes(fmt), gp = dk_qx_group(M);
    for (long p0 = plo; p0 < phi; p0 += gp) {
        int nv = phi - p0 < gp ? (int)(phi - p0) : (int)gp;
        long c0 = p0 * DK_PK_COLS, ncols = N - c0 < nv * DK_PK_COLS ? N - c0 : nv * DK_PK_COLS;
        for (long i0 = 0; i0 < M; i0 += DK_QX_MR) {
            int mr = M - i0 < DK_QX_MR ? (int)(M - i0) : DK_QX_MR;
            dk_qx_tile_any(fmt, mr, nv, nblk, K, xq + i0 * K, dx + i0 * nblk, sx + i0 * nblk, P + p0 * pstride, pstride,
                           bias ? bias + c0 : NULL, out + i0 * N + c0, N, ncols);
        }
    }
}

#pragma GCC pop_options

#pragma GCC pop_options

#endif /* DK_QUANT_H */
