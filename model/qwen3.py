"""Qwen3 dense target on the dk kernels (docs/models.md 1.4): prefill, decode, verification of k+1 rows.

Everything is computed in float32 from bf16 (or f32) weights that the kernels read directly. Every
forward appends its rows to a preallocated KV cache (post-k_norm, post-RoPE K; raw V) and returns
the final-normed hidden of the rows the caller needs plus the DFlash taps: the residual stream after
each layer in ``tap_layer_ids``, concatenated in listed order (HF ``hidden_states[id + 1]``; the
last layer's entry is the final-normed output, as in HF).
"""

from __future__ import annotations

import numpy as np

from dflash_kernels import f32_to_bf16
from dflash_kernels.dense import Q4_INT8, Q8_INT8
from dflash_kernels.layers import Qwen3Layer

from ._ops import Ops
from ._target import TargetBase
from .config import Qwen3Config
from .weights import as_f32, concat_rows

# int8-activation blocks: verification blocks up to this many rows attend row by row (pyx/layers.pxi)
ROW_EXACT_ROWS = 32


def qwen3_layer_shapes(prefix: str, cfg) -> dict[str, tuple]:
    """The 11 tensors of one Qwen3-style decoder layer (targets and DFlash drafters alike); 9 for a
    Llama layer (no q_norm / k_norm)."""
    H, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        prefix + "input_layernorm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        prefix + "self_attn.q_proj.weight": (cfg.q_dim, H),
        prefix + "self_attn.k_proj.weight": (cfg.kv_dim, H),
        prefix + "self_attn.v_proj.weight": (cfg.kv_dim, H),
        prefix + "self_attn.o_proj.weight": (H, cfg.q_dim),
        prefix + "self_attn.q_norm.weight": (D,),
        prefix + "self_attn.k_norm.weight": (D,),
        prefix + "mlp.gate_proj.weight": (inter, H),
        prefix + "mlp.up_proj.weight": (inter, H),
        prefix + "mlp.down_proj.weight": (H, inter),
    }
    if not cfg.qk_norm:
        del shapes[prefix + "self_attn.q_norm.weight"], shapes[prefix + "self_attn.k_norm.weight"]
    return shapes


def qwen3_tensor_shapes(cfg: Qwen3Config) -> dict[str, tuple]:
    """Every tensor a Qwen3ForCausalLM (or LlamaForCausalLM) checkpoint must hold, with its shape
    (docs/models.md 1.3)."""
    H = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update(qwen3_layer_shapes(f"model.layers.{i}.", cfg))
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


def project_qkv(ops, layer, h, pos, cfg, eps):
    """Qwen3 attention inputs for rows h (T, H): q (T, H_q, D), k (T, H_kv, D) after the per-head
    q_norm / k_norm (none in a Llama layer) and RoPE at ``pos``, raw v (T, H_kv, D). Shared by targets
    and drafters."""
    T, Hq, Hkv, D = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qd, kvd = cfg.q_dim, cfg.kv_dim
    qkv = ops.linear(h, layer.w_qkv)  # (T, qd + 2 kvd)
    if layer.q_norm is None:  # Llama; rope rotates in place, so q and k must be their own arrays
        q = np.ascontiguousarray(qkv[:, :qd]).reshape(T, Hq, D)
        k = np.ascontiguousarray(qkv[:, qd : qd + kvd]).reshape(T, Hkv, D)
    else:
        q = ops.rms_norm(qkv[:, :qd].reshape(T * Hq, D), layer.q_norm, eps).reshape(T, Hq, D)
        k = ops.rms_norm(qkv[:, qd : qd + kvd].reshape(T * Hkv, D), layer.k_norm, eps).reshape(T, Hkv, D)
    v = qkv[:, qd + kvd :].reshape(T, Hkv, D)
    freq = cfg.rope_inv_freq  # None unless rope_scaling
    return (ops.apply_rope(q, pos, cfg.rope_theta, inv_freq=freq, out=q),
            ops.apply_rope(k, pos, cfg.rope_theta, inv_freq=freq, out=k), v)


def composed_layers(ops, layers, x, pos, cfg, eps, attend, final_norm=None, on_tap=None, tap_layers=()):
    """Decoder layers over the residual stream x (T, H) as single ops (the path without the fused layer
    calls), shared by targets and drafters: ``attend(li, layer, q, k, v)`` gives the attention output
    (T, H_q, D) and stores what it must. Each layer's MLP residual add is fused into the next norm;
    at ``tap_layers`` it is added at once and ``on_tap(li, x)`` sees the stream. Returns the stream
    normed with ``final_norm``, or None without it."""
    T = x.shape[0]
    delta = None  # (T, H) MLP output not yet added to x
    for li, L in enumerate(layers):
        if delta is None:
            h = ops.rms_norm(x, L.w_in, eps)
        else:  # the previous layer's MLP residual add, fused into this norm
            h, x = ops.rms_norm(delta, L.w_in, eps, residual=x)
        q, k, v = project_qkv(ops, L, h, pos, cfg, eps)
        o = attend(li, L, q, k, v)
        h, x = ops.rms_norm(ops.linear(o.reshape(T, cfg.q_dim), L.w_o), L.w_post, eps, residual=x)
        delta = ops.linear(ops.silu_and_mul(ops.linear(h, L.w_gate_up)), L.w_down)
        if li in tap_layers:
            x, delta = x + delta, None
            on_tap(li, x)
    if final_norm is None:
        return None
    if delta is None:
        return ops.rms_norm(x, final_norm, eps)
    return ops.rms_norm(delta, final_norm, eps, residual=x)[0]


