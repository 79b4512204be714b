"""denoise_block / make_draft_block against the float64 torch reference (token ids exactly)."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels as dk
from dflash_kernels.reference import denoise as ref
from support import KERNEL_BACKENDS, as_f64, as_torch, make_float, readonly

SAMPLING = st.tuples(st.sampled_from([0.3, 1.0, 2.5]), st.sampled_from([0, 1, 7, 10_000]),
                     st.sampled_from([1.0, 0.9, 0.35]))


def _ref_tokens(h, w, **kw):
    return ref.denoise_block(as_f64(h), as_f64(w), **kw).numpy()


@given(t=st.integers(1, 19), h=st.integers(1, 300), v=st.integers(1, 2600),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_greedy_matches_reference(backend, t, h, v, dtype, seed):
    rng = np.random.default_rng(seed)
    x, w = make_float(rng, (t, h), "float32"), make_float(rng, (v, h), dtype)
    got = dk.denoise_block(x, w, backend=backend)
    assert got.dtype == np.int64 and got.shape == (t,)
    np.testing.assert_array_equal(got, _ref_tokens(x, w))


@given(t=st.integers(1, 9), h=st.integers(1, 40), v=st.integers(1, 2100), sampling=SAMPLING,
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_sampling_matches_reference(backend, t, h, v, sampling, dtype, seed):
    temperature, top_k, top_p = sampling
    rng = np.random.default_rng(seed)
    x, w = make_float(rng, (t, h), "float32", scale=0.7), make_float(rng, (v, h), dtype)
    u = rng.random(t)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    got = dk.denoise_block(x, w, uniforms=u, backend=backend, **kw)
    np.testing.assert_array_equal(got, _ref_tokens(x, w, uniforms=u, **kw))


@given(t=st.integers(1, 9), h=st.sampled_from([1, 12, 141]), v=st.integers(2, 3000),
       seed=st.integers(0, 2**32 - 1))
def test_ties_pick_the_first_index(kernel_backend, t, h, v, seed):
    # small integers: every logit is exact in float32, so ties are real ties
    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, (t, h)).astype(np.float32)
    w = rng.integers(-1, 2, (v, h)).astype(np.float32)
    w[rng.integers(0, v, v // 3)] = w[rng.integers(0, v)]  # duplicated rows across tiles and chunks
    got = dk.denoise_block(x, w, backend=kernel_backend)
    logits = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cython_equals_numba_and_threads_do_not_matter(temperature):
    rng = np.random.default_rng(7)
    x, w = make_float(rng, (16, 96), "float32"), make_float(rng, (5003, 96), "bfloat16")
    kw = dict(temperature=temperature, top_k=40, top_p=0.9, generator=11)
    want = dk.denoise_block(x, w, backend="torch", **kw)
    for b in KERNEL_BACKENDS:
        for n in (1, 2, 3):
            np.testing.assert_array_equal(dk.denoise_block(x, w, n_threads=n, backend=b, **kw), want)


def test_torch_bf16_readonly_and_strided_inputs(backend):
    rng = np.random.default_rng(1)
    x, w = make_float(rng, (5, 64), "float32"), make_float(rng, (777, 64), "bfloat16")
    want = dk.denoise_block(x, w, backend=backend)
    t = dk.denoise_block(torch.from_numpy(x), as_torch(w), backend=backend)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64
    np.testing.assert_array_equal(t.numpy(), want)
    np.testing.assert_array_equal(dk.denoise_block(readonly(x), readonly(w), backend=backend), want)
    wide = np.zeros((5, 128), np.float32)
    wide[:, ::2] = x
    np.testing.assert_array_equal(dk.denoise_block(wide[:, ::2], w, backend=backend), want)


def test_generators_are_reproducible():
    rng = np.random.default_rng(2)
    x, w = make_float(rng, (8, 32), "float32"), make_float(rng, (300, 32), "float32")
    kw = dict(temperature=1.0)
    a = dk.denoise_block(x, w, generator=5, **kw)
    u = np.random.default_rng(5).random(8)
    np.testing.assert_array_equal(a, dk.denoise_block(x, w, uniforms=u, **kw))
    np.testing.assert_array_equal(a, dk.denoise_block(x, w, generator=np.random.default_rng(5), **kw))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    np.testing.assert_array_equal(dk.denoise_block(x, w, generator=g1, **kw),
                                  dk.denoise_block(x, w, generator=g2, **kw))


@pytest.mark.parametrize("kernel", KERNEL_BACKENDS)
def test_sampling_workers_keep_their_own_totals(kernel):
    # Two workers sample their halves of the rows at once. Each row's draw must use that row's own
    # total: with one total shared by the workers, rows drew against the other worker's total now
    # and then (irreproducible samples). Many rows of very different temperatures-scaled mass, the
    # same uniforms, repeated: every run equals the one-thread result.
    rng = np.random.default_rng(11)
    x = make_float(rng, (64, 64), "float32") * rng.uniform(0.1, 8.0, (64, 1)).astype(np.float32)
    w = make_float(rng, (6000, 64), "float32")
    u = rng.random(64)
    want = dk.denoise_block(x, w, uniforms=u, temperature=0.9, n_threads=1, backend=kernel)
    for _ in range(30):
        np.testing.assert_array_equal(dk.denoise_block(x, w, uniforms=u, temperature=0.9, n_threads=2,
                                                       backend=kernel), want)


def test_non_finite_inputs_raise(backend):
    x, w = np.ones((2, 8), np.float32), np.ones((20, 8), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(ValueError, match="hidden"):
        dk.denoise_block(x, w, backend=backend)
    x[1, 3] = 0
    w[7, 2] = np.nan
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="row"):
            dk.denoise_block(x, w, temperature=temperature, generator=0, backend=backend)


def test_denoise_bad_input():
    x, w = np.zeros((2, 8), np.float32), np.zeros((20, 8), np.float32)
    with pytest.raises(ValueError, match="lm_head"):
        dk.denoise_block(x, np.zeros((20, 9), np.float32))
    with pytest.raises(ValueError, match="lm_head"):
        dk.denoise_block(x, np.zeros((0, 8), np.float32))
    with pytest.raises(ValueError, match="hidden"):
        dk.denoise_block(np.zeros(8, np.float32), w)
    with pytest.raises(TypeError, match="lm_head"):
        dk.denoise_block(x, w.astype(np.float64))
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dk.denoise_block(x, w, **bad)
    with pytest.raises(ValueError, match="uniforms"):
        dk.denoise_block(x, w, temperature=1.0, uniforms=np.zeros(3))
    with pytest.raises(ValueError, match="uniforms"):
        dk.denoise_block(x, w, temperature=1.0, uniforms=np.ones(2))
    with pytest.raises(TypeError, match="generator"):
        dk.denoise_block(x, w, temperature=1.0, generator="seed")


def test_make_draft_block():
    got = dk.make_draft_block(np.array([5, 9]), 151669, 4)
    np.testing.assert_array_equal(got, [[5, 151669, 151669, 151669], [9, 151669, 151669, 151669]])
    np.testing.assert_array_equal(got, ref.make_draft_block(torch.tensor([5, 9]), 151669, 4).numpy())
    assert dk.make_draft_block(3, 7, 1).tolist() == [3]
    assert dk.make_draft_block(np.int64(3), 7, 3).tolist() == [3, 7, 7]
    t = dk.make_draft_block(torch.tensor([1, 2, 3]), 0, 16)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 16) and t.dtype == torch.int64
    for args, match in (((1, 7, 0), "block_size"), ((-1, 7, 4), "anchor_ids"), ((1, -7, 4), "mask_token_id"),
                        ((np.zeros((2, 2), int), 7, 4), "anchor_ids"), ((1.5, 7, 4), "anchor_ids")):
        with pytest.raises((ValueError, TypeError), match=match):
            dk.make_draft_block(*args)
    with pytest.raises(ValueError, match="anchor_ids"):
        dk.make_draft_block(10, 3, 4, vocab_size=10)
