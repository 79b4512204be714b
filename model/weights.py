"""safetensors loading: memory-mapped, bf16 kept as bf16 (numpy uint16 bit patterns), checked.

The safetensors format (docs/models.md 1.5) is parsed here directly so that every tensor is a zero-copy,
read-only view of one ``numpy.memmap`` per file: a 16 GB bf16 checkpoint costs page cache, not a
float32 copy. Sharded checkpoints are read through ``*.safetensors.index.json`` (shard names come
from its weight_map, never guessed). Errors name the file and the tensor.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from dflash_kernels.quant import QuantizedRows

_DTYPES = {
    "BF16": np.uint16,  # bf16 bit patterns, what the dk kernels read directly
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class WeightsError(ValueError):
    """A checkpoint whose files or tensors do not match what the model needs."""


def read_safetensors(path, mmap: bool = True) -> dict[str, np.ndarray]:
    """Memory-map one .safetensors file (mmap=False: read it into memory, so that a file truncated or
    rewritten later cannot fault the process with SIGBUS); return {name: read-only array} (BF16 as uint16)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise WeightsError(f"{path}: truncated or corrupt safetensors file "
                                   f"(header of {n} bytes, file of {size})")
            raw = f.read(n)
    except FileNotFoundError:
        raise WeightsError(f"{path}: file not found") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    data_start = 8 + n
    data_size = size - data_start
    if size <= data_start:
        buf = np.zeros(0, np.uint8)
    elif mmap:
        # a plain ndarray view of the mapping: np.memmap's indexing and views run Python code
        # (__getitem__, __array_finalize__), which the decode step's embedding lookup paid every step
        buf = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    else:
        buf = np.fromfile(path, dtype=np.uint8)
        buf.flags.writeable = False
    out = {}
    for name, info in header.items():
        if isinstance(info, dict) and info.get("dtype") not in _DTYPES:
            raise WeightsError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise WeightsError(f"{path}: tensor {name!r} has data_offsets {begin}..{end} for {nbytes} bytes "
                               f"of {info['dtype']} {list(shape)}")
        if end > data_size:
            raise WeightsError(f"{path}: truncated file: tensor {name!r} ends at byte {end} "
                               f"of a {data_size}-byte buffer")
        arr = buf[data_start + begin : data_start + end].view(dtype).reshape(shape)
        if not arr.flags.aligned:  # odd packing: copy (rare, small tensors)
            arr = np.array(arr)
            arr.flags.writeable = False
        out[name] = arr
    return out


def read_checkpoint(model_dir, mmap: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a checkpoint directory and, per tensor, the file it came from (memory-mapped, or
    read into memory with mmap=False).

    Sharded: ``*.safetensors.index.json`` (its weight_map names the shards); else the one
    ``model.safetensors`` (or the only ``*.safetensors`` file).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise WeightsError(f"{model_dir}: not a directory")
    indexes = sorted(model_dir.glob("*.safetensors.index.json"))
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    if indexes:
        index_path = indexes[0]
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AssertionError, TypeError) as err:
            raise WeightsError(f"{index_path}: not a safetensors index with a weight_map ({err!r})") from None
        for shard in sorted(set(weight_map.values())):
            shard_path = model_dir / shard
            if not shard_path.exists():
                raise WeightsError(f"{index_path}: shard {shard!r} listed in weight_map is missing")
            for name, arr in read_safetensors(shard_path, mmap).items():
                if name in tensors:
                    raise WeightsError(f"{shard_path}: tensor {name!r} also appears in {origin[name]}")
                tensors[name], origin[name] = arr, str(shard_path)
        for name, shard in weight_map.items():
            if name not in tensors:
                raise WeightsError(f"{model_dir / shard}: tensor {name!r} listed in {index_path.name} "
                                   "is not in the file")
            if Path(origin[name]).name != shard:
                raise WeightsError(f"{index_path}: tensor {name!r} is mapped to {shard} but found in {origin[name]}")
        return tensors, origin
    files = sorted(model_dir.glob("*.safetensors"))
    single = model_dir / "model.safetensors"
    if single.exists():
        files = [single]
    if not files:
        raise WeightsError(f"{model_dir}: no *.safetensors file and no *.safetensors.index.json")
    if len(files) > 1:
        names = [f.name for f in files]
        raise WeightsError(f"{model_dir}: several .safetensors files ({names}) and no index.json")
    for name, arr in read_safetensors(files[0], mmap).items():
        tensors[name], origin[name] = arr, str(files[0])
    return tensors, origin


