"""Trainable torch modules for a Qwen3 target and a DFlash drafter (autograd; used by training only).

Parameter names are exactly the public checkpoint names (docs/models.md 1.3, docs/dflash.md 6), so a
state_dict saved with `save_safetensors` loads in this library's inference layer, in transformers and in vLLM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def has_qk_norm(cfg: dict) -> bool:
    """Qwen3 layers (targets and drafters) normalise q and k per head; Llama layers do not."""
    return cfg.get("model_type", "qwen3") != "llama"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(positions, head_dim: int, theta: float):
    """NeoX RoPE's (cos, sin) for positions (B, T) or (T,), each (.., T, 1, D), computed once per
    forward and shared by every layer."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[..., None] * inv_freq  # (.., T, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[..., None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[..., None, :]
    return cos, sin


def rope(x, rot):
    """NeoX rotate-half RoPE over the full head dim. x (B, T, H, D), rot = rope_tables(...)."""
    cos, sin = rot
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class KVCache:
    """Every layer's keys and values for up to max_len positions, preallocated and written in place:
    extending the cache with torch.cat each decode step copied all of it, a quarter of the step's
    time when generating drafter data (64 rows, SmolLM2-135M, bf16 autocast)."""

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv: int, head_dim: int,
                 dtype=torch.float32):
        self.k = torch.zeros(n_layers, batch, max_len, n_kv, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def extend(self, layer: int, k, v):
        """Write k, v (B, T, H_kv, D) after the cached positions; return the layer's keys and values so far."""
        end = self.length + k.shape[1]
        if end > self.k.shape[2]:
            raise ValueError(f"KVCache: {end} positions exceed max_len {self.k.shape[2]}")
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        # Llama has no per-head q/k norm; Qwen3 targets and every DFlash drafter do
        norm = has_qk_norm(cfg)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"]) if norm else nn.Identity()
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"]) if norm else nn.Identity()

    def project_kv(self, x, rot):
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd))
        v = self.v_proj(x).view(b, t, self.nkv, self.hd)
        return rope(k, rot), v

    def attend(self, x, rot, k, v, mask):
        """Queries from x (RoPE tables rot) over keys k / values v (B, S, H_kv, D); mask (B|1, 1, T, S) bool."""
        b, t, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)), rot)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )  # (B, H_q, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def mlp_block(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class Qwen3LM(nn.Module):
    """Qwen3ForCausalLM (or LlamaForCausalLM: no q/k norm) with public names: model.embed_tokens,
    model.layers.{i}.*, model.norm, lm_head."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def new_cache(self, batch: int, max_len: int, dtype=torch.float32) -> KVCache:
        c = self.cfg
        return KVCache(c["num_hidden_layers"], batch, max_len, c["num_key_value_heads"], c["head_dim"], dtype)

    def forward(self, ids, cache: KVCache | None = None, taps=(), pad=None, last_only: bool = False):
        """ids (B, T). cache: a KVCache (new_cache) this call extends, or None. pad (B,): left-padding
        per row (batched prompts of different lengths): row b's first pad[b] columns are never attended
        to and its positions count from its first real token. last_only: logits of the last position
        only. Returns (logits (B, T or 1, V), [residual after layer i for i in taps], cache)."""
        b, t = ids.shape
        past = 0 if cache is None else cache.length
        pos = torch.arange(past, past + t)
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(past)[None, None]
        if pad is not None:
            pos = (pos[None] - pad[:, None]).clamp(min=0)  # (B, T)
            keys = torch.arange(past + t)
            real = keys[None, :] >= pad[:, None]  # (B, S)
            # a padding row attends to itself only, so its values stay finite (0 * NaN would leak)
            own = keys[None, :] == torch.arange(past, past + t)[:, None]  # (T, S)
            mask = mask & (real[:, None, None, :] | own[None, None])
        x, tapped = self.model.embed_tokens(ids), {}
        rot = rope_tables(pos, self.cfg["head_dim"], self.cfg["rope_theta"])
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            k, v = layer.self_attn.project_kv(h, rot)
            if cache is not None:
                k, v = cache.extend(i, k, v)
            x = layer.mlp_block(x + layer.self_attn.attend(h, rot, k, v, mask))
            if i in taps:  # HF hidden_states[i + 1]; the last entry there is final-normed
                tapped[i] = self.model.norm(x) if i == len(self.model.layers) - 1 else x
        if cache is not None:
            cache.length += t
        return self.lm_head(self.model.norm(x[:, -1:] if last_only else x)), [tapped[i] for i in taps], cache


class DFlashDrafter(nn.Module):
    """DFlash drafter (docs/dflash.md 1) with public names: fc, hidden_norm, layers.{i}.*, norm.

    Training forward over many blocks at once: block n = [token at anchor_n, MASK...] at positions
    anchor_n .. anchor_n + B - 1 sees context features at positions < anchor_n and its own block
    (bidirectionally), nothing else.
    """

    def __init__(self, cfg: dict, n_taps: int):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.fc = nn.Linear(n_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, block_embeds, block_pos, taps, anchors):
        """block_embeds (B, N*Bk, H), block_pos (B, N*Bk), taps (B, L, n*H), anchors (B, N) -> hidden (B, N*Bk, H)."""
        bsz, q_len, _ = block_embeds.shape
        n_blocks = anchors.shape[1]
        bk = q_len // n_blocks
        seq = taps.shape[1]
        ctx = self.hidden_norm(self.fc(taps))  # (B, L, H)
        ctx_pos = torch.arange(seq).expand(bsz, seq)
        # mask (B, 1, N*Bk, L + N*Bk): context strictly before the anchor, own block only
        blk_id = torch.arange(q_len) // bk
        ctx_ok = ctx_pos[:, None, :] < anchors.repeat_interleave(bk, dim=1)[:, :, None]
        blk_ok = (blk_id[:, None] == blk_id[None, :]).expand(bsz, q_len, q_len)
        mask = torch.cat([ctx_ok, blk_ok], -1)[:, None]
        hd, theta, x = self.cfg["head_dim"], self.cfg["rope_theta"], block_embeds
        ctx_rot, block_rot = rope_tables(ctx_pos, hd, theta), rope_tables(block_pos, hd, theta)
        for layer in self.layers:
            h = layer.input_layernorm(x)
            k_c, v_c = layer.self_attn.project_kv(ctx, ctx_rot)
            k_b, v_b = layer.self_attn.project_kv(h, block_rot)
            k, v = torch.cat([k_c, k_b], 1), torch.cat([v_c, v_b], 1)
            x = layer.mlp_block(x + layer.self_attn.attend(h, block_rot, k, v, mask))
        return self.norm(x)


def block_loss_weights(block_size: int, decay: float = 7.0) -> torch.Tensor:
    """Recipe weights for rows 1..B-1: exp(-(k-1)/decay)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / decay)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
