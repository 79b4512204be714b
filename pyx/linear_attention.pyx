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

include "gdn_core.pxi"


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
        gdn_prepare_qk(&q[0, h // group, 0], &k[0, h // group, 0], T, Hk * dk, dk, scale, use_qk_l2norm, qn, kn)
        if chunked:
            _chunked_head(&v[0, 0, 0], &g[0, 0], &beta[0, 0], &state[h, 0, 0], &o[0, 0, 0], T, Hv, h, dk, dv, C,
                          qn, kn, kn + T * dk)
        else:
            gdn_recurrent_head(&v[0, 0, 0], &g[0, 0], &beta[0, 0], &state[h, 0, 0], &ckpt_slot[0], &o[0, 0, 0], ck,
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
    cdef Py_ssize_t r, n = x.shape[1]
    for r in prange(x.shape[0], nogil=True, num_threads=n_threads, schedule="static"):
        gdn_gated_norm_row(&x[r, 0], &z[r, 0], &weight[0], n, eps, &out[r, 0])


def gated_deltanet_gates(const float[:, ::1] a, const float[:, ::1] b, const float[::1] neg_a,
                         const float[::1] dt_bias, float[:, ::1] g, float[:, ::1] beta):
    cdef Py_ssize_t t
    with nogil:
        for t in range(a.shape[0]):
            gdn_gates_row(&a[t, 0], &b[t, 0], &neg_a[0], &dt_bias[0], a.shape[1], &g[t, 0], &beta[t, 0])


def apply_output_gate(const float[:, ::1] o, const float[:, ::1] gate, float[:, ::1] out, *, int n_threads):
    cdef Py_ssize_t r, i
    for r in prange(o.shape[0], nogil=True, num_threads=n_threads, schedule="static"):
        for i in range(o.shape[1]):
            out[r, i] = o[r, i] / (1.0 + dk_exp(-gate[r, i]))
