"""Dense ops around attention: linear layers with bf16 weights, RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import math
import warnings

import numpy as np

from ._autotune import delegates, torch_linear
from ._backends import resolve
from ._dispatch import run
from ._docs import shared_doc
from ._fastpath import FAST
from ._precision import parts as precision_parts
from ._tensors import (
    Array,
    _tensor_view,
    dtype_name,
    f32_array,
    float_array,
    hugepage_empty,
    index_array,
    is_real,
    is_torch,
    wrap,
)
from ._threads import resolve_threads


@shared_doc
def silu_and_mul(gate_up: Array, *, n_threads: int | None = None, backend: str = "auto") -> Array:
    """SwiGLU activation: ``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last axis.

    Parameters
    ----------
    gate_up : ndarray or torch.Tensor, shape (M, 2*I)
        float32 or bf16: the gate and up projections side by side.
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (M, I)
        float32; a torch tensor if gate_up is one.

    Raises
    ------
    ValueError
        If gate_up is not 2-D or its last dimension is odd, or n_threads / backend is invalid.
    TypeError
        If gate_up is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> gate_up = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)  # gate [0, 1], up [2, 3]
    >>> out = dk.silu_and_mul(gate_up)
    >>> out.shape, out.dtype
    ((1, 2), dtype('float32'))
    >>> np.allclose(out, [[0.0, 3.0 / (1.0 + np.exp(-1.0))]])  # silu(x) = x * sigmoid(x)
    True
    """
    done = FAST.silu_and_mul(gate_up, n_threads, backend)
    if done is not None:
        return done
    x = f32_array(gate_up, "gate_up", ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"gate_up must have an even last dimension [gate | up], got shape {x.shape}")
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    run("dense", "silu_and_mul", (x,), out, backend=backend, n_threads=n_threads)
    return wrap(out, is_torch(gate_up))


PANEL = 16  # output columns per panel of a packed weight (pyx/dk_packed.h)
Q4_INT8, Q8_INT8 = 4, 5  # PackedWeight.quant of Q4 / Q8_0 blocks times int8 activations (dflash_kernels.quant)


class PackedWeight:
    """A linear layer's weight (N, K), packed once into the layout of the "fma-packed" path.

    The FMA tiers run 16-row blocks (verification, drafting, prefill) at 35-50% of their peak from
    a row-major weight, and at 65-80% from this layout (pyx/dk_packed.h): panels of 16 output
    columns, k-major, bf16 k-pairs in one 32-bit word (AMX's B-tile layout, which the AMX tier
    loads as it is). M = 1 streams it at the speed of a plain read. It costs one copy of the
    weight, made here; ``linear`` then reads it in place. Build it with ``pack_weight`` or
    ``prepare_weight``.

    Attributes: ``shape`` (N, K); ``dtype`` of the source (float32, uint16 bf16 bit patterns, or
    uint8 for GGUF blocks); ``data``, the packed values (1-D, read-only); ``nbytes``; ``finite``,
    whether every weight is finite (infinite weights keep linear on the FMA tiles: IEEE x * inf, see
    ``linear_packed``); ``quant``, 0, or the format of GGUF blocks kept as they are
    (``dflash_kernels.quant.pack_quantized``: 2 for Q4_0 / Q4_1, 3 for Q8_0; 4 and 5 for the same times
    int8 activations).
    """

    __slots__ = ("shape", "dtype", "data", "finite", "quant")

    def __init__(self, shape, dtype, data, finite=True, quant=0):
        self.shape, self.dtype, self.data, self.finite, self.quant = shape, dtype, data, finite, quant

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def unpack(self) -> np.ndarray:
        """The weight (N, K) as it was given (exact: packing only moves values); GGUF blocks as their
        exact float32 values."""
        if self.quant:
            from .quant import unpack_quantized

            return unpack_quantized(self.data, self.shape, self.quant)
        n, k = self.shape
        n16 = -(-n // PANEL)
        if self.dtype == np.uint16:
            k2 = -(-k // 32) * 16
            w = self.data.view(np.uint32).reshape(n16, k2, PANEL).transpose(0, 2, 1).reshape(n16 * PANEL, k2)
            return np.ascontiguousarray(w).view(np.uint16)[:n, :k].copy()
        return self.data.reshape(n16, k, PANEL).transpose(0, 2, 1).reshape(n16 * PANEL, k)[:n].copy()

    def __array__(self, dtype=None, copy=None):
        """np.asarray(packed): the unpacked (N, K) weight."""
        w = self.unpack()
        return w if dtype is None else w.astype(dtype)

    def __repr__(self) -> str:
        if self.quant:
            from .quant import FORMAT_NAMES

            return f"PackedWeight(shape={self.shape}, dtype={FORMAT_NAMES[self.quant]})"
        dt = "bfloat16" if self.dtype == np.uint16 else "float32"
        return f"PackedWeight(shape={self.shape}, dtype={dt})"

    def to_tensor(self):
        """``data`` as a 1-D torch tensor sharing its memory (torch.bfloat16 for bf16 weights, else
        float32): the form ``torch.ops.dflash.linear_packed`` takes, with ``shape`` and ``finite``."""
        import torch

        if self.quant:
            raise TypeError("a PackedWeight of GGUF blocks runs on the Cython kernels only (no torch op takes it)")
        with warnings.catch_warnings():  # read-only by design: nothing writes through this tensor
            warnings.simplefilter("ignore", UserWarning)
            if self.dtype == np.uint16:
                return torch.from_numpy(self.data.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(self.data)

    @classmethod
    def from_data(cls, data: Array, shape: tuple[int, int], finite: bool = True) -> PackedWeight:
        """The inverse of ``to_tensor``: wrap packed values (1-D, bf16 or float32) of an (N, K)
        weight without copying. The length must be that of ``pack_weight``'s layout."""
        d = float_array(data, "packed", ndim=1)
        n, k = (int(s) for s in shape)
        if n < 0 or k < 0:
            raise ValueError(f"shape must be (N, K) with N, K >= 0, got {shape}")
        n16 = -(-n // PANEL)
        want = n16 * PANEL * (-(-k // 32) * 32 if d.dtype == np.uint16 else k)
        if d.size != want:
            kind = "bf16" if d.dtype == np.uint16 else "float32"
            raise ValueError(f"packed has {d.size} values, but a packed {kind} weight of shape ({n}, {k}) "
                             f"has {want}")
        return cls((n, k), d.dtype, d, bool(finite))


def pack_weight(weight: Array) -> PackedWeight:
    """Pack a linear weight for ``linear``'s "fma-packed" path (see ``PackedWeight``).

    Makes one copy; the source is not kept.

    Parameters
    ----------
    weight : ndarray or torch.Tensor, shape (N, K)
        float32 or bf16 (torch.bfloat16 / numpy uint16 bit patterns).

    Returns
    -------
    PackedWeight
        The packed weight, shape (N, K) and dtype of the source; ``linear`` reads it in place.

    Raises
    ------
    ValueError
        If weight is not 2-D.
    TypeError
        If weight is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> w = np.arange(12, dtype=np.float32).reshape(4, 3)
    >>> packed = dk.pack_weight(w)
    >>> packed
    PackedWeight(shape=(4, 3), dtype=float32)
    >>> np.array_equal(np.asarray(packed), w)  # packing only moves values
    True
    >>> x = np.ones((2, 3), np.float32)
    >>> np.allclose(dk.linear(x, packed), x @ w.T)
    True
    """
    w = float_array(weight, "weight", ndim=2)
    n, k = w.shape
    n16 = -(-n // PANEL)
    if w.dtype == np.uint16:
        # a 32-bit word holds the k-pair (2q, 2q + 1) of one row: move words, not halves. K is
        # padded to whole AMX steps of 32 (zeros), so that the AMX tiles read the same layout.
        k2 = -(-k // 32) * 16
        if n % PANEL or 2 * k2 != k:
            padded = np.zeros((n16 * PANEL, 2 * k2), np.uint16)
            padded[:n, :k] = w
            w = padded
        words = np.ascontiguousarray(w).view(np.uint32)  # (N16 * 16, K2)
        panels = hugepage_empty((n16, k2, PANEL), np.uint32)
        panels[...] = words.reshape(n16, PANEL, k2).transpose(0, 2, 1)
        data = panels.view(np.uint16).ravel()
    else:
        if n % PANEL:
            padded = np.zeros((n16 * PANEL, k), np.float32)
            padded[:n] = w
            w = padded
        panels = hugepage_empty((n16, k, PANEL), np.float32)
        panels[...] = w.reshape(n16, PANEL, k).transpose(0, 2, 1)
        data = panels.ravel()
    data.flags.writeable = False
    # bf16: exponent bits all ones = inf or NaN
    finite = bool(np.isfinite(w).all()) if w.dtype != np.uint16 else not ((w & 0x7F80) == 0x7F80).any()
    return PackedWeight((n, k), w.dtype, data, finite)


def prepare_weight(weight: Array, *, backend: str = "auto") -> PackedWeight | Array:
    """``weight`` in the layout ``linear`` runs fastest on here.

    A ``PackedWeight`` where the Cython kernels run (every compiled path, FMA, AMX or vdpbf16ps tiles,
    has a packed form at least as fast as its row-major one, whatever the precision), else ``weight``
    unchanged (Numba and torch read the row-major layout). For callers that keep a weight for many
    calls (a model's layers); see ``PackedWeight``.

    Parameters
    ----------
    weight : ndarray, torch.Tensor, PackedWeight or QuantizedRows, shape (N, K)
        float32 or bf16 (torch.bfloat16 / numpy uint16 bit patterns). A ``PackedWeight`` is returned as
        it is; GGUF blocks (``dflash_kernels.quant.QuantizedRows``) are packed as they are
        (``pack_quantized``) where Cython runs, else expanded to their exact float32 values.
    backend : {"auto", "cython", "numba", "torch"}, default "auto"
        The backend ``linear`` will run on; "auto" takes the first available (``available_backends()``).

    Returns
    -------
    PackedWeight or ndarray or torch.Tensor
        ``pack_weight(weight)`` when backend resolves to Cython and weight is not empty, else weight
        itself.

    Raises
    ------
    ValueError
        If weight is not 2-D, or backend is invalid.
    TypeError
        If weight is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> w = np.ones((4, 3), np.float32)
    >>> dk.prepare_weight(w, backend="torch") is w  # torch reads the row-major layout
    True
    >>> prepared = dk.prepare_weight(w)  # a PackedWeight where the Cython kernels run
    >>> np.allclose(dk.linear(np.ones((2, 3), np.float32), prepared), 3.0)
    True
    """
    if isinstance(weight, PackedWeight):
        return weight
    from .quant import QuantizedRows, pack_quantized  # (quant builds on this module)

    if isinstance(weight, QuantizedRows):  # GGUF blocks: run as they are where Cython runs
        cython = resolve(backend, "dense")[0] == "cython"
        int8 = weight.activations == "int8"  # computed as such on every backend
        return pack_quantized(weight) if (cython or int8) and weight.blocks.size else weight.dequantize()
    w = float_array(weight, "weight", ndim=2)
    if resolve(backend, "dense")[0] != "cython" or not w.size:
        return weight
    return pack_weight(w)


@shared_doc
def linear(x: Array, weight: Array, bias: Array | None = None, *, precision: str | None = None,
           n_threads: int | None = None, backend: str = "auto") -> Array:
    """Linear layer ``x @ weight.T + bias`` with fp32 or bf16 weights, computed in float32.

    Parameters
    ----------
    x : ndarray or torch.Tensor, shape (..., K)
        float32 (bf16 accepted and upcast; small), at least 1-D.
    weight : ndarray, torch.Tensor or PackedWeight, shape (N, K)
        float32 or bf16, read in place (bf16 is upcast inside the kernel, never as a whole matrix;
        read-only / memory-mapped weights are fine), or a ``PackedWeight`` (``prepare_weight``: the FMA
        tiers' fast layout).
    bias : ndarray or torch.Tensor, shape (N,), optional
        float32 or bf16; None (default) = no bias.
    precision : {"highest", "high", "medium"}, optional
        "highest" (exact fp32 activations), "high" or "medium" (activations rounded to two or one bf16
        parts, see ``set_matmul_precision``); None = the process default.
    {n_threads}
    backend : {"auto", "cython", "numba", "torch"}, default "auto"
        Implementation to run; "auto" takes the first available (``available_backends()``), and runs
        shapes that ``tune_linear`` measured faster in torch here in torch.

    Returns
    -------
    ndarray or torch.Tensor, shape (..., N)
        float32; a torch tensor if x is one. NaN / inf in the inputs propagate as in IEEE arithmetic.

    Raises
    ------
    ValueError
        If x is 0-d, weight is not 2-D, x and weight disagree on K, bias is not of shape (N,), or
        precision, n_threads or backend is invalid.
    TypeError
        If x, weight or bias is not a float32 / bf16 array or tensor.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 3), dtype=np.float32)
    >>> w = rng.standard_normal((4, 3), dtype=np.float32)
    >>> b = np.arange(4, dtype=np.float32)
    >>> y = dk.linear(x, w, b)
    >>> y.shape, y.dtype
    ((2, 5, 4), dtype('float32'))
    >>> np.allclose(y, x @ w.T + b, atol=1e-5)
    True

    A bf16 weight as numpy uint16 bit patterns (0x3FC0 is 1.5):

    >>> w16 = np.full((4, 3), 0x3FC0, np.uint16)
    >>> np.allclose(dk.linear(x, w16), 1.5 * x.sum(-1, keepdims=True), atol=1e-5)
    True
    """
    done = FAST.linear(x, weight, bias, precision, n_threads, backend)
    if done is not None:
        return done
    parts = precision_parts(precision)
    if getattr(x, "ndim", 1) < 1:
        raise ValueError(f"x must have at least 1 dimension (..., K), got shape {tuple(x.shape)}")
    xa = f32_array(x, "x")
    packed = weight if isinstance(weight, PackedWeight) else None
    w = packed if packed is not None else float_array(weight, "weight", ndim=2)
    n, k = w.shape
    if xa.shape[-1] != k:
        raise ValueError(f"x and weight disagree on K: x has shape {xa.shape} (K={xa.shape[-1]}), "
                         f"weight has shape {w.shape} (N, K={k})")
    b = None
    if bias is not None:
        b = f32_array(bias, "bias", ndim=1)
        if b.shape != (n,):
            raise ValueError(f"bias must have shape ({n},) to match weight {w.shape}, got {b.shape}")
    lead = xa.shape[:-1]
    flat = len(lead) == 1  # x is (M, K) already: no reshapes
    x2 = xa if flat else xa.reshape(math.prod(lead), k)  # (M, K)
    out = np.empty((x2.shape[0], n), np.float32)  # (M, N)
    if out.size and k == 0:  # an empty sum: only the bias is left
        out[...] = 0.0 if b is None else b
    elif out.size:
        nt = resolve_threads(n_threads)  # once: it reads the environment
        if packed is not None:
            name, mod = resolve(backend, "dense")
            if name == "cython":
                mod.linear_packed(x2, packed.data, b, out, n_threads=nt, parts=parts, weights_finite=packed.finite,
                                  quant=packed.quant)
            elif packed.quant in (Q4_INT8, Q8_INT8):  # the kernels' int8 arithmetic, bit for bit
                from .quant import linear_int8_reference

                out[...] = linear_int8_reference(x2, packed, b)
            else:  # the other backends read the row-major layout
                run("dense", "linear", (x2, packed.unpack(), b), out, backend=name, n_threads=nt, parts=parts)
        elif backend in ("auto", None) and delegates(x2.shape[0], n, k, w.dtype == np.uint16, parts, nt) \
                and resolve("auto", "dense")[0] == "cython":  # delegates first: it returns at once without a table
            torch_linear(x2, w, b, parts, out, nt)  # measured faster here
        else:
            run("dense", "linear", (x2, w, b), out, backend=backend, n_threads=nt, parts=parts)
    return wrap(out if flat else out.reshape(*lead, n), is_torch(x))


def _eps(eps) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a real number, got {eps!r}") from None
    if not (e >= 0.0 and math.isfinite(e)):  # also rejects NaN
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return e


def _offset(offset) -> float:
    if not is_real(offset):
        raise TypeError(f"offset must be a real number (0.0 for Qwen3, 1.0 for Qwen3.5), got {offset!r}")
    if not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    return float(offset)


@shared_doc
def rms_norm(x: Array, w: Array, eps: float = 1e-6, *, offset: float = 0.0, residual: Array | None = None,
             n_threads: int | None = None, backend: str = "auto") -> Array | tuple[Array, Array]:
    """RMSNorm over the last axis: ``x * rsqrt(mean(x^2) + eps) * (offset + w)``, in float32.

    Parameters
    ----------
    x : ndarray or torch.Tensor, shape (..., H)
        float32 or bf16, any rank >= 1, H >= 1.
    w : ndarray or torch.Tensor, shape (H,)
        float32 or bf16.
    eps : float, default 1e-6
        Finite and >= 0. A row of zeros with eps = 0 gives NaN (0 * inf), as the formula does.
    offset : float, default 0.0
        0.0 for Qwen3's RMSNorm, 1.0 for the zero-centred norms of Qwen3.5 (weight stored as w - 1).
    residual : ndarray or torch.Tensor, shape (..., H), optional
        Like x; then the pre-norm residual add is fused in (see Returns). None (default): no residual.
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, or a pair of them, shape (..., H)
        The normed array, float32; with residual, ``(rms_norm(x + residual), x + residual)``, both
        float32. Torch tensors if x is one.

    Raises
    ------
    ValueError
        If x is 0-d or H == 0, w is not of shape (H,), residual is not of x's shape, eps is negative or
        not finite, offset is not finite, or n_threads / backend is invalid.
    TypeError
        If x, w or residual is not a float32 / bf16 array or tensor, eps is not a real number, or offset
        is not a real number.

    Examples
    --------
    >>> x = np.array([[3.0, 4.0]], np.float32)  # mean(x^2) = 12.5
    >>> w = np.array([1.0, 2.0], np.float32)
    >>> np.allclose(dk.rms_norm(x, w, eps=0.0), x / np.sqrt(12.5) * w)
    True
    >>> np.allclose(dk.rms_norm(x, w - 1, eps=0.0, offset=1.0), x / np.sqrt(12.5) * w)  # Qwen3.5 storage
    True
    >>> normed, res = dk.rms_norm(x, w, residual=np.ones_like(x))
    >>> res
    array([[4., 5.]], dtype=float32)
    """
    done = FAST.rms_norm(x, w, eps, offset, residual, n_threads, backend)
    if done is not None:
        return done
    xa = f32_array(x, "x")
    if getattr(x, "ndim", 1) < 1 or xa.shape[-1] == 0:
        raise ValueError(f"x must have shape (..., H) with H >= 1, got {xa.shape}")
    h = xa.shape[-1]
    wa = f32_array(w, "w", ndim=1)
    if wa.shape != (h,):
        raise ValueError(f"w must have shape ({h},) to match x {xa.shape}, got {wa.shape}")
    eps, offset = _eps(eps), _offset(offset)
    flat = xa.ndim == 2  # x is (M, H) already: no reshapes
    x2 = xa if flat else xa.reshape(-1, h)  # (M, H)
    out = np.empty(x2.shape, np.float32)
    torch_out = is_torch(x)
    if residual is None:
        if out.size:
            run("dense", "rms_norm", (x2, wa), out, backend=backend, n_threads=n_threads, eps=eps, offset=offset)
        return wrap(out if flat else out.reshape(xa.shape), torch_out)
    ra = f32_array(residual, "residual")
    if ra.shape != xa.shape:
        raise ValueError(f"residual must have the shape of x {xa.shape}, got {ra.shape}")
    new_res = np.empty(x2.shape, np.float32)
    if out.size:
        run("dense", "rms_norm_residual", (x2, ra.reshape(-1, h), wa), (out, new_res), backend=backend,
            n_threads=n_threads, eps=eps, offset=offset)
    return wrap(out.reshape(xa.shape), torch_out), wrap(new_res.reshape(xa.shape), torch_out)


def rope_inv_freq(theta: float, rotary_dim: int, scaling: dict | None = None) -> np.ndarray:
    """RoPE frequencies of a Hugging Face config: ``theta ** (-2j / rotary_dim)``, j < rotary_dim / 2.

    The frequencies are rescaled by ``rope_scaling`` (a config's dict): "linear" divides every
    frequency by ``factor``; "llama3" divides the low frequencies (wavelength above
    original_max_position_embeddings / low_freq_factor) by ``factor``, keeps the high ones (below
    .../ high_freq_factor) and blends linearly in between (Llama 3.1's rule). None or "default": no
    scaling.

    Parameters
    ----------
    theta : float
        The RoPE base (``rope_theta``).
    rotary_dim : int
        Even, >= 2: the dims rotated.
    scaling : dict, optional
        The config's ``rope_scaling``: its "rope_type" (or "type"), "factor" (finite, >= 1; default 1.0)
        and, for "llama3", "low_freq_factor" (default 1.0), "high_freq_factor" (default 4.0) and
        "original_max_position_embeddings" (default 8192). None (default) or empty: no scaling.

    Returns
    -------
    ndarray, shape (rotary_dim / 2,)
        float64 frequencies (``apply_rope``'s ``inv_freq``).

    Raises
    ------
    ValueError
        If rotary_dim is not an even int >= 2, factor is not a finite number >= 1, a "llama3" scaling
        does not have 0 < low_freq_factor < high_freq_factor (and original_max_position_embeddings > 0),
        or the scaling type is not default, linear or llama3.

    Examples
    --------
    >>> dk.rope_inv_freq(10000.0, 4)
    array([1.  , 0.01])
    >>> dk.rope_inv_freq(10000.0, 4, {"rope_type": "linear", "factor": 2.0})
    array([0.5  , 0.005])
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) \
            or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even int >= 2, got {rotary_dim!r}")
    freq = float(theta) ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return freq
    factor = float(scaling.get("factor", 1.0))
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"rope_scaling factor must be a finite number >= 1, got {scaling.get('factor')!r}")
    if kind == "linear":
        return freq / factor
    if kind == "llama3":
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        if not (0 < low < high and old > 0):
            raise ValueError(f"llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {scaling!r}")
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * freq / factor + smooth * freq
        return np.where(wavelen > old / low, freq / factor, np.where(wavelen < old / high, freq, blended))
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


@shared_doc
def apply_rope(x: Array, positions: Array, theta: float, rotary_dim: int | None = None, *,
               inv_freq: Array | None = None, out: Array | None = None, n_threads: int | None = None,
               backend: str = "auto") -> Array:
    """Rotary position embedding, NeoX rotate-half style, over the first ``rotary_dim`` dims.

    ``inv_freq[j] = theta ** (-2j / rotary_dim)``, j < rotary_dim/2, and the angles ``pos * inv_freq``
    are formed in float64 (exact enough for positions ~2.6e5, theta 1e7). Dims past rotary_dim are
    copied unchanged.

    Parameters
    ----------
    x : ndarray or torch.Tensor, shape (T, H, D)
        float32 (bf16 accepted, upcast).
    positions : ndarray, torch.Tensor or sequence of int, shape (T,)
        Non-negative integer positions of the T rows.
    theta : float
        RoPE base, finite and > 0.
    rotary_dim : int, optional
        Even, 2 <= rotary_dim <= D; None (default) = D. Qwen3.5 partial rotary: rotary_dim = D / 4.
    inv_freq : ndarray or torch.Tensor, shape (rotary_dim / 2,), optional
        Finite positive frequencies used instead of theta's (scaled RoPE: Llama 3's "llama3" or
        "linear" rope_scaling; see ``rope_inv_freq``). None (default): theta's.
    out : ndarray or torch.Tensor, shape (T, H, D), optional
        float32 C-contiguous writeable array / tensor to write into; ``out=x`` rotates x in place (the
        model layer uses that for q and k). Partially overlapping buffers are not supported.
    {run_options}

    Returns
    -------
    ndarray or torch.Tensor, shape (T, H, D)
        float32: ``out`` when given, else a new array (a torch tensor if x is one).

    Raises
    ------
    ValueError
        If x is not 3-D, positions is not of shape (T,) or holds a negative value, theta is not finite
        and > 0, rotary_dim is odd or outside [2, D], inv_freq is not rotary_dim / 2 finite positive
        numbers, out is not a writeable C-contiguous array of x's shape, or n_threads / backend is
        invalid.
    TypeError
        If x is not a float32 / bf16 array or tensor, positions does not hold integers, theta is not a
        real number, rotary_dim is not an int, or out is not float32.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 1, 4), dtype=np.float32)
    >>> y = dk.apply_rope(x, np.array([0, 1]), 10000.0)
    >>> y.shape, y.dtype
    ((2, 1, 4), dtype('float32'))
    >>> np.allclose(y[0], x[0])  # position 0: no rotation
    True

    At position 1, dims 0 and 2 (rotate-half pairs, inv_freq[0] = 1) turn by 1 radian:

    >>> c, s = np.cos(1.0), np.sin(1.0)
    >>> np.allclose(y[1, 0, [0, 2]], [x[1, 0, 0] * c - x[1, 0, 2] * s, x[1, 0, 2] * c + x[1, 0, 0] * s])
    True
    >>> _ = dk.apply_rope(x, np.array([0, 1]), 10000.0, out=x)  # in place
    >>> np.allclose(x, y)
    True
    """
    done = FAST.apply_rope(x, positions, theta, rotary_dim, inv_freq, out, n_threads, backend)
    if done is not None:
        return done
    xa = f32_array(x, "x", ndim=3)
    t, _, d = xa.shape
    pos = index_array(positions, "positions", ndim=1)
    if pos.shape != (t,):
        raise ValueError(f"positions must have shape ({t},) to match x {xa.shape}, got {pos.shape}")
    if not is_real(theta):
        raise TypeError(f"theta must be a real number, got {theta!r}")
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"theta must be finite and > 0, got {theta!r}")
    rd = d if rotary_dim is None else rotary_dim
    if isinstance(rd, bool) or not isinstance(rd, (int, np.integer)):
        raise TypeError(f"rotary_dim must be an int, got {rotary_dim!r}")
    if rd < 2 or rd % 2 or rd > d:
        raise ValueError(f"rotary_dim must be even with 2 <= rotary_dim <= D={d}, got {rd}")
    freq = None
    if inv_freq is not None:
        # (a torch tensor as float64 first: a bf16 one's view is its bit patterns)
        freq = np.ascontiguousarray(_tensor_view(inv_freq.double(), "inv_freq") if is_torch(inv_freq) else inv_freq,
                                    np.float64)
        if freq.shape != (rd // 2,) or not np.all(np.isfinite(freq)) or not np.all(freq > 0):
            raise ValueError(f"inv_freq must hold rotary_dim / 2 = {rd // 2} finite positive numbers, "
                             f"got shape {freq.shape}")
    if out is None:
        dst = np.empty(xa.shape, np.float32)
        result = None
    else:
        if dtype_name(out) != "float32":
            raise TypeError(f"out must be float32, got {dtype_name(out)}")
        dst = _tensor_view(out, "out") if is_torch(out) else out
        if not isinstance(dst, np.ndarray) or dst.shape != xa.shape or not dst.flags.c_contiguous \
                or not dst.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {xa.shape}")
        result = out
    if dst.size:
        run("dense", "apply_rope", (xa, pos), dst, backend=backend, n_threads=n_threads,
            theta=float(theta), rotary_dim=int(rd), inv_freq=freq)
    return result if result is not None else wrap(dst, is_torch(x))
