"""The speculative decoding engine: lossless greedy and sampling, stops, limits, metrics.

Tiny random checkpoints (tests/checkpoints.py). The "hot" target has one lm_head row aligned with a
direction shared by every embedding, so the random drafter's drafts are accepted in a fair share of
rounds (tau ~ 1.5-2.5): both the accept and the reject paths run in every test.
Kernels run with n_threads=1 (tiny shapes; no thread launch cost in the tests).
"""


import numpy as np
import pytest

import dflash_kernels as dk
import dflash_kernels.model as dm
from checkpoints import special_id, write_dflash
from support import MACHINE_TIERS, chi2_ok

N_PROMPTS = 20
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hot(ckpt_dir, tmp_path_factory):
    t = ckpt_dir("hot", tie=False, hot_tokens=1, hot_scale=40.0, shards=2)
    d = write_dflash(tmp_path_factory.mktemp("hotd"), t, layers=2, block_size=16, target_layer_ids=(0, 2))
    return dm.load(t, d, max_len=128, n_threads=1)


@pytest.fixture(scope="module")
def warm(ckpt_dir, tmp_path_factory):
    """Less peaked than `hot`: at T=0.7 the first tokens spread over several ids."""
    t = ckpt_dir("warm", tie=False, hot_tokens=1, hot_scale=32.0)
    d = write_dflash(tmp_path_factory.mktemp("warmd"), t, layers=2, block_size=16, target_layer_ids=(0, 2))
    return dm.load(t, d, max_len=128, n_threads=1)


@pytest.fixture(scope="module")
def plain(ckpt_dir, tmp_path_factory):
    t = ckpt_dir("plain", tie=True, style="v5")
    d = write_dflash(tmp_path_factory.mktemp("pd"), t, layers=3, block_size=8, target_layer_ids=None,
                     sliding=True, window=5)
    return dm.load(t, d, max_len=128, n_threads=1)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 320, int(rng.integers(1, 13))).tolist() for _ in range(n)]


def test_greedy_lossless_every_k(hot):
    """DFlash greedy == AR greedy, token for token, 20 prompts x k = 1..15 (~300 runs, ~10 s)."""
    hist = {}
    for p in prompts(N_PROMPTS):
        ref = hot.generate(p, NEW_TOKENS, num_speculative_tokens=0, ignore_eos=True)
        assert len(ref.token_ids) == NEW_TOKENS and ref.metrics.rounds == NEW_TOKENS - 1
        for k in range(1, 16):
            res = hot.generate(p, NEW_TOKENS, num_speculative_tokens=k, ignore_eos=True)
            assert res.token_ids == ref.token_ids, f"prompt {p} k={k}"
            for n, c in res.metrics.tau_histogram.items():
                hist[n] = hist.get(n, 0) + c
    # the test is only meaningful if drafts were both rejected and accepted, in runs of several
    assert hist.get(1, 0) > 0 and sum(c for n, c in hist.items() if n >= 3) > 0, hist


def test_greedy_lossless_auto_k(hot):
    """num_speculative_tokens="auto": k chosen every round (autoregressive steps included, whose taps
    reach the drafter's context in a batch before the next draft); output == AR greedy."""
    ks = {}
    for p in prompts(N_PROMPTS, seed=3):
        ref = hot.generate(p, NEW_TOKENS, num_speculative_tokens=0, ignore_eos=True).token_ids
        res = hot.generate(p, NEW_TOKENS, num_speculative_tokens="auto", ignore_eos=True)
        assert res.token_ids == ref, f"prompt {p}"
        for k, c in res.metrics.k_histogram.items():
            ks[k] = ks.get(k, 0) + c
    assert max(ks) == hot.default_num_speculative_tokens and len(ks) >= 2, ks  # k really varied
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0 or 'auto'"):
        hot.generate([1, 2], 4, num_speculative_tokens="fast")


