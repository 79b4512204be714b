"""GGUF block-quantized linear weights (Q4_0, Q4_1, Q8_0), kept in their blocks and run as they are.

``QuantizedRows`` holds a weight as the GGUF file stores it: rows of blocks of 32 weights, each a
float16 scale ``d`` (and, for Q4_1, a float16 offset ``m``) and 32 small integers ``q``; a weight is
``d * q + m`` (Q4_1), ``d * (q - 8)`` (Q4_0) or ``d * q`` (Q8_0). ``pack_quantized`` re-lays the blocks
into panels of 16 output columns (pyx/dk_quant.h), which ``linear`` runs on the Cython tiers: 5 bits a
weight (Q4) or 8.5 (Q8) stream from memory instead of 16 for bf16.

Exactness: ``d * q`` is exact in float32, so each weight the kernels form is the float32 value that
``dequantize`` (and gguf-py's and ggml's expansion) gives, and the sums run in the order of the
float32 packed tiles: ``linear`` over ``pack_quantized(rows)`` is bit-identical to ``linear`` over
``pack_weight(rows.dequantize())``, at every M, thread count and precision.
"""

from __future__ import annotations

import numpy as np

from ._tensors import hugepage_empty
from .dense import Q4_INT8, Q8_INT8, PackedWeight

BLOCK = 32  # weights per GGUF block (K is a multiple of it)
PANEL = 16  # output columns per panel (pyx/dk_quant.h)
# bytes of one GGUF block, and the kernels' format code (pyx/dk_quant.h: DK_Q4, DK_Q8)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
FORMAT = {"Q4_0": 2, "Q4_1": 2, "Q8_0": 3}
FORMAT_NAMES = {2: "q4", 3: "q8", 4: "q4-int8", 5: "q8-int8"}
RECORD_BYTES = {2: 64 + 256, 3: 32 + 512, 4: 64 + 256, 5: 64 + 512}  # one block of one panel (16 columns)
ACTIVATIONS = ("float", "int8")


