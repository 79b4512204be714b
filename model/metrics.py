"""Speculative decoding metrics (docs/dflash.md 5), per generate() call and aggregated over calls.

tau = mean over rounds of (accepted drafts + 1); acceptance rate = accepted / drafted;
per-position acceptance = fraction of the rounds that drafted position i in which it was accepted;
tokens/s excludes the time to first token (prefill + first sample). ``overhead_s`` is round time
spent outside kernel calls (Python bookkeeping), the figure to keep small on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    accepted: list = field(default_factory=list)  # per round: accepted drafts a
    drafted: list = field(default_factory=list)  # per round: drafts proposed k (0 on AR steps)
    prefill_s: float = 0.0  # prefill + first token = time to first token
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward on k+1 rows + target choice (argmax or logits)
    accept_s: float = 0.0  # acceptance kernel + commit, cache cut, drafter context append
    total_s: float = 0.0
    kernel_s: float = 0.0  # time inside dk kernel calls during the rounds
    calls: int = 1

    # -- derived ------------------------------------------------------------------------------

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (accepted + 1)."""
        return float(np.mean(self.accepted) + 1.0) if self.accepted else float("nan")

    @property
    def acceptance_rate(self) -> float:
        d = sum(self.drafted)
        return sum(self.accepted) / d if d else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        if not self.drafted:
            return []
        acc, dr = np.asarray(self.accepted), np.asarray(self.drafted)
        out = []
        for i in range(int(dr.max())):
            n = int((dr > i).sum())
            out.append(float(((acc > i) & (dr > i)).sum() / n) if n else float("nan"))
        return out

    @property
    def k_histogram(self) -> dict[int, int]:
        """{drafts in a round: number of rounds} (0: autoregressive steps); with
        num_speculative_tokens="auto" the k the engine chose each round."""
        vals, counts = np.unique(np.asarray(self.drafted, dtype=np.int64), return_counts=True)
        return {int(v): int(c) for v, c in zip(vals, counts, strict=True)}

    @property
    def tau_histogram(self) -> dict[int, int]:
        """{tokens committed in a round: number of rounds}."""
        vals, counts = np.unique(np.asarray(self.accepted, dtype=np.int64) + 1, return_counts=True)
        return {int(v): int(c) for v, c in zip(vals, counts, strict=True)}

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens after the first, per second of decoding (time to first token excluded)."""
        n = self.generated_tokens - self.calls
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")

    @property
    def ms_per_token(self) -> float:
        """Decode cost per generated token (the inverse of tokens_per_second), in milliseconds."""
        tps = self.tokens_per_second
        return 1e3 / tps if tps == tps and tps > 0 else float("nan")

    @property
    def overhead_s(self) -> float:
        """Round time outside kernel calls."""
        return max(0.0, self.draft_s + self.verify_s + self.accept_s - self.kernel_s)

    @property
    def overhead_per_round_us(self) -> float:
        return 1e6 * self.overhead_s / self.rounds if self.rounds else float("nan")

    def merge(self, other: Metrics) -> Metrics:
        """Aggregate of two runs (rounds pooled, times summed)."""
        return Metrics(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            generated_tokens=self.generated_tokens + other.generated_tokens,
            accepted=self.accepted + other.accepted,
            drafted=self.drafted + other.drafted,
            prefill_s=self.prefill_s + other.prefill_s,
            draft_s=self.draft_s + other.draft_s,
            verify_s=self.verify_s + other.verify_s,
            accept_s=self.accept_s + other.accept_s,
            total_s=self.total_s + other.total_s,
            kernel_s=self.kernel_s + other.kernel_s,
            calls=self.calls + other.calls,
        )

    def summary(self) -> dict:
        """Plain dict for logging / JSON."""
        return {
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "tau_histogram": self.tau_histogram,
            "tokens_per_second": self.tokens_per_second,
            "ms_per_token": self.ms_per_token,
            "time_to_first_token_s": self.prefill_s / self.calls if self.calls else float("nan"),
            "time_s": {
                "prefill": self.prefill_s, "draft": self.draft_s, "verify": self.verify_s,
                "accept": self.accept_s, "total": self.total_s,
            },
            "kernel_s": self.kernel_s,
            "overhead_s": self.overhead_s,
            "overhead_per_round_us": self.overhead_per_round_us,
        }


def aggregate(metrics) -> Metrics:
    """Pool several runs' metrics into one."""
    metrics = list(metrics)
    if not metrics:
        return Metrics(calls=0)
    out = metrics[0]
    for m in metrics[1:]:
        out = out.merge(m)
    return out


def speedup(tau: float, t_ar: float, t_draft: float, t_verify: float, t_accept: float) -> float:
    """docs/dflash.md 5: speedup(k) = tau(k) * T_ar / (T_draft + T_verify(k) + T_accept).

    Times are per round/step."""
    return tau * t_ar / (t_draft + t_verify + t_accept)
