/* AMX-BF16 tiles for linear with bf16 weights and M > DK_MR rows (verification blocks, drafter
   blocks, prefill).

   Why: the FMA path is compute bound from M ~ 8 rows on (~130 GFLOP/s on 2 cores), so a 16-row
   verification costs ~3x an autoregressive step. One TDPBF16PS does 16 x 16 x 32 multiply-adds.

   Precision: each fp32 x is split into `parts` bf16 parts (dk_bf16dot.h): three for "highest"
   (x = x1 + x2 + x3, 3 x 8 significant bits = fp32's 24, exact), two for "high", one for
   "medium". Every product of a part with a bf16 weight is exact in fp32; only the fp32
   accumulation order differs from the FMA path, as it would with any other blocking.

   Layout: out^T = W x^T, so the weights are the A operand and are loaded straight from their
   row-major (N, K) storage (16 rows x 32 bf16 per tile, stride 2K bytes), never repacked (but for
   one K step per group of rows that start off a cache line: dk_amx_group_p). The
   activations are the B operand, packed once per call in the pair-interleaved ("VNNI") layout:
   tile (m block, k block, part) = 16 k-pairs x 16 rows x 2 bf16, `parts` tiles per step.

   Tiles: 0-1 accumulate 2 blocks of 16 output columns (a group of 32 weight rows), 2-3 hold their
   weight tiles, 4-6 the activation parts (one to three). Both weight tiles are loaded before the
   products: with 4 column blocks sharing one weight tile register, each reload waited for the
   products still reading it (28 Qwen3-1.7B layers + LM head at M = 16: 188-204 vs 213-222 ms). */
#ifndef DK_AMX_H
#define DK_AMX_H

#include <stdint.h>
#include <string.h>

#include "dk_bf16dot.h"  /* dk_split_run: the activation parts */

#define DK_AMX_GROUP 32  /* weight rows (output columns) per work item: two C tiles */
#define DK_AMX_KB 32     /* K per tile step */
#define DK_AMX_MB 16     /* x rows per tile */
#define DK_AMX_PARTS 3   /* at most */
#ifndef DK_AMX_KC
#define DK_AMX_KC 512    /* K chunk: its 32 x 512 bf16 weights (32 KiB) serve every m block from L1/L2 */
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DK_AMX_BUILT 1
#define DK_AI_AMX static inline __attribute__((always_inline))

