"""Reference dense ops (torch), computed in the dtype of the inputs (float64 in tests)."""

import torch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # (M, I) each
    return torch.nn.functional.silu(gate) * up
