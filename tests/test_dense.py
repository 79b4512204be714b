"""Dense ops against the float64 torch reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels as dk
from dflash_kernels.reference import dense as ref

from support import TOLERANCE, as_f64, as_torch, assert_close, make_float, readonly


@given(m=st.integers(1, 33), i=st.integers(1, 300), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**32 - 1))
def test_silu_and_mul_matches_reference(backend, m, i, dtype, seed):
    x = make_float(np.random.default_rng(seed), (m, 2 * i), dtype, scale=3.0)
    got = dk.silu_and_mul(x, backend=backend)
    assert got.dtype == np.float32 and got.shape == (m, i)
    assert_close(got, ref.silu_and_mul(as_f64(x)), **TOLERANCE[dtype], what="silu_and_mul")


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