def test_auto_builds_the_drafters_context_only_when_it_drafts(hot):
    """With "auto" the prompt's and the autoregressive steps' taps reach the drafter's context only
    when a round drafts (one GEMM then); a request that never drafts never pays for them, and the
    deferred rows are bounded by the prefill chunk."""
    eng = hot.clone()
    added = []
    original = eng.drafter.add_context
    eng.drafter.add_context = lambda taps, ctx: (added.append(taps.shape[0]), original(taps, ctx))
    cost = eng.round_cost  # a machine where drafting never pays: only AR steps, no probe before
    for _ in range(3):     # PROBE_EVERY of them
        cost.observe(0, 1e-6)
    for _ in range(2):
        cost.observe(eng.default_num_speculative_tokens, 1.0)
    cost.last_k = 0
    p, n = prompts(1, seed=11)[0], dm.adaptive.PROBE_EVERY
    ref = hot.generate(p, n, num_speculative_tokens=0, ignore_eos=True).token_ids
    res = eng.generate(p, n, num_speculative_tokens="auto", ignore_eos=True)
    assert res.token_ids == ref and res.metrics.k_histogram == {0: n - 1} and added == []
    cost.last_k = 3  # the next request starts with a drafting round: all the prompt's rows, at once
    ref = hot.generate(p, NEW_TOKENS, num_speculative_tokens=0, ignore_eos=True).token_ids
    res = eng.generate(p, NEW_TOKENS, num_speculative_tokens="auto", ignore_eos=True)
    assert res.token_ids == ref and added[0] == len(p)
    added.clear()
    eng.target.prefill_chunk = 4  # a prompt longer than a chunk: deferred rows go in every 4
    long_prompt = prompts(1, seed=12)[0] * 3
    cost.last_k = 0
    ref = hot.generate(long_prompt, 8, num_speculative_tokens=0, ignore_eos=True).token_ids
    res = eng.generate(long_prompt, 8, num_speculative_tokens="auto", ignore_eos=True)
    assert res.token_ids == ref and added and max(added) <= 4 and sum(added) >= len(long_prompt) - 3


def test_greedy_lossless_sliding_drafter_default_taps(plain):
    for p in prompts(6, seed=1):
        ref = plain.generate(p, 20, num_speculative_tokens=0, ignore_eos=True)
        for k in (1, 4, 7):
            assert plain.generate(p, 20, num_speculative_tokens=k, ignore_eos=True).token_ids == ref.token_ids


def test_default_k_and_text_prompt(plain):
    assert plain.default_num_speculative_tokens == 7
    text = "The quick brown fox"
    ids = plain.encode(text)
    a = plain.generate(text, 10, ignore_eos=True)
    b = plain.generate(ids, 10, num_speculative_tokens=0, ignore_eos=True)
    assert a.prompt_ids == ids and a.token_ids == b.token_ids
    assert a.text == plain.tokenizer.decode(a.token_ids)


def test_max_new_tokens_exact_and_cache_limit(hot, ckpt_dir):
    p = [3, 1, 4, 1, 5]
    ref = hot.generate(p, 12, num_speculative_tokens=0, ignore_eos=True).token_ids
    for n in range(1, 12):
        res = hot.generate(p, n, num_speculative_tokens=15, ignore_eos=True)
        assert res.token_ids == ref[:n] and res.finish_reason == "length"
    zero = hot.generate(p, 0)
    assert zero.token_ids == [] and zero.text == "" and zero.finish_reason == "length"
    # a 16-position cache holds the prompt and all but the last generated token
    small = dm.load(ckpt_dir("hot"), None, max_len=16, n_threads=1)
    res = small.generate(list(range(10)), 50, ignore_eos=True)
    assert res.finish_reason == "max_len" and len(res.token_ids) == 16 - 10 + 1
    assert res.token_ids == hot.generate(list(range(10)), 7, num_speculative_tokens=0, ignore_eos=True).token_ids


def test_stop_tokens_only_new_tokens(hot):
    p = [0, 7, 0, 9]  # the stop id inside the prompt must not stop anything
    ref = hot.generate(p, NEW_TOKENS, num_speculative_tokens=0, ignore_eos=True).token_ids
    stop = next(t for t in ref[2:] if t not in ref[:2])  # a token first generated mid-way
    cut = ref.index(stop)
    for k in (0, 5, 15):
        res = hot.generate(p, NEW_TOKENS, num_speculative_tokens=k, stop=[stop], ignore_eos=True)
        assert res.token_ids == ref[: cut + 1] and res.finish_reason == "stop", k
        assert res.text == hot.tokenizer.decode(ref[:cut])
    # the drafter's mask id as a stop id never matches the drafted block (docs/dflash.md 9)
    mask = hot.drafter.cfg.mask_token_id
    if mask not in ref:
        assert hot.generate(p, NEW_TOKENS, stop=[mask], ignore_eos=True).token_ids == ref
    # default stops come from generation_config.json (list) + config eos
    assert set(hot.stop_ids) == {special_id("<|im_end|>"), special_id("<|endoftext|>")}


