"""The contention governor: default threads shrink while other processes take the cores."""

import os
import subprocess
import sys
import time

import pytest

from dflash_kernels._threads import ContentionGovernor
from dflash_kernels.model import load

HERE = os.path.dirname(__file__)
STDLIB_PAIR = os.path.join(HERE, "..", "model", "default")


def test_decide_shrinks_under_contention_and_probes_back_with_backoff(tmp_path):
    g = ContentionGovernor(4, window_s=0.1, busy=0.1, probe_s=1.0, max_probe_s=4.0, path=str(tmp_path / "none"))
    assert not g.enabled  # no schedstat here: the count stays
    assert g.update() == 4
    n = g.decide(4, 0.3, now=10.0)
    assert n == 3
    assert g.decide(3, 0.3, now=10.1) == 2  # still taken: one more down
    assert g.decide(2, 0.0, now=10.2) == 2  # free, but the probe waits probe_s
    assert g.decide(2, 0.0, now=11.2) == 3  # the try
    assert g.decide(3, 0.4, now=11.3) == 2  # it failed: back down, next try after twice the wait
    assert g.decide(2, 0.0, now=12.4) == 2
    assert g.decide(2, 0.0, now=13.4) == 3  # 2 s after the failure
    assert g.decide(3, 0.5, now=13.5) == 2
    assert g.decide(2, 0.0, now=17.0) == 2  # backoff now 4 s (the cap)
    assert g.decide(2, 0.0, now=17.6) == 3
    assert g.decide(3, 0.0, now=17.7) == 4  # the cores came back: up to n_max
    assert g.decide(4, 0.0, now=17.8) == 4 and g._backoff == 1.0  # and the backoff starts over
    assert g.decide(1, 0.9, now=20.0) == 1  # never below one thread


def test_update_reads_the_run_delay(tmp_path):
    stat = tmp_path / "schedstat"
    stat.write_text("100 0 5\n")
    g = ContentionGovernor(2, window_s=0.0, path=str(stat))
    assert g.enabled
    time.sleep(0.01)
    assert g.update() == 2  # no delay
    stat.write_text(f"100 {10**9} 5\n")  # a second of waiting within ~0 s of wall time
    time.sleep(0.01)
    assert g.update() == 1
    stat.write_text("garbage")
    assert g.update() == 1  # unreadable: no change
    g.window_s = 3600.0
    stat.write_text(f"100 {10**12} 5\n")
    assert g.update() == 1 and g._last[1] == 1.0  # within the window: not even read


def test_explicit_threads_are_kept():
    eng = load(os.path.join(STDLIB_PAIR, "target"), None, n_threads=2)
    assert eng.ops.governor is None
    assert eng.ops.adapt_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux schedstat and 2 CPUs")
def test_default_threads_shrink_beside_busy_processes():
    eng = load(os.path.join(STDLIB_PAIR, "target"), os.path.join(STDLIB_PAIR, "drafter"))
    g = eng.ops.governor
    assert g is not None and g.enabled and g.n == g.n_max >= 2
    seen = []
    decide = g.decide
    g.decide = lambda n, frac, now: seen.append(decide(n, frac, now)) or seen[-1]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count())]
    try:
        time.sleep(0.2)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3.0 and not any(n < g.n_max for n in seen):
            eng.generate("def f(x):", 32)
    finally:
        for p in busy:
            p.kill()
    assert any(n < g.n_max for n in seen), f"never shrank: {seen}"
