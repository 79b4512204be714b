"""Matmul precision, in torch's vocabulary (``torch.set_float32_matmul_precision``).

Every linear layer and LM-head pass multiplies fp32 activations by fp32 or bf16 weights. The
precision says how the activations enter the products:

    "highest"  exact fp32 activations (the default)
    "high"     each activation rounded to two bf16 parts, x1 + x2 (16 significant bits)
    "medium"   each activation rounded to one bf16 (nearest even): what torch bf16 and vLLM bf16
               compute

Attention follows the same setting: at "medium" the operands of both of its products (scaled
queries, K, V, probabilities) are rounded to one bf16 (dflash_kernels/attention.py).

The products of the rounded activations with the weights are exact and summed in fp32 on every
backend and tier, so a precision is a rounding of the activations, not a property of a kernel:
the AMX and vdpbf16ps paths run one bf16 operation per part, the FMA paths run on the rounded
values. Error bounds against the float64 product of the unrounded inputs: docs/conventions.md.
"""

from __future__ import annotations

from ._env import settings_changed

PRECISIONS = {"highest": 3, "high": 2, "medium": 1}  # name -> bf16 parts per activation

_default = "highest"


def check_precision(precision, name: str = "precision") -> str:
    """Validate a precision name (None means the process default)."""
    if precision is None:
        return _default
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {', '.join(PRECISIONS)} (or None), got {precision!r}")
    return precision


def parts(precision) -> int:
    """bf16 parts per activation for `precision` (None: the process default)."""
    if precision is None:  # the common case: one lookup (this runs on every linear / attention call)
        return PRECISIONS[_default]
    return PRECISIONS[check_precision(precision)]


def set_matmul_precision(precision: str) -> str:
    """Set the default precision of ``linear``, ``denoise_block`` and attention for this process.

    A per-call ``precision=`` overrides it.

    Parameters
    ----------
    precision : {"highest", "high", "medium"}
        "highest" (the default at start: exact fp32 activations), "high" (two bf16 parts) or "medium"
        (one bf16 part); see the module docstring.

    Returns
    -------
    str
        The previous default.

    Raises
    ------
    ValueError
        If precision is not one of the three names (None included).

    Examples
    --------
    >>> old = dk.set_matmul_precision("medium")
    >>> dk.get_matmul_precision()
    'medium'
    >>> dk.set_matmul_precision(old)  # restore; returns the one it replaces
    'medium'
    """
    global _default
    new = check_precision(precision if precision is not None else "", "set_matmul_precision(precision)")
    old, _default = _default, new
    settings_changed()
    return old


def get_matmul_precision() -> str:
    """The default precision of ``linear``, ``denoise_block`` and attention (see set_matmul_precision).

    Returns
    -------
    str
        "highest", "high" or "medium".

    Examples
    --------
    >>> dk.get_matmul_precision() in ("highest", "high", "medium")
    True
    """
    return _default


def bf16_dot_pays() -> bool:
    """Whether "medium" runs on a bf16 dot-product instruction at the tier that runs now.

    That is AMX tiles, or vdpbf16ps where it measures ahead of FMA (Zen 4, not Sapphire Rapids). Only
    then is "medium" faster than "highest"; elsewhere it rounds the operands for the FMA kernels and
    costs a little more. ``model.load(draft_precision="auto")`` drafts at "medium" when this is True.

    Returns
    -------
    bool
        True on AMX, or on AVX512-BF16 where vdpbf16ps outruns FMA (measured once per process);
        False on the FMA-only tiers and without the Cython kernels.

    Examples
    --------
    >>> dk.bf16_dot_pays() in (True, False)
    True
    """
    from ._backends import resolve

    try:
        _, dense = resolve("cython", "dense")
    except RuntimeError:  # no Cython build: the Numba and torch paths have no such rule
        return False
    return bf16_dot_of(dense) is not None


def bf16_dot_of(dense) -> str | None:
    """The bf16 dot-product instruction a Cython tier's dense module runs "medium" on here ("AMX tiles"
    or "vdpbf16ps"), None where "medium" runs FMA on rounded operands."""
    if dense.amx_available():
        return "AMX tiles"
    return "vdpbf16ps" if dense.bf16dot_available() and dense.bf16dot_pays() else None
