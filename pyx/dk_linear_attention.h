/* Micro-kernels behind pyx/linear_attention.pyx: the Gated DeltaNet token loop over 16-column state
   blocks, the small GEMM of its chunked form, and the causal depthwise conv. */
#ifndef DK_LINEAR_ATTENTION_H
#define DK_LINEAR_ATTENTION_H

#include <Python.h>  /* Py_ssize_t */

#include <math.h>
#include <stdint.h>
/* Micro-kernels with GCC vector extensions (8 floats = one AVX register; plain SSE targets get
   pairs): gcc does not keep the 4 x 16 accumulator blocks of these loops in registers on its own. */
typedef float la_v8 __attribute__((vector_size(32), aligned(4)));
#define LA_LD(p) (*(const la_v8*)(p))
#define LA_ST(p, x) (*(la_v8*)(p) = (x))

/* T tokens on the 16 state columns S[:, 0:16] (row stride ld), carried through the scratch
   blk (dk, 16) of row stride lb: in place, rows ld floats apart share a few L1 sets, which costs
   more than the copy from T = 2 on; T = 1 passes blk = S, lb = ld.
   Lazy decay: the true block is sigma * blk, so a token's decay is one multiply of sigma and each
   token is ONE pass over blk: blk += k_t (d_t / sigma)^T, o_t = sigma blk^T q_t, and the next
   token's kv = sigma' blk^T k_{t+1}. sigma is folded back into blk when it leaves [2^-20, 2^20]
   (or is 0 / NaN) and at the end. Checkpoints: token t's state goes to ck + slot[t] * cks. */
