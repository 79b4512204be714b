"""The Gated DeltaNet core shared by linear_attention.pyx (the single ops) and dense.pyx (the fused
Qwen3.5 linear-attention layer, gdn_layer.pxi): the micro-kernels of dk_linear_attention.h and the
per-head recurrence, so that the fused layer runs the single ops' arithmetic.

The includer cimports prange, expf, sqrtf, memcpy, memset and int64_t.
"""

cdef extern from "dk_linear_attention.h":
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


cdef extern from *:
    """
    /* The recurrence per value head, in C so that it can be compiled once, never inlined nor cloned: with
       -fassociative-math and -ffp-contract=fast an inlined copy may vectorise its sums differently at
       each call site, and gated_delta_rule (linear_attention.pyx) and the fused layer (gdn_layer.pxi)
       must give the same bits. */

    /* qn[t] = scale * l2norm(q[t]), kn[t] = l2norm(k[t]); q, k point at head kh of token 0, rows
       `row` floats apart */
    static __attribute__((noinline, noclone)) void gdn_prepare_qk(const float *q, const float *k, Py_ssize_t T, Py_ssize_t row,
                                                         int dk, float scale, int l2norm, float *qn, float *kn) {
        for (Py_ssize_t t = 0; t < T; t++) {
            float sq = 0.0f, sk = 0.0f;
            for (int i = 0; i < dk; i++) {
                sq += q[t * row + i] * q[t * row + i];
                sk += k[t * row + i] * k[t * row + i];
            }
            float fq = scale, fk = 1.0f;
            if (l2norm) {
                fq = scale / sqrtf(sq + 1e-6);
                fk = 1.0 / sqrtf(sk + 1e-6);
            }
            for (int i = 0; i < dk; i++) {
                qn[t * dk + i] = q[t * row + i] * fq;
                kn[t * dk + i] = k[t * row + i] * fk;
            }
        }
    }

    /* One token on the last w < 16 columns of S: S = a S; d = b (v - S^T k); S += k d^T; o = S^T q */
    static inline void gdn_token_narrow(float *S, Py_ssize_t ld, int dk, int w, const float *kn, const float *qn,
                                        float a, float b, const float *vt, float *ot) {
        float acc[16], d[16], s;
        for (int j = 0; j < w; j++) acc[j] = 0.0f;
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < w; j++) {
                s = S[i * ld + j] * a;
                S[i * ld + j] = s;
                acc[j] += s * kn[i];
            }
        for (int j = 0; j < w; j++) {
            d[j] = b * (vt[j] - acc[j]);
            acc[j] = 0.0f;
        }
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < w; j++) {
                s = S[i * ld + j] + kn[i] * d[j];
                S[i * ld + j] = s;
                acc[j] += s * qn[i];
            }
        for (int j = 0; j < w; j++) ot[j] = acc[j];
    }

    /* T tokens of value head h. Full 16-column blocks: la_tokens16, the same arithmetic for every T
       (through the scratch blk from T = 2 on), so re-running a prefix of a block reproduces its
       checkpoints bit for bit. The last dv % 16 columns: the plain two-pass form, token by token, in
       place. Token t's state goes to checkpoint slot[t] when >= 0. */
    static __attribute__((noinline, noclone)) void gdn_recurrent_head(const float *v, const float *g, const float *beta,
                                                             float *S, const int64_t *slot, float *o, float *ckpts,
                                                             Py_ssize_t T, int Hv, int h, int dk, int dv,
                                                             const float *qn, const float *kn, float *blk) {
        Py_ssize_t hs = (Py_ssize_t)dk * dv;
        int pack = T > 1;
        for (int j0 = 0; j0 < dv; j0 += 16) {
            int w = dv - j0 < 16 ? dv - j0 : 16;
            if (w == 16) {
                la_tokens16(S + j0, dv, dk, T, kn, qn, g + h, beta + h, Hv, v + (Py_ssize_t)h * dv + j0,
                            o + (Py_ssize_t)h * dv + j0, (Py_ssize_t)Hv * dv, slot,
                            ckpts ? ckpts + h * hs + j0 : NULL, Hv * hs, pack ? blk : S + j0, pack ? 16 : dv);
                continue;
            }
            for (Py_ssize_t t = 0; t < T; t++) {
                gdn_token_narrow(S + j0, dv, dk, w, kn + t * dk, qn + t * dk, expf(g[t * Hv + h]), beta[t * Hv + h],
                                 v + (t * Hv + h) * dv + j0, o + (t * Hv + h) * dv + j0);
                if (slot[t] >= 0)  /* keep the state after token t */
                    for (int i = 0; i < dk; i++)
                        memcpy(ckpts + (slot[t] * Hv + h) * hs + (Py_ssize_t)i * dv + j0, S + (Py_ssize_t)i * dv + j0,
                               w * sizeof(float));
            }
        }
    }

    /* gated RMSNorm of one row (docs/models.md 2.7): out = w * (x / rms(x)) * silu(z). Compiled once,
       never inlined (as the row functions of dk_dense.h), so that gated_rms_norm and the fused layer
       give the same bits. */
    static __attribute__((noinline, noclone)) void gdn_gated_norm_row(const float *restrict x, const float *restrict z,
                                                             const float *restrict w, long n, float eps,
                                                             float *restrict out) {
        float ss = 0.0f;
        for (long i = 0; i < n; i++) ss += x[i] * x[i];
        float f = 1.0f / __builtin_sqrtf(ss / (float)n + eps);
        for (long i = 0; i < n; i++) out[i] = w[i] * (x[i] * f) * (z[i] / (1.0f + dk_exp(-z[i])));
    }

    /* the gates of one row (H_v heads): beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), in
       overflow-free forms; once, never inlined, for gated_deltanet_gates and the fused layer */
    static __attribute__((noinline, noclone)) void gdn_gates_row(const float *restrict a, const float *restrict b,
                                                        const float *restrict neg_a, const float *restrict dt_bias,
                                                        long n, float *restrict g, float *restrict beta) {
        for (long h = 0; h < n; h++) {
            beta[h] = 0.5f + 0.5f * tanhf(0.5f * b[h]);
            float u = a[h] + dt_bias[h];
            g[h] = neg_a[h] * ((u > 0.0f ? u : 0.0f) + log1pf(expf(-fabsf(u))));
        }
    }
    """
    void gdn_prepare_qk(const float *q, const float *k, Py_ssize_t T, Py_ssize_t row, int dk, float scale, int l2norm,
                        float *qn, float *kn) noexcept nogil
    void gdn_recurrent_head(const float *v, const float *g, const float *beta, float *S, const int64_t *slot, float *o,
                            float *ckpts, Py_ssize_t T, int Hv, int h, int dk, int dv, const float *qn, const float *kn,
                            float *blk) noexcept nogil
    void gdn_gates_row(const float *a, const float *b, const float *neg_a, const float *dt_bias, long n, float *g,
                       float *beta) noexcept nogil
    void gdn_gated_norm_row(const float *x, const float *z, const float *w, long n, float eps,
                            float *out) noexcept nogil
