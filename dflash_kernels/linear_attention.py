"""Qwen3.5 Gated DeltaNet ("linear_attention" layers) and the small gating ops of its full-attention layers.

Facts: docs/models.md 2.5-2.7. A Qwen3.5 linear-attention layer runs, per block of T tokens:

    mixed = in_proj_qkv(x)                                  # (T, 2*H_k*d_k + H_v*d_v), channels [q | k | v]
    y = causal_conv1d(mixed, conv1d.weight, conv_state)     # SiLU included; conv_state updated in place
    q, k, v = split(y)                                      # (T, H_k, d_k), (T, H_k, d_k), (T, H_v, d_v)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)      # (T, H_v) each
    o = gated_delta_rule(q, k, v, g, beta, state)           # raw q, k: l2norm and d_k^-0.5 done inside
    o = gated_rms_norm(o, z, norm.weight)                   # then out_proj

Speculative decoding: a GDN layer's state cannot be cropped like a KV cache. Two ways to get the
state after the accepted prefix 0..a of a verified block of k+1 tokens:
  1. verify with ``checkpoints=True`` (the state after every token) and ``state[...] = ckpts[a]``;
  2. snapshot the state before verifying (one copy) and, after acceptance, restore the snapshot and
     re-run tokens 0..a as one block: bit-identical to checkpoint a in every backend (the recurrence
     does the same arithmetic for every block length; pass chunk_size=0 beyond 64 tokens so the torch
     backend does not switch to the chunked form), and cheaper on CPU, where writing k+1 states (2 MiB each per
     Qwen3.5-9B layer) costs several verification steps of memory bandwidth.
The conv state after n tokens is ``conv_state_at(conv_state_before, x, n)`` (or ``checkpoints=True``
on ``causal_conv1d``).
"""

from __future__ import annotations

import numpy as np

from ._dispatch import run
from ._docs import shared_doc
from ._fastpath import FAST
from ._tensors import Array, _numpy_view, any_torch, dtype_name, f32_array, float_array, wrap


def _state_array(x, name: str, shape: tuple) -> np.ndarray:
    """A recurrent/conv state: float32, C-contiguous and writable, updated in place (never copied)."""
    if dtype_name(x) != "float32":
        raise TypeError(f"{name} must be a float32 array or tensor (it is updated in place), got {dtype_name(x)}")
    arr = _numpy_view(x, name)
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (it is updated in place)")
    if not arr.flags.writeable:
        raise ValueError(f"{name} must be writable (it is updated in place)")
    return arr


