"""The fused Qwen3.5 Gated DeltaNet layer (dflash_kernels.gdn_layer): bit-identical to the composition
of the single ops on every tier, close to the float64 reference on every backend, what a rollback
re-runs recorded exactly, and clear errors for bad weights and states."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels as dk
from dflash_kernels.gdn_layer import compose_gated_deltanet_layer, run_gated_deltanet_layer
from dflash_kernels.reference import dense as ref, linear_attention as ref_la
from support import KERNEL_CASES, TOLERANCE_LONG, as_f64, assert_close, make_float

SEEDS = st.integers(0, 2**32 - 1)
CYTHON_TIERS = pytest.mark.parametrize("kernel_backend", [c for c in KERNEL_CASES if c.startswith("cython")],
                                       indirect=True)


def _weights(rng, H, Hk, Hv, dk_, dv, K, inter, dtype, prefix=""):
    C, vd = 2 * Hk * dk_ + Hv * dv, Hv * dv
    w = {
        "input_layernorm.weight": rng.uniform(-0.5, 0.5, H).astype(np.float32),  # zero-centred: x (1 + w)
        "post_attention_layernorm.weight": rng.uniform(-0.5, 0.5, H).astype(np.float32),
        "linear_attn.in_proj_qkv.weight": make_float(rng, (C, H), dtype, scale=0.2),
        "linear_attn.in_proj_z.weight": make_float(rng, (vd, H), dtype, scale=0.2),
        "linear_attn.in_proj_b.weight": make_float(rng, (Hv, H), dtype, scale=0.5),
        "linear_attn.in_proj_a.weight": make_float(rng, (Hv, H), dtype, scale=0.5),
        "linear_attn.conv1d.weight": rng.standard_normal((C, 1, K)).astype(np.float32) * 0.5,
        "linear_attn.A_log": rng.uniform(-1.0, 1.0, Hv).astype(np.float32),
        "linear_attn.dt_bias": rng.uniform(-1.0, 1.0, Hv).astype(np.float32),
        "linear_attn.norm.weight": rng.uniform(0.5, 1.5, dv).astype(np.float32),  # ones-centred
        "linear_attn.out_proj.weight": make_float(rng, (H, vd), dtype, scale=0.2),
        "mlp.gate_proj.weight": make_float(rng, (inter, H), dtype, scale=0.2),
        "mlp.up_proj.weight": make_float(rng, (inter, H), dtype, scale=0.2),
        "mlp.down_proj.weight": make_float(rng, (H, inter), dtype, scale=0.2),
    }
    return {prefix + k: v for k, v in w.items()}


CONFIGS = st.fixed_dictionaries({
    "H": st.sampled_from([32, 64]),
    "heads": st.sampled_from([(1, 1), (2, 4), (1, 3), (2, 2)]),  # (H_k, H_v): GVA groups 1, 2, 3
    "dims": st.sampled_from([(16, 16), (8, 24), (32, 20), (4, 6)]),  # (d_k, d_v): narrow and 16-wide blocks
    "K": st.sampled_from([1, 2, 4]),
    "inter": st.integers(8, 120),
    "dtype": st.sampled_from(["float32", "bfloat16"]),
    "T": st.sampled_from([1, 3, 17]),
    "warm": st.booleans(),  # states from earlier rows, or zeros
    "precision": st.sampled_from(["highest", "medium"]),
    "threads": st.sampled_from([1, 2]),
})


def _case(cfg, seed, backend="cython"):
    rng = np.random.default_rng(seed)
    (Hk, Hv), (dk_, dv) = cfg["heads"], cfg["dims"]
    w = _weights(rng, cfg["H"], Hk, Hv, dk_, dv, cfg["K"], cfg["inter"], cfg["dtype"])
    layer = dk.prepare_gated_deltanet_layer(w, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                                            linear_key_head_dim=dk_, linear_value_head_dim=dv, backend=backend)
    x = make_float(rng, (cfg["T"], cfg["H"]), "float32", scale=2.0)
    scale = 0.5 if cfg["warm"] else 0.0
    conv = (rng.standard_normal(layer.conv_state_shape) * scale).astype(np.float32)
    state = (rng.standard_normal(layer.state_shape) * scale).astype(np.float32)
    return w, layer, x, conv, state


@CYTHON_TIERS
@given(cfg=CONFIGS, seed=SEEDS)
def test_gated_deltanet_layer_equals_composition_bit_for_bit(kernel_backend, cfg, seed):
    _, layer, x, conv, state = _case(cfg, seed)
    assert layer.fused
    kw = dict(precision=cfg["precision"], n_threads=cfg["threads"], backend="cython")
    c1, s1, c2, s2 = conv.copy(), state.copy(), conv.copy(), state.copy()
    got = dk.gated_deltanet_layer(x, layer, c1, s1, **kw)
    expect = compose_gated_deltanet_layer(x.copy(), layer, c2, s2, **kw)
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(s1, s2)


@CYTHON_TIERS
def test_gated_deltanet_layer_records_what_a_rollback_reruns(kernel_backend):
    """The record buffers hold the conv inputs, the conv outputs and the gates: what HybridCache.truncate
    re-runs."""
    cfg = dict(H=64, heads=(2, 4), dims=(16, 24), K=4, inter=40, dtype="bfloat16", T=6, warm=True)
    _, layer, x, conv, state = _case(cfg, 5)
    T, C, Hv = 6, layer.conv_dim, layer.num_v_heads
    record = tuple(np.full(s, np.nan, np.float32) for s in ((T, C), (T, C), (T, Hv), (T, Hv)))
    ops = dk.BoundOps(n_threads=2, backend="cython", precision="medium")
    x1, c1, s1 = x.copy(), conv.copy(), state.copy()
    run_gated_deltanet_layer(ops._dense, x1, layer, c1, s1, ops._parts, 2, record)
    mixed, y, g, beta = record
    h = ops.rms_norm(x, layer.w_in, layer.eps, offset=1.0)
    proj = ops.linear(h, layer.w_proj)
    np.testing.assert_array_equal(mixed, proj[:, :C])
    np.testing.assert_array_equal(y, dk.causal_conv1d(np.ascontiguousarray(proj[:, :C]), layer.conv, conv.copy()))
    vd = layer.v_head_dim * Hv
    g2, b2 = dk.gated_deltanet_gates(proj[:, C + vd + Hv:], proj[:, C + vd:C + vd + Hv], layer.neg_a, layer.dt_bias)
    np.testing.assert_array_equal(g, g2)
    np.testing.assert_array_equal(beta, b2)
    # the rule re-run on the recorded inputs from the state before gives the layer's new state, and
    # the conv state after any prefix follows from the recorded conv inputs
    kd, d_k = 2 * 16, 16
    again = state.copy()
    dk.gated_delta_rule(y[:, :kd].reshape(T, 2, d_k), y[:, kd:2 * kd].reshape(T, 2, d_k),
                        y[:, 2 * kd:].reshape(T, Hv, 24), g, beta, again)
    np.testing.assert_array_equal(again, s1)
    np.testing.assert_array_equal(dk.conv_state_at(conv, mixed, T), c1)


def _reference_layer(w, cfg, x, conv, state):
    """The layer in float64 torch from the reference ops (HF's Qwen3_5DecoderLayer, linear attention)."""
    (Hk, Hv), (dk_, dv) = cfg["heads"], cfg["dims"]
    T, kd, C = cfg["T"], Hk * dk_, 2 * Hk * dk_ + Hv * dv
    W = {k: as_f64(v) for k, v in w.items()}
    a = "linear_attn."
    xr = as_f64(x)
    h = ref.rms_norm(xr, W["input_layernorm.weight"], eps=1e-6, offset=1.0)
    mixed = ref.linear(h, W[a + "in_proj_qkv.weight"])
    y, _ = ref_la.causal_conv1d(mixed, W[a + "conv1d.weight"].reshape(C, -1), as_f64(conv))
    z = ref.linear(h, W[a + "in_proj_z.weight"]).reshape(T, Hv, dv)
    beta = torch.sigmoid(ref.linear(h, W[a + "in_proj_b.weight"]))
    g = -torch.exp(W[a + "A_log"]) * torch.nn.functional.softplus(ref.linear(h, W[a + "in_proj_a.weight"])
                                                                  + W[a + "dt_bias"])
    o, _, _ = ref_la.gated_delta_rule(y[:, :kd].reshape(T, Hk, dk_), y[:, kd:2 * kd].reshape(T, Hk, dk_),
                                      y[:, 2 * kd:].reshape(T, Hv, dv), g, beta, as_f64(state))
    o = ref_la.gated_rms_norm(o, z, W[a + "norm.weight"]).reshape(T, Hv * dv)
    x1 = xr + ref.linear(o, W[a + "out_proj.weight"])
    h2 = ref.rms_norm(x1, W["post_attention_layernorm.weight"], eps=1e-6, offset=1.0)
    gate_up = torch.cat([ref.linear(h2, W["mlp.gate_proj.weight"]), ref.linear(h2, W["mlp.up_proj.weight"])], -1)
    return x1 + ref.linear(ref.silu_and_mul(gate_up), W["mlp.down_proj.weight"])


@given(cfg=CONFIGS, seed=SEEDS)
def test_gated_deltanet_layer_matches_reference(kernel_backend, cfg, seed):
    cfg = {**cfg, "precision": "highest"}
    w, layer, x, conv, state = _case(cfg, seed, backend=kernel_backend)
    got = dk.gated_deltanet_layer(x, layer, conv.copy(), state.copy(), backend=kernel_backend,
                                  n_threads=cfg["threads"], precision="highest")
    assert_close(got, _reference_layer(w, cfg, x, conv, state), **TOLERANCE_LONG, what="gated_deltanet_layer")


def test_gated_deltanet_layer_torch_tensors_and_prefix():
    rng = np.random.default_rng(2)
    w = _weights(rng, 32, 1, 2, 8, 8, 4, 24, "bfloat16", prefix="model.language_model.layers.0.")
    tw = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == np.uint16 else torch.from_numpy(v)
          for k, v in w.items()}
    args = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    a = dk.prepare_gated_deltanet_layer(w, prefix="model.language_model.layers.0.", **args)
    b = dk.prepare_gated_deltanet_layer(tw, prefix="model.language_model.layers.0.", **args)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    conv, state = np.zeros(a.conv_state_shape, np.float32), np.zeros(a.state_shape, np.float32)
    got = dk.gated_deltanet_layer(torch.from_numpy(x), b, torch.from_numpy(conv.copy()), torch.from_numpy(state.copy()))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), dk.gated_deltanet_layer(x, a, conv, state))
    assert "fused" in repr(a)


