"""Packed weights (dk.pack_weight / prepare_weight / PackedWeight) and linear's "fma-packed" path."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, strategies as st

import dflash_kernels as dk
from dflash_kernels._precision import PRECISIONS
from dflash_kernels.reference import dense as ref
from dflash_kernels.reference.dense import round_activations
from support import KERNEL_BACKENDS, MACHINE_TIERS, TOLERANCE, TOLERANCE_LONG, as_f64, assert_close, make_float

DTYPES = st.sampled_from(["float32", "bfloat16"])


def _case(seed, m, n, k, dtype, with_bias=True):
    rng = np.random.default_rng(seed)
    x = make_float(rng, (m, k), "float32")
    w = make_float(rng, (n, k), dtype, scale=0.5)
    b = make_float(rng, (n,), "float32") if with_bias else None
    return x, w, b


@given(n=st.integers(1, 70), k=st.integers(1, 300), dtype=DTYPES, seed=st.integers(0, 2**31))
@example(n=16, k=2, dtype="bfloat16", seed=0)  # one whole panel, one k-pair
@example(n=17, k=3, dtype="bfloat16", seed=1)  # a padded panel and a padded k-pair
def test_pack_unpack_round_trip(n, k, dtype, seed):
    w = make_float(np.random.default_rng(seed), (n, k), dtype)
    p = dk.pack_weight(w)
    assert p.shape == (n, k) and p.dtype == w.dtype and not p.data.flags.writeable
    assert p.data.size == -(-n // 16) * 16 * (-(-k // 32) * 32 if dtype == "bfloat16" else k)
    assert np.array_equal(p.unpack(), w) and np.array_equal(np.asarray(p), w)


def test_packed_layout_is_the_documented_one():
    # bf16: P[p][q][j][e] = w[16 p + j, 2 q + e], K padded to 32; fp32: P[p][k][j] = w[16 p + j, k]
    # (pyx/dk_packed.h)
    n, k = 35, 7
    w16 = make_float(np.random.default_rng(0), (n, k), "bfloat16")
    P = dk.pack_weight(w16).data.reshape(3, 16, 16, 2)
    for r, c in [(0, 0), (17, 3), (34, 6), (20, 5)]:
        assert P[r // 16, c // 2, r % 16, c % 2] == w16[r, c]
    assert P[2, 3, 2, 1] == 0 and P[2, 0, 3, 0] == 0 and not P[:, 4:].any()  # k >= 7, row 35: zeros
    w32 = make_float(np.random.default_rng(1), (n, k), "float32")
    P = dk.pack_weight(w32).data.reshape(3, k, 16)
    assert P[34 // 16, 6, 34 % 16] == w32[34, 6]


@given(m=st.integers(1, 40), n=st.integers(1, 120), k=st.integers(1, 700), dtype=DTYPES,
       with_bias=st.booleans(), seed=st.integers(0, 2**31))
@example(m=16, n=48 * 3 + 5, k=513, dtype="bfloat16", with_bias=True, seed=0)  # 3 K chunks, odd K, ragged N
@example(m=9, n=32, k=256, dtype="float32", with_bias=False, seed=1)  # two panels (a partial group)
def test_linear_packed_matches_reference(m, n, k, dtype, with_bias, seed):
    x, w, b = _case(seed, m, n, k, dtype, with_bias)
    expect = ref.linear(as_f64(x), as_f64(w), None if b is None else as_f64(b))
    p = dk.pack_weight(w)
    for backend in KERNEL_BACKENDS:
        got = dk.linear(x, p, b, backend=backend)
        tol = TOLERANCE_LONG if k >= 256 else TOLERANCE[dtype]
        assert_close(got, expect, **tol, what=f"packed {backend} M={m} N={n} K={k} {dtype}")
    if "cython" in KERNEL_BACKENDS:
        assert dk.kernel_module("dense", "cython").last_path().endswith("-packed")


@pytest.mark.parametrize("tier", MACHINE_TIERS)
@pytest.mark.parametrize("precision", list(PRECISIONS))
# (96, 70, 4100): on AMX three pairs of m blocks in several K chunks, and a last single panel
@pytest.mark.parametrize("m,n,k", [(1, 70, 256), (8, 48, 2), (16, 200, 513), (17, 97, 96), (40, 33, 1000),
                                   (96, 70, 4100)])
def test_linear_packed_every_tier_and_precision(tier, precision, m, n, k):
    # on the rounded activations only fp32 summation is left, as for the row-major paths
    rng = np.random.default_rng(m * n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = make_float(rng, (n, k), "bfloat16", 0.05)
    p = dk.pack_weight(w)
    dk.set_isa(tier)
    try:
        got = dk.linear(x, p, precision=precision, backend="cython").astype(np.float64)
        cdense = dk.kernel_module("dense", "cython")
        if m > 4 and cdense.amx_available():
            path = "amx-packed"
        elif precision != "highest" and cdense.bf16dot_pays():  # Zen 4: vdpbf16ps at twice the FMA rate
            path = "bf16dot-packed"
        else:
            path = "fma-packed"
        assert cdense.last_path() == f"{tier}:{path}"
    finally:
        dk.set_isa(None)
    xr = round_activations(torch.from_numpy(x), PRECISIONS[precision]).double().numpy()
    scale = np.abs(x).astype(np.float64) @ np.abs(as_f64(w).numpy()).T
    assert np.all(np.abs(got - xr @ as_f64(w).numpy().T) <= 2e-6 * scale + 1e-30)


def _amx_dense():
    """The Cython dense module where AMX runs, else the test is skipped."""
    cdense = dk.kernel_module("dense", "cython")
    if not cdense.amx_available():
        pytest.skip("no AMX on this CPU: the amx-packed path cannot run here")
    return cdense


def test_amx_packed_equals_fma_packed_up_to_summation_order():
    cdense = _amx_dense()
    x, w, b = _case(4, 33, 70, 1000, "bfloat16")
    p = dk.pack_weight(w)
    for precision in PRECISIONS:
        amx = dk.linear(x, p, b, precision=precision, backend="cython")
        assert cdense.last_path() == "amx:amx-packed"
        old = cdense.set_amx_enabled(False)
        try:
            fma = dk.linear(x, p, b, precision=precision, backend="cython")
            assert cdense.last_path() == "amx:fma-packed"
        finally:
            cdense.set_amx_enabled(old)
        assert_close(amx, fma, **TOLERANCE_LONG, what=f"amx vs fma packed, {precision}")


def test_amx_packed_rows_do_not_depend_on_m():
    # prefill-sized blocks run on 2 x 2 tiles in K chunks, a verification block on one m block in
    # one pass: the same products in the same order per step, so the same bits for a row either way
    cdense = _amx_dense()
    x, w, b = _case(6, 97, 70, 4100, "bfloat16")
    p = dk.pack_weight(w)
    for precision in PRECISIONS:
        full = dk.linear(x, p, b, precision=precision, backend="cython")
        for lo, hi in ((0, 16), (40, 56), (81, 97)):
            part = dk.linear(x[lo:hi], p, b, precision=precision, backend="cython")
            assert cdense.last_path() == "amx:amx-packed"
            assert np.array_equal(part, full[lo:hi]), f"rows {lo}:{hi}, {precision}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_packed_rows_do_not_depend_on_m_or_threads(kernel_backend, dtype):
    # one summation order per output (k ascending in fixed K chunks): row i's result is the same bits
    # whatever rows come with it and however many threads run, so a verification row and a decode
    # step of the same token agree exactly
    x, w, b = _case(3, 20, 300, 1100, dtype)
    p = dk.pack_weight(w)
    full = dk.linear(x, p, b, backend=kernel_backend, n_threads=1)
    for n_threads in (2, 3):
        assert np.array_equal(dk.linear(x, p, b, backend=kernel_backend, n_threads=n_threads), full)
    cdense = dk.kernel_module("dense", "cython")
    if kernel_backend.startswith("cython") and cdense.last_path().endswith("fma-packed"):
        for i in (0, 7, 19):  # (AMX tiles sum in their own order: rows agree to rounding there)
            assert np.array_equal(dk.linear(x[i : i + 1], p, b, backend=kernel_backend), full[i : i + 1])


def test_packed_bf16_and_fp32_sum_identically():
    # the two layouts run the same order: bf16 weights give the bits of the same values in fp32
    x, w, b = _case(5, 16, 50, 999, "bfloat16")
    w32 = as_f64(w).numpy().astype(np.float32)
    cdense = dk.kernel_module("dense", "cython")
    old = cdense.set_amx_enabled(False)  # the FMA tiles (AMX takes bf16 blocks where it exists)
    try:
        a = dk.linear(x, dk.pack_weight(w), b, backend="cython")
        assert cdense.last_path().endswith(":fma-packed")
    finally:
        cdense.set_amx_enabled(old)
    assert np.array_equal(a, dk.linear(x, dk.pack_weight(w32), b, backend="cython"))


def test_linear_packed_ieee_specials_and_empty():
    x, w, b = _case(1, 4, 20, 40, "bfloat16")
    x[1, 3], x[2, 0] = np.inf, np.nan
    p = dk.pack_weight(w)
    for precision in PRECISIONS:
        got = dk.linear(x, p, b, precision=precision, backend="cython")
        assert np.isnan(got[2]).all() and np.isfinite(got[0]).all()
        assert np.array_equal(np.isinf(got[1]), as_f64(w).numpy()[:, 3] != 0)
    assert dk.linear(np.zeros((0, 40), np.float32), p, b).shape == (0, 20)
    e = dk.pack_weight(np.zeros((5, 0), np.float32))
    assert np.array_equal(dk.linear(np.ones((2, 0), np.float32), e, np.arange(5, dtype=np.float32)),
                          np.tile(np.arange(5, dtype=np.float32), (2, 1)))


def test_linear_packed_torch_and_leading_dims():
    x, w, _ = _case(2, 6, 24, 64, "bfloat16")
    p = dk.pack_weight(torch.from_numpy(w.view(np.int16)).view(torch.bfloat16))
    got = dk.linear(torch.from_numpy(x).reshape(2, 3, 64), p)
    assert isinstance(got, torch.Tensor) and got.shape == (2, 3, 24)
    assert_close(got.numpy().reshape(6, 24), dk.linear(x, w), **TOLERANCE["bfloat16"], what="torch io")


def test_prepare_weight_packs_for_cython_only():
    w16 = make_float(np.random.default_rng(0), (64, 256), "bfloat16")
    w32 = make_float(np.random.default_rng(0), (64, 256), "float32")
    for tier in MACHINE_TIERS:  # every compiled path has a packed form (FMA, AMX, vdpbf16ps tiles)
        dk.set_isa(tier)
        try:
            for w in (w16, w32):
                assert isinstance(dk.prepare_weight(w), dk.PackedWeight)
        finally:
            dk.set_isa(None)
    assert dk.prepare_weight(w16, backend="numba") is w16  # only Cython reads the packed layout
    p = dk.pack_weight(w16)
    assert dk.prepare_weight(p) is p


@pytest.mark.parametrize("tier", [t for t in MACHINE_TIERS if t in ("avx512_bf16", "amx")])
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("m,n,k", [(1, 7, 40), (5, 33, 31), (16, 130, 1000), (20, 50, 600)])
def test_bf16dot_packed_path_forced(tier, parts, m, n, k):
    """vdpbf16ps over the packed layout (taken where it beats FMA, e.g. Zen 4): forced on, it equals
    the reference on the rounded activations (K and N tails, several K chunks and row tiles), and
    falls back to the FMA tiles on inf / NaN."""
    rng = np.random.default_rng(m + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = make_float(rng, (n, k), "bfloat16", 0.05)
    p = dk.pack_weight(w)
    dk.set_isa(tier)
    dense = dk.kernel_module("dense", "cython")
    old, old_amx = dense.set_bf16dot_enabled(True), dense.set_amx_enabled(False)
    try:
        out = np.empty((m, n), np.float32)
        dense.linear_packed(x, p.data, None, out, n_threads=2, parts=parts)
        assert dense.last_path() == f"{tier}:bf16dot-packed"
        assert dense.packed_path_name(m, True, parts) == f"{tier}:bf16dot-packed"
        xr = round_activations(torch.from_numpy(x), parts).double().numpy()
        scale = np.abs(x).astype(np.float64) @ np.abs(as_f64(w).numpy()).T
        assert np.all(np.abs(out - xr @ as_f64(w).numpy().T) <= 2e-6 * scale + 1e-30)
        x[0, 0] = np.inf
        dense.linear_packed(x, p.data, None, out, n_threads=2, parts=parts)
        assert dense.last_path() == f"{tier}:fma-packed"
        assert np.isinf(out[0]).any() or np.isnan(out[0]).any()
        assert np.isfinite(out[1:]).all()
    finally:
        dense.set_bf16dot_enabled(old)
        dense.set_amx_enabled(old_amx)
        dk.set_isa(None)


def test_packed_bad_input_named():
    x, w, _ = _case(0, 3, 20, 40, "bfloat16")
    p = dk.pack_weight(w)
    with pytest.raises(ValueError, match=r"x and weight disagree on K: x has shape \(3, 39\)"):
        dk.linear(x[:, :39].copy(), p)
    with pytest.raises(ValueError, match=r"bias must have shape \(20,\)"):
        dk.linear(x, p, np.zeros(19, np.float32))
    with pytest.raises(TypeError, match="weight"):
        dk.pack_weight(np.zeros((4, 4), np.int32))
    with pytest.raises(ValueError, match="weight"):
        dk.pack_weight(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="does not fit"):  # the unchecked kernel still guards memory
        dk.kernel_module("dense", "cython").linear_packed(x, p.data[:-1], None, np.empty((3, 20), np.float32),
                                                          n_threads=1)


def test_packed_infinite_weights_follow_ieee():
    # the AMX / vdpbf16ps tiles would multiply a zero activation part by inf (NaN): a packed weight
    # knows it holds inf and keeps to the FMA tiles, so x * inf is +-inf as IEEE says
    x, w, _ = _case(8, 16, 40, 64, "bfloat16")
    x[:, 5] = np.where(x[:, 5] == 0, 1.0, x[:, 5])
    w[3, 5] = 0x7F80  # +inf
    p = dk.pack_weight(w)
    assert not p.finite and dk.pack_weight(_case(8, 2, 2, 2, "bfloat16")[1]).finite
    for precision in PRECISIONS:
        got = dk.linear(x, p, precision=precision, backend="cython")
        assert np.array_equal(got[:, 3], np.where(x[:, 5] > 0, np.inf, -np.inf)), precision
        assert np.isfinite(np.delete(got, 3, axis=1)).all()


def test_large_packed_weights_sit_on_aligned_huge_page_memory():
    """Weights of 2 MiB and more are packed into a 2 MiB aligned private mapping advised for huge
    pages (dflash_kernels._tensors.hugepage_empty); smaller ones into ordinary numpy memory. Either
    way the values round-trip and the kernel reads them."""
    from dflash_kernels._tensors import HUGE_PAGE, hugepage_empty

    big = dk.pack_weight(make_float(np.random.default_rng(3), (1024, 1040), "bfloat16"))
    assert big.data.ctypes.data % HUGE_PAGE == 0 and big.data.nbytes >= HUGE_PAGE
    small = hugepage_empty((3, 5), np.float32)
    assert small.shape == (3, 5) and small.base is None  # plain np.empty
    assert isinstance(np.asarray(big.data).base, np.ndarray)  # a view into the mapping
    w = torch.randn(700, 1030).to(torch.bfloat16)
    pw = dk.pack_weight(w)
    assert np.array_equal(pw.unpack(), w.view(torch.int16).numpy().view(np.uint16))
    x = torch.randn(2, 1030)
    torch.testing.assert_close(dk.linear(x, pw, precision="highest"), x @ w.float().T, rtol=1e-5, atol=1e-4)
