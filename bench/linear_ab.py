"""Two builds of one tier's dense module, side by side in one process: for tuning a kernel on a noisy
machine, where runs of the same command one after the other differ by more than the change.

Build the other version in a worktree (DFLASH_TIERS=<tier> setup.py build_ext --inplace), then:

    python bench/linear_ab.py /path/to/worktree/dflash_kernels/_cython/avx512_bf16/dense*.so \
        --precision medium --rows 16

The two modules' linear_packed run alternately, round by round, over the same packed weights (Qwen3
projection shapes and a Qwen3-1.7B LM head) and their outputs are compared bit for bit; "this" is
the module of the active tier in this checkout (cap it with DFLASH_ISA to match the other build).
--dram times a model step's worth of packed weights instead (Qwen3-1.7B: 28 layers and the LM head,
3.4 GB, streamed from DRAM as in decoding and verification), as GB/s of weights read.
--torch adds torch's F.linear on the same weights (bf16 below "highest", fp32 for "highest") as a
third contender, and each row gives this build's rate against the path's register-only peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dflash_kernels.runtime import PRECISIONS  # noqa: E402
from tiers import BLOCK_SHAPES, _median_interleaved  # noqa: E402

LM_HEAD = ("1.7B lm_head", 151936, 2048)


def load_other(path: str, stem: str = "dense"):
    """The other build's module `stem`, under a name of its own (its init function is PyInit_<stem>)."""
    spec = importlib.util.spec_from_file_location(f"other_build.{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", help="the other build's dense extension module (.so) of the same tier")
    ap.add_argument("--precision", default="medium", choices=tuple(PRECISIONS))
    ap.add_argument("--rows", type=int, default=16, help="M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--torch", action="store_true", help="also time torch F.linear on the same weights")
    ap.add_argument("--dram", action="store_true", help="a Qwen3-1.7B step's weights from DRAM instead")
    args = ap.parse_args(argv)

    import dflash_kernels as dk

    this, other = dk.kernel_module("dense", "cython"), load_other(args.other)
    if other.TIER != this.TIER:
        raise SystemExit(f"other: tier {other.TIER}, this checkout runs {this.TIER}; cap it with DFLASH_ISA")
    for module in (this, other):  # the same path decision in both, whatever each measured
        module.set_bf16dot_enabled(this.bf16dot_pays())
    parts, m = PRECISIONS[args.precision], args.rows
    rng = np.random.default_rng(0)
    path = this.packed_path_name(m, True, parts)
    print(f"tier {this.TIER}, {args.precision}, M = {m}, {args.threads} threads, path {path}")
    if args.dram:
        return _dram_step(this, other, m, parts, args, rng)
    peak = this.peak_gflops("amx" if ":amx" in path else "bf16dot" if "bf16dot" in path else "fma", args.threads)
    extra = " torch (ms) | torch / this | this GFLOP/s (% of peak) |" if args.torch else ""
    print("| shape (N x K) | other (ms) | this (ms) | this / other |" + extra)
    print("|---|---|---|---|" + ("---|---|---|" if args.torch else ""))
    if args.torch:
        import torch

        torch.set_num_threads(args.threads)
    for label, n, k in [*BLOCK_SHAPES, LM_HEAD]:
        bits = rng.integers(0x3C00, 0x3C80, size=(n, k), dtype=np.uint16)
        packed = dk.pack_weight(bits)
        x = rng.standard_normal((m, k)).astype(np.float32)
        outs = {"other": np.empty((m, n), np.float32), "this": np.empty((m, n), np.float32)}
        fns = {key: (lambda mod=mod, o=outs[key], x=x, w=packed.data:
                     mod.linear_packed(x, w, None, o, n_threads=args.threads, parts=parts))
               for key, mod in (("other", other), ("this", this))}
        if args.torch:  # what an engine on torch computes: bf16 x bf16 below "highest", else fp32
            dtype = torch.float32 if args.precision == "highest" else torch.bfloat16
            wt = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(dtype)
            xt = torch.from_numpy(x).to(dtype)
            fns["torch"] = lambda xt=xt, wt=wt: torch.nn.functional.linear(xt, wt)
        med = _median_interleaved(fns, args.rounds)
        a, b = (med[key] * 1e3 for key in ("other", "this"))
        same = "" if np.array_equal(outs["other"], outs["this"]) else " (outputs differ)"
        row = f"| {label} ({n} x {k}) | {a:.3f} | {b:.3f} | {b / a:.3f}{same} |"
        if args.torch:
            gf = 2.0 * m * n * k / med["this"] / 1e9
            row += (f" {med['torch'] * 1e3:.3f} | {med['torch'] / med['this']:.2f}x | "
                    f"{gf:.0f} ({100 * gf / peak:.0f}%) |")
        print(row, flush=True)
    return 0


def _dram_step(this, other, m: int, parts: int, args, rng) -> int:
    """Both builds over one model step of DRAM-resident packed weights, alternating; GB/s of weights."""
    import dflash_kernels as dk
    from linear_dram import _weights
    from scale import SHAPES

    packed = [dk.pack_weight(w) for w in _weights(SHAPES["Qwen3-1.7B"], 28, True, rng)]
    n_bytes = sum(p.data.nbytes for p in packed)
    xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in {p.shape[1] for p in packed}}
    outs = {key: [np.empty((m, p.shape[0]), np.float32) for p in packed] for key in ("other", "this")}

    def step(mod, key):
        for p, o in zip(packed, outs[key], strict=True):
            mod.linear_packed(xs[p.shape[1]], p.data, None, o, n_threads=args.threads, parts=parts)

    med = _median_interleaved({"other": lambda: step(other, "other"), "this": lambda: step(this, "this")},
                              args.rounds)
    same = all(np.array_equal(a, b) for a, b in zip(outs["other"], outs["this"], strict=True))
    print(f"Qwen3-1.7B step, {n_bytes / 1e9:.2f} GB of packed weights: other {n_bytes / med['other'] / 1e9:.1f} "
          f"GB/s, this {n_bytes / med['this'] / 1e9:.1f} GB/s, this / other time {med['this'] / med['other']:.3f}"
          f"{'' if same else ' (outputs differ)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
