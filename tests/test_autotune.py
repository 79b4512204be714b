"""Never slower than torch: the per-machine table of linear shapes delegated to torch."""

import json

import numpy as np
import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import _autotune

pytestmark = pytest.mark.skipif("cython" not in dk.available_backends(), reason="delegation is from Cython")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    _autotune.table_written()
    yield tmp_path / "kernel_autotune.json"
    _autotune.table_written()


def _force(cache, entries, n_threads=2):
    cache.write_text(json.dumps({_autotune.machine_key(n_threads): {"torch": entries, "measured": {}}}))
    _autotune.table_written()


def test_tune_writes_the_table_and_config_lists_it(cache, capsys):
    rows = dk.tune_linear([(64, 32)], m_values=(1, 16), precision="medium", n_threads=2, rounds=3)
    assert {r["entry"] for r in rows} == {"M1 N64 K32 bf16 p1", "M1 N64 K32 fp32 p1", "M16 N64 K32 bf16 p1",
                                          "M16 N64 K32 fp32 p1"}
    data = json.loads(cache.read_text())
    rec = data[_autotune.machine_key(2)]
    assert set(rec["measured"]) == {r["entry"] for r in rows}
    assert set(rec["torch"]) == {r["entry"] for r in rows if r["torch_wins"]}
    _force(cache, ["M16 N64 K32 fp32 p1"], dk._threads.default_threads())
    dk.show_config()
    assert "M16 N64 K32 fp32 p1" in capsys.readouterr().out


@pytest.mark.parametrize("precision,bf16", [("highest", False), ("medium", False), ("medium", True)])
def test_delegated_shape_runs_torch_at_the_same_precision(cache, precision, bf16):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 64)).astype(np.float32)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    if bf16:
        w = (w.view(np.uint32) >> 16).astype(np.uint16)
    parts = {"highest": 3, "medium": 1}[precision]
    _force(cache, [f"M16 N40 K64 {'bf16' if bf16 else 'fp32'} p{parts}"])
    assert _autotune.delegates(12, 40, 64, bf16, parts, 2)
    got = dk.linear(x, w, precision=precision, n_threads=2)
    expect = np.empty_like(got)
    _autotune.torch_linear(x, w, None, parts, expect, 2)
    assert np.array_equal(got, expect)
    ours = dk.linear(x, w, precision=precision, n_threads=2, backend="cython")  # explicit: never delegated
    if bf16:  # torch's bf16 GEMM rounds its output to bf16: equal only to that rounding
        assert not np.array_equal(got, ours)
        assert np.allclose(got, ours, rtol=2 ** -8, atol=1e-3)
    else:
        assert np.allclose(got, ours, rtol=1e-5, atol=1e-5)


def test_bf16_weights_above_medium_never_delegate(cache):
    _force(cache, ["M16 N40 K64 bf16 p3", "M16 N40 K64 bf16 p2"])
    assert not _autotune.delegates(16, 40, 64, True, 3, 2)
    assert not _autotune.delegates(16, 40, 64, True, 2, 2)


def test_other_machines_entries_do_not_apply(cache):
    cache.write_text(json.dumps({"another cpu | tier avx2 | 2 threads": {"torch": ["M16 N40 K64 fp32 p3"]}}))
    _autotune.table_written()
    assert not _autotune.delegates(16, 40, 64, False, 3, 2)


def test_model_layer_delegates_tuned_shapes(cache, tmp_path):
    from dflash_kernels.model._ops import Ops

    ops = Ops(n_threads=2)
    x = torch.randn(16, 64).numpy()
    w = torch.randn(40, 64).numpy()
    ref = ops.linear(x, w)
    assert ops.linear_shapes == {(40, 64)}
    _force(cache, ["M16 N40 K64 fp32 p3"])
    got = ops.linear(x, w)
    expect = np.empty_like(got)
    _autotune.torch_linear(x, w, None, 3, expect, 2)
    assert np.array_equal(got, expect) and np.allclose(got, ref, rtol=1e-5, atol=1e-5)
