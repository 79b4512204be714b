"""num_speculative_tokens="auto" (model/adaptive.py): the estimates and the choice of k."""

import numpy as np
import pytest

from dflash_kernels.model.adaptive import (
    AR_TIMINGS,
    LONG_PROBE_EVERY,
    PRIOR_ACCEPT,
    PRIOR_WEIGHT,
    PROBE_EVERY,
    WINDOW,
    AcceptanceEstimate,
    AutoK,
    RoundCost,
)


def test_acceptance_counts_what_a_round_shows():
    a = AcceptanceEstimate(6, decay=1.0)
    a.observe(5, 2)  # drafts 1, 2 accepted, 3 rejected: "at least j accepted" seen for j <= 5
    assert a.trials.tolist() == [1, 1, 1, 1, 1, 0] and a.hits.tolist() == [1, 1, 0, 0, 0, 0]
    a.observe(3, 3)  # all three accepted
    assert a.trials.tolist() == [2, 2, 2, 1, 1, 0] and a.hits.tolist() == [2, 2, 1, 0, 0, 0]
    a.observe(0, 0)  # an autoregressive step says nothing about acceptance
    assert a.trials.tolist() == [2, 2, 2, 1, 1, 0]
    # each position's counts shrunk toward PRIOR_ACCEPT times the estimate before it, never above it
    want, before = [], 1.0
    for j in range(6):
        before = min(before, (a.hits[j] + PRIOR_WEIGHT * PRIOR_ACCEPT * before) / (a.trials[j] + PRIOR_WEIGHT))
        want.append(before)
    assert np.allclose(a.survival, want)
    b = AcceptanceEstimate(3, decay=1.0)
    b.observe(1, 0)
    b.observe(2, 2)  # position 2's counts alone (1 of 1) would put it above position 1 (1 of 2)
    assert b.survival[1] == b.survival[0] < 0.7  # a survival never rises with j
    assert a.survival[5] == PRIOR_ACCEPT * a.survival[4]  # never drafted: the estimate before it, times the prior


def test_unseen_positions_continue_the_measured_trend():
    """A short k says nothing about the positions past it: they continue the acceptance measured
    where it ran. On the stdlib pair k = 3 rounds that accepted everything left the deep positions
    at the fixed prior (0.8^j), and auto stayed at k = 3 where k = 15 committed 1.3x more per
    second (bench/auto_trace.py, session 20)."""
    sure, poor = AcceptanceEstimate(15), AcceptanceEstimate(15)
    for _ in range(30):
        sure.observe(3, 3)  # every draft of k = 3 accepted
        poor.observe(3, 1)  # only the first
    deep = PRIOR_ACCEPT ** np.arange(1, 13)
    assert sure.survival[2] > 0.95 and np.allclose(sure.survival[3:], sure.survival[2] * deep)
    assert sure.expected_tokens()[15] > 7.5  # the fixed prior's 0.8^j: 5.9 tokens
    assert poor.survival[1] < 0.1 and np.allclose(poor.survival[3:], poor.survival[2] * deep)
    fresh = AcceptanceEstimate(15)  # nothing seen: the prior itself
    assert np.allclose(fresh.survival, PRIOR_ACCEPT ** np.arange(1, 16))


def test_acceptance_decays_and_expected_tokens():
    a = AcceptanceEstimate(3, decay=0.5)
    a.observe(1, 1)
    a.observe(1, 1)
    assert a.trials[0] == 1.5 and a.hits[0] == 1.5
    s = np.array([0.5, 0.25, 0.25])
    # E(k) = 1 + S_1 + ... + S_k: the bonus / target token plus the accepted prefix
    assert np.allclose(a.expected_tokens(s), [1.0, 1.5, 1.75, 2.0])
    with pytest.raises(ValueError, match="prior must have 3 entries"):
        AcceptanceEstimate(3, prior=[0.5, 0.5])


