"""Fused decoder layers (dflash_kernels.layers): bit-identical to the composition of the single ops on
every tier, close to the float64 reference, and clear errors for bad weights and caches."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels as dk
from dflash_kernels.layers import compose_drafter_layer, compose_qwen3_layer
from dflash_kernels.reference import attention as ref_attn, dense as ref, linear_attention as ref_la
from support import KERNEL_CASES, TOLERANCE_LONG, as_f64, assert_close, make_float

SEEDS = st.integers(0, 2**32 - 1)
# the fused kernel is Cython's: its bit-identity runs at each tier of this machine (Numba composes the
# ops itself, which test_*_matches_reference checks)
CYTHON_TIERS = pytest.mark.parametrize("kernel_backend", [c for c in KERNEL_CASES if c.startswith("cython")],
                                       indirect=True)


def _layer_weights(rng, H, Hq, Hkv, D, inter, dtype, qk_norm=True, prefix="", gated=False):
    w = {
        "input_layernorm.weight": rng.uniform(0.5, 1.5, H).astype(np.float32),
        "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, H).astype(np.float32),
        "self_attn.q_proj.weight": make_float(rng, ((2 if gated else 1) * Hq * D, H), dtype, scale=0.2),
        "self_attn.k_proj.weight": make_float(rng, (Hkv * D, H), dtype, scale=0.2),
        "self_attn.v_proj.weight": make_float(rng, (Hkv * D, H), dtype, scale=0.2),
        "self_attn.o_proj.weight": make_float(rng, (H, Hq * D), dtype, scale=0.2),
        "mlp.gate_proj.weight": make_float(rng, (inter, H), dtype, scale=0.2),
        "mlp.up_proj.weight": make_float(rng, (inter, H), dtype, scale=0.2),
        "mlp.down_proj.weight": make_float(rng, (H, inter), dtype, scale=0.2),
    }
    if qk_norm:
        w["self_attn.q_norm.weight"] = rng.uniform(0.5, 1.5, D).astype(np.float32)
        w["self_attn.k_norm.weight"] = rng.uniform(0.5, 1.5, D).astype(np.float32)
    return {prefix + k: v for k, v in w.items()}


CONFIGS = st.fixed_dictionaries({
    "H": st.sampled_from([32, 64, 96]),
    "heads": st.sampled_from([(4, 2), (2, 2), (6, 2), (4, 1)]),  # GQA, MHA, group 3, MQA
    "D": st.sampled_from([16, 32, 48]),  # head_dim independent of H / heads
    "inter": st.integers(8, 200),
    "dtype": st.sampled_from(["float32", "bfloat16"]),
    "kv": st.sampled_from(["float32", "bfloat16"]),
    "qk_norm": st.booleans(),  # False: a Llama layer
    "window": st.sampled_from([None, 1, 7]),
    "scaled_rope": st.booleans(),
    "T": st.sampled_from([1, 3, 16, 40]),
    "start": st.integers(0, 60),
    "precision": st.sampled_from(["highest", "medium"]),
    "threads": st.sampled_from([1, 2]),
    "qwen35": st.booleans(),  # a Qwen3.5 gated full-attention layer: (1 + w) norms, output gate, partial RoPE
})


def _qwen35_args(cfg):
    return dict(norm_offset=1.0, output_gate=True, rotary_dim=cfg["D"] // 8 * 2) if cfg.get("qwen35") else {}


def _case(cfg, seed, causal=True):
    rng = np.random.default_rng(seed)
    Hq, Hkv = cfg["heads"]
    D = cfg["D"]
    w = _layer_weights(rng, cfg["H"], Hq, Hkv, D, cfg["inter"], cfg["dtype"], cfg["qk_norm"], gated=cfg["qwen35"])
    freq = None
    if cfg["scaled_rope"]:
        freq = dk.rope_inv_freq(1e4, _qwen35_args(cfg).get("rotary_dim", D), {"rope_type": "linear", "factor": 4.0})
    layer = dk.prepare_qwen3_layer(w, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                                   rms_norm_eps=1e-6, rope_theta=1e4, rope_inv_freq=freq,
                                   sliding_window=cfg["window"], causal=causal, backend="cython", **_qwen35_args(cfg))
    T, start = cfg["T"], cfg["start"]
    x = make_float(rng, (T, cfg["H"]), "float32", scale=2.0)
    cache = make_float(rng, (start + T + 5, Hkv, D), cfg["kv"])
    return w, layer, x, cache, make_float(rng, cache.shape, cfg["kv"]), freq


@CYTHON_TIERS
@given(cfg=CONFIGS, seed=SEEDS)
def test_qwen3_layer_equals_composition_bit_for_bit(kernel_backend, cfg, seed):
    _, layer, x, k0, v0, _ = _case(cfg, seed)
    assert layer.fused
    kw = dict(precision=cfg["precision"], n_threads=cfg["threads"], backend="cython")
    k1, v1, k2, v2 = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    got = dk.qwen3_layer(x, layer, k1, v1, cfg["start"], **kw)
    expect = compose_qwen3_layer(x.copy(), layer, k2, v2, cfg["start"], **kw)
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(k1, k2)  # the new rows, bf16-rounded as KVCache.write does
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_array_equal(k1[cfg["start"] + x.shape[0]:], k0[cfg["start"] + x.shape[0]:])  # nothing else


@CYTHON_TIERS
@given(cfg=CONFIGS, causal=st.booleans(), seed=SEEDS)
def test_drafter_layer_equals_composition_bit_for_bit(kernel_backend, cfg, causal, seed):
    _, layer, x, k0, v0, _ = _case(cfg, seed, causal)
    k_ctx, v_ctx = k0[:cfg["start"]], v0[:cfg["start"]]  # the injected context
    kw = dict(precision=cfg["precision"], n_threads=cfg["threads"], backend="cython")
    got = dk.drafter_layer(x, layer, k_ctx, v_ctx, **kw)
    expect = compose_drafter_layer(x.copy(), layer, k_ctx, v_ctx, **kw)
    np.testing.assert_array_equal(got, expect)


@given(cfg=CONFIGS, causal=st.booleans(), seed=SEEDS)
def test_drafter_layer_matches_reference(kernel_backend, cfg, causal, seed):
    """A drafter layer is the target layer with injected-KV attention over [context | block]; with
    causal=True and the context as the cache prefix the two are the same computation."""
    cfg = {**cfg, "precision": "highest", "kv": "float32"}
    w, _, x, k0, v0, freq = _case(cfg, seed)
    Hq, Hkv = cfg["heads"]
    layer = dk.prepare_qwen3_layer(w, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=cfg["D"],
                                   rms_norm_eps=1e-6, rope_theta=1e4, rope_inv_freq=freq,
                                   sliding_window=cfg["window"], causal=causal, backend=kernel_backend,
                                   **_qwen35_args(cfg))
    got = dk.drafter_layer(x, layer, k0[:cfg["start"]], v0[:cfg["start"]], backend=kernel_backend,
                           n_threads=cfg["threads"])
    _assert_close_layer(got, _reference_layer(w, cfg, x, k0, v0, freq, causal), what="drafter_layer")


def _assert_close_layer(got, expected, what):
    """TOLERANCE_LONG, its atol scaled by the output's size past 20: fp32 sums carry errors relative
    to their largest terms, and with a Qwen3.5 layer's (1 + w) norms the residual stream reaches ~100
    here, where an element that cancels to 0.17 came out 2.5e-4 off on every backend (torch too)."""
    scale = max(1.0, float(np.abs(np.asarray(expected)).max()) / 20)
    assert_close(got, expected, rtol=TOLERANCE_LONG["rtol"], atol=TOLERANCE_LONG["atol"] * scale, what=what)


def _reference_layer(w, cfg, x, k_cache, v_cache, freq, causal=True):
    """The layer in float64 torch from the reference ops (HF's Qwen3DecoderLayer, step by step; with
    cfg["qwen35"] the full-attention layer of Qwen3_5DecoderLayer)."""
    Hq, Hkv = cfg["heads"]
    D, T, start = cfg["D"], cfg["T"], cfg["start"]
    off, rot = (1.0, cfg["D"] // 8 * 2) if cfg.get("qwen35") else (0.0, D)
    W = {k: as_f64(v) for k, v in w.items()}
    xr = as_f64(x)
    h = ref.rms_norm(xr, W["input_layernorm.weight"], eps=1e-6, offset=off)
    q = ref.linear(h, W["self_attn.q_proj.weight"])
    gate = None
    if cfg.get("qwen35"):
        q, gate = ref_la.split_query_gate(q, Hq, D)
    q = q.reshape(T, Hq, D)
    k = ref.linear(h, W["self_attn.k_proj.weight"]).reshape(T, Hkv, D)
    v = ref.linear(h, W["self_attn.v_proj.weight"]).reshape(T, Hkv, D)
    if cfg["qk_norm"]:
        q = ref.rms_norm(q, W["self_attn.q_norm.weight"], eps=1e-6, offset=off)
        k = ref.rms_norm(k, W["self_attn.k_norm.weight"], eps=1e-6, offset=off)
    pos = torch.arange(start, start + T)
    inv = None if freq is None else torch.from_numpy(freq)
    q = ref.apply_rope(q, pos, theta=1e4, rotary_dim=rot, inv_freq=inv)
    k = ref.apply_rope(k, pos, theta=1e4, rotary_dim=rot, inv_freq=inv)
    keys = torch.cat([as_f64(k_cache[:start]), k])
    vals = torch.cat([as_f64(v_cache[:start]), v])
    if causal:
        o = ref_attn.cached_attention(q, keys, vals, causal=True, window=cfg["window"])
    else:
        o = ref_attn.injected_kv_attention(q, keys[:start], vals[:start], k, v, window=cfg["window"])
    o = o.reshape(T, Hq * D)
    if gate is not None:
        o = ref_la.apply_output_gate(o, gate)
    x1 = xr + ref.linear(o, W["self_attn.o_proj.weight"])
    h2 = ref.rms_norm(x1, W["post_attention_layernorm.weight"], eps=1e-6, offset=off)
    gate_up = torch.cat([ref.linear(h2, W["mlp.gate_proj.weight"]), ref.linear(h2, W["mlp.up_proj.weight"])], -1)
    return x1 + ref.linear(ref.silu_and_mul(gate_up), W["mlp.down_proj.weight"])


@given(cfg=CONFIGS, seed=SEEDS)
def test_qwen3_layer_matches_reference(kernel_backend, cfg, seed):
    cfg = {**cfg, "precision": "highest", "kv": "float32"}  # the reference keeps K/V in float64
    w, _, x, k0, v0, freq = _case(cfg, seed)
    Hq, Hkv = cfg["heads"]
    layer = dk.prepare_qwen3_layer(w, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=cfg["D"],
                                   rms_norm_eps=1e-6, rope_theta=1e4, rope_inv_freq=freq,
                                   sliding_window=cfg["window"], backend=kernel_backend, **_qwen35_args(cfg))
    got = dk.qwen3_layer(x, layer, k0.copy(), v0.copy(), cfg["start"], backend=kernel_backend,
                         n_threads=cfg["threads"])
    _assert_close_layer(got, _reference_layer(w, cfg, x, k0, v0, freq), what="qwen3_layer")


def test_qwen3_layer_torch_tensors_and_prefix():
    rng = np.random.default_rng(3)
    w = _layer_weights(rng, 64, 4, 2, 16, 96, "bfloat16", prefix="model.layers.7.")
    tw = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == np.uint16 else torch.from_numpy(v)
          for k, v in w.items()}
    layer = dk.prepare_qwen3_layer(tw, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   prefix="model.layers.7.")
    x = torch.randn(3, 64)
    kc, vc = torch.zeros(8, 2, 16, dtype=torch.bfloat16), torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    out = dk.qwen3_layer(x, layer, kc, vc, 2)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 64)
    assert kc[2:5].abs().sum() > 0 and kc[5:].abs().sum() == 0 and kc[:2].abs().sum() == 0  # written in place


def _good():
    return _layer_weights(np.random.default_rng(0), 32, 2, 1, 16, 40, "bfloat16")


def _prep(w, **kw):
    args = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return dk.prepare_qwen3_layer(w, **{**args, **kw})


def test_prepare_qwen3_layer_names_the_bad_tensor():
    w = _good()
    del w["mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="mlp.up_proj.weight"):
        _prep(w)
    w = _good()
    w["self_attn.k_proj.weight"] = w["self_attn.k_proj.weight"][:8]
    with pytest.raises(ValueError, match="k_proj"):
        _prep(w)
    w = _good()
    w["self_attn.o_proj.weight"] = w["self_attn.o_proj.weight"].view(np.float16)
    with pytest.raises(TypeError, match="o_proj"):
        _prep(w)
    w = _good()
    w["mlp.down_proj.weight"] = np.zeros((32, 40), np.float32)  # float32 among bf16 projections
    with pytest.raises(TypeError, match="down_proj"):
        _prep(w)
    w = _good()
    del w["self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        _prep(w)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        _prep(_good(), num_key_value_heads=3)
    with pytest.raises(ValueError, match="rope_inv_freq"):
        _prep(_good(), rope_inv_freq=np.ones(3))
    with pytest.raises(ValueError, match="sliding_window"):
        _prep(_good(), sliding_window=0)
    with pytest.raises(ValueError, match="q_proj"):  # a gated layer's q_proj holds [query | gate] per head
        _prep(_good(), output_gate=True)
    with pytest.raises(ValueError, match="norm_offset"):
        _prep(_good(), norm_offset=0.5)
    for bad in (3, 0, 18):
        with pytest.raises(ValueError, match="rotary_dim"):
            _prep(_good(), rotary_dim=bad)
    with pytest.raises(ValueError, match="rope_inv_freq must hold 2"):  # rotary_dim / 2 frequencies
        _prep(_good(), rotary_dim=4, rope_inv_freq=np.ones(8))


def test_drafter_layer_bad_context():
    layer = _prep(_good())
    x = np.zeros((4, 32), np.float32)
    with pytest.raises(ValueError, match="v_ctx must have shape"):
        dk.drafter_layer(x, layer, np.zeros((8, 1, 16), np.float32), np.zeros((8, 2, 16), np.float32))
    with pytest.raises(ValueError, match="k_ctx and v_ctx must match"):
        dk.drafter_layer(x, layer, np.zeros((8, 1, 16), np.float32), np.zeros((7, 1, 16), np.float32))
    ro = np.zeros((8, 1, 16), np.float32)
    ro.flags.writeable = False  # the context is only read
    assert dk.drafter_layer(x, layer, ro, ro).shape == (4, 32)


def test_qwen3_layer_bad_caches_and_positions():
    layer = _prep(_good())
    x = np.zeros((4, 32), np.float32)
    kc = np.zeros((8, 1, 16), np.float32)
    with pytest.raises(ValueError, match="k_cache holds 8 positions"):
        dk.qwen3_layer(x, layer, kc, kc.copy(), 5)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        dk.qwen3_layer(x, layer, kc, np.zeros((8, 2, 16), np.float32), 0)
    with pytest.raises(ValueError, match="must match"):
        dk.qwen3_layer(x, layer, kc, np.zeros((8, 1, 16), np.uint16), 0)
    with pytest.raises(ValueError, match="C-contiguous and writable"):
        dk.qwen3_layer(x, layer, np.zeros((16, 1, 16), np.float32)[::2], kc, 0)
    ro = kc.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache must be C-contiguous and writable"):
        dk.qwen3_layer(x, layer, ro, kc, 0)
    with pytest.raises(ValueError, match="start"):
        dk.qwen3_layer(x, layer, kc, kc.copy(), -1)
    with pytest.raises(ValueError, match="x must have shape"):
        dk.qwen3_layer(np.zeros((4, 31), np.float32), layer, kc, kc.copy(), 0)
    with pytest.raises(TypeError, match="Qwen3Layer"):
        dk.qwen3_layer(x, {}, kc, kc.copy(), 0)
