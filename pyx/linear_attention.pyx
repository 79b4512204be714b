# cython: language_level=3
"""Cython kernels for the Gated DeltaNet ops (float32; the public wrappers upcast bf16 activations).

One value head per OpenMP task. The recurrence walks the state S (d_k, d_v) in blocks of 16 columns
(column j of S only meets column j of v and o), carrying a (d_k, 16) block through all T tokens
while it sits in L1; per token two passes: decay + kv = S^T k, then the rank-1 update + o = S^T q.
The chunked form is the same math as a few small matrix products per chunk (docs/models.md 2.7).
"""

import numpy as np

from cython.parallel cimport prange, threadid
from libc.math cimport expf, sqrtf
from libc.stdint cimport int64_t
from libc.string cimport memcpy, memset

cdef extern from *:
    """
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
    """
    void la_tokens16(float* S, Py_ssize_t ld, int dk, Py_ssize_t T, const float* kn, const float* qn,
                     const float* g, const float* beta, Py_ssize_t gs, const float* v, float* o, Py_ssize_t vs,
                     const int64_t* slot, float* ck, Py_ssize_t cks, float* blk, Py_ssize_t lb) noexcept nogil
    void la_gemm(const float* A, Py_ssize_t lda, const float* B, Py_ssize_t ldb, float* C, Py_ssize_t ldc,
                 int M, int N, int K, float alpha) noexcept nogil
    void la_axpy(float* y, const float* x, float a, int n) noexcept nogil
    float dk_exp(float x) noexcept nogil
    void la_conv_block(const float* x, Py_ssize_t ldx, const float* w, float* state, float* y, Py_ssize_t ldy,
                       float* ck, Py_ssize_t ldck, Py_ssize_t T, int n, int K, int silu, float* wT,
                       float* sT) noexcept nogil

cdef enum:
    BW = 16  # state columns per block: 2 AVX registers wide
    CONV_CB = 256  # channels per conv task


cdef inline void _prepare_qk(const float* q, const float* k, Py_ssize_t T, Py_ssize_t row, int dk,
                             float scale, bint l2norm, float* qn, float* kn) noexcept nogil:
    """qn[t] = scale * l2norm(q[t]), kn[t] = l2norm(k[t]); q, k point at head kh of token 0."""
    cdef Py_ssize_t t
    cdef int i
    cdef float sq, sk, fq, fk
    for t in range(T):
        sq = 0.0
        sk = 0.0
        for i in range(dk):
            sq = sq + q[t * row + i] * q[t * row + i]
            sk = sk + k[t * row + i] * k[t * row + i]
        fq = scale
        fk = 1.0
        if l2norm:
            fq = scale / sqrtf(sq + 1e-6)
            fk = 1.0 / sqrtf(sk + 1e-6)
        for i in range(dk):
            qn[t * dk + i] = q[t * row + i] * fq
            kn[t * dk + i] = k[t * row + i] * fk


cdef inline void _token_narrow(float* S, Py_ssize_t ld, int dk, int w, const float* kn, const float* qn,
                               float a, float b, const float* vt, float* ot) noexcept nogil:
    """One token on the last w < 16 columns of S: S = a S; d = b (v - S^T k); S += k d^T; o = S^T q."""
    cdef float acc[BW]
    cdef float d[BW]
    cdef float s
    cdef int i, j
    for j in range(w):
        acc[j] = 0.0
    for i in range(dk):
        for j in range(w):
            s = S[i * ld + j] * a
            S[i * ld + j] = s
            acc[j] += s * kn[i]
    for j in range(w):
        d[j] = b * (vt[j] - acc[j])
        acc[j] = 0.0
    for i in range(dk):
        for j in range(w):
            s = S[i * ld + j] + kn[i] * d[j]
            S[i * ld + j] = s
            acc[j] += s * qn[i]
    for j in range(w):
        ot[j] = acc[j]


cdef void _recurrent_head(const float* v, const float* g, const float* beta, float* S, const int64_t* slot,
                          float* o, float* ckpts, Py_ssize_t T, int Hv, int h, int dk, int dv,
                          const float* qn, const float* kn, float* blk) noexcept nogil:
    # Full 16-column blocks: la_tokens16, the same arithmetic for every T (through the scratch blk
    # from T = 2 on), so re-running a prefix of a block reproduces its checkpoints bit for bit.
    # The last dv % 16 columns: the plain two-pass form, token by token, in place.
    cdef Py_ssize_t t, hs = <Py_ssize_t>dk * dv
    cdef int j0, w, i
    cdef bint pack = T > 1
    j0 = 0
    while j0 < dv:
        w = dv - j0 if dv - j0 < BW else BW
        if w == BW:
            la_tokens16(S + j0, dv, dk, T, kn, qn, g + h, beta + h, Hv, v + h * dv + j0, o + h * dv + j0,
                        <Py_ssize_t>Hv * dv, slot, ckpts + h * hs + j0 if ckpts != NULL else NULL, Hv * hs,
                        blk if pack else S + j0, BW if pack else dv)
        else:
            for t in range(T):
                _token_narrow(S + j0, dv, dk, w, kn + t * dk, qn + t * dk, expf(g[t * Hv + h]), beta[t * Hv + h],
                              v + (t * Hv + h) * dv + j0, o + (t * Hv + h) * dv + j0)
                if slot[t] >= 0:  # keep the state after token t
                    for i in range(dk):
                        memcpy(ckpts + (slot[t] * Hv + h) * hs + i * dv + j0, S + i * dv + j0, w * sizeof(float))
        j0 = j0 + BW


