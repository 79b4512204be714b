"""Stub of dflash_kernels._cython.<tier>.linear_attention (pyx/linear_attention.pyx), installed beside
each tier's module. Raw kernels: no validation (dflash_kernels.linear_attention checks), outputs
written in place."""

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

def gated_delta_rule(q: F32, k: F32, v: F32, g: F32, beta: F32, state_in: F32 | None,
                     ckpt_slot: npt.NDArray[np.int64], o: F32, state: F32, ckpts: F32, *, n_threads: int,
                     scale: float, use_qk_l2norm: bool, chunk_size: int) -> None: ...
def causal_conv1d(x: F32, weight: F32, state_in: F32 | None, y: F32, state: F32, ckpts: F32, *, n_threads: int,
                  activation: str | None, checkpoints: bool) -> None: ...
def gated_rms_norm(x: F32, z: F32, weight: F32, out: F32, *, n_threads: int, eps: float) -> None: ...
def gated_deltanet_gates(a: F32, b: F32, neg_a: F32, dt_bias: F32, g: F32, beta: F32) -> None: ...
def apply_output_gate(o: F32, gate: F32, out: F32, *, n_threads: int) -> None: ...
