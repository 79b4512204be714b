"""The kernels as torch custom ops: ``torch.ops.dflash.<op>``, traceable by torch.compile and export.

Registered when ``dflash_kernels`` is imported. Each op calls the public function of the same name
(same validation, same backend choice: "auto", default threads, the process's matmul precision
unless given) and has a fake implementation that gives the output shapes and dtypes without
computing, so torch.compile(fullgraph=True) and torch.export trace through it. Ops that update a
caller's tensor in place (the Gated DeltaNet state, the conv state) declare it in ``mutates_args``.
Outputs are fresh tensors, float32 for values (bf16 inputs are read as bf16 and computed in fp32,
as everywhere in the library) and int64 for token ids and counts.

Not ops: ``prepare_weight`` / ``pack_weight`` and ``prepare_qwen3_layer`` build Python objects
(packed weights, prepared layers) that a schema cannot carry. ``linear`` takes the plain (N, K)
weight; ``linear_packed`` takes a packed one as a tensor (``PackedWeight.to_tensor()``) plus its
shape, which is how the vLLM plugin calls it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import acceptance, attention, denoise, dense, linear_attention

F32, I64 = torch.float32, torch.int64


def _new(like: Tensor, shape, dtype=F32) -> Tensor:
    return like.new_empty(tuple(int(s) for s in shape), dtype=dtype)


def _t(x) -> Tensor:
    """A result as a fresh contiguous tensor (the public ops return torch for torch inputs)."""
    return x if isinstance(x, Tensor) and x.is_contiguous() else torch.as_tensor(x).contiguous()


# ---- dense -----------------------------------------------------------------------------------------

@torch.library.custom_op("dflash::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, precision: str | None = None) -> Tensor:
    return _t(dense.linear(x, weight, bias, precision=precision))


@linear.register_fake
def _(x, weight, bias=None, precision=None):
    return _new(x, (*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dflash::linear_packed", mutates_args=())
def linear_packed(x: Tensor, packed: Tensor, n: int, k: int, finite: bool = True, bias: Tensor | None = None,
                  precision: str | None = None, n_threads: int | None = None) -> Tensor:
    """``linear`` with a weight packed once: ``packed`` is ``PackedWeight.to_tensor()`` of an (n, k)
    weight, ``finite`` its ``finite`` flag (what an engine keeps per layer instead of the weight).
    n_threads: as ``linear``'s (an engine that sets its own thread count passes it)."""
    return _t(dense.linear(x, dense.PackedWeight.from_data(packed, (n, k), finite), bias, precision=precision,
                           n_threads=n_threads))


@linear_packed.register_fake
def _(x, packed, n, k, finite=True, bias=None, precision=None, n_threads=None):
    return _new(x, (*x.shape[:-1], n))