static void la_tokens16(float* S, Py_ssize_t ld, int dk, Py_ssize_t T, const float* kn,
                        const float* qn, const float* g, const float* beta, Py_ssize_t gs,
                        const float* v, float* o, Py_ssize_t vs, const int64_t* slot, float* ck,
                        Py_ssize_t cks, float* blk, Py_ssize_t lb) {
    float sigma = expf(g[0]);
    la_v8 x0 = {0}, x1 = {0}, y0 = {0}, y1 = {0};
    int i = 0;
    for (; i + 2 <= dk; i += 2) {  /* pack the decayed block; kv of token 0 */
        la_v8 s00 = LA_LD(S + i * ld) * sigma, s01 = LA_LD(S + i * ld + 8) * sigma;
        la_v8 s10 = LA_LD(S + (i + 1) * ld) * sigma, s11 = LA_LD(S + (i + 1) * ld + 8) * sigma;
        LA_ST(blk + i * lb, s00); LA_ST(blk + i * lb + 8, s01);
        LA_ST(blk + (i + 1) * lb, s10); LA_ST(blk + (i + 1) * lb + 8, s11);
        x0 += s00 * kn[i]; x1 += s01 * kn[i]; y0 += s10 * kn[i + 1]; y1 += s11 * kn[i + 1];
    }
    for (; i < dk; i++) {
        la_v8 s00 = LA_LD(S + i * ld) * sigma, s01 = LA_LD(S + i * ld + 8) * sigma;
        LA_ST(blk + i * lb, s00); LA_ST(blk + i * lb + 8, s01);
        x0 += s00 * kn[i]; x1 += s01 * kn[i];
    }
    sigma = 1.0f;
    la_v8 kv0 = x0 + y0, kv1 = x1 + y1;
    for (Py_ssize_t t = 0; t < T; t++) {
        const float* k = kn + t * dk;
        const float* q = qn + t * dk;
        const float* kx = t + 1 < T ? k + dk : k;  /* next token's key (unused after the last) */
        float bs = beta[t * gs] / sigma;
        la_v8 d0 = bs * (LA_LD(v + t * vs) - kv0), d1 = bs * (LA_LD(v + t * vs + 8) - kv1);
        la_v8 o00 = {0}, o01 = {0}, o10 = {0}, o11 = {0};
        x0 = x1 = y0 = y1 = (la_v8){0};
        for (i = 0; i + 2 <= dk; i += 2) {
            float* r = blk + i * lb;
            la_v8 s00 = LA_LD(r) + k[i] * d0, s01 = LA_LD(r + 8) + k[i] * d1;
            la_v8 s10 = LA_LD(r + lb) + k[i + 1] * d0, s11 = LA_LD(r + lb + 8) + k[i + 1] * d1;
            LA_ST(r, s00); LA_ST(r + 8, s01); LA_ST(r + lb, s10); LA_ST(r + lb + 8, s11);
            o00 += s00 * q[i]; o01 += s01 * q[i]; o10 += s10 * q[i + 1]; o11 += s11 * q[i + 1];
            x0 += s00 * kx[i]; x1 += s01 * kx[i]; y0 += s10 * kx[i + 1]; y1 += s11 * kx[i + 1];
        }
        for (; i < dk; i++) {
            float* r = blk + i * lb;
            la_v8 s00 = LA_LD(r) + k[i] * d0, s01 = LA_LD(r + 8) + k[i] * d1;
            LA_ST(r, s00); LA_ST(r + 8, s01);
            o00 += s00 * q[i]; o01 += s01 * q[i];
            x0 += s00 * kx[i]; x1 += s01 * kx[i];
        }
        LA_ST(o + t * vs, sigma * (o00 + o10));
        LA_ST(o + t * vs + 8, sigma * (o01 + o11));
        if (slot[t] >= 0) {
            float* c = ck + slot[t] * cks;
            for (i = 0; i < dk; i++) {
                LA_ST(c + i * ld, sigma * LA_LD(blk + i * lb));
                LA_ST(c + i * ld + 8, sigma * LA_LD(blk + i * lb + 8));
            }
        }
        if (t + 1 < T) {
            sigma *= expf(g[(t + 1) * gs]);
            kv0 = sigma * (x0 + y0);
            kv1 = sigma * (x1 + y1);
            if (!(sigma >= 0x1p-20f && sigma <= 0x1p20f)) {
                for (i = 0; i < dk; i++) {
                    LA_ST(blk + i * lb, sigma * LA_LD(blk + i * lb));
                    LA_ST(blk + i * lb + 8, sigma * LA_LD(blk + i * lb + 8));
                }
                sigma = 1.0f;
            }
        }
    }
    if (blk == S && sigma == 1.0f) return;  /* worked in place, nothing to fold back */
    for (i = 0; i < dk; i++) {  /* unpack, folding sigma back in */
        LA_ST(S + i * ld, sigma * LA_LD(blk + i * lb));
        LA_ST(S + i * ld + 8, sigma * LA_LD(blk + i * lb + 8));
    }
}

/* C[M, N] += alpha * A[M, K] . B[K, N], row-major with row strides lda, ldb, ldc;
   4 x 16 register blocks, scalar loops for the last M % 4 rows and N % 16 columns. */
static void la_gemm(const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb, float* C,
                    Py_ssize_t ldc, int M, int N, int K, float alpha) {
    int j0 = 0;
    for (; j0 + 16 <= N; j0 += 16) {
        int i = 0;
        for (; i + 4 <= M; i += 4) {
            la_v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
            const float* a = A + i * lda;
            for (int p = 0; p < K; p++) {
                la_v8 b0 = LA_LD(B + p * ldb + j0), b1 = LA_LD(B + p * ldb + j0 + 8);
                float p0 = a[p], p1 = a[lda + p], p2 = a[2 * lda + p], p3 = a[3 * lda + p];
                a00 += p0 * b0; a01 += p0 * b1;
                a10 += p1 * b0; a11 += p1 * b1;
                a20 += p2 * b0; a21 += p2 * b1;
                a30 += p3 * b0; a31 += p3 * b1;
            }
            float* c = C + i * ldc + j0;
            LA_ST(c, LA_LD(c) + alpha * a00); LA_ST(c + 8, LA_LD(c + 8) + alpha * a01);
            c += ldc;
            LA_ST(c, LA_LD(c) + alpha * a10); LA_ST(c + 8, LA_LD(c + 8) + alpha * a11);
            c += ldc;
            LA_ST(c, LA_LD(c) + alpha * a20); LA_ST(c + 8, LA_LD(c + 8) + alpha * a21);
            c += ldc;
            LA_ST(c, LA_LD(c) + alpha * a30); LA_ST(c + 8, LA_LD(c + 8) + alpha * a31);
        }
        for (; i < M; i++) {
            la_v8 a00 = {0}, a01 = {0};
            for (int p = 0; p < K; p++) {
                float p0 = A[i * lda + p];
                a00 += p0 * LA_LD(B + p * ldb + j0); a01 += p0 * LA_LD(B + p * ldb + j0 + 8);
            }
            float* c = C + i * ldc + j0;
            LA_ST(c, LA_LD(c) + alpha * a00); LA_ST(c + 8, LA_LD(c + 8) + alpha * a01);
        }
    }
    for (int j = j0; j < N; j++)
        for (int i = 0; i < M; i++) {
            float s = 0.0f;
            for (int p = 0; p < K; p++) s += A[i * lda + p] * B[p * ldb + j];
            C[i * ldc + j] += alpha * s;
        }
}

