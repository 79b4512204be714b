"""Input normalisation shared by every public op.

Kernels see numpy arrays only: float32 stays float32, bfloat16 (``torch.bfloat16`` or numpy
``uint16`` bit patterns) becomes a zero-copy ``uint16`` view. Results go back to the caller's
framework: torch in, torch out (``torch.from_numpy``, zero-copy); numpy in, numpy out.
"""

from __future__ import annotations

import math
import mmap

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
    return isinstance(x, torch.Tensor)


def dtype_name(x) -> str:
    """'float32', 'bfloat16' (torch bf16 or numpy uint16), or the raw dtype name."""
    if is_torch(x):
        return {torch.float32: F32, torch.bfloat16: BF16}.get(x.dtype, str(x.dtype).replace("torch.", ""))
    dt = x.dtype if isinstance(x, np.ndarray) else np.asarray(x).dtype
    return _NUMPY_KINDS.get(dt) or dt.name  # dict lookup: dtype.name is slow in a per-call path


def _numpy_view(x, name: str) -> np.ndarray:
    if is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16)
        return x.numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def float_array(x, name: str, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> np.ndarray:
    """Validate a float operand and return its C-contiguous numpy form (float32 or uint16 = bf16).

    Strided inputs are copied once; read-only inputs (memory-mapped weights) are used as they are.
    """
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
    arr = float_array(x, name, ndim)
    return bf16_to_f32(arr) if arr.dtype == np.uint16 else arr


def index_array(x, name: str, ndim: int | None = None, high: int | None = None, low: int = 0) -> np.ndarray:
    """Validate integer token ids / counts; return a C-contiguous int64 array."""
    if is_torch(x) or isinstance(x, np.ndarray):
        arr = _numpy_view(x, name)
    elif isinstance(x, (list, tuple, int, np.integer)):
        arr = np.asarray(x)
    else:
        raise TypeError(f"{name} must be an integer torch.Tensor, numpy.ndarray or sequence, got {type(x).__name__}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(arr.shape)}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < low or (high is not None and hi >= high):
            bound = f"[{low}, {high})" if high is not None else f">= {low}"
            raise ValueError(f"{name} values must lie in {bound}, got min {lo} max {hi}")
    return arr


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, round to nearest even (torch's rounding); NaN stays NaN."""
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
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def from_torch(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy, zero-copy; bf16 becomes uint16 bit patterns."""
    return _numpy_view(t, "tensor")


def wrap(out: np.ndarray, torch_out: bool):
    """Return a kernel result in the caller's framework."""
    return to_torch(out) if torch_out else out


def any_torch(*xs) -> bool:
    return any(is_torch(x) for x in xs)
