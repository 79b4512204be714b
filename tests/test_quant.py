"""GGUF blocks kept as they are (dflash_kernels.quant, pyx/dk_quant.h): the blocks' values against an
independent dequantizer, the panel layout's round trip, linear and the fused layer bit-identical to
their float32 expansion on every tier, M, thread count and precision, a GGUF model loaded with
gguf_dtype="blocks" (lossless DFlash, parity with transformers), and clear errors. Q4 blocks times int8
activations (pack_quantized(..., activations="int8"), gguf_dtype="blocks-int8"): the kernels against
their numpy reference bit for bit on every tier and backend, rows independent of M, close to the
exact product, and a model on them lossless."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dflash_kernels as dk
import dflash_kernels.model as dm
from checkpoints import write_dflash
from dflash_kernels.quant import QuantizedRows, linear_int8_reference, pack_quantized
from support import ALL_BACKENDS, MACHINE_TIERS, greedy_runs

gguf = pytest.importorskip("gguf")
from test_gguf import Q, ref_dequantize, tiny, write_gguf  # noqa: E402  (gguf needed first)

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def rows_of(rng, n, k, qtype, scale=0.1):
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(Q, qtype))
    return QuantizedRows.from_bytes(raw, (n, k), qtype), raw


@pytest.mark.parametrize("qtype", QTYPES)
def test_blocks_hold_the_values_of_an_independent_dequantizer(qtype):
    rows, raw = rows_of(np.random.default_rng(0), 37, 96, qtype)
    expected = ref_dequantize(raw, getattr(Q, qtype))
    assert rows.shape == (37, 96) and rows.qtype == qtype
    np.testing.assert_array_equal(rows.dequantize(), expected)
    packed = pack_quantized(rows)
    assert packed.shape == (37, 96) and packed.quant == (3 if qtype == "Q8_0" else 2)
    assert not packed.data.flags.writeable and packed.finite
    assert packed.data.size == 3 * 3 * (544 if qtype == "Q8_0" else 320)  # 3 panels x 3 blocks of K
    np.testing.assert_array_equal(packed.unpack(), expected)  # packing moves values only
    np.testing.assert_array_equal(np.asarray(packed), expected)
    assert repr(packed) == f"PackedWeight(shape=(37, 96), dtype={'q8' if qtype == 'Q8_0' else 'q4'})"


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(QTYPES), n=st.integers(1, 70), kb=st.integers(1, 20), m=st.integers(1, 20),
       tier=st.sampled_from(MACHINE_TIERS), precision=st.sampled_from(["highest", "high", "medium"]),
       threads=st.sampled_from([1, 2, 3]), with_bias=st.booleans(), seed=st.integers(0, 2**31))
def test_linear_over_blocks_is_bit_identical_to_their_float32_expansion(qtype, n, kb, m, tier, precision, threads,
                                                                        with_bias, seed):
    rng = np.random.default_rng(seed)
    rows, _ = rows_of(rng, n, 32 * kb, qtype)
    x = rng.standard_normal((m, 32 * kb)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    w = rows.dequantize()
    dk.set_isa(tier)
    try:
        got = dk.linear(x, pack_quantized(rows), bias, precision=precision, n_threads=threads)
        expected = dk.linear(x, dk.pack_weight(w), bias, precision=precision, n_threads=threads)
        one = dk.linear(x[-1:], pack_quantized(rows), bias, precision=precision, n_threads=1)
    finally:
        dk.set_isa(None)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(one[0], got[-1])  # a row's result does not depend on the others
    if precision == "highest":  # and against float64
        ref = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if bias is None else bias)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(32 * kb))


@pytest.mark.parametrize("tier", MACHINE_TIERS)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_fused_layer_over_blocks_equals_it_over_the_float32_expansion(tier, qtype):
    rng = np.random.default_rng(1)
    H, heads, kv, D, inter = 64, 4, 2, 16, 96
    shapes = {"self_attn.q_proj.weight": (heads * D, H), "self_attn.k_proj.weight": (kv * D, H),
              "self_attn.v_proj.weight": (kv * D, H), "self_attn.o_proj.weight": (H, heads * D),
              "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter)}
    rows = {name: rows_of(rng, *shape, qtype)[0] for name, shape in shapes.items()}
    norms = {"input_layernorm.weight": rng.standard_normal(H).astype(np.float32),
             "post_attention_layernorm.weight": rng.standard_normal(H).astype(np.float32)}
    kw = dict(num_attention_heads=heads, num_key_value_heads=kv, head_dim=D, rms_norm_eps=1e-6, rope_theta=1e4)
    blocks = dk.prepare_qwen3_layer({**rows, **norms}, **kw)
    expanded = dk.prepare_qwen3_layer({**{n: r.dequantize() for n, r in rows.items()}, **norms}, **kw)
    assert blocks.fused and blocks.quant == (3 if qtype == "Q8_0" else 2) and expanded.quant == 0
    x = rng.standard_normal((5, H)).astype(np.float32)
    outs = []
    dk.set_isa(tier)
    try:
        for layer in (blocks, expanded):
            k_cache, v_cache = np.zeros((2, 16, kv, D), np.float32)
            outs.append(dk.qwen3_layer(x, layer, k_cache, v_cache, start=0))
    finally:
        dk.set_isa(None)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_rows_stack_and_reorder_without_touching_values():
    rng = np.random.default_rng(2)
    a, b = rows_of(rng, 5, 64, "Q4_1")[0], rows_of(rng, 3, 64, "Q4_1")[0]
    both = QuantizedRows.concat([a, b])
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    np.testing.assert_array_equal(both.take([7, 0]).dequantize(), both.dequantize()[[7, 0]])
    with pytest.raises(ValueError, match="one qtype"):
        QuantizedRows.concat([a, rows_of(rng, 3, 64, "Q8_0")[0]])


def test_bad_blocks_give_clear_errors():
    with pytest.raises(ValueError, match="qtype must be one of"):
        QuantizedRows.from_bytes(np.zeros(20, np.uint8), (1, 32), "Q5_K")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        QuantizedRows.from_bytes(np.zeros(20, np.uint8), (1, 40), "Q4_1")
    with pytest.raises(ValueError, match="has 40 bytes, got 20"):
        QuantizedRows.from_bytes(np.zeros(20, np.uint8), (2, 32), "Q4_1")
    with pytest.raises(TypeError, match="rows must be a QuantizedRows"):
        pack_quantized(np.zeros((4, 32), np.float32))
    packed = pack_quantized(rows_of(np.random.default_rng(3), 4, 32, "Q8_0")[0])
    with pytest.raises(TypeError, match="Cython kernels only"):
        packed.to_tensor()
    with pytest.raises(ValueError, match="disagree on K"):
        dk.linear(np.ones((1, 64), np.float32), packed)
    # a scale that is not finite: the weight says so (and check_weights names the tensor, below)
    rows = rows_of(np.random.default_rng(4), 2, 32, "Q8_0")[0]
    rows.blocks[1, 0, :2] = np.array([np.inf], np.float16).view(np.uint8)
    assert not rows.finite() and not pack_quantized(rows).finite


def tiny_gguf_pair(tmp_path, qtype):
    """A tiny Llama GGUF of one block type and a DFlash drafter for it: (gguf path, drafter dir)."""
    cfg, tensors = tiny()
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, qtype=qtype)
    hf_dir = tmp_path / "cfg"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    return path, write_dflash(tmp_path / "drafter", hf_dir, target_layer_ids=(0, 1), block_size=8)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_a_gguf_model_run_on_its_blocks(tmp_path, qtype):
    path, drafter = tiny_gguf_pair(tmp_path, qtype)
    blocks = dm.load(path, drafter, gguf_dtype="blocks", max_len=128)
    layer = blocks.target.layers[0]
    assert layer.fused and layer.quant == (3 if qtype == Q.Q8_0 else 2) and blocks.target.fused_layers
    for ar, sd in greedy_runs(blocks):  # lossless over blocks too
        assert sd.token_ids == ar.token_ids
    # the same model as its float32 expansion (embedding and LM head in blocks too), bit for bit
    exact = dm.load(path, drafter, gguf_dtype="float32", max_len=128)
    assert exact.target.layers[0].quant == 0
    prompt = [5, 17, 2, 99, 31, 64, 7]
    a, _ = blocks.target.prefill(prompt, blocks.target.new_cache(64))
    b, _ = exact.target.prefill(prompt, exact.target.new_cache(64))
    np.testing.assert_array_equal(a, b)
    assert [r.token_ids for _, r in greedy_runs(blocks)] == [r.token_ids for _, r in greedy_runs(exact)]
    unfused = dm.load(path, gguf_dtype="blocks", fuse_weights=False, max_len=64)  # blocks run packed anyway
    c, _ = unfused.target.prefill(prompt, unfused.target.new_cache(64))
    np.testing.assert_array_equal(c, a)
    with pytest.raises(ValueError, match="dtype must be one of"):
        dm.load(path, gguf_dtype="q4")


# -- Q4 blocks times int8 activations -------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_int8_activation_panels_hold_the_same_weights(qtype):
    rows, raw = rows_of(np.random.default_rng(5), 37, 96, qtype)
    packed = pack_quantized(rows, activations="int8")
    assert packed.quant == (5 if qtype == "Q8_0" else 4)
    assert packed.data.size == 3 * 3 * (576 if qtype == "Q8_0" else 320)  # Q8_0: + the columns' sums of q
    np.testing.assert_array_equal(packed.unpack(), ref_dequantize(raw, getattr(Q, qtype)))
    assert repr(packed) == f"PackedWeight(shape=(37, 96), dtype={'q8' if qtype == 'Q8_0' else 'q4'}-int8)"
    rows.activations = "int8"  # the rows' own default, as gguf_dtype="blocks-int8" sets it
    assert pack_quantized(rows).quant == packed.quant and pack_quantized(rows, activations="float").quant != 4


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(QTYPES), n=st.integers(1, 70), kb=st.integers(1, 20), m=st.integers(1, 20),
       tier=st.sampled_from(MACHINE_TIERS), threads=st.sampled_from([1, 2, 3]), with_bias=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**31))
def test_int8_activations_give_the_reference_bits_on_every_tier(qtype, n, kb, m, tier, threads, with_bias, scale,
                                                                 seed):
    rng = np.random.default_rng(seed)
    rows, _ = rows_of(rng, n, 32 * kb, qtype)
    x = (rng.standard_normal((m, 32 * kb)) * scale).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: dx = 0
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    packed = pack_quantized(rows, activations="int8")
    dk.set_isa(tier)
    try:
        got = dk.linear(x, packed, bias, n_threads=threads)
        one = dk.linear(x[-1:], packed, bias, n_threads=1)
    finally:
        dk.set_isa(None)
    np.testing.assert_array_equal(got, linear_int8_reference(x, packed, bias))
    np.testing.assert_array_equal(one[0], got[-1])  # a row's result does not depend on the others
    # int8 activations: each x off by at most half a step of its block's amax / 127
    w = rows.dequantize()
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if bias is None else bias)
    step = np.abs(x.reshape(m, kb, 32)).max(-1) / 127  # (m, kb)
    bound = 0.5 * (step[:, None, :] * np.abs(w.reshape(n, kb, 32)).sum(-1)[None]).sum(-1)  # (m, n)
    assert (np.abs(got - exact) <= bound * 1.01 + 1e-5 * (np.abs(exact) + 1)).all()


def test_int8_activations_agree_on_every_backend():
    rng = np.random.default_rng(6)
    rows, _ = rows_of(rng, 40, 128, "Q4_1")
    rows.activations = "int8"
    x = rng.standard_normal((3, 128)).astype(np.float32)
    outs = {b: dk.linear(x, dk.prepare_weight(rows, backend=b), backend=b) for b in ALL_BACKENDS}
    for b, out in outs.items():
        np.testing.assert_array_equal(out, outs[ALL_BACKENDS[0]], err_msg=b)


def test_int8_activations_with_non_finite_x_give_nan_rows():
    rng = np.random.default_rng(7)
    packed = pack_quantized(rows_of(rng, 20, 64, "Q4_1")[0], activations="int8")
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 5], x[2, 40] = np.nan, np.inf
    got = dk.linear(x, packed)
    assert np.isfinite(got[0]).all() and np.isnan(got[1:]).all()
    np.testing.assert_array_equal(got, linear_int8_reference(x, packed))


@pytest.mark.skipif("cython" not in dk.available_backends(), reason="the fused layer is the Cython build's")
def test_row_by_row_attention_bound_is_one():
    # the fused layer (pyx/layers.pxi) and the composed path (model/qwen3.py) attend row by row up to
    # the same block size, so that both give verification rows the decode steps' bits
    from dflash_kernels.model import qwen3

    assert dk.kernel_module("dense", "cython").ROW_EXACT_ROWS == qwen3.ROW_EXACT_ROWS


def test_int8_activations_bad_values_give_clear_errors():
    rows = rows_of(np.random.default_rng(8), 4, 32, "Q4_1")[0]
    with pytest.raises(ValueError, match="activations must be one of"):
        pack_quantized(rows, activations="int4")
    with pytest.raises(ValueError, match="activations must be one of"):
        QuantizedRows(rows.blocks, "Q4_1", "fp8")
    other = QuantizedRows(rows.blocks, "Q4_1", "int8")
    with pytest.raises(ValueError, match="activations"):
        QuantizedRows.concat([rows, other])
    with pytest.raises(ValueError, match="times int8 activations"):
        linear_int8_reference(np.ones((1, 32), np.float32), pack_quantized(rows))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_a_gguf_model_run_with_int8_activations(tmp_path, qtype):
    path, drafter = tiny_gguf_pair(tmp_path, qtype)
    int8 = dm.load(path, drafter, gguf_dtype="blocks-int8", max_len=128)
    want = 5 if qtype == Q.Q8_0 else 4
    assert int8.target.layers[0].quant == want and int8.target.fused_layers and int8.target.lm_head.quant == want
    # the drafter is requantized to Q4_1 at load where its K are whole blocks (not this one's: intermediate 80)
    assert not int8.drafter.int8 and int8.drafter.layers[0].quant == 0 and int8.drafter.fused_layers
    for ar, sd in greedy_runs(int8):  # lossless: verification rows give the bits of decode steps
        assert sd.token_ids == ar.token_ids

    prompt = [5, 17, 2, 99, 31, 64, 7]
    a, _ = int8.target.prefill(prompt, int8.target.new_cache(64))
    unfused = dm.load(path, gguf_dtype="blocks-int8", fuse_weights=False, max_len=64)  # the single ops
    c, _ = unfused.target.prefill(prompt, unfused.target.new_cache(64))
    np.testing.assert_array_equal(c, a)
    exact = dm.load(path, gguf_dtype="float32", max_len=64)
    b, _ = exact.target.prefill(prompt, exact.target.new_cache(64))
    np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * np.abs(b).max())
