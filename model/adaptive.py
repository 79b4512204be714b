"""k chosen every round ("auto"): the draft count that maximises expected committed tokens per second.

A round with k drafts commits E(k) = 1 + sum_{j<=k} S_j tokens on average, where S_j is the
probability that at least j drafts are accepted (docs/dflash.md 5), and costs
C(k) seconds on this machine (C(0): an autoregressive step; C(k >= 1): a drafter pass and a
(k+1)-row verification). The engine picks the k, 0 included, with the largest E(k) / C(k).

Both are estimated online from the rounds the engine runs anyway:
- ``AcceptanceEstimate`` (per request): decayed counts of the rounds that accepted at least j
  drafts, each shrunk toward PRIOR_ACCEPT times the estimate at j - 1. (Starting a request from
  the acceptance the last one learnt instead, tried in session 13, cost SmolLM2's auto 10-20%: its
  prompts differ, and a request after a poor one no longer tried the drafts that paid for it.)
  A sampled request does start from the last sampled one's estimate, as its prior: at T > 0 the
  sampling decides most of the acceptance (SmolLM2's int8 blocks at T = 0.7 on a Zen 4's avx2
  tier: `auto` 0.951x -> 0.979x autoregressive; bench/auto_ab.py, session 30).
- ``RoundCost`` (per Engine: a property of the pair, the machine, the tier and the threads): the
  fastest recent round run at each k, greedy rounds of a fixed k included, interpolated between
  them and the autoregressive step (a least-squares line, tried first, extrapolated its early
  noisy points to k = 15 at 1.4x the real cost).
Until both an AR step and a draft round have been timed, ``AutoK.choose`` explores: the longest k
first, then AR steps; after that it takes the best k, with probes out of long autoregressive
stretches and out of long stretches of short rounds, which see the acceptance past the chosen k
(``AutoK``): greedy, a round of a short k whose whole block is drafted, its drafts past k checked
against the tokens the target commits next; sampled, a round of 2 k + 1 drafts. A later request
starts at the k the Engine's last one ended with, not with the longest k again; a greedy one probes
on its own schedule, a sampled one on the schedule the last sampled request reached.
"""

from __future__ import annotations

import math

import numpy as np

PRIOR_ACCEPT = 0.8  # optimistic: unexplored positions look worth a try
PRIOR_WEIGHT = 2.0  # pseudo-rounds behind the prior
DECAY = 0.97  # per drafting round: about the last 30 drafting rounds carry the estimate
PROBE_EVERY = 8  # autoregressive steps in a row before one drafting round is tried anyway
PROBE_MAX = 128  # the interval doubles after each probe that changes nothing, up to this
LONG_PROBE_EVERY = 12  # drafting rounds shorter than k_max in a row before one drafts k_max
LONG_PROBE_MAX = 96  # that interval doubles after each long probe that changes nothing, up to this
WINDOW = 8  # rounds per k behind its cost estimate
AR_TIMINGS = 3  # autoregressive steps timed before auto weighs k against them
DRAFT_TIMINGS = 2  # rounds of a k timed before its own cost replaces its neighbours' (RoundCost.costs)


