"""dflash_kernels: CPU kernels for DFlash speculative decoding (Cython + Numba, torch reference).

Every op accepts torch CPU tensors (returns torch) or numpy arrays (returns numpy), float32 or
bfloat16 storage (torch.bfloat16 or numpy uint16 bit patterns), computes in float32, and takes
``n_threads=None`` and ``backend="auto"`` (one of ``available_backends()``).
"""

__version__ = "0.1.0"

from ._backends import available_backends
from ._config import show_config
from .acceptance import accept_greedy, rejection_sample
from .attention import cached_attention, injected_kv_attention
from .dense import apply_rope, linear, rms_norm, silu_and_mul
from .denoise import denoise_block, make_draft_block
from .linear_attention import (
    apply_output_gate,
    causal_conv1d,
    conv_state_at,
    gated_delta_rule,
    gated_rms_norm,
    split_query_gate,
)

__all__ = [
    "accept_greedy",
    "apply_output_gate",
    "causal_conv1d",
    "conv_state_at",
    "gated_delta_rule",
    "gated_rms_norm",
    "split_query_gate",
    "apply_rope",
    "available_backends",
    "cached_attention",
    "denoise_block",
    "injected_kv_attention",
    "linear",
    "make_draft_block",
    "rejection_sample",
    "rms_norm",
    "show_config",
    "silu_and_mul",
]
