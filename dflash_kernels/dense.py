"""Dense ops around attention: linear layers with bf16 weights, RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import numpy as np

from ._dispatch import run
from ._tensors import f32_array, is_torch, wrap


def silu_and_mul(gate_up, *, n_threads=None, backend="auto"):
    """SwiGLU activation: ``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last axis.

    gate_up: (M, 2*I) float32 or bf16. Returns (M, I) float32.
    """
    x = f32_array(gate_up, "gate_up", ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"gate_up must have an even last dimension [gate | up], got shape {x.shape}")
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    run("dense", "silu_and_mul", (x,), out, backend=backend, n_threads=n_threads)
    return wrap(out, is_torch(gate_up))


def linear(*a, **k):  # PLACEHOLDER
    raise NotImplementedError


def rms_norm(*a, **k):  # PLACEHOLDER
    raise NotImplementedError


def apply_rope(*a, **k):  # PLACEHOLDER
    raise NotImplementedError