class AcceptanceEstimate:
    """S_j = P(at least j drafts accepted | a round drafted j or more), j = 1..k_max, from decayed
    counts shrunk toward a prior (PRIOR_ACCEPT ** j unless given). E(k) = 1 + S_1 + ... + S_k.

    Every round that drafted k' >= j tells whether j drafts were accepted, so the shallow positions
    are seen in every round and the deep ones in every long round. (A product of per-position
    conditional estimates, tried first, let the prior decide the deep factors, which short rounds
    seldom reach: it kept drafting at tau 2 where an autoregressive step paid more.)
    """

    def __init__(self, k_max: int, prior=None, decay: float = DECAY):
        self.prior = PRIOR_ACCEPT ** np.arange(1, k_max + 1) if prior is None else np.asarray(prior, np.float64).copy()
        if self.prior.shape != (k_max,):
            raise ValueError(f"prior must have {k_max} entries, got shape {self.prior.shape}")
        self.decay = decay
        self.hits = np.zeros(k_max)
        self.trials = np.zeros(k_max)
        self._expected = None  # expected_list()'s cache

    @property
    def survival(self) -> np.ndarray:
        """S_j, non-increasing in j as a survival is. Position j's counts are shrunk toward
        S_{j-1} times the prior's own ratio at j (PRIOR_ACCEPT): the positions a short k leaves
        unseen continue the acceptance measured where it ran. (Shrunk toward the fixed prior
        PRIOR_ACCEPT ** j, as before session 20, they sank to it while k = 3 rounds accepted all
        their drafts: on the stdlib pair auto then stayed at k = 3 where k = 15 committed 1.3x more
        per second; bench/auto_trace.py.)"""
        hits, trials, prior = self.hits.tolist(), self.trials.tolist(), self.prior.tolist()
        out, before = [], 1.0  # S_{j-1}
        for j, p in enumerate(prior):
            toward = before * p / (prior[j - 1] if j else 1.0)
            before = min(before, (hits[j] + PRIOR_WEIGHT * toward) / (trials[j] + PRIOR_WEIGHT))
            out.append(before)
        return np.array(out)

    def observe(self, k: int, accepted: int) -> None:
        """A round drafted k tokens and accepted the first `accepted`. An autoregressive step (k = 0)
        says nothing about acceptance and changes nothing."""
        if k <= 0:
            return
        self._expected = None
        self.hits *= self.decay
        self.trials *= self.decay
        self.trials[:k] += 1.0
        self.hits[:accepted] += 1.0

    def extend(self, start: int, k: int, accepted: int) -> None:
        """Positions start+1..k of a round already observed, seen later (hindsight, ``AutoK``): they
        count as drafted, and start+1..accepted as accepted, in that round's decayed weight."""
        self._expected = None
        self.trials[start:k] += 1.0
        self.hits[start:accepted] += 1.0

    def expected_tokens(self, survival=None) -> np.ndarray:
        """E(k) for k = 0..k_max: tokens a round commits (the bonus / target token included)."""
        s = self.survival if survival is None else survival
        return np.concatenate(([1.0], 1.0 + np.cumsum(s)))

    def expected_list(self) -> list[float]:
        """expected_tokens() as a list, kept until the next drafting round changes it (an AR step
        does not: the chooser reads it every step)."""
        if self._expected is None:
            self._expected = self.expected_tokens().tolist()
        return self._expected


