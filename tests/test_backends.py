"""The backend registry, thread control and the Cython build itself."""

import os
import subprocess
import sys

import pytest

import dflash_kernels as dk
from dflash_kernels._backends import backend_error


def test_cython_built_unless_disabled():
    # A silent fallback to Numba would hide a broken build: fail unless the build was switched off.
    if os.environ.get("DFLASH_NO_CYTHON") == "1":
        pytest.skip("DFLASH_NO_CYTHON=1: the Cython build was switched off on purpose")
    for family in ("attention", "dense", "denoise", "acceptance", "linear_attention"):
        error = backend_error("cython", family)
        assert error is None, f"Cython {family} failed to load: {error}"


def test_available_backends_order():
    assert dk.available_backends()[-1] == "torch"
    assert set(dk.available_backends()) <= {"cython", "numba", "torch"}


def test_unknown_backend_named_in_error():
    import numpy as np

    with pytest.raises(ValueError, match="backend"):
        dk.silu_and_mul(np.zeros((1, 4), np.float32), backend="cuda")


@pytest.mark.parametrize("n_threads", [0, -1, 1.5, "2"])
def test_bad_n_threads(n_threads):
    import numpy as np

    with pytest.raises(ValueError, match="n_threads"):
        dk.silu_and_mul(np.zeros((1, 4), np.float32), n_threads=n_threads)


def test_show_config(capsys):
    dk.show_config()
    out = capsys.readouterr().out
    assert "backend cython" in out and "ISA tier: machine" in out and "torch" in out
    assert "public ops' checks: " in out
    if "cython" in dk.available_backends():  # the decode path and the drafter's precision, as they run here
        assert "decode steps (<= 4 query rows per kv head)" in out
        want = "medium: a bf16 dot product" if dk.bf16_dot_pays() else "the target's: no bf16 dot product"
        assert f'drafter precision (model.load\'s draft_precision="auto"): {want}' in out


def test_show_config_names_the_fast_path(capsys, monkeypatch):
    from dflash_kernels import _fastpath

    dk.show_config()
    built = not isinstance(_fastpath.FAST, _fastpath._NoFast)
    assert ("compiled fast path (pyx/fastpath.pyx)" in capsys.readouterr().out) == built
    monkeypatch.setattr(_fastpath, "FAST", _fastpath._NoFast())
    dk.show_config()
    assert "Python only (no compiled fast path" in capsys.readouterr().out


def test_env_backend_preference():
    code = ("import numpy as np, dflash_kernels as dk; from dflash_kernels._backends import resolve; "
            "print(resolve('auto','dense')[0])")
    env = dict(os.environ, DFLASH_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"


@pytest.mark.parametrize("backend", dk.available_backends())
def test_too_many_threads_is_an_error_not_a_crash(backend):
    """10**6 threads crashed the process ("libgomp: Thread creation failed", a segfault with torch)."""
    import numpy as np

    from dflash_kernels._threads import max_threads

    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match=f"n_threads must be at most {max_threads()}"):
        dk.rms_norm(x, np.ones(8, np.float32), n_threads=10**6, backend=backend)
    assert dk.rms_norm(x, np.ones(8, np.float32), n_threads=np.int64(2), backend=backend).shape == (2, 8)


@pytest.mark.parametrize("value", ["1000000", "two", "0"])
def test_bad_env_threads_named(value):
    code = "import numpy as np, dflash_kernels as dk; dk.silu_and_mul(np.zeros((1, 4), np.float32))"
    env = dict(os.environ, DFLASH_NUM_THREADS=value)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "DFLASH_NUM_THREADS must" in res.stderr and "Segmentation" not in res.stderr


def test_env_settings_take_effect_at_run_time(monkeypatch):
    """DFLASH_BACKEND, DFLASH_NUM_THREADS and DFLASH_ISA are read on every call (through a cache of
    the raw value, _env.py): a change made in the process takes effect at the next call, and a bad
    value is an error at every call while it stays."""
    import numpy as np

    from dflash_kernels import _isa
    from dflash_kernels._backends import resolve
    from dflash_kernels._threads import default_threads

    x = np.zeros((1, 4), np.float32)
    monkeypatch.setenv("DFLASH_BACKEND", "torch")
    assert resolve("auto", "dense")[0] == "torch"
    monkeypatch.delenv("DFLASH_BACKEND")
    assert resolve("auto", "dense")[0] == dk.available_backends()[0]
    monkeypatch.setenv("DFLASH_NUM_THREADS", "1")
    assert default_threads() == 1
    for _ in range(2):
        monkeypatch.setenv("DFLASH_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="DFLASH_NUM_THREADS must be a positive int, got 'two'"):
            dk.silu_and_mul(x)
    monkeypatch.delenv("DFLASH_NUM_THREADS")
    assert default_threads() >= 1
    for _ in range(2):
        monkeypatch.setenv("DFLASH_ISA", "avx1024")
        with pytest.raises(ValueError, match="DFLASH_ISA must be one of"):
            dk.silu_and_mul(x)
    monkeypatch.setenv("DFLASH_ISA", "avx2")
    assert _isa.current_cap() == "avx2"
    monkeypatch.delenv("DFLASH_ISA")
    assert _isa.current_cap() is None
    assert dk.silu_and_mul(x).shape == (1, 2)
