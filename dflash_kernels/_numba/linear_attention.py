"""Numba kernels for the Gated DeltaNet ops (float32; the public wrappers upcast bf16 activations).

Value heads are independent, so every kernel runs one value head per task. Inside a head the state
S (d_k, d_v) is walked in blocks of BW columns: column j of S only ever meets column j of v and o,
so a (d_k, BW) block can be carried through all T tokens while it sits in L1.
"""

import numpy as np
from numba import njit, prange

from .._threads import numba_threads
from ._common import JIT

BW = 16  # state columns per block: (128, 16) float32 = 8 KiB


@njit(inline="always", **JIT)
def _prepare_qk(q, k, kh, scale, l2norm, qn, kn):
    """qn[t] = scale * l2norm(q[t, kh]), kn[t] = l2norm(k[t, kh]) (norms skipped unless l2norm)."""
    T, _, dk = q.shape
    for t in range(T):
        sq = np.float32(0.0)
        sk = np.float32(0.0)
        for i in range(dk):
            sq += q[t, kh, i] * q[t, kh, i]
            sk += k[t, kh, i] * k[t, kh, i]
        fq = scale
        fk = np.float32(1.0)
        if l2norm:
            fq = scale / np.sqrt(sq + np.float32(1e-6))
            fk = np.float32(1.0) / np.sqrt(sk + np.float32(1e-6))
        for i in range(dk):
            qn[t, i] = q[t, kh, i] * fq
            kn[t, i] = k[t, kh, i] * fk


