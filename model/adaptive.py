"""k chosen every round ("auto"): the draft count that maximises expected committed tokens per second.

A round with k drafts commits E(k) = 1 + sum_{j<=k} S_j tokens on average, where S_j is the
probability that at least j drafts are accepted (docs/dflash.md 5), and costs
C(k) seconds on this machine (C(0): an autoregressive step; C(k >= 1): a drafter pass and a
(k+1)-row verification). The engine picks the k, 0 included, with the largest E(k) / C(k).

Both are estimated online from the rounds the engine runs anyway:
- ``AcceptanceEstimate`` (per request): decayed counts of the rounds that accepted at least j
  drafts, shrunk toward the prior PRIOR_ACCEPT ** j.
- ``RoundCost`` (per Engine: a property of the pair, the machine, the tier and the threads): the
  lower envelope of the times of the rounds run at each k, greedy rounds of a fixed k included,
  interpolated between them and the autoregressive step (a least-squares line, tried first,
  extrapolated its early noisy points to k = 15 at 1.4x the real cost).
Until both an AR step and a draft round have been timed, ``AutoK.choose`` explores: the longest k
first, then one AR step; after that it takes the best k, with probes out of long autoregressive
stretches (``AutoK``).
"""

from __future__ import annotations

import numpy as np

PRIOR_ACCEPT = 0.8  # optimistic: unexplored positions look worth a try
PRIOR_WEIGHT = 2.0  # pseudo-rounds behind the prior
DECAY = 0.97  # per drafting round: about the last 30 drafting rounds carry the estimate
PROBE_EVERY = 8  # autoregressive steps in a row before one drafting round is tried anyway
PROBE_MAX = 128  # the interval doubles after each probe that changes nothing, up to this


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

    @property
    def survival(self) -> np.ndarray:
        return (self.hits + PRIOR_WEIGHT * self.prior) / (self.trials + PRIOR_WEIGHT)

    def observe(self, k: int, accepted: int) -> None:
        """A round drafted k tokens and accepted the first `accepted`. An autoregressive step (k = 0)
        says nothing about acceptance and changes nothing."""
        if k <= 0:
            return
        self.hits *= self.decay
        self.trials *= self.decay
        self.trials[:k] += 1.0
        self.hits[:accepted] += 1.0

    def expected_tokens(self, survival=None) -> np.ndarray:
        """E(k) for k = 0..k_max: tokens a round commits (the bonus / target token included)."""
        s = self.survival if survival is None else survival
        return np.concatenate(([1.0], 1.0 + np.cumsum(s)))


class RoundCost:
    """C(k) seconds per round on this machine, per k actually run (0 = an AR step).

    Timing on a shared machine only ever adds time (a descheduled thread, a cold cache, the first
    call's set-up), so the estimate follows the lower envelope of the observations: a faster round
    pulls it halfway down at once, a slower one a tenth of the way up (and counts as at most twice
    the estimate). A decayed mean kept the first, cold round's time for dozens of rounds.

    A k not run yet costs the line between its nearest neighbours run, the autoregressive step
    (k = 0) counting as one (flat above the largest k). Below the smallest k run that is
    optimistic, since a drafting round also pays the drafter, so a short k gets tried once and then
    costs what it measured. (Flat below the smallest k, as before, priced every k at the cost of
    the longest one, which a request runs first: auto never tried the short k that paid. On
    SmolLM2-135M k = 2 ran 1.53x autoregressive and auto 1.02x, mostly autoregressive steps.)
    """

    def __init__(self, k_max: int = 64):
        self.est = np.full(k_max + 1, np.nan)

    def observe(self, k: int, seconds: float) -> None:
        if not (seconds > 0 and np.isfinite(seconds)) or not 0 <= k < len(self.est):
            return
        e = self.est[k]
        if not e == e:  # first time
            self.est[k] = seconds
        elif seconds < e:
            self.est[k] = 0.5 * (e + seconds)
        else:
            self.est[k] = e + 0.1 * (min(seconds, 2.0 * e) - e)

    @property
    def ar_timed(self) -> bool:
        return bool(self.est[0] == self.est[0])

    @property
    def draft_timed(self) -> bool:
        return bool(np.isfinite(self.est[1:]).any())

    def costs(self, k_max: int) -> np.ndarray:
        """C(k) for k = 0..k_max (needs an AR step and a drafting round timed)."""
        seen = np.flatnonzero(np.isfinite(self.est[: k_max + 1]))  # 0 (the AR step) among them
        return np.interp(np.arange(k_max + 1), seen, self.est[seen])  # flat above the largest k


class AutoK:
    """The choice of k for one request: the argmax of E(k) / C(k) under the current estimates.

    An autoregressive step says nothing about acceptance, so once the estimate favours k = 0 it
    would never learn that drafting pays again: after PROBE_EVERY autoregressive steps in a row,
    one round drafts the best k > 0 anyway. A probe after which k = 0 still wins doubles the
    interval (up to PROBE_MAX): where drafts never pay (sampling at T = 0.7 on the shipped pair),
    a fixed interval of 8 cost a drafting round per 8 steps, ~20% of the time. (Thompson sampling,
    tried instead, kept choosing autoregressive steps from pessimistic draws: 2245 against 2812
    tokens/s for k = 15 on the shipped pair's held-out prompts.)
    """

    def __init__(self, k_max: int, cost: RoundCost, prior=None):
        self.k_max, self.cost = k_max, cost
        self.acceptance = AcceptanceEstimate(k_max, prior)
        self.ar_run = 0
        self.rounds = 0
        self.interval = PROBE_EVERY
        self.probing = False

    def choose(self) -> int:
        self.rounds += 1
        if self.rounds == 1 or not self.cost.draft_timed:
            # a request starts with the longest k: it shows this request's acceptance at every
            # position and keeps C(k_max) current (the lower envelope only learns from rounds run)
            return self.k_max
        if not self.cost.ar_timed:
            return 0  # one autoregressive step, to know what a round must beat
        rate = self.acceptance.expected_tokens() / self.cost.costs(self.k_max)
        k = int(np.argmax(rate))
        if self.probing:  # the round after a probe: did it change the decision?
            self.probing = False
            self.interval = PROBE_EVERY if k > 0 else min(2 * self.interval, PROBE_MAX)
        if k == 0:
            self.ar_run += 1
            if self.ar_run >= self.interval:
                self.ar_run, self.probing = 0, True
                k = 1 + int(np.argmax(rate[1:]))
        else:
            self.ar_run = 0
        return k

    def observe(self, k: int, accepted: int, seconds: float) -> None:
        self.acceptance.observe(k, accepted)
        if self.rounds > 1:  # the first round after a prefill runs on cold caches: not a cost of k
            self.cost.observe(k, seconds)