cdef void _chunked_head(const float* v, const float* g, const float* beta, float* S, float* o,
                        Py_ssize_t T, int Hv, int h, int dk, int dv, int C,
                        const float* qn, const float* kn, float* work) noexcept nogil:
    # scratch: G (C), KK (C, C), A (C, C), U (C, dv), W (C, dk), Qe (C, dk), kT (dk, C), KdT (dk, C)
    cdef float* G = work
    cdef float* KK = G + C
    cdef float* A = KK + C * C
    cdef float* U = A + C * C
    cdef float* W = U + C * dv
    cdef float* Qe = W + C * dk
    cdef float* kT = Qe + C * dk
    cdef float* KdT = kT + dk * C
    cdef Py_ssize_t c0, row = <Py_ssize_t>Hv * dv
    cdef int c, i, j, p, jv
    cdef float cum, bi, eg, l, last, e
    cdef const float* kc
    cdef const float* qc
    cdef float* oc
    c0 = 0
    while c0 < T:
        c = T - c0 if T - c0 < C else C
        kc = kn + c0 * dk
        qc = qn + c0 * dk
        oc = o + c0 * row + h * dv
        cum = 0.0
        for i in range(c):
            cum = cum + g[(c0 + i) * Hv + h]
            G[i] = cum
        for p in range(dk):
            for i in range(c):
                kT[p * c + i] = kc[i * dk + p]
        # KK = (beta k k^T) o D strictly lower; A = (q k^T) o D lower incl. diagonal
        memset(KK, 0, c * c * sizeof(float))
        memset(A, 0, c * c * sizeof(float))
        la_gemm(kc, dk, kT, c, KK, c, c, c, dk, 1.0)
        la_gemm(qc, dk, kT, c, A, c, c, c, dk, 1.0)
        for i in range(c):
            bi = beta[(c0 + i) * Hv + h]
            for j in range(c):
                if j < i:
                    e = expf(G[i] - G[j])
                    KK[i * c + j] = KK[i * c + j] * bi * e
                    A[i * c + j] = A[i * c + j] * e
                elif j > i:
                    A[i * c + j] = 0.0
        # forward substitution, L = I + KK: U = L^-1 (beta v), W = L^-1 (beta k exp(G))
        for i in range(c):
            bi = beta[(c0 + i) * Hv + h]
            eg = expf(G[i])
            for jv in range(dv):
                U[i * dv + jv] = bi * v[(c0 + i) * row + h * dv + jv]
            for p in range(dk):
                W[i * dk + p] = bi * kc[i * dk + p] * eg
                Qe[i * dk + p] = qc[i * dk + p] * eg
            for j in range(i):
                l = KK[i * c + j]
                la_axpy(U + i * dv, U + j * dv, -l, dv)
                la_axpy(W + i * dk, W + j * dk, -l, dk)
        la_gemm(W, dk, S, dv, U, dv, c, dv, dk, -1.0)  # v_new = U - W S
        for i in range(c):
            memset(oc + i * row, 0, dv * sizeof(float))
        la_gemm(Qe, dk, S, dv, oc, row, c, dv, dk, 1.0)  # O = (q exp(G)) S
        la_gemm(A, c, U, dv, oc, row, c, dv, c, 1.0)  #   + A v_new
        # S = exp(G_last) S + (k exp(G_last - G))^T v_new
        last = G[c - 1]
        e = expf(last)
        for p in range(dk * dv):
            S[p] = S[p] * e
        for i in range(c):
            e = expf(last - G[i])
            for p in range(dk):
                KdT[p * c + i] = kT[p * c + i] * e
        la_gemm(KdT, c, U, dv, S, dv, dk, dv, c, 1.0)
        c0 = c0 + C