def _good():
    return _weights(np.random.default_rng(0), 32, 1, 2, 8, 8, 4, 24, "bfloat16")


def _prep(w, **kw):
    args = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    return dk.prepare_gated_deltanet_layer(w, **{**args, **kw})


@pytest.mark.parametrize("name, change, error", [
    ("linear_attn.in_proj_z.weight", "drop", KeyError),
    ("linear_attn.conv1d.weight", "drop", KeyError),
    ("linear_attn.A_log", "drop", KeyError),
    ("linear_attn.in_proj_b.weight", "shape", ValueError),
    ("linear_attn.conv1d.weight", "shape", ValueError),
    ("linear_attn.norm.weight", "shape", ValueError),
    ("linear_attn.out_proj.weight", "float16", TypeError),
    ("mlp.down_proj.weight", "float32", TypeError),  # float32 among bf16 projections
])
def test_prepare_gated_deltanet_layer_names_the_bad_tensor(name, change, error):
    w = _good()
    if change == "drop":
        del w[name]
    elif change == "shape":
        w[name] = np.zeros((3, *w[name].shape[1:]), w[name].dtype)
    elif change == "float16":
        w[name] = w[name].view(np.float16)
    else:
        w[name] = np.zeros(w[name].shape, np.float32)
    with pytest.raises(error, match=name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]):
        _prep(w)


