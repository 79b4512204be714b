"""What the public API's checks cost per call: each public op against its kernel called directly.

    python bench/validation_cost.py [--reps 2000]        (DFLASH_ISA=avx2 etc. for another tier)

For each op, tiny inputs (so that the kernel's own work is small and the difference stands out):

- public = ``dk.<op>(x, w, n_threads=1)`` as users call it (``backend="auto"``, the default):
  validation, conversion, output allocation, dispatch, the kernel (the compiled fast path where it
  takes the call, pyx/fastpath.pyx, else the Python path);
- kernel = the kernel "auto" runs (``dk.kernel_module``: the active tier's compiled kernel), called
  with the arguments the public call handed it (captured once) and preallocated outputs.

Both are called as written-out code calls them (``kernel(x, w, out, n_threads=1)``, as the model
layer does): a star-call ``kernel(*args, **kwargs)`` costs a Cython function ~0.6 us more, which in
the baseline would hide that much of the API layer.

- bound = the same call on ``dk.BoundOps(n_threads=1)``, for the ops listed in BOUND (the entry for
  callers that own their buffers; the model layer runs on it).

public - kernel is the per-call cost of the API layer, bound - kernel that of ``BoundOps``. Medians
of ``--reps`` timed calls after a warm-up, numpy inputs and torch inputs, n_threads=1; the calls are
timed in turn within each rep, so that a change in the machine's load shifts them all alike. Prints
one line per op and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import dflash_kernels as dk
from dflash_kernels import acceptance, attention, denoise, dense, linear_attention
from dflash_kernels.runtime import resolve_backend

MODULES = (acceptance, attention, denoise, dense, linear_attention)
# BoundOps methods timed, and what their calls add to the public op's arguments
BOUND = {"linear": {}, "rms_norm": {"eps": 1e-6}, "apply_rope": {}, "silu_and_mul": {}, "cached_attention": {},
         "accept_greedy": {}}


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


def capture(name, args, kwargs):
    """The (kernel, inputs, outs, params) the public call hands its backend."""
    seen = {}
    originals = {m: m.run for m in MODULES}

    def spy(family, op, inputs, outs, *, backend="auto", n_threads=None, **params):
        seen.setdefault("call", (family, op, inputs, outs, params))
        return originals[dense](family, op, inputs, outs, backend=backend, n_threads=n_threads, **params)

    for m in MODULES:
        m.run = spy
    try:  # the backend named: the Python path (the fast path takes "auto" only), which calls run()
        getattr(dk, name)(*args, **kwargs, n_threads=1, backend=resolve_backend("auto", "dense"))
    finally:
        for m, r in originals.items():
            m.run = r
    if "call" not in seen:
        raise RuntimeError(f"{name} did not reach a kernel (a linear shape delegated to torch here?)")
    family, op, inputs, outs, params = seen["call"]
    backend = resolve_backend("auto", family)
    if backend == "torch":
        raise RuntimeError("backend auto resolves to torch here: no kernel to compare with")
    outs = outs if isinstance(outs, tuple) else (outs,)
    return getattr(dk.kernel_module(family, backend), op), inputs, outs, params


def written_out(fn, args: tuple, kwargs: dict):
    """A function of no arguments that calls fn(args..., key=value...) as written-out code does."""
    names = {f"a{i}": a for i, a in enumerate(args)} | {f"k_{k}": v for k, v in kwargs.items()}
    call = ", ".join([*(f"a{i}" for i in range(len(args))), *(f"{k}=k_{k}" for k in kwargs)])
    return eval(f"lambda: fn({call})", {"fn": fn, **names})  # the text is ours: names a0.., k_...


def medians(fns, reps: int) -> list[float]:
    """Median seconds per call of each fn, the fns timed in turn within each of reps rounds."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def measure(name: str, a: tuple, kw: dict, reps: int) -> dict:
    kernel, inputs, outs, params = capture(name, a, kw)
    ta = tuple(torch.from_numpy(x) if isinstance(x, np.ndarray) and x.dtype != np.float64 else x for x in a)
    op = getattr(dk, name)
    fns = [written_out(op, a, {**kw, "n_threads": 1}), written_out(op, ta, {**kw, "n_threads": 1}),
           written_out(kernel, (*inputs, *outs), {"n_threads": 1, **params})]
    if name in BOUND:
        fns.append(written_out(getattr(dk.BoundOps(n_threads=1), name), a, {**kw, **BOUND[name]}))
    public, public_t, bare, *bound = (t * 1e6 for t in medians(fns, reps))
    row = {"op": name, "public_numpy_us": public, "public_torch_us": public_t, "kernel_us": bare,
           "api_numpy_us": public - bare, "api_torch_us": public_t - bare}
    line = (f"{name:22s} public {public:7.2f} us (torch {public_t:7.2f})  kernel {bare:6.2f} us  "
            f"API layer {public - bare:6.2f} / {public_t - bare:6.2f} us")
    if bound:
        row |= {"bound_us": bound[0], "api_bound_us": bound[0] - bare}
        line += f"  BoundOps {bound[0]:6.2f} us (+{bound[0] - bare:5.2f})"
    print(line, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [measure(name, a, kw, args.reps) for name, a, kw in cases(rng)]
    print(json.dumps({"backend": resolve_backend("auto", "dense"), "tier": dk.active_tier(), "reps": args.reps,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