class KVCache:
    """Per-sequence KV cache: (layers, max_len, H_kv, D) K and V, float32 or bf16 (uint16) storage."""

    def __init__(self, n_layers: int, max_len: int, n_kv: int, head_dim: int, dtype: str = "float32"):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"kv_dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        np_dtype = np.float32 if dtype == "float32" else np.uint16
        self.k = np.zeros((n_layers, max_len, n_kv, head_dim), np_dtype)  # (L, T_kv, H_kv, D)
        self.v = np.zeros((n_layers, max_len, n_kv, head_dim), np_dtype)
        self.bf16 = dtype == "bfloat16"
        self.max_len = max_len
        self.length = 0

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store rows pos..pos+T-1 of one layer; k, v (T, H_kv, D) float32."""
        if self.bf16:
            k, v = f32_to_bf16(k), f32_to_bf16(v)
        self.k[layer, pos : pos + k.shape[0]] = k
        self.v[layer, pos : pos + v.shape[0]] = v

    def truncate(self, length: int) -> None:
        """Drop every position >= length (rejected verification rows); the rows are overwritten later."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must lie in [0, {self.length}], got {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0


class Qwen3Model(TargetBase):
    """Qwen3ForCausalLM (or LlamaForCausalLM) forward on the dk kernels."""

    def __init__(self, cfg: Qwen3Config, tensors: dict, origin: dict | None = None, *, ops: Ops | None = None,
                 tap_layer_ids=(), prefill_chunk: int = 512, fuse: bool = True, where: str = "target"):
        """fuse: stack [Wq; Wk; Wv] and [Wgate; Wup] into one bf16 copy per layer (fewer kernel calls);
        False keeps every weight memory-mapped (no copy at all)."""
        t, prep = self._load_shared(cfg, tensors, origin, qwen3_tensor_shapes(cfg), where, ops, prefill_chunk, fuse)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
            self.layers.append(Qwen3Layer(
                w_in=as_f32(t[p + "input_layernorm.weight"]),
                w_qkv=prep(concat_rows(t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"],
                                       fuse=fuse)),
                q_norm=as_f32(t[a + "q_norm.weight"]) if cfg.qk_norm else None,
                k_norm=as_f32(t[a + "k_norm.weight"]) if cfg.qk_norm else None,
                w_o=prep(t[a + "o_proj.weight"]),
                w_post=as_f32(t[p + "post_attention_layernorm.weight"]),
                w_gate_up=prep(concat_rows(t[m + "gate_proj.weight"], t[m + "up_proj.weight"], fuse=fuse)),
                w_down=prep(t[m + "down_proj.weight"]),
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, inv_freq=cfg.rope_inv_freq, window=window,
            ))
        # one compiled call per layer where every layer's weights are packed (Cython): the same kernels
        # in the same order as the loop below, bit for bit (dflash_kernels/layers.py)
        self.fused_layers = self.ops.fused_layers and all(L.fused for L in self.layers)
        self.set_taps(tap_layer_ids)

    def new_cache(self, max_len: int, dtype: str = "float32") -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim, dtype)

    # -- forward -----------------------------------------------------------------------------

    def forward(self, ids, cache: KVCache, *, last_only: bool = False, taps: bool = True, on_taps=None):
        """Run tokens ``ids`` at positions cache.length.. and append their K/V to the cache.

        Returns (hidden, taps): final-normed hidden (T, H) float32 (only the last row, shape (1, H),
        when last_only) and the tap features (T, len(tap_ids) * H) float32 (None when taps=False or
        no taps are configured). Long inputs run in chunks of ``prefill_chunk`` rows; with
        ``on_taps`` each chunk's taps go to ``on_taps(chunk_taps)`` as soon as they exist (a long
        prompt's taps are never held all at once) and the returned taps are None.
        """
        ids = self._forward_ids(ids, cache)
        return self._run_chunks(ids, max(1, self.prefill_chunk), last_only, taps, on_taps,
                                lambda rows, buf, want: self._forward_rows(rows, cache, buf, want))

    def _forward_rows(self, ids, cache: KVCache, tap_out, want_hidden: bool):
        ops, c, eps = self.ops, self.cfg, self.eps
        T = ids.shape[0]
        start = cache.length
        x = self.embed_rows(ids)  # (T, H) residual stream
        if self.fused_layers:
            k_layers, v_layers = cache.k, cache.v
            for li, L in enumerate(self.layers):
                ops.qwen3_layer(x, L, k_layers[li], v_layers[li], start)
                if tap_out is not None and li in self._tap_slot:
                    self._write_taps(tap_out, li, x)
            cache.length = start + T
            return ops.rms_norm(x, self.norm, eps) if want_hidden else None
        pos = np.arange(start, start + T, dtype=np.int64)

        def attend(li, L, q, k, v):
            cache.write(li, start, k, v)
            end = start + T
            if L.quant in (Q4_INT8, Q8_INT8) and 1 < T <= ROW_EXACT_ROWS:  # each row as its decode step
                return np.concatenate([ops.cached_attention(q[t : t + 1], cache.k[li, : start + t + 1],
                                                            cache.v[li, : start + t + 1], window=L.window)
                                       for t in range(T)])
            return ops.cached_attention(q, cache.k[li, :end], cache.v[li, :end], window=L.window)  # (T, Hq, D)

        taps = self._tap_slot if tap_out is not None else ()
        hidden = composed_layers(ops, self.layers, x, pos, c, eps, attend, self.norm if want_hidden else None,
                                 on_tap=lambda li, x: self._write_taps(tap_out, li, x), tap_layers=taps)
        cache.length = start + T
        return hidden
