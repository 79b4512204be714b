"""pytest fixtures; the helpers themselves live in support.py (and checkpoints.py for the model tests)."""

import atexit
import os
import shutil
import tempfile

import pytest

import dflash_kernels as dk

# The tests never read this user's tuning results (`dflash tune`'s k, `tune-kernels`' delegations):
# they would change the k that generate drafts by default, or send matmuls to torch. A fresh
# DFLASH_CACHE_DIR for the session (fetched model files live under DFLASH_CACHE, untouched).
os.environ["DFLASH_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH_CACHE_DIR"], True)
from checkpoints import ckpt_dir  # noqa: E402, F401  (fixture, shared by the tests/test_model_*.py files)
from support import ALL_BACKENDS, KERNEL_CASES  # noqa: E402


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