def _checkpoint_slots(checkpoints, T: int) -> tuple[np.ndarray, int]:
    """(T,) int64: token t's state goes to checkpoint slot[t]; -1 = not kept. And the slots kept."""
    if checkpoints is True:
        return np.arange(T, dtype=np.int64), T
    slot = np.empty(T, np.int64)  # not np.full (Python code around empty + copyto)
    slot.fill(-1)
    if checkpoints is False or checkpoints is None:
        return slot, 0
    try:
        idx = [int(i) for i in checkpoints]
    except TypeError:
        raise TypeError(f"checkpoints must be a bool or a sequence of token indices, got {checkpoints!r}") from None
    if any(i < 0 or i >= T for i in idx):
        raise ValueError(f"checkpoints indices must lie in [0, {T}), got {idx}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"checkpoints indices must be distinct, got {idx}")
    slot[idx] = np.arange(len(idx))
    return slot, len(idx)


@shared_doc
def gated_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *, checkpoints: bool = False,
                     use_qk_l2norm: bool = True, scale: float | None = None, chunk_size: int | None = None,
                     checkpoints_out: Array | None = None, n_threads: int | None = None,
                     backend: str = "auto") -> tuple[Array, Array | None]:
    """Gated delta rule over a block of T tokens, continuing from (and updating) `state` in place.

    Per token and value head: S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q. Value head h
    reads key head h // (H_v // H_k). NaN/inf propagate unchecked.

    Parameters
    ----------
    q, k : ndarray or torch.Tensor, shape (T, H_k, d_k)
        Raw projections (after conv + SiLU), float32 or bf16; with ``use_qk_l2norm`` both are
        l2-normalised here, exactly as Qwen3.5 does in fp32.
    v : ndarray or torch.Tensor, shape (T, H_v, d_v)
        float32 or bf16; H_v % H_k == 0.
    g : ndarray or torch.Tensor, shape (T, H_v)
        Log-decay (<= 0, i.e. -exp(A_log) * softplus(a + dt_bias)), float32 or bf16.
    beta : ndarray or torch.Tensor, shape (T, H_v)
        sigmoid(b), float32 or bf16.
    state : ndarray or torch.Tensor, shape (H_v, d_k, d_v)
        float32, C-contiguous, writable; on return it holds the state after token T-1.
    checkpoints : bool or sequence of int, default False
        False; True (the state after every token); or a sequence of distinct token indices in [0, T).
    use_qk_l2norm : bool, default True
        l2-normalise q and k (x * rsqrt(sum x^2 + 1e-6)).
    scale : float, optional
        q is multiplied by it; None (default) = d_k**-0.5.
    chunk_size : int, optional
        0 = the token-by-token recurrence; n > 0 = the chunked (WY) form in chunks of n (not combinable
        with checkpoints); None (default) = the faster form per backend: torch runs chunks of 64 for
        T > 64, the compiled kernels always run the recurrence (one pass per token over L1-resident
        (d_k, 16) state blocks measured 1.6-3x faster than their chunked form at T = 512, see
        bench/bench_linear_attention.py). Both forms agree to float32 rounding.
    checkpoints_out : ndarray or torch.Tensor, shape (n_kept, H_v, d_k, d_v), optional
        Preallocated float32 C-contiguous writable buffer for the checkpoints (reuse it across rounds:
        a fresh n_kept x 2 MiB allocation per call costs page faults on top of the memory-bound
        copies).
    {run_options}

    Returns
    -------
    o : ndarray or torch.Tensor, shape (T, H_v, d_v)
        float32. Without checkpoints (False or None) o alone is returned.
    ckpts : ndarray or torch.Tensor, shape (n_kept, H_v, d_k, d_v)
        Only with checkpoints: float32 states (``state[...] = ckpts[a]`` restores the state after
        token a; checkpoints_out itself when given). Torch tensors if q, k, v or state is one.

    Raises
    ------
    ValueError
        If the shapes disagree (q, k, v not 3-D or g, beta not (T, H_v), k not of q's shape, v without
        T rows, H_v not a multiple of H_k, a zero head dim or head count, state or checkpoints_out of
        another shape or not C-contiguous and writable), checkpoints indices are out of range or
        repeated, chunk_size is not None or an int >= 0 or is > 0 with checkpoints, checkpoints_out is
        given without checkpoints, or n_threads / backend is invalid.
    TypeError
        If q, k, v, g or beta is not a float32 / bf16 array or tensor, state or checkpoints_out is not
        float32, or checkpoints is neither a bool nor a sequence of indices.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 3, 1, 4), dtype=np.float32)  # T = 3, H_k = 1, d_k = 4
    >>> v = rng.standard_normal((3, 2, 4), dtype=np.float32)  # H_v = 2, d_v = 4
    >>> g, beta = np.full((3, 2), -0.1, np.float32), np.full((3, 2), 0.5, np.float32)
    >>> state = np.zeros((2, 4, 4), np.float32)
    >>> o, ckpts = dk.gated_delta_rule(q, k, v, g, beta, state, checkpoints=True)
    >>> o.shape, ckpts.shape
    ((3, 2, 4), (3, 2, 4, 4))
    >>> np.allclose(ckpts[-1], state)  # state was updated in place
    True

    Two blocks continue one another, and checkpoint a is the state after token a:

    >>> state2 = np.zeros((2, 4, 4), np.float32)
    >>> o1 = dk.gated_delta_rule(q[:2], k[:2], v[:2], g[:2], beta[:2], state2)
    >>> np.allclose(state2, ckpts[1], atol=1e-6)
    True
    >>> o2 = dk.gated_delta_rule(q[2:], k[2:], v[2:], g[2:], beta[2:], state2)
    >>> np.allclose(np.concatenate([o1, o2]), o, atol=1e-6), np.allclose(state2, state, atol=1e-6)
    (True, True)
    """
    done = FAST.gated_delta_rule(q, k, v, g, beta, state, checkpoints, use_qk_l2norm, scale, chunk_size,
                                 checkpoints_out, n_threads, backend)
    if done is not None:
        return done
    qa = f32_array(q, "q", ndim=3)
    ka = f32_array(k, "k", ndim=3)
    va = f32_array(v, "v", ndim=3)
    ga = f32_array(g, "g", ndim=2)
    ba = f32_array(beta, "beta", ndim=2)
    T, Hk, dk = qa.shape
    _, Hv, dv = va.shape
    if ka.shape != qa.shape:
        raise ValueError(f"k must have the shape of q {qa.shape}, got {ka.shape}")
    if va.shape[0] != T:
        raise ValueError(f"v must have T={T} rows like q, got shape {va.shape}")
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"value heads of v ({Hv}) must be a multiple of the key heads of q ({Hk})")
    if min(dk, dv, Hv) == 0:
        raise ValueError(f"head dims and heads must be positive, got q {qa.shape}, v {va.shape}")
    for name, arr in (("g", ga), ("beta", ba)):
        if arr.shape != (T, Hv):
            raise ValueError(f"{name} must have shape (T, H_v) = {(T, Hv)}, got {arr.shape}")
    st = _state_array(state, "state", (Hv, dk, dv))
    slot, n_keep = _checkpoint_slots(checkpoints, T)
    if chunk_size is None:
        chunk_size = -1  # the backend's choice (see the docstring)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
        raise ValueError(f"chunk_size must be None or an int >= 0, got {chunk_size!r}")
    elif chunk_size > 0 and checkpoints is not False and checkpoints is not None:
        raise ValueError("chunk_size > 0 (chunked form) cannot produce per-token checkpoints; use chunk_size=0")
    scale = dk**-0.5 if scale is None else float(scale)
    o = np.empty((T, Hv, dv), np.float32)
    if checkpoints_out is None:
        ckpts = np.empty((n_keep, Hv, dk, dv), np.float32)
    elif n_keep == 0:
        raise ValueError("checkpoints_out needs checkpoints=True or a list of token indices")
    else:
        ckpts = _state_array(checkpoints_out, "checkpoints_out", (n_keep, Hv, dk, dv))
    run("linear_attention", "gated_delta_rule", (qa, ka, va, ga, ba, st, slot), (o, st, ckpts),
        backend=backend, n_threads=n_threads, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
        chunk_size=int(chunk_size))
    torch_out = any_torch(q, k, v, state)
    if checkpoints is False or checkpoints is None:
        return wrap(o, torch_out)
    return wrap(o, torch_out), (checkpoints_out if checkpoints_out is not None else wrap(ckpts, torch_out))


