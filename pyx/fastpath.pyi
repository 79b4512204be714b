"""Stub of dflash_kernels._cython.fastpath (pyx/fastpath.pyx): the public ops' compiled fast path,
compiled once (not per tier). Each op method takes the public op's arguments, in the order written
out here, and returns its result, or None where the public op's Python path must run."""

from collections.abc import Callable, Sequence
from typing import Any

def settings_changed() -> None: ...

class Fast:
    def __init__(self, refresh: Callable[[], dict], environ_data: dict, keys: Sequence[bytes]) -> None: ...
    def linear(self, x, weight, bias, precision, n_threads, backend) -> Any: ...
    def rms_norm(self, x, w, eps, offset, residual, n_threads, backend) -> Any: ...
    def apply_rope(self, x, positions, theta, rotary_dim, inv_freq, out, n_threads, backend) -> Any: ...
    def silu_and_mul(self, gate_up, n_threads, backend) -> Any: ...
    def cached_attention(self, q, k_cache, v_cache, causal, scale, window, precision, n_threads, backend) -> Any: ...
    def injected_kv_attention(
        self, q, k_ctx, v_ctx, k_blk, v_blk, scale, causal_block, window, precision, n_threads, backend
    ) -> Any: ...
    def denoise_block(
        self, hidden, lm_head, temperature, top_k, top_p, generator, uniforms, precision, n_threads, backend
    ) -> Any: ...
    def rejection_sample(
        self,
        draft_tokens,
        target_logits,
        draft_probs,
        temperature,
        top_k,
        top_p,
        num_draft,
        uniforms,
        generator,
        n_threads,
        backend,
    ) -> Any: ...
    def gated_delta_rule(
        self,
        q,
        k,
        v,
        g,
        beta,
        state,
        checkpoints,
        use_qk_l2norm,
        scale,
        chunk_size,
        checkpoints_out,
        n_threads,
        backend,
    ) -> Any: ...
    def accept_greedy(self, draft_tokens, target_tokens, num_draft, vocab_size, n_threads, backend) -> Any: ...
