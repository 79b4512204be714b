/* linear over weights packed once at load ("fma-packed"): panels of 16 output columns, k-major.

Why: the k-vector register tiles of dk_dense.h (acc[i][j] += x_i[k:k+VW] * w_j[k:k+VW], the lanes
summed at the end) peak near 60% of the FMA rate even in L1: every FMA needs a fresh x or w vector
and the lanes must be reduced. With the outputs as the vector lanes instead,
    acc[i][v] += broadcast(x[i, k]) * panel[k, v*VW : (v+1)*VW],
an MR x NV tile of accumulators costs NV panel loads and MR broadcasts per MR * NV FMAs. That needs
the weights k-major, and transposing them per call costs more than it saves at M = 16 (measured:
0.83-1.02x). So they are transposed once, at load, into this layout:

    bf16 weights (N, K) -> uint16 P[N16][K2][16][2], N16 = ceil(N / 16), K2 = 16 ceil(K / 32),
                           P[p][q][j][e] = w[16 p + j, 2 q + e]  (zero beyond N and K)
    fp32 weights (N, K) -> float  P[N16][K][16],     P[p][k][j]  = w[16 p + j, k]

A bf16 k-pair row of a panel is one 64-byte line of 16 32-bit words (the layout AMX and vdpbf16ps
call VNNI): the low half of a word is the even-k weight, the high half the odd-k one, so
word << 16 and word & 0xFFFF0000 are their fp32 values, one ALU op per 16 (avx512) or 8 (avx2)
weights, with no shuffle. Each panel is one contiguous stream, which the hardware prefetchers
follow; M = 1 reads it once, at streaming speed. 16 k-pair rows of a panel are also an AMX B tile
(1 KiB, contiguous), which the AMX-packed path at the end of this file loads as they are.

Summation order: per output, k ascending within a K chunk of DK_PK_KC, chunk sums added to out in
chunk order. It depends on neither the thread count nor M (row i's result is the same whatever
rows come with it), and the bf16 and fp32 layouts sum identically. */
#ifndef DK_PACKED_H
#define DK_PACKED_H

#include <stdlib.h>

#include "dk_dense.h"
#include "dk_amx.h"

/* The extensions are built with -fassociative-math (setup.py), under which gcc turned
   acc += xe * we; acc += xo * wo into a multiply, an FMA and an add (3 ops for 2). This header's
   sums are written in the order they should run. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#define DK_PK_COLS 16                  /* output columns per panel, every tier */
#define DK_PK_VPP (DK_PK_COLS / DK_VW) /* vectors per panel row: 1 zmm, 2 ymm */
#if DK_VW == 16
#define DK_PK_MR 8                     /* 8 rows x 3 panels: 24 zmm accumulators of 32 */
#define DK_PK_NV 3
#else
/* 4 rows x 1 panel (2 ymm): 8 of 16 ymm. 6 rows (12 accumulators) left too few registers for the
   bf16 pair's two weight vectors, the mask and the broadcast: gcc spilled an accumulator every
   k-pair (a vmovaps to the stack inside the loop, `gcc -S -march=x86-64-v3`). With 4 rows and the
   prefetch below, avx2 "highest" at M = 16 ran 1.02-1.33x faster on a Zen 4 (bench/linear_ab.py,
   docs/benchmarks.md, session 9). */
#define DK_PK_MR 4
#define DK_PK_NV 1
#endif
/* avx2, fp32 tiles of up to 6 rows (12 accumulators, 2 weight vectors and the broadcast: 15 ymm).
   The 4 x 16 bf16 tile is bound by FMA latency, not rate: Zen 2 needs 10 FMAs in flight (2 pipes x
   5 cycles) and 8 accumulators give 8, so it ran at 74-79% of the FMA peak on L1-resident data, where
   a 6 x 16 fp32 tile ran at 99-103% (bench/avx2_tiles.c, Zen 2). So with bf16 weights each K chunk
   of the panel is upcast once (exactly) into an L1 buffer that every row tile then reads, whenever
   the rows split into tiles of at least 5 (dk_pk_upcast_tiles): 16 rows as 6 + 5 + 5. 8 rows stay
   on the bf16 tile (4 + 4: the upcast cost more than it saved). The sums run in the same order
   either way, so the results are bit-identical. Measured in docs/benchmarks.md, session 11. */
#if DK_VW == 8
#define DK_PK_MR32 6
#define DK_PK_UPCAST 1
#else
#define DK_PK_MR32 DK_PK_MR
#define DK_PK_UPCAST 0
#endif
#define DK_PK_MRMAX (DK_PK_MR32 > DK_PK_MR ? DK_PK_MR32 : DK_PK_MR)
/* Panels per tile for M = 1 (a decode step's GEMV). One row over one avx2 panel has 2 accumulators,
   each taking 2 dependent FMAs per k-pair: 10 cycles per 64-byte pair row, ~19 GB/s a core, which
   bounds weights that sit in L2 / L3 (a small model's decode; from DRAM the bus bounds first). 4
   panels give 8 independent chains. Each output still sums k in the same order, so the bits equal
   those of any M. */
#if DK_VW == 8
#define DK_PK_GV 4
#else
#define DK_PK_GV DK_PK_NV
#endif
#define DK_PK_NVMAX (DK_PK_GV > DK_PK_NV ? DK_PK_GV : DK_PK_NV)