@njit(parallel=True, **JIT)
def _recurrent(q, k, v, g, beta, state, ckpt_slot, o, ckpts, scale, l2norm):
    # Lazy decay, as in the Cython kernel: the true (d_k, BW) block is sigma * blk, so a token's decay
    # only multiplies sigma and each token is one pass over blk: blk += k_t (d_t / sigma)^T,
    # o_t = sigma blk^T q_t and the next token's kv = sigma' blk^T k_{t+1}. sigma is folded back into
    # blk when it leaves [2^-20, 2^20] (or is 0 / NaN) and when the block is written back.
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    group = Hv // Hk
    lo, hi = np.float32(2.0**-20), np.float32(2.0**20)
    for h in prange(Hv):  # one value head per task
        qn = np.empty((T, dk), np.float32)
        kn = np.empty((T, dk), np.float32)
        _prepare_qk(q, k, h // group, scale, l2norm, qn, kn)
        S = state[h]  # (d_k, d_v), updated in place
        blk = np.empty((dk, BW), np.float32)  # contiguous copy: S's rows lie d_v floats apart
        kv = np.empty(BW, np.float32)
        ov = np.empty(BW, np.float32)
        d = np.empty(BW, np.float32)
        for j0 in range(0, dv, BW):
            w = min(BW, dv - j0)
            if T == 0:
                break
            a = np.exp(g[0, h])
            kv[:] = 0.0
            for i in range(dk):  # pack the decayed block; kv of token 0
                ki = kn[0, i]
                for j in range(w):
                    s = S[i, j0 + j] * a
                    blk[i, j] = s
                    kv[j] += s * ki
            sigma = np.float32(1.0)
            for t in range(T):
                tn = t + 1 if t + 1 < T else t
                bs = beta[t, h] / sigma
                for j in range(w):  # d = beta * (v - kv), in blk's scale
                    d[j] = bs * (v[t, h, j0 + j] - kv[j])
                    ov[j] = 0.0
                    kv[j] = 0.0
                for i in range(dk):  # blk += k d^T;  o = blk^T q;  next kv = blk^T k_next
                    ki = kn[t, i]
                    qi = qn[t, i]
                    kxi = kn[tn, i]
                    for j in range(w):
                        s = blk[i, j] + ki * d[j]
                        blk[i, j] = s
                        ov[j] += s * qi
                        kv[j] += s * kxi
                for j in range(w):
                    o[t, h, j0 + j] = sigma * ov[j]
                slot = ckpt_slot[t]
                if slot >= 0:
                    for i in range(dk):
                        for j in range(w):
                            ckpts[slot, h, i, j0 + j] = sigma * blk[i, j]
                if t + 1 < T:
                    sigma *= np.exp(g[t + 1, h])
                    for j in range(w):
                        kv[j] *= sigma
                    if not (sigma >= lo and sigma <= hi):
                        for i in range(dk):
                            for j in range(w):
                                blk[i, j] *= sigma
                        sigma = np.float32(1.0)
            for i in range(dk):  # write back, folding sigma in
                for j in range(w):
                    S[i, j0 + j] = sigma * blk[i, j]


@njit(parallel=True, **JIT)
def _chunked(q, k, v, g, beta, state, o, scale, l2norm, C):
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    group = Hv // Hk
    for h in prange(Hv):
        qn = np.empty((T, dk), np.float32)
        kn = np.empty((T, dk), np.float32)
        _prepare_qk(q, k, h // group, scale, l2norm, qn, kn)
        S = state[h]
        G = np.empty(C, np.float32)
        KK = np.zeros((C, C), np.float32)  # strictly lower part of L
        A = np.zeros((C, C), np.float32)  # (q k^T) o D, lower incl. diagonal
        U = np.empty((C, dv), np.float32)  # becomes v_new
        W = np.empty((C, dk), np.float32)
        for c0 in range(0, T, C):
            c = min(C, T - c0)
            cum = np.float32(0.0)
            for i in range(c):
                cum += g[c0 + i, h]
                G[i] = cum
            for i in range(c):
                for j in range(i + 1):
                    kk = np.float32(0.0)
                    qk = np.float32(0.0)
                    for p in range(dk):
                        kk += kn[c0 + i, p] * kn[c0 + j, p]
                        qk += qn[c0 + i, p] * kn[c0 + j, p]
                    dec = np.exp(G[i] - G[j])
                    KK[i, j] = beta[c0 + i, h] * kk * dec
                    A[i, j] = qk * dec
            # forward substitution with the unit lower-triangular L = I + KK:
            # U = L^-1 (beta v), W = L^-1 (beta k exp(G))
            for i in range(c):
                b = beta[c0 + i, h]
                eg = np.exp(G[i])
                for jv in range(dv):
                    U[i, jv] = b * v[c0 + i, h, jv]
                for p in range(dk):
                    W[i, p] = b * kn[c0 + i, p] * eg
                for j in range(i):
                    lij = KK[i, j]
                    for jv in range(dv):
                        U[i, jv] -= lij * U[j, jv]
                    for p in range(dk):
                        W[i, p] -= lij * W[j, p]
            # v_new = U - W S;  O = (q exp(G)) S + A v_new
            for i in range(c):
                eg = np.exp(G[i])
                for jv in range(dv):
                    o[c0 + i, h, jv] = 0.0
                for p in range(dk):
                    w_ = W[i, p]
                    qe = qn[c0 + i, p] * eg
                    for jv in range(dv):
                        U[i, jv] -= w_ * S[p, jv]
                        o[c0 + i, h, jv] += qe * S[p, jv]
                for j in range(i + 1):
                    a_ = A[i, j]
                    for jv in range(dv):
                        o[c0 + i, h, jv] += a_ * U[j, jv]
            # S = exp(G_last) S + (k exp(G_last - G))^T v_new
            last = G[c - 1]
            el = np.exp(last)
            for p in range(dk):
                for jv in range(dv):
                    S[p, jv] *= el
            for i in range(c):
                e = np.exp(last - G[i])
                for p in range(dk):
                    kp = kn[c0 + i, p] * e
                    for jv in range(dv):
                        S[p, jv] += kp * U[i, jv]


def gated_delta_rule(q, k, v, g, beta, state_in, ckpt_slot, o, state, ckpts, *, n_threads, scale,
                     use_qk_l2norm, chunk_size):
    # state_in is the same buffer as state (updated in place); the torch backend needs it as an input
    if chunk_size < 0:  # auto: the one-pass-per-token recurrence is the faster form here at every T
        chunk_size = 0
    with numba_threads(n_threads):
        if chunk_size > 0 and ckpts.shape[0] == 0:
            _chunked(q, k, v, g, beta, state, o, np.float32(scale), bool(use_qk_l2norm), int(chunk_size))
        else:
            _recurrent(q, k, v, g, beta, state, ckpt_slot, o, ckpts, np.float32(scale), bool(use_qk_l2norm))


@njit(parallel=True, **JIT)
def _conv(x, weight, state, y, ckpts, silu, keep):
    T, C = x.shape
    K = weight.shape[1]
    for c in prange(C):  # channels are independent
        for t in range(T):
            acc = np.float32(0.0)
            for j in range(K):  # xpad[t + j] = state[c, t + j] before x, else x[t + j - (K-1)]
                s = t + j - (K - 1)
                acc += weight[c, j] * (x[s, c] if s >= 0 else state[c, t + j])
            if silu:
                acc = acc / (np.float32(1.0) + np.exp(-acc))
            y[t, c] = acc
            if keep:  # state after token t: xpad[t + 1 .. t + K - 1]
                for i in range(K - 1):
                    s = t + 1 + i - (K - 1)
                    ckpts[t, c, i] = x[s, c] if s >= 0 else state[c, t + 1 + i]
        for i in range(K - 1):  # ascending i reads state[c, T + i] before anything overwrites it
            s = T + i - (K - 1)
            state[c, i] = x[s, c] if s >= 0 else state[c, T + i]


def causal_conv1d(x, weight, state_in, y, state, ckpts, *, n_threads, activation, checkpoints):
    # state_in is the same buffer as state (updated in place); ckpts is empty unless checkpoints
    with numba_threads(n_threads):
        _conv(x, weight, state, y, ckpts, activation == "silu", ckpts.shape[0] > 0)


@njit(parallel=True, **JIT)
def _gated_rms_norm(x, z, weight, out, eps):
    n = x.shape[1]
    for r in prange(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[r, i] * x[r, i]
        f = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
        for i in range(n):
            zi = z[r, i]
            out[r, i] = weight[i] * (x[r, i] * f) * (zi / (np.float32(1.0) + np.exp(-zi)))


def gated_rms_norm(x, z, weight, out, *, n_threads, eps):
    with numba_threads(n_threads):
        _gated_rms_norm(x, z, weight, out, np.float32(eps))


@njit(parallel=True, **JIT)
def _apply_output_gate(o, gate, out):
    for r in prange(o.shape[0]):
        for i in range(o.shape[1]):
            out[r, i] = o[r, i] / (np.float32(1.0) + np.exp(-gate[r, i]))


def apply_output_gate(o, gate, out, *, n_threads):
    with numba_threads(n_threads):
        _apply_output_gate(o, gate, out)
