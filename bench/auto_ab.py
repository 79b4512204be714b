"""Two versions of "auto" k (model/adaptive.py) side by side in one process: for tuning the chooser on a
noisy machine, where runs of `dflash bench` one after the other differ by more than the change.

    git show <commit>:model/adaptive.py > /tmp/adaptive_old.py
    python bench/auto_ab.py /tmp/adaptive_old.py --model stdlib --n-prompts 8 --repeats 2

One Engine of a shipped pair; per prompt, an autoregressive run, then "auto" with the other version's
AutoK, then with this checkout's (then any --fixed k), so the machine's noise hits all three alike. Each version keeps
its own RoundCost across the prompts, as an Engine does between requests. Prints tokens/s of each,
its ratio to autoregressive decoding (pooled), and the median over prompt runs of the ratio to the
same prompt's autoregressive run: robust to the bursts of a shared host, which hit neighbouring runs
alike. The order of the modes rotates from one prompt run to the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys


def load_adaptive(path: str):
    """Another version's model/adaptive.py as a module. Its AutoK takes this engine's arguments: a
    version from before AutoK(..., sampled=) (session 20) ignores that one; one from before the
    whole-block probes (session 28) never asks for them and ignores the tokens observe() gets."""
    spec = importlib.util.spec_from_file_location("dflash_kernels.model.adaptive_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if "sampled" not in inspect.signature(module.AutoK).parameters:
        class AutoK(module.AutoK):
            def __init__(self, k_max, cost, prior=None, *, sampled=False):
                super().__init__(k_max, cost, prior)

        module.AutoK = AutoK
    if "committed" not in inspect.signature(module.AutoK.observe).parameters:
        class AutoK(module.AutoK):
            whole_block = False

            def observe(self, k, accepted, seconds, committed=(), unverified=None):
                super().observe(k, accepted, seconds)

        module.AutoK = AutoK
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", help="the other version's model/adaptive.py")
    ap.add_argument("--model", default="stdlib", choices=("stdlib", "smollm2"))
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (each prompt run seeded alike for every mode)")
    ap.add_argument("--fixed", default="", help="comma-separated fixed k to run alongside (e.g. 4,8)")
    ap.add_argument("--floor", action="store_true",
                    help='also run "auto" that never drafts (this version\'s choice replaced by 0): what '
                         "keeping drafting possible costs an autoregressive step (taps, bookkeeping)")
    ap.add_argument("--gguf-dtype", default="blocks-int8", choices=("blocks-int8", "blocks", "bfloat16", "float32"),
                    help="SmolLM2's GGUF weights: expanded, or read as stored (model.load's gguf_dtype)")
    args = ap.parse_args(argv)

    from dflash_kernels.model import adaptive, engine
    from dflash_kernels.model.benchmark import load_prompts
    from dflash_kernels.model.defaults import load_default

    other = load_adaptive(args.other)
    eng = load_default(args.model, n_threads=args.threads,
                       **({"gguf_dtype": args.gguf_dtype} if args.model == "smollm2" else {}))
    prompts = load_prompts(None, args.n_prompts, eng)
    eng.generate(prompts[0], 8, num_speculative_tokens="auto")  # warm-up
    fixed = {f"k={k}": int(k) for k in args.fixed.split(",") if k}
    modes = {"autoregressive": 0, "other": "auto", "this": "auto", **fixed}
    if args.floor:
        modes["auto, never drafting"] = "auto"

    class NeverDrafts(adaptive.AutoK):
        def choose(self) -> int:
            super().choose()
            return 0

    chooser = {"other": other.AutoK, "auto, never drafting": NeverDrafts}
    totals = {name: [0, 0.0] for name in modes}
    k_hist = {name: {} for name in modes}  # rounds per k chosen
    k_max = eng.default_num_speculative_tokens
    costs = {name: (other if name == "other" else adaptive).RoundCost(k_max) for name in modes}
    ratios = {name: [] for name in modes}  # per prompt run: tokens/s against the same prompt's AR run
    names = list(modes)
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            rate = {}
            turn = (rep * len(prompts) + i) % len(names)  # the order rotates: no mode always runs first
            for name in names[turn:] + names[:turn]:
                engine.AutoK = chooser.get(name, adaptive.AutoK)
                eng.round_cost = costs[name]
                res = eng.generate(p, args.max_new_tokens, num_speculative_tokens=modes[name],
                                   temperature=args.temperature, seed=rep * len(prompts) + i)
                totals[name][0] += len(res.token_ids)
                totals[name][1] += res.metrics.total_s
                rate[name] = len(res.token_ids) / res.metrics.total_s
                for kk, n in res.metrics.k_histogram.items():
                    k_hist[name][kk] = k_hist[name].get(kk, 0) + n
            for name in names:
                ratios[name].append(rate[name] / rate["autoregressive"])
    engine.AutoK = adaptive.AutoK
    ar = totals["autoregressive"][0] / totals["autoregressive"][1]
    for name, (tokens, seconds) in totals.items():
        hist = "" if name not in ("other", "this") else f"  rounds per k {dict(sorted(k_hist[name].items()))}"
        print(f"{name}: {tokens / seconds:.1f} tokens/s, {tokens / seconds / ar:.3f}x autoregressive pooled, "
              f"median per prompt run {statistics.median(ratios[name]):.3f}x{hist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
