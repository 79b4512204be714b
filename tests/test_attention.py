"""Attention ops against the float64 torch reference; cython == numba; independence of n_threads."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels as dk
from dflash_kernels._precision import PRECISIONS
from dflash_kernels._tensors import bf16_to_f32, f32_to_bf16
from dflash_kernels.reference import attention as ref
from support import KERNEL_BACKENDS, TOLERANCE, TOLERANCE_LONG, as_f64, as_torch, assert_close, make_float, readonly

DTYPES = st.sampled_from(["float32", "bfloat16"])
WINDOWS = st.one_of(st.none(), st.integers(1, 40))


def _injected_inputs(seed, t_q, t_ctx, h_kv, group, d, dtype, ctx_dtype=None):
    rng = np.random.default_rng(seed)
    q = make_float(rng, (t_q, h_kv * group, d), "float32")
    kc = make_float(rng, (t_ctx, h_kv, d), ctx_dtype or dtype)
    vc = make_float(rng, (t_ctx, h_kv, d), ctx_dtype or dtype)
    kb = make_float(rng, (t_q, h_kv, d), dtype)
    vb = make_float(rng, (t_q, h_kv, d), dtype)
    return q, kc, vc, kb, vb


def _cached_inputs(seed, t_q, t_kv, h_kv, group, d, dtype, q_dtype="float32"):
    rng = np.random.default_rng(seed)
    q = make_float(rng, (t_q, h_kv * group, d), q_dtype)
    k = make_float(rng, (t_kv, h_kv, d), dtype)
    v = make_float(rng, (t_kv, h_kv, d), dtype)
    return q, k, v


def _ref_kw(kw):
    """The reference's arguments: precision as its bf16 parts."""
    kw = dict(kw)
    if "precision" in kw:
        kw["parts"] = PRECISIONS[kw.pop("precision")]
    return kw


def _check_injected(args, backend, tol, **kw):
    got = dk.injected_kv_attention(*args, backend=backend, **kw)
    assert got.dtype == np.float32 and got.shape == args[0].shape
    assert_close(got, ref.injected_kv_attention(*(as_f64(a) for a in args), **_ref_kw(kw)), **tol,
                 what=f"injected_kv_attention {backend} {kw}")
    return got


def _check_cached(args, backend, tol, **kw):
    got = dk.cached_attention(*args, backend=backend, **kw)
    assert got.dtype == np.float32 and got.shape == args[0].shape
    assert_close(got, ref.cached_attention(*(as_f64(a) for a in args), **_ref_kw(kw)), **tol,
                 what=f"cached_attention {backend} {kw}")
    return got


@given(t_q=st.integers(1, 20), t_ctx=st.sampled_from([0, 1, 7, 64, 65, 150]), h_kv=st.integers(1, 3),
       group=st.integers(1, 8), d=st.sampled_from([64, 128, 256]), dtype=DTYPES,
       causal_block=st.booleans(), window=WINDOWS, seed=st.integers(0, 2**32 - 1))
def test_injected_matches_reference(backend, t_q, t_ctx, h_kv, group, d, dtype, causal_block, window, seed):
    args = _injected_inputs(seed, t_q, t_ctx, h_kv, group, d, dtype)
    _check_injected(args, backend, TOLERANCE[dtype], causal_block=causal_block, window=window)


@given(t_kv=st.integers(1, 200), t_q=st.sampled_from([1, 1, 2, 16, 17, 40]), h_kv=st.integers(1, 3),
       group=st.integers(1, 8), d=st.sampled_from([64, 128, 256]), dtype=DTYPES, causal=st.booleans(),
       window=WINDOWS, seed=st.integers(0, 2**32 - 1))
def test_cached_matches_reference(backend, t_kv, t_q, h_kv, group, d, dtype, causal, window, seed):
    args = _cached_inputs(seed, min(t_q, t_kv), t_kv, h_kv, group, d, dtype)
    _check_cached(args, backend, TOLERANCE[dtype], causal=causal, window=window)


@given(d=st.sampled_from([1, 8, 40, 72, 100]), t_q=st.integers(1, 9), t_ctx=st.integers(0, 80),
       group=st.sampled_from([1, 3, 5]), causal_block=st.booleans(), window=WINDOWS,
       seed=st.integers(0, 2**32 - 1))
