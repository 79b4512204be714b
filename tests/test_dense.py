"""Dense ops (linear, RMSNorm, RoPE, SwiGLU) against the float64 torch reference."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, strategies as st

import dflash_kernels as dk
from dflash_kernels.reference import dense as ref
from support import KERNEL_BACKENDS, TOLERANCE, TOLERANCE_LONG, as_f64, as_torch, assert_close, make_float, readonly

DTYPES = st.sampled_from(["float32", "bfloat16"])
SEEDS = st.integers(0, 2**32 - 1)


# ---- SwiGLU ---------------------------------------------------------------------------------------

@given(m=st.integers(1, 33), i=st.integers(1, 300), dtype=DTYPES, seed=SEEDS)
def test_silu_and_mul_matches_reference(backend, m, i, dtype, seed):
    x = make_float(np.random.default_rng(seed), (m, 2 * i), dtype, scale=3.0)
    got = dk.silu_and_mul(x, backend=backend)
    assert got.dtype == np.float32 and got.shape == (m, i)
    assert_close(got, ref.silu_and_mul(as_f64(x)), **TOLERANCE[dtype], what="silu_and_mul")


def test_silu_and_mul_polynomial_exp_over_the_whole_range(backend):
    # gate from -87 to 87 (where the clamped exp is exact to ~2 ulp): relative error stays tiny
    gate = np.linspace(-87.0, 87.0, 20001, dtype=np.float32)
    up = np.random.default_rng(1).uniform(0.5, 2.0, gate.shape).astype(np.float32)
    got = dk.silu_and_mul(np.concatenate([gate, up])[None], backend=backend)[0]
    expect = ref.silu_and_mul(as_f64(np.concatenate([gate, up])[None]))[0].numpy()
    rel = np.abs(got - expect) / np.abs(expect).clip(1e-300)
    assert rel.max() < 2e-6, f"worst relative error {rel.max()} at gate={gate[np.argmax(rel)]}"


def test_silu_and_mul_torch_in_torch_out_and_readonly(backend):
    x = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    t = dk.silu_and_mul(torch.from_numpy(x), backend=backend)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    n = dk.silu_and_mul(readonly(x), backend=backend)
    np.testing.assert_array_equal(t.numpy(), n)
    strided = dk.silu_and_mul(np.asfortranarray(x), backend=backend)
    np.testing.assert_array_equal(strided, n)


def test_silu_and_mul_bad_input():
    with pytest.raises(ValueError, match="gate_up"):
        dk.silu_and_mul(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="gate_up"):
        dk.silu_and_mul(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="gate_up"):
        dk.silu_and_mul(np.zeros((2, 4), np.float64))


# ---- linear ---------------------------------------------------------------------------------------

def _linear_case(seed, m, n, k, dtype, with_bias):
    rng = np.random.default_rng(seed)
    x = make_float(rng, (m, k), "float32")
    w = make_float(rng, (n, k), dtype, scale=0.5)
    b = make_float(rng, (n,), "float32") if with_bias else None
    expect = ref.linear(as_f64(x), as_f64(w), None if b is None else as_f64(b))
    return x, w, b, expect


@given(m=st.integers(1, 70), n=st.integers(1, 40), k=st.integers(1, 1100), dtype=DTYPES, with_bias=st.booleans(),
       seed=SEEDS)
@example(m=1, n=1, k=1, dtype="bfloat16", with_bias=False, seed=0)  # smallest everything
@example(m=1, n=4096 // 512, k=4096, dtype="bfloat16", with_bias=False, seed=1)  # decode GEMV, long K
@example(m=16, n=9, k=1031, dtype="float32", with_bias=True, seed=2)  # 3 K chunks, ragged N and K
@example(m=65, n=5, k=33, dtype="bfloat16", with_bias=True, seed=3)  # two row blocks, ragged tile
def test_linear_matches_reference(backend, m, n, k, dtype, with_bias, seed):
    x, w, b, expect = _linear_case(seed, m, n, k, dtype, with_bias)
    got = dk.linear(x, w, b, backend=backend)
    assert got.dtype == np.float32 and got.shape == (m, n)
    # fp32 sums of k terms: torch's MKL was already ~1e-5 off at k=341
    tol = TOLERANCE_LONG if k >= 256 else TOLERANCE[dtype]
    assert_close(got, expect, **tol, what=f"linear M={m} N={n} K={k} {dtype}")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 16, 64, 65, 130])
def test_linear_every_tile_height(kernel_backend, m):
    # every remainder of the register tiles (3 or 4 rows), the row blocks of 64, ragged N and K
    x, w, b, expect = _linear_case(m, m, 11, 530, "bfloat16", True)
    assert_close(dk.linear(x, w, b, backend=kernel_backend), expect, **TOLERANCE["bfloat16"], what=f"M={m}")


def test_linear_cython_equals_numba():
    if len(KERNEL_BACKENDS) < 2:
        pytest.fail(f"both kernel backends should load here, got {KERNEL_BACKENDS}")
    for m, dtype in [(1, "bfloat16"), (16, "bfloat16"), (16, "float32"), (33, "float32")]:
        x, w, b, _ = _linear_case(m, m, 37, 777, dtype, True)
        a = dk.linear(x, w, b, backend="cython")
        c = dk.linear(x, w, b, backend="numba")
        assert_close(a, c, **TOLERANCE[dtype], what=f"cython vs numba M={m} {dtype}")


@pytest.mark.parametrize("m,n,k", [(5, 64, 32), (16, 200, 256), (17, 128, 96), (40, 192, 512)])
def test_linear_bf16_blocks_amx_path(m, n, k):
    # bf16 weights, M > 4, K % 32 == 0, N >= 64: the AMX tiles where the CPU has them (columns past
    # the last whole 32 by the FMA path); fp32-exact activation parts keep the FMA path's accuracy
    cdense = dk.kernel_module("dense", "cython")

    x, w, b, expect = _linear_case(m + n + k, m, n, k, "bfloat16", True)
    got = dk.linear(x, w, b, backend="cython")
    assert_close(got, expect, **TOLERANCE["float32"], what=f"amx={cdense.amx_available()} M={m} N={n} K={k}")
    old = cdense.set_amx_enabled(False)
    try:
        fma = dk.linear(x, w, b, backend="cython")
    finally:
        cdense.set_amx_enabled(old)
    assert_close(got, fma, **TOLERANCE["float32"], what="AMX vs FMA path")
    x[1, 3] = np.inf  # inf / NaN rows go to the FMA path: IEEE results
    x[2, 0] = np.nan
    got = dk.linear(x, w, b, backend="cython")
    assert np.isnan(got[2]).all() and not np.isnan(got[0]).any()
    assert np.array_equal(np.isinf(got[1]), np.ones(n, bool) & (w[:, 3] != 0))


@pytest.mark.parametrize("m", [1, 16])
def test_linear_independent_of_n_threads(kernel_backend, m):
    x, w, b, _ = _linear_case(7, m, 300, 1500, "bfloat16", True)  # big enough to run threaded
    one = dk.linear(x, w, b, backend=kernel_backend, n_threads=1)
    for n in (2, 3):
        assert_close(dk.linear(x, w, b, backend=kernel_backend, n_threads=n), one, rtol=1e-6, atol=1e-6,
                     what=f"n_threads={n}")


def test_linear_readonly_memmap_weights_and_strided_x(backend, tmp_path):
    x, w, b, expect = _linear_case(5, 6, 19, 70, "bfloat16", True)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r", shape=w.shape)
    assert not mapped.flags.writeable
    got = dk.linear(x, mapped, readonly(b), backend=backend)
    assert_close(got, expect, **TOLERANCE["bfloat16"], what="memmap weights")
    wide = np.zeros((6, 140), np.float32)
    wide[:, ::2] = x
    np.testing.assert_array_equal(dk.linear(wide[:, ::2], mapped, b, backend=backend), got)
    np.testing.assert_array_equal(dk.linear(np.asfortranarray(x), w, b, backend=backend), got)


def test_linear_torch_bf16_weights_and_leading_dims(backend):
    x, w, b, expect = _linear_case(9, 6, 8, 40, "bfloat16", False)
    xt = torch.from_numpy(x.reshape(2, 3, 40))
    got = dk.linear(xt, as_torch(w), backend=backend)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (2, 3, 8)
    assert_close(got.reshape(6, 8), expect, **TOLERANCE["bfloat16"], what="torch bf16 weights")
    xb = dk.linear(xt.bfloat16(), as_torch(w), backend=backend)  # bf16 activations are upcast
    expect_b = ref.linear(as_f64(xt.bfloat16().reshape(6, 40)), as_f64(w))
    assert_close(xb.reshape(6, 8), expect_b, **TOLERANCE["bfloat16"], what="bf16 activations")


def test_linear_empty_dims(backend):
    b = np.arange(3, dtype=np.float32)
    w = np.zeros((3, 4), np.float32)
    assert dk.linear(np.zeros((0, 4), np.float32), w, backend=backend).shape == (0, 3)
    np.testing.assert_array_equal(dk.linear(np.zeros((2, 0), np.float32), np.zeros((3, 0), np.float32), b,
                                            backend=backend), np.stack([b, b]))


def test_linear_bad_input():
    x, w = np.zeros((2, 8), np.float32), np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match=r"x and weight disagree on K.*\(2, 7\).*\(4, 8\)"):
        dk.linear(np.zeros((2, 7), np.float32), w)
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        dk.linear(x, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="bias"):
        dk.linear(x, w, np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="weight"):
        dk.linear(x, w.astype(np.float64))
    with pytest.raises(TypeError, match="x"):
        dk.linear(x.astype(np.int32), w)
    with pytest.raises(ValueError, match="x must have at least 1"):
        dk.linear(np.array(1.0, np.float32), w)
    with pytest.raises(ValueError, match="n_threads"):
        dk.linear(x, w, n_threads=0)


# ---- RMSNorm --------------------------------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=2), h=st.integers(1, 700), dtype=DTYPES,
       offset=st.sampled_from([0.0, 1.0]), eps=st.sampled_from([1e-6, 1e-5, 0.1]), fused=st.booleans(), seed=SEEDS)
@example(shape=[16], h=4096, dtype="bfloat16", offset=0.0, eps=1e-6, fused=True, seed=0)  # Qwen3-8B block
def test_rms_norm_matches_reference(backend, shape, h, dtype, offset, eps, fused, seed):
    rng = np.random.default_rng(seed)
    x = make_float(rng, (*shape, h), dtype, scale=2.0)
    w = make_float(rng, (h,), dtype, scale=0.3)
    tol = TOLERANCE_LONG if h >= 1000 else TOLERANCE[dtype]
    if not fused:
        got = dk.rms_norm(x, w, eps, offset=offset, backend=backend)
        assert got.dtype == np.float32 and got.shape == x.shape
        assert_close(got, ref.rms_norm(as_f64(x), as_f64(w), eps=eps, offset=offset), **tol, what="rms_norm")
        return
    res = make_float(rng, (*shape, h), "float32")
    normed, new_res = dk.rms_norm(x, w, eps, offset=offset, residual=res, backend=backend)
    e_normed, e_res = ref.rms_norm_residual(as_f64(x), as_f64(res), as_f64(w), eps=eps, offset=offset)
    assert_close(new_res, e_res, **TOLERANCE["float32"], what="x + residual")
    assert_close(normed, e_normed, **tol, what="rms_norm(x + residual)")


def test_rms_norm_independent_of_n_threads_and_torch_io(kernel_backend):
    rng = np.random.default_rng(3)
    x = make_float(rng, (64, 1024), "float32")  # 64K elements: parallel with 2+ threads
    w = make_float(rng, (1024,), "float32")
    one = dk.rms_norm(x, w, 1e-6, backend=kernel_backend, n_threads=1)
    np.testing.assert_array_equal(dk.rms_norm(x, w, 1e-6, backend=kernel_backend, n_threads=3), one)
    t = dk.rms_norm(torch.from_numpy(x), torch.from_numpy(w).bfloat16(), 1e-6, backend=kernel_backend)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    strided = dk.rms_norm(np.asfortranarray(x), readonly(w), 1e-6, backend=kernel_backend)
    np.testing.assert_array_equal(strided, one)


def test_rms_norm_bad_input():
    x, w = np.zeros((2, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="w must have shape"):
        dk.rms_norm(x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps"):
        dk.rms_norm(x, w, -1e-6)
    with pytest.raises(ValueError, match="eps"):
        dk.rms_norm(x, w, float("nan"))
    with pytest.raises(ValueError, match="residual"):
        dk.rms_norm(x, w, residual=np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match="x must have shape"):
        dk.rms_norm(np.zeros((2, 0), np.float32), np.ones(0, np.float32))
    with pytest.raises(TypeError, match="x"):
        dk.rms_norm(x.astype(np.float64), w)


# ---- RoPE -----------------------------------------------------------------------------------------

@given(t=st.integers(1, 20), h=st.integers(1, 5), half_d=st.integers(1, 80), partial=st.sampled_from([1, 2, 4]),
       theta=st.sampled_from([1e4, 1e6, 1e7]), max_pos=st.sampled_from([16, 40960, 262144]),
       in_place=st.booleans(), seed=SEEDS)
@example(t=16, h=32, half_d=64, partial=1, theta=1e6, max_pos=40960, in_place=False, seed=0)  # Qwen3 q
@example(t=3, h=2, half_d=64, partial=4, theta=1e7, max_pos=262144, in_place=True, seed=1)  # Qwen3.5 partial
def test_apply_rope_matches_reference(backend, t, h, half_d, partial, theta, max_pos, in_place, seed):
    rng = np.random.default_rng(seed)
    d = 2 * half_d
    rotary_dim = max(2, (d // partial) // 2 * 2)
    x = make_float(rng, (t, h, d), "float32")
    pos = rng.integers(0, max_pos, t)
    expect = ref.apply_rope(as_f64(x), torch.from_numpy(pos), theta=theta, rotary_dim=rotary_dim)
    if in_place:
        y = x.copy()
        got = dk.apply_rope(y, pos, theta, rotary_dim, out=y, backend=backend)
        assert got is y
    else:
        got = dk.apply_rope(x, pos, theta, rotary_dim, backend=backend)
        assert got.dtype == np.float32 and got.shape == x.shape
    assert_close(got, expect, **TOLERANCE["float32"], what=f"rope rotary_dim={rotary_dim}/{d}")
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])  # untouched tail


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_scaled_rope_matches_transformers_and_reference(backend, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                                   rope_theta=5e5, rope_scaling=dict(scaling))
    hf_freq, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    freq = dk.rope_inv_freq(5e5, 128, scaling)
    np.testing.assert_allclose(freq, hf_freq.double().numpy(), rtol=1e-6)  # HF forms them in float32
    rng = np.random.default_rng(0)
    x = make_float(rng, (7, 3, 128), "float32")
    pos = rng.integers(0, 100_000, 7)
    got = dk.apply_rope(x, pos, 5e5, inv_freq=freq, backend=backend)
    expect = ref.apply_rope(as_f64(x), torch.from_numpy(pos), theta=5e5, rotary_dim=128, inv_freq=freq)
    assert_close(got, expect, **TOLERANCE["float32"], what=f"{scaling['rope_type']} rope")
    plain = dk.apply_rope(x, pos, 5e5, backend=backend)
    assert not np.allclose(got, plain)  # the scaling is applied, not ignored
    with pytest.raises(ValueError, match="inv_freq"):
        dk.apply_rope(x, pos, 5e5, inv_freq=freq[:-1], backend=backend)
    with pytest.raises(ValueError, match="not supported"):
        dk.rope_inv_freq(5e5, 128, {"rope_type": "yarn", "factor": 4.0})


def test_apply_rope_far_positions_use_accurate_angles(backend):
    # pos * inv_freq ~ 2.6e5 rad: fp32 angles would be off by ~1e-2 rad
    x = np.ones((3, 1, 128), np.float32)
    pos = np.array([262143, 200001, 131072])
    got = dk.apply_rope(x, pos, 1e7, backend=backend)
    expect = ref.apply_rope(as_f64(x), torch.from_numpy(pos), theta=1e7, rotary_dim=128)
    assert_close(got, expect, rtol=1e-5, atol=1e-6, what="far positions")


def test_apply_rope_torch_io_and_n_threads(kernel_backend):
    rng = np.random.default_rng(4)
    x = make_float(rng, (16, 32, 128), "float32")
    pos = torch.arange(100, 116)
    one = dk.apply_rope(torch.from_numpy(x), pos, 1e6, backend=kernel_backend, n_threads=1)
    assert isinstance(one, torch.Tensor) and one.dtype == torch.float32
    three = dk.apply_rope(torch.from_numpy(x), pos, 1e6, backend=kernel_backend, n_threads=3)
    np.testing.assert_array_equal(one.numpy(), three.numpy())
    xt = torch.from_numpy(x.copy())
    assert dk.apply_rope(xt, pos, 1e6, out=xt, backend=kernel_backend) is xt  # in place on a tensor
    np.testing.assert_array_equal(xt.numpy(), one.numpy())


def test_apply_rope_inv_freq_tensor_of_any_float_dtype():
    """inv_freq as a torch tensor is read as its values whatever its dtype (a bf16 tensor's numpy view
    holds bit patterns)."""
    x = make_float(np.random.default_rng(5), (3, 2, 8), "float32")
    freq = torch.tensor([1.0, 0.5, 0.25, 0.125])  # exact in bf16
    want = dk.apply_rope(x, np.arange(3), 1e4, inv_freq=freq.numpy().astype(np.float64))
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        np.testing.assert_array_equal(dk.apply_rope(x, np.arange(3), 1e4, inv_freq=freq.to(dtype)), want)


def test_apply_rope_bad_input():
    x, pos = np.zeros((2, 1, 8), np.float32), np.array([0, 1])
    with pytest.raises(ValueError, match="rotary_dim"):
        dk.apply_rope(x, pos, 1e4, rotary_dim=3)
    with pytest.raises(ValueError, match="rotary_dim"):
        dk.apply_rope(x, pos, 1e4, rotary_dim=10)
    with pytest.raises(ValueError, match="positions values must lie"):
        dk.apply_rope(x, np.array([0, -1]), 1e4)
    with pytest.raises(ValueError, match="positions must have shape"):
        dk.apply_rope(x, np.array([0, 1, 2]), 1e4)
    with pytest.raises(TypeError, match="positions"):
        dk.apply_rope(x, np.array([0.0, 1.0]), 1e4)
    with pytest.raises(ValueError, match="theta"):
        dk.apply_rope(x, pos, 0.0)
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        dk.apply_rope(np.zeros((2, 8), np.float32), pos, 1e4)
    with pytest.raises(ValueError, match="out"):
        dk.apply_rope(x, pos, 1e4, out=np.zeros((2, 1, 6), np.float32))
    with pytest.raises(TypeError, match="out"):
        dk.apply_rope(x, pos, 1e4, out=np.zeros((2, 1, 8), np.float64))


def test_small_ops_cython_equals_numba():
    if len(KERNEL_BACKENDS) < 2:
        pytest.fail(f"both kernel backends should load here, got {KERNEL_BACKENDS}")
    rng = np.random.default_rng(11)
    x, res = make_float(rng, (5, 3, 136), "float32"), make_float(rng, (5, 3, 136), "float32")
    w = make_float(rng, (136,), "bfloat16")
    pos = rng.integers(0, 262144, 5)
    runs = {b: (dk.rms_norm(x, w, 1e-6, offset=1.0, residual=res, backend=b), dk.apply_rope(x, pos, 1e7, 34, backend=b),
                dk.silu_and_mul(x.reshape(15, 136), backend=b)) for b in ("cython", "numba")}
    (n_c, r_c), rope_c, silu_c = runs["cython"]
    (n_n, r_n), rope_n, silu_n = runs["numba"]
    np.testing.assert_array_equal(r_c, r_n)  # x + residual: one rounding, identical
    for a, b, what in [(n_c, n_n, "rms_norm"), (rope_c, rope_n, "rope"), (silu_c, silu_n, "silu_and_mul")]:
        assert_close(a, b, **TOLERANCE["float32"], what=f"cython vs numba {what}")


@pytest.mark.parametrize("offset_bytes", [0, 2, 8, 16, 48, 62])
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_linear_bf16_weights_off_a_cache_line(offset_bytes, precision):
    """Weights that start off a 64-byte boundary (safetensors puts tensors 8 bytes past one): the
    AMX path's K steps start at the boundary and the head + tail elements form one step of their
    own (pyx/dk_amx.h); every other path reads in place. All equal the reference."""
    rng = np.random.default_rng(offset_bytes)
    m, n, k = 20, 96, 256
    buf = make_float(rng, n * k + 64, "bfloat16")
    start = (-buf.ctypes.data % 64 + offset_bytes) // 2
    w = buf[start:start + n * k].reshape(n, k)
    assert w.ctypes.data % 64 == offset_bytes
    x = rng.standard_normal((m, k)).astype(np.float32)
    from dflash_kernels.reference.dense import round_activations

    xr = round_activations(torch.from_numpy(x), {"highest": 3, "medium": 1}[precision]).double()
    expect = (xr @ as_f64(w).T).numpy()
    got = dk.linear(x, w, precision=precision, backend="cython")
    assert_close(got, expect, **TOLERANCE_LONG, what=f"offset {offset_bytes} {precision}")


@pytest.mark.parametrize("offset,err", [("a", TypeError), (float("nan"), ValueError), (True, TypeError)])
def test_rms_norm_bad_offset_named(offset, err):
    x = np.ones((2, 8), np.float32)
    with pytest.raises(err, match="offset must be"):
        dk.rms_norm(x, np.ones(8, np.float32), offset=offset)
