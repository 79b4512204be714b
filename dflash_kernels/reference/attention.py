"""Reference attention (torch), computed in the dtype of the inputs (float64 in tests).

Plain and explicit on purpose: GQA by repeat_interleave, the mask as a boolean matrix, softmax, matmul.
Positions: keys are numbered 0 .. T_kv-1; query i sits at position q_off + i.
"""

import torch


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


def _attend(q, k, v, scale, ok):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (T_kv, H_q, D): query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale  # (H_q, T_q, T_kv)
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)  # (T_q, H_q, D)


def injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, *, scale=None, causal_block=False, window=None):
    """softmax(q [k_ctx | k_blk]^T * scale) [v_ctx | v_blk]; the block sits at positions T_ctx + i."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    t_q, t_ctx = q.shape[0], k_ctx.shape[0]
    k = torch.cat([k_ctx.to(q.dtype), k_blk.to(q.dtype)])  # (T_ctx + T_q, H_kv, D)
    v = torch.cat([v_ctx.to(q.dtype), v_blk.to(q.dtype)])
    ok = _visible(t_q, t_ctx + t_q, t_ctx, causal_block, window)
    return _attend(q, k, v, scale, ok)


def cached_attention(q, k_cache, v_cache, *, causal=True, scale=None, window=None):
    """q are the last T_q positions of the cache: query i sits at position T_kv - T_q + i."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    t_q, t_kv = q.shape[0], k_cache.shape[0]
    ok = _visible(t_q, t_kv, t_kv - t_q, causal, window)
    return _attend(q, k_cache.to(q.dtype), v_cache.to(q.dtype), scale, ok)
