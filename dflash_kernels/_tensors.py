"""Input normalisation shared by every public op.

Kernels see numpy arrays only: float32 stays float32, bfloat16 (``torch.bfloat16`` or numpy
``uint16`` bit patterns) becomes a zero-copy ``uint16`` view. Results go back to the caller's
framework: torch in, torch out (``torch.from_numpy``, zero-copy); numpy in, numpy out.
"""

from __future__ import annotations

import math
import mmap
import numbers

import numpy as np
import torch

# What every public op takes and returns: a numpy array or a torch CPU tensor (bf16 as numpy uint16 or
# torch.bfloat16); the result is in the framework of the inputs.
Array = np.ndarray | torch.Tensor
Generator = int | np.random.Generator | torch.Generator | None

F32 = "float32"
BF16 = "bfloat16"
FLOAT_DTYPES = (F32, BF16)
_NUMPY_KINDS = {np.dtype(np.float32): F32, np.dtype(np.uint16): BF16}
_TORCH_KINDS = {torch.float32: F32, torch.bfloat16: BF16}
_F32 = np.dtype(np.float32)
_U16 = np.dtype(np.uint16)
_I64 = np.dtype(np.int64)

# Arrays up to this many elements are range-checked in Python (tolist, then min / max or a loop): on
# small arrays numpy's reductions cost ~2 us each per call on Zen 2, more than the rest of the API
# layer; Python's cost grows with the size and reaches theirs at ~35 floats, ~80 ints.
SMALL = 32


HUGE_PAGE = 2 << 20


def hugepage_empty(shape, dtype) -> np.ndarray:
    """``np.empty`` on memory backed by transparent huge pages where Linux allows: a private
    anonymous mapping, advised MADV_HUGEPAGE, the array 2 MiB aligned in it (freed with the array).

    For weights that are streamed once per token: a decode step reads gigabytes, and on 4 KiB pages
    the TLB misses cost bandwidth. numpy advises huge pages for its own large allocations, but under
    another malloc (vLLM preloads tcmalloc) a packed weight got 216 of 1,229 MB on huge pages and
    streamed at 25 GB/s instead of 28 (docs/benchmarks.md, session 7). Arrays under 2 MiB, and
    systems without MADV_HUGEPAGE, get ``np.empty``."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are faulted in huge
    raw = np.frombuffer(m, np.uint8)  # keeps the mapping alive as long as the array
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_torch(x) -> bool:
    # numpy arrays first: isinstance(an ndarray, torch.Tensor) goes through torch's metaclass
    return type(x) is not np.ndarray and isinstance(x, torch.Tensor)


def dtype_name(x) -> str:
    """'float32', 'bfloat16' (torch bf16 or numpy uint16), or the raw dtype name."""
    if is_torch(x):
        return _TORCH_KINDS.get(x.dtype) or str(x.dtype).replace("torch.", "")
    dt = x.dtype if isinstance(x, np.ndarray) else np.asarray(x).dtype
    return _NUMPY_KINDS.get(dt) or dt.name  # dict lookup: dtype.name is slow in a per-call path


def _numpy_view(x, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, torch.Tensor):
        return _tensor_view(x, name)
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _tensor_view(x: torch.Tensor, name: str) -> np.ndarray:
    # each property of a tensor costs a call into torch: the fewest that tell (not x.device.type)
    if not x.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
    # (numpy() would throw from C++ on these, naming nothing; a copy would lose an in-place update)
    if x.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.is_neg():
        raise ValueError(f"{name} is a negative view (torch._neg_view); pass {name}.resolve_neg()")
    if x.requires_grad:  # detach() only when numpy() would refuse the tensor
        x = x.detach()
    if x.dtype is torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def float_array(x, name: str, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> np.ndarray:
    """Validate a float operand and return its C-contiguous numpy form (float32 or uint16 = bf16).

    Strided inputs are copied once; read-only inputs (memory-mapped weights) are used as they are.
    """
    # This runs for every operand of every call. First what the kernels take as it is: a plain
    # C-contiguous numpy array of an accepted dtype (0-d and subclasses such as np.matrix take the
    # np.ascontiguousarray below, which makes them 1-d / plain arrays).
    if type(x) is np.ndarray and x.ndim and (ndim is None or x.ndim == ndim) and x.flags.c_contiguous \
            and _NUMPY_KINDS.get(x.dtype) in dtypes:
        return x
    # then numpy arrays and torch tensors of an accepted dtype, by one dict lookup; anything else
    # takes the general path and its errors
    if isinstance(x, np.ndarray) and _NUMPY_KINDS.get(x.dtype) in dtypes:
        arr = x
    elif isinstance(x, torch.Tensor) and _TORCH_KINDS.get(x.dtype) in dtypes:
        arr = _tensor_view(x, name)
    else:
        kind = dtype_name(x)
        if kind not in dtypes:
            allowed = " or ".join(dtypes)
            raise TypeError(f"{name} must have dtype {allowed} (bf16 as torch.bfloat16 or numpy uint16), got {kind}")
        arr = _numpy_view(x, name)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(arr.shape)}")
    return np.ascontiguousarray(arr)


def f32_array(x, name: str, ndim: int | None = None) -> np.ndarray:
    """Like float_array but upcasts bf16 to a float32 copy (for small activations)."""
    if type(x) is np.ndarray and x.dtype is _F32 and x.ndim and (ndim is None or x.ndim == ndim) \
            and x.flags.c_contiguous:  # float_array's first case, for float32, one call less per operand
        return x
    arr = float_array(x, name, ndim)
    return bf16_to_f32(arr) if arr.dtype == _U16 else arr


def index_array(x, name: str, ndim: int | None = None, high: int | None = None, low: int | None = 0) -> np.ndarray:
    """Validate integer token ids / counts, in [low, high) (None: unbounded); return a C-contiguous
    int64 array."""
    if type(x) is np.ndarray and x.dtype is _I64 and x.ndim and x.flags.c_contiguous:
        arr = x  # what the kernels take as it is (as in float_array)
    else:
        if isinstance(x, (np.ndarray, torch.Tensor)):
            arr = _numpy_view(x, name)
        elif isinstance(x, (list, tuple, int, np.integer)):
            arr = np.asarray(x)
        else:
            raise TypeError(f"{name} must be an integer torch.Tensor, numpy.ndarray or sequence, "
                            f"got {type(x).__name__}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr, dtype=_I64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(arr.shape)}")
    if arr.size and (low is not None or high is not None):
        lo, hi = int_bounds(arr)
        if (low is not None and lo < low) or (high is not None and hi >= high):
            bound = f">= {low}" if high is None else f"< {high}" if low is None else f"[{low}, {high})"
            raise ValueError(f"{name} values must lie in {bound}, got min {lo} max {hi}")
    return arr


def is_int(x) -> bool:
    """An integer argument (Python or numpy), not a bool. int first: isinstance against the numbers
    ABCs is the slow part of the check, and most callers pass a plain int."""
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Integral))


def is_real(x) -> bool:
    """A real-number argument (Python or numpy int / float), not a bool; float and int first."""
    return type(x) is float or type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Real))


def int_bounds(arr: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty integer array (see SMALL)."""
    if arr.size <= SMALL:
        vals = arr.ravel().tolist()
        return min(vals), max(vals)
    return int(arr.min()), int(arr.max())