def test_round_cost_is_the_fastest_recent_round():
    c = RoundCost(8)
    assert not c.draft_timed and not c.ar_timed
    c.observe(4, 0.5)
    c.observe(4, 100.0)  # a descheduled thread: timing noise only adds time
    assert c.est[4] == 0.5
    for _ in range(WINDOW - 2):
        c.observe(4, 0.9)
    assert c.est[4] == 0.5  # still in the window
    c.observe(4, 0.9)
    assert c.est[4] == 0.9  # the machine got slower: the fast round left the window
    c.observe(0, 1.0)  # the first step after a drafting round: cold caches
    assert not c.ar_timed  # one step does not price the autoregressive step
    for _ in range(AR_TIMINGS - 1):
        c.observe(0, 0.5)
    assert c.ar_timed and c.draft_timed
    c.observe(8, 3.0)  # timed once, maybe cold: priced as its neighbours while k = 4 has run twice
    assert c.costs(8)[8] == 0.9
    c.observe(8, 2.0)
    cost = c.costs(8)
    assert cost[0] == 0.5 and cost[4] == 0.9 and cost[8] == 2.0
    assert np.isclose(cost[6], (0.9 + 2.0) / 2)  # linear between the k run
    assert np.isclose(cost[2], (0.5 + 0.9) / 2)  # below the smallest k: towards the AR step
    assert c.costs(10)[10] == 2.0  # flat above the largest k
    c.observe(6, 1.0)
    assert np.isclose(c.costs(8)[6], (0.9 + 2.0) / 2)  # once: still the line
    c.observe(6, 1.0)
    assert c.costs(8)[6] == 1.0  # a new estimate is seen at once (costs() caches between changes)


def test_a_k_timed_once_too_dear_is_run_again():
    """The longest k's one timing came from a cold round (the stdlib pair on a Xeon with AMX: 1.84
    ms against 1.10 ms in steady state): once a short k has run twice, k = 15 is priced from its
    neighbours, tried again, and from then on priced at what it really costs."""
    k_max = 15
    cost = _cost(1.0, 8.0)  # a cold k = 15 round: 8 AR steps
    chooser = AutoK(k_max, cost)
    chooser.choose()
    for i in range(40):  # every draft accepted in half the rounds, four in the others: E(15) = 10.5
        chooser.observe(k_max, k_max if i % 2 else 4, 8.0)
    picks = []
    for i in range(30):  # in steady state k = 15 costs 2 AR steps, a shorter k 1.5
        k = chooser.choose()
        picks.append(k)
        chooser.observe(k, min(k, k_max if i % 2 else 4), 2.0 if k == k_max else 1.5)
    assert 0 < picks[0] < k_max and k_max in picks[:4]  # tried again once the short k has run twice
    assert cost.est[k_max] == 2.0 and cost.costs(k_max)[k_max] == 2.0
    assert picks[-5:] == [k_max] * 5


def _cost(ar, draft, k_max=15):
    c = RoundCost(k_max)
    for _ in range(AR_TIMINGS):
        c.observe(0, ar)
    c.observe(k_max, draft)
    return c


def test_autok_explores_then_picks_the_best_rate():
    k_max = 15
    cost = RoundCost(k_max)
    chooser = AutoK(k_max, cost)
    assert chooser.choose() == k_max  # a request starts with the longest k
    chooser.observe(k_max, 15, 30.0)  # right after the prefill: cold, not timed
    assert not cost.draft_timed
    assert chooser.choose() == k_max  # still no drafting round timed
    chooser.observe(k_max, 15, 3.0)
    for _ in range(AR_TIMINGS):  # then autoregressive steps, to know what a round must beat
        assert chooser.choose() == 0
        chooser.observe(0, 0, 1.0)
    for _ in range(40):  # every draft accepted: E(15) ~ 16 tokens for 3x an AR step
        chooser.observe(k_max, k_max, 3.0)
    assert chooser.choose() == k_max


@pytest.mark.parametrize("sampled", [False, True])
def test_autok_goes_autoregressive_when_drafts_do_not_pay_and_probes(sampled):
    k_max = 15
    chooser = AutoK(k_max, _cost(1.0, 3.0), sampled=sampled)  # a round costs 3 AR steps
    chooser.choose()  # the request's first round: k_max
    for _ in range(60):  # nothing is ever accepted: E(k) = 1 < 3
        chooser.observe(k_max, 0, 3.0)
    picks = [chooser.choose() for _ in range(PROBE_EVERY)]
    assert picks[: PROBE_EVERY - 1] == [0] * (PROBE_EVERY - 1)
    # after PROBE_EVERY autoregressive steps, one drafting round anyway that sees past it: greedy, the
    # best drafting k (the cheapest here) over the whole block; sampled, 2 k + 1 of them
    probe = 3 if sampled else 1
    assert picks[-1] == probe and chooser.whole_block == (not sampled)
    chooser.observe(probe, 0, 3.0, [7], None if sampled else [8] * (k_max - 1))  # rejected too
    picks = [chooser.choose() for _ in range(2 * PROBE_EVERY)]
    assert picks[:-1] == [0] * (2 * PROBE_EVERY - 1) and picks[-1] == probe  # the interval doubled