#include "dk_exp.h"  /* dk_exp: the shared polynomial exp */

/* dst (cols, rows) = src (rows, cols)^T. Kept scalar: with a handful of columns gcc's vectorised
   form (gathers / scatters) is several times slower. */
__attribute__((optimize("no-tree-vectorize")))
static void la_transpose(const float* __restrict src, int rows, int cols, float* __restrict dst) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) dst[c * rows + r] = src[r * cols + c];
}

/* Causal depthwise conv on n channels: x (T, .) row stride ldx, w (n, K), state (n, K-1) (updated),
   y row stride ldy, ck (T, n, K-1) token stride ldck or NULL. Vectorised over channels through
   the transposed scratch wT (K, n) and sT (K-1, n). */
static void la_conv_block(const float* __restrict x, Py_ssize_t ldx, const float* __restrict w,
                          float* __restrict state, float* __restrict y, Py_ssize_t ldy,
                          float* __restrict ck, Py_ssize_t ldck, Py_ssize_t T, int n, int K, int silu,
                          float* __restrict wT, float* __restrict sT) {
    int km1 = K - 1;
    la_transpose(w, n, K, wT);
    la_transpose(state, n, km1, sT);
    for (Py_ssize_t t = 0; t < T; t++) {
        float* __restrict yr = y + t * ldy;
        for (int c = 0; c < n; c++) yr[c] = 0.0f;
        for (int j = 0; j < K; j++) {  /* xpad[t + j]: the old state, then x */
            Py_ssize_t s = t + j - km1;
            const float* __restrict src = s >= 0 ? x + s * ldx : sT + (t + j) * n;
            const float* __restrict wr = wT + j * n;
            for (int c = 0; c < n; c++) yr[c] += wr[c] * src[c];
        }
        if (silu)
            for (int c = 0; c < n; c++) yr[c] = yr[c] / (1.0f + dk_exp(-yr[c]));
        if (ck)  /* state after token t: xpad[t + 1 .. t + K - 1] */
            for (int c = 0; c < n; c++)
                for (int i = 0; i < km1; i++) {
                    Py_ssize_t s = t + 1 + i - km1;
                    ck[t * ldck + c * km1 + i] = s >= 0 ? x[s * ldx + c] : sT[(t + 1 + i) * n + c];
                }
    }
    for (int i = 0; i < km1; i++) {  /* new state, transposed, then back into (n, K-1) */
        Py_ssize_t s = T + i - km1;
        const float* src = s >= 0 ? x + s * ldx : sT + (T + i) * n;
        for (int c = 0; c < n; c++) wT[i * n + c] = src[c];
    }
    la_transpose(wT, km1, n, state);
}

/* y[0:n] += a * x[0:n] (x, y do not overlap) */
static inline void la_axpy(float* y, const float* x, float a, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) LA_ST(y + j, LA_LD(y + j) + a * LA_LD(x + j));
    for (; j < n; j++) y[j] += a * x[j];
}

#endif /* DK_LINEAR_ATTENTION_H */
