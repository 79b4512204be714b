"""Where a prefill's time goes: a target's forward over an N-token prompt, with the time inside each
kernel op (the model layer's Ops) summed per op, as medians over repeats.

    python bench/scale.py --shape Qwen3.5-9B --layers 4 --keep /tmp/q9 ...   # writes the pair once
    python bench/prefill_ops.py /tmp/q9/target --tokens 512 --precision medium

To compare two builds of a tier, run it with each build's modules in place, alternately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", help="a target checkpoint directory")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--precision", default="highest", choices=("highest", "high", "medium"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import numpy as np

    import dflash_kernels as dk
    from dflash_kernels.model import load

    eng = load(args.target, None, n_threads=args.threads, max_len=args.tokens + 64, precision=args.precision,
               fuse_weights=True)
    tgt = eng.target
    ops_class = type(tgt.ops)  # the model layer's timed ops: each op's time added up per name
    per_op = defaultdict(float)

    def timed(name):
        run = getattr(ops_class, name)

        def op(self, *a, **k):
            t = time.perf_counter()
            try:
                return run(self, *a, **k)
            finally:
                per_op[name] += time.perf_counter() - t

        return op

    for name in dk.BoundOps.OPS:
        setattr(ops_class, name, timed(name))
    prompt = np.random.default_rng(0).integers(0, min(151643, tgt.cfg.vocab_size), args.tokens).tolist()
    # one cache, reset between runs: a fresh one per run faults its zeroed pages in during the first
    # writes (the recurrent states of a 9B hybrid are 50 MB), which was counted as the ops' time
    cache = tgt.new_cache(args.tokens + 1, "float32")
    runs = []
    for i in range(args.repeats + 1):  # the first run warms up
        per_op.clear()
        cache.reset()
        t = time.perf_counter()
        tgt.forward(prompt, cache, last_only=True, taps=True)
        if i:
            runs.append((time.perf_counter() - t, dict(per_op)))
    total = statistics.median(r[0] for r in runs)
    print(f"{dk.active_tier()}, {args.precision}, {args.tokens} tokens, {args.threads} threads: forward "
          f"{total * 1e3:.0f} ms (median of {args.repeats}; each run {', '.join(f'{r[0] * 1e3:.0f}' for r in runs)})")
    names = sorted(runs[0][1], key=lambda n: -runs[0][1][n])
    for name in names:
        ms = statistics.median(r[1].get(name, 0.0) for r in runs) * 1e3
        print(f"  {name:24s} {ms:8.1f} ms  ({100 * ms / 1e3 / total:4.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
