"""Reference DFlash drafter forward (docs/dflash.md 1), plain torch, in the dtype of the inputs.

Independent of the kernels and of the model layer's caching: it recomputes every context K/V from
the full tap history on each call and builds the attention mask as an explicit boolean matrix.
Used by the model tests as the oracle for ``dflash_kernels.model.DFlashDrafter``.
"""

from __future__ import annotations

import torch


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """NeoX rotate-half RoPE over the full head dim; x (T, H, D), positions (T,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None]  # (T, D/2)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def drafter_hidden(weights: dict, cfg, taps, block_embeds, *, causal=None, windows=None):
    """Final-normed drafter hidden of one block.

    weights: {name: tensor} with the checkpoint's names (fc.weight, layers.{i}...). cfg: a
    DFlashConfig-like object (hidden/heads/kv heads/head_dim/rms_norm_eps/rope_theta/
    num_hidden_layers, causal, layer_types, sliding_window). taps: (S, n_taps * H_t) target
    features of committed positions 0..S-1. block_embeds: (B, H) embeddings of [anchor, MASK...];
    the block sits at positions S..S+B-1. Returns (B, H).
    """
    S, B = taps.shape[0], block_embeds.shape[0]
    nq, nkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    group = nq // nkv
    dt = block_embeds.dtype
    W = {k: v.to(dt) for k, v in weights.items()}
    ctx = rms_norm(taps.to(dt) @ W["fc.weight"].T, W["hidden_norm.weight"], eps)  # (S, H)
    ctx_pos = torch.arange(S)
    blk_pos = torch.arange(S, S + B)
    x = block_embeds
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.self_attn."
        h = rms_norm(x, W[f"layers.{i}.input_layernorm.weight"], eps)
        q = rms_norm((h @ W[p + "q_proj.weight"].T).view(B, nq, D), W[p + "q_norm.weight"], eps)
        q = rope(q, blk_pos, cfg.rope_theta)
        # context and block keys use the SAME Wk / k_norm, each at its own absolute positions
        k_c = rms_norm((ctx @ W[p + "k_proj.weight"].T).view(S, nkv, D), W[p + "k_norm.weight"], eps)
        k_c = rope(k_c, ctx_pos, cfg.rope_theta)
        v_c = (ctx @ W[p + "v_proj.weight"].T).view(S, nkv, D)
        k_x = rms_norm((h @ W[p + "k_proj.weight"].T).view(B, nkv, D), W[p + "k_norm.weight"], eps)
        k_x = rope(k_x, blk_pos, cfg.rope_theta)
        v_x = (h @ W[p + "v_proj.weight"].T).view(B, nkv, D)
        k = torch.cat([k_c, k_x]).repeat_interleave(group, dim=1)  # (S+B, nq, D)
        v = torch.cat([v_c, v_x]).repeat_interleave(group, dim=1)
        # mask: full layers see everything; causal layers see block keys up to themselves;
        # sliding layers see keys at positions > p - window
        qpos = blk_pos[:, None]
        kpos = torch.cat([ctx_pos, blk_pos])[None, :]
        ok = torch.ones(B, S + B, dtype=torch.bool)
        is_causal = cfg.causal[i] if causal is None else causal
        window = cfg.window(i) if windows is None else windows[i]
        if is_causal:
            ok &= kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
        s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        s = s.masked_fill(~ok, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(B, nq * D)
        x = x + o @ W[p + "o_proj.weight"].T
        m = f"layers.{i}.mlp."
        h = rms_norm(x, W[f"layers.{i}.post_attention_layernorm.weight"], eps)
        act = torch.nn.functional.silu(h @ W[m + "gate_proj.weight"].T) * (h @ W[m + "up_proj.weight"].T)
        x = x + act @ W[m + "down_proj.weight"].T
    return rms_norm(x, W["norm.weight"], eps)