class RoundCost:
    """C(k) seconds per round on this machine, per k actually run (0 = an AR step): the fastest of
    the last WINDOW rounds run at that k.

    Timing on a shared machine only ever adds time (a descheduled thread, a cold cache, the first
    call's set-up), so the floor of the recent rounds is the round's own cost; the window lets it
    rise when the machine really gets slower. Two estimators before it kept a cold first time too
    long: a decayed mean (for dozens of rounds), then a lower envelope (a faster round pulled it
    halfway down, a slower one a tenth of the way up). On the stdlib pair the first AR step, timed
    right after a drafting round at about twice its steady time, kept the AR step dear under the
    envelope: auto drafted where AR steps paid more, and took none of the AR steps that would
    have corrected the price (bench/auto_ab.py, AMD Zen 2, session 12). The AR step is priced
    only after AR_TIMINGS steps.

    A k not run yet, or run only once while another drafting k has run twice, costs the line
    between its nearest neighbours run (twice), the autoregressive step (k = 0) counting as one
    (flat above the largest k). The stdlib pair on a Xeon with AMX showed why once is not enough:
    after 8 prompts the version before priced k = 15 at 1.68-1.77 ms from its few cold rounds,
    against 1.14-1.20 ms in steady state, and rarely ran it again (0.77x of k = 15 in `dflash bench`;
    bench/auto_trace.py, session 18).
    Below the smallest k run that is optimistic, since a drafting round also pays the drafter, so
    a short k gets tried and then costs what it measured. (Flat below the smallest k, as before,
    priced every k at the cost of the longest one, which a request runs first: auto never tried
    the short k that paid. On SmolLM2-135M k = 2 ran 1.53x autoregressive and auto 1.02x, mostly
    autoregressive steps.)
    """

    def __init__(self, k_max: int = 64):
        self.est = np.full(k_max + 1, np.nan)
        self._recent = [[] for _ in range(k_max + 1)]  # the last WINDOW seconds per k
        self._costs = None  # costs()'s, until an estimate changes
        self.draft_timed = False  # a drafting round (k >= 1) timed
        # the k the Engine's last "auto" request ended with: the next request starts there (AutoK)
        self.last_k: int | None = None
        # the probe interval a sampled request starts with: the last sampled request's (AutoK)
        self.sampled_probe_interval = PROBE_EVERY
        # the last sampled request's acceptance: the next sampled request's prior (AutoK)
        self.sampled_acceptance: AcceptanceEstimate | None = None

    def observe(self, k: int, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)) or not 0 <= k < len(self.est):
            return
        recent = self._recent[k]
        recent.append(seconds)
        if len(recent) > WINDOW:
            del recent[0]
        low = min(recent)
        if low != self.est[k] or len(recent) == DRAFT_TIMINGS:  # (a k's second timing makes it count)
            self.est[k] = low
            self._costs = None
            self.draft_timed = self.draft_timed or k > 0

    @property
    def ar_timed(self) -> bool:
        """Enough autoregressive steps timed to price one: AR_TIMINGS. The first after a drafting
        round runs on caches the round filled (about twice the steady time on the stdlib pair);
        priced at that one step, drafting looked better than it was, and auto never took the
        autoregressive step that would have corrected it."""
        return len(self._recent[0]) >= AR_TIMINGS

    def costs(self, k_max: int) -> list[float]:
        """C(k) for k = 0..k_max (needs an AR step and a drafting round timed). Plain floats, cached
        until an estimate changes: the chooser reads them every step, and on 16 entries numpy's
        per-call cost (np.interp and friends) dominated."""
        if self._costs is not None and len(self._costs) == k_max + 1:
            return self._costs  # no estimate changed since
        est = self.est[: k_max + 1].tolist()
        seen = [k for k, e in enumerate(est) if e == e]  # 0 (the AR step) among them
        # a drafting k timed once counts only while no drafting k has been timed twice: one round
        # may be a cold one, and a k priced too high is never run again to correct it
        settled = [k for k in seen if k == 0 or len(self._recent[k]) >= DRAFT_TIMINGS]
        if len(settled) > 1:
            seen = settled
        out, j = [], 0
        for k in range(k_max + 1):
            while j + 1 < len(seen) and seen[j + 1] <= k:
                j += 1
            a = seen[j]
            if k == a or j + 1 == len(seen):  # run, or above the largest k run: flat
                out.append(est[a])
            else:  # the line between the neighbours run
                b = seen[j + 1]
                out.append(est[a] + (k - a) / (b - a) * (est[b] - est[a]))
        self._costs = out
        return out


