"""The public ops' compiled fast path (pyx/fastpath.pyx) against their Python path.

Every call gives the same result with and without it: the same bits, or the same error with the same
message. Plain operands really take it (the Python dispatch is patched to fail), and the settings it
keeps follow every change: environment, set_isa, set_matmul_precision, a tuning table.
"""

import copy
import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash_kernels as dk
from dflash_kernels import _fastpath, acceptance, attention, denoise, dense, linear_attention
from dflash_kernels._env import settings_changed

MODULES = (acceptance, attention, dense, denoise, linear_attention)
pytestmark = pytest.mark.skipif(isinstance(_fastpath.FAST, _fastpath._NoFast),
                                reason="the compiled fast path is not built (no Cython build)")


def _f32(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def _bf16(rng, *shape):
    return (_f32(rng, *shape).view(np.uint32) >> 16).astype(np.uint16)


def _cases(rng):
    """(public op, args, kwargs): plain, valid calls of every op the fast path covers."""
    x, w, b = _f32(rng, 5, 24), _f32(rng, 7, 24), _f32(rng, 7)
    q, k, v = _f32(rng, 3, 4, 8), _f32(rng, 9, 2, 8), _f32(rng, 9, 2, 8)
    drafts = np.array([[1, 2, 3], [1, 5, 3]], np.int64)
    targets = np.array([[1, 2, 4, 7], [1, 2, 3, 7]], np.int64)
    return [
        (dk.linear, (x, w), {}),
        (dk.linear, (x, _bf16(rng, 7, 24), b), {"precision": "medium"}),
        (dk.linear, (x, dk.prepare_weight(_bf16(rng, 40, 24))), {}),
        (dk.rms_norm, (x, _f32(rng, 24), 1e-6), {"offset": 1.0}),
        (dk.rms_norm, (q, _f32(rng, 8)), {"residual": _f32(rng, 3, 4, 8)}),
        (dk.apply_rope, (q, np.array([4, 9, 2]), 1e6), {"rotary_dim": 4}),
        (dk.apply_rope, (q, np.array([4, 9, 2]), 10000), {"inv_freq": dk.rope_inv_freq(1e4, 8, {
            "rope_type": "linear", "factor": 2.0})}),
        (dk.silu_and_mul, (x,), {}),
        (dk.cached_attention, (q, k, v), {"window": 4}),
        (dk.cached_attention, (q, _bf16(rng, 9, 2, 8), _bf16(rng, 9, 2, 8)), {"causal": False, "scale": 0.3}),
        (dk.injected_kv_attention, (q, k, v, _f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8)), {"causal_block": True}),
        (dk.accept_greedy, (drafts, targets), {"vocab_size": 8}),
        # torch tensors, as engines pass them (the vLLM plugin: x and bias tensors, a PackedWeight)
        (dk.linear, (torch.from_numpy(x), dk.prepare_weight(_bf16(rng, 7, 24)), torch.from_numpy(b)), {}),
        (dk.linear, (torch.from_numpy(_bf16(rng, 5, 24).view(np.int16)).view(torch.bfloat16),
                     dk.prepare_weight(_bf16(rng, 7, 24))), {"precision": "medium"}),  # as vLLM's bf16 layers
        (dk.rms_norm, (_bf16(rng, 5, 24), _bf16(rng, 24)), {}),
        (dk.linear, (torch.from_numpy(x), torch.from_numpy(_bf16(rng, 7, 24).view(np.int16)).view(torch.bfloat16)),
         {}),
        (dk.rms_norm, (torch.from_numpy(x), _f32(rng, 24)), {"residual": torch.from_numpy(_f32(rng, 5, 24))}),
        (dk.silu_and_mul, (torch.from_numpy(x),), {}),
        (dk.cached_attention, (q, torch.from_numpy(k), v), {}),
        (dk.injected_kv_attention, (torch.from_numpy(q), k, v, _f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8)), {}),
        (dk.apply_rope, (torch.from_numpy(q), torch.tensor([4, 9, 2]), 1e6), {}),
        (dk.accept_greedy, (torch.from_numpy(drafts), targets), {}),
        (dk.denoise_block, (torch.from_numpy(x), w), {}),
        (dk.rejection_sample, (torch.from_numpy(drafts), _f32(rng, 2, 4, 8)), {"uniforms": rng.random((2, 4, 2))}),
        (dk.gated_delta_rule, (_f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8), _f32(rng, 3, 4, 6), -np.abs(_f32(rng, 3, 4)),
                               np.abs(_f32(rng, 3, 4)), torch.from_numpy(_f32(rng, 4, 8, 6))), {}),
        (dk.denoise_block, (x, w), {}),
        (dk.denoise_block, (x, _bf16(rng, 7, 24)), {"temperature": 0.8, "top_k": 3, "uniforms": rng.random(5)}),
        (dk.denoise_block, (x, w), {"temperature": 1, "top_p": 0.9, "generator": 7}),
        (dk.rejection_sample, (drafts, _f32(rng, 2, 4, 8)), {"uniforms": rng.random((2, 4, 2)), "top_p": 0.8}),
        (dk.rejection_sample, (drafts, _bf16(rng, 2, 4, 8)), {
            "draft_probs": rng.dirichlet(np.ones(8), (2, 3)).astype(np.float32), "uniforms": rng.random((2, 4, 2)),
            "temperature": 0.0}),
        (dk.gated_delta_rule, (_f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8), _f32(rng, 3, 4, 6), -np.abs(_f32(rng, 3, 4)),
                               np.abs(_f32(rng, 3, 4)), _f32(rng, 4, 8, 6)), {}),
        (dk.gated_delta_rule, (_f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8), _f32(rng, 3, 4, 6), -np.abs(_f32(rng, 3, 4)),
                               np.abs(_f32(rng, 3, 4)), _f32(rng, 4, 8, 6)),
         {"scale": 0.5, "chunk_size": 2, "use_qk_l2norm": False}),
    ]