/* Panels per work item (a thread's unit in linear_packed) for M rows */
static inline long dk_pk_group(long M) { return M == 1 ? DK_PK_GV : DK_PK_NV; }
#ifndef DK_PK_KC
#define DK_PK_KC 256                   /* k per chunk: NV panels' chunk stays in L1 for every row tile */
#endif
#ifndef DK_PK_PF
#define DK_PK_PF 1024                  /* prefetch distance (bytes) along each panel in a chunk's first row tile */
#endif

/* K of a bf16 panel, padded with zero pairs to whole AMX steps of 32 (so that the AMX-packed path
   below reads the same layout) */
static inline long dk_pk_kpad(long K) { return (K + 31) / 32 * 32; }

/* Elements (uint16 or float) per panel */
static inline long dk_pk_panel_elems(long K, int bf16) {
    return bf16 ? dk_pk_kpad(K) * DK_PK_COLS : K * DK_PK_COLS;
}

/* A tile row's nvec accumulators into o: stored (first) or added to it, then the bias; where
   ncols < nvec * DK_VW (the last panel group, N % 16 != 0) element by element through a buffer
   (indexing acc at run time would move every accumulator out of registers). Also dk_quant.h's. */
#define DK_PK_ROW_MAX 64  /* floats of a tile row: 4 panels (dk_quant.h's GEMV tile) */
DK_AI void dk_pk_store_row(const dk_vf *acc, const int nvec, float *o, long ncols, int first,
                           const float *bias) {
    if (ncols == nvec * DK_VW) {
        for (int v = 0; v < nvec; v++) {
            dk_vf s = acc[v];
            if (!first) s += dk_load(o + v * DK_VW);
            if (bias) s += dk_load(bias + v * DK_VW);
            dk_store(o + v * DK_VW, s);
        }
        return;
    }
    float t[DK_PK_ROW_MAX];
    for (int v = 0; v < nvec; v++) dk_store(t + v * DK_VW, acc[v]);
    for (long j = 0; j < ncols; j++) {
        float s = t[j];
        if (!first) s += o[j];
        if (bias) s += bias[j];
        o[j] = s;
    }
}

/* One tile: rows [0, mr) of x (row stride ldx) times panels [0, nv) of P from k0 for kc k (k0, kc
   even, except a last odd kc), into out (row stride ldo; the first ncols <= nv * 16 columns). first:
   the chunk's sums are stored, else added to out; bias (last chunk only) is added after. pf, pfnext:
   prefetches along the panels (see dk_pk_next_chunk); pfup (fp32 tiles over an upcast chunk): bf16
   bytes to ask into L2, 32 per k. upst (bf16, nv = 1): the upcast weights are also stored there,
   buf[k * 16 + j] for k < kc, for the fp32 tiles of the other rows (dk_pk_run). */