def check_tensors(tensors: dict, origin: dict, expected: dict[str, tuple], where, optional=()) -> None:
    """Raise WeightsError listing missing, unexpected and wrongly shaped / typed tensors.

    expected: {name: shape}; optional: names that may be present (ignored) or absent.
    Floating tensors must be BF16, F32 or F16 (read as bf16 / f32 storage by the model).
    """
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected and n not in optional]
    problems = []
    for name, shape in expected.items():
        arr = tensors.get(name)
        if arr is None:
            continue
        if tuple(arr.shape) != tuple(shape):
            problems.append(f"{name} in {origin.get(name, '?')}: shape {list(arr.shape)}, expected {list(shape)}")
        elif isinstance(arr, QuantizedRows) and len(shape) != 2:
            problems.append(f"{name} in {origin.get(name, '?')}: {arr.qtype} blocks, expected BF16/F32/F16")
        elif not isinstance(arr, QuantizedRows) and arr.dtype not in (np.uint16, np.float32, np.float16):
            problems.append(f"{name} in {origin.get(name, '?')}: dtype {arr.dtype}, expected BF16/F32/F16")
    if missing or unexpected or problems:
        lines = [f"{where}: checkpoint does not match the config"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {_names(missing)}")
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {_names(unexpected)}")
        lines += [f"  {p}" for p in problems]
        raise WeightsError("\n".join(lines))


def check_finite(tensors: dict, origin: dict) -> None:
    """Raise WeightsError naming the first tensor (and its file) that holds a NaN or an infinity.
    bf16 (uint16 bits) is non-finite when its exponent bits are all ones."""
    chunk = 1 << 24  # elements per pass: bounded temporaries on multi-GB tensors
    for name, arr in tensors.items():
        if isinstance(arr, QuantizedRows):
            if not arr.finite():
                raise WeightsError(f"{name} in {origin.get(name, '?')}: a NaN or an infinity in its "
                                   f"{arr.qtype} scales")
            continue
        if arr.dtype.kind not in "fu" or (arr.dtype.kind == "u" and arr.dtype != np.uint16):
            continue
        flat = arr.reshape(-1)
        for s in range(0, flat.size, chunk):
            part = flat[s:s + chunk]
            bad = (part & 0x7F80) == 0x7F80 if part.dtype == np.uint16 else ~np.isfinite(part)
            if bad.any():
                i = s + int(np.argmax(bad))
                where = np.unravel_index(i, arr.shape)
                raise WeightsError(f"{origin.get(name, '?')}: tensor {name!r} holds a non-finite value at "
                                   f"index {tuple(int(j) for j in where)}")


def _names(names: list, limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def storage(arr: np.ndarray) -> np.ndarray:
    """Tensor as kernel storage: bf16 (uint16), f32 and GGUF blocks unchanged, f16 upcast to f32
    (small checkpoints)."""
    if not isinstance(arr, QuantizedRows) and arr.dtype == np.float16:
        return arr.astype(np.float32)
    return arr


def as_f32(arr: np.ndarray) -> np.ndarray:
    """float32 copy of a small tensor (norm weights); bf16 bit patterns upcast exactly."""
    if arr.dtype == np.uint16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(arr, dtype=np.float32)


def int8_rows(w: np.ndarray):
    """A float32 / bf16 matmul weight (N, K) requantized to Q4_1 blocks (gguf-py's quantizer), to be
    multiplied with int8 activations (dflash_kernels.quant); GGUF blocks keep theirs; w itself when K
    is not a multiple of 32. Q4_1: a drafter's weights (drafts are only proposals) drafted with the
    same acceptance in half Q8_0's bytes on SmolLM2 (docs/benchmarks.md, session 30)."""
    if isinstance(w, QuantizedRows):
        return QuantizedRows(w.blocks, w.qtype, "int8")
    if w.ndim != 2 or w.shape[1] % 32:
        return w
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(as_f32(w), GGMLQuantizationType.Q4_1)
    return QuantizedRows(QuantizedRows.from_bytes(raw, w.shape, "Q4_1").blocks, "Q4_1", "int8")


def release_pages(*arrays) -> None:
    """Drop the file pages behind memory-mapped checkpoint arrays from this process's resident set
    (madvise MADV_DONTNEED over their byte ranges), once their values live in a copy (a fused or
    packed weight). The mapping stays valid: a later read faults the pages back in from the page
    cache or the file. Without it, every mapped page a copy was made from stays in RSS next to the
    copy (a Qwen3.5-9B-shape subset: 12.7 GiB for 7.7 GiB of weights). Arrays that are not views
    of a file mapping are skipped."""
    if not hasattr(mmap, "MADV_DONTNEED"):  # a platform without madvise: the pages stay
        return
    page = mmap.PAGESIZE
    for a in arrays:
        if not isinstance(a, np.ndarray) or not a.size:
            continue
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not isinstance(root.base, mmap.mmap):
            continue
        start = root.ctypes.data - int(getattr(root, "offset", 0)) % mmap.ALLOCATIONGRANULARITY
        lo = a.ctypes.data - start
        hi = lo + a.nbytes
        lo, hi = -(-lo // page) * page, hi // page * page  # the whole pages inside the range
        if hi > lo:
            root.base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def concat_rows(*weights: np.ndarray, fuse: bool = True):
    """Stack linear weights (N_i, K) into one (sum N_i, K) so several projections run as one GEMM.

    The result is in RAM in the weights' storage dtype (bf16 stays bf16); mixed dtypes go to f32.
    fuse=False keeps the memory-mapped parts as a tuple instead (``Ops.linear`` runs one GEMM per
    part and concatenates the outputs: same result, no copy of the weights).
    """
    ws = [storage(w) for w in weights]
    if any(isinstance(w, QuantizedRows) for w in ws):  # GGUF blocks: rows stack as they are (fused or
        if len({getattr(w, "qtype", None) for w in ws}) == 1:  # not: they run only packed, a copy anyway)
            return QuantizedRows.concat(ws)
        ws = [w.dequantize() if isinstance(w, QuantizedRows) else as_f32(w) for w in ws]  # mixed: float32
    if not fuse:
        return tuple(ws)
    if len({w.dtype for w in ws}) > 1:
        ws = [as_f32(w) for w in ws]
    out = aligned_empty((sum(w.shape[0] for w in ws), ws[0].shape[1]), ws[0].dtype)
    np.concatenate(ws, axis=0, out=out)
    release_pages(*weights)  # their values are in `out` now
    return out


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array starting on an `align`-byte boundary: AMX tile loads of
    weight rows that straddle cache lines cost up to 20% (dflash_kernels' dk_amx.h), and numpy
    only guarantees 16 bytes."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n].view(dtype).reshape(shape)
