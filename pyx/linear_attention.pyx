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
                      silu, &scratch[tid, 0], &scratch[tid, 0] + K * CONV_CB)  # sT: (K-1) rows, none when K = 1


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