@torch.library.custom_op("dflash::rms_norm", mutates_args=())
def rms_norm(x: Tensor, w: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    return _t(dense.rms_norm(x, w, eps, offset=offset))


@rms_norm.register_fake
def _(x, w, eps=1e-6, offset=0.0):
    return _new(x, x.shape)


@torch.library.custom_op("dflash::rms_norm_residual", mutates_args=())
def rms_norm_residual(x: Tensor, residual: Tensor, w: Tensor, eps: float = 1e-6,
                      offset: float = 0.0) -> tuple[Tensor, Tensor]:
    out, new_res = dense.rms_norm(x, w, eps, offset=offset, residual=residual)
    return _t(out), _t(new_res)


@rms_norm_residual.register_fake
def _(x, residual, w, eps=1e-6, offset=0.0):
    return _new(x, x.shape), _new(x, x.shape)


@torch.library.custom_op("dflash::apply_rope", mutates_args=())
def apply_rope(x: Tensor, positions: Tensor, theta: float, rotary_dim: int | None = None,
               inv_freq: Tensor | None = None) -> Tensor:
    freq = None if inv_freq is None else inv_freq.detach().cpu().numpy()
    return _t(dense.apply_rope(x, positions, theta, rotary_dim, inv_freq=freq))


@apply_rope.register_fake
def _(x, positions, theta, rotary_dim=None, inv_freq=None):
    return _new(x, x.shape)


@torch.library.custom_op("dflash::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: Tensor) -> Tensor:
    return _t(dense.silu_and_mul(gate_up))


@silu_and_mul.register_fake
def _(gate_up):
    return _new(gate_up, (gate_up.shape[0], gate_up.shape[1] // 2))


# ---- attention -------------------------------------------------------------------------------------

@torch.library.custom_op("dflash::cached_attention", mutates_args=())
def cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, causal: bool = True, scale: float | None = None,
                     window: int | None = None, precision: str | None = None) -> Tensor:
    return _t(attention.cached_attention(q, k_cache, v_cache, causal=causal, scale=scale, window=window,
                                         precision=precision))


@cached_attention.register_fake
def _(q, k_cache, v_cache, causal=True, scale=None, window=None, precision=None):
    return _new(q, q.shape)


@torch.library.custom_op("dflash::injected_kv_attention", mutates_args=())
def injected_kv_attention(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor,
                          causal_block: bool = False, scale: float | None = None,
                          window: int | None = None, precision: str | None = None) -> Tensor:
    return _t(attention.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, causal_block=causal_block,
                                              scale=scale, window=window, precision=precision))


@injected_kv_attention.register_fake
def _(q, k_ctx, v_ctx, k_blk, v_blk, causal_block=False, scale=None, window=None, precision=None):
    return _new(q, q.shape)


# ---- drafting and acceptance -----------------------------------------------------------------------

@torch.library.custom_op("dflash::denoise_block", mutates_args=())
def denoise_block(hidden: Tensor, lm_head: Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  uniforms: Tensor | None = None, precision: str | None = None) -> Tensor:
    return _t(denoise.denoise_block(hidden, lm_head, temperature=temperature, top_k=top_k, top_p=top_p,
                                    uniforms=uniforms, precision=precision)).to(I64)


@denoise_block.register_fake
def _(hidden, lm_head, temperature=0.0, top_k=0, top_p=1.0, uniforms=None, precision=None):
    return _new(hidden, (hidden.shape[0],), I64)


@torch.library.custom_op("dflash::make_draft_block", mutates_args=())
def make_draft_block(anchor_ids: Tensor, mask_token_id: int, block_size: int) -> Tensor:
    return _t(denoise.make_draft_block(anchor_ids, mask_token_id, block_size)).to(I64)


@make_draft_block.register_fake
def _(anchor_ids, mask_token_id, block_size):
    return _new(anchor_ids, (anchor_ids.shape[0], block_size), I64)


@torch.library.custom_op("dflash::accept_greedy", mutates_args=())
def accept_greedy(draft_tokens: Tensor, target_tokens: Tensor,
                  num_draft: Tensor | None = None) -> tuple[Tensor, Tensor]:
    n, tokens = acceptance.accept_greedy(draft_tokens, target_tokens, num_draft)
    return _t(n).to(I64), _t(tokens).to(I64)


@accept_greedy.register_fake
def _(draft_tokens, target_tokens, num_draft=None):
    b, k = draft_tokens.shape
    return _new(draft_tokens, (b,), I64), _new(draft_tokens, (b, k + 1), I64)


@torch.library.custom_op("dflash::rejection_sample", mutates_args=())
def rejection_sample(draft_tokens: Tensor, target_logits: Tensor, uniforms: Tensor,
                     draft_probs: Tensor | None = None, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, num_draft: Tensor | None = None) -> tuple[Tensor, Tensor]:
    n, tokens = acceptance.rejection_sample(draft_tokens, target_logits, draft_probs=draft_probs,
                                            temperature=temperature, top_k=top_k, top_p=top_p,
                                            num_draft=num_draft, uniforms=uniforms)
    return _t(n).to(I64), _t(tokens).to(I64)


@rejection_sample.register_fake
def _(draft_tokens, target_logits, uniforms, draft_probs=None, temperature=1.0, top_k=0, top_p=1.0,
      num_draft=None):
    b, k = draft_tokens.shape
    return _new(draft_tokens, (b,), I64), _new(draft_tokens, (b, k + 1), I64)


@torch.library.custom_op("dflash::filtered_probs", mutates_args=())
def filtered_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    return _t(acceptance.filtered_probs(logits, temperature, top_k, top_p)).to(F32)


@filtered_probs.register_fake
def _(logits, temperature=1.0, top_k=0, top_p=1.0):
    return _new(logits, logits.shape)


@torch.library.custom_op("dflash::sample_filtered", mutates_args=())
def sample_filtered(logits: Tensor, uniforms: Tensor, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> tuple[Tensor, Tensor]:
    tokens, probs = acceptance.sample_filtered(logits, temperature, top_k, top_p, uniforms=uniforms)
    return _t(tokens).to(I64), _t(probs).to(F32)


@sample_filtered.register_fake
def _(logits, uniforms, temperature=1.0, top_k=0, top_p=1.0):
    return _new(logits, logits.shape[:1], I64), _new(logits, logits.shape)


# ---- Qwen3.5 linear attention ----------------------------------------------------------------------

@torch.library.custom_op("dflash::gated_delta_rule", mutates_args=("state",))
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                     use_qk_l2norm: bool = True, scale: float | None = None) -> Tensor:
    """o (T, H_v, d_v); state (H_v, d_k, d_v) float32 contiguous, updated in place."""
    return _t(linear_attention.gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm,
                                                scale=scale))


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, state, use_qk_l2norm=True, scale=None):
    return _new(q, v.shape)


