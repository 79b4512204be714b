"""Fused decoder layers: a whole Qwen3 (or Llama) target layer, or a DFlash drafter layer, in one
kernel call.

A decoder layer is ~14 kernel calls (norms, the stacked QKV projection, q/k norms, RoPE, the cache
append, attention, the output projection, the residual adds and the SwiGLU MLP). For a small model,
or a decode step of any model, the work between those calls (Python wrappers, argument checks,
output allocation) is a large share of the step: ~20% on SmolLM2-135M, most of it on the shipped
4M-parameter pair. ``qwen3_layer`` runs the same kernels in the same order from one compiled
function (pyx/layers.pxi), so its output is bit-identical to the composition of the single ops,
which is its oracle (``compose_qwen3_layer``) and what other backends run.

A DFlash drafter layer is the same layer with another attention (``drafter_layer``): the block's
queries see the injected context K/V and the block's own K/V, which are not stored.

A Qwen3.5 gated full-attention layer is the same layer with three switches (``prepare_qwen3_layer``'s
``norm_offset``, ``output_gate``, ``rotary_dim``): zero-centred norms, a sigmoid output gate beside
each query head and partial RoPE. Qwen3.5's Gated DeltaNet layers are ``gdn_layer.py``'s.

Weights are prepared once (``prepare_qwen3_layer``): [Wq; Wk; Wv] and [Wgate; Wup] stacked, every
matmul weight in linear's fastest layout (``prepare_weight``), the norms in float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._backends import resolve
from ._docs import shared_doc
from ._precision import check_precision, get_matmul_precision, parts as precision_parts
from ._tensors import Array, _numpy_view, any_torch, f32_array, f32_to_bf16, float_array, wrap
from ._threads import resolve_threads
from .attention import cached_attention, injected_kv_attention
from .dense import PackedWeight, apply_rope, linear, prepare_weight, rms_norm, silu_and_mul
from .linear_attention import apply_output_gate, split_query_gate
from .quant import QuantizedRows


class _PreparedLayer:
    """What the prepared decoder layers share: the matmul weights named in ``MATMULS`` (each a
    ``PackedWeight`` or a plain array), the input norm ``w_in`` and the MLP's ``w_down``."""

    __slots__ = ()
    MATMULS: tuple[str, ...] = ()

    def _finite_mask(self) -> int:
        """Bit i: matmul weight i is finite (PackedWeight.finite), for the kernel's path choice; once
        at preparation, not per call."""
        return sum(1 << i for i, n in enumerate(self.MATMULS) if getattr(getattr(self, n), "finite", True))

    @property
    def hidden_size(self) -> int:
        return self.w_in.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w_down.shape[1]

    @property
    def fused(self) -> bool:
        """Whether the layer runs as one compiled call: every matmul weight packed, all of one storage
        (float32, bf16, or GGUF blocks of one format)."""
        ws = [getattr(self, n) for n in self.MATMULS]
        return all(isinstance(w, PackedWeight) for w in ws) and len({(w.dtype, w.quant) for w in ws}) == 1

    @property
    def quant(self) -> int:
        """The matmul weights' GGUF block format (PackedWeight.quant; 0: float32 / bf16 panels)."""
        return getattr(getattr(self, self.MATMULS[0]), "quant", 0)


