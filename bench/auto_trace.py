"""What "auto" (model/adaptive.py) chooses, round by round: for finding why it loses to a fixed k.

    python bench/auto_trace.py --model stdlib --n-prompts 8 --repeats 2 [--temperature 0.7] [--fixed 15]
    git show <commit>:model/adaptive.py > /tmp/adaptive_old.py
    python bench/auto_trace.py --adaptive /tmp/adaptive_old.py ...   # another version's choices

One Engine of a shipped pair; per prompt, "auto" and then any --fixed k. Prints per prompt the tokens/s
and tau of each, auto's k of every round (hex digits, 0 = an autoregressive step), and at the end the
Engine's round-cost estimates C(k) (RoundCost.est, ms): the fastest recent round timed at each k.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from auto_ab import load_adaptive  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="stdlib", choices=("stdlib", "smollm2"))
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--fixed", default="", help="comma-separated fixed k to run after each auto run")
    ap.add_argument("--adaptive", help="another version's model/adaptive.py to trace instead of this one")
    ap.add_argument("--gguf-dtype", default="blocks-int8", choices=("blocks-int8", "blocks", "bfloat16", "float32"),
                    help="SmolLM2's GGUF weights: expanded, or read as stored (model.load's gguf_dtype)")
    args = ap.parse_args(argv)

    from dflash_kernels.model import adaptive

    if args.adaptive:
        adaptive = load_adaptive(args.adaptive)
    from dflash_kernels.model.benchmark import load_prompts
    from dflash_kernels.model.defaults import load_default

    choices = []

    class Traced(adaptive.AutoK):
        def choose(self) -> int:
            choices.append(super().choose())
            return choices[-1]

    from dflash_kernels.model import engine

    original, engine.AutoK = engine.AutoK, Traced
    eng = load_default(args.model, n_threads=args.threads,
                       **({"gguf_dtype": args.gguf_dtype} if args.model == "smollm2" else {}))
    eng.round_cost = adaptive.RoundCost(eng.default_num_speculative_tokens)
    prompts = load_prompts(None, args.n_prompts, eng)
    fixed = [int(k) for k in args.fixed.split(",") if k]
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            runs = []
            for k in ["auto", *fixed]:
                choices.clear()
                r = eng.generate(p, args.max_new_tokens, num_speculative_tokens=k, temperature=args.temperature,
                                 seed=rep * len(prompts) + i)
                runs.append(f"{k}: {r.metrics.tokens_per_second:.1f} tok/s, tau {r.metrics.tau:.2f}")
                if k == "auto":
                    seq = "".join(f"{c:x}" for c in choices)
            print(f"repeat {rep} prompt {i}: " + " | ".join(runs) + f"\n  auto's k: {seq}")
    est = eng.round_cost.est
    print("C(k) ms:", {k: round(float(v) * 1e3, 3) for k, v in enumerate(est) if v == v})
    engine.AutoK = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