def test_stop_string(plain):
    ref = plain.generate([5, 6, 7], 20, ignore_eos=True)
    text = ref.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if not needle.strip() or "\ufffd" in needle:
        pytest.skip("random text without a usable two-character needle")
    res = plain.generate([5, 6, 7], 20, stop=[needle], ignore_eos=True)
    assert res.finish_reason == "stop" and needle not in res.text and text.startswith(res.text)


def test_streaming_pieces_add_up(plain):
    pieces, ids = [], []
    def stream(new_ids, text):
        ids.extend(new_ids)
        pieces.append(text)

    res = plain.generate([11, 12, 13], 16, ignore_eos=True, stream=stream)
    assert ids == res.token_ids
    assert "".join(pieces) == plain.tokenizer.decode(res.token_ids)


def test_streamed_text_leaves_out_the_stop_token_as_the_result_does(plain):
    free = plain.generate([11, 12, 13], 16, ignore_eos=True).token_ids
    stop = free[5]  # a token greedy decoding reaches: generation ends there
    pieces = []
    res = plain.generate([11, 12, 13], 16, stop=[stop], stream=lambda new_ids, text: pieces.append(text))
    assert res.finish_reason == "stop" and res.token_ids[-1] == stop
    assert "".join(pieces) == res.text == plain.tokenizer.decode(res.token_ids[:-1])


def test_metrics(hot):
    hot.reset_metrics()
    res = hot.generate([1, 2, 3], 30, num_speculative_tokens=7, ignore_eos=True)
    m = res.metrics
    assert m.rounds == len(m.accepted) == len(m.drafted) > 0
    assert m.tau == pytest.approx(np.mean(m.accepted) + 1)
    assert 1.0 <= m.tau <= 8.0 and 0.0 <= m.acceptance_rate <= 1.0
    assert m.acceptance_rate == pytest.approx(sum(m.accepted) / sum(m.drafted))
    assert sum(m.tau_histogram.values()) == m.rounds
    assert len(m.per_position_acceptance) == 7
    assert all(0.0 <= a <= 1.0 for a in m.per_position_acceptance)
    drafted = np.asarray(m.drafted) > 0
    assert m.per_position_acceptance[0] == pytest.approx(np.mean(np.asarray(m.accepted)[drafted] > 0))
    assert 1 + sum(a + 1 for a in m.accepted) >= m.generated_tokens == 30
    assert m.tokens_per_second > 0 and m.overhead_s >= 0 and m.kernel_s > 0
    assert m.prefill_s > 0 and m.draft_s > 0 and m.verify_s > 0 and m.accept_s >= 0
    s = m.summary()
    assert s["rounds"] == m.rounds and "overhead_per_round_us" in s
    hot.generate([4, 5], 10, num_speculative_tokens=3, ignore_eos=True)
    agg = hot.aggregate_metrics()
    assert agg.calls == 2 and agg.rounds == m.rounds + hot.history[1].rounds
    assert agg.generated_tokens == 40


# -- sampling ---------------------------------------------------------------------------------------