def test_odd_head_dims(kernel_backend, d, t_q, t_ctx, group, causal_block, window, seed):
    args = _injected_inputs(seed, t_q, t_ctx, 2, group, d, "float32")
    _check_injected(args, kernel_backend, TOLERANCE["float32"], causal_block=causal_block, window=window)
    cargs = _cached_inputs(seed, t_q, t_ctx + t_q, 2, group, d, "bfloat16")
    _check_cached(cargs, kernel_backend, TOLERANCE["bfloat16"], window=window)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prefill(kernel_backend, dtype, window):
    """T_q = T_kv (many query blocks, causal tiles cut across the diagonal), like a prompt prefill."""
    args = _cached_inputs(1, 300, 300, 2, 4, 64, dtype)
    _check_cached(args, kernel_backend, TOLERANCE_LONG, window=window)


@pytest.mark.parametrize("t_q", [1, 16])
def test_long_context_key_splits(kernel_backend, t_q):
    """Few query rows over thousands of keys: the key range is split and the partials merged."""
    args = _cached_inputs(2, t_q, 3000, 8, 4, 128, "bfloat16")
    _check_cached(args, kernel_backend, TOLERANCE_LONG)
    iargs = _injected_inputs(3, t_q, 3000, 2, 4, 128, "float32")
    _check_injected(iargs, kernel_backend, TOLERANCE_LONG, window=1000)


@given(t_q=st.sampled_from([1, 2]), t_ctx=st.integers(0, 300), group=st.integers(1, 4),
       d=st.sampled_from([64, 128, 80]), dtype=DTYPES, ctx_dtype=DTYPES, window=WINDOWS,
       seed=st.integers(0, 2**32 - 1))
def test_decode_steps_match_reference(kernel_backend, t_q, t_ctx, group, d, dtype, ctx_dtype, window, seed):
    """A decode step's few query rows per kv head (at most 4 here) at every tier: with D = 64 or 128
    the Cython kernels read K and V in place (no tiles; dk_qk_direct), including tiles that straddle
    the context and the block in mixed dtypes; D = 80 takes the tiled path."""
    args = _injected_inputs(seed, t_q, t_ctx, 3, group, d, dtype, ctx_dtype=ctx_dtype)
    _check_injected(args, kernel_backend, TOLERANCE["bfloat16"], window=window)
    cached = _cached_inputs(seed, t_q, t_ctx + t_q, 3, group, d, dtype)
    _check_cached(cached, kernel_backend, TOLERANCE["bfloat16"], window=window)


@pytest.mark.parametrize("t_q,t_kv", [(1, 2000), (16, 2000), (200, 200)])
def test_independent_of_n_threads(kernel_backend, t_q, t_kv):
    args = _cached_inputs(4, t_q, t_kv, 4, 4, 64, "float32")
    one = dk.cached_attention(*args, n_threads=1, backend=kernel_backend)
    two = dk.cached_attention(*args, n_threads=2, backend=kernel_backend)
    three = dk.cached_attention(*args, n_threads=3, backend=kernel_backend)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, three)


@pytest.mark.skipif(len(KERNEL_BACKENDS) < 2, reason="needs both the cython and the numba backend")
@given(t_q=st.integers(1, 20), t_ctx=st.integers(0, 700), group=st.integers(1, 6), dtype=DTYPES,
       causal_block=st.booleans(), window=WINDOWS, seed=st.integers(0, 2**32 - 1))
def test_cython_equals_numba(t_q, t_ctx, group, dtype, causal_block, window, seed):
    args = _injected_inputs(seed, t_q, t_ctx, 2, group, 64, dtype)
    kw = dict(causal_block=causal_block, window=window)
    c = dk.injected_kv_attention(*args, backend="cython", **kw)
    n = dk.injected_kv_attention(*args, backend="numba", **kw)
    np.testing.assert_allclose(c, n, rtol=2e-6, atol=2e-6)


# "medium" against the reference's own rounding: fp32 sums differ, and so does where P is rounded
# (the kernels round exp(s - running max) per key tile, the reference exp(s - row max), each to
# within 2^-9 relative).
TOLERANCE_MEDIUM = dict(rtol=5e-3, atol=5e-3)


