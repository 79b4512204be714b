"""dk.BoundOps against the public ops: the same bits on the fast path and on the fallback, the public
op's errors on bad input, and the fast path really taken on plain operands."""

import doctest

import numpy as np
import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import bound
from support import KERNEL_BACKENDS


def _rng(seed=0):
    return np.random.default_rng(seed)


def _f32(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def _cases(rng):
    """(method, args, kwargs, public op call) for each op BoundOps runs directly."""
    x, w, wb = _f32(rng, 5, 24), _f32(rng, 7, 24), _f32(rng, 7, 24).view(np.uint32) >> 16
    wb = wb.astype(np.uint16)
    norm, res = _f32(rng, 24), _f32(rng, 5, 24)
    q, k, v = _f32(rng, 3, 4, 8), _f32(rng, 9, 2, 8), _f32(rng, 9, 2, 8)
    pos = np.arange(6, 9, dtype=np.int64)
    drafts = np.array([[1, 2, 3], [1, 5, 3]], np.int64)
    targets = np.array([[1, 2, 4, 7], [1, 2, 3, 7]], np.int64)
    return [
        ("linear", (x, w), {}, lambda kw: dk.linear(x, w, **kw)),
        ("linear", (x, wb), {}, lambda kw: dk.linear(x, wb, **kw)),
        ("rms_norm", (x, norm, 1e-6), {"offset": 1.0}, lambda kw: dk.rms_norm(x, norm, 1e-6, offset=1.0, **kw)),
        ("rms_norm", (x, norm, 1e-6), {"residual": res},
         lambda kw: dk.rms_norm(x, norm, 1e-6, residual=res, **kw)),
        ("apply_rope", (q, pos, 1e4), {}, lambda kw: dk.apply_rope(q, pos, 1e4, **kw)),
        ("silu_and_mul", (x,), {}, lambda kw: dk.silu_and_mul(x, **kw)),
        ("cached_attention", (q, k, v), {"window": 4}, lambda kw: dk.cached_attention(q, k, v, window=4, **kw)),
        ("accept_greedy", (drafts, targets), {}, lambda kw: dk.accept_greedy(drafts, targets, **kw)),
    ]


def _same(a, b):
    if isinstance(a, tuple):
        assert all(_same(x, y) for x, y in zip(a, b, strict=True))
        return True
    assert np.array_equal(np.asarray(a), np.asarray(b)), (a, b)
    return True


@pytest.mark.parametrize("backend", ["auto", *KERNEL_BACKENDS])
def test_each_backend_gives_the_public_ops_bits(backend, monkeypatch):
    """"auto" takes the compiled fast path (the public op patched to fail must not be reached); a named
    backend goes to the public op with it. The public op's bits either way."""
    ops = dk.BoundOps(n_threads=2, backend=backend, precision="highest")
    kw = {"n_threads": 2, "backend": backend, "precision": "highest"}
    fast = backend == "auto" and dk.runtime.resolve_backend("auto", "dense") == "cython"
    for name, args, kwargs, public in _cases(_rng()):
        call_kw = {k: v for k, v in kw.items() if k != "precision" or name in ("linear", "cached_attention")}
        expect = public(call_kw)
        with monkeypatch.context() as m:
            if fast:
                m.setattr(bound, name, lambda *a, _n=name, **k: pytest.fail(f"{_n}: took the public path"))
            got = getattr(ops, name)(*args, **kwargs)
        _same(got, expect)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_torch_and_strided_operands_take_the_public_path(backend):
    ops = dk.BoundOps(n_threads=1, backend=backend)
    rng = _rng(1)
    x, w = _f32(rng, 4, 32)[:, ::2], _f32(rng, 6, 16)  # x not C-contiguous
    _same(ops.linear(x, w), dk.linear(np.ascontiguousarray(x), w, n_threads=1, backend=backend))
    t = ops.silu_and_mul(torch.from_numpy(_f32(rng, 3, 8)))
    assert isinstance(t, torch.Tensor) and t.shape == (3, 4)
    q = _f32(rng, 2, 2, 8)
    rot = ops.apply_rope(q, [3, 4], 1e4)  # a list of positions: the public op converts it
    _same(rot, dk.apply_rope(q, np.array([3, 4]), 1e4, n_threads=1, backend=backend))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_bad_operands_get_the_public_ops_errors(backend):
    ops = dk.BoundOps(n_threads=1, backend=backend)
    rng = _rng(2)
    with pytest.raises(ValueError, match=r"x and weight disagree on K: x has shape \(2, 5\) \(K=5\)"):
        ops.linear(_f32(rng, 2, 5), _f32(rng, 3, 6))
    with pytest.raises(ValueError, match=r"w must have shape \(8,\)"):
        ops.rms_norm(_f32(rng, 2, 8), _f32(rng, 7), 1e-6)
    with pytest.raises(ValueError, match=r"draft_tokens values must lie in >= 0, got min -1"):
        ops.accept_greedy(np.array([[-1, 2]], np.int64), np.array([[1, 2, 3]], np.int64))
    with pytest.raises(ValueError, match=r"q has T_q = 5 rows but k_cache only T_kv = 3"):
        ops.cached_attention(_f32(rng, 5, 2, 8), _f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8))


def test_in_place_rope_and_settings_fixed_at_construction(monkeypatch):
    ops = dk.BoundOps(n_threads=1, precision="medium")
    monkeypatch.setenv("DFLASH_NUM_THREADS", "2")
    dk.set_matmul_precision("highest")
    try:
        assert ops.precision == "medium" and ops.kw["n_threads"] == 1
    finally:
        dk.set_matmul_precision("highest")
    q = _f32(_rng(3), 2, 2, 8)
    expect = dk.apply_rope(q, np.array([0, 5]), 1e4)
    assert ops.apply_rope(q, np.array([0, 5], np.int64), 1e4, out=q) is q
    _same(q, expect)


def test_examples_run():
    tests = doctest.DocTestFinder(recurse=False).find(dk.BoundOps, "BoundOps", globs={"np": np, "dk": dk})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted and result.failed == 0


def test_every_kernel_method_is_listed_in_ops():
    """BoundOps.OPS is what callers wrap to time kernels (the model layer's Ops): a new method must join it."""
    methods = {n for n, v in vars(dk.BoundOps).items() if callable(v) and not n.startswith("_")}
    assert methods - {"prepare", "adapt_threads", "with_precision"} == set(dk.BoundOps.OPS)


class _Busy:
    """A contention governor that always answers one thread."""

    def update(self):
        return 1


def test_with_precision_shares_everything_but_the_precision():
    ops = dk.BoundOps(n_threads=2, precision="highest")
    ops.governor = _Busy()  # as default threads have, answering 1
    twin = ops.with_precision("medium")
    x, w = _f32(_rng(4), 3, 64), _f32(_rng(5), 8, 64)
    _same(twin.linear(x, w), dk.linear(x, w, precision="medium", n_threads=2))
    _same(ops.linear(x, w), dk.linear(x, w, precision="highest", n_threads=2))
    assert twin.adapt_threads() == 1
    assert ops.kw["n_threads"] == 1 and ops._n == 1  # what either decides holds for both
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.with_precision("fp8")