def _conv_weight(weight) -> np.ndarray:
    w = f32_array(weight, "weight")
    if w.ndim == 3 and w.shape[1] == 1:  # nn.Conv1d depthwise layout (C, 1, K)
        w = w.reshape(w.shape[0], w.shape[2])
    if w.ndim != 2 or w.shape[1] == 0:
        raise ValueError(f"weight must have shape (C, K) or (C, 1, K) with K >= 1, got {tuple(w.shape)}")
    return w


@shared_doc
def causal_conv1d(x: Array, weight: Array, conv_state: Array, *, activation: str | None = "silu",
                  checkpoints: bool = False, n_threads: int | None = None,
                  backend: str = "auto") -> Array | tuple[Array, Array]:
    """Depthwise causal conv over time (Qwen3.5 GDN short conv), continuing from `conv_state`.

    y[t, c] = act(sum_j weight[c, j] * xpad[t + j, c]) with xpad = [conv_state^T ; x], act = SiLU or
    None (activation=None).

    Parameters
    ----------
    x : ndarray or torch.Tensor, shape (T, C)
        float32 or bf16, channels in the checkpoint's order ([q | k | v] for Qwen3.5).
    weight : ndarray or torch.Tensor, shape (C, K) or (C, 1, K)
        (C, 1, K) is nn.Conv1d's depthwise layout; oldest tap first, float32 or bf16, K >= 1.
    conv_state : ndarray or torch.Tensor, shape (C, K-1)
        float32, writable, C-contiguous: the last K-1 inputs before x, oldest first (zeros at the start
        of a sequence); updated in place to the last K-1 inputs including x.
    activation : {"silu", None}, default "silu"
        SiLU, or None for no activation.
    checkpoints : bool, default False
        Also return the conv states after every token (the compact alternative: ``conv_state_at``).
    {run_options}

    Returns
    -------
    y : ndarray or torch.Tensor, shape (T, C)
        float32; alone without checkpoints.
    ckpts : ndarray or torch.Tensor, shape (T, C, K-1)
        Only with checkpoints=True: float32 conv states after every token. Torch tensors if x or
        conv_state is one.

    Raises
    ------
    ValueError
        If x is not 2-D, weight is not (C, K) or (C, 1, K) with K >= 1 and x's C, activation is not
        "silu" or None, conv_state is not (C, K-1), C-contiguous and writable, or n_threads / backend
        is invalid.
    TypeError
        If x or weight is not a float32 / bf16 array or tensor, conv_state is not float32, or
        checkpoints is not a bool.

    Examples
    --------
    >>> x = np.arange(6, dtype=np.float32).reshape(3, 2)  # T = 3, C = 2
    >>> weight = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], np.float32)  # K = 3: the newest / oldest tap
    >>> conv_state = np.zeros((2, 2), np.float32)
    >>> dk.causal_conv1d(x, weight, conv_state, activation=None)
    array([[0., 0.],
           [2., 0.],
           [4., 1.]], dtype=float32)
    >>> conv_state  # the last K-1 = 2 inputs, oldest first
    array([[2., 4.],
           [3., 5.]], dtype=float32)
    """
    xa = f32_array(x, "x", ndim=2)
    w = _conv_weight(weight)
    T, C = xa.shape
    if w.shape[0] != C:
        raise ValueError(f"weight must have C={C} channels like x, got {w.shape[0]}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    K = w.shape[1]
    st = _state_array(conv_state, "conv_state", (C, K - 1))
    if not isinstance(checkpoints, bool):
        raise TypeError(f"checkpoints must be a bool, got {checkpoints!r}")
    y = np.empty((T, C), np.float32)
    ckpts = np.empty((T if checkpoints else 0, C, K - 1), np.float32)
    run("linear_attention", "causal_conv1d", (xa, w, st), (y, st, ckpts), backend=backend,
        n_threads=n_threads, activation=activation, checkpoints=checkpoints)
    torch_out = any_torch(x, conv_state)
    return (wrap(y, torch_out), wrap(ckpts, torch_out)) if checkpoints else wrap(y, torch_out)


def conv_state_at(conv_state_before: Array, x: Array, n: int) -> Array:
    """The conv state after the first n tokens of x: rows n .. n+K-2 of [conv_state_before^T ; x].

    Use it to restore the conv state of the accepted prefix after verification without keeping
    per-token states.

    Parameters
    ----------
    conv_state_before : ndarray or torch.Tensor, shape (C, K-1)
        The state before x was fed, float32 or bf16.
    x : ndarray or torch.Tensor, shape (T, C)
        The inputs fed, float32 or bf16.
    n : int
        Tokens of x taken, 0 <= n <= T.

    Returns
    -------
    ndarray or torch.Tensor, shape (C, K-1)
        A new float32 array (torch tensor if either input is one).

    Raises
    ------
    ValueError
        If an input is not 2-D, x does not have C channels, or n is not an int in [0, T].
    TypeError
        If an input is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> before = np.zeros((2, 2), np.float32)  # C = 2, K = 3
    >>> x = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> dk.conv_state_at(before, x, 1)  # a row of the old state, then x[0]
    array([[0., 0.],
           [0., 1.]], dtype=float32)
    >>> dk.conv_state_at(before, x, 3)  # what causal_conv1d leaves in conv_state
    array([[2., 4.],
           [3., 5.]], dtype=float32)
    """
    sa = f32_array(conv_state_before, "conv_state_before", ndim=2)
    xa = f32_array(x, "x", ndim=2)
    if xa.shape[1] != sa.shape[0]:
        raise ValueError(f"x must have C={sa.shape[0]} channels like conv_state_before, got {xa.shape[1]}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= xa.shape[0]:
        raise ValueError(f"n must be an int in [0, {xa.shape[0]}], got {n!r}")
    return wrap(conv_state_rows(sa, xa, n), any_torch(conv_state_before, x))


def conv_state_rows(conv_state_before: np.ndarray, x: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """conv_state_at on checked float32 arrays, into out (C, K-1) when given: rows n .. n+K-2 of
    [conv_state_before^T ; x], only those copied. For callers that hold valid arrays (the Qwen3.5
    rollback, once per Gated DeltaNet layer)."""
    km1 = conv_state_before.shape[1]
    if out is None:
        out = np.empty(conv_state_before.shape, np.float32)
    old = max(0, km1 - n)  # rows from the old state
    out[:, :old] = conv_state_before[:, km1 - old :]
    out[:, old:] = x[n - (km1 - old) : n].T
    return out


@shared_doc
def gated_rms_norm(x: Array, z: Array, weight: Array, eps: float = 1e-6, *, n_threads: int | None = None,
                   backend: str = "auto") -> Array:
    """Qwen3.5 RMSNormGated (linear_attn.norm): weight * x * rsqrt(mean(x^2) + eps) * silu(z), fp32.

    Parameters
    ----------
    x, z : ndarray or torch.Tensor, shape (..., D)
        float32 or bf16, the same shape; D = d_v >= 1, one norm per head.
    weight : ndarray or torch.Tensor, shape (D,)
        Ones-centred (NOT the zero-centred 1 + w of the other Qwen3.5 norms), float32 or bf16.
    eps : float, default 1e-6
        Finite, >= 0.
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor
        float32 of x's shape; a torch tensor if x or z is one.

    Raises
    ------
    ValueError
        If x is 0-d or has an empty last axis, z is not of x's shape, weight is not (D,), eps is
        negative or not finite, or n_threads / backend is invalid.
    TypeError
        If x, z or weight is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> x = np.array([[3.0, 4.0]], np.float32)  # mean(x^2) = 12.5
    >>> z = np.array([[0.0, 2.0]], np.float32)
    >>> out = dk.gated_rms_norm(x, z, np.ones(2, np.float32), eps=0.0)
    >>> np.allclose(out, x / np.sqrt(12.5) * z / (1.0 + np.exp(-z)))
    True
    """
    xa = f32_array(x, "x")
    za = f32_array(z, "z")
    wa = f32_array(weight, "weight", ndim=1)
    if xa.ndim == 0 or xa.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis, got shape {xa.shape}")
    if za.shape != xa.shape:
        raise ValueError(f"z must have the shape of x {xa.shape}, got {za.shape}")
    if wa.shape != (xa.shape[-1],):
        raise ValueError(f"weight must have shape ({xa.shape[-1]},), got {wa.shape}")
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    x2, z2 = xa.reshape(-1, xa.shape[-1]), za.reshape(-1, xa.shape[-1])
    out = np.empty(x2.shape, np.float32)
    run("linear_attention", "gated_rms_norm", (x2, z2, wa), out, backend=backend, n_threads=n_threads, eps=float(eps))
    return wrap(out.reshape(xa.shape), any_torch(x, z))


def split_query_gate(qg: Array, n_heads: int, head_dim: int) -> tuple[Array, Array]:
    """Split a Qwen3.5 gated-attention q_proj output, laid out per head as [query_h | gate_h].

    Data movement only.

    Parameters
    ----------
    qg : ndarray or torch.Tensor, shape (T, n_heads * 2 * head_dim)
        float32 or bf16.
    n_heads : int
        Attention heads, positive.
    head_dim : int
        Head dim, positive.

    Returns
    -------
    query : ndarray or torch.Tensor, shape (T, n_heads, head_dim)
        The queries: a C-contiguous copy in qg's dtype (and framework).
    gate : ndarray or torch.Tensor, shape (T, n_heads * head_dim)
        The gates: a C-contiguous copy in qg's dtype (and framework).

    Raises
    ------
    ValueError
        If qg is not 2-D, n_heads or head_dim is not a positive int, or qg does not have
        n_heads * 2 * head_dim columns.
    TypeError
        If qg is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> qg = np.arange(8, dtype=np.float32).reshape(1, 8)  # T = 1, 2 heads of [query (2) | gate (2)]
    >>> query, gate = dk.split_query_gate(qg, 2, 2)
    >>> query
    array([[[0., 1.],
            [4., 5.]]], dtype=float32)
    >>> gate
    array([[2., 3., 6., 7.]], dtype=float32)
    """
    arr = float_array(qg, "qg", ndim=2)
    for name, val in (("n_heads", n_heads), ("head_dim", head_dim)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if arr.shape[1] != n_heads * 2 * head_dim:
        raise ValueError(f"qg must have n_heads * 2 * head_dim = {n_heads * 2 * head_dim} columns, got {arr.shape[1]}")
    per_head = arr.reshape(arr.shape[0], n_heads, 2 * head_dim)  # (T, H, 2D)
    query = np.ascontiguousarray(per_head[..., :head_dim])
    gate = np.ascontiguousarray(per_head[..., head_dim:]).reshape(arr.shape[0], n_heads * head_dim)
    return wrap(query, any_torch(qg)), wrap(gate, any_torch(qg))


@shared_doc
def apply_output_gate(o: Array, gate: Array, *, n_threads: int | None = None, backend: str = "auto") -> Array:
    """Gated attention output o * sigmoid(gate), before o_proj.

    Parameters
    ----------
    o : ndarray or torch.Tensor, shape (T, H, D) or (T, H*D)
        Attention output, float32 or bf16.
    gate : ndarray or torch.Tensor, shape (T, H*D)
        float32 or bf16 (``split_query_gate``'s gate).
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T, H*D)
        float32; a torch tensor if o or gate is one.

    Raises
    ------
    ValueError
        If gate is not 2-D, o is not (T, H, D) or (T, H*D) matching gate, or n_threads / backend is
        invalid.
    TypeError
        If o or gate is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> o = np.ones((2, 2, 3), np.float32)  # T = 2, H = 2, D = 3
    >>> out = dk.apply_output_gate(o, np.zeros((2, 6), np.float32))  # sigmoid(0) = 0.5
    >>> out.shape, np.allclose(out, 0.5)
    ((2, 6), True)
    """
    oa = f32_array(o, "o")
    ga = f32_array(gate, "gate", ndim=2)
    if oa.ndim not in (2, 3) or oa.shape[0] != ga.shape[0] or int(np.prod(oa.shape[1:])) != ga.shape[1]:
        raise ValueError(f"o must have shape (T, H, D) or (T, H*D) matching gate {ga.shape}, got {oa.shape}")
    o2 = oa.reshape(ga.shape)
    out = np.empty(ga.shape, np.float32)
    run("linear_attention", "apply_output_gate", (o2, ga), out, backend=backend, n_threads=n_threads)
    return wrap(out, any_torch(o, gate))