/* Linux hands out AMX tile state only on request (once per process). 1 when granted. */
static int dk_amx_ready(void) {
    static int state = -1;
    if (state < 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} dk_tilecfg;

/* Every tile 16 rows x 64 bytes. A constant: gcc 12 dropped the stores that filled a local copy
   as dead once dk_amx_begin was no longer inlined (the builtin's read of it is not seen), and
   ldtilecfg then faulted on the half-filled config. */
static const dk_tilecfg dk_amx_cfg = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* Per thread, before its first tile instruction. */
static void dk_amx_begin(void) { _tile_loadconfig(&dk_amx_cfg); }

static void dk_amx_end(void) { _tile_release(); }

/* Register-only TDPBF16PS loop (the AMX ceiling that benchmarks quote): four accumulators, two A
   and two B tiles loaded once, iters x 4 products of 16 x 16 x 32. The caller has dk_amx_ready(). */
static float dk_peak_amx(long iters) {
    float zeros[256] __attribute__((aligned(64))) = {0}, out[256] __attribute__((aligned(64)));
    dk_amx_begin();
    _tile_loadd(4, zeros, 64); _tile_loadd(5, zeros, 64); _tile_loadd(6, zeros, 64); _tile_loadd(7, zeros, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (long it = 0; it < iters; it++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    dk_amx_end();
    return out[0];
}

#else
#define DK_AMX_BUILT 0
static int dk_amx_ready(void) { return 0; }
static void dk_amx_begin(void) {}
static void dk_amx_end(void) {}
static float dk_peak_amx(long iters) { (void)iters; return 0.0f; }
#endif

/* Size in uint16 of the packed activations for M rows, K (a multiple of DK_AMX_KB), `parts` parts. */
static long dk_amx_xsize(long M, long K, int parts) {
    long nmb = (M + DK_AMX_MB - 1) / DK_AMX_MB;
    return nmb * (K / DK_AMX_KB) * parts * 16 * 32;
}

/* Elements from a row start to the next 64-byte boundary (0 when aligned; rows are 2K bytes apart,
   a multiple of 64, so every row has the same offset). */
static long dk_amx_head(const uint16_t *w) {
    uintptr_t a = (uintptr_t)w;
    return a % 2 ? 0 : (long)((64 - a % 64) % 64 / 2);
}

/* xp = x with its columns in the K-step order of dk_amx_group for weights whose rows start h
   elements before a 64-byte boundary: [0, h) and [K - 32 + h, K) first, then [h, K - 32 + h). */
static void dk_amx_permute_x(long M, long K, long h, const float *x, float *xp) {
    for (long i = 0; i < M; i++) {
        const float *xr = x + i * K;
        float *o = xp + i * K;
        memcpy(o, xr, h * sizeof(float));
        memcpy(o + h, xr + K - (DK_AMX_KB - h), (DK_AMX_KB - h) * sizeof(float));
        memcpy(o + DK_AMX_KB, xr + h, (K - DK_AMX_KB) * sizeof(float));
    }
}

#if DK_AMX_BUILT
/* Pack m block mb (rows 16 mb .. 16 mb + 15, zeros past M) of x (M, K), row stride ldx, into xb as
   `parts` parts. Returns 0 when those rows hold inf or NaN: the parts of inf are NaN, so the caller
   then takes the FMA path (IEEE results). */
static int dk_amx_pack_block(long mb, long M, long K, const float *x, long ldx, int parts, uint16_t *xb) {
    long nkb = K / DK_AMX_KB;
    /* the parts of one K step, row-major: [part][row][32 bf16] = [part][row][16 pairs] */
    uint16_t rows[DK_AMX_PARTS][DK_AMX_MB][DK_AMX_KB] __attribute__((aligned(64)));
    uint32_t bad = 0;
    const __m512i by_row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                                3, 2, 1, 0), _mm512_set1_epi32(16));
    for (long kb = 0; kb < nkb; kb++) {
        for (long ml = 0; ml < DK_AMX_MB; ml++) {
            long m = mb * DK_AMX_MB + ml;
            if (m >= M) {
                for (int p = 0; p < parts; p++) memset(rows[p][ml], 0, sizeof rows[p][ml]);
                continue;
            }
            bad |= dk_split_run(x + m * ldx + kb * DK_AMX_KB, DK_AMX_KB, parts, rows[0][ml], rows[1][ml],
                                rows[2][ml]);
        }
        /* VNNI tile = transpose of the [row][pair] dword matrix: tile row r gathers pair r of
           every x row */
        uint32_t *t = (uint32_t *)(xb + (mb * nkb + kb) * parts * 512);
        for (int p = 0; p < parts; p++)
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(t + p * 256 + r * 16,
                                    _mm512_i32gather_epi32(by_row, (const int *)rows[p] + r, 4));
    }
    return bad == 0;
}
#else
static int dk_amx_pack_block(long mb, long M, long K, const float *x, long ldx, int parts, uint16_t *xb) {
    (void)mb; (void)M; (void)K; (void)x; (void)ldx; (void)parts; (void)xb;
    return 0;
}
#endif

#if DK_AMX_BUILT
/* out[:, n0 : n0 + 32] = x w[n0 : n0 + 32]^T + bias, all M rows; w bf16 (N, K), K % 32 == 0.
   Weights are tile-loaded in place; the caller gives each thread a contiguous run of groups, so
   each thread streams one region of the matrix and the hardware prefetchers follow it. An earlier
   software prefetch of the next group's block (32 x K, 2 KiB per K step) cost 5-75% from DRAM once
   measured per shape (M = 16, "medium", 2 threads, Xeon: 4096 x 12288 18.7 -> 30.4 GB/s of weights,
   4096 x 4096 25.6 -> 29.9, 151936 x 1024 23.0 -> 25.9; "highest" 12288-wide 15.0 -> 26.5).
   cacc keeps the C tiles of every m block between K chunks ((M / 16 rounded up) x 2 x 256 floats).

   Alignment: a tile row load that straddles two cache lines costs ~25-40% (weights 8, 16 or 32
   bytes past a 64-byte boundary: M = 16, 6144 x 2048, 2 threads: 0.49 vs 0.61-0.63 ms), and
   safetensors places tensors 8 bytes past one. So the K steps start at the first 64-byte boundary
   of the rows, h = dk_amx_head(w) elements in: K step 0 holds the h head elements and the 32 - h
   tail elements of each row, copied into w0 (32 rows x 64 bytes, aligned) per group; step s >= 1
   reads elements h + 32 (s - 1) .. in place. The activations are packed in the same order
   (dk_amx_permute_x). */
DK_AI_AMX void dk_amx_group_p(const int parts, long M, long K, long N, long n0, const uint16_t *xb,
                               const uint16_t *w, const float *bias, float *out, float *cacc, uint16_t *w0) {
    long nkb = K / DK_AMX_KB, nmb = (M + DK_AMX_MB - 1) / DK_AMX_MB;
    const long ldw = 2 * K;  /* bytes between weight rows */
    const long h = dk_amx_head(w);
    const uint16_t *wg = w + n0 * K + (h ? h - DK_AMX_KB : 0);  /* + 32 s: K step s >= 1 */
    (void)N;
    if (h)  /* element k < h of a row is its head element k, element k >= h its element K - 32 + k */
        for (int r = 0; r < DK_AMX_GROUP; r++) {
            const uint16_t *row = w + (n0 + r) * K;
            for (int k = 0; k < DK_AMX_KB; k++) w0[r * DK_AMX_KB + k] = row[k < h ? k : K - DK_AMX_KB + k];
        }
    for (long k0 = 0; k0 < K; k0 += DK_AMX_KC) {
        long kc = K - k0 < DK_AMX_KC ? K - k0 : DK_AMX_KC;
        const uint16_t *wc = wg + k0;
        for (long mb = 0; mb < nmb; mb++) {
            float *c = cacc + mb * 2 * 256;
            if (k0 == 0) { _tile_zero(0); _tile_zero(1); }
            else { _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); }
            const uint16_t *xt = xb + (mb * nkb + k0 / DK_AMX_KB) * parts * 512;
            for (long kb = 0; kb < kc / DK_AMX_KB; kb++, xt += parts * 512) {
                if (h && k0 == 0 && kb == 0) {  /* head + tail, from the aligned copy */
                    _tile_loadd(2, w0, 64);
                    _tile_loadd(3, w0 + 16 * DK_AMX_KB, 64);
                } else {
                    const uint16_t *pk = wc + kb * DK_AMX_KB;
                    _tile_loadd(2, pk, ldw);
                    _tile_loadd(3, pk + 16 * K, ldw);
                }
                _tile_loadd(4, xt, 64);
                if (parts > 1) _tile_loadd(5, xt + 512, 64);
                if (parts > 2) _tile_loadd(6, xt + 1024, 64);
                _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 3, 4);
                if (parts > 1) { _tile_dpbf16ps(0, 2, 5); _tile_dpbf16ps(1, 3, 5); }
                if (parts > 2) { _tile_dpbf16ps(0, 2, 6); _tile_dpbf16ps(1, 3, 6); }
            }
            _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
            if (k0 + kc < K) continue;
            long rows = M - mb * DK_AMX_MB < DK_AMX_MB ? M - mb * DK_AMX_MB : DK_AMX_MB;
            for (long i = 0; i < rows; i++) {
                float *o = out + (mb * DK_AMX_MB + i) * N + n0;
                for (int j = 0; j < 2; j++)
                    for (int r = 0; r < 16; r++) {
                        float v = c[j * 256 + r * 16 + i];  /* tile j: [n][m] */
                        o[j * 16 + r] = bias ? v + bias[n0 + j * 16 + r] : v;
                    }
            }
        }
    }
}
/* parts as a compile-time constant in each copy */
static void dk_amx_group(long M, long K, long N, long n0, int parts, const uint16_t *xb, const uint16_t *w,
                         const float *bias, float *out, float *cacc, uint16_t *w0) {
    if (parts == 1) dk_amx_group_p(1, M, K, N, n0, xb, w, bias, out, cacc, w0);
    else if (parts == 2) dk_amx_group_p(2, M, K, N, n0, xb, w, bias, out, cacc, w0);
    else dk_amx_group_p(3, M, K, N, n0, xb, w, bias, out, cacc, w0);
}
#else
static void dk_amx_group(long M, long K, long N, long n0, int parts, const uint16_t *xb, const uint16_t *w,
                         const float *bias, float *out, float *cacc, uint16_t *w0) {
    (void)M; (void)K; (void)N; (void)n0; (void)parts; (void)xb; (void)w; (void)bias; (void)out; (void)cacc;
    (void)w0;
}
#endif

#endif /* DK_AMX_H */
