"""Dense ops around attention: linear layers with bf16 weights, RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import math
import warnings

import numpy as np

from ._autotune import delegates, torch_linear
from ._backends import resolve
from ._dispatch import run
from ._precision import parts as precision_parts
from ._tensors import Array, dtype_name, f32_array, float_array, hugepage_empty, index_array, is_torch, wrap
from ._threads import resolve_threads


def silu_and_mul(gate_up: Array, *, n_threads: int | None = None, backend: str = "auto") -> Array:
    """SwiGLU activation: ``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last axis.

    gate_up: (M, 2*I) float32 or bf16. Returns (M, I) float32.
    """
    x = f32_array(gate_up, "gate_up", ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"gate_up must have an even last dimension [gate | up], got shape {x.shape}")
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    run("dense", "silu_and_mul", (x,), out, backend=backend, n_threads=n_threads)
    return wrap(out, is_torch(gate_up))


PANEL = 16  # output columns per panel of a packed weight (pyx/dk_packed.h)


class PackedWeight:
    """A linear layer's weight (N, K), packed once into the layout of the "fma-packed" path.

    The FMA tiers run 16-row blocks (verification, drafting, prefill) at 35-50% of their peak from
    a row-major weight, and at 65-80% from this layout (pyx/dk_packed.h): panels of 16 output
    columns, k-major, bf16 k-pairs in one 32-bit word (AMX's B-tile layout, which the AMX tier
    loads as it is). M = 1 streams it at the speed of a plain read. It costs one copy of the
    weight, made here; ``linear`` then reads it in place. Build it with ``pack_weight`` or
    ``prepare_weight``.

    Attributes: ``shape`` (N, K); ``dtype`` of the source (float32, or uint16 bf16 bit patterns);
    ``data``, the packed values (1-D, read-only); ``nbytes``; ``finite``, whether every weight is
    finite (infinite weights keep linear on the FMA tiles: IEEE x * inf, see ``linear_packed``).
    """

    __slots__ = ("shape", "dtype", "data", "finite")

    def __init__(self, shape, dtype, data, finite=True):
        self.shape, self.dtype, self.data, self.finite = shape, dtype, data, finite

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def unpack(self) -> np.ndarray:
        """The weight (N, K) as it was given (exact: packing only moves values)."""
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
        dt = "bfloat16" if self.dtype == np.uint16 else "float32"
        return f"PackedWeight(shape={self.shape}, dtype={dt})"

    def to_tensor(self):
        """``data`` as a 1-D torch tensor sharing its memory (torch.bfloat16 for bf16 weights, else
        float32): the form ``torch.ops.dflash.linear_packed`` takes, with ``shape`` and ``finite``."""
        import torch

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
    """Pack a linear weight (N, K), float32 or bf16 (torch.bfloat16 / numpy uint16 bit patterns), for
    ``linear``'s "fma-packed" path. Makes one copy; the source is not kept."""
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
    """``weight`` in the layout ``linear`` runs fastest on here: a ``PackedWeight`` where the Cython
    kernels run (every compiled path, FMA, AMX or vdpbf16ps tiles, has a packed form at least as
    fast as its row-major one, whatever the precision), else ``weight`` unchanged (Numba and torch
    read the row-major layout). For callers that keep a weight for many calls (a model's layers);
    see ``PackedWeight``."""
    if isinstance(weight, PackedWeight):
        return weight
    w = float_array(weight, "weight", ndim=2)
    if resolve(backend, "dense")[0] != "cython" or not w.size:
        return weight
    return pack_weight(w)


