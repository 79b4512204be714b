"""pytest fixtures; the helpers themselves live in support.py."""

import pytest

from support import ALL_BACKENDS, KERNEL_BACKENDS


@pytest.fixture(params=ALL_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request):
    return request.param