def gated_delta_rule(const float[:, :, ::1] q, const float[:, :, ::1] k, const float[:, :, ::1] v,
                     const float[:, ::1] g, const float[:, ::1] beta, state_in, const int64_t[::1] ckpt_slot,
                     float[:, :, ::1] o, float[:, :, ::1] state, float[:, :, :, ::1] ckpts, *, int n_threads,
                     float scale, bint use_qk_l2norm, int chunk_size):
    # state_in is the same buffer as state (updated in place); the torch backend needs it as an input
    cdef Py_ssize_t T = q.shape[0]
    cdef int Hk = q.shape[1], dk = q.shape[2], Hv = v.shape[1], dv = v.shape[2]
    cdef int group = Hv // Hk, h, tid
    # chunk_size < 0 (auto): always the recurrence, faster here than the chunked form at every T
    cdef bint chunked = chunk_size > 0 and ckpts.shape[0] == 0
    cdef int C = chunk_size if chunked else 1
    if T == 0:
        return
    cdef Py_ssize_t per = 2 * T * dk + dk * BW
    if chunked:
        per += C + 2 * C * C + C * dv + 2 * C * dk + 2 * dk * C
    n_threads = max(1, min(n_threads, Hv))
    cdef float[:, ::1] scratch = np.empty((n_threads, per), np.float32)
    cdef float* ck = &ckpts[0, 0, 0, 0] if ckpts.shape[0] > 0 else NULL
    cdef float* qn
    cdef float* kn
    for h in prange(Hv, nogil=True, num_threads=n_threads, schedule="static"):
        tid = threadid()
        qn = &scratch[tid, 0]
        kn = qn + T * dk
        _prepare_qk(&q[0, h // group, 0], &k[0, h // group, 0], T, Hk * dk, dk, scale, use_qk_l2norm, qn, kn)
        if chunked:
            _chunked_head(&v[0, 0, 0], &g[0, 0], &beta[0, 0], &state[h, 0, 0], &o[0, 0, 0], T, Hv, h, dk, dv, C,
                          qn, kn, kn + T * dk)
        else:
            _recurrent_head(&v[0, 0, 0], &g[0, 0], &beta[0, 0], &state[h, 0, 0], &ckpt_slot[0], &o[0, 0, 0], ck,
                            T, Hv, h, dk, dv, qn, kn, kn + T * dk)


def causal_conv1d(const float[:, ::1] x, const float[:, ::1] weight, state_in, float[:, ::1] y,
                  float[:, ::1] state, float[:, :, ::1] ckpts, *, int n_threads, activation, checkpoints):
    # state_in is the same buffer as state (updated in place); ckpts is empty unless checkpoints
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1], c0
    cdef int K = weight.shape[1], km1 = K - 1, n, b, tid
    cdef int nb = <int>((C + CONV_CB - 1) // CONV_CB)
    cdef bint silu = activation == "silu", keep = ckpts.shape[0] > 0
    n_threads = max(1, min(n_threads, nb))
    cdef float[:, ::1] scratch = np.empty((n_threads, (2 * K - 1) * CONV_CB), np.float32)
    cdef const float* xp = &x[0, 0] if T > 0 else NULL
    cdef float* yp = &y[0, 0] if T > 0 else NULL
    cdef float* sp = &state[0, 0] if km1 > 0 else NULL
    cdef float* cp = &ckpts[0, 0, 0] if keep and km1 > 0 else NULL
    for b in prange(nb, nogil=True, num_threads=n_threads, schedule="static"):  # blocks of channels
        tid = threadid()
        c0 = <Py_ssize_t>b * CONV_CB
        n = <int>(C - c0 if C - c0 < CONV_CB else CONV_CB)
        la_conv_block(xp + c0 if xp != NULL else NULL, C, &weight[c0, 0], sp + c0 * km1 if sp != NULL else NULL,
                      yp + c0 if yp != NULL else NULL, C, cp + c0 * km1 if cp != NULL else NULL, C * km1, T, n, K,
                      silu, &scratch[tid, 0], &scratch[tid, K * CONV_CB])


def gated_rms_norm(const float[:, ::1] x, const float[:, ::1] z, const float[::1] weight, float[:, ::1] out, *,
                   int n_threads, float eps):
    cdef Py_ssize_t r, i, n = x.shape[1]
    cdef float ss, f, zi
    for r in prange(x.shape[0], nogil=True, num_threads=n_threads, schedule="static"):
        ss = 0.0
        for i in range(n):
            ss = ss + x[r, i] * x[r, i]
        f = 1.0 / sqrtf(ss / n + eps)
        for i in range(n):
            zi = z[r, i]
            out[r, i] = weight[i] * (x[r, i] * f) * (zi / (1.0 + dk_exp(-zi)))


def apply_output_gate(const float[:, ::1] o, const float[:, ::1] gate, float[:, ::1] out, *, int n_threads):
    cdef Py_ssize_t r, i
    for r in prange(o.shape[0], nogil=True, num_threads=n_threads, schedule="static"):
        for i in range(o.shape[1]):
            out[r, i] = o[r, i] / (1.0 + dk_exp(-gate[r, i]))
