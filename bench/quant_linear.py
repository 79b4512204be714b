"""linear over GGUF Q4_1 blocks (dk.pack_quantized), exact and times int8 activations, against the same
weights expanded to bf16 panels.

A SmolLM2-135M-shaped stack of 30 layers' projections (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536: 106 M weights, 66 MB as Q4_1 blocks, 212 MB as bf16), random weights
quantized by gguf-py; each timing runs x (M rows) through all 120 matmuls once, so the weights stream
from DRAM as in a decode step. The three layouts alternate round by round; medians, and the ratios.

    python bench/quant_linear.py --threads 2 --m 1,3,5,16,64
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
    from gguf import GGMLQuantizationType, quants

    import dflash_kernels as dk

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--m", default="1,3,5,16,64", help="comma-separated row counts")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    raw = {s: quants.quantize((rng.standard_normal(s) * 0.05).astype(np.float32), GGMLQuantizationType.Q4_1)
           for s in shapes}
    stacks = {"q4_1 blocks": [], "q4_1 x int8": [], "bf16": []}
    for _ in range(30):
        for s in shapes:
            rows = dk.QuantizedRows.from_bytes(raw[s].copy(), s, "Q4_1")
            stacks["q4_1 blocks"].append(dk.pack_quantized(rows))
            stacks["q4_1 x int8"].append(dk.pack_quantized(rows, activations="int8"))
            stacks["bf16"].append(dk.pack_weight(dk.f32_to_bf16(rows.dequantize())))
    mb = {name: sum(w.nbytes for w in ws) / 1e6 for name, ws in stacks.items()}
    print(f"tier {dk.active_tier()}, {args.threads} threads; {mb['q4_1 blocks']:.0f} MB of Q4_1 blocks, "
          f"{mb['bf16']:.0f} MB of bf16\n")
    print("| M | Q4_1 blocks (ms) | x int8 (ms) | bf16 (ms) | blocks / bf16 | x int8 / blocks | x int8 / bf16 | "
          "blocks, x int8, bf16 GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (int(v) for v in args.m.split(",")):
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in (576, 1536)}
        times = {name: [] for name in stacks}
        for _ in range(args.rounds):
            for name, ws in stacks.items():
                t = time.perf_counter()
                for w in ws:
                    dk.linear(xs[w.shape[1]], w, n_threads=args.threads)
                times[name].append(time.perf_counter() - t)
        q, i8, b = (float(np.median(times[n])) for n in stacks)
        print(f"| {m} | {q * 1e3:.2f} | {i8 * 1e3:.2f} | {b * 1e3:.2f} | **{q / b:.2f}** | **{i8 / q:.2f}** | "
              f"{i8 / b:.2f} | {mb['q4_1 blocks'] / q / 1e3:.1f}, {mb['q4_1 x int8'] / i8 / 1e3:.1f}, "
              f"{mb['bf16'] / b / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
