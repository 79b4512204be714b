"""One call path from a public op to its backend.

Kernel modules (dflash_kernels._cython.<family>, dflash_kernels._numba.<family>) export, per op,
a Python-callable ``op(*inputs, *outs, n_threads=n, **params)`` that writes into the preallocated
``outs``. The torch backend runs the reference ``dflash_kernels.reference.<family>.op(*inputs,
**params)`` on float32 tensors and its result is copied into ``outs``.
"""

from __future__ import annotations

import numpy as np
import torch

from ._backends import resolve
from ._tensors import to_torch
from ._threads import resolve_threads, torch_threads


def _torch_input(a):
    if not isinstance(a, np.ndarray):
        return a
    t = to_torch(a)
    return t.float() if t.dtype in (torch.bfloat16, torch.float16, torch.float64) else t


def run(family: str, op: str, inputs: tuple, outs, *, backend="auto", n_threads=None, **params) -> str:
    """Run `op` of `family` on the chosen backend, writing into `outs`; return the backend's name."""
    n = resolve_threads(n_threads)
    name, impl = resolve(backend, family)
    outs_t = outs if type(outs) is tuple else (outs,)
    if name == "torch":
        with torch_threads(n), torch.no_grad():
            res = getattr(impl, op)(*(_torch_input(a) for a in inputs), **params)
        res_t = res if isinstance(res, tuple) else (res,)
        # the reference may return fewer results than there are outputs (e.g. no checkpoints, no status)
        for out, r in zip(outs_t, res_t, strict=False):
            out[...] = r.numpy().astype(out.dtype, copy=False)
    else:  # one tuple behind one star: f(*a, *b) first builds a list
        getattr(impl, op)(*(inputs + outs_t), n_threads=n, **params)
    return name
