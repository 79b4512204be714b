"""A fused Qwen3.5 Gated DeltaNet decoder layer: the linear-attention layer of a Qwen3.5 hybrid target in
one kernel call.

Three of every four Qwen3.5 layers are Gated DeltaNet layers (docs/models.md 2.3-2.8). Composed of the
single ops, one is ~13 calls plus a few numpy expressions: the zero-centred input norm, the stacked
input projection [W_qkv; W_z; W_b; W_a], the causal conv + SiLU, the gates, the gated delta rule, the
gated RMSNorm, out_proj, the post norm with the residual add, and the SwiGLU MLP. For a decode step
the Python between those calls is a visible share of the step. ``gated_deltanet_layer`` runs the same
C code in the same order from one compiled function (pyx/gdn_layer.pxi) where the Cython kernels run
with packed weights; elsewhere the composition (``compose_gated_deltanet_layer``, also its oracle).

With the Cython kernels the two are bit-identical (the same C row functions in the same order); the
composition on another backend agrees to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._backends import resolve
from ._docs import shared_doc
from ._precision import check_precision, get_matmul_precision, parts as precision_parts
from ._tensors import Array, _numpy_view, any_torch, f32_array, wrap
from ._threads import resolve_threads
from .dense import linear, prepare_weight, rms_norm, silu_and_mul
from .layers import _hidden, _PreparedLayer, _weight
from .linear_attention import _conv_weight, _state_array, causal_conv1d, gated_delta_rule, gated_rms_norm


class GatedDeltaNetLayer(_PreparedLayer):
    """One Qwen3.5 Gated DeltaNet decoder layer's weights, ready for ``gated_deltanet_layer``.

    Attributes: ``w_in``, ``w_post`` (H,) float32 zero-centred norms (x (1 + w)); ``w_proj``
    (C + H_v d_v + 2 H_v, H) = [W_qkv; W_z; W_b; W_a], ``w_out`` (H, H_v d_v), ``w_gate_up`` (2 I, H),
    ``w_down`` (H, I), each a ``PackedWeight`` (Cython) or a float32 / bf16 array; ``conv`` (C, K)
    float32 depthwise conv; ``neg_a`` = -exp(A_log), ``dt_bias`` (H_v,) float32; ``norm`` (d_v,)
    float32 ones-centred gated norm; the head counts and dims and ``eps``. C = 2 H_k d_k + H_v d_v.
    """

    __slots__ = ("w_in", "w_proj", "conv", "neg_a", "dt_bias", "norm", "w_out", "w_post", "w_gate_up", "w_down",
                 "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "eps", "finite_mask")
    MATMULS = ("w_proj", "w_out", "w_gate_up", "w_down")

    @property
    def fused(self) -> bool:
        """As the other layers, but not over GGUF blocks (the compiled Gated DeltaNet layer reads
        float32 / bf16 panels only; such weights run through the composed ops)."""
        return super().fused and self.quant == 0

    def __init__(self, *, w_in, w_proj, conv, neg_a, dt_bias, norm, w_out, w_post, w_gate_up, w_down,
                 num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, eps: float):
        self.w_in, self.w_proj, self.conv, self.neg_a, self.dt_bias = w_in, w_proj, conv, neg_a, dt_bias
        self.norm, self.w_out, self.w_post, self.w_gate_up, self.w_down = norm, w_out, w_post, w_gate_up, w_down
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.k_head_dim, self.v_head_dim, self.eps = k_head_dim, v_head_dim, eps
        self.finite_mask = self._finite_mask()

    @property
    def conv_dim(self) -> int:
        """C = 2 H_k d_k + H_v d_v: the q | k | v channels of the conv."""
        return self.conv.shape[0]

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv.shape[0], self.conv.shape[1] - 1

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.k_head_dim, self.v_head_dim

    def __repr__(self) -> str:
        return (f"GatedDeltaNetLayer(hidden={self.hidden_size}, heads={self.num_k_heads}x{self.k_head_dim}/"
                f"{self.num_v_heads}x{self.v_head_dim}, conv={self.conv.shape[1]}, "
                f"intermediate={self.intermediate_size}, fused={self.fused})")


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@shared_doc
def prepare_gated_deltanet_layer(weights: Mapping[str, Array], *, linear_num_key_heads: int,
                                 linear_num_value_heads: int, linear_key_head_dim: int, linear_value_head_dim: int,
                                 rms_norm_eps: float = 1e-6, prefix: str = "",
                                 backend: str = "auto") -> GatedDeltaNetLayer:
    """Prepare one Qwen3.5 Gated DeltaNet decoder layer from its Hugging Face tensors.

    Tensor names as in a Qwen3.5 checkpoint, after ``prefix``: ``input_layernorm.weight``,
    ``linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}.weight``,
    ``linear_attn.conv1d.weight`` ((C, 1, K) or (C, K)), ``linear_attn.A_log``, ``linear_attn.dt_bias``,
    ``linear_attn.norm.weight``, ``post_attention_layernorm.weight``, ``mlp.{gate,up,down}_proj.weight``.
    The four input projections and [Wgate; Wup] are stacked, every matmul weight put in linear's
    fastest layout (``prepare_weight``), the rest in float32.

    Parameters
    ----------
    weights : Mapping[str, ndarray or torch.Tensor]
        The layer's tensors by name. Matmul weights float32 or bf16, all of one dtype.
    linear_num_key_heads, linear_num_value_heads : int
        H_k and H_v (the config's names), positive; H_v a multiple of H_k.
    linear_key_head_dim, linear_value_head_dim : int
        d_k and d_v, positive.
    rms_norm_eps : float, default 1e-6
        The config's.
    prefix : str, default ""
        Prefix of the tensor names, e.g. "model.language_model.layers.0.".
    backend : {"auto", "cython", "numba", "torch"}, default "auto"
        The one the layer will run on (packing is for Cython).

    Returns
    -------
    GatedDeltaNetLayer

    Raises
    ------
    KeyError
        If a tensor is missing; the error names it.
    ValueError
        If a head count or dim is not a positive int, H_v is not a multiple of H_k, or a tensor has
        the wrong shape (the error names it).
    TypeError
        If a matmul weight has another dtype than in_proj_qkv's, or a tensor is not float32 / bf16.

    Examples
    --------
    {gdn_weights_example}
    >>> layer.conv_state_shape, layer.state_shape
    ((16, 3), (2, 4, 4))
    """
    Hk = _positive_int("linear_num_key_heads", linear_num_key_heads)
    Hv = _positive_int("linear_num_value_heads", linear_num_value_heads)
    dk = _positive_int("linear_key_head_dim", linear_key_head_dim)
    dv = _positive_int("linear_value_head_dim", linear_value_head_dim)
    if Hv % Hk:
        raise ValueError(f"linear_num_value_heads ({Hv}) must be a multiple of linear_num_key_heads ({Hk})")
    p, a, m = prefix, prefix + "linear_attn.", prefix + "mlp."
    w_in = f32_array(_weight(weights, p + "input_layernorm.weight", (_hidden(weights, p),)), "input_layernorm")
    H, C, vd = w_in.shape[0], 2 * Hk * dk + Hv * dv, Hv * dv
    wqkv = _weight(weights, a + "in_proj_qkv.weight", (C, H))
    wz = _weight(weights, a + "in_proj_z.weight", (vd, H), wqkv.dtype)
    wb = _weight(weights, a + "in_proj_b.weight", (Hv, H), wqkv.dtype)
    wa = _weight(weights, a + "in_proj_a.weight", (Hv, H), wqkv.dtype)
    wo = _weight(weights, a + "out_proj.weight", (H, vd), wqkv.dtype)
    conv_name = a + "conv1d.weight"
    if conv_name not in weights:
        raise KeyError(f"missing tensor {conv_name!r}")
    conv = _conv_weight(weights[conv_name])
    if conv.shape[0] != C:
        raise ValueError(f"tensor {conv_name!r} must have {C} channels (2 H_k d_k + H_v d_v), got shape "
                         f"{tuple(_numpy_view(weights[conv_name], conv_name).shape)}")
    a_log = f32_array(_weight(weights, a + "A_log", (Hv,)), "A_log")
    dt_bias = f32_array(_weight(weights, a + "dt_bias", (Hv,)), "dt_bias")
    norm = f32_array(_weight(weights, a + "norm.weight", (dv,)), "norm")
    gate = weights.get(m + "gate_proj.weight")
    inter = _numpy_view(gate, m + "gate_proj.weight").shape[0] if gate is not None else 0
    wg = _weight(weights, m + "gate_proj.weight", (inter, H), wqkv.dtype)
    wu = _weight(weights, m + "up_proj.weight", (inter, H), wqkv.dtype)
    wd = _weight(weights, m + "down_proj.weight", (H, inter), wqkv.dtype)
    w_post = f32_array(_weight(weights, p + "post_attention_layernorm.weight", (H,)), "post_attention_layernorm")
    prep = lambda w: prepare_weight(w, backend=backend)  # noqa: E731
    return GatedDeltaNetLayer(
        w_in=w_in, w_proj=prep(np.concatenate([wqkv, wz, wb, wa])), conv=np.ascontiguousarray(conv, np.float32),
        neg_a=-np.exp(a_log), dt_bias=dt_bias, norm=norm, w_out=prep(wo), w_post=w_post,
        w_gate_up=prep(np.concatenate([wg, wu])), w_down=prep(wd), num_k_heads=Hk, num_v_heads=Hv, k_head_dim=dk,
        v_head_dim=dv, eps=float(rms_norm_eps))


@shared_doc
def gated_deltanet_gates(a: Array, b: Array, neg_a: Array, dt_bias: Array, *,
                         backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule's log-decay g and write strength beta from the a and b projections.

    As Qwen3.5: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), in overflow-free forms
    (softplus(u) = max(u, 0) + log1p(exp(-|u|)), sigmoid(b) = (1 + tanh(b / 2)) / 2), in float32: the
    Cython kernel's C code is the fused layer's, numpy's ufuncs elsewhere (a few ulp apart).

    Parameters
    ----------
    a, b : ndarray or torch.Tensor, shape (T, H_v)
        The in_proj_a and in_proj_b outputs, float32 or bf16.
    neg_a : ndarray or torch.Tensor, shape (H_v,)
        -exp(A_log), float32 or bf16.
    dt_bias : ndarray or torch.Tensor, shape (H_v,)
        float32 or bf16.
    {backend}

    Returns
    -------
    g, beta : ndarray, shape (T, H_v)
        float32; g <= 0, beta in [0, 1].

    Raises
    ------
    TypeError
        If an input is not a float32 / bf16 array or tensor.
    ValueError
        If a and b differ in shape or are not 2-D, neg_a / dt_bias are not (H_v,), or backend is invalid.

    Examples
    --------
    >>> g, beta = dk.gated_deltanet_gates(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32),
    ...                                   np.full(2, -1.0, np.float32), np.zeros(2, np.float32))
    >>> g.round(4), beta  # -softplus(0) = -ln 2, sigmoid(0) = 0.5
    (array([[-0.6931, -0.6931]], dtype=float32), array([[0.5, 0.5]], dtype=float32))
    """
    a, b = f32_array(a, "a", ndim=2), f32_array(b, "b", ndim=2)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape (T, H_v), got {a.shape} and {b.shape}")
    neg_a, dt_bias = f32_array(neg_a, "neg_a", ndim=1), f32_array(dt_bias, "dt_bias", ndim=1)
    for name, v in (("neg_a", neg_a), ("dt_bias", dt_bias)):
        if v.shape != (a.shape[1],):
            raise ValueError(f"{name} must have shape ({a.shape[1]},), got {v.shape}")
    name, module = resolve(backend, "linear_attention")
    if name == "cython":
        g, beta = np.empty(a.shape, np.float32), np.empty(a.shape, np.float32)
        if a.size:
            module.gated_deltanet_gates(np.ascontiguousarray(a), np.ascontiguousarray(b), neg_a, dt_bias, g, beta)
        return g, beta
    u = a + dt_bias
    with np.errstate(over="ignore", under="ignore"):
        beta = (0.5 + 0.5 * np.tanh(0.5 * b)).astype(np.float32)
        g = (neg_a * (np.maximum(u, 0) + np.log1p(np.exp(-np.abs(u))))).astype(np.float32)
    return g, beta


@shared_doc
def gated_deltanet_layer(x: Array, layer: GatedDeltaNetLayer, conv_state: Array, state: Array, *,
                         precision: str | None = None, n_threads: int | None = None, backend: str = "auto") -> Array:
    """The layer's output for rows x of the residual stream, its conv and recurrent states advanced
    over the T rows in place.

    On the Cython backend with packed weights this is one compiled call; otherwise the composition
    of the single ops (``compose_gated_deltanet_layer``), bit-identical where Cython runs.

    Parameters
    ----------
    {layer_rows}
    layer : GatedDeltaNetLayer
        The layer's weights (``prepare_gated_deltanet_layer``).
    conv_state : ndarray or torch.Tensor, shape (C, K-1)
        float32, C-contiguous, writable: the conv inputs of the last K-1 earlier rows (zeros at the start).
    state : ndarray or torch.Tensor, shape (H_v, d_k, d_v)
        float32, C-contiguous, writable: the recurrent state after the earlier rows (zeros at the start).
    {layer_precision}
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T, H)
        float32: x + the Gated DeltaNet mixer + the MLP, as HF's decoder layer; a torch tensor if x is one.

    Raises
    ------
    TypeError
        If layer is not a GatedDeltaNetLayer, x is not a float32 / bf16 array or tensor, or a state is
        not float32.
    ValueError
        If x is not (T, H), a state has the wrong shape or is not C-contiguous and writable, or
        precision, n_threads or backend is invalid.

    Examples
    --------
    A prompt of 3 rows, then one more row, give the rows of one pass over all 4:

    {gdn_weights_example}
    >>> x = rng.standard_normal((4, H), dtype=np.float32)
    >>> conv, state = np.zeros(layer.conv_state_shape, np.float32), np.zeros(layer.state_shape, np.float32)
    >>> whole = dk.gated_deltanet_layer(x, layer, conv, state)
    >>> conv2, state2 = np.zeros_like(conv), np.zeros_like(state)
    >>> steps = [dk.gated_deltanet_layer(x[:3], layer, conv2, state2),
    ...          dk.gated_deltanet_layer(x[3:], layer, conv2, state2)]
    >>> np.allclose(np.concatenate(steps), whole, atol=1e-5), np.allclose(state2, state, atol=1e-6)
    (True, True)
    """
    if not isinstance(layer, GatedDeltaNetLayer):
        raise TypeError(f"layer must be a GatedDeltaNetLayer (prepare_gated_deltanet_layer), got "
                        f"{type(layer).__name__}")
    xa = f32_array(x, "x", ndim=2)
    if xa.shape[1] != layer.hidden_size:
        raise ValueError(f"x must have shape (T, {layer.hidden_size}), got {xa.shape}")
    cs = _state_array(conv_state, "conv_state", layer.conv_state_shape)
    st = _state_array(state, "state", layer.state_shape)
    prec = check_precision(precision) if precision is not None else get_matmul_precision()
    name, module = resolve(backend, "dense")
    out = xa.copy()
    if out.shape[0]:
        if name == "cython" and layer.fused:
            run_gated_deltanet_layer(module, out, layer, cs, st, precision_parts(prec), resolve_threads(n_threads))
        else:
            out = compose_gated_deltanet_layer(out, layer, cs, st, precision=prec, n_threads=n_threads,
                                               backend=backend)
    return wrap(out, any_torch(x))


def run_gated_deltanet_layer(module, x: np.ndarray, layer: GatedDeltaNetLayer, conv_state: np.ndarray,
                             state: np.ndarray, parts: int, n_threads: int, record=None) -> None:
    """The compiled layer, no checks: x (T, H) float32 C-contiguous, updated in place, as the states
    (the model layer's fast path; ``gated_deltanet_layer`` validates first). record: None, or float32
    (mixed (T, C), conv_out (T, C), g (T, H_v), beta (T, H_v)) buffers that receive what a rollback
    re-runs (the conv inputs, the conv outputs q | k | v and the gates)."""
    mixed, conv_out, g, beta = record if record is not None else (None, None, None, None)
    module.gated_deltanet_layer(
        x, layer.w_in, layer.w_proj.data, layer.conv, layer.neg_a, layer.dt_bias, layer.norm, layer.w_out.data,
        layer.w_post, layer.w_gate_up.data, layer.w_down.data, conv_state, state, n_k_heads=layer.num_k_heads,
        intermediate=layer.intermediate_size, eps=layer.eps, n_threads=n_threads, parts=parts,
        finite_mask=layer.finite_mask, mixed_out=mixed, conv_out=conv_out, g_out=g, beta_out=beta)


def compose_gated_deltanet_layer(x: np.ndarray, layer: GatedDeltaNetLayer, conv_state: np.ndarray,
                                 state: np.ndarray, *, precision: str | None = None, n_threads: int | None = None,
                                 backend: str = "auto") -> np.ndarray:
    """``gated_deltanet_layer`` as the composition of the single ops (the fused kernel's oracle; the
    path of the other backends). Same arguments, validated by the caller; returns (T, H) float32."""
    kw = dict(n_threads=n_threads, backend=backend)
    T, Hk, Hv, dk, dv = x.shape[0], layer.num_k_heads, layer.num_v_heads, layer.k_head_dim, layer.v_head_dim
    C, kd, vd = layer.conv_dim, Hk * dk, Hv * dv
    h = rms_norm(x, layer.w_in, layer.eps, offset=1.0, **kw)
    proj = np.asarray(linear(h, layer.w_proj, precision=precision, **kw))  # [qkv | z | b | a]
    y = np.asarray(causal_conv1d(np.ascontiguousarray(proj[:, :C]), layer.conv, conv_state, activation="silu", **kw))
    g, beta = gated_deltanet_gates(proj[:, C + vd + Hv:], proj[:, C + vd:C + vd + Hv], layer.neg_a, layer.dt_bias,
                                   backend=backend)
    q, k = y[:, :kd].reshape(T, Hk, dk), y[:, kd:2 * kd].reshape(T, Hk, dk)
    o = gated_delta_rule(q, k, y[:, 2 * kd:].reshape(T, Hv, dv), g, beta, state, **kw)
    o = gated_rms_norm(o, np.ascontiguousarray(proj[:, C:C + vd]).reshape(T, Hv, dv), layer.norm, layer.eps, **kw)
    h, x1 = rms_norm(linear(np.asarray(o).reshape(T, vd), layer.w_out, precision=precision, **kw), layer.w_post,
                     layer.eps, offset=1.0, residual=x, **kw)
    mlp = linear(silu_and_mul(linear(h, layer.w_gate_up, precision=precision, **kw), **kw), layer.w_down,
                 precision=precision, **kw)
    return np.asarray(mlp) + np.asarray(x1)
