"""Scale benchmark: random-weight bf16 checkpoints at real Qwen3 shapes with a matching 5-layer DFlash
drafter (written on the fly to a temporary directory, never committed).

Measures, side by side in one process: T_ar (one decode step: target forward + greedy choice),
T_draft(k) (drafter block forward + token choice), T_verify(k) (target forward over k+1 rows + greedy),
T_accept (accept_greedy + cache cut + drafter context append) and the projected speedup
tau(k) * T_ar / (T_draft(k) + T_verify(k) + T_accept) (dflash.md 5) for a given tau table; and the
AR step against the weight-streaming roofline (bytes read per step / streaming read bandwidth measured
in the same run).

    python bench/scale.py --shape Qwen3-1.7B --tau-json trained_tau.json --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from shapes import QWEN3_0_6B, QWEN3_1_7B, QWEN3_8B  # noqa: E402

SHAPES = {s.name: s for s in (QWEN3_0_6B, QWEN3_1_7B, QWEN3_8B)}
PUBLISHED_TAU = {15: 6.93}  # Qwen3.5-9B-DFlash on HumanEval (dflash.md 8)


def _randn_bf16(*shape, std=0.02, gen=None):
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def write_pair(root: Path, s, draft_layers: int = 5, seed: int = 0) -> tuple[Path, Path]:
    """A random target at shape `s` (tied embeddings as in the real 0.6B/1.7B) and a 5-layer drafter."""
    gen = torch.Generator().manual_seed(seed)
    t_dir, d_dir = root / "target", root / "drafter"
    t_dir.mkdir(parents=True)
    d_dir.mkdir(parents=True)
    h, i, hd, nh, nkv = s.hidden, s.intermediate, s.head_dim, s.heads, s.kv_heads
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=h, intermediate_size=i,
               num_hidden_layers=s.layers, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
               vocab_size=s.vocab, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
               tie_word_embeddings=s.hidden < 4096, torch_dtype="bfloat16", hidden_act="silu",
               attention_bias=False, bos_token_id=151643, eos_token_id=151645)
    (t_dir / "config.json").write_text(json.dumps(cfg))

    def layer(prefix):
        return {
            f"{prefix}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{prefix}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{prefix}self_attn.q_proj.weight": _randn_bf16(nh * hd, h, gen=gen),
            f"{prefix}self_attn.k_proj.weight": _randn_bf16(nkv * hd, h, gen=gen),
            f"{prefix}self_attn.v_proj.weight": _randn_bf16(nkv * hd, h, gen=gen),
            f"{prefix}self_attn.o_proj.weight": _randn_bf16(h, nh * hd, gen=gen),
            f"{prefix}self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            f"{prefix}self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            f"{prefix}mlp.gate_proj.weight": _randn_bf16(i, h, gen=gen),
            f"{prefix}mlp.up_proj.weight": _randn_bf16(i, h, gen=gen),
            f"{prefix}mlp.down_proj.weight": _randn_bf16(h, i, gen=gen),
        }

    tensors = {"model.embed_tokens.weight": _randn_bf16(s.vocab, h, std=1.0, gen=gen),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = _randn_bf16(s.vocab, h, gen=gen)
    for li in range(s.layers):
        tensors.update(layer(f"model.layers.{li}."))
    save_file(tensors, str(t_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    taps = [round(1 + j * (s.layers - 4) / (draft_layers - 1)) for j in range(draft_layers)]
    dcfg = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                "hidden_act", "attention_bias")}
    dcfg.update(architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=draft_layers,
                num_target_layers=s.layers, block_size=16, tie_word_embeddings=False, torch_dtype="bfloat16",
                layer_types=["full_attention"] * draft_layers,
                dflash_config={"mask_token_id": 151669, "target_layer_ids": taps, "block_size": 16})
    (d_dir / "config.json").write_text(json.dumps(dcfg))
    dt = {"fc.weight": _randn_bf16(h, len(taps) * h, gen=gen), "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
          "norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for li in range(draft_layers):
        dt.update(layer(f"layers.{li}."))
    save_file(dt, str(d_dir / "model.safetensors"), metadata={"format": "pt"})
    return t_dir, d_dir


def stream_read_gbs(n_bytes: int, n_threads: int, repeats: int = 5) -> float:
    """Streaming read bandwidth over a buffer of the given size (Numba parallel sum)."""
    import numba

    @numba.njit(parallel=True, cache=False, fastmath=True)
    def _sum(a):
        acc = 0.0
        for j in numba.prange(a.shape[0]):
            acc += a[j]
        return acc

    buf = np.ones(n_bytes // 4, np.float32)
    numba.set_num_threads(n_threads)
    _sum(buf)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _sum(buf)
        times.append(time.perf_counter() - t)
    return n_bytes / statistics.median(times) / 1e9


def _median(fn, n):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(target_dir, drafter_dir, *, n_threads, context=256, repeats=7, ks=range(1, 16)) -> dict:
    from dflash_kernels.model import load

    eng = load(target_dir, drafter_dir, n_threads=n_threads, max_len=context + 64)
    tgt, dr = eng.target, eng.drafter
    cache, ctx = tgt.new_cache(context + 64), dr.new_cache(context + 64)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 151643, context).tolist()
    _, taps = tgt.forward(prompt, cache, last_only=True, taps=True)
    dr.add_context(taps, ctx)
    base = cache.length
    anchor = int(prompt[-1])

    def ar_step():
        h, _ = tgt.forward([anchor], cache, taps=False)
        tgt.greedy(h)
        cache.truncate(base)

    res = {"context": context, "t_ar_s": _median(ar_step, repeats), "k": {}}
    for k in ks:
        drafts = dr.draft(anchor, k, ctx)
        block = np.concatenate([[anchor], drafts]).astype(np.int64)

        def verify():
            h, _ = tgt.forward(block, cache, taps=True)
            tgt.greedy(h)
            cache.truncate(base)

        h, vt = tgt.forward(block, cache, taps=True)
        choice = tgt.greedy(h)
        cache.truncate(base)
        n_ctx = ctx.length

        def accept():
            n_acc, _ = eng.ops.accept_greedy(drafts[None], choice[None])
            cache.length = base + k + 1  # as after a verification
            cache.truncate(base + int(np.asarray(n_acc)[0]) + 1)
            dr.add_context(vt[: int(np.asarray(n_acc)[0]) + 1], ctx)
            ctx.length = n_ctx
            cache.truncate(base)

        res["k"][k] = {"t_draft_s": _median(lambda: dr.draft(anchor, k, ctx), repeats),
                       "t_verify_s": _median(verify, repeats), "t_accept_s": _median(accept, repeats)}
    return res


def projected(res: dict, tau: dict) -> dict:
    out = {}
    for k, t in tau.items():
        r = res["k"].get(int(k))
        if r:
            out[int(k)] = tau[k] * res["t_ar_s"] / (r["t_draft_s"] + r["t_verify_s"] + r["t_accept_s"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="Qwen3-0.6B", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tau-json", help="measured tau per k, e.g. from `dflash tune` ({k: tau})")
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args(argv)
    s = SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="dflash_scale_") as tmp:
        t0 = time.time()
        t_dir, d_dir = write_pair(Path(tmp), s)
        print(f"wrote random {s.name} pair in {time.time() - t0:.0f} s", file=sys.stderr)
        res = measure(t_dir, d_dir, n_threads=args.threads, context=args.context, repeats=args.repeats)
    per_layer = 2 * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.hidden * s.heads * s.head_dim
                     + 3 * s.hidden * s.intermediate)
    step_bytes = s.layers * per_layer + 2 * s.vocab * s.hidden  # bf16 weights + the LM head read per step
    kv_bytes = s.layers * 2 * args.context * s.kv_heads * s.head_dim * 4
    gbs = stream_read_gbs(min(step_bytes, 2 << 30), args.threads)
    res.update(shape=s.name, threads=args.threads, step_weight_bytes=step_bytes, kv_bytes=kv_bytes,
               stream_read_gbs=gbs, roofline_step_s=(step_bytes + kv_bytes) / gbs / 1e9)
    res["ar_vs_roofline"] = res["t_ar_s"] / res["roofline_step_s"]
    res["projected_published"] = projected(res, PUBLISHED_TAU)
    if args.tau_json:
        res["tau_measured"] = {int(k): v for k, v in json.loads(Path(args.tau_json).read_text()).items()}
        res["projected_measured"] = projected(res, res["tau_measured"])
    print(f"{s.name}: T_ar {res['t_ar_s'] * 1e3:.1f} ms, roofline {res['roofline_step_s'] * 1e3:.1f} ms "
          f"({res['ar_vs_roofline']:.2f}x), stream read {gbs:.1f} GB/s")
    print("| k | T_draft ms | T_verify ms | T_accept ms | verify/AR | projected (tau 6.93 at 15) | projected (measured tau) |")
    print("|---|---|---|---|---|---|---|")
    for k, r in res["k"].items():
        pm = res.get("projected_measured", {}).get(k)
        pp = res["projected_published"].get(k)
        print(f"| {k} | {r['t_draft_s'] * 1e3:.1f} | {r['t_verify_s'] * 1e3:.1f} | {r['t_accept_s'] * 1e3:.2f} | "
              f"{r['t_verify_s'] / res['t_ar_s']:.2f} | {f'{pp:.2f}x' if pp else '-'} | {f'{pm:.2f}x' if pm else '-'} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
