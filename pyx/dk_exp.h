/* float32 exp shared by every Cython kernel. Cephes-style: x = n ln2 + r (two-step Cody-Waite via
   fma, so -fassociative-math cannot merge the steps), exp(r) by a degree-6 polynomial, 2^n through
   the exponent bits; ~2 ulp. Branch-free, so gcc vectorises the loops that call it. x < -87 (and
   -inf, the attention masks) gives exactly 0; x > 88 is clamped (exp(88) ~ 1.7e38, never inf). */
#ifndef DK_EXP_H
#define DK_EXP_H
static inline float dk_exp(float x) {
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
    float r = __builtin_fmaf(n, -0.693359375f, xc);
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { unsigned int u; float f; } two_n;
    two_n.u = (unsigned int)((int)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * two_n.f;
}
#endif
