"""The dk kernels as the model layer calls them: fixed n_threads / backend, time spent inside counted.

``Ops.kernel_s`` accumulates wall time inside kernel calls, so the engine can report the Python
overhead of a round (round time minus kernel time). The clock costs ~0.1 us per call.
"""

from __future__ import annotations

import math
import os
from time import perf_counter

import numpy as np

import dflash_kernels as dk
from dflash_kernels import linear_attention as _la
from dflash_kernels._autotune import delegates, torch_linear
from dflash_kernels._backends import resolve
from dflash_kernels._precision import check_precision, parts as precision_parts
from dflash_kernels._threads import ContentionGovernor, resolve_threads
from dflash_kernels.layers import run_qwen3_layer

from .weights import release_pages

_FAMILIES = ("dense", "attention", "denoise", "acceptance", "linear_attention")


_W_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16))


def _plain(a, ndim=None) -> bool:
    """A C-contiguous float32 numpy array (of `ndim` dimensions): safe for a direct kernel call."""
    return (type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous
            and (ndim is None or a.ndim == ndim))


def _plain_ids(a, ndim: int) -> bool:
    """A C-contiguous int64 numpy array of `ndim` dimensions (token ids this layer made itself)."""
    return type(a) is np.ndarray and a.dtype == np.int64 and a.flags.c_contiguous and a.ndim == ndim


def _fixed_backend(backend):
    """The backend "auto" resolves to when it is the same for every kernel family, else "auto"."""
    if backend != "auto":
        return backend
    names = {resolve("auto", family)[0] for family in _FAMILIES}
    return names.pop() if len(names) == 1 else "auto"


