"""Tokens/s of a shipped pair per decoding mode, with whatever kernels this process imports: for
comparing two builds of the kernels on a noisy machine, run alternately, several times each.

    git worktree add /tmp/old <commit> && (cd /tmp/old && DFLASH_TIERS=avx2 python setup.py -q build_ext --inplace)
    for i in 1 2 3 4; do
        python bench/pair_tokens.py --model stdlib --ks 0,8
        PYTHONPATH=/tmp/old python bench/pair_tokens.py --model stdlib --ks 0,8   # the old kernels
    done

(With PYTHONPATH=<worktree>, `dflash_kernels` comes from the worktree and the model layer from this
checkout, so only the kernels differ.) Greedy, the first --n-prompts held-out prompts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="stdlib", choices=("stdlib", "smollm2"))
    ap.add_argument("--ks", default="0,auto", help="comma-separated modes: 0 (autoregressive), a k, or auto")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-vocab", default="on", choices=("on", "off"),
                    help="use the drafter's draft_vocab.json when it has one (model/draft_vocab.py)")
    args = ap.parse_args(argv)

    import dflash_kernels
    from dflash_kernels.model.benchmark import load_prompts
    from dflash_kernels.model.defaults import load_default

    eng = load_default(args.model, n_threads=args.threads, draft_vocab=args.draft_vocab == "on")
    prompts = load_prompts(None, args.n_prompts, eng)
    eng.generate(prompts[0], 8, num_speculative_tokens=0)  # warm-up
    rates = []
    for mode in args.ks.split(","):
        k = mode if mode == "auto" else int(mode)
        tokens, seconds, accepted, rounds = 0, 0.0, 0, 0
        for p in prompts:
            res = eng.generate(p, args.max_new_tokens, num_speculative_tokens=k)
            tokens, seconds = tokens + len(res.token_ids), seconds + res.metrics.total_s
            accepted, rounds = accepted + sum(res.metrics.accepted), rounds + res.metrics.rounds
        rates.append(f"k={mode}: {tokens / seconds:.1f} tokens/s (tau {1 + accepted / max(rounds, 1):.2f})")
    vocab = "" if eng.drafter is None or eng.drafter.draft_ids is None else \
        f", drafting vocabulary {len(eng.drafter.draft_ids)}"
    print(f"{Path(dflash_kernels.__file__).parent.parent}{vocab}: " + ", ".join(rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