def in_unit_interval(arr: np.ndarray) -> bool:
    """Whether every value of a float array lies in [0, 1) (NaN does not; see SMALL)."""
    if arr.size <= SMALL:
        return all(0.0 <= v < 1.0 for v in arr.ravel().tolist())
    return bool(arr.min() >= 0.0 and arr.max() < 1.0)  # numpy's min / max propagate NaN


def first_nonzero(arr: np.ndarray) -> int:
    """Index of the first nonzero entry of a 1-D array (a kernel's status codes), -1 if none (see SMALL)."""
    if arr.size <= SMALL:
        vals = arr.tolist()
        return next((i for i, v in enumerate(vals) if v), -1) if any(vals) else -1
    nonzero = np.flatnonzero(arr)
    return int(nonzero[0]) if nonzero.size else -1


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (numpy uint16, the ops' bf16 storage) to float32, exactly.

    Parameters
    ----------
    u16 : ndarray of uint16, any shape
        bf16 values as their bit patterns.

    Returns
    -------
    ndarray of float32, the same shape

    Examples
    --------
    >>> dk.bf16_to_f32(np.array([0x3F80, 0xC040], np.uint16))
    array([ 1., -3.], dtype=float32)
    """
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """float32 to bf16 bit patterns (numpy uint16, the ops' bf16 storage), rounded to nearest even as
    torch rounds; NaN stays NaN.

    Parameters
    ----------
    f32 : array_like of float32, any shape

    Returns
    -------
    ndarray of uint16, the same shape

    Examples
    --------
    >>> bits = dk.f32_to_bf16(np.array([1.0, 1.00390625, np.nan], np.float32))  # 1 + 2**-8 is a tie
    >>> [hex(b) for b in bits]
    ['0x3f80', '0x3f80', '0x7fc0']
    >>> dk.bf16_to_f32(bits)[:2]
    array([1., 1.], dtype=float32)
    """
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """numpy -> torch, zero-copy; uint16 is read as bf16 bit patterns."""
    if not arr.flags.writeable:  # torch warns on read-only buffers; a copy keeps callers' data safe
        arr = arr.copy()
    if arr.dtype == _U16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def from_torch(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy, zero-copy; bf16 becomes uint16 bit patterns."""
    return _numpy_view(t, "tensor")


def wrap(out: np.ndarray, torch_out: bool):
    """Return a kernel result in the caller's framework."""
    return to_torch(out) if torch_out else out


def any_torch(*xs) -> bool:
    for x in xs:  # a loop, not any(generator): half the cost, per call
        if is_torch(x):
            return True
    return False
