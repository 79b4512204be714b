/* FMA register tiles of the avx2 packed linear (pyx/dk_packed.h) on L1-resident data, one core,
   against a register-only FMA loop: why the avx2 tier upcasts bf16 chunks and runs 6-row fp32 tiles.

       gcc -O3 -march=x86-64-v3 bench/avx2_tiles.c -o /tmp/avx2_tiles && /tmp/avx2_tiles

   - peak: 12 independent FMA chains (a register-only loop, as dense.peak_gflops);
   - 4x16 bf16: the bf16 pair-word tile (8 accumulators; even k by << 16, odd k by & 0xFFFF0000);
   - 6x16 fp32: the tile over an upcast chunk (12 accumulators);
   - 6x16 fp32 + next upcast: the fp32 tile also upcasting the next chunk (double buffering),
     the alternative to the fused bf16 tile; the upcast ops take FMA slots;
   - MRx16 bf16, stores: the fused upcast's bf16 tile, which also stores the fp32 weights for the
     fp32 tiles of the other rows (4 rows in dk_packed.h; 6 rows spill and run slowest of all; 5 rows
     run faster here, but 16 rows as 5 + 6 + 5 against 4 + 6 + 6 took 0.96-1.08x the time in
     bench/linear_ab.py, Zen 2, session 12: no gain).
   The activations' rows are LDX floats apart, as x's rows in a linear of K = LDX. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define KC 128   /* k per pass: weights and activations stay in L1 */
#define LDX 4096

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float W[KC * 16] __attribute__((aligned(64)));         /* fp32 panel chunk, k-major */
static unsigned int WB[KC / 2 * 16] __attribute__((aligned(64))); /* the same as bf16 pair words */
static float X[6 * LDX] __attribute__((aligned(64)));
static float OUT[12 * 16];

/* one k of the 6 x 16 fp32 tile, and a tile's accumulators to OUT */
static inline __attribute__((always_inline)) void fp32_k6(__m256 a[6][2], int k) {
    __m256 w0 = _mm256_load_ps(W + k * 16), w1 = _mm256_load_ps(W + k * 16 + 8);
    for (int i = 0; i < 6; i++) {
        __m256 x = _mm256_broadcast_ss(X + i * LDX + k);
        a[i][0] = _mm256_fmadd_ps(x, w0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(x, w1, a[i][1]);
    }
}

static inline __attribute__((always_inline)) void store_rows(__m256 a[][2], int rows) {
    for (int i = 0; i < rows; i++) {
        _mm256_storeu_ps(OUT + i * 16, a[i][0]);
        _mm256_storeu_ps(OUT + i * 16 + 8, a[i][1]);
    }
}

__attribute__((noinline)) static void tile_fp32_6(int reps) {
    for (int r = 0; r < reps; r++) {
        __m256 a[6][2];
        for (int i = 0; i < 6; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int k = 0; k < KC; k++) {
            fp32_k6(a, k);
        }
        store_rows(a, 6);
    }
}

__attribute__((noinline)) static void tile_bf16_4(int reps) {
    const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int r = 0; r < reps; r++) {
        __m256 a[4][2];
        for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int q = 0; q < KC / 2; q++) {
            __m256i u0 = _mm256_load_si256((const __m256i *)(WB + q * 16));
            __m256i u1 = _mm256_load_si256((const __m256i *)(WB + q * 16 + 8));
            __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));
            __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));
            for (int i = 0; i < 4; i++) {
                __m256 x = _mm256_broadcast_ss(X + i * LDX + 2 * q);
                a[i][0] = _mm256_fmadd_ps(x, e0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(x, e1, a[i][1]);
            }
            __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(u0, mask));
            __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(u1, mask));
            for (int i = 0; i < 4; i++) {
                __m256 x = _mm256_broadcast_ss(X + i * LDX + 2 * q + 1);
                a[i][0] = _mm256_fmadd_ps(x, o0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(x, o1, a[i][1]);
            }
        }
        store_rows(a, 4);
    }
}


/* MR x 16 bf16 tile whose conversions read the pair words straight from memory (vpslld / vpand with
   a memory operand) so that no raw pair word stays live: 2 MR accumulators + 2 weights + a
   broadcast + the mask; with store, the fp32 weights also go to UP (the fused upcast) */
