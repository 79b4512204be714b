"""Reference Gated DeltaNet ops of Qwen3.5 (torch), computed in the dtype of the inputs.

The token-by-token recurrence is the oracle; the chunked form (docs/models.md 2.7) exists to
test the kernels' chunked prefill path and as the torch peer for prefill. Layouts:
q, k (T, H_k, d_k); v (T, H_v, d_v); g, beta (T, H_v); state (H_v, d_k, d_v); value head h reads
key head h // (H_v // H_k).
"""

from __future__ import annotations

import torch

AUTO_CHUNK = 64


def _prepare_qk(q, k, n_v_heads: int, scale, use_qk_l2norm: bool):
    """l2-normalise (optional), scale q, and repeat key heads for the value heads (GVA)."""
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = n_v_heads // q.shape[1]
    q = (q * scale).repeat_interleave(group, dim=1)  # (T, H_v, d_k)
    k = k.repeat_interleave(group, dim=1)  # (T, H_v, d_k)
    return q, k


def gated_delta_rule(q, k, v, g, beta, state, ckpt_slot=None, *, scale=None, use_qk_l2norm=True, chunk_size=0):
    """Run the gated delta rule from `state`; returns (o, final state, checkpoints).

    ckpt_slot (T,) int: token t's state is stored in checkpoints[ckpt_slot[t]] (-1: not kept);
    checkpoints has max(ckpt_slot) + 1 entries (H_v, d_k, d_v). chunk_size > 0 runs the chunked form
    (only when no checkpoint is requested: it does not produce per-token states); < 0: chunks of
    64 when T > 64.
    """
    n_slots = 0 if ckpt_slot is None or len(ckpt_slot) == 0 else int(ckpt_slot.max()) + 1
    if chunk_size < 0:  # auto: chunks of 64 for long blocks (much faster in torch)
        chunk_size = AUTO_CHUNK if v.shape[0] > AUTO_CHUNK else 0
    if chunk_size and n_slots == 0:
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                      chunk_size=chunk_size)
        return o, s, s.new_zeros((0, *s.shape))
    qs, ks = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm)
    s = state.clone().to(v.dtype)  # (H_v, d_k, d_v)
    ckpts = s.new_zeros((n_slots, *s.shape))
    o = v.new_empty(v.shape)  # (T, H_v, d_v)
    for t in range(v.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]  # decay
        kv = torch.einsum("hk,hkv->hv", ks[t], s)  # S^T k
        d = beta[t][:, None] * (v[t] - kv)  # delta rule
        s = s + ks[t][:, :, None] * d[:, None, :]  # rank-1 update
        o[t] = torch.einsum("hk,hkv->hv", qs[t], s)  # S^T q
        if n_slots and ckpt_slot[t] >= 0:
            ckpts[int(ckpt_slot[t])] = s
    return o, s, ckpts


def chunk_gated_delta_rule(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True, chunk_size=64):
    """The chunked (WY) form of the same recurrence; returns (o, final state)."""
    T, H, dv = v.shape
    C = chunk_size
    qs, ks = _prepare_qk(q, k, H, scale, use_qk_l2norm)
    pad = (-T) % C  # zero padding: g = 0, beta = 0 leaves the state untouched
    if pad:
        qs, ks, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qs, ks, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # (H, n, C, d): one row per head and chunk
    split = lambda x: x.reshape(-1, C, *x.shape[1:]).movedim(2, 0)  # noqa: E731
    qs, ks, v, g, beta = split(qs), split(ks), split(v), split(g), split(beta)
    s = state.clone().to(v.dtype)  # (H, d_k, d_v)
    eye = torch.eye(C, dtype=v.dtype)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool))
    o = torch.empty_like(v)
    for n in range(v.shape[1]):
        qc, kc, vc, bc = qs[:, n], ks[:, n], v[:, n], beta[:, n][..., None]  # (H, C, d) / (H, C, 1)
        G = g[:, n].cumsum(-1)  # (H, C) cumulative log-decay
        D = torch.exp(G[:, :, None] - G[:, None, :]).masked_fill(~lower, 0.0)  # (H, C, C)
        L = eye + torch.tril((bc * kc) @ kc.transpose(1, 2) * D, diagonal=-1)
        U = torch.linalg.solve_triangular(L, bc * vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(L, bc * kc * torch.exp(G)[..., None], upper=False, unitriangular=True)
        A = (qc @ kc.transpose(1, 2)) * D  # (H, C, C) lower incl. diagonal
        v_new = U - W @ s  # (H, C, d_v)
        o[:, n] = (qc * torch.exp(G)[..., None]) @ s + A @ v_new
        last = G[:, -1:]  # (H, 1)
        s = torch.exp(last)[..., None] * s + (kc * torch.exp(last - G)[..., None]).transpose(1, 2) @ v_new
    o = o.movedim(0, 2).reshape(-1, H, dv)[:T]
    return o, s


def causal_conv1d(x, weight, conv_state, *, activation="silu", checkpoints=False):
    """Depthwise causal conv over time: returns (y, new conv state[, states after every token]).

    x (T, C); weight (C, K) oldest tap first; conv_state (C, K-1) the K-1 inputs before x (oldest first).
    y[t, c] = act(sum_j weight[c, j] * xpad[t + j, c]) with xpad = [conv_state^T ; x].
    """
    K = weight.shape[1]
    xpad = torch.cat([conv_state.transpose(0, 1).to(x.dtype), x], dim=0)  # (K-1+T, C)
    T = x.shape[0]
    y = sum(weight[:, j] * xpad[j : j + T] for j in range(K))  # (T, C)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    new_state = xpad[T:].transpose(0, 1).contiguous()  # (C, K-1)
    if not checkpoints:
        return y, new_state
    states = (torch.stack([xpad[t + 1 : t + K].transpose(0, 1) for t in range(T)]) if T
              else x.new_zeros((0, *new_state.shape)))
    return y, new_state, states


def gated_rms_norm(x, z, weight, *, eps=1e-6):
    """Qwen3.5 RMSNormGated over the last axis: weight * x / rms(x) * silu(z) (weight ones-centred)."""
    n = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return weight * n * torch.nn.functional.silu(z)


def apply_output_gate(o, gate):
    """Gated attention output: o * sigmoid(gate)."""
    return o * torch.sigmoid(gate)


def split_query_gate(qg, n_heads: int, head_dim: int):
    """q_proj output (T, H*2*D), per head [query_h | gate_h] -> (query (T, H, D), gate (T, H*D))."""
    qg = qg.reshape(qg.shape[0], n_heads, 2 * head_dim)
    query, gate = qg[..., :head_dim], qg[..., head_dim:]
    return query.contiguous(), gate.reshape(qg.shape[0], n_heads * head_dim).contiguous()