class Qwen3Layer(_PreparedLayer):
    """One Qwen3 / Llama decoder layer's weights, ready for ``qwen3_layer``.

    Attributes: ``w_in``, ``w_post`` (H,) float32 norms; ``w_qkv`` (q_dim + 2 kv_dim, H) =
    [Wq; Wk; Wv], ``w_o`` (H, q_dim), ``w_gate_up`` (2 I, H) = [Wgate; Wup], ``w_down`` (H, I), each a
    ``PackedWeight`` (Cython) or a float32 / bf16 array; ``q_norm``, ``k_norm`` (D,) float32, or None
    for a Llama layer; the head counts, ``head_dim``, ``eps``, ``rope_theta``, ``inv_freq`` (float64
    (D/2,) scaled-RoPE frequencies, or None), ``window`` (sliding window, or None) and ``causal``
    (a drafter layer's block attention: whether a row sees the rows after it; targets are causal);
    for a Qwen3.5 gated full-attention layer ``norm_offset`` 1.0 (every norm x (1 + w); 0.0 else),
    ``output_gate`` (Wq's rows per head [query | gate], the attention output times sigmoid(gate)) and
    ``rotary_dim`` (RoPE on the first dims of a head only; head_dim for Qwen3).
    """

    __slots__ = ("w_in", "w_qkv", "q_norm", "k_norm", "w_o", "w_post", "w_gate_up", "w_down", "window",
                 "num_heads", "num_kv_heads", "head_dim", "eps", "rope_theta", "inv_freq", "causal", "finite_mask",
                 "norm_offset", "output_gate", "rotary_dim")
    MATMULS = ("w_qkv", "w_o", "w_gate_up", "w_down")

    def __init__(self, *, w_in, w_qkv, q_norm, k_norm, w_o, w_post, w_gate_up, w_down, num_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float, rope_theta: float, inv_freq=None, window=None,
                 causal: bool = True, norm_offset: float = 0.0, output_gate: bool = False,
                 rotary_dim: int | None = None):
        self.w_in, self.w_qkv, self.q_norm, self.k_norm = w_in, w_qkv, q_norm, k_norm
        self.w_o, self.w_post, self.w_gate_up, self.w_down = w_o, w_post, w_gate_up, w_down
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.rope_theta, self.inv_freq, self.window = eps, rope_theta, inv_freq, window
        self.causal = causal
        self.norm_offset, self.output_gate = float(norm_offset), bool(output_gate)
        self.rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
        self.finite_mask = self._finite_mask()

    def __repr__(self) -> str:
        return (f"Qwen3Layer(hidden={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, "
                f"intermediate={self.intermediate_size}, qk_norm={self.q_norm is not None}, fused={self.fused})")


def _weight(weights: Mapping, name: str, shape: tuple, dtype=None) -> np.ndarray | QuantizedRows:
    """weights[name] checked: its shape, and its storage (a dtype, or a GGUF block type) if given."""
    if name not in weights:
        raise KeyError(f"missing tensor {name!r}")
    w = weights[name]
    if not isinstance(w, QuantizedRows):
        w = float_array(w, name, ndim=len(shape))
    if w.shape != shape:
        raise ValueError(f"tensor {name!r} must have shape {shape}, got {w.shape}")
    if dtype is not None and _storage(w) != dtype:
        raise TypeError(f"tensor {name!r} must have the dtype of the other projections ({dtype}), got {_storage(w)}")
    return w


def _storage(w) -> object:
    """A projection's storage: its dtype, or its GGUF block type (QuantizedRows)."""
    return w.qtype if isinstance(w, QuantizedRows) else w.dtype


def _stack(parts):
    """Projections' rows stacked (the fused qkv and gate_up weights); GGUF blocks stay blocks."""
    return QuantizedRows.concat(parts) if isinstance(parts[0], QuantizedRows) else np.concatenate(parts)


