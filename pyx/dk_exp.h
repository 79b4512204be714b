/* float32 exp shared by every Cython kernel. Cephes-style: x = n ln2 + r (two-step Cody-Waite via
   fma, so -fassociative-math cannot merge the steps), exp(r) by a degree-6 polynomial, 2^n through
   the exponent bits; ~2 ulp. Branch-free, so gcc vectorises the loops that call it. x < -87 (and
   -inf, the attention masks) gives exactly 0; x > 88 is clamped (exp(88) ~ 1.7e38, never inf). */
#ifndef DK_EXP_H
#define DK_EXP_H
/* its constants, shared by the scalar and vector forms */
#define DK_EXP_LOG2E 1.44269504088896341f
#define DK_EXP_LN2_HI -0.693359375f  /* -ln 2 in two parts (Cody-Waite) */
#define DK_EXP_LN2_LO 2.12194440e-4f
#define DK_EXP_P0 1.9875691500e-4f  /* the polynomial, highest degree first */
#define DK_EXP_P1 1.3981999507e-3f
#define DK_EXP_P2 8.3334519073e-3f
#define DK_EXP_P3 4.1665795894e-2f
#define DK_EXP_P4 1.6666665459e-1f
#define DK_EXP_P5 5.0000001201e-1f
static inline float dk_exp(float x) {
    float xc = x < -87.0f ? -87.0f : x;  /* two selects, not one nested: fewer blends in gcc's vectors */
    xc = xc > 88.0f ? 88.0f : xc;
    float n = __builtin_floorf(xc * DK_EXP_LOG2E + 0.5f);
    float r = __builtin_fmaf(n, DK_EXP_LN2_HI, xc);
    r = __builtin_fmaf(n, DK_EXP_LN2_LO, r);
    float p = DK_EXP_P0;
    p = p * r + DK_EXP_P1;
    p = p * r + DK_EXP_P2;
    p = p * r + DK_EXP_P3;
    p = p * r + DK_EXP_P4;
    p = p * r + DK_EXP_P5;
    p = p * (r * r) + r + 1.0f;
    union { unsigned int u; float f; } two_n;
    two_n.u = (unsigned int)((int)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * two_n.f;
}

/* dk_exp on a vector of 16 (AVX-512) or 8 (AVX2) floats, the same steps lane by lane, in
   intrinsics: where gcc vectorises the scalar one it builds the clamps and the final select from
   vblendvps on AVX2 (3 uops each on Intel), and a loop that calls it ran 1.3x slower there than
   its Numba twin. */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
static inline __m512 dk_exp16(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));  /* NaN stays */
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(DK_EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(DK_EXP_LN2_HI), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(DK_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(DK_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(DK_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(DK_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(DK_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(DK_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(DK_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}
#endif
#if defined(__AVX2__)
static inline __m256 dk_exp8(__m256 x) {
    __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(DK_EXP_LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(DK_EXP_LN2_HI), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(DK_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(DK_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(DK_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(DK_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(DK_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(DK_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(DK_EXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

/* The sampling kernels' exp pass over one block (pyx/_sampling.pxi): e_i <- exp((e_i - m) * inv_t)
   where e_i >= thr, else 0; returns the block's sum in float64. */
static inline double dk_exp_span(float* e, long n, float m, float inv_t, float thr) {
    long i = 0;
    double acc = 0.0;
#if defined(__AVX512F__)
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(e + i);
        __m512 w = dk_exp16(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(m)), _mm512_set1_ps(inv_t)));
        w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(thr), _CMP_GE_OQ), w);
        _mm512_storeu_ps(e + i, w);
        a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
        a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1))));
    }
    acc = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#elif defined(__AVX2__)
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(e + i);
        __m256 w = dk_exp8(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(m)), _mm256_set1_ps(inv_t)));
        w = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GE_OQ), w);
        _mm256_storeu_ps(e + i, w);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
    }
    __m256d s = _mm256_add_pd(a0, a1);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    acc = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
#endif
    for (; i < n; i++) {
        float v = e[i], w = dk_exp((v - m) * inv_t);
        w = v >= thr ? w : 0.0f;
        e[i] = w;
        acc += w;
    }
    return acc;
}
#endif