DK_AI void dk_pk_tile(const int mr, const int nv, const int bf16, long k0, long kc, const float *x,
                      long ldx, const void *P, long pstride, int first, const float *bias, float *out,
                      long ldo, long ncols, int pf, long pfnext, const char *pfup, float *upst) {
    dk_vf acc[DK_PK_MRMAX][DK_PK_NVMAX * DK_PK_VPP];
    const int nvec = nv * DK_PK_VPP;
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nvec; v++) acc[i][v] = (dk_vf){0};
    if (bf16) {
        const uint16_t *p = (const uint16_t *)P + k0 / 2 * 32;
        long pairs = kc / 2;
        for (long q = 0; q < pairs; q++) {
            const float *xk = x + k0 + 2 * q;
            /* even k for every row, then odd k: nvec weight vectors live at a time, not 2 nvec
               (8 x 3 tile: 24 accumulators + 3 + a broadcast fit the 32 zmm) */
            dk_vu u[DK_PK_NVMAX * DK_PK_VPP];
            dk_vf w[DK_PK_NVMAX * DK_PK_VPP];
            if (pf)
                for (int v = 0; v < nvec; v += DK_PK_VPP)
                    __builtin_prefetch(p + (v / DK_PK_VPP) * pstride + q * 32 + DK_PK_PF / 2, 0, 3);
            if (pfnext)
                for (int v = 0; v < nvec; v += DK_PK_VPP)
                    __builtin_prefetch(p + (v / DK_PK_VPP) * pstride + q * 32 + pfnext, 0, 2);
            if (mr == 1 && nv > DK_PK_NV) {  /* the GEMV tile: each weight vector used once, at once
                                                (the same order per accumulator: even k, then odd) */
                const dk_vf xe = (dk_vf){0} + xk[0], xo = (dk_vf){0} + xk[1];
#pragma GCC unroll 8
                for (int v = 0; v < nvec; v++) {
                    dk_vu uv;
                    memcpy(&uv, p + (v / DK_PK_VPP) * pstride + q * 32 + (v % DK_PK_VPP) * 2 * DK_VW, sizeof uv);
                    acc[0][v] += xe * (dk_vf)(uv << 16);
                    acc[0][v] += xo * (dk_vf)(uv & 0xFFFF0000u);
                }
                continue;
            }
            for (int v = 0; v < nvec; v++) {
                memcpy(&u[v], p + (v / DK_PK_VPP) * pstride + q * 32 + (v % DK_PK_VPP) * 2 * DK_VW, sizeof u[v]);
                w[v] = (dk_vf)(u[v] << 16);
                if (upst) dk_store(upst + 2 * q * DK_PK_COLS + v * DK_VW, w[v]);
            }
            for (int i = 0; i < mr; i++) {
                dk_vf xe = (dk_vf){0} + xk[i * ldx];
                for (int v = 0; v < nvec; v++) acc[i][v] += xe * w[v];
            }
            for (int v = 0; v < nvec; v++) {
                w[v] = (dk_vf)(u[v] & 0xFFFF0000u);
                if (upst) dk_store(upst + (2 * q + 1) * DK_PK_COLS + v * DK_VW, w[v]);
            }
            for (int i = 0; i < mr; i++) {
                dk_vf xo = (dk_vf){0} + xk[i * ldx + 1];
                for (int v = 0; v < nvec; v++) acc[i][v] += xo * w[v];
            }
        }
        if (kc % 2) {  /* odd K: the last pair holds one weight (x[K] does not exist) */
            const float *xk = x + k0 + 2 * pairs;
            for (int v = 0; v < nvec; v++) {
                dk_vu u;
                memcpy(&u, p + (v / DK_PK_VPP) * pstride + pairs * 32 + (v % DK_PK_VPP) * 2 * DK_VW, sizeof u);
                dk_vf w = (dk_vf)(u << 16);
                if (upst) dk_store(upst + 2 * pairs * DK_PK_COLS + v * DK_VW, w);
                for (int i = 0; i < mr; i++) acc[i][v] += ((dk_vf){0} + xk[i * ldx]) * w;
            }
        }
    } else {
        const float *p = (const float *)P + k0 * DK_PK_COLS;
        for (long k = 0; k < kc; k++) {
            dk_vf w[DK_PK_NVMAX * DK_PK_VPP];
#pragma GCC unroll 8
            for (int v = 0; v < nvec; v++)
                w[v] = dk_load(p + (v / DK_PK_VPP) * pstride + k * DK_PK_COLS + (v % DK_PK_VPP) * DK_VW);
            if (pfnext)
                for (int v = 0; v < nvec; v += DK_PK_VPP)
                    __builtin_prefetch(p + (v / DK_PK_VPP) * pstride + k * DK_PK_COLS + pfnext, 0, 2);
            if (pfup) __builtin_prefetch(pfup + k * 2 * DK_PK_COLS, 0, 2);
            for (int i = 0; i < mr; i++) {
                dk_vf xb = (dk_vf){0} + x[i * ldx + k0 + k];
#pragma GCC unroll 8
                for (int v = 0; v < nvec; v++) acc[i][v] += xb * w[v];
            }
        }
    }
    for (int i = 0; i < mr; i++) dk_pk_store_row(acc[i], nvec, out + i * ldo, ncols, first, bias);
}

/* Where the last row tile of a K chunk prefetches from, relative to the chunk (in elements of the
   panel; 0: no prefetch): the same panels' next chunk, or after the last chunk the next group's
   first. Into L2 while that tile computes from L1, so that DRAM streams all the time: without it
   a chunk's first row tile waited on DRAM and the others on nothing. With one row tile (M <= MR)
   there is no later tile to overlap with (tried there: faster on some shapes, slower on others).
   On a Zen 4 at M = 16 (bench/linear_ab.py, docs/benchmarks.md, session 9): the vdpbf16ps tile
   ("medium") 1.02-1.18x, the avx512 FMA tile, which the FMA rate bounds, unchanged; into L1, or
   from every row tile, was slower. at: the chunk's offset in its panel; chunk: elements per chunk. */
static inline long dk_pk_next_chunk(long M, long i, int last, int nv, long pstride, long at, long chunk) {
    if (M <= DK_PK_MR || i + DK_PK_MR < M) return 0;
    return last ? nv * pstride - at : chunk;
}

/* mr and nv as compile-time constants (accumulators in registers) */
static void dk_pk_tile_any(int mr, int nv, int bf16, long k0, long kc, const float *x, long ldx,
                           const void *P, long pstride, int first, const float *bias, float *out,
                           long ldo, long ncols, int pf, long pfnext, const char *pfup) {
#define DK_PK_T(MR_, NV_) \
    if (bf16) dk_pk_tile(MR_, NV_, 1, k0, kc, x, ldx, P, pstride, first, bias, out, ldo, ncols, pf, pfnext, pfup, NULL); \
    else dk_pk_tile(MR_, NV_, 0, k0, kc, x, ldx, P, pstride, first, bias, out, ldo, ncols, pf, pfnext, pfup, NULL);
#define DK_PK_T32(MR_) \
    dk_pk_tile(MR_, 1, 0, k0, kc, x, ldx, P, pstride, first, bias, out, ldo, ncols, pf, pfnext, pfup, NULL);
#if DK_PK_NV == 3
#define DK_PK_NVS(MR_) \
    if (nv == 3) { DK_PK_T(MR_, 3) } else if (nv == 2) { DK_PK_T(MR_, 2) } else { DK_PK_T(MR_, 1) }
#else
#define DK_PK_NVS(MR_) DK_PK_T(MR_, 1)
#endif
#if DK_PK_GV > DK_PK_NV
    if (mr == 1 && nv > DK_PK_NV) {  /* a GEMV over up to DK_PK_GV panels */
        if (nv == 4) { DK_PK_T(1, 4) } else if (nv == 3) { DK_PK_T(1, 3) } else { DK_PK_T(1, 2) }
        return;
    }
#endif
    switch (mr) {
    case 1: DK_PK_NVS(1) break;
    case 2: DK_PK_NVS(2) break;
    case 3: DK_PK_NVS(3) break;
    case 4: DK_PK_NVS(4) break;
#if DK_PK_MR > 4
    case 5: DK_PK_NVS(5) break;
    case 6: DK_PK_NVS(6) break;
    case 7: DK_PK_NVS(7) break;
    case 8: DK_PK_NVS(8) break;
#elif DK_PK_MR32 > 4
    case 5: DK_PK_T32(5) break;  /* fp32 tiles only: a bf16 tile of these heights would spill */
    case 6: DK_PK_T32(6) break;
#endif
    }
#undef DK_PK_NVS
#undef DK_PK_T
#undef DK_PK_T32
}

