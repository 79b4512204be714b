"""The drafter's token choice for a block, and the block it denoises (docs/dflash.md sections 2-3)."""

from __future__ import annotations

import numpy as np
import torch

from ._backends import resolve
from ._dispatch import run
from ._docs import shared_doc
from ._fastpath import FAST
from ._precision import parts as precision_parts
from ._tensors import Array, Generator, any_torch, f32_array, first_nonzero, float_array, index_array, is_int, wrap
from ._threads import resolve_threads
from .acceptance import check_sampling, check_uniforms, draw_uniforms
from .reference.dense import round_activations


@shared_doc
def denoise_block(hidden: Array, lm_head: Array, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  generator: Generator = None, uniforms: Array | None = None, precision: str | None = None,
                  n_threads: int | None = None, backend: str = "auto") -> Array:
    """One token per row of ``hidden @ lm_head^T``, without materialising the logits when greedy.

    temperature == 0: argmax per row, first index on ties; one streaming pass over lm_head.
    temperature > 0: a draw from softmax(logits / temperature) after top_k / top_p filtering (same
    rules as ``rejection_sample``), by inverse CDF at one uniform per row; the logits are materialised
    (T, V) float32 on this path. Temperatures below 1e-6 are greedy.

    Parameters
    ----------
    hidden : ndarray or torch.Tensor, shape (T, H)
        float32 (bf16 is upcast): the drafter block's final-normed rows (or the target's verify rows).
        Must be finite.
    lm_head : ndarray or torch.Tensor, shape (V, H)
        float32 or bf16, read in place (memory-mapped weights are fine). V >= 1.
    temperature : float, default 0.0
        Finite, >= 0; 0 = greedy.
    top_k : int, default 0
        Keep the top_k largest logits (ties at the threshold kept), as ``rejection_sample``; 0 = off.
    top_p : float, default 1.0
        Nucleus mass in (0, 1], as ``rejection_sample``; 1.0 = off.
    generator : int, numpy.random.Generator or torch.Generator, optional
        Source of the uniforms when temperature > 0 and uniforms is not given: an int seed, a numpy
        Generator or a torch.Generator; None (default) = fresh entropy.
    uniforms : ndarray or torch.Tensor, shape (T,), optional
        Floats in [0, 1), one per row, used instead of drawing from generator (temperature > 0 only).
    precision : {"highest", "high", "medium"}, optional
        Of the logits' products, as in ``linear`` (hidden rounded to bf16 parts); None = the process
        default (``set_matmul_precision``).
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T,)
        int64 token ids; a torch tensor if hidden or lm_head is one.

    Raises
    ------
    ValueError
        If temperature, top_k or top_p is out of range, hidden is not 2-D or contains NaN or inf, lm_head
        is not of shape (V, H) with V >= 1, uniforms has another shape or values outside [0, 1),
        precision, n_threads or backend is invalid, or a logit is NaN (NaN / inf in lm_head: it is
        checked only through the logits it produces).
    TypeError
        If hidden or lm_head is not a float32 / bf16 array or tensor, uniforms is not a float array, or
        generator is not one of the accepted kinds.

    Examples
    --------
    >>> hidden = np.array([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], np.float32)
    >>> lm_head = np.eye(5, 4, dtype=np.float32)  # V = 5; token 4 scores 0
    >>> dk.denoise_block(hidden, lm_head)
    array([2, 0])
    >>> dk.denoise_block(hidden, lm_head, temperature=1.0, top_k=1, generator=0)  # top_k=1: the argmax
    array([2, 0])
    """
    done = FAST.denoise_block(hidden, lm_head, temperature, top_k, top_p, generator, uniforms, precision, n_threads,
                              backend)
    if done is not None:
        return done
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    parts = precision_parts(precision)
    x = f32_array(hidden, "hidden", ndim=2)
    if parts < 3:
        x = round_activations(torch.from_numpy(np.ascontiguousarray(x)), parts).numpy()
    w = float_array(lm_head, "lm_head", ndim=2)
    t_sz, h_sz = x.shape
    if w.shape[1] != h_sz:
        raise ValueError(f"lm_head must have shape (V, {h_sz}) to match hidden (T, H), got {w.shape}")
    if w.shape[0] == 0:
        raise ValueError("lm_head must have at least one vocabulary row")
    if not np.isfinite(x).all():
        raise ValueError("hidden contains NaN or inf")
    u = None
    if temperature > 0:
        u = draw_uniforms(generator, (t_sz,)) if uniforms is None else check_uniforms(uniforms, (t_sz,))
    tokens = np.zeros(t_sz, np.int64)
    status = np.zeros(t_sz, np.int64)
    if t_sz:
        run("denoise", "denoise_block", (x, w), (tokens, status), backend=backend, n_threads=n_threads,
            temperature=temperature, top_k=top_k, top_p=top_p, uniforms=u)
    bad = first_nonzero(status)
    if bad >= 0:
        raise ValueError(f"logits row {bad} is not finite (lm_head contains NaN or inf)")
    return wrap(tokens, any_torch(hidden, lm_head))


@shared_doc
def make_draft_block(anchor_ids: Array, mask_token_id: int, block_size: int, *, vocab_size: int | None = None,
                     n_threads: int | None = None, backend: str = "auto") -> Array:
    """The block a drafter denoises: [anchor, MASK x (block_size - 1)] per sequence.

    A plain fill: n_threads and backend are validated for API uniformity only.

    Parameters
    ----------
    anchor_ids : ndarray, torch.Tensor, int or sequence of int, shape (B,) or ()
        The last committed token per sequence, or a scalar for one sequence.
    mask_token_id : int
        The drafter config's mask token, >= 0.
    block_size : int
        Tokens per block, in [1, 65536] (drafters use 8-32).
    vocab_size : int, optional
        When given, every id (anchors and mask_token_id) must lie below it.
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (B, block_size), or (block_size,) for a scalar anchor
        int64; a torch tensor if anchor_ids is one.

    Raises
    ------
    ValueError
        If block_size is not an int in [1, 65536], mask_token_id is not an int >= 0 (or not below
        vocab_size), anchor_ids has more than one dimension or holds an id < 0 or >= vocab_size, or
        n_threads / backend is invalid.
    TypeError
        If anchor_ids does not hold integers.

    Examples
    --------
    >>> dk.make_draft_block(np.array([5, 7]), 99, 4)
    array([[ 5, 99, 99, 99],
           [ 7, 99, 99, 99]])
    >>> dk.make_draft_block(5, 99, 3)
    array([ 5, 99, 99])
    """
    resolve_threads(n_threads)
    resolve(backend, "denoise")
    if not is_int(block_size) or not 1 <= block_size <= 2**16:
        raise ValueError(f"block_size must be an int in [1, 65536] (drafters use 8-32), got {block_size!r}")
    if not is_int(mask_token_id) or mask_token_id < 0:
        raise ValueError(f"mask_token_id must be an int >= 0, got {mask_token_id!r}")
    if vocab_size is not None and mask_token_id >= vocab_size:
        raise ValueError(f"mask_token_id must be < vocab_size {vocab_size}, got {mask_token_id}")
    scalar = np.ndim(anchor_ids) == 0
    anchors = index_array(anchor_ids, "anchor_ids", high=vocab_size)
    if anchors.ndim > 1:
        raise ValueError(f"anchor_ids must be a scalar or have shape (B,), got {anchors.shape}")
    block = np.full((anchors.size, int(block_size)), int(mask_token_id), np.int64)
    block[:, 0] = anchors.reshape(-1)
    if scalar:
        block = block[0]
    return wrap(block, any_torch(anchor_ids))
