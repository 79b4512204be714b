"""Stub of dflash_kernels._cython.<tier>.attention (pyx/attention.pyx), installed beside each tier's
module. Raw kernels: no validation (dflash_kernels.attention checks), out written in place. K/V are
float32 or bf16 bits (uint16); parts 1 is "medium" (bf16 operands), 2 and 3 exact."""

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
KV = npt.NDArray[np.float32] | npt.NDArray[np.uint16]

def injected_kv_attention(q: F32, k_ctx: KV, v_ctx: KV, k_blk: KV, v_blk: KV, out: F32, *, n_threads: int,
                          scale: float, causal_block: bool, window: int | None, parts: int = 3) -> None: ...
def cached_attention(q: F32, k_cache: KV, v_cache: KV, out: F32, *, n_threads: int, causal: bool, scale: float,
                     window: int | None, parts: int = 3) -> None: ...
