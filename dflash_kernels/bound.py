"""``BoundOps``: the ops bound to one thread count, backend and precision, for callers that own their
buffers (the model layer, engines).

Settings given at construction stay: the thread count (or the contention governor's), the backend
and the precision, so that every matmul of a model computes the same way. Each op goes first to the
compiled fast path that the public ops take too (dflash_kernels/_fastpath.py: the public op's checks in
C, about 1 us on Zen 2, bench/validation_cost.py), and to the public op where that declines. The
choices of kernel path live here too, so every caller gets them: the LM head's greedy pass and whole
compiled decoder layers.
"""

from __future__ import annotations

import copy
import math
import os

import numpy as np

from . import linear_attention as _la
from ._backends import kernel_module, resolve
from ._fastpath import FAST
from ._precision import check_precision, parts as precision_parts
from ._threads import ContentionGovernor, resolve_threads
from .acceptance import accept_greedy, filtered_probs, rejection_sample, sample_filtered
from .attention import cached_attention, injected_kv_attention
from .denoise import denoise_block
from .dense import PackedWeight, apply_rope, linear, prepare_weight, rms_norm, silu_and_mul
from .gdn_layer import run_gated_deltanet_layer
from .layers import run_qwen3_layer

_FAMILIES = ("dense", "attention", "denoise", "acceptance", "linear_attention")
def _fixed_backend(backend):
    """The backend "auto" resolves to when it is the same for every kernel family, else "auto"."""
    if backend != "auto":
        return backend
    names = {resolve("auto", family)[0] for family in _FAMILIES}
    return names.pop() if len(names) == 1 else "auto"


