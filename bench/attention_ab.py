"""Two builds of one tier's attention module, side by side in one process (see bench/linear_ab.py).

Build the other version in a worktree (DFLASH_TIERS=<tier> DFLASH_ONLY=attention setup.py
build_ext --inplace), then:

    python bench/attention_ab.py /path/to/worktree/dflash_kernels/_cython/avx512_bf16/attention*.so

The two modules' cached_attention run alternately, round by round, on the same fp32 and bf16 K/V:
a verification block (16 queries over 4096 keys, 32/8 heads x 128, bottom-right causal), a decode
step (1 query), a short cache (16 queries over 512 keys) and a short block (3 queries: 12 packed rows
per kv head). Outputs are compared bit for bit and,
when they differ, by their largest relative difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dflash_kernels.runtime import PRECISIONS  # noqa: E402
from linear_ab import load_other  # noqa: E402
from tiers import _median_interleaved  # noqa: E402

# (label, T_q, T_kv, H_q, H_kv, D)
SHAPES = [("verify 16 q x 4096", 16, 4096, 32, 8, 128), ("decode 1 q x 4096", 1, 4096, 32, 8, 128),
          ("verify 16 q x 512", 16, 512, 32, 8, 128), ("verify 3 q x 4096", 3, 4096, 32, 8, 128)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", help="the other build's attention extension module (.so) of the same tier")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--precision", default="highest", choices=tuple(PRECISIONS),
                    help="both builds must know it unless it is the default, highest")
    args = ap.parse_args(argv)
    extra = {} if args.precision == "highest" else {"parts": PRECISIONS[args.precision]}

    import dflash_kernels as dk
    from dflash_kernels import f32_to_bf16

    # the other build asks its tier's dense module whether vdpbf16ps and AMX pay ("medium"): give it
    # this checkout's, so that both builds take the same path decision
    sys.modules["other_build.dense"] = dk.kernel_module("dense", "cython")
    this, other = dk.kernel_module("attention", "cython"), load_other(args.other, "attention")
    tier = this.__name__.split(".")[-2]  # dflash_kernels._cython.<tier>.attention
    if Path(args.other).parent.name != tier:
        raise SystemExit(f"other: {args.other}, this checkout runs tier {tier}; cap it with DFLASH_ISA")
    rng = np.random.default_rng(0)
    print(f"tier {tier}, {args.precision}, {args.threads} threads")
    print("| shape | K/V | other (ms) | this (ms) | this / other | outputs |")
    print("|---|---|---|---|---|---|")
    for label, t_q, t_kv, h_q, h_kv, d in SHAPES:
        q = rng.standard_normal((t_q, h_q, d)).astype(np.float32)
        k32, v32 = (rng.standard_normal((t_kv, h_kv, d)).astype(np.float32) for _ in range(2))
        for kv, k, v in (("fp32", k32, v32), ("bf16", f32_to_bf16(k32), f32_to_bf16(v32))):
            outs = {key: np.empty_like(q) for key in ("other", "this")}
            fns = {key: (lambda mod=mod, o=outs[key], q=q, k=k, v=v, scale=d ** -0.5:
                         mod.cached_attention(q, k, v, o, n_threads=args.threads, causal=True, scale=scale,
                                              window=None, **extra))
                   for key, mod in (("other", other), ("this", this))}
            med = _median_interleaved(fns, args.rounds)
            a, b = (med[key] * 1e3 for key in ("other", "this"))
            diff = np.abs(outs["this"] - outs["other"]).max() / np.abs(outs["other"]).max()
            same = "identical" if np.array_equal(outs["other"], outs["this"]) else f"max rel diff {diff:.1e}"
            print(f"| {label} | {kv} | {a:.3f} | {b:.3f} | {b / a:.3f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