def test_a_greedy_probe_sees_past_k_in_hindsight():
    """A whole-block probe verifies k drafts; each later draft counts as accepted once the target has
    committed that very token (and every one before it), as a longer verification would have."""
    k_max = 15
    chooser = AutoK(k_max, _cost(1.0, 3.0))
    chooser.choose()
    est = chooser.acceptance = AcceptanceEstimate(k_max, decay=1.0)  # plain counts
    drafts = list(range(100, 115))  # a probe of k = 2 over the whole block
    chooser.observe(2, 2, 1.5, [100, 101, 102], drafts[2:])  # both accepted; the target's token = draft 3
    assert est.trials.tolist() == est.hits.tolist() == [1.0] * 3 + [0.0] * 12
    chooser.observe(0, 0, 1.0, [103])  # an AR step commits draft 4
    chooser.observe(1, 1, 1.2, [104, 999])  # a round commits draft 5, then not draft 6
    # the probe: positions 1-5 accepted, 6 rejected and so every one past it; the round: position 1
    assert est.trials.tolist() == [2.0] + [1.0] * 14
    assert est.hits.tolist() == [2.0] + [1.0] * 4 + [0.0] * 10
    assert not chooser._pending
    chooser.observe(3, 1, 1.5, [300, 301], [400] * 12)  # a probe whose second draft is rejected:
    assert est.trials.tolist() == [3.0] + [2.0] * 14  # a longer verification stops there too
    assert est.hits.tolist() == [3.0] + [1.0] * 4 + [0.0] * 10 and not chooser._pending


def test_autok_prefers_short_k_when_deep_positions_fail():
    k_max = 15
    cost = RoundCost(k_max)
    for k in range(k_max + 1):
        for _ in range(AR_TIMINGS if k == 0 else 1):
            cost.observe(k, 1.0 + 0.2 * k)  # every k timed: rounds grow with k
    chooser = AutoK(k_max, cost)
    chooser.choose()
    for _ in range(80):  # the first two drafts always accepted, the third never
        chooser.observe(k_max, 2, cost.est[k_max])
    # k = 2 commits ~3 tokens for 1.4 s; a third draft adds ~0.15 tokens for 0.2 s more
    assert chooser.choose() == 2


def test_autok_tries_a_short_k_when_the_longest_does_not_pay():
    """Only k_max and the AR step timed, k_max losing to autoregressive steps: the short k that pays
    gets tried (it looks cheap on the line from the AR step), then kept at its measured cost."""
    k_max = 15
    cost = _cost(1.0, 4.0)  # a k = 15 round costs 4 AR steps
    chooser = AutoK(k_max, cost)
    chooser.choose()
    for _ in range(40):  # two drafts accepted per round: E(15) = 3 tokens for 4 steps' time
        chooser.observe(k_max, 2, 4.0)
    k = chooser.choose()
    assert 0 < k < k_max
    picks = []
    for _ in range(20):  # what a short round really costs: 1.5 AR steps for ~3 tokens, more per draft
        chooser.observe(k, min(k, 2), 4.0 if k == k_max else 1.4 + 0.05 * k)
        k = chooser.choose()
        picks.append(k)
    assert k == 2
    # k_max: tried once more to confirm its price (timed once before), and one long probe
    assert picks.count(k_max) <= 2


def test_a_request_starts_where_the_last_one_ended():
    """The Engine's RoundCost carries the last request's k: where drafts did not pay, the next
    request starts with autoregressive steps (on the stdlib pair, a k = 15 round at every request's
    start cost 7 AR steps), and probes on its own schedule (carried over, a poor prompt's long
    interval kept the next request from drafting where it paid)."""
    k_max = 15
    cost = _cost(1.0, 3.0)
    first = AutoK(k_max, cost)
    assert first.choose() == k_max  # the Engine's first request: the longest k
    for _ in range(60):  # nothing accepted: autoregressive steps, probes further and further apart
        first.observe(k_max, 0, 3.0)
    picks = [first.choose() for _ in range(3 * PROBE_EVERY)]
    assert picks.count(0) >= 3 * PROBE_EVERY - 2 and first.interval > PROBE_EVERY
    second = AutoK(k_max, cost)
    assert second.choose() == 0 and second.interval == PROBE_EVERY < first.interval
    cost.last_k = 4
    assert AutoK(k_max, cost).choose() == 4
    cost.last_k = 40
    assert AutoK(k_max, cost).choose() == k_max  # never more than this request allows


