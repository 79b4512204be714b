"""accept_greedy / rejection_sample / sample_filtered against the float64 torch reference (counts and tokens
exactly)."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels as dk
from dflash_kernels.reference import acceptance as ref
from support import KERNEL_BACKENDS, as_f64, as_torch, chi2_ok, make_float, readonly

SAMPLING = st.tuples(st.sampled_from([0.4, 1.0, 1.7]), st.sampled_from([0, 1, 3, 50, 10_000]),
                     st.sampled_from([1.0, 0.95, 0.5]))


def _check_invariants(num_accepted, out, num_draft):
    num_accepted, out = np.asarray(num_accepted), np.asarray(out)
    assert np.all(num_accepted >= 0) and np.all(num_accepted <= num_draft)
    for b, a in enumerate(num_accepted):
        assert np.all(out[b, : a + 1] >= 0), "accepted drafts + one target token are emitted"
        assert np.all(out[b, a + 1:] == -1), "padding after the emitted tokens"


def _drafts_and_targets(rng, b, k, v):
    drafts = rng.integers(0, v, (b, k))
    target = np.concatenate([drafts, rng.integers(0, v, (b, 1))], axis=1)
    miss = rng.random((b, k)) < 0.2  # a few mismatches at random positions
    target[:, :k][miss] = (target[:, :k][miss] + 1) % v
    return drafts, target


@given(b=st.integers(1, 9), k=st.integers(0, 17), seed=st.integers(0, 2**32 - 1))
def test_accept_greedy_matches_reference(backend, b, k, seed):
    rng = np.random.default_rng(seed)
    drafts, target = _drafts_and_targets(rng, b, k, 50)
    num_draft = rng.integers(0, k + 1, b)
    got = dk.accept_greedy(drafts, target, num_draft, backend=backend)
    want = ref.accept_greedy(torch.from_numpy(drafts), torch.from_numpy(target), torch.from_numpy(num_draft))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.int64
        np.testing.assert_array_equal(g, w.numpy())
    _check_invariants(*got, num_draft)


def test_accept_greedy_examples(backend):
    drafts = np.array([[4, 5, 6], [4, 5, 6], [4, 5, 6]])
    target = np.array([[4, 5, 6, 7], [4, 9, 6, 7], [1, 5, 6, 7]])
    n, out = dk.accept_greedy(drafts, target, backend=backend)
    np.testing.assert_array_equal(n, [3, 1, 0])
    np.testing.assert_array_equal(out, [[4, 5, 6, 7], [4, 9, -1, -1], [1, -1, -1, -1]])
    n, out = dk.accept_greedy(drafts, target, num_draft=2, backend=backend)  # third draft ignored
    np.testing.assert_array_equal(out[0], [4, 5, 6, -1])
    n1, out1 = dk.accept_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 0, 7]), backend=backend)
    assert isinstance(n1, torch.Tensor) and n1.shape == () and int(n1) == 2
    assert out1.tolist() == [4, 5, 0, -1]
    padded = np.array([[4, -1, -1]])  # drafts beyond num_draft may be padding
    _, out = dk.accept_greedy(padded, np.array([[4, 8, 0, 0]]), num_draft=[1], backend=backend)
    assert out.tolist() == [[4, 8, -1, -1]]


def test_accept_greedy_bad_input():
    d, t = np.zeros((2, 3), np.int64), np.zeros((2, 4), np.int64)
    with pytest.raises(ValueError, match="target_tokens"):
        dk.accept_greedy(d, t[:, :3])
    with pytest.raises(ValueError, match="num_draft"):
        dk.accept_greedy(d, t, num_draft=[1, 4])
    with pytest.raises(ValueError, match="num_draft"):
        dk.accept_greedy(d, t, num_draft=[-1, 1])
    with pytest.raises(ValueError, match="draft_tokens"):
        dk.accept_greedy(d - 1, t)
    with pytest.raises(ValueError, match="draft_tokens"):
        dk.accept_greedy(d + 9, t, vocab_size=9)
    with pytest.raises(TypeError, match="draft_tokens"):
        dk.accept_greedy(d.astype(np.float32), t)
    with pytest.raises(ValueError, match="draft_tokens"):
        dk.accept_greedy(np.zeros((1, 2, 3), np.int64), t)


def _case(rng, b, k, v, dtype, with_q, scale=2.0):
    logits = make_float(rng, (b, k + 1, v), dtype, scale=scale)
    lf = as_f64(logits)
    drafts = torch.argmax(lf[:, :k], -1).numpy()
    swap = rng.random((b, k)) < 0.3  # some drafts that are not the target's favourite
    drafts[swap] = rng.integers(0, v, int(swap.sum()))
    q = None
    if with_q:
        q = torch.softmax(torch.from_numpy(rng.standard_normal((b, k, v)) * 2), -1).float().numpy()
        q[rng.random((b, k, v)) < 0.2] = 0.0  # zero draft probabilities
    return logits, drafts, q


@given(b=st.integers(1, 4), k=st.integers(0, 6), v=st.integers(1, 1500), sampling=SAMPLING,
       dtype=st.sampled_from(["float32", "bfloat16"]), with_q=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rejection_sample_matches_reference(backend, b, k, v, sampling, dtype, with_q, seed):
    temperature, top_k, top_p = sampling
    rng = np.random.default_rng(seed)
    logits, drafts, q = _case(rng, b, k, v, dtype, with_q)
    num_draft = rng.integers(0, k + 1, b)
    u = rng.random((b, k + 1, 2))
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    got = dk.rejection_sample(drafts, logits, draft_probs=q, num_draft=num_draft, uniforms=u,
                              backend=backend, **kw)
    want = ref.rejection_sample(torch.from_numpy(drafts), as_f64(logits), None if q is None else as_f64(q),
                                torch.from_numpy(num_draft), uniforms=u, **kw)
    np.testing.assert_array_equal(got[0], want[0].numpy())
    np.testing.assert_array_equal(got[1], want[1].numpy())
    _check_invariants(*got, num_draft)


@given(b=st.integers(1, 5), k=st.integers(0, 8), v=st.integers(1, 300), with_q=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_temperature_zero_is_greedy_acceptance(backend, b, k, v, with_q, seed):
    rng = np.random.default_rng(seed)
    logits, drafts, q = _case(rng, b, k, v, "float32", with_q)
    got = dk.rejection_sample(drafts, logits, draft_probs=q, temperature=0.0, generator=seed, backend=backend)
    want = dk.accept_greedy(drafts, np.argmax(logits, -1), backend=backend)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_certain_target_accepts_every_draft(backend):
    v, k = 50, 6
    drafts = np.arange(3, 3 + k)[None]
    logits = np.full((1, k + 1, v), -np.inf, np.float32)
    logits[0, np.arange(k), drafts[0]] = 1.0  # one-hot target equal to the draft
    logits[0, k, 44] = 0.0
    for q in (None, np.full((1, k, v), 1.0 / v, np.float32)):
        n, out = dk.rejection_sample(drafts, logits, draft_probs=q, generator=0, backend=backend)
        assert n.tolist() == [k] and out.tolist() == [[*drafts[0], 44]]


def test_zero_probabilities(backend):
    v = 10
    logits = np.zeros((1, 2, v), np.float32)
    logits[0, 0, 3] = -np.inf  # the target never emits token 3
    q = np.full((1, 1, v), 0.1, np.float32)
    q[0, 0, 5] = 0.0
    for seed in range(20):
        n, out = dk.rejection_sample(np.array([[3]]), logits, generator=seed, backend=backend)
        assert n.tolist() == [0] and out[0, 0] != 3
        # q(x) = 0 with p(x) > 0: always accepted; the residual never holds the zero-probability token
        n, out = dk.rejection_sample(np.array([[5]]), logits, draft_probs=q, generator=seed, backend=backend)
        assert n.tolist() == [1]
        n, out = dk.rejection_sample(np.array([[3]]), logits, draft_probs=q, generator=seed, backend=backend)
        assert n.tolist() == [0] and out[0, 0] != 3


def test_cython_equals_numba_and_threads_do_not_matter():
    rng = np.random.default_rng(3)
    for with_q in (False, True):
        logits, drafts, q = _case(rng, 7, 5, 3001, "bfloat16", with_q, scale=3.0)
        for kw in (dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.8), dict(temperature=0.0)):
            want = dk.rejection_sample(drafts, logits, draft_probs=q, generator=4, backend="torch", **kw)
            for be in KERNEL_BACKENDS:
                for n in (1, 2, 3):
                    got = dk.rejection_sample(drafts, logits, draft_probs=q, generator=4, n_threads=n,
                                              backend=be, **kw)
                    np.testing.assert_array_equal(got[0], want[0])
                    np.testing.assert_array_equal(got[1], want[1])


def test_torch_readonly_unbatched_and_generators(backend):
    rng = np.random.default_rng(5)
    logits, drafts, _ = _case(rng, 1, 4, 100, "bfloat16", False)
    want = dk.rejection_sample(drafts, logits, generator=9, backend=backend)
    t = dk.rejection_sample(torch.from_numpy(drafts), as_torch(logits), generator=9, backend=backend)
    assert isinstance(t[1], torch.Tensor)
    np.testing.assert_array_equal(t[1].numpy(), want[1])
    ro = dk.rejection_sample(readonly(drafts), readonly(logits), generator=np.random.default_rng(9),
                             backend=backend)
    np.testing.assert_array_equal(ro[1], want[1])
    n1, out1 = dk.rejection_sample(drafts[0], logits[0], generator=9, backend=backend)
    assert np.shape(n1) == () and out1.tolist() == want[1][0].tolist()
    u = np.random.default_rng(9).random((1, 5, 2))
    got = dk.rejection_sample(drafts, logits, uniforms=u, backend=backend)
    np.testing.assert_array_equal(got[1], want[1])
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    np.testing.assert_array_equal(dk.rejection_sample(drafts, logits, generator=g1, backend=backend)[1],
                                  dk.rejection_sample(drafts, logits, generator=g2, backend=backend)[1])


def test_non_finite_logits(backend):
    logits = np.zeros((1, 3, 5), np.float32)
    drafts = np.array([[0, 0]])
    logits[0, 0, 0] = -np.inf  # draft 0 rejected at row 0 for sure
    logits[0, 2, 1] = np.nan  # never read: rows after the first rejection are skipped
    n, _ = dk.rejection_sample(drafts, logits, generator=0, backend=backend)
    assert n.tolist() == [0]
    logits[0, 0, 2] = np.nan
    with pytest.raises(ValueError, match="target_logits"):
        dk.rejection_sample(drafts, logits, generator=0, backend=backend)
    logits[0, 0, 2] = np.inf
    with pytest.raises(ValueError, match="target_logits"):
        dk.rejection_sample(drafts, logits, generator=0, backend=backend)
    logits[0, 0] = -np.inf
    with pytest.raises(ValueError, match="target_logits"):
        dk.rejection_sample(drafts, logits, generator=0, backend=backend)


def test_rejection_sample_bad_input():
    d, lg = np.zeros((2, 3), np.int64), np.zeros((2, 4, 10), np.float32)
    cases = [
        (dict(draft_tokens=d + 10), ValueError, "draft_tokens"),
        (dict(target_logits=lg[:, :3]), ValueError, "target_logits"),
        (dict(target_logits=lg.astype(np.float64)), TypeError, "target_logits"),
        (dict(draft_probs=np.zeros((2, 3, 9), np.float32)), ValueError, "draft_probs"),
        (dict(num_draft=[4, 0]), ValueError, "num_draft"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(top_k=-2), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(uniforms=np.zeros((2, 4))), ValueError, "uniforms"),
        (dict(uniforms=np.ones((2, 4, 2))), ValueError, "uniforms"),
        (dict(uniforms=np.zeros((2, 4, 2), np.int64)), TypeError, "uniforms"),
        (dict(generator=1.5), TypeError, "generator"),
    ]
    for kw, err, match in cases:
        args = dict(draft_tokens=d, target_logits=lg)
        args.update(kw)
        with pytest.raises(err, match=match):
            dk.rejection_sample(args.pop("draft_tokens"), args.pop("target_logits"), **args)
    with pytest.raises(ValueError, match="draft_probs"):
        q = np.full((2, 3, 10), 0.1, np.float32)
        q[0, 0, 0] = -1.0
        dk.rejection_sample(d, lg, draft_probs=q, generator=0)


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_emitted_tokens_follow_the_target_distribution(kernel_backend, with_q, sampling):
    """Lossless: at each position, tokens emitted after an accepted prefix are distributed as p_i."""
    temperature, top_k, top_p = sampling
    v, k, n = 8, 3, 600_000
    rng = np.random.default_rng(123)
    logits = (rng.standard_normal((k + 1, v)) * 2.0).astype(np.float32)
    p = torch.stack([ref.filtered_probs(torch.from_numpy(r).double(), temperature, top_k, top_p)
                     for r in logits]).numpy()  # (k+1, V)
    batch = np.broadcast_to(logits, (n, k + 1, v))
    if with_q:
        qd = torch.softmax(torch.from_numpy(rng.standard_normal((k, v))), -1).numpy()
        qd[:, 0] = 0.0  # a token the drafter never proposes
        qd /= qd.sum(-1, keepdims=True)
        drafts = np.stack([rng.choice(v, size=n, p=qd[i]) for i in range(k)], 1)
        q = np.broadcast_to(qd.astype(np.float32), (n, k, v))
    else:
        drafts = np.broadcast_to(np.argmax(logits[:k], -1), (n, k))  # an argmax drafter
        q = None
    num_acc, out = dk.rejection_sample(drafts, batch, draft_probs=q, temperature=temperature, top_k=top_k,
                                       top_p=top_p, generator=7, backend=kernel_backend)
    for i in range(k + 1):
        reached = num_acc >= i  # every earlier position emitted its draft
        counts = np.bincount(out[reached, i], minlength=v)
        assert counts.sum() > 5_000
        ok, stat, crit = chi2_ok(dict(enumerate(counts.tolist())), p[i])
        assert ok, f"position {i}: chi2 {stat:.1f} >= {crit:.1f} over {counts.sum()} samples"


def test_chi_square_check_catches_a_two_percent_bias():
    """The distribution check above must fail a sampler that is only slightly wrong: with 2% of the
    mass moved from one token to another, at the sample counts those tests reach."""
    rng = np.random.default_rng(0)
    p = torch.softmax(torch.from_numpy(rng.standard_normal(8) * 2.0), -1).numpy()
    biased = p.copy()
    shift = min(0.02, biased[0])
    biased[0] -= shift
    biased[1] += shift
    for n in (5_000, 50_000, 600_000):
        fair = np.bincount(rng.choice(8, size=n, p=p), minlength=8)
        assert chi2_ok(dict(enumerate(fair.tolist())), p)[0]
    for n in (50_000, 600_000):
        bad = np.bincount(rng.choice(8, size=n, p=biased), minlength=8)
        assert not chi2_ok(dict(enumerate(bad.tolist())), p)[0], f"a 2% bias passed at n={n}"


@pytest.mark.parametrize("temperature", [1e-300, 3e-39, 1e-7])
def test_tiny_temperature_is_greedy_on_every_backend(temperature):
    """1 / T overflowed float32: Cython emitted token 0, Numba raised SystemError, torch IndexError."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((2, 5, 50)) * 3).astype(np.float32)
    drafts = logits[:, :4].argmax(-1)
    drafts[1, 2] = (drafts[1, 2] + 1) % 50
    greedy = dk.rejection_sample(drafts, logits, temperature=0.0, generator=0)
    for b in dk.available_backends():
        got = dk.rejection_sample(drafts, logits, temperature=temperature, generator=0, backend=b)
        for g, e in zip(got, greedy, strict=True):
            assert np.array_equal(np.asarray(g), np.asarray(e)), b
        tok = dk.denoise_block(logits[0], np.eye(50, dtype=np.float32), temperature=temperature, generator=0,
                               backend=b)
        assert np.array_equal(np.asarray(tok), logits[0].argmax(-1)), b


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_all_minus_inf_row_raises_on_every_backend(temperature):
    """A verify row with no finite logit: Cython and Numba chose token 0 at temperature 0 where torch
    raised; every backend raises now, at every temperature."""
    logits = np.zeros((1, 3, 10), np.float32)
    logits[0, 0, :] = -np.inf
    for b in dk.available_backends():
        with pytest.raises(ValueError, match="has no finite logit"):
            dk.rejection_sample(np.array([[3, 4]]), logits, temperature=temperature, generator=0, backend=b)


