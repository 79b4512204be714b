"""Stub of dflash_kernels._cython.<tier>.denoise (pyx/denoise.pyx), installed beside each tier's
module. Raw kernel: no validation (dflash_kernels.denoise checks), tokens and status written in place."""

import numpy as np
import numpy.typing as npt

def denoise_block(hidden: npt.NDArray[np.float32], lm_head: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
                  tokens: npt.NDArray[np.int64], status: npt.NDArray[np.int64], *, n_threads: int,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  uniforms: npt.NDArray[np.float64] | None = None) -> None: ...