@torch.library.custom_op("dflash::causal_conv1d", mutates_args=("conv_state",))
def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, activation: str | None = "silu") -> Tensor:
    """(T, C); conv_state (C, K-1) float32 contiguous, updated in place."""
    return _t(linear_attention.causal_conv1d(x, weight, conv_state, activation=activation))


@causal_conv1d.register_fake
def _(x, weight, conv_state, activation="silu"):
    return _new(x, x.shape)


@torch.library.custom_op("dflash::conv_state_at", mutates_args=())
def conv_state_at(conv_state_before: Tensor, x: Tensor, n: int) -> Tensor:
    return _t(linear_attention.conv_state_at(conv_state_before, x, n)).to(F32).clone()


@conv_state_at.register_fake
def _(conv_state_before, x, n):
    return _new(conv_state_before, conv_state_before.shape)


@torch.library.custom_op("dflash::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return _t(linear_attention.gated_rms_norm(x, z, weight, eps))


@gated_rms_norm.register_fake
def _(x, z, weight, eps=1e-6):
    return _new(x, x.shape)


@torch.library.custom_op("dflash::split_query_gate", mutates_args=())
def split_query_gate(qg: Tensor, n_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    q, gate = linear_attention.split_query_gate(qg, n_heads, head_dim)
    return _t(q).to(F32).clone(), _t(gate).to(F32).clone()


@split_query_gate.register_fake
def _(qg, n_heads, head_dim):
    t = qg.shape[0]
    return _new(qg, (t, n_heads, head_dim)), _new(qg, (t, n_heads * head_dim))


@torch.library.custom_op("dflash::apply_output_gate", mutates_args=())
def apply_output_gate(o: Tensor, gate: Tensor) -> Tensor:
    return _t(linear_attention.apply_output_gate(o, gate))


@apply_output_gate.register_fake
def _(o, gate):
    return _new(o, gate.shape)


OPS = (linear, linear_packed, rms_norm, rms_norm_residual, apply_rope, silu_and_mul, cached_attention,
       injected_kv_attention, denoise_block, make_draft_block, accept_greedy, rejection_sample, filtered_probs,
       sample_filtered, gated_delta_rule, causal_conv1d, conv_state_at, gated_rms_norm, split_query_gate,
       apply_output_gate)