#if DK_PK_UPCAST
/* buf[k * 16 + j] = the fp32 weight of column j at k, k < kc, from a chunk's pair rows at p (one panel) */
static void dk_pk_upcast(const uint16_t *p, long kc, float *buf) {
    long pairs = kc / 2;
    for (long q = 0; q < pairs; q++)
        for (int v = 0; v < DK_PK_VPP; v++) {
            dk_vu u;
            memcpy(&u, p + q * 32 + v * 2 * DK_VW, sizeof u);
            dk_store(buf + 2 * q * DK_PK_COLS + v * DK_VW, (dk_vf)(u << 16));
            dk_store(buf + (2 * q + 1) * DK_PK_COLS + v * DK_VW, (dk_vf)(u & 0xFFFF0000u));
        }
    if (kc % 2)  /* odd K: the last pair holds one weight */
        for (int v = 0; v < DK_PK_VPP; v++) {
            dk_vu u;
            memcpy(&u, p + pairs * 32 + v * 2 * DK_VW, sizeof u);
            dk_store(buf + 2 * pairs * DK_PK_COLS + v * DK_VW, (dk_vf)(u << 16));
        }
}
#endif

/* Row tiles when bf16 chunks are upcast (see DK_PK_MR32): nt balanced tiles of at most DK_PK_MR32
   rows if each gets at least 5, else 0 (the bf16 tile, DK_PK_MR rows at a time) */
static inline long dk_pk_upcast_tiles(long M) {
#if DK_PK_UPCAST
    if (M < 5) return 0;
    long nt = (M + DK_PK_MR32 - 1) / DK_PK_MR32;
    return M / nt >= 5 ? nt : 0;
#else
    (void)M;
    return 0;
#endif
}

/* out[:, 16 plo : 16 phi] (clipped to N) = x (M, K; row stride ldx) W^T + bias, for the panels
   [plo, phi) of P, dk_pk_group(M) at a time: for each K chunk, the group's chunk of panels stays in L1
   while every DK_PK_MR-row tile of x passes it (or, upcast, the chunk's fp32 copy does).
   Upcast (avx2, see DK_PK_MR32): when the rows after the first DK_PK_MR split into fp32 tiles of
   at least 5, the first DK_PK_MR rows run the bf16 tile, which stores the chunk's fp32 copy as it
   goes (16 rows: 4 + 6 + 6); else, if all rows split so, the chunk is upcast on its own first
   (6 rows: 6). The fused store overlaps the bf16 tile's FMAs; a separate upcast, bound by one
   store a cycle, cost about an eighth of a 16-row chunk's FMA time. */
static void dk_pk_run(long M, long K, long N, long plo, long phi, int bf16, const float *x, long ldx,
                      const void *P, const float *bias, float *out) {
    const long pstride = dk_pk_panel_elems(K, bf16), esz = bf16 ? 2 : 4;
#if DK_PK_UPCAST
    const long fz = bf16 && dk_pk_upcast_tiles(M - DK_PK_MR) ? DK_PK_MR : 0;  /* rows of the fused tile */
    const long nt = bf16 ? dk_pk_upcast_tiles(M - fz) : 0;  /* fp32 tiles after it */
    float up[DK_PK_KC * DK_PK_COLS] __attribute__((aligned(64)));  /* 16 KiB */
#endif
    const long gp = dk_pk_group(M);
    for (long p0 = plo; p0 < phi; p0 += gp) {
        int nv = phi - p0 < gp ? (int)(phi - p0) : (int)gp;
        long c0 = p0 * DK_PK_COLS, ncols = N - c0 < nv * DK_PK_COLS ? N - c0 : nv * DK_PK_COLS;
        const char *pg = (const char *)P + p0 * pstride * esz;
        for (long k0 = 0; k0 < K; k0 += DK_PK_KC) {
            long kc = K - k0 < DK_PK_KC ? K - k0 : DK_PK_KC;
            int first = k0 == 0, last = k0 + kc == K;
            const float *cbias = last && bias ? bias + c0 : NULL;
#if DK_PK_UPCAST
            if (nt) {  /* one panel (nv = 1); the first fp32 tile asks the next chunk (or the next
                          panel's first; panels are contiguous) into L2: spread over a 6-row tile,
                          the requests ran 0-6% faster (bench/linear_ab.py) than from the fused
                          tile, which takes a quarter of the time */
                long to_next = last ? pstride - k0 * DK_PK_COLS : DK_PK_KC * DK_PK_COLS;  /* elements */
                if (fz)
                    dk_pk_tile(DK_PK_MR, 1, 1, k0, kc, x, ldx, pg, pstride, first, cbias, out + c0, N, ncols,
                               1, 0, NULL, up);
                else
                    dk_pk_upcast((const uint16_t *)pg + k0 * DK_PK_COLS, kc, up);
                for (long t = 0, i = fz, mr; i < M; i += mr, t++) {
                    mr = (M - fz) / nt + (t < (M - fz) % nt);
                    dk_pk_tile_any((int)mr, 1, 0, 0, kc, x + i * ldx + k0, ldx, up, 0, first, cbias,
                                   out + i * N + c0, N, ncols, 0, 0,
                                   t == 0 ? pg + (k0 * DK_PK_COLS + to_next) * esz : NULL);
                }
                continue;
            }
#endif
            for (long i = 0; i < M; i += DK_PK_MR) {
                int mr = M - i < DK_PK_MR ? (int)(M - i) : DK_PK_MR;
                dk_pk_tile_any(mr, nv, bf16, k0, kc, x + i * ldx, ldx, pg, pstride, first, cbias,
                               out + i * N + c0, N, ncols, i == 0,
                               dk_pk_next_chunk(M, i, last, nv, pstride, k0 * DK_PK_COLS, DK_PK_KC * DK_PK_COLS),
                               NULL);
            }
        }
    }
}