def _softmax(logits, temperature):
    z = logits.astype(np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def _target_probs(eng, ids, temperature):
    cache = eng.target.new_cache(64)
    h, _ = eng.target.forward(ids, cache, last_only=True, taps=False)
    return _softmax(eng.target.logits(h)[0], temperature)


def test_sampling_follows_target_distribution(warm):
    """Tokens 1-3 sampled by DFlash (k=3, T=0.7) follow p(t1), p(t2|t1), p(t3|t1,t2) exactly.

    Token 1 comes from the prefill, token 2 from verify row 0 (accepted draft or the residual
    p - one_hot(draft)), token 3 from row 1 (second draft or bonus) or the next round.
    """
    T, N = 0.7, 700
    prompt = [9, 8, 7, 6]
    warm.reset_metrics()
    samples = [tuple(warm.generate(prompt, 4, temperature=T, seed=s, num_speculative_tokens=3,
                                   ignore_eos=True).token_ids) for s in range(N)]
    hist = warm.aggregate_metrics().tau_histogram
    assert hist.get(1, 0) > 50 and hist.get(2, 0) > 50, hist  # both rejections and acceptances
    # position 1 (the verify row-0 rejection path) and position 2 (accepted-draft path) are checked
    checks = [((), 0)]
    first = {}
    for s in samples:
        first.setdefault(s[0], []).append(s)
    checks += [((t1,), 1) for t1, group in first.items() if len(group) >= 60]
    second = {}
    for s in samples:
        second.setdefault(s[:2], []).append(s)
    checks += [(pre, 2) for pre, group in second.items() if len(group) >= 60]
    assert len(checks) >= 4, "too few large groups for a conditional test"
    for prefix, pos in checks:
        group = [s for s in samples if s[:pos] == prefix]
        counts = {}
        for s in group:
            counts[s[pos]] = counts.get(s[pos], 0) + 1
        ok, stat, crit = chi2_ok(counts, _target_probs(warm, prompt + list(prefix), T))
        assert ok, f"prefix {prefix}: chi2 {stat:.1f} >= {crit:.1f} with {len(group)} samples"


def _check_first_two_tokens(eng, prompt, T, samples, label):
    """Sampled tokens 1 and 2 follow p(t1) and p(t2 | t1) (chi-square; t1 values with >= 60 samples)."""
    checks = [((), 0)]
    first = {}
    for s in samples:
        first.setdefault(s[0], []).append(s)
    checks += [((t1,), 1) for t1, group in first.items() if len(group) >= 60]
    assert len(checks) >= 2, "too few large groups for a conditional test"
    for prefix, pos in checks:
        counts = {}
        for s in samples:
            if s[:pos] == prefix:
                counts[s[pos]] = counts.get(s[pos], 0) + 1
        ok, stat, crit = chi2_ok(counts, _target_probs(eng, prompt + list(prefix), T))
        assert ok, f"{label}, prefix {prefix}: chi2 {stat:.1f} >= {crit:.1f}"


def test_sampling_with_auto_k_follows_target_distribution(warm):
    """num_speculative_tokens="auto" changes k from round to round (0 included): tokens 1 and 2 still
    follow p(t1) and p(t2|t1)."""
    T, N = 0.7, 700
    prompt = [9, 8, 7, 6]
    warm.reset_metrics()
    samples = [tuple(warm.generate(prompt, 3, temperature=T, seed=5000 + s, num_speculative_tokens="auto",
                                   ignore_eos=True).token_ids) for s in range(N)]
    m = warm.aggregate_metrics()
    assert {0, 1} <= set(m.k_histogram), m.k_histogram  # drafting rounds and autoregressive steps
    _check_first_two_tokens(warm, prompt, T, samples, "auto k")


def test_sampling_ar_matches_distribution_and_seed(warm):
    hot = warm
    T, N = 0.7, 300
    prompt = [9, 8, 7, 6]
    counts = {}
    for s in range(N):
        t = hot.generate(prompt, 1, temperature=T, seed=1000 + s, num_speculative_tokens=0).token_ids[0]
        counts[t] = counts.get(t, 0) + 1
    ok, stat, crit = chi2_ok(counts, _target_probs(hot, prompt, T))
    assert ok, f"AR first token chi2 {stat:.1f} >= {crit:.1f}"
    a = hot.generate(prompt, 20, temperature=T, seed=42, ignore_eos=True).token_ids
    b = hot.generate(prompt, 20, temperature=T, seed=42, ignore_eos=True).token_ids
    c = hot.generate(prompt, 20, temperature=T, seed=43, ignore_eos=True).token_ids
    assert a == b and a != c


def test_sampling_top_k_top_p_support(hot):
    """With top_k=2 every sampled token is among the target's top-2 at its position."""
    prompt = [1, 2, 3]
    for seed in range(15):
        res = hot.generate(prompt, 12, temperature=1.5, top_k=2, seed=seed, num_speculative_tokens=5, ignore_eos=True)
        ids = prompt + res.token_ids
        cache = hot.target.new_cache(64)
        h, _ = hot.target.forward(ids[:-1], cache, taps=False)
        logits = hot.target.logits(h)[len(prompt) - 1 :]
        top2 = np.argsort(-logits, axis=-1, kind="stable")[:, :2]
        assert all(t in row for t, row in zip(res.token_ids, top2, strict=True)), seed
    res = hot.generate(prompt, 12, temperature=1.0, top_p=1e-6, seed=0, num_speculative_tokens=5, ignore_eos=True)
    assert res.token_ids == hot.generate(prompt, 12, num_speculative_tokens=0, ignore_eos=True).token_ids


# -- bad input ------------------------------------------------------------------------------------

def test_generate_bad_input(hot, ckpt_dir):
    with pytest.raises(ValueError, match="empty"):
        hot.generate([], 5)
    with pytest.raises(ValueError, match="empty"):
        hot.generate("", 5)
    with pytest.raises(ValueError, match="max_len"):
        hot.generate(list(range(128)), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hot.generate([1], -1)
    with pytest.raises(ValueError, match="token ids"):
        hot.generate([1, 10_000], 3)
    with pytest.raises(TypeError, match="sequence of token ids"):
        hot.generate([1.5, 2.0], 3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        hot.generate([1], 3, num_speculative_tokens=16)
    with pytest.raises(ValueError, match="temperature"):
        hot.generate([1], 3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        hot.generate([1], 3, top_p=0.0)
    ar = dm.load(ckpt_dir("hot"), max_len=32, n_threads=1)
    with pytest.raises(ValueError, match="needs a drafter"):
        ar.generate([1], 3, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dm.load(ckpt_dir("hot"), max_len=10**6)


def test_chunked_prefill_with_drafter(plain):
    """The drafter context built chunk by chunk during a chunked prefill gives the same drafts."""
    chunked = dm.load(plain.target_dir, plain.drafter_dir, max_len=128, n_threads=1, prefill_chunk=3)
    p = list(range(40, 57))
    ref = plain.generate(p, 16, num_speculative_tokens=0, ignore_eos=True).token_ids
    a = plain.generate(p, 16, num_speculative_tokens=7, ignore_eos=True)
    b = chunked.generate(p, 16, num_speculative_tokens=7, ignore_eos=True)
    assert a.token_ids == b.token_ids == ref
    assert a.metrics.accepted == b.metrics.accepted


@pytest.mark.parametrize("backend", list(dk.available_backends()))
def test_every_backend_same_greedy_tokens(plain, backend):
    eng = dm.load(plain.target_dir, plain.drafter_dir, max_len=64, n_threads=1, backend=backend)
    p = [21, 22, 23, 24]
    ref = plain.generate(p, 12, num_speculative_tokens=0, ignore_eos=True).token_ids
    assert eng.generate(p, 12, num_speculative_tokens=5, ignore_eos=True).token_ids == ref
    assert eng.generate(p, 12, num_speculative_tokens=0, ignore_eos=True).token_ids == ref


@pytest.mark.parametrize("tier", [None, *MACHINE_TIERS])
@pytest.mark.parametrize("precision,kv_dtype", [("highest", "float32"), ("high", "float32"), ("medium", "float32"),
                                                ("medium", "bfloat16")])
def test_greedy_lossless_every_tier_and_precision(hot, tier, precision, kv_dtype):
    """Under each ISA cap and matmul precision, DFlash greedy == AR greedy of the same engine (the
    bf16 checkpoint's verify rows take the AMX / FMA block paths, the AR step the GEMV path; at
    "medium" with a bf16 cache, attention runs on vdpbf16ps where the CPU has it)."""
    if tier is not None:
        dk.set_isa(tier)
    try:
        eng = dm.load(hot.target_dir, hot.drafter_dir, max_len=128, n_threads=1, precision=precision,
                      kv_dtype=kv_dtype)
        assert eng.ops.precision == precision
        accepted = 0
        for p in prompts(6, seed=1):
            ref = eng.generate(p, 16, num_speculative_tokens=0, ignore_eos=True).token_ids
            for k in (4, 15):
                res = eng.generate(p, 16, num_speculative_tokens=k, ignore_eos=True)
                assert res.token_ids == ref, f"tier {tier} precision {precision} prompt {p} k={k}"
                accepted += sum(res.metrics.accepted)
        assert accepted > 0  # drafts were accepted: the verify rows decided tokens
    finally:
        dk.set_isa(None)


def test_load_bad_precision(hot):
    with pytest.raises(ValueError, match="precision must be one of highest, high, medium"):
        dm.load(hot.target_dir, hot.drafter_dir, precision="fp8")
    with pytest.raises(ValueError, match="draft_precision must be 'auto', None or one of highest, high, medium"):
        dm.load(hot.target_dir, hot.drafter_dir, draft_precision="fp8")


@pytest.mark.parametrize("tier", [None, *MACHINE_TIERS])
@pytest.mark.parametrize("precision,draft_precision", [("highest", "medium"), ("medium", "highest"),
                                                       ("high", "medium")])
def test_greedy_lossless_with_the_drafter_at_another_precision(hot, tier, precision, draft_precision):
    """The drafter's own precision changes what it proposes, never the output: DFlash greedy ==
    AR greedy, and the target's steps and verification rows keep the target's precision."""
    if tier is not None:
        dk.set_isa(tier)
    try:
        eng = dm.load(hot.target_dir, hot.drafter_dir, max_len=128, n_threads=1, precision=precision,
                      draft_precision=draft_precision)
        assert (eng.ops.precision, eng.drafter.ops.precision) == (precision, draft_precision)
        assert eng.target.ops is eng.ops
        accepted = 0
        for p in prompts(4, seed=2):
            ref = eng.generate(p, 16, num_speculative_tokens=0, ignore_eos=True).token_ids
            res = eng.generate(p, 16, num_speculative_tokens=15, ignore_eos=True)
            assert res.token_ids == ref, f"tier {tier} {precision}/{draft_precision} prompt {p}"
            accepted += sum(res.metrics.accepted)
        assert accepted > 0
    finally:
        dk.set_isa(None)


@pytest.mark.parametrize("tier", [None, *MACHINE_TIERS])
def test_draft_precision_auto_is_medium_only_where_a_bf16_dot_product_runs_it(hot, tier):
    if tier is not None:
        dk.set_isa(tier)
    try:
        if tier in ("avx2", "avx512"):  # no bf16 dot product at these tiers
            assert not dk.bf16_dot_pays()
        auto = dm.load(hot.target_dir, hot.drafter_dir, max_len=64, n_threads=1)
        assert auto.drafter.ops.precision == ("medium" if dk.bf16_dot_pays() else "highest")
        assert (auto.drafter.ops is auto.ops) == (not dk.bf16_dot_pays())  # one Ops when they agree
        same = dm.load(hot.target_dir, hot.drafter_dir, max_len=64, n_threads=1, draft_precision=None)
        assert same.drafter.ops is same.ops
    finally:
        dk.set_isa(None)


def test_drafter_ops_of_their_own_are_timed_and_cloned(hot):
    eng = dm.load(hot.target_dir, hot.drafter_dir, max_len=128, n_threads=1, draft_precision="medium")
    before = eng.drafter.ops.kernel_s
    res = eng.generate(prompts(1, seed=3)[0], 16, num_speculative_tokens=15, ignore_eos=True)
    drafted = eng.drafter.ops.kernel_s - before
    assert drafted > 0  # the drafts ran on the drafter's own ops ...
    assert res.metrics.kernel_s >= drafted  # ... and count in the round's kernel time
    twin = eng.clone()
    assert (twin.ops.precision, twin.drafter.ops.precision) == ("highest", "medium")
    assert twin.drafter.ops is not eng.drafter.ops and twin.target.ops is twin.ops
    assert twin.generate([5, 6], 8, num_speculative_tokens=4, ignore_eos=True).token_ids == \
        eng.generate([5, 6], 8, num_speculative_tokens=0, ignore_eos=True).token_ids


def test_generate_refuses_reentrant_and_concurrent_use(plain):
    """One Engine, one generation at a time: a second call from the stream callback, or from another
    thread while the first runs, raises instead of corrupting the caches (it gave wrong tokens)."""
    import threading

    seen = []

    def reenter(new_ids, new_text):
        with pytest.raises(RuntimeError, match="already running"):
            plain.generate([1, 2, 3], 4)
        seen.append(True)

    ref = plain.generate([5, 6, 7], 6, num_speculative_tokens=3, ignore_eos=True).token_ids
    assert plain.generate([5, 6, 7], 6, num_speculative_tokens=3, ignore_eos=True, stream=reenter).token_ids == ref
    assert seen
    started, release, errors = threading.Event(), threading.Event(), []

    def slow(new_ids, new_text):
        started.set()
        release.wait(5)

    t = threading.Thread(target=lambda: plain.generate([5, 6, 7], 3, ignore_eos=True, stream=slow))
    t.start()
    assert started.wait(5)
    try:
        plain.generate([1, 2], 2)
    except RuntimeError as err:
        errors.append(err)
    release.set()
    t.join()
    assert errors and "already running" in str(errors[0])
    assert plain.generate([5, 6, 7], 6, num_speculative_tokens=3, ignore_eos=True).token_ids == ref


def test_tiny_temperature_generates_greedily(plain):
    ref = plain.generate([9, 10, 11], 8, ignore_eos=True).token_ids
    assert plain.generate([9, 10, 11], 8, temperature=1e-30, seed=1, ignore_eos=True).token_ids == ref


@pytest.mark.parametrize("kwargs,err,match", [
    ({"stop": b"\n"}, TypeError, "stop must be token ids and/or strings, got bytes"),
    ({"stop": 1.5}, TypeError, "stop must be a token id, a string, or a list of them"),
    ({"seed": "abc"}, ValueError, "seed must be an int >= 0 or None"),
    ({"seed": 1.5}, ValueError, "seed must be an int >= 0 or None"),
    ({"seed": -1}, ValueError, "seed must be an int >= 0 or None"),
    ({"stream": 5}, TypeError, "stream must be a callable"),
])
def test_generate_arguments_checked_up_front(plain, kwargs, err, match):
    with pytest.raises(err, match=match):
        plain.generate([1, 2, 3], 4, **kwargs)


def test_nan_weights_raise_on_the_autoregressive_path_too(ckpt_dir, tmp_path_factory):
    """NaN in the LM head gave [0, 0, ...] on the autoregressive path (argmax over NaN) while the
    DFlash path raised: both raise now."""
    t = ckpt_dir("plain", tie=True, style="v5")
    eng = dm.load(t, None, max_len=64, n_threads=1)
    eng.target.lm_head = np.array(eng.target.lm_head, copy=True)
    eng.target.lm_head[7] = 0x7FC0  # bf16 NaN
    with pytest.raises(ValueError, match="not finite"):
        eng.generate([1, 2, 3], 4, ignore_eos=True)


def test_default_k_auto_when_greedy_fixed_when_sampling(hot, monkeypatch):
    """Without a tuned k: greedy and unseeded sampling run "auto" (greedy output is the same for every
    k, so only speed moves), seeded sampling runs block_size - 1 (auto's k follows round times, so
    the seed would not reproduce tokens)."""
    assert hot.default_speculative_tokens(0.0) == "auto" == hot.default_speculative_tokens(0.7)
    assert hot.default_speculative_tokens(0.7, seed=5) == hot.default_num_speculative_tokens == 15
    import dflash_kernels.model.engine as engine_mod

    choosers = []

    class Spy(engine_mod.AutoK):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            choosers.append(self)

    monkeypatch.setattr(engine_mod, "AutoK", Spy)
    ref = hot.generate([9, 8, 7], 40, ignore_eos=True, num_speculative_tokens=0)
    assert hot.generate([9, 8, 7], 40, ignore_eos=True).token_ids == ref.token_ids
    assert len(choosers) == 1 and choosers[0].rounds > 0  # greedy: k chosen every round
    a = hot.generate([9, 8, 7], 20, temperature=0.7, seed=5, ignore_eos=True)
    b = hot.generate([9, 8, 7], 20, temperature=0.7, seed=5, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(choosers) == 1 and a.metrics.drafted[0] == 15  # fixed k
    hot.generate([9, 8, 7], 20, temperature=0.7, ignore_eos=True)  # no seed: nothing to reproduce
    assert len(choosers) == 2  # "auto"


def test_fixed_k_greedy_rounds_time_the_round_cost(plain):
    """The round cost "auto" picks k by is the Engine's: greedy rounds of a fixed k time that k too
    (not the first after the prefill, on cold caches; not sampled rounds, which also sample)."""
    eng = plain.clone()
    assert not np.isfinite(eng.round_cost.est).any()
    eng.generate([5, 6, 7], 12, num_speculative_tokens=3, ignore_eos=True)
    timed = set(np.flatnonzero(np.isfinite(eng.round_cost.est)).tolist())
    assert 3 in timed and timed <= {0, 1, 2, 3}, timed  # (the budget's last rounds draft fewer)
    eng.generate([5, 6, 7], 6, num_speculative_tokens=0, ignore_eos=True)
    assert eng.round_cost.ar_timed
    before = eng.round_cost.est.copy()
    eng.generate([5, 6, 7], 12, temperature=0.7, seed=1, num_speculative_tokens=5, ignore_eos=True)
    assert np.array_equal(before, eng.round_cost.est, equal_nan=True)


def _half_vocab(eng, first: int):
    """Every other token id from `first`: a drafting vocabulary that misses half of the target's
    (the fixtures' hot token, the one the random drafter favours, is id 0)."""
    return np.arange(first, eng.target.cfg.vocab_size, 2, dtype=np.int64)


def test_draft_vocab_greedy_lossless(hot):
    """Drafts from a drafting vocabulary (model/draft_vocab.py) are target ids inside it; greedy
    output stays the autoregressive one. The whole vocabulary as the set drafts exactly as before."""
    full = hot.clone()
    full.drafter.set_draft_vocab(np.arange(hot.target.cfg.vocab_size), full.target.lm_head_table)
    half = hot.clone()
    ids = _half_vocab(half, 1)  # without the hot token: drafts the target often rejects
    half.drafter.set_draft_vocab(ids, half.target.lm_head_table)
    proposed = []
    draft = half.drafter.draft
    half.drafter.draft = lambda *a: proposed.append(d := draft(*a)) or d
    for p in prompts(8, seed=21):
        ref = hot.generate(p, NEW_TOKENS, num_speculative_tokens=0, ignore_eos=True).token_ids
        base = hot.generate(p, NEW_TOKENS, num_speculative_tokens=4, ignore_eos=True)
        same = full.generate(p, NEW_TOKENS, num_speculative_tokens=4, ignore_eos=True)
        assert base.token_ids == ref and same.token_ids == ref and same.metrics.accepted == base.metrics.accepted
        assert half.generate(p, NEW_TOKENS, num_speculative_tokens=4, ignore_eos=True).token_ids == ref
    drafted = np.concatenate(proposed)
    assert np.isin(drafted, ids).all() and len(set(drafted.tolist())) > 1  # never the hot token 0
    with pytest.raises(ValueError, match="sorted, unique token ids"):
        half.drafter.set_draft_vocab(ids[::-1], half.target.lm_head_table)


def test_draft_vocab_sampling_follows_target_distribution(warm):
    """Sampled drafts over half the vocabulary, with q zero outside it: tokens 1 and 2 still follow
    p(t1) and p(t2 | t1) (rejection sampling with q is exact for any q)."""
    eng = warm.clone()
    ids = _half_vocab(eng, 0)
    eng.drafter.set_draft_vocab(ids, eng.target.lm_head_table)
    sampled = []
    draft_sampled = eng.drafter.draft_sampled
    eng.drafter.draft_sampled = lambda *a: sampled.append(r := draft_sampled(*a)) or r
    T, N = 0.7, 700
    prompt = [9, 8, 7, 6]
    samples = [tuple(eng.generate(prompt, 3, temperature=T, seed=7000 + s, num_speculative_tokens=3,
                                  ignore_eos=True).token_ids) for s in range(N)]
    for drafts, q in sampled[:50]:  # q: rows over the whole vocabulary, all their mass on the set
        assert np.isin(drafts, ids).all() and (q[np.arange(len(drafts)), drafts] > 0).all()
        assert np.allclose(q[:, ids].sum(axis=1), 1.0, atol=1e-5) and not np.delete(q, ids, axis=1).any()
    hist = eng.aggregate_metrics().tau_histogram
    assert hist.get(1, 0) > 50 and sum(c for n, c in hist.items() if n >= 2) > 50, hist
    _check_first_two_tokens(eng, prompt, T, samples, "draft vocabulary")


def test_draft_vocab_file_is_loaded_beside_the_drafter(ckpt_dir, tmp_path_factory):
    """model.load reads the drafter directory's draft_vocab.json (draft_vocab=False ignores it); a
    bad file is a clear error naming it."""
    from dflash_kernels.model import draft_vocab

    t = ckpt_dir("hot", tie=False, hot_tokens=1, hot_scale=40.0, shards=2)
    d = write_dflash(tmp_path_factory.mktemp("dv"), t, layers=2, block_size=16, target_layer_ids=(0, 2))
    V = dm.load(t, d, max_len=64, n_threads=1).target.cfg.vocab_size
    draft_vocab.write(d / draft_vocab.FILE, [5, 0, 7, 5], vocab_size=V, source="test", tokens_counted=4)
    eng = dm.load(t, d, max_len=64, n_threads=1)
    assert eng.drafter.draft_ids.tolist() == [0, 5, 7]
    assert dm.load(t, d, max_len=64, n_threads=1, draft_vocab=False).drafter.draft_ids is None
    res = eng.generate([3, 4, 5], 12, num_speculative_tokens=4, ignore_eos=True)
    assert res.token_ids == eng.generate([3, 4, 5], 12, num_speculative_tokens=0, ignore_eos=True).token_ids
    for bad, match in (('{"token_ids": [1, 99999]}', r"token ids must lie in \[0, "),
                       ('{"vocab_size": 7, "token_ids": [1]}', "made for a vocabulary of 7"),
                       ("not json", "not a draft vocabulary")):
        (d / draft_vocab.FILE).write_text(bad)
        with pytest.raises(ValueError, match=match) as err:
            dm.load(t, d, max_len=64, n_threads=1)
        assert draft_vocab.FILE in str(err.value)