@shared_doc
def prepare_qwen3_layer(weights: Mapping[str, Array], *, num_attention_heads: int, num_key_value_heads: int,
                        head_dim: int, rms_norm_eps: float = 1e-6, rope_theta: float = 1e6,
                        rope_inv_freq: Array | None = None, sliding_window: int | None = None, prefix: str = "",
                        causal: bool = True, norm_offset: float = 0.0, output_gate: bool = False,
                        rotary_dim: int | None = None, backend: str = "auto") -> Qwen3Layer:
    """Prepare one Qwen3 / Llama decoder layer from its Hugging Face tensors, for ``qwen3_layer``.

    Tensor names as in a Qwen3 / Llama checkpoint, after ``prefix``: ``input_layernorm.weight``,
    ``self_attn.{q,k,v,o}_proj.weight``, ``self_attn.{q,k}_norm.weight`` (Qwen3; both absent for
    Llama), ``post_attention_layernorm.weight``, ``mlp.{gate,up,down}_proj.weight``. [Wq; Wk; Wv] and
    [Wgate; Wup] are stacked, every matmul weight put in linear's fastest layout (``prepare_weight``),
    the norms in float32.

    Parameters
    ----------
    weights : Mapping[str, ndarray or torch.Tensor]
        The layer's tensors by name. Matmul weights float32 or bf16, all of one dtype, or GGUF blocks
        (``dflash_kernels.quant.QuantizedRows``), all of one block type.
    num_attention_heads, num_key_value_heads : int
        Query and kv heads (GQA: the first a multiple of the second), positive.
    head_dim : int
        Positive and even (RoPE rotates pairs).
    rms_norm_eps : float, default 1e-6
        The config's.
    rope_theta : float, default 1e6
        The config's; used unless rope_inv_freq is given.
    rope_inv_freq : ndarray, shape (head_dim / 2,), optional
        Scaled-RoPE frequencies (``rope_inv_freq``), finite and positive; None (default): rope_theta's.
    sliding_window : int, optional
        The layer's window (>= 1), or None (default).
    prefix : str, default ""
        Prefix of the tensor names, e.g. "model.layers.3.".
    causal : bool, default True
        For ``drafter_layer``: whether a block row sees only the rows up to its own (DFlash drafters:
        False, their config's ``causal``).
    norm_offset : {0.0, 1.0}, default 0.0
        1.0 for Qwen3.5's zero-centred norms (x (1 + w): input, post-attention, q and k norms).
    output_gate : bool, default False
        Qwen3.5 gated attention: q_proj has 2 head_dim rows per head, [query | gate], and the
        attention output is multiplied by sigmoid(gate) before o_proj.
    rotary_dim : int, optional
        Even, 2 <= rotary_dim <= head_dim: RoPE on a head's first rotary_dim dims (Qwen3.5: head_dim
        times partial_rotary_factor); None (default) = head_dim.
    backend : {"auto", "cython", "numba", "torch"}, default "auto"
        The one the layer will run on (packing is for Cython).

    Returns
    -------
    Qwen3Layer
        The prepared weights.

    Raises
    ------
    KeyError
        If a tensor is missing, or only one of q_norm / k_norm is given. Errors name the tensor.
    ValueError
        If a head count or head_dim is not a positive int, num_attention_heads is not a multiple of
        num_key_value_heads, head_dim is odd, a tensor has the wrong shape, rope_inv_freq is not
        rotary_dim / 2 finite positive frequencies, sliding_window is not None or an int >= 1,
        norm_offset is not 0 or 1, rotary_dim is odd or outside [2, head_dim], or backend is invalid.
    TypeError
        If a matmul weight has another dtype than q_proj's, or a tensor is not float32 / bf16.

    Examples
    --------
    {layer_weights_example}
    >>> layer = dk.prepare_qwen3_layer(weights, num_attention_heads=2, num_key_value_heads=1, head_dim=D)
    >>> layer.hidden_size, layer.intermediate_size, layer.q_norm is None  # no q/k norms: a Llama layer
    (8, 16, True)
    """
    for key, v in (("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads),
                   ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{key} must be a positive int, got {v!r}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
                         f"({num_key_value_heads})")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    if norm_offset not in (0.0, 1.0):
        raise ValueError(f"norm_offset must be 0.0 (Qwen3) or 1.0 (Qwen3.5), got {norm_offset!r}")
    rot = head_dim if rotary_dim is None else rotary_dim
    if isinstance(rot, bool) or not isinstance(rot, (int, np.integer)) or rot % 2 or not 2 <= rot <= head_dim:
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim = {head_dim}], got {rotary_dim!r}")
    p, a, m = prefix, prefix + "self_attn.", prefix + "mlp."
    w_in = f32_array(_weight(weights, p + "input_layernorm.weight", (_hidden(weights, p),)), "input_layernorm")
    H = w_in.shape[0]
    qd, kvd = num_attention_heads * head_dim, num_key_value_heads * head_dim
    wq = _weight(weights, a + "q_proj.weight", (2 * qd if output_gate else qd, H))
    wk = _weight(weights, a + "k_proj.weight", (kvd, H), _storage(wq))
    wv = _weight(weights, a + "v_proj.weight", (kvd, H), _storage(wq))
    wo = _weight(weights, a + "o_proj.weight", (H, qd), _storage(wq))
    gate = weights.get(m + "gate_proj.weight")
    inter = (gate if isinstance(gate, QuantizedRows) else _numpy_view(gate, m + "gate_proj.weight")).shape[0] \
        if gate is not None else 0
    wg = _weight(weights, m + "gate_proj.weight", (inter, H), _storage(wq))
    wu = _weight(weights, m + "up_proj.weight", (inter, H), _storage(wq))
    wd = _weight(weights, m + "down_proj.weight", (H, inter), _storage(wq))
    has_q, has_k = a + "q_norm.weight" in weights, a + "k_norm.weight" in weights
    if has_q != has_k:
        raise KeyError(f"{a}q_norm.weight and {a}k_norm.weight come together (Qwen3) or not at all (Llama); "
                       f"got only {'q_norm' if has_q else 'k_norm'}")
    qn = f32_array(_weight(weights, a + "q_norm.weight", (head_dim,)), "q_norm") if has_q else None
    kn = f32_array(_weight(weights, a + "k_norm.weight", (head_dim,)), "k_norm") if has_k else None
    w_post = f32_array(_weight(weights, p + "post_attention_layernorm.weight", (H,)), "post_attention_layernorm")
    freq = None
    if rope_inv_freq is not None:
        freq = np.ascontiguousarray(np.asarray(rope_inv_freq, dtype=np.float64))
        if freq.shape != (rot // 2,) or not (np.isfinite(freq).all() and (freq > 0).all()):
            raise ValueError(f"rope_inv_freq must hold {rot // 2} finite positive frequencies, got shape "
                             f"{freq.shape}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    prep = lambda w: prepare_weight(w, backend=backend)  # noqa: E731
    return Qwen3Layer(
        w_in=w_in, w_qkv=prep(_stack([wq, wk, wv])), q_norm=qn, k_norm=kn, w_o=prep(wo), w_post=w_post,
        w_gate_up=prep(_stack([wg, wu])), w_down=prep(wd), num_heads=int(num_attention_heads),
        num_kv_heads=int(num_key_value_heads), head_dim=int(head_dim), eps=float(rms_norm_eps),
        rope_theta=float(rope_theta), inv_freq=freq, window=None if sliding_window is None else int(sliding_window),
        causal=bool(causal), norm_offset=norm_offset, output_gate=output_gate, rotary_dim=int(rot))


def _hidden(weights: Mapping, prefix: str) -> int:
    name = prefix + "input_layernorm.weight"
    if name not in weights:
        raise KeyError(f"missing tensor {name!r}")
    shape = _numpy_view(weights[name], name).shape
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"tensor {name!r} must have shape (hidden_size,), got {shape}")
    return shape[0]


def _cache(c, name: str, min_len: int, n_kv: int, d: int, writable: bool = True) -> np.ndarray:
    float_array(c, name, ndim=3)  # dtype and rank
    arr = _numpy_view(c, name)
    if not arr.flags.c_contiguous or (writable and not arr.flags.writeable):
        need = "C-contiguous and writable: the layer writes its new rows into it" if writable else "C-contiguous"
        raise ValueError(f"{name} must be {need}")
    if arr.shape[1:] != (n_kv, d):
        raise ValueError(f"{name} must have shape ({'max_len' if writable else 'T_ctx'}, {n_kv}, {d}), got {arr.shape}")
    if arr.shape[0] < min_len:
        raise ValueError(f"{name} holds {arr.shape[0]} positions; the layer writes up to position {min_len - 1}")
    return arr


@shared_doc
def qwen3_layer(x: Array, layer: Qwen3Layer, k_cache: Array, v_cache: Array, start: int, *,
                precision: str | None = None, n_threads: int | None = None, backend: str = "auto") -> Array:
    """The layer's output for rows x of the residual stream at positions start..start+T-1.

    The rows' K (after k_norm and RoPE) and V are written into the cache at start..start+T-1, and
    attention is causal over positions 0..start+T-1 (within the layer's window). On the Cython backend
    with packed weights this is one compiled call; otherwise the composition of the single ops
    (``compose_qwen3_layer``).

    Parameters
    ----------
    {layer_rows}
    layer : Qwen3Layer
        The layer's weights (``prepare_qwen3_layer``).
    k_cache, v_cache : ndarray or torch.Tensor, shape (max_len, H_kv, D)
        This layer's cache, float32 or bf16 (torch.bfloat16 or numpy uint16), C-contiguous and
        writable, one shape and one dtype, holding positions 0..start-1; max_len >= start + T.
    start : int
        Position of the first row, >= 0.
    {layer_precision}
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T, H)
        float32: x + attention + MLP, as HF's decoder layer; a torch tensor if x is one.

    Raises
    ------
    TypeError
        If layer is not a Qwen3Layer, or x or a cache is not a float32 / bf16 array or tensor.
    ValueError
        If x is not (T, H), start is not an int >= 0, a cache is not 3-D, C-contiguous and writable,
        not (max_len, H_kv, D) or shorter than start + T, the caches differ in shape or dtype, or
        precision, n_threads or backend is invalid.

    Examples
    --------
    {layer_weights_example}
    >>> layer = dk.prepare_qwen3_layer(weights, num_attention_heads=2, num_key_value_heads=1, head_dim=D)
    >>> x = rng.standard_normal((3, H), dtype=np.float32)
    >>> k_cache, v_cache = np.zeros((2, 4, 1, D), np.float32)  # max_len 4
    >>> out = dk.qwen3_layer(x, layer, k_cache, v_cache, 0)  # prefill positions 0..2
    >>> out.shape, out.dtype
    ((3, 8), dtype('float32'))

    The same rows as a prefill of two and a decode step of one, on a second cache:

    >>> k2, v2 = np.zeros((2, 4, 1, D), np.float32)
    >>> steps = [dk.qwen3_layer(x[:2], layer, k2, v2, 0), dk.qwen3_layer(x[2:], layer, k2, v2, 2)]
    >>> np.allclose(np.concatenate(steps), out, rtol=1e-4, atol=1e-4), np.allclose(k2, k_cache, atol=1e-5)
    (True, True)
    """
    xa, kc, vc = _check(x, layer, k_cache, v_cache, "k_cache", "v_cache", start)
    return _run(x, xa, layer, kc, vc, int(start), True, precision, n_threads, backend)


@shared_doc
def drafter_layer(x: Array, layer: Qwen3Layer, k_ctx: Array, v_ctx: Array, *, precision: str | None = None,
                  n_threads: int | None = None, backend: str = "auto") -> Array:
    """A DFlash drafter layer over rows x of the block's residual stream, after the injected context.

    The rows sit at positions T_ctx..T_ctx+T-1. The block's queries see the context and the block's own
    K/V (every block row, or the rows up to their own with ``layer.causal``; within ``layer.window``),
    as ``injected_kv_attention``; the block's K/V are not stored. One compiled call on the Cython
    backend with packed weights, else ``compose_drafter_layer``.

    Parameters
    ----------
    x : ndarray or torch.Tensor, shape (T, H)
        Rows of the block's residual stream, float32 (bf16 is upcast).
    layer : Qwen3Layer
        The layer's weights (``prepare_qwen3_layer``; its ``causal`` and ``window`` apply).
    k_ctx, v_ctx : ndarray or torch.Tensor, shape (T_ctx, H_kv, D)
        The context's K (after k_norm and RoPE) and V, float32 or bf16, C-contiguous, one shape and one
        dtype; read only.
    {layer_precision}
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T, H)
        float32; a torch tensor if x is one.

    Raises
    ------
    TypeError
        If layer is not a Qwen3Layer, or x, k_ctx or v_ctx is not a float32 / bf16 array or tensor.
    ValueError
        If x is not (T, H), k_ctx or v_ctx is not 3-D, C-contiguous and (T_ctx, H_kv, D), they differ in
        shape or dtype, or precision, n_threads or backend is invalid.

    Examples
    --------
    {layer_weights_example}
    >>> layer = dk.prepare_qwen3_layer(weights, num_attention_heads=2, num_key_value_heads=1, head_dim=D,
    ...                                causal=False)
    >>> k_ctx, v_ctx = rng.standard_normal((2, 5, 1, D), dtype=np.float32)  # T_ctx = 5
    >>> out = dk.drafter_layer(rng.standard_normal((3, H), dtype=np.float32), layer, k_ctx, v_ctx)
    >>> out.shape, out.dtype
    ((3, 8), dtype('float32'))
    """
    xa, kc, vc = _check(x, layer, k_ctx, v_ctx, "k_ctx", "v_ctx", None)
    return _run(x, xa, layer, kc, vc, kc.shape[0], False, precision, n_threads, backend)


def _check(x, layer, k, v, k_name: str, v_name: str, start):
    """Validated (x, k, v) numpy arrays; start None: a drafter layer's read-only context."""
    if not isinstance(layer, Qwen3Layer):
        raise TypeError(f"layer must be a Qwen3Layer (prepare_qwen3_layer), got {type(layer).__name__}")
    xa = f32_array(x, "x", ndim=2)
    if xa.shape[1] != layer.hidden_size:
        raise ValueError(f"x must have shape (T, {layer.hidden_size}), got {xa.shape}")
    writable = start is not None
    if writable and (isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0):
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    min_len = start + xa.shape[0] if writable else 0
    kc = _cache(k, k_name, min_len, layer.num_kv_heads, layer.head_dim, writable)
    vc = _cache(v, v_name, min_len, layer.num_kv_heads, layer.head_dim, writable)
    if kc.shape != vc.shape or kc.dtype != vc.dtype:
        raise ValueError(f"{k_name} and {v_name} must match, got {kc.shape} {kc.dtype} and {vc.shape} {vc.dtype}")
    return xa, kc, vc


def _run(x, xa, layer, kc, vc, start: int, append: bool, precision, n_threads, backend):
    prec = check_precision(precision) if precision is not None else get_matmul_precision()
    name, module = resolve(backend, "dense")
    out = xa.copy()
    if out.shape[0]:
        if name == "cython" and layer.fused:
            run_qwen3_layer(module, out, layer, kc, vc, start, precision_parts(prec), resolve_threads(n_threads),
                            append=append)
        elif append:
            out = compose_qwen3_layer(out, layer, kc, vc, start, precision=prec, n_threads=n_threads,
                                      backend=backend)
        else:
            out = compose_drafter_layer(out, layer, kc, vc, precision=prec, n_threads=n_threads, backend=backend)
    return wrap(out, any_torch(x))


def run_qwen3_layer(module, x: np.ndarray, layer: Qwen3Layer, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
                    parts: int, n_threads: int, append: bool = True) -> None:
    """The compiled layer, no checks: x (T, H) float32 C-contiguous, updated in place (the model
    layer's fast path; ``qwen3_layer`` / ``drafter_layer`` validate first). append=False: a drafter
    layer over the context rows 0..start-1 of the caches."""
    module.qwen3_layer(
        x, start, layer.w_in, layer.w_qkv.data, layer.q_norm, layer.k_norm, layer.w_o.data, layer.w_post,
        layer.w_gate_up.data, layer.w_down.data, k_cache, v_cache, n_heads=layer.num_heads,
        n_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, intermediate=layer.intermediate_size,
        eps=layer.eps, theta=layer.rope_theta, inv_freq=layer.inv_freq, window=layer.window or 0,
        n_threads=n_threads, parts=parts, finite_mask=layer.finite_mask, append=append,
        causal=layer.causal, norm_offset=layer.norm_offset, output_gate=layer.output_gate, rotary_dim=layer.rotary_dim,
        quant=layer.quant)


def _project(x, layer, start, precision, kw):
    """h, q, k (after the q/k norms and RoPE), v and the output gate (None unless layer.output_gate)
    of rows x at positions start.."""
    T, D, off = x.shape[0], layer.head_dim, layer.norm_offset
    qd, kvd = layer.num_heads * D, layer.num_kv_heads * D
    qw = 2 * qd if layer.output_gate else qd  # the query columns (and their gates) of a qkv row
    h = rms_norm(x, layer.w_in, layer.eps, offset=off, **kw)
    qkv = np.asarray(linear(h, layer.w_qkv, precision=precision, **kw))
    gate = None
    if layer.output_gate:
        q, gate = split_query_gate(qkv[:, :qw], layer.num_heads, D)
    else:
        q = np.ascontiguousarray(qkv[:, :qd]).reshape(T, layer.num_heads, D)
    k = np.ascontiguousarray(qkv[:, qw:qw + kvd]).reshape(T, layer.num_kv_heads, D)
    v = np.ascontiguousarray(qkv[:, qw + kvd:]).reshape(T, layer.num_kv_heads, D)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, layer.eps, offset=off, **kw)
        k = rms_norm(k, layer.k_norm, layer.eps, offset=off, **kw)
    pos = np.arange(start, start + T, dtype=np.int64)
    q = apply_rope(q, pos, layer.rope_theta, layer.rotary_dim, inv_freq=layer.inv_freq, **kw)
    k = apply_rope(k, pos, layer.rope_theta, layer.rotary_dim, inv_freq=layer.inv_freq, **kw)
    return q, k, v, gate