/* ---- AMX-BF16 over the packed layout ("amx-packed") -------------------------------------------

   out = x W^T as C (16 rows x 16 columns, fp32) += A (16 x rows, 32 k of one activation part, bf16)
   . B (16 k-pairs of one panel: 1 KiB, contiguous in P). The activations are split into `parts`
   bf16 parts (dk_bf16dot.h) once per call, K padded to dk_pk_kpad(K) and the rows to a multiple of
   16 (zeros), and stored as contiguous A tiles (dk_pk_amx_split, tiled). Tiles: 0-1 accumulate
   two panels (32 output columns), 2-3 hold their B tiles, 4-6 the A tiles of the parts; both B
   tiles are loaded before the products (dk_amx.h: a reload waits for the products reading it). */

/* Rows of the activation planes for M rows (a multiple of 16) */
static long dk_pk_amx_rows(long M) { return (M + 15) / 16 * 16; }

/* Split x (M, K; row stride ldx) into `parts` planes of (dk_pk_amx_rows(M), dk_pk_kpad(K)) bf16
   (zeros past M and K), rows [m0, m1) only. tiled = 0: plane q row-major (the bf16dot-packed
   layout); tiled = 1: AMX A tiles, each contiguous, [m block][K step of 32][part][16 rows][32]
   (a tile load then reads 1 KiB in sequence: re-read from L2 for every pair of panels, the
   row-major planes' 16 strided lines per tile ran amx-packed below the row-major AMX path).
   Returns 0 when those rows hold inf or NaN (the parts of inf are NaN: the caller takes the FMA
   path, IEEE results). */
static int dk_pk_amx_split(long m0, long m1, long M, long K, const float *x, long ldx, int parts,
                           int tiled, uint16_t *xb) {
    const long kp = dk_pk_kpad(K), plane = dk_pk_amx_rows(M) * kp;
    uint32_t bad = 0;
    uint16_t *row = tiled ? (uint16_t *)malloc(3 * kp * sizeof(uint16_t)) : NULL;
    if (tiled && !row) return 0;
    for (long m = m0; m < m1; m++) {
        uint16_t *p0 = tiled ? row : xb + m * kp;
        uint16_t *p1 = tiled ? row + kp : xb + plane + m * kp, *p2 = tiled ? row + 2 * kp : xb + 2 * plane + m * kp;
        long from = m < M ? K : 0;
        if (m < M) bad |= dk_split_run(x + m * ldx, K, parts, p0, parts > 1 ? p1 : NULL, parts > 2 ? p2 : NULL);
        uint16_t *ps[3] = {p0, p1, p2};
        for (int q = 0; q < parts; q++) memset(ps[q] + from, 0, (kp - from) * sizeof(uint16_t));
        if (tiled) {
            long mb = m / 16, r = m % 16, nsteps = kp / 32;
            for (long st = 0; st < nsteps; st++)
                for (int q = 0; q < parts; q++)
                    memcpy(xb + (((mb * nsteps + st) * parts + q) * 16 + r) * 32, ps[q] + st * 32, 64);
        }
    }
    free(row);
    return bad == 0;
}

#ifndef DK_PK_AMX_PF
#define DK_PK_AMX_PF 8  /* B-tile prefetch distance, in K steps of 32 (2 KiB per panel) */
#endif

