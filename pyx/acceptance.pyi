"""Stub of dflash_kernels._cython.<tier>.acceptance (pyx/acceptance.pyx), installed beside each tier's
module. Raw kernels: no validation (dflash_kernels.acceptance checks), outputs written in place."""

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Probs = npt.NDArray[np.float32] | npt.NDArray[np.uint16]  # float32 or bf16 bits

def accept_greedy(drafts: I64, target: I64, num_draft: I64, num_accepted: I64, out: I64, *,
                  n_threads: int) -> None: ...
def rejection_sample(drafts: I64, logits: Probs, draft_probs: Probs | None,
                     num_draft: I64, num_accepted: I64, out: I64, status: I64, *, n_threads: int,
                     uniforms: npt.NDArray[np.float64], temperature: float, top_k: int, top_p: float) -> None: ...
def sample_filtered(logits: Probs, tokens: I64, probs: npt.NDArray[np.float32], status: I64, *, n_threads: int,
                    uniforms: npt.NDArray[np.float64] | None, temperature: float, top_k: int,
                    top_p: float) -> None: ...
