"""What the public API's checks cost per call: each public op against its kernel called directly.

    python bench/validation_cost.py [--reps 2000]        (DFLASH_ISA=avx2 etc. for another tier)

For each op, tiny inputs (so that the kernel's own work is small and the difference stands out):

- public = ``dk.<op>(...)``: validation, conversion, output allocation, dispatch, the kernel;
- kernel = the active tier's compiled kernel (``dk.kernel_module``), called with the arguments the
  public call handed it (captured once) and preallocated outputs.

public - kernel is the per-call cost of the API layer. Medians of ``--reps`` timed calls after a
warm-up, numpy inputs and torch inputs, n_threads=1. Prints one line per op and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import dflash_kernels as dk
from dflash_kernels import acceptance, attention, denoise, dense, linear_attention

sys.path.insert(0, str(Path(__file__).parent))
from scale import _median  # noqa: E402  (median of n calls after a warm-up, as every bench script here)

MODULES = (acceptance, attention, denoise, dense, linear_attention)
BACKEND = "cython"  # kernel_module's: the compiled kernels of the active tier


def cases(rng):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    drafts = rng.integers(0, 50, (1, 4))
    yield "linear", (f(1, 64), f(32, 64)), {}
    yield "rms_norm", (f(1, 64), f(64)), {}
    yield "apply_rope", (f(1, 2, 16), np.array([3])), {"theta": 1e4}
    yield "silu_and_mul", (f(1, 64),), {}
    yield "cached_attention", (f(1, 2, 16), f(8, 1, 16), f(8, 1, 16)), {}
    yield "injected_kv_attention", (f(4, 2, 16), f(8, 1, 16), f(8, 1, 16), f(4, 1, 16), f(4, 1, 16)), {}
    yield "denoise_block", (f(4, 64), f(50, 64)), {}
    yield "accept_greedy", (drafts, np.concatenate([drafts, drafts[:, :1]], 1)), {}
    yield "rejection_sample", (drafts, f(1, 5, 50)), {"uniforms": rng.random((1, 5, 2)), "temperature": 0.8}
    yield "gated_delta_rule", (f(1, 1, 16), f(1, 1, 16), f(1, 1, 16), -np.abs(f(1, 1)), np.abs(f(1, 1)),
                               np.zeros((1, 16, 16), np.float32)), {}


def capture(name, args, kwargs, backend):
    """The (kernel, inputs, outs, params) the public call hands its backend."""
    seen = {}
    originals = {m: m.run for m in MODULES}

    def spy(family, op, inputs, outs, *, backend="auto", n_threads=None, **params):
        seen.setdefault("call", (family, op, inputs, outs, params))
        return originals[dense](family, op, inputs, outs, backend=backend, n_threads=n_threads, **params)

    for m in MODULES:
        m.run = spy
    try:
        getattr(dk, name)(*args, **kwargs, backend=backend, n_threads=1)
    finally:
        for m, r in originals.items():
            m.run = r
    family, op, inputs, outs, params = seen["call"]
    outs = outs if isinstance(outs, tuple) else (outs,)
    return getattr(dk.kernel_module(family, backend), op), inputs, outs, params


def measure(name: str, a: tuple, kw: dict, reps: int) -> dict:
    kernel, inputs, outs, params = capture(name, a, kw, BACKEND)
    ta = tuple(torch.from_numpy(x) if isinstance(x, np.ndarray) and x.dtype != np.float64 else x for x in a)
    op = getattr(dk, name)
    public = _median(lambda: op(*a, **kw, backend=BACKEND, n_threads=1), reps) * 1e6
    public_t = _median(lambda: op(*ta, **kw, backend=BACKEND, n_threads=1), reps) * 1e6
    bare = _median(lambda: kernel(*inputs, *outs, n_threads=1, **params), reps) * 1e6
    print(f"{name:22s} public {public:7.2f} us (torch {public_t:7.2f})  kernel {bare:6.2f} us  "
          f"API layer {public - bare:6.2f} / {public_t - bare:6.2f} us", flush=True)
    return {"op": name, "public_numpy_us": public, "public_torch_us": public_t, "kernel_us": bare,
            "api_numpy_us": public - bare, "api_torch_us": public_t - bare}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [measure(name, a, kw, args.reps) for name, a, kw in cases(rng)]
    print(json.dumps({"backend": BACKEND, "tier": dk.active_tier(), "reps": args.reps, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
