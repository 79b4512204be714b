"""Kernel validation on this hardware: every compiled backend against the torch reference.

`dflash validate` (and `python -m dflash_kernels.validate`) runs each op on randomized inputs at
realistic and odd shapes, with float32 and bf16 storage and every matmul precision, and prints a
pass/fail table. The Cython kernels run at every ISA tier this machine supports (through the cap,
``set_isa``), each a row of its own. Floats are compared as max |kernel - reference| /
rms(reference) against the float32 reference backend; token ids and accept counts exactly.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _isa
from ._backends import available_backends
from ._config import config_lines
from ._tensors import f32_to_bf16


@dataclass
class Check:
    name: str
    run: Callable[[str], object]  # backend -> result (array or tuple of arrays)
    exact: bool = False
    rtol: float = 2e-4


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    return f32_to_bf16(x) if dtype == "bfloat16" else x


def _checks(seed: int) -> list[Check]:
    import dflash_kernels as dk

    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    checks: list[Check] = []
    for dt in ("float32", "bfloat16"):
        # attention: drafter shape (GQA 4:1, d 128) and an odd one
        for t_q, t_ctx, hq, hkv, d in ((16, 1000, 32, 8, 128), (5, 0, 6, 2, 64), (3, 77, 8, 1, 256)):
            q = f(t_q, hq, d)
            kc, vc = _store(f(t_ctx, hkv, d), dt), _store(f(t_ctx, hkv, d), dt)
            kb, vb = _store(f(t_q, hkv, d), dt), _store(f(t_q, hkv, d), dt)
            checks.append(Check(f"injected_kv_attention {dt} q{t_q} ctx{t_ctx} {hq}/{hkv}x{d}",
                                lambda b, a=(q, kc, vc, kb, vb): dk.injected_kv_attention(*a, backend=b)))
            checks.append(Check(f"injected_kv_attention causal+window {dt} q{t_q} ctx{t_ctx}",
                                lambda b, a=(q, kc, vc, kb, vb): dk.injected_kv_attention(
                                    *a, causal_block=True, window=64, backend=b)))
        for t_q, t_kv in ((1, 4096), (16, 2000), (40, 40)):
            q = f(t_q, 32, 128)
            kv = (_store(f(t_kv, 8, 128), dt), _store(f(t_kv, 8, 128), dt))
            checks.append(Check(f"cached_attention {dt} q{t_q} kv{t_kv}",
                                lambda b, a=(q, *kv): dk.cached_attention(*a, backend=b)))
            # "medium": bf16 operands; the reference rounds P at the row max, the kernels at each key
            # tile's running max, each within 2^-9 relative (docs/conventions.md). Measured: max err /
            # rms 4e-3 to 9e-3 (the max over 65k outputs is ~4.5 rms); a broken path is off by O(1).
            checks.append(Check(f"cached_attention {dt} medium q{t_q} kv{t_kv}",
                                lambda b, a=(q, *kv): dk.cached_attention(*a, precision="medium", backend=b),
                                rtol=2e-2))
        # dense
        for m, n, k in ((1, 4096, 1024), (16, 1000, 1024), (7, 33, 130)):
            x, w = f(m, k), _store(f(n, k, s=0.05), dt)
            checks.append(Check(f"linear {dt} {m}x{k}->{n}", lambda b, a=(x, w): dk.linear(*a, backend=b)))
            # the packed layout the model layer uses (dk.prepare_weight); Numba reads it unpacked
            packed = dk.pack_weight(w)
            checks.append(Check(f"linear packed {dt} {m}x{k}->{n}",
                                lambda b, a=(x, packed): dk.linear(*a, backend=b)))
            if dt == "bfloat16":
                for prec in ("high", "medium"):
                    checks.append(Check(f"linear {dt} {prec} {m}x{k}->{n}",
                                        lambda b, a=(x, w), p=prec: dk.linear(*a, precision=p, backend=b)))
                    checks.append(Check(f"linear packed {dt} {prec} {m}x{k}->{n}",
                                        lambda b, a=(x, packed), p=prec: dk.linear(*a, precision=p, backend=b)))
        if dt == "float32":  # GGUF blocks read as stored (dk.pack_quantized); the reference expands them
            from gguf import GGMLQuantizationType, quants

            for qtype in ("Q4_1", "Q8_0"):
                for m, n, k in ((1, 4096, 1024), (16, 1000, 1024), (9, 33, 128)):
                    x, w = f(m, k), f(n, k, s=0.05)
                    rows = dk.QuantizedRows.from_bytes(quants.quantize(w, getattr(GGMLQuantizationType, qtype)),
                                                       (n, k), qtype)
                    packed = dk.pack_quantized(rows)
                    checks.append(Check(f"linear {qtype} blocks {m}x{k}->{n}",
                                        lambda b, a=(x, packed): dk.linear(*a, backend=b)))
                    if qtype == "Q4_1":  # times int8 activations: one arithmetic, the same bits everywhere
                        int8 = dk.pack_quantized(rows, activations="int8")
                        checks.append(Check(f"linear {qtype} blocks x int8 {m}x{k}->{n}",
                                            lambda b, a=(x, int8): dk.linear(*a, backend=b), exact=True))
        x, w = f(16, 4096), _store(1 + f(4096, s=0.1), dt)
        checks.append(Check(f"rms_norm {dt} 16x4096", lambda b, a=(x, w): dk.rms_norm(*a, 1e-6, backend=b)))
        gu = _store(f(16, 2 * 3072), dt)
        checks.append(Check(f"silu_and_mul {dt} 16x3072", lambda b, a=gu: dk.silu_and_mul(a, backend=b)))
        # denoise (exact token ids)
        h, lm = f(16, 256), _store(f(5000, 256), dt)
        checks.append(Check(f"denoise_block greedy {dt} 16x256 V5000",
                            lambda b, a=(h, lm): dk.denoise_block(*a, backend=b), exact=True))
        checks.append(Check(f"denoise_block greedy medium {dt} 16x256 V5000",
                            lambda b, a=(h, lm): dk.denoise_block(*a, precision="medium", backend=b),
                            exact=True))
        checks.append(Check(f"denoise_block T=0.7 {dt} 16x256 V5000",
                            lambda b, a=(h, lm): dk.denoise_block(*a, temperature=0.7, generator=seed, backend=b),
                            exact=True))
    pos = np.arange(100, 116)
    xr = f(16, 32, 128)
    checks.append(Check("apply_rope 16x32x128 theta 1e6", lambda b: dk.apply_rope(xr, pos, 1e6, backend=b)))
    xp = f(16, 4, 256)
    checks.append(Check("apply_rope partial 64/256 theta 1e7",
                        lambda b, x=xp: dk.apply_rope(x, pos, 1e7, rotary_dim=64, backend=b)))
    llama3 = dk.rope_inv_freq(5e5, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    checks.append(Check("apply_rope llama3-scaled 16x32x128",
                        lambda b: dk.apply_rope(xr, pos + 20000, 5e5, inv_freq=llama3, backend=b)))
    # Qwen3.5 Gated DeltaNet (state updated in place: each backend gets its own copy)
    for t in (1, 16, 100):
        gq, gk, gv = f(t, 4, 64), f(t, 4, 64), f(t, 8, 64)
        gg = -np.abs(f(t, 8, s=0.5))
        gb = 1 / (1 + np.exp(-f(t, 8)))
        s0 = f(8, 64, 64, s=0.1)

        def gdn(b, a=(gq, gk, gv, gg, gb), s0=s0):
            st = s0.copy()
            return dk.gated_delta_rule(*a, st, backend=b), st

        checks.append(Check(f"gated_delta_rule T={t} 4/8 heads 64x64", gdn))
        xc, wc, c0 = f(t, 96), f(96, 4, s=0.5), f(96, 3)

        def conv(b, a=(xc, wc), c0=c0):
            cs = c0.copy()
            return dk.causal_conv1d(*a, cs, backend=b), cs

        checks.append(Check(f"causal_conv1d T={t} C=96 K=4", conv))
    # fused decoder layers: a Qwen3 target layer (K/V appended to its cache) and a DFlash drafter layer
    # (over an injected context), bf16 weights, prepared per backend (packed where Cython runs)
    H, hq, hkv, d, inter = 256, 4, 2, 64, 512
    lw = {"input_layernorm.weight": 1 + f(H, s=0.1), "post_attention_layernorm.weight": 1 + f(H, s=0.1),
          "self_attn.q_norm.weight": 1 + f(d, s=0.1), "self_attn.k_norm.weight": 1 + f(d, s=0.1)}
    for name, shape in (("self_attn.q_proj", (hq * d, H)), ("self_attn.k_proj", (hkv * d, H)),
                        ("self_attn.v_proj", (hkv * d, H)), ("self_attn.o_proj", (H, hq * d)),
                        ("mlp.gate_proj", (inter, H)), ("mlp.up_proj", (inter, H)), ("mlp.down_proj", (H, inter))):
        lw[name + ".weight"] = _store(f(*shape, s=0.05), "bfloat16")
    lx, k0, v0 = f(16, H), f(64, hkv, d), f(64, hkv, d)

    def layer(b, causal=True):
        return dk.prepare_qwen3_layer(lw, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                                      causal=causal, backend=b)

    def target_layer(b):
        kc, vc = k0.copy(), v0.copy()
        return dk.qwen3_layer(lx, layer(b), kc, vc, 40, backend=b), kc, vc

    checks.append(Check(f"qwen3_layer 16 rows after 40, {hq}/{hkv}x{d}, H {H}", target_layer))
    checks.append(Check(f"drafter_layer 16 rows over 40, {hq}/{hkv}x{d}, H {H}",
                        lambda b: dk.drafter_layer(lx, layer(b, causal=False), k0[:40], v0[:40], backend=b)))
    # Qwen3.5: a gated full-attention layer (q_proj [query | gate] per head, partial RoPE, (1 + w) norms)
    # and a Gated DeltaNet layer (its conv and recurrent states advanced in place)
    gw = {**lw, "self_attn.q_proj.weight": _store(f(2 * hq * d, H, s=0.05), "bfloat16")}

    def gated_layer(b):
        kc, vc = k0.copy(), v0.copy()
        gl = dk.prepare_qwen3_layer(gw, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, norm_offset=1.0,
                                    output_gate=True, rotary_dim=d // 4, backend=b)
        return dk.qwen3_layer(lx, gl, kc, vc, 40, backend=b), kc, vc

    checks.append(Check(f"qwen3_layer, Qwen3.5 gated, 16 rows after 40, {hq}/{hkv}x{d}, H {H}", gated_layer))
    n_k, n_v, d_k, d_v = 2, 4, 32, 48
    C, vd = 2 * n_k * d_k + n_v * d_v, n_v * d_v
    nw = {k: v for k, v in lw.items() if k.startswith(("mlp.", "input_", "post_"))}
    for name, shape in (("in_proj_qkv", (C, H)), ("in_proj_z", (vd, H)), ("in_proj_b", (n_v, H)),
                        ("in_proj_a", (n_v, H)), ("out_proj", (H, vd))):
        nw[f"linear_attn.{name}.weight"] = _store(f(*shape, s=0.05), "bfloat16")
    nw.update({"linear_attn.conv1d.weight": f(C, 1, 4, s=0.5), "linear_attn.A_log": f(n_v, s=0.5),
               "linear_attn.dt_bias": f(n_v, s=0.5), "linear_attn.norm.weight": 1 + f(d_v, s=0.1)})
    conv0, state0 = f(C, 3, s=0.5), f(n_v, d_k, d_v, s=0.1)

    def deltanet_layer(b):
        gl = dk.prepare_gated_deltanet_layer(nw, linear_num_key_heads=n_k, linear_num_value_heads=n_v,
                                             linear_key_head_dim=d_k, linear_value_head_dim=d_v, backend=b)
        cs, st = conv0.copy(), state0.copy()
        return dk.gated_deltanet_layer(lx, gl, cs, st, backend=b), cs, st

    checks.append(Check(f"gated_deltanet_layer 16 rows, {n_k}/{n_v} heads {d_k}x{d_v}, H {H}", deltanet_layer))
    # acceptance (exact)
    v, k = 2000, 15
    drafts = rng.integers(0, v, (4, k))
    target = drafts.copy()
    target[1, 3] = (target[1, 3] + 1) % v
    target = np.concatenate([target, rng.integers(0, v, (4, 1))], axis=1)
    checks.append(Check("accept_greedy B4 k15", lambda b: dk.accept_greedy(drafts, target, backend=b), exact=True))
    logits = f(2, k + 1, v, s=3.0)
    drafts2 = logits[:, :k].argmax(-1)
    for temp, top_k, top_p in ((1.0, 0, 1.0), (0.7, 50, 0.9)):
        checks.append(Check(f"rejection_sample T={temp} top_k={top_k} top_p={top_p}",
                            lambda b, t=temp, tk=top_k, tp=top_p: dk.rejection_sample(
                                drafts2, logits, temperature=t, top_k=tk, top_p=tp, generator=seed, backend=b),
                            exact=True))
    checks.append(Check("sample_filtered T=0.7 top_p=0.9 k15", lambda b: dk.sample_filtered(
        logits[0, :k], 0.7, 0, 0.9, generator=seed, backend=b)))
    return checks


def _compare(got, ref, check: Check) -> tuple[bool, str]:
    got_t = got if isinstance(got, tuple) else (got,)
    ref_t = ref if isinstance(ref, tuple) else (ref,)
    worst = 0.0
    for g, r in zip(got_t, ref_t, strict=True):
        g = g.numpy() if hasattr(g, "numpy") else np.asarray(g)
        r = r.numpy() if hasattr(r, "numpy") else np.asarray(r)
        if g.shape != r.shape:
            return False, f"shape {g.shape} != {r.shape}"
        if check.exact:
            if not np.array_equal(g, r):
                return False, f"{int(np.sum(g != r))} mismatches"
            continue
        g, r = g.astype(np.float64), r.astype(np.float64)
        if g.size:  # error relative to the output's scale: near-zero entries carry no relative meaning
            scale = max(float(np.sqrt(np.mean(r * r))), 1e-30)
            worst = max(worst, float(np.max(np.abs(g - r))) / scale)
    if check.exact:
        return True, "exact"
    return worst <= check.rtol, f"max err / rms {worst:.2e}"


def _contenders() -> list[tuple[str, str, str | None]]:
    """(label, backend, ISA cap) for every compiled backend, Cython once per supported tier."""
    out = []
    if "cython" in available_backends():
        machine = _isa.machine_tier()
        tiers = _isa.TIERS[: _isa.TIERS.index(machine) + 1] if machine else ()
        out += [(f"cython/{t}", "cython", t) for t in tiers] or [("cython", "cython", None)]
    if "numba" in available_backends():
        out.append(("numba", "numba", None))
    return out


def validate(seed: int = 0, file=sys.stdout) -> bool:
    """Run every check on every compiled backend and tier; print a table; return True when all pass."""
    print("\n".join(config_lines()), file=file)
    from tqdm import tqdm

    contenders = _contenders()
    rows, ok_all = [], True
    saved_cap = _isa.current_cap()
    checks = _checks(seed)
    # a first run spends about a minute compiling the Numba kernels (then cached): say so, and show progress
    print(f"running {len(checks)} checks on {len(contenders)} backends (the first run also compiles the "
          "Numba kernels, about a minute)", file=sys.stderr)
    try:
        for check in tqdm(checks, desc="validate", unit="check", file=sys.stderr, leave=False):
            ref = check.run("torch")
            for label, b, cap in contenders:
                _isa.set_isa(cap or saved_cap)
                t0 = time.perf_counter()
                try:
                    ok, detail = _compare(check.run(b), ref, check)
                except Exception as err:  # a crash is a failure to report, not to hide
                    ok, detail = False, f"error: {type(err).__name__}: {err}"
                rows.append((check.name, label, "PASS" if ok else "FAIL", detail, time.perf_counter() - t0))
                ok_all &= ok
    finally:
        _isa.set_isa(saved_cap)
    width = max(len(r[0]) for r in rows)
    print(f"{'check':{width}s}  {'backend':18s}  result  detail", file=file)
    for name, b, res, detail, _ in rows:
        print(f"{name:{width}s}  {b:18s}  {res:6s}  {detail}", file=file)
    n_fail = sum(r[2] == "FAIL" for r in rows)
    print(f"{len(rows) - n_fail} passed, {n_fail} failed", file=file)
    return ok_all


if __name__ == "__main__":
    sys.exit(0 if validate() else 1)