def _medium_paths(backend):
    """(bf16dot, amx) settings that reach each "medium" path of this tier: vdpbf16ps runs only where
    it measured ahead of FMA (dense.bf16dot_pays: Zen 4 yes, Sapphire Rapids no) and AMX where the
    CPU grants it; the tests force each one that is built."""
    dense = dk.kernel_module("dense", "cython") if backend == "cython" else None
    if dense is None or not dense.bf16dot_available():
        return [(None, None)]
    return [(False, False), (True, False)] + ([(None, True)] if dense.amx_available() else [])


def _each_medium_path(backend, check):
    dense = dk.kernel_module("dense", "cython") if backend == "cython" else None
    for dot, amx in _medium_paths(backend):
        old_dot = dense.set_bf16dot_enabled(dot) if dot is not None else None
        old_amx = dense.set_amx_enabled(amx) if amx is not None else None
        try:
            check()
        finally:
            if dot is not None:
                dense.set_bf16dot_enabled(old_dot)
            if amx is not None:
                dense.set_amx_enabled(old_amx)


@given(t_q=st.integers(1, 20), t_ctx=st.sampled_from([0, 1, 7, 64, 65, 150]), group=st.integers(1, 6),
       d=st.sampled_from([31, 64, 128]), dtype=DTYPES, ctx_dtype=DTYPES, causal_block=st.booleans(),
       window=WINDOWS, seed=st.integers(0, 2**32 - 1))
def test_medium_matches_reference(kernel_backend, t_q, t_ctx, group, d, dtype, ctx_dtype, causal_block, window,
                                  seed):
    """Every tier's "medium" paths (pair words on AMX tiles or vdpbf16ps, rounded operands on FMA),
    with mixed source dtypes, D not a multiple of 32 or odd, and key pairs that straddle the two
    sources."""
    args = _injected_inputs(seed, t_q, t_ctx, 2, group, d, dtype, ctx_dtype)
    cargs = _cached_inputs(seed, t_q, t_ctx + t_q, 2, group, d, dtype)

    def check():
        _check_injected(args, kernel_backend, TOLERANCE_MEDIUM, causal_block=causal_block, window=window,
                        precision="medium")
        _check_cached(cargs, kernel_backend, TOLERANCE_MEDIUM, window=window, precision="medium")
    _each_medium_path(kernel_backend, check)


@given(t_q=st.integers(5, 40), t_ctx=st.integers(1, 300), group=st.integers(1, 6), d=st.sampled_from([64, 128]),
       window=WINDOWS, seed=st.integers(0, 2**32 - 1))
def test_highest_on_amx_tiles(t_q, t_ctx, group, d, window, seed):
    """"highest" over bf16 K and V on AMX tiles (three exact bf16 parts of the queries and of P): within
    the fp32 tolerance of the reference, as the FMA tiles it replaces (AMX switched off), and not
    their bits (another summation order: the AMX path ran). Random fp32 queries carry bits that one
    bf16 part would lose (~1e-3)."""
    dense = dk.kernel_module("dense", "cython")
    if not dense.amx_available():
        pytest.skip("AMX tiles are not available on this CPU")
    args = _injected_inputs(seed, t_q, t_ctx, 2, group, d, "bfloat16")
    cargs = _cached_inputs(seed, t_q, t_ctx + t_q, 2, group, d, "bfloat16")
    fixed = _cached_inputs(0, 16, 200, 2, 4, 128, "bfloat16")  # many keys per row: the orders differ
    got = [_check_injected(args, "cython", TOLERANCE["bfloat16"], window=window),
           _check_cached(cargs, "cython", TOLERANCE["bfloat16"], window=window),
           _check_cached(fixed, "cython", TOLERANCE["bfloat16"])]
    old = dense.set_amx_enabled(False)
    try:
        fma = [_check_injected(args, "cython", TOLERANCE["bfloat16"], window=window),
               _check_cached(cargs, "cython", TOLERANCE["bfloat16"], window=window),
               _check_cached(fixed, "cython", TOLERANCE["bfloat16"])]
    finally:
        dense.set_amx_enabled(old)
    assert not np.array_equal(got[2], fma[2])