#if DK_AMX_BUILT
/* C tile t (16 x 16 fp32: rows m0.., columns c0..) into out, clipped to M x N, plus bias */
DK_AI_AMX void dk_pk_amx_store(const int t, long M, long N, long m0, long c0, const float *bias, float *out) {
    float tmp[256] __attribute__((aligned(64)));
    long rows = M - m0 < 16 ? M - m0 : 16, cols = N - c0 < DK_PK_COLS ? N - c0 : DK_PK_COLS;
    float *o = out + m0 * N + c0;
    if (rows <= 0 || cols <= 0) return;
    int direct = rows == 16 && cols == 16;  /* straight into out */
    float *dst = direct ? o : tmp;
    long ld = direct ? N * 4 : 64;
    switch (t) {  /* a tile number is an immediate: the switch folds once inlined */
    case 0: _tile_stored(0, dst, ld); break;
    case 1: _tile_stored(1, dst, ld); break;
    case 2: _tile_stored(2, dst, ld); break;
    default: _tile_stored(3, dst, ld); break;
    }
    if (direct) {
        if (bias)
            for (long i = 0; i < 16; i++)
                for (long j = 0; j < 16; j++) o[i * N + j] += bias[c0 + j];
        return;
    }
    for (long i = 0; i < rows; i++)
        for (long j = 0; j < cols; j++) {
            float v = tmp[i * 16 + j];
            o[i * N + j] = bias ? v + bias[c0 + j] : v;
        }
}

/* The B tiles DK_PK_AMX_PF steps ahead, into L2: two sequential streams alone left the tile loads
   waiting on L3 (the row-major path's 16 strided rows keep more lines in flight) */
DK_AI_AMX void dk_pk_amx_prefetch(const uint16_t *b0, const uint16_t *b1, long s, int np) {
    for (int l = 0; l < 16; l++) {
        __builtin_prefetch(b0 + (s + DK_PK_AMX_PF) * 512 + l * 32, 0, 2);
        if (np > 1) __builtin_prefetch(b1 + (s + DK_PK_AMX_PF) * 512 + l * 32, 0, 2);
    }
}

/* out[m0 : m1, 16 p0 : 16 (p0 + np)] (clipped to N) for panels p0, p0 + 1 (np = 2) or p0 alone
   (np = 1), one m block of 16 rows at a time; pf: prefetch the panels in the first block */
DK_AI_AMX void dk_pk_amx_p(const int parts, long M, long K, long N, long m0, long m1, long p0, int np,
                           int pf, const uint16_t *xb, const uint16_t *P, const float *bias, float *out) {
    const long kp = dk_pk_kpad(K), nsteps = kp / 32, pstride = dk_pk_panel_elems(K, 1);
    const uint16_t *b0 = P + p0 * pstride, *b1 = b0 + pstride;
    for (; m0 < m1; m0 += 16, pf = 0) {
        const uint16_t *a = xb + m0 / 16 * nsteps * parts * 512;  /* this m block's tiles */
        _tile_zero(0);
        _tile_zero(1);
        for (long s = 0; s < nsteps; s++, a += parts * 512) {
            if (pf) dk_pk_amx_prefetch(b0, b1, s, np);
            _tile_loadd(2, b0 + s * 512, 64);
            if (np > 1) _tile_loadd(3, b1 + s * 512, 64);
            _tile_loadd(4, a, 64);
            if (parts > 1) _tile_loadd(5, a + 512, 64);
            if (parts > 2) _tile_loadd(6, a + 1024, 64);
            _tile_dpbf16ps(0, 4, 2);
            if (np > 1) _tile_dpbf16ps(1, 4, 3);
            if (parts > 1) { _tile_dpbf16ps(0, 5, 2); if (np > 1) _tile_dpbf16ps(1, 5, 3); }
            if (parts > 2) { _tile_dpbf16ps(0, 6, 2); if (np > 1) _tile_dpbf16ps(1, 6, 3); }
        }
        dk_pk_amx_store(0, M, N, m0, p0 * DK_PK_COLS, bias, out);
        if (np > 1) dk_pk_amx_store(1, M, N, m0, (p0 + 1) * DK_PK_COLS, bias, out);
    }
}

/* Two m blocks x two panels (rows m0 .. m0 + 31, panels p0, p0 + 1), K steps [s0, s1): C tiles 0-3,
   A tiles 4-5 (one part of each block at a time), B tiles 6-7. Each loaded tile serves two
   products, where the one-block kernel above loads a B tile per product. The C tiles start from
   zero at s0 = 0, else from c (4 x 256 floats: the sums so far), and go back to c, or to out
   (clipped, plus the bias) after the last step: exact fp32 round trips, and the parts run in the
   same order per step as above, so the sums are bit-identical to the one-block kernel's. */