class QuantizedRows:
    """A linear weight (N, K) as GGUF blocks: ``blocks`` (N, K / 32, bytes per block) uint8, ``qtype``
    "Q4_0", "Q4_1" or "Q8_0". Rows can be stacked (``concat``) and reordered (``take``) without
    touching the values; ``dequantize`` gives the exact float32 weights. ``activations``: what
    ``pack_quantized`` multiplies the blocks with by default, "float" (exact) or "int8"."""

    __slots__ = ("blocks", "qtype", "activations")
    ndim = 2

    def __init__(self, blocks: np.ndarray, qtype: str, activations: str = "float"):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"qtype must be one of {sorted(BLOCK_BYTES)}, got {qtype!r}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.activations = activations
        blocks = np.asarray(blocks)
        if blocks.dtype != np.uint8 or blocks.ndim != 3 or blocks.shape[2] != BLOCK_BYTES[qtype]:
            raise ValueError(f"{qtype} blocks must be uint8 of shape (N, K / {BLOCK}, {BLOCK_BYTES[qtype]}), "
                             f"got {blocks.dtype} {blocks.shape}")
        self.blocks, self.qtype = blocks, qtype

    @classmethod
    def from_bytes(cls, data, shape: tuple[int, int], qtype: str) -> QuantizedRows:
        """The rows of a GGUF tensor's raw bytes (row-major blocks, as gguf-py's ``ReaderTensor.data``)."""
        n, k = (int(s) for s in shape)
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"qtype must be one of {sorted(BLOCK_BYTES)}, got {qtype!r}")
        if k % BLOCK:
            raise ValueError(f"a {qtype} row holds whole blocks of {BLOCK}, got K = {k}")
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        want = n * (k // BLOCK) * BLOCK_BYTES[qtype]
        if raw.size != want:
            raise ValueError(f"{qtype} data of shape ({n}, {k}) has {want} bytes, got {raw.size}")
        return cls(raw.reshape(n, k // BLOCK, BLOCK_BYTES[qtype]), qtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.blocks.shape[1] * BLOCK)

    @property
    def dtype(self) -> np.dtype:
        return self.blocks.dtype

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def __repr__(self) -> str:
        return f"QuantizedRows(shape={self.shape}, qtype={self.qtype})"

    def take(self, rows, axis: int = 0) -> QuantizedRows:
        """These rows, in this order, still as blocks (a copy); as ``ndarray.take(rows, axis=0)``."""
        if axis != 0:
            raise ValueError("QuantizedRows.take selects rows (axis=0) only")
        return QuantizedRows(np.ascontiguousarray(self.blocks[np.asarray(rows).reshape(-1)]), self.qtype,
                             self.activations)

    def __getitem__(self, rows) -> np.ndarray:
        """Rows (an int, a slice or an index array) as their float32 values, as indexing an array
        would give them: an embedding lookup."""
        sub = self.blocks[rows]
        flat = QuantizedRows(np.ascontiguousarray(sub.reshape(-1, *sub.shape[-2:])), self.qtype)
        return flat.dequantize().reshape(*sub.shape[:-2], self.shape[1])

    @staticmethod
    def concat(parts) -> QuantizedRows:
        """Rows stacked in order; every part must have the same qtype and K."""
        qtypes, ks = {p.qtype for p in parts}, {p.shape[1] for p in parts}
        acts = {p.activations for p in parts}
        if len(qtypes) != 1 or len(ks) != 1 or len(acts) != 1:
            raise ValueError(f"only rows of one qtype, K and activations stack, got {sorted(qtypes)}, K {sorted(ks)} "
                             f"and {sorted(acts)}")
        return QuantizedRows(np.concatenate([p.blocks for p in parts]), qtypes.pop(), acts.pop())

    def finite(self) -> bool:
        """Whether every scale (and offset) is finite: float16 exponent bits all ones are inf or NaN."""
        halves = 2 if self.qtype == "Q4_1" else 1
        h = np.ascontiguousarray(self.blocks[..., : 2 * halves]).view(np.uint16)
        return not ((h & 0x7C00) == 0x7C00).any()

    def dequantize(self) -> np.ndarray:
        """The weights (N, K) in float32, exactly (d * q rounds nothing; Q4_1 adds m once)."""
        d, m, q = _scales(self.blocks, self.qtype)
        w = d.astype(np.float32)[..., None] * q.astype(np.float32)
        if m is not None:
            w += m[..., None]
        return w.reshape(self.shape)


def _scales(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(d, m, q) of (N, nb) blocks: d float16 (N, nb), m float32 (N, nb) (None for Q8_0; Q4_0's is
    -8 d, exact), q (N, nb, 32) in k order (uint8 for Q4, int8 for Q8_0). A weight is d q + m."""
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if qtype == "Q8_0":
        return d, None, blocks[..., 2:].view(np.int8)
    nib = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)  # GGUF's byte j: q[j] low, q[j + 16] high
    if qtype == "Q4_1":
        return d, np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32), q
    return d, d.astype(np.float32) * -8.0, q


def pack_quantized(rows: QuantizedRows, activations: str | None = None) -> PackedWeight:
    """Lay GGUF blocks out in the kernels' panels (pyx/dk_quant.h), for ``linear`` and the fused layers.

    Makes one copy. The Cython tiers run the result as it is (``linear`` on any other backend expands
    it to its float32 values); results are bit-identical to ``pack_weight(rows.dequantize())``.
    With ``activations="int8"``, the blocks are instead multiplied as llama.cpp does: each row of x
    rounded to int8 per block of 32 k, integer dot products, one float scale per block
    (``linear_int8_reference`` gives the same bits); faster where several rows share the weights
    (verification, prefill), and no longer the float32 expansion's values.

    Parameters
    ----------
    rows : QuantizedRows
        A weight (N, K) as Q4_0, Q4_1 or Q8_0 blocks (``QuantizedRows.from_bytes`` of a GGUF tensor).
    activations : {"float", "int8"}, optional
        What the blocks multiply: float32 activations exactly, or int8 ones. Default: rows.activations.

    Returns
    -------
    PackedWeight
        Shape (N, K), dtype uint8, ``quant`` 2 (Q4_0 / Q4_1, 5 bits a weight), 3 (Q8_0, 8.5 bits), 4
        (Q4_0 / Q4_1 times int8 activations) or 5 (Q8_0 times int8 activations, 9 bits).

    Raises
    ------
    TypeError
        If rows is not a QuantizedRows.
    ValueError
        If a Q4_0 scale is too large to carry as Q4_1 (|8 d| > 65504).

    Examples
    --------
    >>> from gguf import GGMLQuantizationType, quants
    >>> w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    >>> rows = dk.QuantizedRows.from_bytes(quants.quantize(w, GGMLQuantizationType.Q4_1), (64, 32), "Q4_1")
    >>> packed = dk.pack_quantized(rows)
    >>> packed
    PackedWeight(shape=(64, 32), dtype=q4)
    >>> x = np.ones((2, 32), np.float32)
    >>> np.array_equal(dk.linear(x, packed), dk.linear(x, dk.pack_weight(rows.dequantize())))
    True
    """
    if not isinstance(rows, QuantizedRows):
        raise TypeError(f"rows must be a QuantizedRows (GGUF blocks: QuantizedRows.from_bytes), got "
                        f"{type(rows).__name__}; pack float32 / bf16 weights with pack_weight")
    activations = rows.activations if activations is None else activations
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    n, k = rows.shape
    fmt, nb = FORMAT[rows.qtype], k // BLOCK
    if activations == "int8":
        fmt = Q4_INT8 if fmt == 2 else Q8_INT8
    n16 = -(-n // PANEL)
    d, m, q = _scales(rows.blocks, rows.qtype)
    if m is not None:  # the panels carry m as float16: Q4_1's is one, Q4_0's -8 d is unless it overflows
        if (np.abs(m[np.isfinite(m)]) > np.finfo(np.float16).max).any():
            raise ValueError("a Q4_0 scale too large to express as Q4_1 (|8 d| > 65504)")
        m = m.astype(np.float16)
    pad = n16 * PANEL - n
    if pad:  # zero rows: d = m = 0, so their weights are 0
        d, q = np.pad(d, ((0, pad), (0, 0))), np.pad(q, ((0, pad), (0, 0), (0, 0)))
        m = None if m is None else np.pad(m, ((0, pad), (0, 0)))
    rec = hugepage_empty((n16, nb, RECORD_BYTES[fmt]), np.uint8)
    # per panel and block: the 16 columns' d (and m) as float16, then the integers k-major
    rec[..., :32] = d.reshape(n16, PANEL, nb).transpose(0, 2, 1).copy().view(np.uint8).reshape(n16, nb, 32)
    if fmt in (2, Q4_INT8):
        rec[..., 32:64] = m.reshape(n16, PANEL, nb).transpose(0, 2, 1).copy().view(np.uint8).reshape(n16, nb, 32)
    if fmt == 2:
        pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # (N16 * 16, nb, 16): byte p = q[2p] | q[2p + 1] << 4
        rec[..., 64:] = pairs.reshape(n16, PANEL, nb, 16).transpose(0, 2, 3, 1).reshape(n16, nb, 256)
    elif fmt == Q4_INT8:  # per group g of 8 k, 4 bytes a column: byte i = q[8g + i] | q[8g + 4 + i] << 4
        g = q.reshape(n16, PANEL, nb, 4, 8)
        quads = g[..., :4] | (g[..., 4:] << 4)  # (N16, 16 columns, nb, 4 groups, 4 bytes)
        rec[..., 64:] = quads.transpose(0, 2, 3, 1, 4).reshape(n16, nb, 256)
    elif fmt == Q8_INT8:  # per column the sum of its q (int16), then per group g of 4 k the column's 4 bytes
        qs = q.sum(-1, dtype=np.int16).reshape(n16, PANEL, nb).transpose(0, 2, 1)  # (N16, nb, 16)
        rec[..., 32:64] = np.ascontiguousarray(qs).view(np.uint8).reshape(n16, nb, 32)
        rec[..., 64:] = q.view(np.uint8).reshape(n16, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(n16, nb, 512)
    else:
        rec[..., 32:] = q.view(np.uint8).reshape(n16, PANEL, nb, BLOCK).transpose(0, 2, 3, 1).reshape(n16, nb, 512)
    data = rec.reshape(-1)
    data.flags.writeable = False
    return PackedWeight((n, k), np.dtype(np.uint8), data, rows.finite(), quant=fmt)


def unpack_quantized(data: np.ndarray, shape: tuple[int, int], fmt: int) -> np.ndarray:
    """The float32 weights (N, K) of ``pack_quantized``'s panels (exact)."""
    n, k = shape
    n16, nb = -(-n // PANEL), k // BLOCK
    rec = np.asarray(data).reshape(n16, nb, RECORD_BYTES[fmt])
    d = rec[..., :32].copy().view(np.float16).astype(np.float32)  # (N16, nb, 16 columns)
    if fmt == Q4_INT8:
        m = rec[..., 32:64].copy().view(np.float16).astype(np.float32)
        w = d[:, :, None, :] * _q4_int8_q(rec).astype(np.float32) + m[:, :, None, :]
    elif fmt == Q8_INT8:
        w = d[:, :, None, :] * _q8_int8_q(rec).astype(np.float32)
    elif fmt == 2:
        m = rec[..., 32:64].copy().view(np.float16).astype(np.float32)
        pairs = rec[..., 64:].reshape(n16, nb, 16, PANEL)
        q = np.stack([pairs & 15, pairs >> 4], axis=3).reshape(n16, nb, BLOCK, PANEL).astype(np.float32)
        w = d[:, :, None, :] * q + m[:, :, None, :]
    else:
        q = rec[..., 32:].view(np.int8).reshape(n16, nb, BLOCK, PANEL).astype(np.float32)
        w = d[:, :, None, :] * q
    return np.ascontiguousarray(w.transpose(0, 3, 1, 2).reshape(n16 * PANEL, k)[:n])


def _q4_int8_q(rec: np.ndarray) -> np.ndarray:
    """The integers (N16, nb, 32 k, 16 columns) of Q4-times-int8 records (N16, nb, 320)."""
    n16, nb = rec.shape[:2]
    quads = rec[..., 64:].reshape(n16, nb, 4, PANEL, 4)  # (N16, nb, group, column, byte)
    q = np.concatenate([quads & 15, quads >> 4], axis=-1)  # (.., column, 8 k of the group)
    return q.transpose(0, 1, 2, 4, 3).reshape(n16, nb, BLOCK, PANEL)


def _q8_int8_q(rec: np.ndarray) -> np.ndarray:
    """The integers (N16, nb, 32 k, 16 columns) of Q8-times-int8 records (N16, nb, 576)."""
    n16, nb = rec.shape[:2]
    g = rec[..., 64:].view(np.int8).reshape(n16, nb, 8, PANEL, 4)  # (N16, nb, group, column, k of the group)
    return g.transpose(0, 1, 2, 4, 3).reshape(n16, nb, BLOCK, PANEL)


def linear_int8_reference(x: np.ndarray, packed: PackedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """``linear`` over blocks times int8 activations (a ``PackedWeight`` of quant 4 or 5) in numpy: the
    bits the kernels give (pyx/dk_quant.h, DK_Q4X / DK_Q8X), for the backends without them and tests.

    Each row of x (M, K) float32 is rounded per block of 32 k: amax = max |x|, dx = amax / 127, xq =
    rint(x 127 / amax) in [-127, 127] (0 where amax is 0; a non-finite block gives dx non-finite and
    NaN outputs). Per block and output column, S = sum_k q xq is exact, and out += (d dx) S, then (Q4
    only) out += m (dx sum_k xq), each operation rounded once in float32, blocks in k order; the bias
    last.
    """
    if packed.quant not in (Q4_INT8, Q8_INT8):
        raise ValueError(f"linear_int8_reference needs a PackedWeight of blocks times int8 activations (quant "
                         f"{Q4_INT8} or {Q8_INT8}), got quant {packed.quant}")
    q8 = packed.quant == Q8_INT8
    n, k = packed.shape
    n16, nb = -(-n // PANEL), k // BLOCK
    x = np.asarray(x, np.float32).reshape(-1, nb, BLOCK)  # (M, nb, 32)
    rec = np.asarray(packed.data).reshape(n16, nb, RECORD_BYTES[packed.quant])
    d = rec[..., :32].copy().view(np.float16).astype(np.float32).transpose(0, 2, 1).reshape(n16 * PANEL, nb)[:n]
    m = None if q8 else \
        rec[..., 32:64].copy().view(np.float16).astype(np.float32).transpose(0, 2, 1).reshape(n16 * PANEL, nb)[:n]
    q = (_q8_int8_q(rec) if q8 else _q4_int8_q(rec)).transpose(0, 3, 1, 2).reshape(n16 * PANEL, nb, BLOCK)[:n]
    q = q.astype(np.int32)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(x), axis=-1)  # (M, nb); NaN propagates
        dx = amax / np.float32(127)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
        r = np.rint(x * inv[..., None])
        r = np.where(np.isnan(r), 0, np.clip(r, -127, 127)).astype(np.int32)
        sx = dx * r.sum(-1).astype(np.float32)
        s = np.einsum("mbk,nbk->mnb", r, q).astype(np.float32)  # exact: |S| <= 32 * 15 * 127
        out = np.zeros((x.shape[0], n), np.float32)
        for b in range(nb):
            out = out + (d[None, :, b] * dx[:, None, b]) * s[:, :, b]
            if m is not None:
                out = out + m[None, :, b] * sx[:, None, b]
        if bias is not None:
            out = out + np.asarray(bias, np.float32)
    return out