@pytest.mark.parametrize("d", [2, 3, 64])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_medium_rounds_every_operand(kernel_backend, d, kv):
    """Two keys, scale 1: key 0 is zero, key 1 and the query are 1.003 on dim 0 (1 in bf16); V is
    1 / 0. "medium" then gives exactly bf16(e^-1) / (1 + e^-1) (queries, K and P rounded), and
    one key gives bf16(v) (V rounded); "highest" and "high" give the unrounded values."""
    q = np.zeros((1, 1, d), np.float32)
    q[0, 0, 0] = 1.003
    k = np.zeros((2, 1, d), np.float32)
    k[1, 0, 0] = 1.003
    v = np.zeros((2, 1, d), np.float32)
    v[0, 0, :] = 1.0
    v_one = np.random.default_rng(0).standard_normal((1, 1, d)).astype(np.float32)
    if kv == "bfloat16":
        k, v = f32_to_bf16(k), f32_to_bf16(v)
    kw = dict(scale=1.0, backend=kernel_backend)
    p0 = float(bf16_to_f32(f32_to_bf16(np.float32([np.exp(-1.0)])))[0])

    def check():
        got = dk.cached_attention(q, k, v, precision="medium", **kw)[0, 0, 0]
        assert abs(got - p0 / (1 + np.exp(-1.0))) < 1e-6
        one = dk.cached_attention(q, v_one, v_one, precision="medium", **kw)
        np.testing.assert_array_equal(one, bf16_to_f32(f32_to_bf16(v_one)))
    _each_medium_path(kernel_backend, check)
    s1 = 1.003 * (1.003 if kv == "float32" else 1.0)
    exact = np.exp(-s1) / (1 + np.exp(-s1))
    for precision in ("highest", "high"):
        assert abs(dk.cached_attention(q, k, v, precision=precision, **kw)[0, 0, 0] - exact) < 1e-6
        np.testing.assert_array_equal(dk.cached_attention(q, v_one, v_one, precision=precision, **kw), v_one)


def test_window_semantics(kernel_backend):
    """A window covering everything is no window; window=1 with a causal block sees only itself."""
    args = _injected_inputs(5, 6, 30, 2, 2, 64, "float32")
    full = dk.injected_kv_attention(*args, causal_block=True, backend=kernel_backend)
    np.testing.assert_array_equal(full, dk.injected_kv_attention(*args, causal_block=True, window=36,
                                                                 backend=kernel_backend))
    own = dk.injected_kv_attention(*args, causal_block=True, window=1, backend=kernel_backend)
    v_blk = args[4]  # (T_q, H_kv, D): query head h reads kv head h // 2
    np.testing.assert_allclose(own, np.repeat(v_blk, 2, axis=1), rtol=1e-6, atol=1e-6)


def test_decode_rows_equal_prefill_rows(kernel_backend):
    """Causal prefill row i equals decoding position i against the first i+1 cache rows."""
    q, k, v = _cached_inputs(6, 70, 70, 2, 3, 64, "float32")
    full = dk.cached_attention(q, k, v, backend=kernel_backend)
    for i in (0, 1, 33, 69):
        row = dk.cached_attention(q[i:i + 1], k[:i + 1], v[:i + 1], backend=kernel_backend)
        np.testing.assert_allclose(row[0], full[i], rtol=1e-6, atol=1e-6)


def test_mixed_source_dtypes(kernel_backend):
    """bf16 context cache with float32 block keys/values (each source read in its own dtype)."""
    args = _injected_inputs(7, 16, 100, 2, 4, 128, "float32", ctx_dtype="bfloat16")
    _check_injected(args, kernel_backend, TOLERANCE["bfloat16"])


def test_torch_bf16_readonly_and_strided(backend):
    q, k, v = _cached_inputs(8, 5, 40, 2, 2, 64, "bfloat16", q_dtype="bfloat16")
    base = dk.cached_attention(q, k, v, backend=backend)
    t = dk.cached_attention(as_torch(q), as_torch(k), as_torch(v), backend=backend)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), base)
    # read-only arrays (memory-mapped caches) are read in place; Numba compiles a separate variant
    ro = dk.cached_attention(readonly(q), readonly(k), readonly(v), backend=backend)
    np.testing.assert_allclose(ro, base, rtol=1e-6, atol=1e-6)
    k_strided = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)  # (T_kv, H_kv, D) view
    assert not k_strided.flags.c_contiguous
    np.testing.assert_array_equal(dk.cached_attention(q, k_strided, v, backend=backend), base)
    q32 = as_f64(q).float().numpy()
    np.testing.assert_array_equal(dk.cached_attention(q32[:, ::-1][:, ::-1], k, v, backend=backend), base)


