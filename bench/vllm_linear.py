"""The plugin's linear against vLLM's own CPU GEMM, per projection shape, in vLLM's environment.

vLLM gives every unquantized linear layer a `cpu_linear` at load (`dispatch_cpu_unquantized_gemm`:
oneDNN's prepacked matmul on x86, zentorch on a Zen build, sgl-kernel for small weights); the plugin
replaces it with `torch.ops.dflash.linear_packed` over weights packed once. This script builds the
layers of one model shape both ways from the same bf16 weights and times the two `cpu_linear`s
alternately, round by round, at the rows a DFlash round runs (1: an autoregressive step; k + 1:
a verification or draft block), so a round's time can be split by shape:

    /work/vllm-venv/bin/python bench/vllm_linear.py --shape Qwen3-1.7B --rows 1,16 --threads 2

--overhead-only prints only what one call costs beyond the kernel (a 64 x 64 weight, one bf16 row).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scale import SHAPES, _median  # noqa: E402
from tiers import _median_interleaved  # noqa: E402


def layer_shapes(name: str) -> list[tuple[str, int, int]]:
    """(label, N, K) of one decoder layer's projections as vLLM fuses them, and the LM head."""
    s = SHAPES[name]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [("qkv", q + 2 * kv, s.hidden), ("o", s.hidden, q), ("gate_up", 2 * s.intermediate, s.hidden),
            ("down", s.hidden, s.intermediate), ("lm_head", s.vocab, s.hidden)]


def print_call_overhead(plugin, g) -> None:
    """What a call costs beyond the kernel, at a 64 x 64 bf16 weight and one bf16 row: the layer's
    cpu_linear (eager), the custom op it is when traced, and linear on fp32 numpy."""
    import torch

    import dflash_kernels as dk

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16), requires_grad=False)
    assert plugin.route_linear(layer, True)
    kw = layer.cpu_linear.keywords
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    xf = x.float().numpy()
    us = {"cpu_linear (eager)": _median(lambda: layer.cpu_linear(x, layer.weight, None), 300) * 1e6,
          "torch.ops.dflash.linear_packed": _median(lambda: torch.ops.dflash.linear_packed(
              x, kw["packed"], 64, 64, True, None, "medium", kw["n_threads"]), 300) * 1e6,
          "dk.linear, bf16 tensor": _median(lambda: dk.linear(x, kw["prepared"], precision="medium",
                                                               n_threads=kw["n_threads"]), 300) * 1e6,
          "dk.linear, fp32 numpy": _median(lambda: dk.linear(xf, kw["prepared"], precision="medium"), 300) * 1e6}
    print("per call at 64 x 64, M = 1: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="Qwen3-1.7B", choices=sorted(n for n in SHAPES if n.startswith("Qwen3-")))
    ap.add_argument("--rows", default="1,16", help="comma list of M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--overhead-only", action="store_true", help="print the per-call costs only, no shape table")
    args = ap.parse_args(argv)

    import torch
    from vllm.model_executor.layers import utils

    import dflash_kernels as dk
    from dflash_kernels import vllm as plugin

    torch.set_num_threads(args.threads)
    print(f"{args.shape}, bf16 weights, {args.threads} threads, tier {dk.active_tier()}, torch {torch.__version__}")
    print("| layer (N x K) | M | vLLM cpu_linear (ms) | plugin (ms) | plugin / vLLM | plugin path |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    dense = dk.kernel_module("dense", "cython")
    print_call_overhead(plugin, g)
    if args.overhead_only:
        return 0
    for label, n, k in layer_shapes(args.shape):
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        theirs, ours = torch.nn.Module(), torch.nn.Module()
        theirs.weight = torch.nn.Parameter(w, requires_grad=False)
        ours.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        utils.dispatch_cpu_unquantized_gemm(theirs, True)
        assert plugin.route_linear(ours, True)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            fns = {"vllm": lambda x=x, lay=theirs: lay.cpu_linear(x, lay.weight, None),
                   "plugin": lambda x=x, lay=ours: lay.cpu_linear(x, lay.weight, None)}
            med = _median_interleaved(fns, args.rounds)
            a, b = (med[key] * 1e3 for key in ("vllm", "plugin"))
            print(f"| {label} ({n} x {k}) | {m} | {a:.3f} | {b:.3f} | {b / a:.2f} | "
                  f"{dense.packed_path_name(m, True, 1)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
