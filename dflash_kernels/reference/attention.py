"""Reference attention (torch), computed in the dtype of the inputs (float64 in tests).

Plain and explicit on purpose: GQA by repeat_interleave, the mask as a boolean matrix, softmax, matmul.
Positions: keys are numbered 0 .. T_kv-1; query i sits at position q_off + i.
"""

import torch

from .dense import round_activations


def _visible(t_q: int, t_kv: int, q_off: int, causal: bool, window) -> torch.Tensor:
    """(T_q, T_kv) bool: key j visible to query i (position p = q_off + i).

    causal: j <= p; window w: j > p - w. Every query sees its own position p (w >= 1).
    """
    pos = torch.arange(t_q).unsqueeze(1) + q_off  # (T_q, 1)
    key = torch.arange(t_kv).unsqueeze(0)  # (1, T_kv)
    ok = torch.ones(t_q, t_kv, dtype=torch.bool)
    if causal:
        ok &= key <= pos
    if window is not None:
        ok &= key > pos - window
    return ok


def _bf16(x):
    return round_activations(x, 1).to(x.dtype)


def _attend(q, k, v, scale, ok, parts):
    """parts 1 ("medium"): both products take bf16 operands, the scaled queries, K, V and the
    probabilities before normalisation, as in the kernels; 2 and 3 compute exactly."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (T_kv, H_q, D): query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    if parts == 1:
        q, k, v, scale = _bf16(q * scale), _bf16(k), _bf16(v), 1.0
    s = torch.einsum("qhd,khd->hqk", q, k) * scale  # (H_q, T_q, T_kv)
    s = s.masked_fill(~ok, float("-inf"))
    if parts != 1:
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)  # (T_q, H_q, D)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.einsum("hqk,khd->qhd", _bf16(e) / e.sum(-1, keepdim=True), v)


def injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, *, scale=None, causal_block=False, window=None, parts=3):
    """softmax(q [k_ctx | k_blk]^T * scale) [v_ctx | v_blk]; the block sits at positions T_ctx + i."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    t_q, t_ctx = q.shape[0], k_ctx.shape[0]
    k = torch.cat([k_ctx.to(q.dtype), k_blk.to(q.dtype)])  # (T_ctx + T_q, H_kv, D)
    v = torch.cat([v_ctx.to(q.dtype), v_blk.to(q.dtype)])
    ok = _visible(t_q, t_ctx + t_q, t_ctx, causal_block, window)
    return _attend(q, k, v, scale, ok, parts)


def cached_attention(q, k_cache, v_cache, *, causal=True, scale=None, window=None, parts=3):
    """q are the last T_q positions of the cache: query i sits at position T_kv - T_q + i."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    t_q, t_kv = q.shape[0], k_cache.shape[0]
    ok = _visible(t_q, t_kv, t_kv - t_q, causal, window)
    return _attend(q, k_cache.to(q.dtype), v_cache.to(q.dtype), scale, ok, parts)