def test_empty_queries_and_empty_context(backend):
    q, k, v = _cached_inputs(9, 0, 10, 2, 2, 64, "float32")
    assert dk.cached_attention(q, k, v, backend=backend).shape == (0, 4, 64)
    assert dk.cached_attention(q, k[:0], v[:0], backend=backend).shape == (0, 4, 64)
    e = np.zeros((0, 2, 64), np.float32)
    assert dk.injected_kv_attention(q, e, e, e, e, backend=backend).shape == (0, 4, 64)


def test_bad_input():
    q, k, v = _cached_inputs(10, 4, 10, 2, 2, 64, "float32")
    kb = k[:4]
    with pytest.raises(ValueError, match="q"):
        dk.cached_attention(q[0], k, v)
    with pytest.raises(ValueError, match="k_cache"):
        dk.cached_attention(q, k[0], v[0])
    with pytest.raises(ValueError, match="v_cache"):
        dk.cached_attention(q, k, v[:5])
    with pytest.raises(TypeError, match="v_cache"):
        dk.cached_attention(q, k, v.astype(np.float64))
    with pytest.raises(TypeError, match="q"):
        dk.cached_attention(q.astype(np.float16), k, v)
    with pytest.raises(ValueError, match="heads"):
        dk.cached_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="head dim"):
        dk.cached_attention(q[..., :32], k, v)
    with pytest.raises(ValueError, match="T_q <= T_kv"):
        dk.cached_attention(q, k[:3], v[:3])
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="window"):
            dk.cached_attention(q, k, v, window=bad)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            dk.cached_attention(q, k, v, scale=bad)
    with pytest.raises(TypeError, match="scale"):
        dk.cached_attention(q, k, v, scale="1")
    with pytest.raises(ValueError, match="k_blk"):
        dk.injected_kv_attention(q, k, v, k[:5], v[:5])
    with pytest.raises(ValueError, match="k_blk"):
        dk.injected_kv_attention(q, k, v, k[:4, :1], v[:4, :1])
    with pytest.raises(TypeError, match="k_blk"):
        dk.injected_kv_attention(q, k, v, kb.astype(np.float64), kb.astype(np.float64))
    with pytest.raises(ValueError, match="head dim"):
        dk.injected_kv_attention(q, k[..., :32], v[..., :32], kb, kb)
    with pytest.raises(ValueError, match="n_threads"):
        dk.cached_attention(q, k, v, n_threads=0)
    with pytest.raises(ValueError, match="backend"):
        dk.cached_attention(q, k, v, backend="fortran")
    for bad in ("low", "HIGHEST", 1):
        with pytest.raises(ValueError, match="precision must be one of highest, high, medium"):
            dk.cached_attention(q, k, v, precision=bad)
        with pytest.raises(ValueError, match="precision must be one of highest, high, medium"):
            dk.injected_kv_attention(q, k, v, kb, kb, precision=bad)


def test_nan_key_propagates_on_every_backend():
    """NaN in one K row reaches the outputs of the queries that see it, on every backend (Numba's
    exp turned it into 0 and dropped the key)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    k = rng.standard_normal((10, 2, 64)).astype(np.float32)
    v = rng.standard_normal((10, 2, 64)).astype(np.float32)
    k[3, 0, 5] = np.nan
    expect = np.zeros((2, 4), bool)
    expect[:, :2] = True  # query heads 0 and 1 read kv head 0; both queries see key 3

    def check(backend, precision):
        out = dk.cached_attention(q, k, v, causal=True, precision=precision, backend=backend)
        assert np.array_equal(np.isnan(out).any(axis=2), expect), (backend, precision)

    for b in dk.available_backends():
        check(b, "highest")
        _each_medium_path(b, lambda b=b: check(b, "medium"))  # the bf16 rounding keeps NaN a NaN


def test_huge_window_is_no_window():
    """window=2**70 raised OverflowError from the C conversion; it is wider than any sequence."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    k = rng.standard_normal((10, 2, 64)).astype(np.float32)
    assert np.array_equal(dk.cached_attention(q, k, k, window=2**70), dk.cached_attention(q, k, k))
    assert np.array_equal(dk.injected_kv_attention(q, k, k, k[:2], k[:2], window=2**70),
                          dk.injected_kv_attention(q, k, k, k[:2], k[:2]))
