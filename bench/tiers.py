"""Every ISA tier of this machine against torch at the same tier: one table per tier.

For each tier the machine has, a worker process runs with our cap (DFLASH_ISA) and torch's
(ONEDNN_MAX_CPU_ISA for bf16 matmul and SDPA, MKL_ENABLE_INSTRUCTIONS for fp32 matmul) at that tier,
so both sides may use the same instructions. Contenders alternate round by round and the medians are
compared, all at the same thread count:

- peak: register-only FMA, vdpbf16ps and AMX loops (dense.peak_gflops), the ceiling for the others;
- linear M=16 (a verification block) at Qwen3-8B and Qwen3-1.7B projection shapes, bf16 weights:
  "medium" against torch bf16 F.linear, "highest" against torch fp32 F.linear on fp32 weights;
- linear M=16 at small shapes, "highest", fp32 weights, against torch fp32;
- linear M=1 over a model step of DRAM-resident bf16 weights, against a streaming read;
- attention, 16 queries over 4096 keys, 32/8 heads x 128, fp32 and bf16 K/V, against SDPA at the
  same dtype: ours "highest" (exact products) and "medium" (bf16 operands, what SDPA does in bf16).

    python bench/tiers.py --threads 2 [--tiers avx2,amx] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
MKL_ISA = {"avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512", "amx": "AVX512"}

# (label, N, K) of the weights: Qwen3-8B q_proj / up_proj / down_proj and Qwen3-1.7B fused qkv /
# gate_up / down
BLOCK_SHAPES = [("8B q_proj", 4096, 4096), ("8B up_proj", 12288, 4096), ("8B down_proj", 4096, 12288),
                ("1.7B qkv", 4096, 2048), ("1.7B gate_up", 12288, 2048), ("1.7B down", 2048, 6144)]
SMALL_SHAPES = [("256x256", 256, 256), ("768x256", 768, 256)]


def _median_interleaved(fns: dict, rounds: int, inner: int = 1) -> dict:
    """Median seconds per call of each contender, the contenders alternating round by round."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(tier: str, threads: int, rounds: int, attention_only: bool = False) -> dict:
    import numpy as np
    import torch

    import dflash_kernels as dk

    torch.set_num_threads(threads)
    dense = dk.kernel_module("dense", "cython")
    assert dense.TIER == tier, (dense.TIER, tier)
    res = {"tier": tier, "threads": threads, "cpu": dk.runtime.cpu_model()}
    # the best of three 0.2 s runs: a register-only loop is only ever slowed down by the noise
    res["peak_fma"] = max(dense.peak_gflops("fma", threads, 0.2) for _ in range(3))
    res["peak_bf16dot"] = max(dense.peak_gflops("bf16dot", threads, 0.2) for _ in range(3))
    res["peak_amx"] = max(dense.peak_gflops("amx", threads, 0.2) for _ in range(3))
    res["bf16dot_taken"] = bool(dense.bf16dot_pays())
    if not attention_only:
        rng = np.random.default_rng(0)
        rows = []
        for label, n, k in BLOCK_SHAPES + SMALL_SHAPES:
            small = (label, n, k) in SMALL_SHAPES
            x = rng.standard_normal((16, k)).astype(np.float32)
            wf = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            wt = torch.from_numpy(wf)
            wb = wt.bfloat16()
            wb_np = wb.view(torch.int16).numpy().view(np.uint16)
            xt = torch.from_numpy(x)
            out = np.empty((16, n), np.float32)
            a = dict(x=x, xt=xt, wt=wt, wf=wf, wb=wb, wb_np=wb_np, out=out)  # this shape's operands
            paths = {}

            def ours(w, parts, key, a=a, paths=paths):
                """linear on the layout dk.prepare_weight gives a model at this tier (packed on FMA)"""
                w = dk.prepare_weight(w, backend="cython")
                if isinstance(w, dk.PackedWeight):
                    fn = lambda: dense.linear_packed(a["x"], w.data, None, a["out"], n_threads=threads, parts=parts)  # noqa: E731
                else:
                    fn = lambda: dense.linear(a["x"], w, None, a["out"], n_threads=threads, parts=parts)  # noqa: E731
                fn()
                paths[key] = dense.last_path()
                return fn

            fns = {"torch fp32": lambda a=a: torch.nn.functional.linear(a["xt"], a["wt"]),
                   "ours highest (fp32 w)": ours(wf, 3, "path_fp32")}
            if not small:
                fns.update({
                    "torch bf16": lambda a=a: torch.nn.functional.linear(a["xt"].bfloat16(), a["wb"]),
                    "ours medium": ours(wb_np, 1, "path_medium"),
                    "ours highest": ours(wb_np, 3, "path_highest"),
                    # the row-major layout, for the gain of packing where the tier packs
                    "row-major highest": lambda a=a: dense.linear(a["x"], a["wb_np"], None, a["out"],
                                                                  n_threads=threads, parts=3),
                })
            t = _median_interleaved(fns, rounds, inner=20 if small else 1)
            if not small:  # the same call back to back: the weights stay in L2/L3 (the kernel's own rate)
                t["ours highest, warm"] = _median_interleaved({"w": fns["ours highest"]}, rounds, inner=5)["w"]
            rows.append({"shape": label, "N": n, "K": k, "flops": 2 * 16 * n * k, **paths, **t})
        res["linear16"] = rows
        # M=1 from DRAM: bench/linear_dram.py's model step (Qwen3-1.7B, 28 layers + head) and stream read
        sys.path.insert(0, str(HERE))
        from linear_dram import model_step_gbs

        res["dram"] = model_step_gbs("Qwen3-1.7B", 28, threads, repeats=max(3, rounds // 2))
    # attention: 16 queries (a block) over 4096 keys, 32/8 heads x 128
    q = torch.randn(16, 32, 128)
    att = []
    for dtype in (torch.float32, torch.bfloat16):
        k, v = torch.randn(4096, 8, 128).to(dtype), torch.randn(4096, 8, 128).to(dtype)
        qd = q.to(dtype)
        mask = torch.ones(16, 4096, dtype=torch.bool).tril(4096 - 16)  # bottom-right causal
        qh, kh, vh = (a.transpose(0, 1).unsqueeze(0) for a in (qd, k, v))

        def sdpa(qh=qh, kh=kh, vh=vh, mask=mask):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)

        t = _median_interleaved({"sdpa": sdpa,
                                 "ours": lambda k=k, v=v: dk.cached_attention(q, k, v, causal=True,
                                                                              n_threads=threads),
                                 "ours medium": lambda k=k, v=v: dk.cached_attention(
                                     q, k, v, causal=True, precision="medium", n_threads=threads)}, rounds)
        att.append({"kv": str(dtype).replace("torch.", ""), **t})
    res["attention"] = att
    return res


def _table(r: dict) -> str:
    lines = [f"### Tier `{r['tier']}` ({r['cpu']}, {r['threads']} threads)", "",
             f"Register-only peaks: FMA {r['peak_fma']:.0f} GFLOP/s, vdpbf16ps {r['peak_bf16dot']:.0f} GFLOP/s, "
             f"AMX {r.get('peak_amx', 0):.0f} GFLOP/s "
             f"(bf16dot path {'taken' if r['bf16dot_taken'] else 'not taken: FMA is faster here'}).", ""]
    if "linear16" in r:
        lines += _linear_lines(r)
    lines += ["| attention 16 q x 4096 keys, 32/8 x 128 | ours highest / medium (ms) | SDPA (ms) | "
              "SDPA / ours highest | SDPA / ours medium |", "|---|---|---|---|---|"]
    for a in r["attention"]:
        lines.append(f"| {a['kv']} K/V | {a['ours'] * 1e3:.2f} / {a['ours medium'] * 1e3:.2f} | "
                     f"{a['sdpa'] * 1e3:.2f} | **{a['sdpa'] / a['ours']:.2f}x** | "
                     f"**{a['sdpa'] / a['ours medium']:.2f}x** |")
    return "\n".join(lines)


def _linear_lines(r: dict) -> list:
    lines = ["| linear M=16 | medium: ours / torch bf16 (ms) | ratio | path | highest: ours / torch fp32 (ms) "
             "| ratio | GFLOP/s (% of the path's peak) | path | row-major highest (ms) | warm: GFLOP/s (% of peak) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["linear16"]:
        hi = x.get("ours highest", x["ours highest (fp32 w)"])
        gf = x["flops"] / hi / 1e9
        med = (f"{x['ours medium'] * 1e3:.2f} / {x['torch bf16'] * 1e3:.2f} | "
               f"**{x['torch bf16'] / x['ours medium']:.2f}x** | {x['path_medium']}") if "ours medium" in x \
            else "- | - | -"
        path_hi = x["path_highest"] if "ours highest" in x else x["path_fp32"] + " (fp32 w)"
        # an AMX path is judged against the AMX ceiling (the FMA one would read over 100%)
        peak = r["peak_amx"] if ":amx" in path_hi and r.get("peak_amx") else r["peak_fma"]
        row = f"{x['row-major highest'] * 1e3:.3f}" if "row-major highest" in x else "-"
        warm = "-"
        if "ours highest, warm" in x:
            gw = x["flops"] / x["ours highest, warm"] / 1e9
            warm = f"{gw:.0f} ({100 * gw / peak:.0f}%)"
        lines.append(f"| {x['shape']} ({x['N']}x{x['K']}) | {med} | {hi * 1e3:.3f} / {x['torch fp32'] * 1e3:.3f} | "
                     f"**{x['torch fp32'] / hi:.2f}x** | {gf:.0f} ({100 * gf / peak:.0f}%) | {path_hi} | {row} | "
                     f"{warm} |")
    d = r["dram"]
    lines += ["", f"linear M=1 from DRAM ({d['shape']}, {d['gb']:.2f} GB of bf16 weights): row-major "
                  f"{d['gemv_gbs']:.1f} GB/s, packed {d['packed_gbs']:.1f} GB/s, against a streaming read of "
                  f"{d['stream_gbs']:.1f} GB/s: **{100 * d['gemv_gbs'] / d['stream_gbs']:.0f}% / "
                  f"{100 * d['packed_gbs'] / d['stream_gbs']:.0f}%**", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tiers", default=None, help="comma-separated (default: every tier this machine has)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--attention-only", action="store_true", help="only the peaks and the attention table")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.rounds, args.attention_only)))
        return 0
    from dflash_kernels import runtime

    machine = runtime.machine_tier()
    tiers = args.tiers.split(",") if args.tiers else list(runtime.TIERS[: runtime.TIERS.index(machine) + 1])
    results = []
    for tier in tiers:
        env = dict(os.environ, DFLASH_ISA=tier, ONEDNN_MAX_CPU_ISA=runtime.ONEDNN_ISA[tier],
                   MKL_ENABLE_INSTRUCTIONS=MKL_ISA[tier], DFLASH_NUM_THREADS=str(args.threads),
                   OMP_NUM_THREADS=str(args.threads))
        out = subprocess.run([sys.executable, __file__, "--worker", tier, "--threads", str(args.threads),
                              "--rounds", str(args.rounds), *(["--attention-only"] if args.attention_only else [])],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        print(_table(r) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
