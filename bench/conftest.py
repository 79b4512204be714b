"""pytest fixtures for the benchmarks; helpers live in benchsupport.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from benchsupport import CONTENDERS  # noqa: E402


@pytest.fixture(params=CONTENDERS)
def contender(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    """Smoke run (benchmarks disabled): deselect the cases marked timed_only (large shapes)."""
    timing = (config.getoption("benchmark_enable", default=False)
              or not config.getoption("benchmark_disable", default=False))
    if timing:
        return
    keep = [i for i in items if i.get_closest_marker("timed_only") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("timed_only")])
        items[:] = keep