def _copy(obj, memo=None):
    """A deep copy that keeps arrays' writeable flags and aliasing (out=x): each run gets its own."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, np.ndarray):
        new = obj.copy(order="K")
        new.flags.writeable = obj.flags.writeable
    elif isinstance(obj, (list, tuple)):
        new = type(obj)(_copy(o, memo) for o in obj)
    elif isinstance(obj, dict):
        new = {k: _copy(v, memo) for k, v in obj.items()}
    else:
        new = copy.deepcopy(obj)
    memo[id(obj)] = new
    return new


def _outcome(op, args, kwargs):
    try:
        result = op(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the outcome compared is the error itself
        return type(err), str(err)
    return result


def _python_path(op, args, kwargs, monkeypatch):
    with monkeypatch.context() as m:
        for mod in MODULES:
            m.setattr(mod, "FAST", _fastpath._NoFast())
        return _outcome(op, args, kwargs)


def _same(a, b):
    if isinstance(a, tuple) and isinstance(a[0], type):  # (error type, message)
        assert a == b
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert type(a) is type(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(_values(a), _values(b), equal_nan=True)


def _values(a):
    return a.detach().float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def test_plain_calls_take_the_fast_path_and_give_the_python_paths_bits(monkeypatch):
    for op, args, kwargs in _cases(np.random.default_rng(0)):
        expect = _python_path(op, *_copy((args, kwargs)), monkeypatch)  # a copy: state is updated in place
        with monkeypatch.context() as m:
            _fast_only(m)
            got = op(*args, **kwargs)
        _same(got, expect)


def test_the_python_path_still_runs_where_the_fast_path_declines(monkeypatch):
    """A strided x takes the Python path; it must be reached (here it fails on purpose)."""
    x, w = np.ones((2, 6), np.float32)[:, ::2], np.ones((4, 3), np.float32)
    with monkeypatch.context() as m:
        m.setattr(dense, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("python path")))
        with pytest.raises(RuntimeError, match="python path"):
            dk.linear(x, w)


def _mutations():
    """Ways to spoil one argument (each left as it is where it does not apply)."""
    def arrays(fn, kind=None):
        return lambda a: fn(a) if isinstance(a, np.ndarray) and (kind is None or a.dtype.kind in kind) else a

    return [
        arrays(lambda a: a.astype(np.float64)),
        arrays(lambda a: a.astype(np.int32)),
        arrays(lambda a: (a.view(np.uint32) >> 16).astype(np.uint16), "f"),  # float32 to bf16 bits
        arrays(np.asfortranarray),
        arrays(lambda a: a[..., ::2]),
        arrays(lambda a: a[:-1]),
        arrays(lambda a: a[:1]),
        arrays(lambda a: a[None]),
        arrays(lambda a: a.reshape(-1)),
        arrays(lambda a: a[:0]),
        arrays(lambda a: -a, "i"),
        arrays(lambda a: a + 100, "i"),
        arrays(lambda a: a + 1.0, "f"),
        arrays(lambda a: np.full_like(a, np.nan), "f"),
        arrays(lambda a: np.full_like(a, -np.inf), "f"),
        arrays(lambda a: torch.from_numpy(np.ascontiguousarray(a))),
        arrays(lambda a: torch.from_numpy(a.copy()).requires_grad_(), "f"),
        arrays(lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16), "u"),
        arrays(lambda a: torch.nn.Parameter(torch.from_numpy(a.copy()), requires_grad=False), "f"),
        # tensors the fast path reads through their data pointer, or must not: at an offset in their
        # storage, strided, with the negative bit, sparse, empty
        arrays(lambda a: torch.cat([torch.from_numpy(a.copy())] * 2)[len(a):] if a.ndim else a),
        arrays(lambda a: torch.from_numpy(np.ascontiguousarray(a))[..., ::2]),
        arrays(lambda a: torch._neg_view(torch.from_numpy(-a)), "f"),
        arrays(lambda a: torch.from_numpy(a.copy()).to_sparse(), "f"),
        arrays(lambda a: torch.from_numpy(np.ascontiguousarray(a))[:0]),
        arrays(lambda a: a.astype(a.dtype.newbyteorder())),
        arrays(lambda a: a.tolist()),
        arrays(lambda a: np.require(a, requirements="C").view(np.matrix) if a.ndim == 2 else a),
        arrays(lambda a: _read_only(a)),
        lambda a: None,
        lambda a: -1.0,
        lambda a: 1e-40,  # a temperature below MIN_TEMPERATURE: greedy (1 / T overflows float32)
        lambda a: float("nan"),
        lambda a: float("inf"),
        lambda a: 0,
        lambda a: 3,
        lambda a: True,
        lambda a: 2**70,
        lambda a: "medium",
        lambda a: "bogus",
    ]


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _spoiled_calls(op, args, kwargs):
    """The call with each argument (positional, or any keyword the op takes) spoiled each way."""
    params = list(inspect.signature(op).parameters)
    keywords = params[len(args):]  # every parameter not passed by position
    for mutate in _mutations():
        for i in range(len(args)):
            yield [*args[:i], mutate(args[i]), *args[i + 1:]], kwargs
        for key in keywords:
            default = kwargs.get(key, args[0] if key in ("out", "residual") else None)
            yield args, {**kwargs, key: mutate(default)}


def test_invalid_combinations_give_the_python_paths_error(monkeypatch):
    """Arguments valid alone, invalid together: each takes the Python path and its error."""
    rng = np.random.default_rng(3)
    q, k, v = _f32(rng, 3, 4, 8), _f32(rng, 9, 2, 8), _f32(rng, 9, 2, 8)
    state = _f32(rng, 4, 8, 6)
    state.flags.writeable = False
    calls = [
        (dk.cached_attention, (q, k[:2], v[:2]), {}),  # more queries than cache rows
        (dk.cached_attention, (q, k, v.astype(np.float16).view(np.uint16)), {}),  # K float32, V bf16
        (dk.injected_kv_attention, (q, k, v, k[:3, :1].copy(), v[:3, :1].copy()), {}),  # other kv heads
        (dk.gated_delta_rule, (_f32(rng, 3, 2, 8), _f32(rng, 3, 2, 8), _f32(rng, 3, 4, 6), _f32(rng, 3, 4),
                               _f32(rng, 3, 4), state), {}),  # read-only state
        (dk.linear, (_f32(rng, 2, 8), _f32(rng, 3, 8), _f32(rng, 4)), {}),  # bias of another N
        (dk.rms_norm, (q, _f32(rng, 8)), {"residual": _f32(rng, 3, 8, 4)}),  # residual of another shape
    ]
    for op, args, kwargs in calls:
        expect = _python_path(op, args, kwargs, monkeypatch)
        assert isinstance(expect, tuple) and isinstance(expect[0], type), (op.__name__, expect)
        _same(_outcome(op, args, kwargs), expect)


@pytest.mark.parametrize("case", range(len(_cases(np.random.default_rng(0)))))
def test_every_spoiled_call_gives_the_python_paths_result_or_error(case):
    """Each argument of a plain call spoiled in each way: the public op (fast path first) and its Python
    path give the same bits, or the same error and message. Each run on its own copy of the arguments
    (state is updated in place, out=x rotates x in place; deepcopy keeps that aliasing)."""
    op, args, kwargs = _cases(np.random.default_rng(case))[case]
    for spoiled_args, spoiled_kwargs in _spoiled_calls(op, list(args), dict(kwargs)):
        with pytest.MonkeyPatch.context() as mp:
            expect = _python_path(op, *_copy((spoiled_args, spoiled_kwargs)), mp)
        got = _outcome(op, *_copy((spoiled_args, spoiled_kwargs)))
        if op in (dk.denoise_block, dk.rejection_sample) and spoiled_kwargs.get("uniforms") is None \
                and spoiled_kwargs.get("generator") is None:  # fresh randomness: the same kind of outcome
            got, expect = _kind(got), _kind(expect)
        _same(got, expect)


def _kind(outcome):
    """An error as it is; a result as arrays of its shapes and dtypes, zero-filled."""
    if isinstance(outcome, tuple) and isinstance(outcome[0], type):
        return outcome
    if isinstance(outcome, tuple):
        return tuple(_kind(o) for o in outcome)
    return np.zeros(outcome.shape, np.asarray(outcome).dtype) if isinstance(outcome, np.ndarray) else outcome * 0


def _fast_only(monkeypatch):
    """The Python dispatch patched to fail: whatever runs took the fast path."""
    def no_dispatch(*a, **k):
        raise AssertionError("took the Python path")
    for mod in MODULES:
        monkeypatch.setattr(mod, "run", no_dispatch)


@settings(max_examples=100, deadline=None)
@given(t=st.integers(1, 6), h_kv=st.integers(1, 3), group=st.integers(1, 3), d=st.integers(1, 20),
       extra=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_random_plain_shapes_take_the_fast_path_with_the_python_paths_bits(t, h_kv, group, d, extra, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _f32(rng, t, h_kv * group, d), _f32(rng, t + extra, h_kv, d), _f32(rng, t + extra, h_kv, d)
    x, w = _f32(rng, t, d), _f32(rng, h_kv * group + extra, d)
    drafts = rng.integers(0, 4, (h_kv, t))
    for op, args, kwargs in [(dk.cached_attention, (q, k, v), {}), (dk.linear, (x, w), {}),
                             (dk.rms_norm, (q, _f32(rng, d)), {}), (dk.denoise_block, (x, w), {}),
                             (dk.injected_kv_attention, (q, k, v, k[:t].copy(), v[:t].copy()), {}),
                             (dk.silu_and_mul, (np.concatenate([x, x], 1),), {}),
                             (dk.apply_rope, (q, rng.integers(0, 99, t), 1e4), {"rotary_dim": 2 * (d // 2) or None}),
                             (dk.accept_greedy, (drafts, rng.integers(0, 4, (h_kv, t + 1))), {})]:
        if op is dk.apply_rope and d < 2:
            continue
        with pytest.MonkeyPatch.context() as mp:
            expect = _python_path(op, args, kwargs, mp)
        with pytest.MonkeyPatch.context() as mp:
            _fast_only(mp)
            _same(op(*args, **kwargs), expect)


def test_settings_are_followed(monkeypatch):
    rng = np.random.default_rng(1)
    x, w = _f32(rng, 4, 64), _f32(rng, 8, 64)
    highest = dk.linear(x, w)
    old = dk.set_matmul_precision("medium")
    try:
        medium = dk.linear(x, w)
        _same(medium, _python_path(dk.linear, (x, w), {}, monkeypatch))
        assert not np.array_equal(medium, highest)  # the change was seen
    finally:
        dk.set_matmul_precision(old)
    _same(dk.linear(x, w), highest)

    monkeypatch.setenv("DFLASH_NUM_THREADS", "zero")  # a bad value: the Python path's error
    with pytest.raises(ValueError, match="DFLASH_NUM_THREADS must be a positive int"):
        dk.silu_and_mul(x)
    monkeypatch.setenv("DFLASH_NUM_THREADS", "1")
    seen = []
    original = dense.run

    def spy(family, op, inputs, outs, **kw):
        seen.append(kw.get("backend"))
        return original(family, op, inputs, outs, **kw)

    monkeypatch.setattr(dense, "run", spy)
    dk.silu_and_mul(x)
    assert seen == []  # a good value again: the fast path
    monkeypatch.setenv("DFLASH_BACKEND", "numba")  # "auto" now runs Numba: the Python path
    dk.silu_and_mul(x)
    assert seen == ["auto"]
    monkeypatch.delenv("DFLASH_BACKEND")
    dk.set_isa("avx2")  # a cap: resolved again, and still the fast path
    try:
        dk.silu_and_mul(x)
    finally:
        dk.set_isa(None)
    assert seen == ["auto"]


def test_a_tuning_table_is_asked(monkeypatch):
    """Where a tuning table sends a shape to torch, the fast path leaves the call to the Python path."""
    rng = np.random.default_rng(2)
    x, w = _f32(rng, 4, 16), _f32(rng, 8, 16)
    asked, delegated = [], []
    monkeypatch.setattr(_fastpath, "has_table", lambda: True)
    monkeypatch.setattr(_fastpath, "delegates", lambda *a: asked.append(a) or True)
    monkeypatch.setattr(dense, "delegates", lambda *a: True)
    monkeypatch.setattr(dense, "torch_linear", lambda *a: delegated.append(a[0].shape))
    settings_changed()
    try:
        dk.linear(x, w, n_threads=1)
    finally:
        monkeypatch.undo()
        settings_changed()
    assert asked == [(4, 8, 16, False, 3, 1)] and delegated == [(4, 16)]
