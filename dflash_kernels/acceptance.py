"""Speculative acceptance: greedy prefix matching and lossless rejection sampling (docs/dflash.md s. 4).

Both ops return ``(num_accepted, out_tokens)``: ``out_tokens[b]`` holds the accepted drafts, then the
target's token at the first mismatch / rejection (or the bonus token when every draft passed),
then -1 padding. ``num_accepted[b]`` lies in ``[0, num_draft[b]]`` and ``num_accepted + 1`` tokens
are emitted. Unbatched inputs (drafts (K,), targets (K+1,) / logits (K+1, V)) give a 0-d count and
(K+1,) tokens.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ._dispatch import run
from ._docs import shared_doc
from ._fastpath import FAST
from ._tensors import (
    Array,
    Generator,
    _tensor_view,
    any_torch,
    first_nonzero,
    float_array,
    in_unit_interval,
    index_array,
    int_bounds,
    is_int,
    is_real,
    is_torch,
    wrap,
)

# kernel status codes (see dflash_kernels/_numba/acceptance.py)
_STATUS = {1: "contains NaN or +inf", 2: "has no finite logit (all -inf)",
           3: "draft_probs has a NaN or negative entry"}


def draw_uniforms(generator, shape, name: str = "generator") -> np.ndarray:
    """float64 uniforms in [0, 1) from an int seed, numpy Generator, torch.Generator or None (fresh)."""
    if generator is None or isinstance(generator, (numbers.Integral, np.random.SeedSequence)):
        if isinstance(generator, bool):
            raise TypeError(f"{name} must be an int seed, numpy.random.Generator or torch.Generator")
        return np.random.default_rng(generator).random(shape)
    if isinstance(generator, np.random.Generator):
        return generator.random(shape)
    if isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, dtype=torch.float64).numpy()
    raise TypeError(f"{name} must be an int seed, numpy.random.Generator or torch.Generator, "
                    f"got {type(generator).__name__}")


def check_uniforms(uniforms, shape, name: str = "uniforms") -> np.ndarray:
    """Validate caller-supplied uniforms: exact shape, floating, all in [0, 1); float64 copy."""
    if is_torch(uniforms):
        uniforms = _tensor_view(uniforms.cpu(), name)
    u = np.asarray(uniforms)
    if u.dtype.kind != "f":
        raise TypeError(f"{name} must be a float array, got dtype {u.dtype}")
    if u.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {u.shape}")
    u = np.ascontiguousarray(u, dtype=np.float64)
    if not in_unit_interval(u):
        raise ValueError(f"{name} must lie in [0, 1)")
    return u


# Temperatures below this sample greedily (argmax, first index on ties), on every backend: 1 / T
# overflowed float32 below ~3e-39 and every backend failed differently (token 0, SystemError,
# IndexError); from 1e-6 down, softmax(logits / T) is one-hot for any logit gap above ~1e-4 anyway.
MIN_TEMPERATURE = 1e-6


def check_sampling(temperature, top_k, top_p) -> tuple[float, int, float]:
    """Validate the sampling arguments; temperature below MIN_TEMPERATURE comes back as 0 (greedy)."""
    if not is_real(temperature) or not temperature >= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite real number >= 0, got {temperature!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not is_real(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    t = float(temperature)
    return (0.0 if t < MIN_TEMPERATURE else t), int(top_k), float(top_p)


def _full(shape, value: int) -> np.ndarray:
    """np.full for int64 at half its cost per call (np.full is Python code around empty + copyto)."""
    arr = np.empty(shape, np.int64)
    arr.fill(value)
    return arr


def _num_draft(num_draft, b_sz: int, k: int) -> np.ndarray:
    if num_draft is None:
        return _full(b_sz, k)
    scalar = np.ndim(num_draft) == 0
    nd = index_array(num_draft, "num_draft")
    if scalar:
        nd = _full(b_sz, int(nd.reshape(-1)[0]))
    if nd.shape != (b_sz,):
        raise ValueError(f"num_draft must have shape ({b_sz},), got {nd.shape}")
    if nd.size and int_bounds(nd)[1] > k:
        raise ValueError(f"num_draft values must lie in [0, {k}] (K = drafts per row), got max {nd.max()}")
    return nd


def _check_used(tokens: np.ndarray, count: np.ndarray | None, name: str, high: int | None) -> None:
    """Token ids at positions < count[b] must lie in [0, high); later positions are padding.
    count None: every position is used (no num_draft: the common case, without the mask)."""
    if count is None:
        vals = tokens
    else:
        vals = tokens[np.arange(tokens.shape[1])[None, :] < count[:, None]]
    if not vals.size:
        return
    lo, hi = int_bounds(vals)
    if lo < 0 or (high is not None and hi >= high):
        bound = f"[0, {high})" if high is not None else ">= 0"
        raise ValueError(f"{name} values must lie in {bound}, got min {lo} max {hi}")


def _ids(x, name: str) -> np.ndarray:
    return index_array(x, name, low=None)  # range checked on the used part only


def _finish(num_accepted, out, unbatched: bool, torch_out: bool):
    if unbatched:
        num_accepted, out = num_accepted.reshape(()), out[0]
    return wrap(num_accepted, torch_out), wrap(out, torch_out)


@shared_doc
def accept_greedy(draft_tokens: Array, target_tokens: Array, num_draft: Array | None = None, *,
                  vocab_size: int | None = None, n_threads: int | None = None,
                  backend: str = "auto") -> tuple[Array, Array]:
    """Greedy verification: the longest prefix of drafts equal to the target's argmax choices.

    Parameters
    ----------
    draft_tokens : ndarray, torch.Tensor or sequence of int, shape (B, K) or (K,)
        Integer draft ids.
    target_tokens : ndarray, torch.Tensor or sequence of int, shape (B, K+1) or (K+1,)
        Integer ids: the target's choice at each verify row.
    num_draft : ndarray, torch.Tensor, int or sequence of int, shape (B,) or (), optional
        Drafts per sequence, in [0, K]; None (default) = K. Drafts beyond it are ignored and may be
        padding.
    vocab_size : int, optional
        Upper bound for the ids. Only the used ids are checked: drafts at positions < num_draft[b],
        targets at positions <= num_draft[b].
    {run_options}

    {acceptance_returns}
    out_tokens : ndarray or torch.Tensor, shape (B, K+1)
        int64: the accepted drafts, then target_tokens[b, a] (correction or bonus), then -1 padding;
        (K+1,) for unbatched inputs. num_accepted + 1 tokens are emitted. Torch tensors if
        draft_tokens or target_tokens is one.

    Raises
    ------
    ValueError
        If draft_tokens is not (B, K) or (K,), target_tokens not (B, K+1), num_draft not (B,) or
        a scalar or outside [0, K], a used id is negative or >= vocab_size, or n_threads / backend is
        invalid.
    TypeError
        If an id array does not hold integers.

    Examples
    --------
    >>> drafts = np.array([[3, 4, 5], [3, 4, 5]])
    >>> targets = np.array([[3, 4, 9, 1], [3, 4, 5, 6]])
    >>> num_accepted, out = dk.accept_greedy(drafts, targets)
    >>> num_accepted
    array([2, 3])
    >>> out
    array([[ 3,  4,  9, -1],
           [ 3,  4,  5,  6]])
    >>> dk.accept_greedy([3, 4, 5], [3, 4, 5, 6], num_draft=1)  # unbatched, one draft used
    (array(1), array([ 3,  4, -1, -1]))
    """
    done = FAST.accept_greedy(draft_tokens, target_tokens, num_draft, vocab_size, n_threads, backend)
    if done is not None:
        return done
    d = _ids(draft_tokens, "draft_tokens")
    tg = _ids(target_tokens, "target_tokens")
    unbatched = d.ndim == 1
    if unbatched:
        d, tg = d[None], tg.reshape(1, -1) if tg.ndim == 1 else tg
    if d.ndim != 2:
        raise ValueError(f"draft_tokens must have shape (B, K) or (K,), got {d.shape}")
    b_sz, k = d.shape
    if tg.shape != (b_sz, k + 1):
        raise ValueError(f"target_tokens must have shape ({b_sz}, {k + 1}) (K+1 verify rows), got {tg.shape}")
    nd = _num_draft(num_draft, b_sz, k)
    used = None if num_draft is None else nd  # None: every draft is used
    _check_used(d, used, "draft_tokens", vocab_size)
    _check_used(tg, None if used is None else used + 1, "target_tokens", vocab_size)
    num_accepted = np.empty(b_sz, np.int64)  # every backend writes all of both
    out = np.empty((b_sz, k + 1), np.int64)
    run("acceptance", "accept_greedy", (d, tg, nd), (num_accepted, out), backend=backend, n_threads=n_threads)
    return _finish(num_accepted, out, unbatched, any_torch(draft_tokens, target_tokens))


@shared_doc
def filtered_probs(logits: Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, *,
                   n_threads: int | None = None, backend: str = "auto") -> Array:
    """The sampling distribution of each row of ``logits``: softmax(logits / temperature) after top_k / top_p.

    The distribution is restricted by top_k and top_p and renormalised, by exactly the rule
    ``rejection_sample`` applies to target rows (ties at either threshold kept; temperature 0 =
    one-hot argmax, first index). What a drafter that samples its drafts passes as ``draft_probs``;
    ``sample_filtered`` also draws the drafts from it in the same pass.

    Parameters
    ----------
    logits : ndarray or torch.Tensor, shape (T, V)
        float32 or bf16, V >= 1.
    temperature : float, default 1.0
        Finite, >= 0; 0 (or below 1e-6) = one-hot argmax.
    top_k : int, default 0
        Keep the logits >= the top_k-th largest; 0 = off.
    top_p : float, default 1.0
        Nucleus mass in (0, 1]; 1.0 = off.
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T, V)
        float32 probabilities, in the caller's framework.

    Raises
    ------
    ValueError
        If temperature, top_k or top_p is out of range, logits is not 2-D or has an empty vocabulary
        axis, a row has NaN (or +inf when temperature > 0), a row has no finite entry, or n_threads /
        backend is invalid.
    TypeError
        If logits is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> logits = np.array([[1.0, 1.0, 0.0]], np.float32)
    >>> dk.filtered_probs(logits, top_k=2)
    array([[0.5, 0.5, 0. ]], dtype=float32)
    >>> dk.filtered_probs(logits, temperature=0.0)  # first index on ties
    array([[1., 0., 0.]], dtype=float32)
    """
    return _filter_rows(logits, temperature, top_k, top_p, None, None, n_threads, backend)[1]


@shared_doc
def sample_filtered(logits: Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, *,
                    uniforms: Array | None = None, generator: Generator = None, n_threads: int | None = None,
                    backend: str = "auto") -> tuple[Array, Array]:
    """One token drawn from each row's filtered distribution, and the distributions: a sampling drafter's step.

    probs[t] is ``filtered_probs(logits)[t]`` and tokens[t] is drawn from it by inverse CDF (the
    first index, in index order, whose running sum exceeds uniforms[t] times the row's mass: the rule
    ``rejection_sample`` draws its replacement and bonus tokens by). Passing the tokens as
    ``draft_tokens`` and probs as ``draft_probs`` to ``rejection_sample`` gives lossless speculative
    sampling; one compiled pass replaces filtered_probs plus a cumulative sum per row.

    Parameters
    ----------
    logits : ndarray or torch.Tensor, shape (T, V)
        float32 or bf16, V >= 1: a drafter's logits for T draft positions.
    temperature : float, default 1.0
        Finite, >= 0; 0 (or below 1e-6) = greedy: tokens are the argmax (first index), probs one-hot.
    top_k : int, default 0
        Keep the logits >= the top_k-th largest; 0 = off.
    top_p : float, default 1.0
        Nucleus mass in (0, 1]; 1.0 = off.
    uniforms : ndarray or torch.Tensor, shape (T,), optional
        Floats in [0, 1), one per row, used instead of drawing from generator.
    generator : int, numpy.random.Generator or torch.Generator, optional
        Without uniforms, they are drawn from it (None (default) = fresh entropy) as float64 (T,).
    {run_options}

    Returns
    -------
    tokens : ndarray or torch.Tensor, shape (T,)
        int64 token ids.
    probs : ndarray or torch.Tensor, shape (T, V)
        float32 distributions the tokens were drawn from. Torch tensors if logits is one.

    Raises
    ------
    ValueError
        If temperature, top_k or top_p is out of range, logits is not 2-D or has an empty vocabulary
        axis, a row has NaN (or +inf when temperature > 0) or no finite entry (the message names the
        row), uniforms has another shape or values outside [0, 1), or n_threads / backend is invalid.
    TypeError
        If logits is not a float32 / bf16 array or tensor, uniforms is not a float array, or
        generator is not one of the accepted kinds.

    Examples
    --------
    >>> logits = np.log(np.array([[0.25, 0.75], [0.5, 0.5]], np.float32))
    >>> tokens, probs = dk.sample_filtered(logits, uniforms=np.array([0.3, 0.3]))
    >>> tokens  # 0.3 lies past token 0's mass 0.25 in row 0, inside its 0.5 in row 1
    array([1, 0])
    >>> probs.round(2)
    array([[0.25, 0.75],
           [0.5 , 0.5 ]], dtype=float32)
    """
    return _filter_rows(logits, temperature, top_k, top_p, uniforms, generator, n_threads, backend, draw=True)


def _filter_rows(logits, temperature, top_k, top_p, uniforms, generator, n_threads, backend, draw=False):
    """(tokens, probs) of sample_filtered; without draw, tokens only at temperature 0 (filtered_probs)."""
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    x = float_array(logits, "logits", ndim=2)
    t_sz, v_sz = x.shape
    if v_sz == 0:
        raise ValueError("logits must have a non-empty vocabulary axis")
    u = None
    if draw and temperature > 0:
        u = draw_uniforms(generator, (t_sz,)) if uniforms is None else check_uniforms(uniforms, (t_sz,))
    tokens = np.empty(t_sz, np.int64)
    probs = np.empty((t_sz, v_sz), np.float32)
    status = np.zeros(t_sz, np.int64)
    run("acceptance", "sample_filtered", (x,), (tokens, probs, status), backend=backend, n_threads=n_threads,
        uniforms=u, temperature=temperature, top_k=top_k, top_p=top_p)
    bad = first_nonzero(status)
    if bad >= 0:
        raise ValueError(f"logits row {bad} {_STATUS[int(status[bad])]}")
    torch_out = any_torch(logits)
    return wrap(tokens, torch_out), wrap(probs, torch_out)


@shared_doc
def rejection_sample(draft_tokens: Array, target_logits: Array, *, draft_probs: Array | None = None,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, num_draft: Array | None = None,
                     uniforms: Array | None = None, generator: Generator = None, n_threads: int | None = None,
                     backend: str = "auto") -> tuple[Array, Array]:
    """Lossless speculative sampling of one verify round; the emitted tokens follow the target exactly.

    Row i of sequence b (i < num_draft[b]) accepts draft x with probability p_i(x) (one-hot q) or
    min(1, p_i(x) / q_i(x)) (test ``u * q(x) < p(x)``; q(x) = 0 accepts iff p(x) > 0). At the first
    rejection the replacement is drawn from normalize(max(0, p_i - q_i)) (p_i with x removed for
    one-hot q; p_i itself if that residual is all zero); if all drafts pass, the bonus token is drawn
    from row num_draft[b]. Rows after the first rejection are never read.

    p = softmax(logits / temperature) restricted by top_k (keep logits >= the k-th largest: ties at
    the threshold are all kept; 0 = off) and then top_p (keep probabilities >= p*, p* the smallest
    probability in the shortest descending prefix whose mass reaches top_p; ties at p* kept).
    temperature == 0 is greedy: p = one-hot(argmax, first index), i.e. accept_greedy on the argmaxes.
    -inf logits are tokens of probability 0; the kernels treat probabilities below e^-87 of the row
    maximum as 0.

    Parameters
    ----------
    draft_tokens : ndarray, torch.Tensor or sequence of int, shape (B, K) or (K,)
        Integer draft ids.
    target_logits : ndarray or torch.Tensor, shape (B, K+1, V) or (K+1, V)
        float32 or bf16; row i scores position i.
    draft_probs : ndarray or torch.Tensor, shape (B, K, V) or (K, V), optional
        float32 / bf16 draft distributions q (``filtered_probs``); None (default) = one-hot drafts,
        e.g. argmax drafters.
    temperature : float, default 1.0
        Finite, >= 0; 0 (or below 1e-6) = greedy.
    top_k : int, default 0
        See above; 0 = off.
    top_p : float, default 1.0
        In (0, 1], see above; 1.0 = off.
    num_draft : ndarray, torch.Tensor, int or sequence of int, shape (B,) or (), optional
        Drafts per sequence, in [0, K]; None (default) = K.
    uniforms : ndarray or torch.Tensor, shape (B, K+1, 2) (or (K+1, 2) unbatched), optional
        Floats in [0, 1): [b, i, 0] decides acceptance at row i, [b, i, 1] draws the replacement /
        bonus at row i by inverse CDF (first index, in index order, whose running sum exceeds
        u * total).
    generator : int, numpy.random.Generator or torch.Generator, optional
        Without uniforms, they are drawn from it (int seed, numpy Generator, torch.Generator; None
        (default) = fresh entropy) as a float64 (B, K+1, 2) array.
    {run_options}

    {acceptance_returns}
    out_tokens : ndarray or torch.Tensor, shape (B, K+1)
        int64: the accepted drafts, then the replacement or bonus token, then -1 padding; (K+1,) for
        unbatched inputs. Torch tensors if draft_tokens or target_logits is one.

    Raises
    ------
    ValueError
        If temperature, top_k or top_p is out of range; a shape disagrees (draft_tokens, target_logits,
        draft_probs, num_draft, uniforms) or V == 0; num_draft is outside [0, K]; a used draft id is
        outside [0, V); uniforms lie outside [0, 1); a processed row of target_logits has NaN (or +inf
        when temperature > 0) or no finite entry (the message names target_logits); draft_probs has a
        NaN or negative entry; or n_threads / backend is invalid.
    TypeError
        If draft_tokens or num_draft does not hold integers, target_logits or draft_probs is not a
        float32 / bf16 array or tensor, uniforms is not a float array, or generator is not one of the
        accepted kinds.

    Examples
    --------
    One token of probability 1 per row (the other logits are -inf): the target picks 1, 2, 3.

    >>> logits = np.full((1, 3, 4), -np.inf, np.float32)
    >>> logits[0, [0, 1, 2], [1, 2, 3]] = 0.0
    >>> num_accepted, out = dk.rejection_sample(np.array([[1, 0]]), logits, generator=0)
    >>> num_accepted, out  # draft 1 accepted, draft 0 rejected and replaced by 2
    (array([1]), array([[ 1,  2, -1]]))
    >>> dk.rejection_sample(np.array([[1, 2]]), logits, temperature=0.0)  # all pass: bonus token 3
    (array([2]), array([[1, 2, 3]]))
    """
    done = FAST.rejection_sample(draft_tokens, target_logits, draft_probs, temperature, top_k, top_p, num_draft,
                                 uniforms, generator, n_threads, backend)
    if done is not None:
        return done
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    d = _ids(draft_tokens, "draft_tokens")
    logits = float_array(target_logits, "target_logits")
    unbatched = d.ndim == 1
    if unbatched:
        d = d[None]
        if logits.ndim == 2:
            logits = logits[None]
    if d.ndim != 2:
        raise ValueError(f"draft_tokens must have shape (B, K) or (K,), got {d.shape}")
    b_sz, k = d.shape
    if logits.ndim != 3 or logits.shape[:2] != (b_sz, k + 1):
        raise ValueError(f"target_logits must have shape ({b_sz}, {k + 1}, V) (K+1 verify rows), "
                         f"got {tuple(np.shape(target_logits))}")
    v_sz = logits.shape[2]
    if v_sz == 0:
        raise ValueError("target_logits must have a non-empty vocabulary axis")
    q = None
    if draft_probs is not None:
        q = float_array(draft_probs, "draft_probs")
        if unbatched and q.ndim == 2:
            q = q[None]
        if q.shape != (b_sz, k, v_sz):
            raise ValueError(f"draft_probs must have shape ({b_sz}, {k}, {v_sz}), "
                             f"got {tuple(np.shape(draft_probs))}")
    nd = _num_draft(num_draft, b_sz, k)
    _check_used(d, None if num_draft is None else nd, "draft_tokens", v_sz)
    if uniforms is None:
        u = draw_uniforms(generator, (b_sz, k + 1, 2))
    else:
        u = check_uniforms(uniforms, (1, k + 1, 2) if unbatched and np.ndim(uniforms) == 3 else
                           ((k + 1, 2) if unbatched else (b_sz, k + 1, 2)))
        if unbatched:
            u = u.reshape(b_sz, k + 1, 2)
    num_accepted = np.empty(b_sz, np.int64)  # every backend writes all of both (when it returns OK)
    out = np.empty((b_sz, k + 1), np.int64)
    status = np.zeros(b_sz, np.int64)  # written only where a sequence fails (the Numba kernel)
    run("acceptance", "rejection_sample", (d, logits, q, nd), (num_accepted, out, status), backend=backend,
        n_threads=n_threads, uniforms=u, temperature=temperature, top_k=top_k, top_p=top_p)
    b = first_nonzero(status)
    if b >= 0:
        what = _STATUS[int(status[b])]
        raise ValueError(f"target_logits[{b}] {what}" if status[b] != 3 else f"{what} (sequence {b})")
    return _finish(num_accepted, out, unbatched, any_torch(draft_tokens, target_logits))