class BoundOps:
    """The public ops with n_threads, backend and precision fixed at construction.

    Each method computes what the public op of its name computes (``linear`` also takes a tuple of
    row blocks; ``cached_attention`` is causal). n_threads=None: the CPUs this process may run on,
    fewer while other processes take the cores (``adapt_threads``, asked once per step; results do
    not depend on it). precision=None: the process default, read once, so that every matmul of a
    model computes the same way.

    Examples
    --------
    >>> ops = dk.BoundOps(n_threads=1)
    >>> x, w = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)
    >>> ops.linear(x, w)
    array([[3., 3., 3., 3.],
           [3., 3., 3., 3.]], dtype=float32)
    >>> ops.rms_norm(x, np.ones(3, np.float32), 1e-6).round(3)
    array([[1., 1., 1.],
           [1., 1., 1.]], dtype=float32)
    """

    def __init__(self, n_threads: int | None = None, backend: str = "auto", precision: str | None = None):
        self.n_threads, self.backend = n_threads, backend
        self.precision = check_precision(precision)
        self._parts = precision_parts(self.precision)
        # "auto" and n_threads=None resolved once: per call they would read the environment again
        self.kw = {"n_threads": resolve_threads(n_threads), "backend": _fixed_backend(backend)}
        name = self.kw["backend"]
        self._dense = kernel_module("dense", name) if name in ("cython", "numba") else None  # the fused layers
        self._linear_packed = getattr(self._dense, "linear_packed", None)  # Cython only
        self.tier = getattr(self._dense, "TIER", None)  # the Cython tier that runs, None elsewhere
        self.linear_shapes: set[tuple[int, int]] = set()  # (N, K) of every matmul run: tune_linear's input
        self._n = self.kw["n_threads"]
        self.governor = ContentionGovernor(self._n) if n_threads is None else None
        self._family = [self]  # these ops and their with_precision twins: one thread count
        # LM-head blocks (verification, drafts): linear + argmax beats denoise_block's vocab-chunked
        # tiles on every tier where Cython runs (bench/bench_denoise.py), and the (rows, V) float32
        # logits are small
        self.block_head_linear = name == "cython"
        # whole decoder layers in one compiled call where the Cython kernels run;
        # DFLASH_FUSED_LAYERS=0 composes the single ops instead (the same bits, slower)
        self.fused_layers = self._linear_packed is not None and os.environ.get("DFLASH_FUSED_LAYERS", "1") != "0"

    def with_precision(self, precision: str | None) -> BoundOps:
        """These ops at another matmul precision, sharing everything else: the backend, the thread
        count and what ``adapt_threads`` decides (on either). For a drafter at "medium" beside a
        target at "highest": drafts only propose tokens, so their precision never changes the output."""
        twin = copy.copy(self)
        twin.precision = check_precision(precision)
        twin._parts = precision_parts(twin.precision)
        self._family.append(twin)  # the same list in every member (copy.copy shares it)
        return twin

    def adapt_threads(self) -> int:
        """With default threads, the count for the next kernels: fewer while other processes take the
        cores (the governor tries more again after a while). Returns the count."""
        if self.governor is not None:
            n = self.governor.update()
            if n != self._n:
                self.kw["n_threads"] = n  # one dict for the whole family (copy.copy shares it)
                for member in self._family:
                    member._n = n
        return self._n

    def prepare(self, w):
        """w in the layout ``linear`` runs fastest here (``prepare_weight``: a packed copy where the
        Cython kernels run, else w). Tuples (unfused row blocks) stay as they are."""
        if isinstance(w, tuple):
            return w
        return prepare_weight(w, backend=self.kw["backend"])

    def linear(self, x, w):
        """x (M, K) @ w^T; w (N, K), a PackedWeight, or a tuple of row blocks (outputs side by side)."""
        return self._matmul(x, w)

    def _matmul(self, x, w):
        if isinstance(w, tuple):
            self.linear_shapes.update((p.shape[0], p.shape[1]) for p in w)
            return np.concatenate([linear(x, part, precision=self.precision, **self.kw) for part in w], axis=-1)
        self.linear_shapes.add(tuple(w.shape[:2]))
        done = FAST.linear(x, w, None, self.precision, self._n, self.backend)
        if done is not None:
            return done
        # the backend asked for: "auto" delegates the shapes tune_linear measured faster in torch
        return linear(x, w, precision=self.precision, n_threads=self._n, backend=self.backend)

    def qwen3_layer(self, x, layer, k_cache, v_cache, start):
        """x (T, H) <- layer(x) in place, one compiled call (``layer.fused``, Cython): as the public
        ``qwen3_layer``, the layer's K/V rows go into k_cache / v_cache (max_len, H_kv, D) at start."""
        run_qwen3_layer(self._dense, x, layer, k_cache, v_cache, start, self._parts, self._n)

    def drafter_layer(self, x, layer, k_ctx, v_ctx, n_ctx):
        """x (T, H) <- a DFlash drafter layer(x) in place, one compiled call: the block over the context
        K/V rows 0..n_ctx-1 of k_ctx / v_ctx (max_len, H_kv, D) and its own K/V (not stored)."""
        run_qwen3_layer(self._dense, x, layer, k_ctx, v_ctx, n_ctx, self._parts, self._n, append=False)

    def gated_deltanet_layer(self, x, layer, conv_state, state, record=None):
        """x (T, H) <- a Qwen3.5 Gated DeltaNet layer(x) in place, one compiled call (``layer.fused``,
        Cython), conv_state (C, K-1) and state (H_v, d_k, d_v) advanced in place; record: None or the
        (mixed, conv_out, g, beta) buffers of ``run_gated_deltanet_layer``."""
        run_gated_deltanet_layer(self._dense, x, layer, conv_state, state, self._parts, self._n, record)

    def rms_norm(self, x, w, eps, *, offset=0.0, residual=None):
        """offset 0: Qwen3 RMSNorm (x w); offset 1: Qwen3.5 zero-centred norm (x (1 + w)). With a
        residual: (rms_norm(x + residual), x + residual), the pre-norm residual add fused in."""
        done = FAST.rms_norm(x, w, eps, offset, residual, self._n, self.backend)
        return done if done is not None else rms_norm(x, w, eps, offset=offset, residual=residual, **self.kw)

    def apply_rope(self, x, positions, theta, rotary_dim=None, *, inv_freq=None, out=None):
        """RoPE over the first rotary_dim dims (default D) of x (T, H, D); out=x rotates in place."""
        done = FAST.apply_rope(x, positions, theta, rotary_dim, inv_freq, out, self._n, self.backend)
        if done is not None:
            return done
        return apply_rope(x, positions, theta, rotary_dim, inv_freq=inv_freq, out=out, **self.kw)

    def silu_and_mul(self, gate_up):
        done = FAST.silu_and_mul(gate_up, self._n, self.backend)
        return done if done is not None else silu_and_mul(gate_up, **self.kw)

    def cached_attention(self, q, k, v, *, window=None):
        """Causal attention of q's rows, the last positions of the cache rows k / v."""
        done = FAST.cached_attention(q, k, v, True, None, window, self.precision, self._n, self.backend)
        if done is not None:
            return done
        return cached_attention(q, k, v, causal=True, window=window, precision=self.precision, **self.kw)

    def injected_kv_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, *, causal_block=False, window=None):
        done = FAST.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, None, causal_block, window, self.precision,
                                          self._n, self.backend)
        if done is not None:
            return done
        return injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, causal_block=causal_block, window=window,
                                     precision=self.precision, **self.kw)

    def argmax_tokens(self, hidden, lm_head):
        """Greedy token per row of final-normed hidden (rows, H): argmax of hidden @ lm_head^T, the
        first on ties, as ``denoise_block`` at temperature 0; int64 (rows,)."""
        if hidden.shape[0] <= 4 or (self.block_head_linear and hidden.shape[0] <= 64) \
                or isinstance(lm_head, PackedWeight):
            # Decode: linear's read-once GEMV path streams the head faster than denoise_block's
            # vocab-chunked tiles, and (1..4, V) logits are small; np.argmax keeps the first index on ties
            logits = np.asarray(self._matmul(hidden, lm_head))
            out = np.argmax(logits, axis=1)
            # argmax picks a NaN (or +inf) wherever there is one: non-finite logits raise here as
            # they do in denoise_block and rejection_sample, instead of choosing a token silently
            if len(out) == 1:  # decode: one scalar test instead of the fancy index below
                bad_row = None if math.isfinite(logits[0, out[0]]) else 0
            else:
                bad = ~np.isfinite(logits[np.arange(len(out)), out])
                bad_row = int(np.flatnonzero(bad)[0]) if bad.any() else None
            if bad_row is not None:
                raise ValueError(f"logits row {bad_row} is not finite (NaN or inf in the weights or activations)")
        else:
            out = denoise_block(hidden, lm_head, temperature=0.0, precision=self.precision, **self.kw)
        return np.asarray(out, dtype=np.int64)

    # -- Qwen3.5 hybrid layers (dflash_kernels.linear_attention) -----------------------------------

    def causal_conv1d(self, x, weight, conv_state):
        """GDN short conv + SiLU over (T, C); conv_state (C, K-1) updated in place."""
        return _la.causal_conv1d(x, weight, conv_state, activation="silu", **self.kw)

    def gated_delta_rule(self, q, k, v, g, beta, state, checkpoints=False):
        """o (T, H_v, d_v), or (o, per-token states) with checkpoints; state updated in place."""
        done = FAST.gated_delta_rule(q, k, v, g, beta, state, checkpoints, True, None, None, None, self._n,
                                     self.backend)
        if done is not None:
            return done
        return _la.gated_delta_rule(q, k, v, g, beta, state, checkpoints=checkpoints, **self.kw)

    def gated_rms_norm(self, x, z, w, eps):
        return _la.gated_rms_norm(x, z, w, eps, **self.kw)

    def split_query_gate(self, qg, n_heads, head_dim):
        return _la.split_query_gate(qg, n_heads, head_dim)

    def apply_output_gate(self, o, gate):
        return _la.apply_output_gate(o, gate, **self.kw)

    # -- acceptance -----------------------------------------------------------------------------------

    def accept_greedy(self, drafts, targets):
        """(num_accepted (B,), out (B, K+1)) for draft ids (B, K) against the target's choices (B, K+1)."""
        done = FAST.accept_greedy(drafts, targets, None, None, self._n, self.backend)
        return done if done is not None else accept_greedy(drafts, targets, **self.kw)

    def filtered_probs(self, logits, temperature, top_k, top_p):
        return filtered_probs(logits, temperature, top_k, top_p, **self.kw)

    def sample_filtered(self, logits, temperature, top_k, top_p, uniforms):
        """(tokens (T,), probs (T, V)): a draw from each row's filtered distribution, and the distributions."""
        return sample_filtered(logits, temperature, top_k, top_p, uniforms=uniforms, **self.kw)

    def rejection_sample(self, drafts, logits, temperature, top_k, top_p, generator, num_draft=None,
                         draft_probs=None):
        return rejection_sample(drafts, logits, draft_probs=draft_probs, temperature=temperature, top_k=top_k,
                                top_p=top_p, num_draft=num_draft, generator=generator, **self.kw)

    # the methods that run kernels (what a caller timing kernel time wraps)
    OPS = ("linear", "qwen3_layer", "drafter_layer", "gated_deltanet_layer", "rms_norm", "apply_rope", "silu_and_mul",
           "cached_attention",
           "injected_kv_attention", "argmax_tokens", "causal_conv1d", "gated_delta_rule", "gated_rms_norm",
           "split_query_gate", "apply_output_gate", "accept_greedy", "filtered_probs", "sample_filtered",
           "rejection_sample")
