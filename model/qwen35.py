"""Qwen3.5 hybrid target on the dk kernels (docs/models.md 2.3-2.8): Gated DeltaNet + gated full attention.

Same interface as ``Qwen3Model`` (forward / prefill / decode / verify / logits / greedy / new_cache,
DFlash taps = the residual stream after each tapped layer, the last layer's final-normed as in HF).
Differences from Qwen3 that matter numerically: every RMSNorm except the GDN output norm is
zero-centred (x (1 + w), ``offset=1``); q_proj rows are per head [query_h | gate_h] and the attention
output is multiplied by sigmoid(gate) before o_proj; RoPE covers only the first ``rotary_dim`` dims.

The cache (``HybridCache``) holds K/V for the full-attention layers and, for each linear layer, the
conv state (C, K-1) and the recurrent state (H_v, d_k, d_v). Those states cannot be cropped like a
KV cache, so a verification forward (k+1 rows) keeps what it needs to rebuild them at any prefix:
the recurrent and conv states before the block and the block's inputs to the conv and the delta rule.
``cache.truncate(start + a + 1)`` restores the states before the block and re-runs the first a + 1
rows' recurrence: bit-identical to token-by-token decoding, at the memory of one extra set of states
plus the block's small inputs, where keeping the state after every row cost k + 1 sets (768 MB per
16-row block at Qwen3.5-9B) and as many bytes written per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_kernels import GatedDeltaNetLayer, Qwen3Layer, gated_deltanet_gates
from dflash_kernels.linear_attention import conv_state_rows, gated_delta_rule

from ._ops import Ops
from ._target import TargetBase
from .qwen3 import KVCache
from .qwen35_config import Qwen35Config
from .weights import as_f32, concat_rows

SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # vision tower and the MTP head: not used for decoding


def qwen35_tensor_shapes(cfg: Qwen35Config) -> dict[str, tuple]:
    """Every text-model tensor a Qwen3.5 checkpoint must hold, with its shape (docs/models.md 2.3)."""
    H, inter, D, P = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.prefix
    shapes = {P + "embed_tokens.weight": (cfg.vocab_size, H), P + "norm.weight": (H,)}
    Hv = cfg.linear_num_value_heads
    for i, kind in enumerate(cfg.layer_types):
        p = f"{P}layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        })
        if kind == "full_attention":
            a = p + "self_attn."
            shapes.update({
                a + "q_proj.weight": (2 * cfg.q_dim, H),  # per head [query | gate]
                a + "k_proj.weight": (cfg.kv_dim, H),
                a + "v_proj.weight": (cfg.kv_dim, H),
                a + "o_proj.weight": (H, cfg.q_dim),
                a + "q_norm.weight": (D,),
                a + "k_norm.weight": (D,),
            })
        else:
            a = p + "linear_attn."
            shapes.update({
                a + "in_proj_qkv.weight": (cfg.conv_dim, H),
                a + "in_proj_z.weight": (cfg.lin_value_dim, H),
                a + "in_proj_b.weight": (Hv, H),
                a + "in_proj_a.weight": (Hv, H),
                a + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                a + "A_log": (Hv,),
                a + "dt_bias": (Hv,),
                a + "norm.weight": (cfg.linear_value_head_dim,),
                a + "out_proj.weight": (H, cfg.lin_value_dim),
            })
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


@dataclass
class _FullLayer:
    w_qkv: np.ndarray | tuple  # (2 q_dim + 2 kv_dim, H): [Wq (per head query|gate); Wk; Wv]
    q_norm: np.ndarray  # (D,) f32, zero-centred
    k_norm: np.ndarray
    w_o: np.ndarray  # (H, q_dim)


@dataclass
class _LinearLayer:
    w_in: np.ndarray | tuple  # (C + H_v d_v + 2 H_v, H): [W_qkv; W_z; W_b; W_a]
    conv: np.ndarray  # (C, K) storage dtype
    neg_a: np.ndarray  # (H_v,) f32: -exp(A_log)
    dt_bias: np.ndarray  # (H_v,) f32
    norm: np.ndarray  # (d_v,) f32, ones-centred (gated norm)
    w_out: np.ndarray  # (H, H_v d_v)


@dataclass
class _Layer:
    w_in: np.ndarray  # (H,) f32 zero-centred input_layernorm
    w_post: np.ndarray  # (H,) f32 zero-centred post_attention_layernorm
    w_gate_up: np.ndarray | tuple  # (2I, H)
    w_down: np.ndarray  # (H, I)
    mixer: _FullLayer | _LinearLayer
    slot: int  # index among the layers of its kind (KV slot or linear-state slot)
    # the layer's weights as one compiled call takes them: a linear layer's, or a full-attention one's
    gdn: GatedDeltaNetLayer | None = None
    full: Qwen3Layer | None = None


@dataclass
class _Record:
    """What a verification forward keeps so that truncate() can restore any accepted prefix."""

    start: int  # cache length before the block
    n: int  # rows in the block
    conv_before: np.ndarray  # (n_lin, C, K-1) conv states before the block
    state_before: np.ndarray  # (n_lin, H_v, d_k, d_v) recurrent states before the block
    mixed: list  # per linear layer: (n, C) conv inputs of the block
    inputs: list  # per linear layer: the block's (q, k, v, g, beta) for the delta rule


class HybridCache:
    """Per-sequence cache of a Qwen3.5 target.

    kv: K/V of the full-attention layers (``KVCache``, float32 or bf16 storage); conv (n_lin, C, K-1)
    and state (n_lin, H_v, d_k, d_v) float32 for the linear layers (the state after ``length`` tokens).
    record_limit: verification blocks of up to this many rows keep what truncate() needs (the states
    before the block, once, and the block's inputs). delta_rule: the ``gated_delta_rule`` that
    re-runs the kept rows (the model's, so that it computes exactly as the forward did).
    """

    def __init__(self, cfg: Qwen35Config, max_len: int, dtype: str = "float32", record_limit: int = 64,
                 delta_rule=None):
        n_lin = len(cfg.linear_layers)
        self.kv = KVCache(len(cfg.full_layers), max_len, cfg.num_key_value_heads, cfg.head_dim, dtype)
        self.conv = np.zeros((n_lin, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), np.float32)
        self.state = np.zeros((n_lin, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                               cfg.linear_value_head_dim), np.float32)
        self.max_len = max_len
        self.record_limit = record_limit
        self.length = 0
        self._rec: _Record | None = None
        self._state_before = np.empty_like(self.state)  # reused by every verification forward
        self._delta_rule = delta_rule

    def reset(self) -> None:
        self.length = 0
        self.conv[...] = 0.0
        self.state[...] = 0.0
        self._rec = None

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions: K/V rows are cut, linear states are rebuilt from what
        the last verification forward kept (lengths start+1 .. start+rows). 0 resets."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"truncate length must be an int, got {length!r}")
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must lie in [0, {self.length}] (the verified tokens), got {length}")
        if length == self.length:
            return
        if length == 0:
            self.reset()
            return
        rec = self._rec
        if rec is None or not rec.start < length <= rec.start + rec.n:
            have = "no verification checkpoints are kept" if rec is None else \
                f"checkpoints exist for lengths {rec.start + 1}..{rec.start + rec.n}"
            raise ValueError(f"cannot truncate the hybrid cache from {self.length} to {length}: Gated DeltaNet "
                             f"states cannot be cropped and {have} (run a multi-token forward with "
                             "checkpoints, or reset() and re-run the prefix)")
        j = length - rec.start  # rows of the block kept
        rule = self._delta_rule or gated_delta_rule
        for s in range(self.state.shape[0]):
            self.state[s] = rec.state_before[s]
            rule(*(a[:j] for a in rec.inputs[s]), self.state[s])  # the kept rows again, in place
            conv_state_rows(rec.conv_before[s], rec.mixed[s], j, out=self.conv[s])
        self.length = length


class Qwen35Model(TargetBase):
    """Qwen3_5ForCausalLM (text model of Qwen3_5ForConditionalGeneration) forward on the dk kernels."""

    def __init__(self, cfg: Qwen35Config, tensors: dict, origin: dict | None = None, *, ops: Ops | None = None,
                 tap_layer_ids=(), prefill_chunk: int = 512, fuse: bool = True, where: str = "target"):
        """tensors: the whole checkpoint (vision / MTP tensors are skipped). fuse: stack each layer's
        input projections into one in-RAM copy (one GEMM); False keeps every weight memory-mapped."""
        tensors = {k: v for k, v in tensors.items() if not k.startswith(SKIPPED_PREFIXES)}
        P = cfg.prefix
        t, prep = self._load_shared(cfg, tensors, origin, qwen35_tensor_shapes(cfg), where, ops, prefill_chunk, fuse,
                                    prefix=P)
        self.layers = []
        n_full = n_lin = 0
        for i, kind in enumerate(cfg.layer_types):
            p = f"{P}layers.{i}."
            if kind == "full_attention":
                a = p + "self_attn."
                mixer = _FullLayer(
                    w_qkv=prep(concat_rows(t[a + "q_proj.weight"], t[a + "k_proj.weight"],
                                           t[a + "v_proj.weight"], fuse=fuse)),
                    q_norm=as_f32(t[a + "q_norm.weight"]),
                    k_norm=as_f32(t[a + "k_norm.weight"]),
                    w_o=prep(t[a + "o_proj.weight"]),
                )
                slot, n_full = n_full, n_full + 1
            else:
                a = p + "linear_attn."
                conv = t[a + "conv1d.weight"]
                mixer = _LinearLayer(
                    w_in=prep(concat_rows(t[a + "in_proj_qkv.weight"], t[a + "in_proj_z.weight"],
                                          t[a + "in_proj_b.weight"], t[a + "in_proj_a.weight"], fuse=fuse)),
                    conv=conv.reshape(conv.shape[0], conv.shape[2]),
                    neg_a=-np.exp(as_f32(t[a + "A_log"])),  # fp32, as HF's A_log.float().exp()
                    dt_bias=as_f32(t[a + "dt_bias"]),
                    norm=as_f32(t[a + "norm.weight"]),
                    w_out=prep(t[a + "out_proj.weight"]),
                )
                slot, n_lin = n_lin, n_lin + 1
            m = p + "mlp."
            layer = _Layer(
                w_in=as_f32(t[p + "input_layernorm.weight"]),
                w_post=as_f32(t[p + "post_attention_layernorm.weight"]),
                w_gate_up=prep(concat_rows(t[m + "gate_proj.weight"], t[m + "up_proj.weight"], fuse=fuse)),
                w_down=prep(t[m + "down_proj.weight"]),
                mixer=mixer,
                slot=slot,
            )
            if kind == "full_attention":
                layer.full = Qwen3Layer(
                    w_in=layer.w_in, w_qkv=mixer.w_qkv, q_norm=mixer.q_norm, k_norm=mixer.k_norm, w_o=mixer.w_o,
                    w_post=layer.w_post, w_gate_up=layer.w_gate_up, w_down=layer.w_down,
                    num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    eps=self.eps, rope_theta=cfg.rope_theta, norm_offset=1.0, output_gate=True,
                    rotary_dim=cfg.rotary_dim)
            else:
                layer.gdn = GatedDeltaNetLayer(
                    w_in=layer.w_in, w_proj=mixer.w_in, conv=as_f32(mixer.conv), neg_a=mixer.neg_a,
                    dt_bias=mixer.dt_bias, norm=mixer.norm, w_out=mixer.w_out, w_post=layer.w_post,
                    w_gate_up=layer.w_gate_up, w_down=layer.w_down, num_k_heads=cfg.linear_num_key_heads,
                    num_v_heads=cfg.linear_num_value_heads, k_head_dim=cfg.linear_key_head_dim,
                    v_head_dim=cfg.linear_value_head_dim, eps=self.eps)
            self.layers.append(layer)
        # every layer in one compiled call where the weights are packed (Cython): the same kernels in
        # the same order as _full_attention / _linear_attention and the loop around them, bit for bit
        self.fused_layers = self.ops.fused_layers and all((L.gdn or L.full).fused for L in self.layers)
        self.set_taps(tap_layer_ids)

    def new_cache(self, max_len: int, dtype: str = "float32", record_limit: int = 64) -> HybridCache:
        return HybridCache(self.cfg, max_len, dtype, record_limit, delta_rule=self.ops.gated_delta_rule)

    # -- forward -----------------------------------------------------------------------------

    def forward(self, ids, cache: HybridCache, *, last_only: bool = False, taps: bool = True, on_taps=None,
                checkpoints: bool | None = None):
        """Run tokens ``ids`` at positions cache.length.. and advance the cache.

        Returns (hidden, taps) exactly as ``Qwen3Model.forward``. checkpoints: keep the linear
        layers' states before the block and the block's inputs so that ``cache.truncate(n)`` can go
        back to any n in
        start+1 .. start+T; None (default) = on for blocks of 2 .. cache.record_limit rows when not
        last_only (verification), off for prompts (last_only) and single tokens.
        """
        ids = self._forward_ids(ids, cache)
        T = ids.shape[0]
        if checkpoints is None:
            checkpoints = not last_only and 1 < T <= cache.record_limit
        chunk = T if checkpoints else max(1, self.prefill_chunk)  # a recorded block runs in one piece
        cache._rec = None  # older checkpoints describe states this forward overwrites
        record = bool(checkpoints)
        return self._run_chunks(ids, chunk, last_only, taps, on_taps,
                                lambda rows, buf, want: self._forward_rows(rows, cache, buf, want, record))

    def _full_attention(self, L: _FullLayer, slot: int, h, cache: HybridCache, pos):
        ops, c, eps = self.ops, self.cfg, self.eps
        T = h.shape[0]
        Hq, Hkv, D, qd, kvd = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.q_dim, c.kv_dim
        qkv = ops.linear(h, L.w_qkv)  # (T, 2 qd + 2 kvd)
        query, gate = ops.split_query_gate(qkv[:, : 2 * qd], Hq, D)  # (T, Hq, D), (T, qd)
        q = ops.rms_norm(query.reshape(T * Hq, D), L.q_norm, eps, offset=1.0).reshape(T, Hq, D)
        k = ops.rms_norm(qkv[:, 2 * qd : 2 * qd + kvd].reshape(T * Hkv, D), L.k_norm, eps, offset=1.0)
        k = k.reshape(T, Hkv, D)
        v = qkv[:, 2 * qd + kvd :].reshape(T, Hkv, D)
        q = ops.apply_rope(q, pos, c.rope_theta, c.rotary_dim, out=q)  # first rotary_dim dims only
        k = ops.apply_rope(k, pos, c.rope_theta, c.rotary_dim, out=k)
        start = int(pos[0])
        cache.kv.write(slot, start, k, v)
        end = start + T
        o = ops.cached_attention(q, cache.kv.k[slot, :end], cache.kv.v[slot, :end])  # (T, Hq, D)
        return ops.linear(ops.apply_output_gate(o, gate), L.w_o)  # o * sigmoid(gate), then o_proj

    def _linear_attention(self, L: _LinearLayer, slot: int, h, cache: HybridCache, rec: _Record | None):
        ops, c = self.ops, self.cfg
        T = h.shape[0]
        C, vd, Hk, Hv = c.conv_dim, c.lin_value_dim, c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv, kd = c.linear_key_head_dim, c.linear_value_head_dim, c.lin_key_dim
        proj = ops.linear(h, L.w_in)  # (T, C + vd + 2 Hv): [qkv | z | b | a]
        mixed = np.ascontiguousarray(proj[:, :C])
        z = proj[:, C : C + vd].reshape(T, Hv, dv)
        b = proj[:, C + vd : C + vd + Hv]
        a = proj[:, C + vd + Hv :]
        if rec is not None:
            rec.conv_before[slot] = cache.conv[slot]
            rec.mixed.append(mixed)
        y = ops.causal_conv1d(mixed, L.conv, cache.conv[slot])  # (T, C), SiLU applied
        q = y[:, :kd].reshape(T, Hk, dk)
        k = y[:, kd : 2 * kd].reshape(T, Hk, dk)
        v = y[:, 2 * kd :].reshape(T, Hv, dv)
        g, beta = gated_deltanet_gates(a, b, L.neg_a, L.dt_bias, backend=ops.kw["backend"])  # (T, Hv) each
        if rec is not None:
            rec.state_before[slot] = cache.state[slot]
            rec.inputs.append((q, k, v, g, beta))
        o = ops.gated_delta_rule(q, k, v, g, beta, cache.state[slot])
        o = ops.gated_rms_norm(o, z, L.norm, self.eps)  # (T, Hv, dv), per value head
        return ops.linear(o.reshape(T, vd), L.w_out)

    def _fused_linear_layer(self, L: _Layer, x, cache: HybridCache, rec: _Record | None):
        """x <- the Gated DeltaNet layer L(x) in place, one compiled call; with rec, what truncate()
        re-runs is kept as _linear_attention keeps it."""
        slot, c = L.slot, self.cfg
        record = None
        if rec is not None:
            T, C, Hv = x.shape[0], c.conv_dim, c.linear_num_value_heads
            rec.conv_before[slot] = cache.conv[slot]
            rec.state_before[slot] = cache.state[slot]
            record = (np.empty((T, C), np.float32), np.empty((T, C), np.float32), np.empty((T, Hv), np.float32),
                      np.empty((T, Hv), np.float32))
        self.ops.gated_deltanet_layer(x, L.gdn, cache.conv[slot], cache.state[slot], record)
        if rec is not None:
            mixed, y, g, beta = record
            Hk, dk, dv, kd = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.lin_key_dim
            rec.mixed.append(mixed)
            rec.inputs.append((y[:, :kd].reshape(T, Hk, dk), y[:, kd:2 * kd].reshape(T, Hk, dk),
                               y[:, 2 * kd:].reshape(T, Hv, dv), g, beta))

    def _forward_rows(self, ids, cache: HybridCache, tap_out, want_hidden: bool, record: bool):
        ops, eps = self.ops, self.eps
        T = ids.shape[0]
        start = cache.length
        pos = np.arange(start, start + T, dtype=np.int64)
        rec = None
        if record:
            rec = _Record(start, T, np.empty_like(cache.conv), cache._state_before, [], [])
        x = self.embed_rows(ids)  # (T, H) residual stream
        delta = None  # (T, H) MLP output not yet added to x
        for li, L in enumerate(self.layers):
            if self.fused_layers:  # x <- the whole layer (delta stays None)
                if L.full is not None:
                    ops.qwen3_layer(x, L.full, cache.kv.k[L.slot], cache.kv.v[L.slot], start)
                else:
                    self._fused_linear_layer(L, x, cache, rec)
            else:
                if delta is None:
                    h = ops.rms_norm(x, L.w_in, eps, offset=1.0)
                else:  # the previous layer's MLP residual add, fused into this norm
                    h, x = ops.rms_norm(delta, L.w_in, eps, offset=1.0, residual=x)
                if isinstance(L.mixer, _FullLayer):
                    out = self._full_attention(L.mixer, L.slot, h, cache, pos)
                else:
                    out = self._linear_attention(L.mixer, L.slot, h, cache, rec)
                h, x = ops.rms_norm(out, L.w_post, eps, offset=1.0, residual=x)
                delta = ops.linear(ops.silu_and_mul(ops.linear(h, L.w_gate_up)), L.w_down)
            if tap_out is not None and li in self._tap_slot:
                if delta is not None:
                    x, delta = x + delta, None
                self._write_taps(tap_out, li, x, norm_offset=1.0)  # Qwen3.5's zero-centred final norm
        cache.length = start + T
        cache._rec = rec
        if not want_hidden:
            return None
        if delta is None:
            return ops.rms_norm(x, self.norm, eps, offset=1.0)
        return ops.rms_norm(delta, self.norm, eps, offset=1.0, residual=x)[0]

    def verify(self, tokens, cache: HybridCache):
        """[anchor, drafts...] (k+1 tokens) -> (float32 logits (k+1, V), taps); keeps per-row linear
        states, so ``cache.truncate(start + accepted + 1)`` afterwards restores the accepted prefix."""
        hidden, taps = self.forward(tokens, cache, checkpoints=len(tokens) > 1)
        return self.logits(hidden), taps