class Ops:
    def __init__(self, n_threads=None, backend="auto", precision=None):
        self.n_threads, self.backend = n_threads, backend
        # One precision for every matmul of the model (fixed here, not read per call), so a target
        # step and a verification row compute the same way.
        self.precision = check_precision(precision)
        self._parts = precision_parts(self.precision)
        # Resolved once: per call, "auto" and n_threads=None would read the environment again
        # (~4 us of a ~15 us call on this model's small ops).
        self.kw = {"n_threads": resolve_threads(n_threads), "backend": _fixed_backend(backend)}
        self.kernel_s = 0.0
        # The dense kernels are called directly when the operands are arrays this layer made
        # itself (float32 / bf16-as-uint16, C-contiguous): the public wrappers' checks and dispatch
        # cost ~10 us per call, most of a small model's decode step. Anything else takes the
        # public path.
        name = self.kw["backend"]
        self._dense = dk.kernel_module("dense", name) if name in ("cython", "numba") else None
        self._linear_packed = getattr(self._dense, "linear_packed", None)  # Cython only
        self._attention = dk.kernel_module("attention", name) if name in ("cython", "numba") else None
        self._acceptance = dk.kernel_module("acceptance", name) if name in ("cython", "numba") else None
        self._auto = backend == "auto" and name == "cython"  # may delegate tuned shapes to torch
        self.linear_shapes: set[tuple[int, int]] = set()  # (N, K) of every matmul run: tune_linear's input
        self._n = self.kw["n_threads"]
        # default threads (n_threads=None) shrink while other processes take the cores (adapt_threads)
        self.governor = ContentionGovernor(self._n) if n_threads is None else None
        # LM-head blocks (verification, drafts): linear + argmax beats denoise_block's vocab-chunked
        # tiles on every tier (16 x 2048 x 151936 bf16, 2 threads: 87 vs 107 ms on avx2, 64 vs 102
        # on avx512_bf16; inside a Qwen3-1.7B-shape verification on avx512, with the memory-mapped
        # head, 373 ms through denoise_block), and the (rows, V) float32 logits are small
        self.block_head_linear = name == "cython"
        # whole decoder layers in one compiled call (dflash_kernels/layers.py) where the Cython kernels
        # run; DFLASH_FUSED_LAYERS=0 composes the single ops instead (benchmarks: the same bits, slower)
        self.fused_layers = self._linear_packed is not None and os.environ.get("DFLASH_FUSED_LAYERS", "1") != "0"

    def adapt_threads(self) -> int:
        """With default threads, the count for the next kernels: fewer while other processes take the
        cores (dflash_kernels._threads.ContentionGovernor; the engine asks once per step). Results
        do not depend on it."""
        if self.governor is not None:
            n = self.governor.update()
            if n != self._n:
                self._n = self.kw["n_threads"] = n
        return self._n

    def prepare(self, w):
        """w in the layout this Ops' linear runs fastest (``dk.prepare_weight``: a packed copy where
        the Cython kernels run, else w). Tuples (unfused, memory-mapped weights) stay as they are."""
        if isinstance(w, tuple):
            return w
        out = dk.prepare_weight(w, backend=self.kw["backend"])
        if out is not w:
            release_pages(w)  # a memory-mapped source: its values are in the packed copy now
        return out

    def linear(self, x, w):
        """x (M, K) @ w^T; w (N, K), or a tuple of row blocks (unfused weights): outputs side by side."""
        t = perf_counter()
        out = self._matmul(x, w)
        self.kernel_s += perf_counter() - t
        return out

    def _matmul(self, x, w):
        if isinstance(w, tuple):
            self.linear_shapes.update((p.shape[0], p.shape[1]) for p in w)
        else:  # one weight, every step: a plain add, no generator
            self.linear_shapes.add(w.shape[:2])
        if isinstance(w, dk.PackedWeight):
            if self._linear_packed is not None and _plain(x, 2) and x.shape[1] == w.shape[1] and x.size:
                out = np.empty((x.shape[0], w.shape[0]), np.float32)
                self._linear_packed(x, w.data, None, out, n_threads=self._n, parts=self._parts,
                                    weights_finite=w.finite)
            else:
                out = dk.linear(x, w, precision=self.precision, **self.kw)
        elif isinstance(w, tuple):
            out = np.concatenate([dk.linear(x, part, precision=self.precision, **self.kw) for part in w],
                                 axis=-1)
        elif (self._dense is not None and _plain(x, 2) and w.dtype in _W_DTYPES and w.flags.c_contiguous
              and x.shape[1] == w.shape[1] and x.size and w.size):
            out = np.empty((x.shape[0], w.shape[0]), np.float32)
            if self._auto and delegates(x.shape[0], w.shape[0], w.shape[1], w.dtype == np.uint16, self._parts,
                                        self._n):
                torch_linear(x, w, None, self._parts, out, self._n)  # measured faster here (tune-kernels)
            else:
                self._dense.linear(x, w, None, out, n_threads=self._n, parts=self._parts)
        else:
            out = dk.linear(x, w, precision=self.precision, **self.kw)
        return out

    def qwen3_layer(self, x, layer, k_cache, v_cache, start):
        """x (T, H) <- layer(x) in place, as one compiled call (layer.fused, Cython); the layer's K/V rows
        go into k_cache / v_cache (max_len, H_kv, D) at start.."""
        t = perf_counter()
        run_qwen3_layer(self._dense, x, layer, k_cache, v_cache, start, self._parts, self._n)
        self.kernel_s += perf_counter() - t

    def drafter_layer(self, x, layer, k_ctx, v_ctx, n_ctx):
        """x (T, H) <- a DFlash drafter layer(x) in place, one compiled call: the block over the context
        K/V rows 0..n_ctx-1 of k_ctx / v_ctx (max_len, H_kv, D) and its own K/V (not stored)."""
        t = perf_counter()
        run_qwen3_layer(self._dense, x, layer, k_ctx, v_ctx, n_ctx, self._parts, self._n, append=False)
        self.kernel_s += perf_counter() - t

    def rms_norm(self, x, w, eps, offset=0.0):
        """offset 0: Qwen3 RMSNorm (x w); offset 1: Qwen3.5 zero-centred norm (x (1 + w))."""
        t = perf_counter()
        if self._dense is not None and _plain(x) and x.size and _plain(w, 1) and w.shape[0] == x.shape[-1]:
            out = np.empty_like(x)
            self._dense.rms_norm(x.reshape(-1, w.shape[0]), w, out.reshape(-1, w.shape[0]), n_threads=self._n,
                                 eps=eps, offset=offset)
        else:
            out = dk.rms_norm(x, w, eps, offset=offset, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def add_rms_norm(self, x, residual, w, eps, offset=0.0):
        """(rms_norm(x + residual), x + residual): the pre-norm residual add fused into the norm."""
        t = perf_counter()
        if (self._dense is not None and _plain(x, 2) and x.size and _plain(residual, 2)
                and residual.shape == x.shape and _plain(w, 1) and w.shape[0] == x.shape[1]):
            out, new_res = np.empty_like(x), np.empty_like(x)
            self._dense.rms_norm_residual(x, residual, w, out, new_res, n_threads=self._n, eps=eps, offset=offset)
            out = (out, new_res)
        else:
            out = dk.rms_norm(x, w, eps, offset=offset, residual=residual, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def rope(self, x, positions, theta, rotary_dim=None, inv_freq=None):
        """RoPE in place on a float32 C-contiguous (T, H, D) array (first rotary_dim dims; default D);
        inv_freq: scaled frequencies (float64, rotary_dim / 2) instead of theta's."""
        t = perf_counter()
        rd = x.shape[-1] if rotary_dim is None else rotary_dim
        if (self._dense is not None and _plain(x, 3) and x.size and x.flags.writeable
                and isinstance(positions, np.ndarray) and positions.dtype == np.int64
                and positions.shape == (x.shape[0],) and positions.flags.c_contiguous):
            self._dense.apply_rope(x, positions, x, n_threads=self._n, theta=float(theta), rotary_dim=int(rd),
                                   inv_freq=inv_freq)
            out = x
        else:
            out = dk.apply_rope(x, positions, theta, rotary_dim, inv_freq=inv_freq, out=x, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def silu_and_mul(self, gate_up):
        t = perf_counter()
        if self._dense is not None and _plain(gate_up, 2) and gate_up.size and gate_up.shape[1] % 2 == 0:
            out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
            self._dense.silu_and_mul(gate_up, out, n_threads=self._n)
        else:
            out = dk.silu_and_mul(gate_up, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def cached_attention(self, q, k, v, window=None):
        t = perf_counter()
        # direct kernel call for the caches this layer owns (float32 or bf16 bits, C-contiguous): the
        # public checks and dispatch cost ~100 us a call (cProfile, SmolLM2 decode, 1 thread): 30 calls,
        # ~3 ms of a ~30 ms step
        if (self._attention is not None and _plain(q, 3) and type(k) is np.ndarray and k.flags.c_contiguous
                and k.dtype in _W_DTYPES and v.dtype == k.dtype and v.flags.c_contiguous and k.ndim == 3
                and v.shape == k.shape and q.shape[0] <= k.shape[0] and q.shape[2] == k.shape[2]
                and q.shape[1] % k.shape[1] == 0):
            out = np.empty(q.shape, np.float32)
            self._attention.cached_attention(q, k, v, out, n_threads=self._n, causal=True,
                                             scale=q.shape[2] ** -0.5, window=window, parts=self._parts)
        else:
            out = dk.cached_attention(q, k, v, causal=True, window=window, precision=self.precision, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def injected_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, causal_block, window):
        t = perf_counter()
        out = dk.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, causal_block=causal_block, window=window,
                                       precision=self.precision, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def argmax_tokens(self, hidden, lm_head):
        """Greedy token per row of final-normed hidden: argmax of hidden @ lm_head^T, first on ties."""
        t = perf_counter()
        if hidden.shape[0] <= 4 or (self.block_head_linear and hidden.shape[0] <= 64) \
                or isinstance(lm_head, dk.PackedWeight):
            # Decode: linear's read-once GEMV path streams the LM head ~1.7x faster than
            # denoise_block's vocab-chunked tiles (measured on 151936 x 1024 bf16: 16.9 vs 28.9 ms),
            # and (1..4, V) logits are small; np.argmax keeps the first index on ties. Draft blocks
            # with AMX tiles: 15 x 151936 x 2048 in 39.6 vs 96.1 ms (4160 x 256: 0.12 vs 0.49 ms).
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
            out = dk.denoise_block(hidden, lm_head, temperature=0.0, precision=self.precision, **self.kw)
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
        """(num_accepted (B,), out (B, K+1)) for draft ids (B, K) against the target's choices (B, K+1)."""
        t = perf_counter()
        # ids from this layer's argmax (int64, non-negative): the public checks cost ~60 us a round,
        # 3% of a round of the stdlib pair
        if (self._acceptance is not None and _plain_ids(drafts, 2) and _plain_ids(targets, 2)
                and targets.shape == (drafts.shape[0], drafts.shape[1] + 1)):
            b, k = drafts.shape
            out = (np.zeros(b, np.int64), np.empty((b, k + 1), np.int64))
            self._acceptance.accept_greedy(drafts, targets, np.full(b, k, np.int64), *out, n_threads=self._n)
        else:
            out = dk.accept_greedy(drafts, targets, **self.kw)
        self.kernel_s += perf_counter() - t
        return out

    def filtered_probs(self, logits, temperature, top_k, top_p):
        t = perf_counter()
        out = dk.filtered_probs(logits, temperature, top_k, top_p)
        self.kernel_s += perf_counter() - t
        return out

    def rejection_sample(self, drafts, logits, temperature, top_k, top_p, generator, num_draft=None,
                         draft_probs=None):
        t = perf_counter()
        out = dk.rejection_sample(
            drafts, logits, draft_probs=draft_probs, temperature=temperature, top_k=top_k, top_p=top_p,
            num_draft=num_draft, generator=generator, **self.kw,
        )
        self.kernel_s += perf_counter() - t
        return out