def _finish(x, o, gate, layer, precision, kw):
    """x + o_proj(o, gated) + MLP(norm(...)): the layer's second half."""
    if gate is not None:
        o = apply_output_gate(np.asarray(o).reshape(x.shape[0], -1), gate, **kw)
    h, x1 = rms_norm(linear(o.reshape(x.shape[0], -1), layer.w_o, precision=precision, **kw), layer.w_post,
                     layer.eps, offset=layer.norm_offset, residual=x, **kw)
    mlp = linear(silu_and_mul(linear(h, layer.w_gate_up, precision=precision, **kw), **kw), layer.w_down,
                 precision=precision, **kw)
    return mlp + x1


def compose_qwen3_layer(x: np.ndarray, layer: Qwen3Layer, k_cache: np.ndarray, v_cache: np.ndarray, start: int, *,
                        precision: str | None = None, n_threads: int | None = None,
                        backend: str = "auto") -> np.ndarray:
    """``qwen3_layer`` as the composition of the single ops (the fused kernel's oracle; the path of
    the other backends). Same arguments, validated by the caller; returns (T, H) float32."""
    T, kw = x.shape[0], dict(n_threads=n_threads, backend=backend)
    q, k, v, gate = _project(x, layer, start, precision, kw)
    bf16 = k_cache.dtype == np.uint16
    k_cache[start:start + T] = f32_to_bf16(k) if bf16 else k
    v_cache[start:start + T] = f32_to_bf16(v) if bf16 else v
    o = cached_attention(q, k_cache[:start + T], v_cache[:start + T], causal=True, window=layer.window,
                         precision=precision, **kw)
    return _finish(x, o, gate, layer, precision, kw)


def compose_drafter_layer(x: np.ndarray, layer: Qwen3Layer, k_ctx: np.ndarray, v_ctx: np.ndarray, *,
                          precision: str | None = None, n_threads: int | None = None,
                          backend: str = "auto") -> np.ndarray:
    """``drafter_layer`` as the composition of the single ops (its oracle; the other backends' path)."""
    kw = dict(n_threads=n_threads, backend=backend)
    q, k, v, gate = _project(x, layer, k_ctx.shape[0], precision, kw)
    o = injected_kv_attention(q, k_ctx, v_ctx, k, v, causal_block=layer.causal, window=layer.window,
                              precision=precision, **kw)
    return _finish(x, o, gate, layer, precision, kw)
