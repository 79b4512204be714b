"""pytest fixtures; the helpers themselves live in support.py (and checkpoints.py for the model tests)."""

import pytest

import dflash_kernels as dk
from checkpoints import ckpt_dir  # noqa: F401  (fixture, shared by the tests/test_model_*.py files)
from support import ALL_BACKENDS, KERNEL_CASES


@pytest.fixture(params=ALL_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=KERNEL_CASES)
def kernel_backend(request):
    """A compiled backend: Cython at each ISA tier of this machine (capped with set_isa), or Numba."""
    name, _, tier = request.param.partition("/")
    if not tier:
        yield name
        return
    dk.set_isa(tier)
    try:
        assert dk.kernel_module("dense", "cython").TIER == tier  # the cap really selects the tier
        yield name
    finally:
        dk.set_isa(None)
