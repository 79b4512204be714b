"""linear with the weights in DRAM: a model step's worth of bf16 layer weights, bigger than any cache.

pytest-benchmark cases reuse one matrix, which then sits in this Xeon's 480 MB L3; a decode step of
a real model streams every weight from DRAM once. This script runs `linear` over n_layers x
[qkv, o, gate_up, down] (+ the LM head) of a Qwen3 shape, M = 1 and M = 16, with the AMX path on and
off, next to a streaming read of the same bytes (bench/scale.py's Numba sum), all in one process:

    python bench/linear_dram.py --shape Qwen3-1.7B --layers 28 --threads 2 [--precision medium]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dflash_kernels.runtime import PRECISIONS  # noqa: E402  (name -> bf16 parts of the activations)
from scale import SHAPES, _median, stream_read_gbs  # noqa: E402


def _weights(s, n_layers: int, head: bool, rng) -> list[np.ndarray]:
    """bf16 bit patterns of small random values (the values do not change the traffic)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    shapes = [(q + 2 * kv, s.hidden), (s.hidden, q), (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate)]
    shapes = shapes * n_layers + ([(s.vocab, s.hidden)] if head else [])
    return [rng.integers(0x3C00, 0x3C80, size=shape, dtype=np.uint16) for shape in shapes]


def model_step_gbs(shape: str, layers: int, threads: int, repeats: int = 5, head: bool = True) -> dict:
    """linear at M=1 over a model step of DRAM-resident bf16 weights at the active tier, row-major
    and packed (dk.pack_weight), next to a streaming read of the same bytes:
    {"gemv_gbs", "packed_gbs", "stream_gbs", "gb", "shape"}."""
    import dflash_kernels as dk

    dense = dk.kernel_module("dense", "cython")
    rng = np.random.default_rng(0)
    mats = _weights(SHAPES[shape], layers, head, rng)
    n_bytes = sum(w.nbytes for w in mats)
    xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in {w.shape[1] for w in mats}}
    outs = [np.empty((1, w.shape[0]), np.float32) for w in mats]

    def step():
        for w, o in zip(mats, outs, strict=True):
            dense.linear(xs[w.shape[1]], w, None, o, n_threads=threads)

    gemv_s = _median(step, repeats)
    packed = [dk.pack_weight(w) for w in mats]
    mats.clear()  # the row-major copies: keep one set of weights in memory

    def step_packed():
        for p, o in zip(packed, outs, strict=True):
            dense.linear_packed(xs[p.shape[1]], p.data, None, o, n_threads=threads)

    return {"shape": shape, "gb": n_bytes / 1e9, "gemv_gbs": n_bytes / gemv_s / 1e9,
            "packed_gbs": n_bytes / _median(step_packed, repeats) / 1e9,
            "stream_gbs": stream_read_gbs(min(n_bytes, 2 << 30), threads)}


def main(argv=None) -> int:
    import dflash_kernels as dk

    dense = dk.kernel_module("dense", "cython")

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="Qwen3-1.7B", choices=sorted(n for n in SHAPES if n.startswith("Qwen3-")))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--no-head", action="store_true", help="leave out the LM head")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precision", default="highest", choices=tuple(PRECISIONS),
                    help="of the packed rows (the row-major rows stay \"highest\")")
    args = ap.parse_args(argv)
    parts = PRECISIONS[args.precision]
    s = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    mats = _weights(s, args.layers, not args.no_head, rng)
    n_bytes = sum(w.nbytes for w in mats)

    def run(m: int) -> float:
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in {w.shape[1] for w in mats}}
        outs = [np.empty((m, w.shape[0]), np.float32) for w in mats]

        def step():
            for w, o in zip(mats, outs, strict=True):
                dense.linear(xs[w.shape[1]], w, None, o, n_threads=args.threads)

        step()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    print(f"{args.shape}, {args.layers} layers{'' if args.no_head else ' + LM head'}: "
          f"{n_bytes / 1e9:.2f} GB of bf16 weights, {args.threads} threads, AMX here: {dense.amx_available()}")
    print(f"streaming read: {stream_read_gbs(min(n_bytes, 2 << 30), args.threads):.1f} GB/s")
    for m in (1, 16):
        for amx in ((True, False) if m > 4 else (True,)):
            old = dense.set_amx_enabled(amx)
            t = run(m)
            dense.set_amx_enabled(old)
            path = "GEMV" if m <= 4 else ("AMX" if amx and dense.amx_available() else "FMA")
            print(f"M={m:2d} {path:4s}: {t * 1e3:7.1f} ms  ({n_bytes / t / 1e9:5.1f} GB/s of weights)")
    packed = [dk.pack_weight(w) for w in mats]
    mats.clear()
    for m in (1, 16):
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in {p.shape[1] for p in packed}}
        outs = [np.empty((m, p.shape[0]), np.float32) for p in packed]

        def step_packed(xs=xs, outs=outs):
            for p, o in zip(packed, outs, strict=True):
                dense.linear_packed(xs[p.shape[1]], p.data, None, o, n_threads=args.threads, parts=parts)

        t = _median(step_packed, args.repeats)
        print(f"M={m:2d} packed, {args.precision} ({dense.last_path()}): {t * 1e3:7.1f} ms  "
              f"({n_bytes / t / 1e9:5.1f} GB/s of weights)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