def test_prepare_gated_deltanet_layer_bad_heads():
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        _prep(_good(), linear_num_key_heads=2, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_key_head_dim must be a positive int"):
        _prep(_good(), linear_key_head_dim=0)


def test_gated_deltanet_layer_bad_states_and_rows():
    layer = _prep(_good())
    x = np.zeros((2, 32), np.float32)
    conv, state = np.zeros(layer.conv_state_shape, np.float32), np.zeros(layer.state_shape, np.float32)
    with pytest.raises(ValueError, match=r"conv_state must have shape \(32, 3\)"):
        dk.gated_deltanet_layer(x, layer, np.zeros((32, 4), np.float32), state)
    with pytest.raises(TypeError, match="state must be a float32"):
        dk.gated_deltanet_layer(x, layer, conv, state.astype(np.float64))
    ro = state.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="state must be writable"):
        dk.gated_deltanet_layer(x, layer, conv, ro)
    with pytest.raises(ValueError, match="x must have shape"):
        dk.gated_deltanet_layer(np.zeros((2, 31), np.float32), layer, conv, state)
    with pytest.raises(TypeError, match="GatedDeltaNetLayer"):
        dk.gated_deltanet_layer(x, {}, conv, state)
    assert dk.gated_deltanet_layer(np.zeros((0, 32), np.float32), layer, conv, state).shape == (0, 32)


def test_gated_deltanet_gates_backends_agree_and_check_shapes():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 5, 3)).astype(np.float32) * 30  # far into softplus' and sigmoid's tails
    neg_a, dt = -rng.uniform(0.1, 2, 3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    expect_g = -np.exp(np.log(-neg_a.astype(np.float64))) * np.logaddexp(0.0, a.astype(np.float64) + dt)
    expect_b = 1 / (1 + np.exp(-b.astype(np.float64)))
    for backend in dk.available_backends():
        g, beta = dk.gated_deltanet_gates(a, b, neg_a, dt, backend=backend)
        assert_close(g, expect_g, rtol=1e-6, atol=1e-6, what=f"g {backend}")
        assert_close(beta, expect_b, rtol=1e-6, atol=1e-7, what=f"beta {backend}")
    with pytest.raises(ValueError, match="one shape"):
        dk.gated_deltanet_gates(a, b[:, :2], neg_a, dt)
    with pytest.raises(ValueError, match=r"dt_bias must have shape \(3,\)"):
        dk.gated_deltanet_gates(a, b, neg_a, dt[:2])