def test_a_sampled_request_starts_with_the_last_sampled_probe_interval():
    """Sampling decides most of the acceptance at T > 0: a sampled request probes on the schedule
    the last sampled one reached, a greedy request on a fresh one."""
    k_max = 15
    cost = _cost(1.0, 3.0)
    first = AutoK(k_max, cost, sampled=True)
    first.choose()
    for _ in range(60):  # nothing accepted: the probes grow further apart
        first.observe(k_max, 0, 3.0)
    for _ in range(7 * PROBE_EVERY):
        k = first.choose()
        first.observe(k, 0, 3.0 if k else 1.0)
    assert first.interval >= 4 * PROBE_EVERY and cost.sampled_probe_interval == first.interval
    assert AutoK(k_max, cost, sampled=True).interval == first.interval
    assert AutoK(k_max, cost).interval == PROBE_EVERY  # greedy: afresh


def test_a_sampled_request_starts_from_the_last_sampled_acceptance():
    """... and from the acceptance the last sampled request measured, where a greedy request (and the
    first sampled one) starts from the optimistic PRIOR_ACCEPT ** j."""
    k_max = 15
    cost = _cost(1.0, 3.0)
    first = AutoK(k_max, cost, sampled=True)
    first.choose()
    rng = np.random.default_rng(0)
    for _ in range(60):  # one draft in four accepted, never two
        first.observe(k_max, int(rng.random() < 0.25), 3.0)
    second = AutoK(k_max, cost, sampled=True)
    np.testing.assert_allclose(second.acceptance.survival, np.maximum(first.acceptance.survival, 1e-9))
    assert second.acceptance.survival[0] < 0.5 < AutoK(k_max, cost).acceptance.survival[0]
    assert AutoK(k_max, RoundCost(k_max), sampled=True).acceptance.survival[0] > 0.5  # none before it


def test_autok_decision_follows_each_new_estimate():
    """choose() reuses its argmax while neither estimate changed; a change is seen at once."""
    k_max = 15
    cost = _cost(1.0, 3.0)
    chooser = AutoK(k_max, cost)
    chooser.choose()
    for _ in range(30):
        chooser.observe(k_max, 0, 3.0)
    assert chooser.choose() == 0
    chooser.observe(0, 0, 1.0)  # an AR step no faster than before: no estimate changed
    assert chooser.choose() == 0
    for _ in range(40):  # now every draft is accepted
        chooser.observe(k_max, k_max, 3.0)
    assert chooser.choose() == k_max
    cost.observe(0, 0.01)  # the AR step became 300x cheaper than a round: AR wins again
    assert chooser.choose() == 0


@pytest.mark.parametrize("sampled", [False, True])
def test_long_rounds_now_and_then_among_short_ones(sampled):
    """A short k leaves the positions past it unseen: after LONG_PROBE_EVERY short rounds in a row one
    round sees past it (sampled: drafts 2 k + 1; greedy: drafts the whole block, verifies k); each that
    changes nothing doubles the interval."""
    k_max = 15
    cost = RoundCost(k_max)
    for k, c in ((0, 1.0), (2, 1.2), (k_max, 5.0)):  # k = 2 pays, k = 15 does not
        for _ in range(AR_TIMINGS):
            cost.observe(k, c)
    chooser = AutoK(k_max, cost, sampled=sampled)
    chooser.choose()
    for _ in range(40):  # two drafts accepted per round
        chooser.observe(k_max, 2, 5.0)
    picks, longs = [], []
    for i in range(LONG_PROBE_EVERY * 7 + 1):
        picks.append(chooser.choose())
        if picks[-1] == 5 or chooser.whole_block:
            longs.append(i)
        unverified = [1] * (k_max - picks[-1]) if chooser.whole_block else None
        chooser.observe(picks[-1], min(picks[-1], 2), 1.2 if picks[-1] == 2 else 5.0, [0] * 3, unverified)
    assert set(picks) == ({2, 5} if sampled else {2})
    assert longs == [LONG_PROBE_EVERY - 1, 3 * LONG_PROBE_EVERY - 1, 7 * LONG_PROBE_EVERY - 1]
