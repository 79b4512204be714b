"""Attention for DFlash: the drafter's injected-KV attention and attention over a KV cache.

Both ops compute, per query head h (GQA: it reads kv head ``h // (H_q // H_kv)``),
``softmax(q K^T * scale + mask) V`` over keys numbered by absolute position 0 .. T_kv-1, where
query i sits at position p_i. A key at position j is visible to the query at p when

    lo(p) <= j <= hi(p),   lo(p) = max(0, p - window + 1) if window else 0,
                           hi(p) = p if causal else T_kv - 1,

so every query sees at least its own position (window >= 1): no row is ever fully masked.

Storage: q float32 or bf16 (upcast once, it is small); K/V float32 or bf16 (torch.bfloat16 or numpy
uint16), read directly by the kernels. Outputs are float32. Inputs must be finite: NaN/inf in q, K
or V give unspecified (typically NaN) outputs for the rows that see them.

Precision (``precision=``, default ``set_matmul_precision``'s): "highest" and "high" compute both
products exactly in fp32 (over bf16 K and V on AMX tiles, the queries and the probabilities split
into three bf16 parts, whose sum is exact). "medium" gives both products bf16 operands, as torch's bf16 SDPA does: the
scaled queries, K, V and the probabilities are rounded to bf16 (nearest even), their products are
exact and summed in fp32, and the softmax's max, exp and sum stay fp32. It runs on AMX tiles where
the CPU has them, on vdpbf16ps where that measures ahead of FMA (Zen 4: twice the rate), and on FMA
over the rounded operands elsewhere; bf16 K/V are read without conversion on the first two.
"""

from __future__ import annotations

import math

import numpy as np

from ._dispatch import run
from ._docs import shared_doc
from ._fastpath import FAST
from ._precision import parts as precision_parts
from ._tensors import Array, any_torch, f32_array, float_array, wrap


def _window(window):
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    return min(int(window), 2**62)  # wider than any sequence: the same as no window (and fits C)


def _scale(scale, d: int) -> float:
    if scale is None:
        return d ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def _kv_pair(k, v, k_name: str, v_name: str, h_kv=None, d=None):
    """Validate a (T, H_kv, D) key/value pair; return numpy arrays (float32 or uint16)."""
    ka = float_array(k, k_name, ndim=3)
    va = float_array(v, v_name, ndim=3)
    if ka.shape != va.shape:
        raise ValueError(f"{k_name} and {v_name} must have the same shape, got {ka.shape} and {va.shape}")
    if ka.dtype != va.dtype:
        raise TypeError(f"{k_name} and {v_name} must have the same dtype, got {ka.dtype} and {va.dtype}")
    if h_kv is not None and ka.shape[1] != h_kv:
        raise ValueError(f"{k_name} must have {h_kv} kv heads like the other keys, got shape {ka.shape}")
    if d is not None and ka.shape[2] != d:
        raise ValueError(f"{k_name} head dim must equal q's head dim {d}, got shape {ka.shape}")
    return ka, va


def _check_q(qa):
    if qa.shape[2] < 1:
        raise ValueError(f"q must have a head dim D >= 1, got shape {qa.shape}")


def _check_heads(h_q: int, h_kv: int, k_name: str):
    if h_kv < 1 or h_q < 1 or h_q % h_kv:
        raise ValueError(f"q heads ({h_q}) must be a positive multiple of {k_name} heads ({h_kv})")


@shared_doc
def injected_kv_attention(q: Array, k_ctx: Array, v_ctx: Array, k_blk: Array, v_blk: Array, *,
                          scale: float | None = None, causal_block: bool = False, window: int | None = None,
                          precision: str | None = None, n_threads: int | None = None, backend: str = "auto") -> Array:
    """Drafter attention: block queries over [injected context | block] keys/values, without a copy.

    Positions: context row j sits at position j, block row i at T_ctx + i (query i too). Default
    (``full_attention`` drafter layers): every query sees every context and block key, no mask.
    ``causal_block=True``: query i sees block keys 0..i only (and all context). ``window=w``
    (``sliding_attention`` layers): query i (position p = T_ctx + i) sees only keys at positions
    j > p - w, i.e. the last w positions up to itself; without causal_block it also sees the block
    keys after it. Query head h reads kv head ``h // (H_q // H_kv)`` (GQA).

    Parameters
    ----------
    q : ndarray or torch.Tensor, shape (T_q, H_q, D)
        Block queries, float32 or bf16 (upcast once: it is small). D >= 1, H_q % H_kv == 0.
    k_ctx, v_ctx : ndarray or torch.Tensor, shape (T_ctx, H_kv, D)
        Context keys/values, float32 or bf16 (torch.bfloat16 or numpy uint16), read in place by the
        kernels; one shape and one dtype. T_ctx may be 0.
    k_blk, v_blk : ndarray or torch.Tensor, shape (T_q, H_kv, D)
        The block's own keys/values, float32 or bf16, one shape and one dtype. The two sources
        (context and block) may have different dtypes.
    scale : float, optional
        Scale of the scores ``q K^T``; None (default) = D**-0.5.
    causal_block : bool, default False
        Query i sees block keys 0..i only (and all context).
    window : int, optional
        Sliding window w >= 1 (see above); None (default) = no window.
    {attention_tail}

    Raises
    ------
    ValueError
        If the shapes disagree (q, the keys and values not 3-D, D < 1, a key/value pair of two shapes,
        other kv heads or head dim, H_q not a multiple of H_kv, k_blk without T_q rows), window is not
        None or an int >= 1, scale is not finite, or precision, n_threads or backend is invalid.
    TypeError
        If an operand is not a float32 / bf16 array or tensor, a key/value pair has two dtypes, or
        scale is not a number.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8), dtype=np.float32)
    >>> k_ctx, v_ctx = rng.standard_normal((2, 3, 2, 8), dtype=np.float32)
    >>> k_blk, v_blk = rng.standard_normal((2, 2, 2, 8), dtype=np.float32)
    >>> out = dk.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk)
    >>> out.shape, out.dtype
    ((2, 4, 8), dtype('float32'))

    Without context and with a causal block, query 0 sees only block key 0 (heads 0-1 read kv head
    0, heads 2-3 kv head 1):

    >>> empty = np.zeros((0, 2, 8), np.float32)
    >>> out = dk.injected_kv_attention(q, empty, empty, k_blk, v_blk, causal_block=True)
    >>> np.allclose(out[0], v_blk[0].repeat(2, axis=0))
    True
    """
    done = FAST.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, scale, causal_block, window, precision,
                                      n_threads, backend)
    if done is not None:
        return done
    qa = f32_array(q, "q", ndim=3)
    _check_q(qa)
    t_q, h_q, d = qa.shape
    kc, vc = _kv_pair(k_ctx, v_ctx, "k_ctx", "v_ctx", d=d)
    kb, vb = _kv_pair(k_blk, v_blk, "k_blk", "v_blk", h_kv=kc.shape[1], d=d)
    _check_heads(h_q, kc.shape[1], "k_ctx")
    if kb.shape[0] != t_q:
        raise ValueError(f"k_blk must have T_q = {t_q} rows (one per query), got shape {kb.shape}")
    sc, win, parts = _scale(scale, d), _window(window), precision_parts(precision)
    out = np.empty((t_q, h_q, d), np.float32)
    if t_q:
        run("attention", "injected_kv_attention", (qa, kc, vc, kb, vb), out, backend=backend,
            n_threads=n_threads, scale=sc, causal_block=bool(causal_block), window=win, parts=parts)
    return wrap(out, any_torch(q, k_ctx, v_ctx, k_blk, v_blk))