#define TILE_BF16_MEM(NAME, MR, STORE)                                                              \
__attribute__((noinline)) static void NAME(int reps) {                                                \
    const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);                                       \
    for (int r = 0; r < reps; r++) {                                                                \
        __m256 a[MR][2];                                                                            \
        for (int i = 0; i < MR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();                       \
        for (int q = 0; q < KC / 2; q++) {                                                          \
            const __m256i *p = (const __m256i *)(WB + q * 16);                                      \
            __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(p), 16));           \
            __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(p + 1), 16));       \
            if (STORE) { _mm256_store_ps(UP + 2 * q * 16, e0); _mm256_store_ps(UP + 2 * q * 16 + 8, e1); } \
            for (int i = 0; i < MR; i++) {                                                          \
                __m256 x = _mm256_broadcast_ss(X + i * LDX + 2 * q);                                \
                a[i][0] = _mm256_fmadd_ps(x, e0, a[i][0]);                                          \
                a[i][1] = _mm256_fmadd_ps(x, e1, a[i][1]);                                          \
            }                                                                                       \
            __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(mask, _mm256_load_si256(p)));         \
            __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(mask, _mm256_load_si256(p + 1)));     \
            if (STORE) { _mm256_store_ps(UP + (2 * q + 1) * 16, o0); _mm256_store_ps(UP + (2 * q + 1) * 16 + 8, o1); } \
            for (int i = 0; i < MR; i++) {                                                          \
                __m256 x = _mm256_broadcast_ss(X + i * LDX + 2 * q + 1);                            \
                a[i][0] = _mm256_fmadd_ps(x, o0, a[i][0]);                                          \
                a[i][1] = _mm256_fmadd_ps(x, o1, a[i][1]);                                          \
            }                                                                                       \
        }                                                                                           \
        store_rows(a, MR);                                                                          \
    }                                                                                               \
}
static float UP[KC * 16] __attribute__((aligned(64)));
TILE_BF16_MEM(tile_bf16m_4s, 4, 1)
TILE_BF16_MEM(tile_bf16m_5s, 5, 1)
TILE_BF16_MEM(tile_bf16m_6s, 6, 1)

static float UP2[KC * 16] __attribute__((aligned(64)));
/* 6x16 fp32 tile that also upcasts the next chunk's bf16 pair words into UP2 (double buffer) */
__attribute__((noinline)) static void tile_fp32_6_up(int reps) {
    const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int r = 0; r < reps; r++) {
        __m256 a[6][2];
        for (int i = 0; i < 6; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int q = 0; q < KC / 2; q++) {
            const __m256i *p = (const __m256i *)(WB + q * 16);
            __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(p), 16));
            __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(p + 1), 16));
            _mm256_store_ps(UP2 + 2 * q * 16, e0); _mm256_store_ps(UP2 + 2 * q * 16 + 8, e1);
            __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(mask, _mm256_load_si256(p)));
            __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(mask, _mm256_load_si256(p + 1)));
            _mm256_store_ps(UP2 + (2 * q + 1) * 16, o0); _mm256_store_ps(UP2 + (2 * q + 1) * 16 + 8, o1);
            for (int kk = 2 * q; kk < 2 * q + 2; kk++) fp32_k6(a, kk);
        }
        store_rows(a, 6);
    }
}
__attribute__((noinline)) static void peak(int reps) {
    __m256 a[12], b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i * 0.001f);
    for (long r = 0; r < (long)reps * KC; r++)
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
    for (int i = 0; i < 12; i++) _mm256_storeu_ps(OUT + i * 8, a[i]);
}

int main(void) {
    for (int i = 0; i < KC * 16; i++) W[i] = 0.001f * i;
    for (int i = 0; i < KC * 8; i++) WB[i] = 0x3f803f80u;
    for (int i = 0; i < 6 * LDX; i++) X[i] = 0.5f;
    const int reps = 200000;
    double t = now(), gf_peak, gf;
    peak(reps);
    gf_peak = 12.0 * 8 * 2 * reps * KC / (now() - t) / 1e9;
    printf("peak (register-only FMA)  %6.1f GFLOP/s\n", gf_peak);
    t = now();
    tile_bf16_4(reps);
    gf = 4.0 * 16 * 2 * KC * reps / (now() - t) / 1e9;
    printf("4x16 bf16 tile            %6.1f GFLOP/s (%3.0f%% of peak)\n", gf, 100 * gf / gf_peak);
    t = now();
    tile_fp32_6(reps);
    gf = 6.0 * 16 * 2 * KC * reps / (now() - t) / 1e9;
    printf("6x16 fp32 tile            %6.1f GFLOP/s (%3.0f%% of peak)\n", gf, 100 * gf / gf_peak);
#define RUN(NAME, MR, LABEL)                                                                   \
    t = now();                                                                                  \
    NAME(reps);                                                                                 \
    gf = MR * 16.0 * 2 * KC * reps / (now() - t) / 1e9;                                         \
    printf("%-26s%6.1f GFLOP/s (%3.0f%% of peak)\n", LABEL, gf, 100 * gf / gf_peak);
    RUN(tile_fp32_6_up, 6, "6x16 fp32 + next upcast")
    RUN(tile_bf16m_4s, 4, "4x16 bf16, stores")
    RUN(tile_bf16m_5s, 5, "5x16 bf16, stores")
    RUN(tile_bf16m_6s, 6, "6x16 bf16, stores")
    return 0;
}
