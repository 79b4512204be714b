"""End-to-end benchmarks of the engine: autoregressive vs DFlash (`dflash bench`) and the k sweep
(`dflash tune`). AR and DFlash run prompt by prompt, side by side, through the same engine and kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dflash_kernels.runtime import user_cache_dir

from .metrics import aggregate


def load_prompts(prompts_file=None, n_prompts: int = 8, eng=None) -> list[str]:
    """Prompts from a file (JSON list of strings, or one prompt per line), else held-out ones: for an
    engine whose target has a chat template (an instruct model), held-out chat requests
    (model/prompts.py) through that template, else held-out stdlib source."""
    if prompts_file is None:
        if eng is not None and eng.chat_template is not None:
            from .prompts import chat_prompts

            return [eng.chat_prompt(p) for p in chat_prompts("eval", n_prompts)]
        from .corpus import eval_prompts

        return eval_prompts(n_prompts)
    path = Path(prompts_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: a JSON prompts file must hold a list of strings")
    except json.JSONDecodeError:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts[:n_prompts] if n_prompts else prompts


def _run(eng, prompts, max_new_tokens, temperature, k, seed):
    # A chat model's answer ends at its stop token, as a user sees it; source continuations run to
    # max_new_tokens (the stdlib pair has no natural end).
    ignore_eos = eng.chat_template is None
    results = [eng.generate(p, max_new_tokens, temperature=temperature, seed=seed + i,
                            num_speculative_tokens=k, ignore_eos=ignore_eos) for i, p in enumerate(prompts)]
    return results


def _row(mode, temperature, k, metrics) -> dict:
    s = metrics.summary()
    return {"mode": mode, "temperature": temperature, "num_speculative_tokens": k, **s}


def run_environment(eng) -> dict:
    """What a figure depends on besides the code: the machine, the ISA tier and backend that ran,
    the threads, the precision and the versions (recorded in bench.json)."""
    import numba
    import torch

    import dflash_kernels as dk
    from dflash_kernels import runtime

    ops = eng.ops
    return {"threads": ops.kw["n_threads"], "backend": ops.kw["backend"], "precision": ops.precision,
            "draft_precision": _draft_precision(eng), "kv_dtype": getattr(eng, "kv_dtype", "float32"),
            "machine": {**runtime.machine(), "tier": ops.tier},
            "versions": {"dflash_kernels": dk.__version__, "numpy": np.__version__, "numba": numba.__version__,
                         "torch": torch.__version__}}


def run_bench(eng, *, prompts_file=None, n_prompts=8, max_new_tokens=128, temperatures=(0.0, 0.7),
              num_speculative_tokens=None, out_dir=None, seed=0, sweep_ks=(1, 2, 4, 8, 12, 15, "auto")) -> dict:
    """AR vs DFlash per temperature (+ a greedy throughput-vs-k sweep); returns rows and markdown."""
    if eng.drafter is None:
        raise ValueError("dflash bench compares autoregressive with DFlash: load a drafter")
    prompts = load_prompts(prompts_file, n_prompts, eng)
    eng.generate(prompts[0], 8, num_speculative_tokens=num_speculative_tokens)  # warm-up: JIT caches, buffers
    rows, lossless = [], {}
    for temp in temperatures:
        # None: what `dflash generate` drafts at this temperature as a user runs it, without a seed (the
        # tuned k, else auto). The seeds below only make the autoregressive rows repeatable; seeded
        # generate's own default (block_size - 1, for reproducible sampled tokens) ran SmolLM2 at
        # T = 0.7 at 0.46x autoregressive where auto ran 1.15x (Zen 4, docs/benchmarks.md session 16).
        k = eng.default_speculative_tokens(temp) if num_speculative_tokens is None else num_speculative_tokens
        ar, sd = [], []
        for i, p in enumerate(tqdm(prompts, desc=f"bench T={temp}", leave=False)):
            ar += _run(eng, [p], max_new_tokens, temp, 0, seed + i)
            sd += _run(eng, [p], max_new_tokens, temp, k, seed + i)
        if temp == 0.0:
            lossless[temp] = all(a.token_ids == s.token_ids for a, s in zip(ar, sd, strict=True))
        m_ar, m_sd = aggregate(r.metrics for r in ar), aggregate(r.metrics for r in sd)
        rows.append(_row("autoregressive", temp, 0, m_ar))
        rows.append(_row("dflash", temp, k, m_sd))
        rows[-1]["speedup"] = m_sd.tokens_per_second / m_ar.tokens_per_second
        rows[-1]["k_histogram"] = m_sd.k_histogram  # rounds per k (several with "auto")
    sweep = []
    if sweep_ks:
        sub = prompts[: max(1, len(prompts) // 2)]
        ks = [x for x in sweep_ks if x == "auto" or x <= eng.default_num_speculative_tokens]
        for kk in tqdm(ks, desc="k sweep", leave=False):
            m = aggregate(r.metrics for r in _run(eng, sub, max_new_tokens, 0.0, kk, seed))
            sweep.append({"k": kk, "tokens_per_second": m.tokens_per_second, "tau": m.tau,
                          "acceptance_rate": m.acceptance_rate})
    report = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "rows": rows, "greedy_identical": lossless,
              "k_sweep": sweep, **run_environment(eng)}
    report["markdown"] = bench_markdown(report)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({k: v for k, v in report.items() if k != "markdown"}, indent=2,
                                                   default=float) + "\n")
        (out / "bench.md").write_text(report["markdown"] + "\n")
        plot_bench(report, out)
    return report


def bench_markdown(report: dict) -> str:
    lines = ["| mode | T | k | tokens/s | speedup | tau | acceptance | overhead/round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
        tau = f"{r['tau']:.2f}" if r["mode"] == "dflash" else "1"
        acc = f"{r['acceptance_rate']:.1%}" if r["mode"] == "dflash" else "-"
        lines.append(f"| {r['mode']} | {r['temperature']} | {r['num_speculative_tokens']} | "
                     f"{r['tokens_per_second']:.1f} | {sp} | {tau} | {acc} | {r['overhead_per_round_us']:.0f} us |")
    for _temp, same in report["greedy_identical"].items():
        lines.append(f"\ngreedy DFlash output identical to autoregressive: {same}")
    if report["k_sweep"]:
        lines += ["", "| k | tokens/s | tau | acceptance |", "|---|---|---|---|"]
        lines += [f"| {s['k']} | {s['tokens_per_second']:.1f} | {s['tau']:.2f} | {s['acceptance_rate']:.1%} |"
                  for s in report["k_sweep"]]
    return "\n".join(lines)


def plot_bench(report: dict, out: Path) -> list[Path]:
    """tau histogram, per-position acceptance, throughput vs k (PNG); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    dflash_rows = [r for r in report["rows"] if r["mode"] == "dflash"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in dflash_rows:
        hist = {int(k): v for k, v in r["tau_histogram"].items()}
        xs = np.arange(1, max(hist) + 1)
        ax.bar(xs + (0.4 if r["temperature"] else 0.0), [hist.get(x, 0) for x in xs], width=0.4,
               label=f"T={r['temperature']} (tau {r['tau']:.2f})")
    ax.set(xlabel="tokens committed per round", ylabel="rounds", title="DFlash acceptance length")
    ax.legend()
    paths.append(out / "tau_histogram.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in dflash_rows:
        ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                label=f"T={r['temperature']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", title="per-position acceptance", ylim=(0, 1))
    ax.legend()
    paths.append(out / "per_position_acceptance.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    if report["k_sweep"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        fixed = [s for s in report["k_sweep"] if s["k"] != "auto"]
        ax.plot([s["k"] for s in fixed], [s["tokens_per_second"] for s in fixed], marker="o", label="DFlash, fixed k")
        # the sweep is greedy; the greedy autoregressive line exists only when T = 0 was asked for
        ar = next((r for r in report["rows"] if r["mode"] == "autoregressive" and r["temperature"] == 0.0), None)
        if ar is not None:
            ax.axhline(ar["tokens_per_second"], color="gray", ls="--", label="autoregressive")
        for s in report["k_sweep"]:
            if s["k"] == "auto":
                ax.axhline(s["tokens_per_second"], color="green", ls=":", label="DFlash, k auto")
        ax.set(xlabel="num_speculative_tokens", ylabel="tokens/s", title="throughput vs k (greedy)")
        ax.legend()
        paths.append(out / "throughput_vs_k.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close("all")
    return paths


# ------------------------------------------------------------------------------------------ tuning
def tuned_path() -> Path:
    return user_cache_dir() / "tuned.json"


def _tune_key(eng) -> str:
    """The pair, and what decides a round's cost here: the threads asked for (default threads count
    as the CPUs, whatever the contention governor runs at the moment), the ISA tier and the matmul
    precision and KV cache storage (a k tuned on AMX is too long for the same pair capped to AVX2)."""
    ops = eng.ops
    tier = ops.tier or ops.kw["backend"]  # numba / torch have no Cython tier
    threads = ops.governor.n_max if ops.governor is not None else ops.kw["n_threads"]
    return (f"{getattr(eng, 'target_dir', '?')}|{getattr(eng, 'drafter_dir', '?')}|threads={threads}"
            f"|tier={tier}|precision={ops.precision}|draft={_draft_precision(eng)}"
            f"|kv={getattr(eng, 'kv_dtype', 'float32')}")


def _draft_precision(eng) -> str | None:
    drafter = getattr(eng, "drafter", None)
    return None if drafter is None else drafter.ops.precision


def tuned_num_speculative_tokens(eng) -> int | None:
    """The k `dflash tune` measured best for this pair and thread count on this machine, if any (0:
    no k beat autoregressive decoding there)."""
    try:
        return int(json.loads(tuned_path().read_text())[_tune_key(eng)]["best_k"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


LOAD_SPREAD = 0.25  # autoregressive tokens/s measured before and after the sweep may differ this much


def run_tune(eng, *, n_prompts=4, max_new_tokens=96, ks=range(1, 16), save=True, prompts=None, seed=0,
             max_spread: float = LOAD_SPREAD) -> dict:
    """Sweep k by measured greedy throughput (not acceptance rate, which falls with k). best_k is 0
    when no k beats autoregressive decoding; nothing is stored when the autoregressive speed measured
    before and after the sweep differs by more than max_spread (a busy machine). The result says why
    in "warnings" and where it stored the profile in "stored_in"."""
    if eng.drafter is None:
        raise ValueError("dflash tune needs a drafter")
    prompts = prompts or load_prompts(None, n_prompts, eng)
    ks = [k for k in ks if 1 <= k <= eng.default_num_speculative_tokens]
    eng.generate(prompts[0], 8)  # warm-up
    ar = aggregate(r.metrics for r in _run(eng, prompts, max_new_tokens, 0.0, 0, seed))
    sweep = []
    for k in tqdm(ks, desc="tune k", leave=False):
        m = aggregate(r.metrics for r in _run(eng, prompts, max_new_tokens, 0.0, k, seed))
        sweep.append({"k": k, "tokens_per_second": m.tokens_per_second, "tau": m.tau,
                      "acceptance_rate": m.acceptance_rate, "speedup": m.tokens_per_second / ar.tokens_per_second})
    # the same autoregressive run again: a machine busy with other work shows as a spread between the
    # two, and a k measured then would describe the load, not the pair
    ar2 = aggregate(r.metrics for r in _run(eng, prompts, max_new_tokens, 0.0, 0, seed))
    spread = abs(ar2.tokens_per_second - ar.tokens_per_second) / max(ar.tokens_per_second, ar2.tokens_per_second)
    best = max(sweep, key=lambda s: s["tokens_per_second"])
    ar_tps = max(ar.tokens_per_second, ar2.tokens_per_second)
    warnings = []
    if best["tokens_per_second"] <= ar_tps:
        warnings.append(f"no k beat autoregressive decoding ({ar_tps:.1f} tokens/s against "
                        f"{best['tokens_per_second']:.1f} at k={best['k']}): storing 0, generate will not draft")
    best_k = best["k"] if best["tokens_per_second"] > ar_tps else 0
    if spread > max_spread:
        warnings.append(f"autoregressive speed moved by {spread:.0%} during the sweep (busy machine?): "
                        "not stored; run dflash tune again when the machine is idle")
        save = False
    result = {"best_k": best_k, "ar_tokens_per_second": ar.tokens_per_second,
              "ar_tokens_per_second_after": ar2.tokens_per_second, "sweep": sweep, "warnings": warnings,
              "stored_in": None}
    lines = ["| k | tokens/s | speedup | tau | acceptance |", "|---|---|---|---|---|"]
    lines += [f"| {s['k']} | {s['tokens_per_second']:.1f} | {s['speedup']:.2f}x | {s['tau']:.2f} | "
              f"{s['acceptance_rate']:.1%} |" for s in sweep]
    result["markdown"] = (f"autoregressive: {ar.tokens_per_second:.1f} tokens/s (again after the sweep: "
                          f"{ar2.tokens_per_second:.1f})\n\n" + "\n".join(lines))
    if save:
        path = tuned_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        result["stored_in"] = str(path)
        table[_tune_key(eng)] = {k: v for k, v in result.items() if k != "markdown"}
        path.write_text(json.dumps(table, indent=2) + "\n")
        eng._tuned_k = None  # generate reads the new value
    return result