DK_AI_AMX void dk_pk_amx_2x2(const int parts, long M, long K, long N, long m0, long p0, long s0, long s1,
                             const uint16_t *xb, const uint16_t *P, const float *bias, float *out, float *c) {
    const long kp = dk_pk_kpad(K), nsteps = kp / 32, pstride = dk_pk_panel_elems(K, 1);
    const uint16_t *b0 = P + p0 * pstride, *b1 = b0 + pstride;
    const uint16_t *a0 = xb + (m0 / 16 * nsteps + s0) * parts * 512, *a1 = a0 + nsteps * parts * 512;
    if (s0 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    else {
        _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64);
        _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64);
    }
    for (long s = s0; s < s1; s++, a0 += parts * 512, a1 += parts * 512) {
        if (m0 == 0) dk_pk_amx_prefetch(b0, b1, s, 2);
        _tile_loadd(6, b0 + s * 512, 64);
        _tile_loadd(7, b1 + s * 512, 64);
        for (int q = 0; q < parts; q++) {
            _tile_loadd(4, a0 + q * 512, 64);
            _tile_loadd(5, a1 + q * 512, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (s1 < nsteps) {
        _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
        return;
    }
    dk_pk_amx_store(0, M, N, m0, p0 * DK_PK_COLS, bias, out);
    dk_pk_amx_store(1, M, N, m0, (p0 + 1) * DK_PK_COLS, bias, out);
    dk_pk_amx_store(2, M, N, m0 + 16, p0 * DK_PK_COLS, bias, out);
    dk_pk_amx_store(3, M, N, m0 + 16, (p0 + 1) * DK_PK_COLS, bias, out);
}

#ifndef DK_PK_AMX_GROUP
#define DK_PK_AMX_GROUP 8  /* pairs of panels per group on the 2 x 2 kernel */
#endif
#ifndef DK_PK_AMX_ABYTES
#define DK_PK_AMX_ABYTES (512L << 10)  /* activation tiles per K chunk, all rows: stay in L2 */
#endif

/* Panels [plo, phi) (plo even: pairs as every thread split pairs them), all M rows.
   Rows 0 .. 32 (M / 32) - 1 run on the 2 x 2 kernel by groups of DK_PK_AMX_GROUP pairs of panels and,
   within a group, K chunk by K chunk: a chunk's activation tiles (all rows, DK_PK_AMX_ABYTES) serve
   every pair of the group from L2, a pair's chunk of B every pair of m blocks from L1, and the
   group's partial sums (cacc, GROUP x M / 32 x 4 KiB) stay in L2. Tiles from L3 run at a quarter of
   the AMX peak on this class (one pass over K per pair of panels read the activations from L3 for
   every pair: about 20% of the peak at M = 512); tiles from L2 at three quarters (bench/amx_tiles.c,
   session 18). The rest
   (an odd last m block, a last pair that is a single panel) on the one-block kernel. */
DK_AI_AMX void dk_pk_amx_run_p(const int parts, long M, long K, long N, long plo, long phi, const uint16_t *xb,
                               const uint16_t *P, const float *bias, float *out) {
    const long nsteps = dk_pk_kpad(K) / 32, mpairs = M / 32, pfull = plo + (phi - plo) / 2 * 2;
    long ks = DK_PK_AMX_ABYTES / (M * 64 * parts);
    ks = ks < 4 ? 4 : ks > nsteps ? nsteps : ks;
    float *cacc = mpairs ? (float *)aligned_alloc(64, DK_PK_AMX_GROUP * mpairs * 1024 * sizeof(float)) : NULL;
    if (cacc)
        for (long g0 = plo; g0 < pfull; g0 += 2 * DK_PK_AMX_GROUP) {
            long g1 = pfull - g0 < 2 * DK_PK_AMX_GROUP ? pfull : g0 + 2 * DK_PK_AMX_GROUP;
            for (long s0 = 0; s0 < nsteps; s0 += ks)
                for (long p = g0; p < g1; p += 2)
                    for (long i = 0; i < mpairs; i++)
                        dk_pk_amx_2x2(parts, M, K, N, 32 * i, p, s0, s0 + ks < nsteps ? s0 + ks : nsteps, xb, P,
                                      bias, out, cacc + ((p - g0) / 2 * mpairs + i) * 1024);
        }
    for (long p = plo; p < phi; p += 2) {
        int np = phi - p < 2 ? 1 : 2;
        long m0 = cacc && p < pfull ? 32 * mpairs : 0;
        if (m0 < M) dk_pk_amx_p(parts, M, K, N, m0, M, p, np, m0 == 0, xb, P, bias, out);
    }
    free(cacc);
}

/* parts as a compile-time constant in each copy; the caller has run dk_amx_begin on this thread */
static void dk_pk_amx_run(long M, long K, long N, long plo, long phi, int parts, const uint16_t *xb,
                          const uint16_t *P, const float *bias, float *out) {
    if (parts == 1) dk_pk_amx_run_p(1, M, K, N, plo, phi, xb, P, bias, out);
    else if (parts == 2) dk_pk_amx_run_p(2, M, K, N, plo, phi, xb, P, bias, out);
    else dk_pk_amx_run_p(3, M, K, N, plo, phi, xb, P, bias, out);
}
#else
static void dk_pk_amx_run(long M, long K, long N, long plo, long phi, int parts, const uint16_t *xb,
                          const uint16_t *P, const float *bias, float *out) {
    (void)M; (void)K; (void)N; (void)plo; (void)phi; (void)parts; (void)xb; (void)P; (void)bias; (void)out;
}
#endif

/* ---- vdpbf16ps over the packed layout ("bf16dot-packed", AVX512-BF16 without AMX) ---------------

   "high" / "medium" on a CPU whose vdpbf16ps issues like an FMA (Zen 4: twice the FMA path's
   multiply-adds per instruction). A packed k-pair row of a panel is the vdpbf16ps B operand as it
   is; the A operand is one activation part's k-pair of row i, broadcast as a 32-bit word:
       acc[i][v] = vdpbf16ps(acc[i][v], broadcast(xpart[i, 2q : 2q + 2]), P[v][q])
   an 8 x 3 tile of 16-column accumulators, as the FMA tiles. The activation parts are the planes of
   dk_pk_amx_split (K zero-padded to dk_pk_kpad, so no tail). vdpbf16ps treats bf16 denormals as zero
   (as the row-major bf16dot path does); products are otherwise exact and the sums fp32. */
#if DK_DP_BUILT
DK_AI void dk_pkdp_tile(const int mr, const int nv, const int parts, long q0, long nq, const uint32_t *xw,
                        long ldxw, long planew, const uint32_t *Pw, long pstridew, int first,
                        const float *bias, float *out, long ldo, long ncols, long pfnext) {
    __m512 acc[DK_PK_MR][DK_PK_NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = _mm512_setzero_ps();
    for (long q = q0; q < q0 + nq; q++) {
        __m512i w[DK_PK_NV];
        for (int v = 0; v < nv; v++) w[v] = _mm512_loadu_si512(Pw + v * pstridew + q * 16);
        if (pfnext)
            for (int v = 0; v < nv; v++) __builtin_prefetch(Pw + v * pstridew + q * 16 + pfnext, 0, 2);
        for (int p = 0; p < parts; p++)
            for (int i = 0; i < mr; i++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)xw[p * planew + i * ldxw + q]);
                for (int v = 0; v < nv; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, (__m512bh)w[v]);
            }
    }
    /* the epilogue runs once per K chunk: vectors, masked on the last panel of a ragged N (the
       FMA tiles' epilogue is vectors too; a scalar loop over 8 x 48 outputs per chunk was slower) */
    for (int i = 0; i < mr; i++) {
        float *o = out + i * ldo;
        for (int v = 0; v < nv; v++) {
            long c = ncols - v * 16;  /* >= 1: a group's last panel holds a column */
            __mmask16 k = c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << c) - 1);
            __m512 s = acc[i][v];
            if (!first) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(k, o + v * 16));
            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(k, bias + v * 16));
            _mm512_mask_storeu_ps(o + v * 16, k, s);
        }
    }
}