def linear(x: Array, weight: Array, bias: Array | None = None, *, precision: str | None = None,
           n_threads: int | None = None, backend: str = "auto") -> Array:
    """Linear layer ``x @ weight.T + bias`` with fp32 or bf16 weights, computed in float32.

    x: (..., K) float32 (bf16 accepted and upcast; small). weight: (N, K) float32 or bf16, read in
    place (bf16 is upcast inside the kernel, never as a whole matrix; read-only / memory-mapped
    weights are fine), or a ``PackedWeight`` (``prepare_weight``: the FMA tiers' fast layout).
    bias: (N,) float32 or bf16, optional. Returns (..., N) float32.
    precision: "highest" (exact fp32 activations), "high" or "medium" (activations rounded to two
    or one bf16 parts, see ``set_matmul_precision``); None = the process default.
    With backend="auto", shapes that ``tune_linear`` measured faster in torch here run in torch.
    NaN / inf in the inputs propagate as in IEEE arithmetic.
    """
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
    x2 = xa.reshape(math.prod(lead), k)  # (M, K)
    out = np.empty((x2.shape[0], n), np.float32)  # (M, N)
    if out.size and k == 0:  # an empty sum: only the bias is left
        out[...] = 0.0 if b is None else b
    elif out.size:
        nt = resolve_threads(n_threads)  # once: it reads the environment
        if packed is not None:
            name, mod = resolve(backend, "dense")
            if name == "cython":
                mod.linear_packed(x2, packed.data, b, out, n_threads=nt, parts=parts, weights_finite=packed.finite)
            else:  # the other backends read the row-major layout
                run("dense", "linear", (x2, packed.unpack(), b), out, backend=name, n_threads=nt, parts=parts)
        elif backend in ("auto", None) and resolve("auto", "dense")[0] == "cython" \
                and delegates(x2.shape[0], n, k, w.dtype == np.uint16, parts, nt):
            torch_linear(x2, w, b, parts, out, nt)  # measured faster here
        else:
            run("dense", "linear", (x2, w, b), out, backend=backend, n_threads=nt, parts=parts)
    return wrap(out.reshape(*lead, n), is_torch(x))


def _eps(eps) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a real number, got {eps!r}") from None
    if not (e >= 0.0 and math.isfinite(e)):  # also rejects NaN
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return e


def _offset(offset) -> float:
    if isinstance(offset, (bool, str)) or not isinstance(offset, (int, float, np.integer, np.floating)):
        raise TypeError(f"offset must be a real number (0.0 for Qwen3, 1.0 for Qwen3.5), got {offset!r}")
    if not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    return float(offset)


def rms_norm(x: Array, w: Array, eps: float = 1e-6, *, offset: float = 0.0, residual: Array | None = None,
             n_threads: int | None = None, backend: str = "auto") -> Array | tuple[Array, Array]:
    """RMSNorm over the last axis: ``x * rsqrt(mean(x^2) + eps) * (offset + w)``, in float32.

    x: (..., H) float32 or bf16 (any rank >= 1). w: (H,) float32 or bf16. offset: 0.0 for Qwen3's
    RMSNorm, 1.0 for the zero-centred norms of Qwen3.5 (weight stored as w - 1).
    residual: optional (..., H) like x; then the pre-norm residual add is fused in and the result is
    ``(rms_norm(x + residual), x + residual)``, both float32. Otherwise returns the normed array.
    A row of zeros with eps = 0 gives NaN (0 * inf), as the formula does.
    """
    xa = f32_array(x, "x")
    if getattr(x, "ndim", 1) < 1 or xa.shape[-1] == 0:
        raise ValueError(f"x must have shape (..., H) with H >= 1, got {xa.shape}")
    h = xa.shape[-1]
    wa = f32_array(w, "w", ndim=1)
    if wa.shape != (h,):
        raise ValueError(f"w must have shape ({h},) to match x {xa.shape}, got {wa.shape}")
    params = dict(eps=_eps(eps), offset=_offset(offset))
    x2 = xa.reshape(-1, h)  # (M, H)
    out = np.empty(x2.shape, np.float32)
    torch_out = is_torch(x)
    if residual is None:
        if out.size:
            run("dense", "rms_norm", (x2, wa), out, backend=backend, n_threads=n_threads, **params)
        return wrap(out.reshape(xa.shape), torch_out)
    ra = f32_array(residual, "residual")
    if ra.shape != xa.shape:
        raise ValueError(f"residual must have the shape of x {xa.shape}, got {ra.shape}")
    new_res = np.empty(x2.shape, np.float32)
    if out.size:
        run("dense", "rms_norm_residual", (x2, ra.reshape(-1, h), wa), (out, new_res), backend=backend,
            n_threads=n_threads, **params)
    return wrap(out.reshape(xa.shape), torch_out), wrap(new_res.reshape(xa.shape), torch_out)