@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0), (0.7, 5, 0.9), (0.5, 0, 0.5), (1.3, 3, 1.0), (0.0, 0, 1.0)])
def test_filtered_probs_is_the_rule_rejection_sample_applies(sampling):
    temperature, top_k, top_p = sampling
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((6, 40)) * 2).astype(np.float32)
    logits[2, :4] = logits[2, 4]  # ties at the thresholds
    logits[3, 10:] = -np.inf
    got = dk.filtered_probs(logits, temperature, top_k, top_p)
    for r in range(6):
        if temperature == 0:
            expect = np.eye(40)[np.argmax(logits[r])]
        else:
            expect = ref.filtered_probs(torch.from_numpy(logits[r]).double(), temperature, top_k, top_p).numpy()
        np.testing.assert_allclose(got[r], expect, rtol=1e-6, atol=1e-7)
    assert isinstance(dk.filtered_probs(torch.from_numpy(logits), 1.0), torch.Tensor)
    with pytest.raises(ValueError, match="no finite logit"):
        dk.filtered_probs(np.full((1, 4), -np.inf, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        dk.filtered_probs(np.array([[0.0, np.nan]], np.float32))


@given(t=st.integers(0, 6), v=st.integers(1, 1500), sampling=SAMPLING, dtype=st.sampled_from(["float32", "bfloat16"]),
       greedy=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_sample_filtered_matches_reference(backend, t, v, sampling, dtype, greedy, seed):
    temperature, top_k, top_p = (0.0, 0, 1.0) if greedy else sampling
    rng = np.random.default_rng(seed)
    logits = make_float(rng, (t, v), dtype, scale=2.0)
    logits_f = as_f64(logits)
    if t > 1:
        logits_f[1, : v // 2] = float("-inf")  # a row with tokens of probability 0
        logits = logits_f.float().numpy() if dtype == "float32" else dk.f32_to_bf16(logits_f.float().numpy())
    u = rng.random(t)
    tokens, probs = dk.sample_filtered(logits, temperature, top_k, top_p, uniforms=u, backend=backend)
    want_tokens, want_probs = ref.sample_filtered(logits_f, uniforms=u, temperature=temperature, top_k=top_k,
                                                  top_p=top_p)
    assert tokens.dtype == np.int64 and probs.dtype == np.float32 and probs.shape == (t, v)
    np.testing.assert_array_equal(tokens, want_tokens.numpy())
    np.testing.assert_allclose(probs, want_probs.numpy(), rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(probs, dk.filtered_probs(logits, temperature, top_k, top_p, backend=backend))
    if t:
        assert (probs[np.arange(t), tokens] > 0).all()


def test_sample_filtered_draws_from_its_probs(backend):
    """Tokens follow probs (a chi-square test over many uniforms), and a seed reproduces them."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((2, 12)) * 1.5).astype(np.float32)
    draws = [dk.sample_filtered(logits, 0.8, 0, 0.9, generator=rng, backend=backend)[0] for _ in range(3000)]
    _, probs = dk.sample_filtered(logits, 0.8, 0, 0.9, generator=0, backend=backend)
    for row in range(2):
        counts = np.bincount(np.array(draws)[:, row], minlength=12)
        ok, stat, crit = chi2_ok(dict(enumerate(counts.tolist())), probs[row].astype(np.float64))
        assert ok, f"row {row}: chi2 {stat:.1f} >= {crit:.1f}"
    first = dk.sample_filtered(logits, 0.8, generator=7, backend=backend)[0]
    np.testing.assert_array_equal(first, dk.sample_filtered(logits, 0.8, generator=7, backend=backend)[0])
    tokens, probs = dk.sample_filtered(torch.from_numpy(logits), 0.0, backend=backend)
    assert isinstance(tokens, torch.Tensor) and tokens.tolist() == np.argmax(logits, 1).tolist()
    assert probs.sum(1).tolist() == [1.0, 1.0]


def test_sample_filtered_bad_input():
    logits = np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError, match="uniforms"):
        dk.sample_filtered(logits, uniforms=np.zeros(2))
    with pytest.raises(ValueError, match="uniforms"):
        dk.sample_filtered(logits, uniforms=np.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        dk.sample_filtered(logits, -1.0)
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        dk.sample_filtered(np.zeros((3, 0), np.float32))
    with pytest.raises(TypeError, match="logits"):
        dk.sample_filtered(logits.astype(np.float64))
    with pytest.raises(TypeError, match="generator"):
        dk.sample_filtered(logits, generator="seed")
    bad = logits.copy()
    bad[2, 1] = np.nan
    for b in dk.available_backends():
        with pytest.raises(ValueError, match="logits row 2 contains NaN"):
            dk.sample_filtered(bad, generator=0, backend=b)
        bad[2, 1] = np.inf  # +inf is a valid maximum only when greedy
        with pytest.raises(ValueError, match="logits row 2 contains"):
            dk.sample_filtered(bad, 0.5, generator=0, backend=b)
        assert dk.sample_filtered(bad, 0.0, backend=b)[0].tolist() == [0, 0, 1]
        bad[2, 1] = np.nan


@pytest.mark.parametrize("size", [0, 1, 5, 32, 33, 200])
def test_small_array_checks_agree_with_numpy(size):
    """The range checks behind the ids, uniforms and status codes take a Python path up to
    _tensors.SMALL elements and numpy's above: both give numpy's answer, NaN and infinities included."""
    from dflash_kernels._tensors import first_nonzero, in_unit_interval, int_bounds

    rng = np.random.default_rng(size)
    ints = rng.integers(-5, 50, size)
    if size:
        assert int_bounds(ints) == (ints.min(), ints.max())
    status = np.zeros(size, np.int64)
    assert first_nonzero(status) == -1
    if size:
        status[size // 2 :] = 2
        assert first_nonzero(status) == size // 2
    for bad in (None, np.nan, np.inf, -np.inf, 1.0, -1e-300):
        u = rng.random(size)
        if bad is not None and size:
            u[rng.integers(size)] = bad
        assert in_unit_interval(u) == bool(np.all(u >= 0.0) and np.all(u < 1.0)), (size, bad)
