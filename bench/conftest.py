"""pytest fixtures for the benchmarks; helpers live in benchsupport.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from benchsupport import CONTENDERS  # noqa: E402


@pytest.fixture(params=CONTENDERS)
def contender(request):
    return request.param