class AutoK:
    """The choice of k for one request: the argmax of E(k) / C(k) under the current estimates.

    An autoregressive step says nothing about acceptance, so once the estimate favours k = 0 it
    would never learn that drafting pays again: after PROBE_EVERY autoregressive steps in a row,
    one round drafts anyway (``_probe``), which shows positions past it. (A probe of the best k > 0 under
    the estimate that had just lost to k = 0 was mostly a k = 2 or 3, whose few drafts seldom
    changed the estimate: on the stdlib pair auto spent 600-800 of its 900 rounds on
    autoregressive steps where k = 15 ran 1.6x faster; bench/auto_ab.py, session 20.) A probe
    after which k = 0 still wins doubles the interval (up to PROBE_MAX): where drafts never pay
    (sampling at T = 0.7 on the shipped pair), a fixed interval of 8 cost a drafting round per 8
    steps, ~20% of the time. (Thompson sampling,
    tried instead, kept choosing autoregressive steps from pessimistic draws: 2245 against 2812
    tokens/s for k = 15 on the shipped pair's held-out prompts.) A greedy request starts that
    schedule afresh: carried over from the last request, as before session 18, a poor prompt's
    interval of 32-128 left the next, well-predicted one on autoregressive steps for most of its
    tokens (greedy acceptance differs by prompt: tau 1.0 to 10.6 at k = 15 on the stdlib pair's
    held-out prompts). A sampled request starts with the last sampled request's interval: there
    the sampling decides most of the acceptance. At T = 0.7 on the stdlib pair, where no draft
    pays, the fresh schedule's four failed probes per 128-token request cost 11% against
    autoregressive decoding (bench/auto_ab.py, session 20).

    Likewise a short k says nothing about the positions past it, whose estimate then only decays
    toward the prior: after LONG_PROBE_EVERY drafting rounds shorter than k_max in a row, one round
    sees them all, the interval doubling (up to LONG_PROBE_MAX) after each that changes nothing. On
    the stdlib pair (Xeon with AMX, where k = 15 pays on most prompts) the two changes took auto
    from 1.08x to 1.33x autoregressive (k = 15: 1.49x); on SmolLM2 1.54x to 1.59x (k = 2: 1.54x),
    with `bench/auto_ab.py` (docs/benchmarks.md, session 18).

    Both kinds of probe drafted k_max until session 28 (sampled ones until session 30, now 2 k + 1). A
    greedy probe now runs the best drafting k
    (the chosen k for a long probe) with the whole block drafted (``_probe``): the drafter's pass
    over 16 rows costs little more than over 3, while verifying 16 rows over SmolLM2's GGUF blocks
    costs 4.5 autoregressive steps on a Zen 4. (Drafting the whole block in every round, for the
    drafts' own sake, moved tau by -1% to +8% but ran at 0.76-0.99x the tokens/s for fixed k = 1-8 on
    both shipped pairs: the drafter's extra rows outweigh it; docs/benchmarks.md, session 28.)
    """

    def __init__(self, k_max: int, cost: RoundCost, prior=None, *, sampled: bool = False):
        self.k_max, self.cost, self.sampled = k_max, cost, sampled
        if prior is None and sampled and cost.sampled_acceptance is not None \
                and cost.sampled_acceptance.prior.shape == (k_max,):
            # at T > 0 the sampling decides most of the acceptance: a sampled request starts from
            # what the last one measured (as a prior of PRIOR_WEIGHT rounds), not from the
            # optimistic PRIOR_ACCEPT ** j
            prior = np.maximum(cost.sampled_acceptance.survival, 1e-9)  # (ratios of it are taken)
        self.acceptance = AcceptanceEstimate(k_max, prior)
        if sampled:
            cost.sampled_acceptance = self.acceptance
        self.ar_run = 0  # autoregressive steps since the last drafting round
        self.interval = cost.sampled_probe_interval if sampled else PROBE_EVERY
        self.rounds = 0
        self.probing = False
        self.short_run = 0  # drafting rounds since the last that drafted k_max
        self.long_interval, self.long_probing = LONG_PROBE_EVERY, False
        self._inputs, self._choice, self._rate = (None, None), 0, []  # _best()'s cache
        # greedy: this round is a probe that drafts the whole block and verifies only k (the engine
        # reads it after choose()); its drafts past k wait in _pending for the tokens committed next
        self.whole_block = False
        self._pending: list[tuple[list[int], int, int]] = []  # (drafts past k, how many resolved, k)

    def choose(self) -> int:
        self.rounds += 1
        self.whole_block = False
        if not self.cost.draft_timed or (self.rounds == 1 and self.cost.last_k is None):
            # the Engine's first request starts with the longest k: it shows the acceptance at
            # every position and times C(k_max)
            return self.k_max
        if not self.cost.ar_timed:
            return 0  # autoregressive steps, to know what a round must beat
        best = self._best()
        if self.rounds == 1:  # later requests start where the last one ended
            k = min(self.cost.last_k, self.k_max)
        else:
            k = best
            # once a probe has shown what it will (a greedy one's drafts past k are checked token by
            # token as the target commits them): did it change the decision?
            if self.probing and (k > 0 or not self._pending):
                self.probing = False
                self.interval = PROBE_EVERY if k > 0 else min(2 * self.interval, PROBE_MAX)
                if self.sampled:
                    self.cost.sampled_probe_interval = self.interval
        self.cost.last_k = k
        if k == 0:
            self.ar_run += 1
            if self.ar_run >= self.interval:
                self.ar_run, self.probing = 0, True
                k = self._probe(self._best(drafting=True))
        else:
            self.ar_run = 0
        if self.long_probing:  # the round after a long probe: did it change the decision?
            self.long_probing = False
            grown = min(2 * self.long_interval, LONG_PROBE_MAX)
            self.long_interval = LONG_PROBE_EVERY if best == self.k_max else grown
        if 0 < k < self.k_max:  # positions past k go unseen: now and then a round that sees them all
            self.short_run += 1
            if self.short_run >= self.long_interval:
                self.short_run, self.long_probing, k = 0, True, self._probe(k)
        elif k == self.k_max:
            self.short_run = 0
        return k

    def _best(self, drafting: bool = False) -> int:
        """The argmax over k (k >= 1 if `drafting`) of E(k) / C(k), the first of equal rates as
        np.argmax. Recomputed only when an estimate changed: both inputs are lists cached by their
        owners until then, and most steps (autoregressive ones) change neither."""
        expected, costs = self.acceptance.expected_list(), self.cost.costs(self.k_max)
        if expected is not self._inputs[0] or costs is not self._inputs[1]:
            self._rate = [e / c for e, c in zip(expected, costs, strict=True)]
            self._inputs, self._choice = (expected, costs), max(range(len(self._rate)), key=self._rate.__getitem__)
        if drafting and self._choice == 0:
            return max(range(1, len(self._rate)), key=self._rate.__getitem__)
        return self._choice

    def _probe(self, k: int) -> int:
        """The k of a round that shows the acceptance past k. Greedy: k, with the whole block drafted
        (``whole_block``), whose drafts past k are checked against the tokens the target commits next
        (``observe``): a greedy target commits the same tokens whatever was drafted, so a draft past
        k would have been accepted exactly when it and the drafts before it equal them. A probe then
        costs a round of k and the drafter's longer block, not a round of k_max (4.5 autoregressive
        steps over SmolLM2's GGUF blocks on a Zen 4). Sampled (nothing to check in hindsight: the
        target's tokens depend on the drafts): 2 k + 1 drafts, each probe that changes the decision
        seeing twice as deep as the last. (k_max until session 30: over SmolLM2's GGUF blocks times
        int8 activations, where a k = 15 round costs about 6 autoregressive steps on a Zen 4's avx2
        tier, its probes cost `auto` at T = 0.7 6-8% against autoregressive decoding.)"""
        if self.sampled:
            return min(self.k_max, 2 * k + 1)
        self.whole_block = k < self.k_max
        return k

    def observe(self, k: int, accepted: int, seconds: float, committed=(), unverified=None) -> None:
        """A round drafted k, accepted `accepted` and took `seconds`. committed: the tokens it
        committed (earlier greedy probes' drafts are checked against them); unverified: a
        ``whole_block`` round's drafts past k."""
        self._resolve(committed)  # earlier probes first: this round's tokens follow theirs
        self.acceptance.observe(k, accepted)
        if unverified is not None and len(unverified):
            if accepted < k:  # a longer verification stops at the same rejected draft
                self.acceptance.extend(k, k + len(unverified), accepted)
            else:  # the target's own token after the k accepted drafts checks the first of the rest
                self._pending.append((list(unverified), 0, k))
                self._resolve(committed[-1:])
        elif self.rounds > 1:  # (a cold first round after a prefill, or a probe's longer block: not C(k))
            self.cost.observe(k, seconds)

    def _resolve(self, tokens) -> None:
        """Hindsight for the pending probes' drafts: each matching token in turn is an accepted
        position; the first that does not match fails it and every position after it."""
        if not self._pending or not len(tokens):
            return
        still = []
        for drafts, i, k in self._pending:
            n, m = len(drafts), 0
            while m < len(tokens) and i + m < n and tokens[m] == drafts[i + m]:
                m += 1
            if m:
                self.acceptance.extend(k + i, k + i + m, k + i + m)
            i += m
            if i < n and m < len(tokens):  # drafts[i] is not what the target committed
                self.acceptance.extend(k + i, k + n, k + i)
            elif i < n:
                still.append((drafts, i, k))
        self._pending = still