def rope_inv_freq(theta: float, rotary_dim: int, scaling: dict | None = None) -> np.ndarray:
    """RoPE frequencies (rotary_dim / 2,) float64 of a Hugging Face config: ``theta ** (-2j / rotary_dim)``,
    rescaled by ``rope_scaling`` (a config's dict): "linear" divides every frequency by ``factor``;
    "llama3" divides the low frequencies (wavelength above original_max_position_embeddings /
    low_freq_factor) by ``factor``, keeps the high ones (below .../ high_freq_factor) and blends
    linearly in between (Llama 3.1's rule). None or "default": no scaling."""
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


def apply_rope(x: Array, positions: Array, theta: float, rotary_dim: int | None = None, *,
               inv_freq: Array | None = None, out: Array | None = None, n_threads: int | None = None,
               backend: str = "auto") -> Array:
    """Rotary position embedding, NeoX rotate-half style, over the first ``rotary_dim`` dims.

    x: (T, H, D) float32 (bf16 accepted, upcast). positions: (T,) non-negative integers.
    theta: base > 0; ``inv_freq[j] = theta ** (-2j / rotary_dim)``, j < rotary_dim/2, and the angles
    ``pos * inv_freq`` are formed in float64 (exact enough for positions ~2.6e5, theta 1e7).
    rotary_dim: even, 2 <= rotary_dim <= D (default D); dims past it are copied unchanged
    (Qwen3.5 partial rotary: rotary_dim = D / 4).
    inv_freq: optional (rotary_dim / 2,) finite positive frequencies used instead of theta's (scaled
    RoPE: Llama 3's "llama3" or "linear" rope_scaling; see ``rope_inv_freq``).
    out: optional float32 C-contiguous (T, H, D) array / tensor to write into; ``out=x`` rotates x in
    place (the model layer uses that for q and k). Partially overlapping buffers are not supported.
    Returns (T, H, D) float32: ``out`` when given, else a new array.
    """
    xa = f32_array(x, "x", ndim=3)
    t, _, d = xa.shape
    pos = index_array(positions, "positions", ndim=1)
    if pos.shape != (t,):
        raise ValueError(f"positions must have shape ({t},) to match x {xa.shape}, got {pos.shape}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float, np.integer, np.floating)):
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
        freq = np.ascontiguousarray(inv_freq.detach().numpy() if is_torch(inv_freq) else inv_freq, np.float64)
        if freq.shape != (rd // 2,) or not np.all(np.isfinite(freq)) or not np.all(freq > 0):
            raise ValueError(f"inv_freq must hold rotary_dim / 2 = {rd // 2} finite positive numbers, "
                             f"got shape {freq.shape}")
    if out is None:
        dst = np.empty(xa.shape, np.float32)
        result = None
    else:
        if dtype_name(out) != "float32":
            raise TypeError(f"out must be float32, got {dtype_name(out)}")
        dst = out.detach().numpy() if is_torch(out) else out
        if not isinstance(dst, np.ndarray) or dst.shape != xa.shape or not dst.flags.c_contiguous \
                or not dst.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {xa.shape}")
        result = out
    if dst.size:
        run("dense", "apply_rope", (xa, pos), dst, backend=backend, n_threads=n_threads,
            theta=float(theta), rotary_dim=int(rd), inv_freq=freq)
    return result if result is not None else wrap(dst, is_torch(x))
