"""DFlash block-diffusion drafter on the dk kernels (docs/dflash.md 1-2).

Context: each committed position p contributes, once, per layer ``k_norm(c Wk)`` (RoPE at p) and
``c Wv`` with ``c = hidden_norm(fc(taps_p))``; all layers' [Wk; Wv] run as one GEMM and the results
are appended to the drafter's own context cache. Block: ``[anchor, MASK x k]`` at positions
start..start+k attends to the cached context plus its own transient K/V (never cached, so a
rejection needs no drafter rollback). Embeddings and lm_head are the target's.
"""

from __future__ import annotations

import numpy as np

from dflash_kernels.layers import Qwen3Layer
from dflash_kernels.quant import QuantizedRows

from ._ops import Ops
from .config import DFlashConfig
from .qwen3 import composed_layers, qwen3_layer_shapes
from .weights import as_f32, check_tensors, concat_rows, int8_rows, storage


def dflash_tensor_shapes(cfg: DFlashConfig, target_hidden: int) -> dict[str, tuple]:
    """Every tensor a DFlashDraftModel checkpoint must hold (docs/dflash.md 6), names without prefix."""
    H = cfg.hidden_size
    shapes = {
        "fc.weight": (H, len(cfg.target_layer_ids) * target_hidden),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(cfg.num_hidden_layers):
        shapes.update(qwen3_layer_shapes(f"layers.{i}.", cfg))
    return shapes


class ContextCache:
    """Drafter context K/V per committed position: (layers, max_len, H_kv, D) float32."""

    def __init__(self, n_layers: int, max_len: int, n_kv: int, head_dim: int):
        self.k = np.zeros((n_layers, max_len, n_kv, head_dim), np.float32)
        self.v = np.zeros((n_layers, max_len, n_kv, head_dim), np.float32)
        self.max_len = max_len
        self.length = 0

    def reset(self) -> None:
        self.length = 0


class DFlashDrafter:
    """DFlashDraftModel forward; ``embed`` and ``lm_head`` are the target's (V, H) tables."""

    def __init__(self, cfg: DFlashConfig, tensors: dict, embed: np.ndarray, lm_head: np.ndarray, *,
                 origin: dict | None = None, ops: Ops | None = None, target_hidden: int | None = None,
                 fuse: bool = True, where: str = "drafter", int8: bool = False):
        target_hidden = target_hidden or cfg.hidden_size
        check_tensors(tensors, origin or {}, dflash_tensor_shapes(cfg, target_hidden), where)
        if embed.shape[1] != cfg.hidden_size:
            raise ValueError(f"{where}: hidden_size {cfg.hidden_size} != target embedding width {embed.shape[1]}")
        if not 0 <= cfg.mask_token_id < embed.shape[0]:
            raise ValueError(f"{where}: mask_token_id {cfg.mask_token_id} outside the target embedding "
                             f"(0..{embed.shape[0] - 1})")
        self.cfg, self.ops, self.eps = cfg, ops or Ops(), cfg.rms_norm_eps
        self.embed, self.lm_head = embed, lm_head
        t = {k: storage(v) for k, v in tensors.items()}
        prep = self.ops.prepare if fuse else (lambda w: w)  # as in Qwen3Model
        # every matmul weight as Q4_1 blocks times int8 activations (drafts are only proposals), where
        # every K (hidden, intermediate, q_dim, the taps' width) is whole blocks of 32
        ks = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim,
              len(cfg.target_layer_ids) * target_hidden)
        self.int8 = int8 and fuse and all(k % 32 == 0 for k in ks)
        if self.int8:
            def prep(w):
                return self.ops.prepare(int8_rows(w))
        self.fc = prep(t["fc.weight"])
        self.hidden_norm = as_f32(t["hidden_norm.weight"])
        self.norm = as_f32(t["norm.weight"])
        self.mask_embedding = as_f32(embed[cfg.mask_token_id : cfg.mask_token_id + 1])  # (1, H), row as stored
        self.layers = []
        kv_rows = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            wk, wv = t[a + "k_proj.weight"], t[a + "v_proj.weight"]
            kv_rows += [wk, wv]
            self.layers.append(Qwen3Layer(
                w_in=as_f32(t[p + "input_layernorm.weight"]),
                w_qkv=prep(concat_rows(t[a + "q_proj.weight"], wk, wv, fuse=fuse)),
                q_norm=as_f32(t[a + "q_norm.weight"]),
                k_norm=as_f32(t[a + "k_norm.weight"]),
                w_o=prep(t[a + "o_proj.weight"]),
                w_post=as_f32(t[p + "post_attention_layernorm.weight"]),
                w_gate_up=prep(concat_rows(t[m + "gate_proj.weight"], t[m + "up_proj.weight"], fuse=fuse)),
                w_down=prep(t[m + "down_proj.weight"]),
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, inv_freq=cfg.rope_inv_freq,
                window=cfg.window(i), causal=cfg.causal[i],
            ))
        # Context rows are never queried: one GEMM gives every layer's K and V.
        self.w_kv_all = prep(concat_rows(*kv_rows))  # (layers * 2 kv_dim, H) [Wk_0; Wv_0; Wk_1; ...]
        # one compiled call per block layer where the weights are packed (as Qwen3Model.fused_layers)
        self.fused_layers = self.ops.fused_layers and all(L.fused for L in self.layers)
        # the tokens drafts are chosen from: all (the target's head), or a drafting vocabulary
        self.draft_head, self.draft_ids = lm_head, None
        self._prep = prep

    def set_draft_vocab(self, token_ids: np.ndarray, lm_head_table: np.ndarray) -> None:
        """Draft only over `token_ids` (sorted, unique, int64): the drafter's head becomes those rows
        of the target's LM head (`lm_head_table`, as stored), a copy in linear's layout
        (model/draft_vocab.py). Drafts are target token ids as before."""
        ids = np.asarray(token_ids, dtype=np.int64)
        V = lm_head_table.shape[0]
        if ids.ndim != 1 or not ids.size or ids.min() < 0 or ids.max() >= V or np.any(np.diff(ids) <= 0):
            raise ValueError(f"a drafting vocabulary must be sorted, unique token ids in [0, {V})")
        self.draft_ids = ids
        self.draft_head = self._prep(storage(_rows(lm_head_table, ids)))

    def new_cache(self, max_len: int) -> ContextCache:
        c = self.cfg
        return ContextCache(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim)

    def add_context(self, taps: np.ndarray, cache: ContextCache) -> None:
        """Append context K/V for committed positions cache.length.. from target taps (S, n_taps * H_t)."""
        ops, c, eps = self.ops, self.cfg, self.eps
        S = taps.shape[0]
        if S == 0:
            return
        start = cache.length
        if start + S > cache.max_len:
            raise ValueError(f"drafter context overflow: {start} + {S} > max_len {cache.max_len}")
        pos = np.arange(start, start + S, dtype=np.int64)
        ctx = ops.rms_norm(ops.linear(taps, self.fc), self.hidden_norm, eps)  # (S, H)
        kv = ops.linear(ctx, self.w_kv_all)  # (S, layers * 2 kv_dim)
        Hkv, D, kvd = c.num_key_value_heads, c.head_dim, c.kv_dim
        for li, L in enumerate(self.layers):
            off = 2 * kvd * li
            k = ops.rms_norm(kv[:, off : off + kvd].reshape(S * Hkv, D), L.k_norm, eps).reshape(S, Hkv, D)
            cache.k[li, start : start + S] = ops.apply_rope(k, pos, c.rope_theta, inv_freq=c.rope_inv_freq, out=k)
            cache.v[li, start : start + S] = kv[:, off + kvd : off + 2 * kvd].reshape(S, Hkv, D)
        cache.length = start + S

    def block_hidden(self, anchor: int, n_draft: int, cache: ContextCache) -> np.ndarray:
        """Final-normed hidden (n_draft + 1, H) of the block [anchor, MASK x n_draft] at positions
        cache.length .. cache.length + n_draft (the anchor sits right after the committed context)."""
        ops, c, eps = self.ops, self.cfg, self.eps
        B = n_draft + 1
        start = cache.length
        pos = np.arange(start, start + B, dtype=np.int64)
        x = np.empty((B, c.hidden_size), np.float32)  # (B, H) block residual stream
        x[0] = as_f32(self.embed[anchor])
        x[1:] = self.mask_embedding
        if self.fused_layers:
            for li, L in enumerate(self.layers):
                ops.drafter_layer(x, L, cache.k[li], cache.v[li], start)
            return ops.rms_norm(x, self.norm, eps)

        def attend(li, L, q, k, v):
            return ops.injected_kv_attention(q, cache.k[li, :start], cache.v[li, :start], k, v,
                                             causal_block=L.causal, window=L.window)

        return composed_layers(ops, self.layers, x, pos, c, eps, attend, self.norm)

    def draft(self, anchor: int, n_draft: int, cache: ContextCache) -> np.ndarray:
        """n_draft greedy draft tokens (argmax of rows 1..n_draft through the target's lm_head)."""
        h = self.block_hidden(anchor, n_draft, cache)
        best = self.ops.argmax_tokens(h[1:], self.draft_head)
        return best if self.draft_ids is None else self.draft_ids[best]

    def draft_sampled(self, anchor: int, n_draft: int, cache: ContextCache, temperature: float, top_k: int,
                      top_p: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """n_draft drafts sampled from the drafter's own distribution q (its logits under the request's
        temperature / top_k / top_p, dk.sample_filtered), and q itself (n_draft, V): rejection sampling
        with q accepts with probability sum_x min(p(x), q(x)) per position, where a one-hot (argmax)
        draft is accepted only with p(argmax)."""
        h = self.block_hidden(anchor, n_draft, cache)
        drafts, q = self.ops.sample_filtered(self.ops.linear(h[1:], self.draft_head), temperature, top_k, top_p,
                                             rng.random(n_draft))
        if self.draft_ids is None:
            return drafts, q
        # over a drafting vocabulary: q as rows over the target's vocabulary (0 outside the set),
        # which is all rejection sampling needs to stay exact
        full = np.zeros((n_draft, self.embed.shape[0]), np.float32)
        full[:, self.draft_ids] = q
        return self.draft_ids[drafts], full


def _rows(table, ids: np.ndarray):
    """Rows ids of an LM head as stored: an array's as a C-contiguous copy, GGUF blocks as blocks."""
    return table.take(ids) if isinstance(table, QuantizedRows) else np.ascontiguousarray(table[ids])
