"""dflash_kernels: CPU kernels for DFlash speculative decoding (Cython + Numba, torch reference).

Every op accepts torch CPU tensors (returns torch) or numpy arrays (returns numpy), float32 or
bfloat16 storage (torch.bfloat16 or numpy uint16 bit patterns), computes in float32, and takes
``n_threads=None`` and ``backend="auto"`` (one of ``available_backends()``). The Examples in the ops'
docstrings assume ``import numpy as np`` and ``import dflash_kernels as dk`` (tests/test_docstrings.py runs them).
"""

__version__ = "0.1.0"

import os as _os
import sys as _sys

from . import _isa

# DFLASH_ISA caps Numba's code generation too, when Numba is not imported yet (its CPU target is
# read once, at import): the same tier for every backend.
if _os.environ.get("DFLASH_ISA") and "numba" not in _sys.modules and "NUMBA_CPU_NAME" not in _os.environ:
    _cap = _isa.parse_cap(_os.environ["DFLASH_ISA"])
    if _cap is not None:
        _os.environ["NUMBA_CPU_NAME"] = _isa.NUMBA_CPU[_isa.cap_tier(_cap, _isa.machine_tier()) or "avx2"]

from . import (
    runtime,  # noqa: F401  (dk.runtime: what the ops resolve at run time)
    torch_ops as _torch_ops,  # noqa: F401  (registers torch.ops.dflash.*)
)
from ._autotune import tune_linear
from ._backends import available_backends, kernel_module
from ._config import show_config
from ._isa import active_tier, set_isa
from ._precision import bf16_dot_pays, get_matmul_precision, set_matmul_precision
from ._tensors import bf16_to_f32, f32_to_bf16
from .acceptance import accept_greedy, filtered_probs, rejection_sample, sample_filtered
from .attention import cached_attention, injected_kv_attention
from .bound import BoundOps
from .denoise import denoise_block, make_draft_block
from .dense import (
    PackedWeight,
    apply_rope,
    linear,
    pack_weight,
    prepare_weight,
    rms_norm,
    rope_inv_freq,
    silu_and_mul,
)
from .gdn_layer import (
    GatedDeltaNetLayer,
    gated_deltanet_gates,
    gated_deltanet_layer,
    prepare_gated_deltanet_layer,
)
from .layers import Qwen3Layer, drafter_layer, prepare_qwen3_layer, qwen3_layer
from .linear_attention import (
    apply_output_gate,
    causal_conv1d,
    conv_state_at,
    gated_delta_rule,
    gated_rms_norm,
    split_query_gate,
)
from .quant import QuantizedRows, pack_quantized

__all__ = [
    "accept_greedy",
    "filtered_probs",
    "active_tier",
    "get_matmul_precision",
    "bf16_dot_pays",
    "kernel_module",
    "set_isa",
    "set_matmul_precision",
    "tune_linear",
    "apply_output_gate",
    "causal_conv1d",
    "conv_state_at",
    "gated_delta_rule",
    "gated_rms_norm",
    "split_query_gate",
    "apply_rope",
    "rope_inv_freq",
    "available_backends",
    "bf16_to_f32",
    "f32_to_bf16",
    "BoundOps",
    "cached_attention",
    "denoise_block",
    "injected_kv_attention",
    "linear",
    "pack_weight",
    "prepare_weight",
    "PackedWeight",
    "QuantizedRows",
    "pack_quantized",
    "Qwen3Layer",
    "prepare_qwen3_layer",
    "qwen3_layer",
    "drafter_layer",
    "GatedDeltaNetLayer",
    "prepare_gated_deltanet_layer",
    "gated_deltanet_layer",
    "gated_deltanet_gates",
    "make_draft_block",
    "rejection_sample",
    "sample_filtered",
    "rms_norm",
    "show_config",
    "silu_and_mul",
]