static void dk_pkdp_tile_any(int mr, int nv, int parts, long q0, long nq, const uint32_t *xw, long ldxw,
                             long planew, const uint32_t *Pw, long pstridew, int first, const float *bias,
                             float *out, long ldo, long ncols, long pfnext) {
#define DK_PKDP_T(MR_, NV_) \
    if (parts == 1) dk_pkdp_tile(MR_, NV_, 1, q0, nq, xw, ldxw, planew, Pw, pstridew, first, bias, out, ldo, ncols, pfnext); \
    else dk_pkdp_tile(MR_, NV_, 2, q0, nq, xw, ldxw, planew, Pw, pstridew, first, bias, out, ldo, ncols, pfnext);
#define DK_PKDP_NVS(MR_) \
    if (nv == 3) { DK_PKDP_T(MR_, 3) } else if (nv == 2) { DK_PKDP_T(MR_, 2) } else { DK_PKDP_T(MR_, 1) }
    switch (mr) {
    case 1: DK_PKDP_NVS(1) break;
    case 2: DK_PKDP_NVS(2) break;
    case 3: DK_PKDP_NVS(3) break;
    case 4: DK_PKDP_NVS(4) break;
    case 5: DK_PKDP_NVS(5) break;
    case 6: DK_PKDP_NVS(6) break;
    case 7: DK_PKDP_NVS(7) break;
    case 8: DK_PKDP_NVS(8) break;
    }
#undef DK_PKDP_NVS
#undef DK_PKDP_T
}

/* As dk_pk_run, for panels [plo, phi), from the activation planes xb of dk_pk_amx_split; parts 1 or 2
   ("highest" stays on the FMA tiles, whose exact fp32 x needs no parts). */
static void dk_pkdp_run(long M, long K, long N, long plo, long phi, int parts, const uint16_t *xb,
                        const uint16_t *P, const float *bias, float *out) {
    const long kp = dk_pk_kpad(K), ldxw = kp / 2, planew = dk_pk_amx_rows(M) * ldxw;
    const long pstridew = dk_pk_panel_elems(K, 1) / 2, qc = DK_PK_KC / 2;
    for (long p0 = plo; p0 < phi; p0 += DK_PK_NV) {
        int nv = phi - p0 < DK_PK_NV ? (int)(phi - p0) : DK_PK_NV;
        long c0 = p0 * DK_PK_COLS, ncols = N - c0 < nv * DK_PK_COLS ? N - c0 : nv * DK_PK_COLS;
        const uint32_t *pg = (const uint32_t *)P + p0 * pstridew;
        for (long q0 = 0; q0 < ldxw; q0 += qc) {
            long nq = ldxw - q0 < qc ? ldxw - q0 : qc;
            int first = q0 == 0, last = q0 + nq == ldxw;
            for (long i = 0; i < M; i += DK_PK_MR) {
                int mr = M - i < DK_PK_MR ? (int)(M - i) : DK_PK_MR;
                dk_pkdp_tile_any(mr, nv, parts, q0, nq, (const uint32_t *)xb + i * ldxw, ldxw, planew, pg,
                                 pstridew, first, last && bias ? bias + c0 : NULL, out + i * N + c0, N, ncols,
                                 dk_pk_next_chunk(M, i, last, nv, pstridew, q0 * 16, qc * 16));
            }
        }
    }
}
#else
static void dk_pkdp_run(long M, long K, long N, long plo, long phi, int parts, const uint16_t *xb,
                        const uint16_t *P, const float *bias, float *out) {
    (void)M; (void)K; (void)N; (void)plo; (void)phi; (void)parts; (void)xb; (void)P; (void)bias; (void)out;
}
#endif

#pragma GCC pop_options

#endif /* DK_PACKED_H */
