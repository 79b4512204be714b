"""Matmul precisions ("highest", "high", "medium"): every backend and tier, bounds, the API."""

import numpy as np
import pytest
import torch

import dflash_kernels as dk
from dflash_kernels._precision import PRECISIONS
from dflash_kernels.reference.dense import round_activations
from support import MACHINE_TIERS, as_f64, make_float

# Error of a precision against the float64 product of the *unrounded* inputs, relative to
# sum_k |x_k w_k| (docs/conventions.md): the activation rounding (2^-9 for one bf16 part, 2^-16 for
# two) plus fp32 accumulation.
BOUND = {"highest": 2e-6, "high": 2e-5, "medium": 2.5e-3}


def _case(seed, m, n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = make_float(rng, (n, k), "bfloat16", 0.05)
    return x, w


def _exact_on_rounded(x, w, precision):
    """float64 product of the rounded activations: what every path must compute up to fp32 sums."""
    xr = round_activations(torch.from_numpy(x), PRECISIONS[precision])
    return (xr.double() @ as_f64(w).T).numpy()


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("m,n,k", [(1, 70, 256), (3, 33, 100), (16, 200, 512), (40, 97, 96), (5, 64, 1000)])
def test_linear_precision_every_backend(kernel_backend, precision, m, n, k):
    x, w = _case(m * n + k, m, n, k)
    got = dk.linear(x, w, precision=precision, backend=kernel_backend).astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(as_f64(w).numpy()).T
    # the rounding rule is the reference's: on the rounded activations only fp32 summation is left
    assert np.all(np.abs(got - _exact_on_rounded(x, w, precision)) <= 2e-6 * scale + 1e-30)
    exact = x.astype(np.float64) @ as_f64(w).numpy().T
    assert np.all(np.abs(got - exact) <= BOUND[precision] * scale), precision


def test_precision_bounds_are_tight_enough_to_fail():
    """The bound of "high" rejects "medium" results, and that of "highest" rejects "high": the
    table separates the precisions. K = 1, so that each output's error is its activation's rounding
    (over a long sum the errors of random signs cancel)."""
    x, w = _case(0, 64, 64, 1)
    scale = np.abs(x).astype(np.float64) @ np.abs(as_f64(w).numpy()).T
    exact = x.astype(np.float64) @ as_f64(w).numpy().T
    for looser, tighter in (("medium", "high"), ("high", "highest")):
        got = dk.linear(x, w, precision=looser, backend="torch").astype(np.float64)
        assert np.any(np.abs(got - exact) > BOUND[tighter] * scale), (looser, tighter)


@pytest.mark.parametrize("tier", [t for t in MACHINE_TIERS if t in ("avx512_bf16", "amx")])
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("m,n,k", [(1, 7, 40), (4, 64, 4096), (5, 33, 31), (16, 130, 1000), (70, 65, 2048)])
def test_bf16dot_path_forced(tier, parts, m, n, k):
    """vdpbf16ps path (taken where it beats FMA, e.g. Zen 4): forced on, it equals the reference,
    including K tails, N tails, several K chunks and M blocks, and falls back on inf / NaN."""
    dk.set_isa(tier)
    dense = dk.kernel_module("dense", "cython")
    old = dense.set_bf16dot_enabled(True)
    old_amx = dense.set_amx_enabled(False)
    try:
        x, w = _case(m + n + k, m, n, k)
        out = np.empty((m, n), np.float32)
        dense.linear(x, w, None, out, n_threads=2, parts=parts)
        assert dense.last_path() == f"{tier}:bf16dot"
        prec = {1: "medium", 2: "high"}[parts]
        scale = np.abs(x).astype(np.float64) @ np.abs(as_f64(w).numpy()).T
        assert np.all(np.abs(out - _exact_on_rounded(x, w, prec)) <= 2e-6 * scale + 1e-30)
        x[0, 0] = np.inf
        dense.linear(x, w, None, out, n_threads=2, parts=parts)
        assert np.isinf(out[0]).any() or np.isnan(out[0]).any()
        if m > 1:
            assert np.isfinite(out[1:]).all()
    finally:
        dense.set_bf16dot_enabled(old)
        dense.set_amx_enabled(old_amx)
        dk.set_isa(None)


def test_denoise_block_precision_matches_linear_argmax():
    rng = np.random.default_rng(3)
    h = rng.standard_normal((16, 128)).astype(np.float32)
    lm = make_float(rng, (3000, 128), "bfloat16")
    for precision in PRECISIONS:
        expect = _exact_on_rounded(h, lm, precision).argmax(1)
        for b in dk.available_backends():
            assert np.array_equal(dk.denoise_block(h, lm, precision=precision, backend=b), expect), (precision, b)


def test_set_matmul_precision():
    x, w = _case(1, 4, 8, 64)
    old = dk.set_matmul_precision("medium")
    try:
        assert dk.get_matmul_precision() == "medium"
        assert np.array_equal(dk.linear(x, w), dk.linear(x, w, precision="medium"))
    finally:
        assert dk.set_matmul_precision(old) == "medium"
    assert dk.get_matmul_precision() == "highest"


@pytest.mark.parametrize("bad", ["low", "HIGHEST", 1, ""])
def test_bad_precision_named(bad):
    x, w = _case(1, 2, 3, 8)
    with pytest.raises(ValueError, match="precision must be one of highest, high, medium"):
        dk.linear(x, w, precision=bad)
    with pytest.raises(ValueError, match="set_matmul_precision\\(precision\\) must be one of"):
        dk.set_matmul_precision(bad)
