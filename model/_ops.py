"""The dk kernels as the model layer calls them: fixed n_threads / backend, time spent inside counted.

``Ops.kernel_s`` accumulates wall time inside kernel calls, so the engine can report the Python
overhead of a round (round time minus kernel time). The clock costs ~0.1 us per call.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

import dflash_kernels as dk
from dflash_kernels import linear_attention as _la


class Ops:
    def __init__(self, n_threads=None, backend="auto"):
        self.n_threads, self.backend = n_threads, backend
        self.kw = {"n_threads": n_threads, "backend": backend}
        self.kernel_s = 0.0

    def linear(self, x, w):
        """x (M, K) @ w^T; w (N, K), or a tuple of row blocks (unfused weights): outputs side by side."""
        t = perf_counter()
        if isinstance(w, tuple):
            out = np.concatenate([dk.linear(x, part, **self.kw) for part in w], axis=-1)
        else:
            out = dk.linear(x, w, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def rms_norm(self, x, w, eps, offset=0.0):
        """offset 0: Qwen3 RMSNorm (x w); offset 1: Qwen3.5 zero-centred norm (x (1 + w))."""
        t = perf_counter()
        out = dk.rms_norm(x, w, eps, offset=offset, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def add_rms_norm(self, x, residual, w, eps, offset=0.0):
        """(rms_norm(x + residual), x + residual): the pre-norm residual add fused into the norm."""
        t = perf_counter()
        out = dk.rms_norm(x, w, eps, offset=offset, residual=residual, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def rope(self, x, positions, theta, rotary_dim=None):
        """RoPE in place on a float32 C-contiguous (T, H, D) array (first rotary_dim dims; default D)."""
        t = perf_counter()
        out = dk.apply_rope(x, positions, theta, rotary_dim, out=x, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def silu_and_mul(self, gate_up):
        t = perf_counter()
        out = dk.silu_and_mul(gate_up, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def cached_attention(self, q, k, v, window=None):
        t = perf_counter()
        out = dk.cached_attention(q, k, v, causal=True, window=window, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def injected_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, causal_block, window):
        t = perf_counter()
        out = dk.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, causal_block=causal_block, window=window,
                                       **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def argmax_tokens(self, hidden, lm_head):
        """Greedy token per row of final-normed hidden: argmax of hidden @ lm_head^T, first on ties."""
        t = perf_counter()
        if hidden.shape[0] <= 4:
            # Decode: linear's read-once GEMV path streams the LM head ~1.7x faster than
            # denoise_block's vocab-chunked tiles (measured on 151936 x 1024 bf16: 16.9 vs 28.9 ms),
            # and (1..4, V) logits are small; np.argmax keeps the first index on ties.
            out = np.argmax(np.asarray(dk.linear(hidden, lm_head, **self.kw)), axis=1)
        else:
            out = dk.denoise_block(hidden, lm_head, temperature=0.0, **self.kw)
        self.kernel_s += perf_counter() - t
        return np.asarray(out, dtype=np.int64)

    # -- Qwen3.5 hybrid layers (dflash_kernels.linear_attention) -----------------------------------

    def causal_conv1d(self, x, weight, conv_state):
        """GDN short conv + SiLU over (T, C); conv_state (C, K-1) updated in place."""
        t = perf_counter()
        out = _la.causal_conv1d(x, weight, conv_state, activation="silu", **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def gated_delta_rule(self, q, k, v, g, beta, state, checkpoints=False):
        """o (T, H_v, d_v), or (o, per-token states) with checkpoints; state updated in place."""
        t = perf_counter()
        out = _la.gated_delta_rule(q, k, v, g, beta, state, checkpoints=checkpoints, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def gated_rms_norm(self, x, z, w, eps):
        t = perf_counter()
        out = _la.gated_rms_norm(x, z, w, eps, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def split_query_gate(self, qg, n_heads, head_dim):
        t = perf_counter()
        out = _la.split_query_gate(qg, n_heads, head_dim)
        self.kernel_s += perf_counter() - t
        return out

    def apply_output_gate(self, o, gate):
        t = perf_counter()
        out = _la.apply_output_gate(o, gate, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def accept_greedy(self, drafts, targets):
        t = perf_counter()
        out = dk.accept_greedy(drafts, targets, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def rejection_sample(self, drafts, logits, temperature, top_k, top_p, generator, num_draft=None):
        t = perf_counter()
        out = dk.rejection_sample(
            drafts, logits, temperature=temperature, top_k=top_k, top_p=top_p, num_draft=num_draft,
            generator=generator, **self.kw,
        )
        self.kernel_s += perf_counter() - t
        return out
