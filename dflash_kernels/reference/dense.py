"""Reference dense ops (torch), computed in the dtype of the inputs (float64 in tests)."""

from __future__ import annotations

import torch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # (M, I) each
    return torch.nn.functional.silu(gate) * up


def round_activations(x: torch.Tensor, parts: int = 3) -> torch.Tensor:
    """fp32 x rounded to the sum of `parts` bf16 parts (dflash_kernels/_precision.py): 3 keeps x,
    2 = truncate to bf16 + the remainder rounded to nearest even, 1 = rounded to nearest even.
    inf and NaN are kept."""
    if parts >= 3:
        return x
    x = x.float().contiguous()
    if parts == 1:
        r = x.to(torch.bfloat16).float()
    else:
        hi = (x.view(torch.int32) & -65536).view(torch.float32)
        r = hi + (x - hi).to(torch.bfloat16).float()
    return torch.where(torch.isfinite(x), r, x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           parts: int = 3) -> torch.Tensor:
    # (M, K) @ (N, K)^T + (N,) -> (M, N), activations rounded to `parts` bf16 parts
    x = round_activations(x, parts)
    return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def rms_norm(x: torch.Tensor, w: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * (offset + w), over the last axis (H)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.to(x.dtype))


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, *, eps: float,
                      offset: float = 0.0):
    """(rms_norm(x + residual), x + residual): the pre-norm residual add fused with the norm."""
    h = x + residual
    return rms_norm(h, w, eps=eps, offset=offset), h


def rope_cos_sin(positions: torch.Tensor, theta: float, rotary_dim: int, inv_freq=None):
    """cos, sin of pos * theta^(-2j/rotary_dim), j < rotary_dim/2 (or pos * inv_freq[j] when given: scaled
    RoPE), in float64: (T, rotary_dim/2) each."""
    if inv_freq is None:
        j = torch.arange(rotary_dim // 2, dtype=torch.float64)
        inv_freq = float(theta) ** (-2.0 * j / rotary_dim)
    else:
        inv_freq = torch.as_tensor(inv_freq, dtype=torch.float64)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, *, theta: float, rotary_dim: int,
               inv_freq=None) -> torch.Tensor:
    """NeoX rotate-half RoPE over the first rotary_dim dims of x (T, H, D); the rest passes through."""
    half = rotary_dim // 2
    cs = rope_cos_sin(positions, theta, rotary_dim, inv_freq)
    cos, sin = (c.to(x.dtype)[:, None, :] for c in cs)  # (T, 1, half)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