@shared_doc
def cached_attention(q: Array, k_cache: Array, v_cache: Array, *, causal: bool = True, scale: float | None = None,
                     window: int | None = None, precision: str | None = None, n_threads: int | None = None,
                     backend: str = "auto") -> Array:
    """Attention of the last T_q positions of a KV cache (decode T_q = 1, verification T_q = k+1, prefill).

    The cache already holds the queries' own keys: query i sits at position p = T_kv - T_q + i.
    ``causal=True`` (bottom-right aligned): it sees keys 0..p; ``causal=False``: all keys.
    ``window=w``: additionally only keys at positions j > p - w. Query head h reads kv head
    ``h // (H_q // H_kv)`` (GQA).

    Parameters
    ----------
    q : ndarray or torch.Tensor, shape (T_q, H_q, D)
        Queries, float32 or bf16 (upcast once: it is small). T_q <= T_kv, D >= 1, H_q % H_kv == 0.
    k_cache, v_cache : ndarray or torch.Tensor, shape (T_kv, H_kv, D)
        Keys/values of positions 0..T_kv-1, float32 or bf16 (torch.bfloat16 or numpy uint16), read in
        place by the kernels; one shape and one dtype.
    causal : bool, default True
        Query i sees keys 0..p only (bottom-right aligned); False: all keys.
    scale : float, optional
        Scale of the scores ``q K^T``; None (default) = D**-0.5.
    window : int, optional
        Sliding window w >= 1: only keys at positions j > p - w; None (default) = no window.
    {attention_tail}

    Raises
    ------
    ValueError
        If the shapes disagree (q, k_cache or v_cache not 3-D, D < 1, k_cache and v_cache of two
        shapes, another head dim, H_q not a multiple of H_kv, T_q > T_kv), window is not None or an
        int >= 1, scale is not finite, or precision, n_threads or backend is invalid.
    TypeError
        If an operand is not a float32 / bf16 array or tensor, k_cache and v_cache have two dtypes, or
        scale is not a number.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 4, 8), dtype=np.float32)
    >>> k, v = rng.standard_normal((2, 3, 2, 8), dtype=np.float32)
    >>> out = dk.cached_attention(q, k, v)  # prefill: T_q = T_kv = 3
    >>> out.shape, out.dtype
    ((3, 4, 8), dtype('float32'))

    Query 0 sits at position 0 and sees key 0 only; with ``window=1`` every query sees only its own
    key (heads 0-1 read kv head 0, heads 2-3 kv head 1):

    >>> np.allclose(out[0], v[0].repeat(2, axis=0))
    True
    >>> np.allclose(dk.cached_attention(q, k, v, window=1), v.repeat(2, axis=1))
    True
    """
    done = FAST.cached_attention(q, k_cache, v_cache, causal, scale, window, precision, n_threads, backend)
    if done is not None:
        return done
    qa = f32_array(q, "q", ndim=3)
    _check_q(qa)
    t_q, h_q, d = qa.shape
    kc, vc = _kv_pair(k_cache, v_cache, "k_cache", "v_cache", d=d)
    _check_heads(h_q, kc.shape[1], "k_cache")
    if t_q > kc.shape[0]:
        raise ValueError(f"q has T_q = {t_q} rows but k_cache only T_kv = {kc.shape[0]}; need T_q <= T_kv")
    sc, win, parts = _scale(scale, d), _window(window), precision_parts(precision)
    out = np.empty((t_q, h_q, d), np.float32)
    if t_q:
        run("attention", "cached_attention", (qa, kc, vc), out, backend=backend, n_threads=n_threads,
            causal=bool(causal), scale=sc, window=win, parts=parts)
    return wrap(out, any_torch(q, k_cache, v_cache))
