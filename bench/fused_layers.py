"""A target's forward with fused decoder layers against the same model composing the single ops.

One process, one loaded model; the two paths alternate (the model's ``fused_layers`` switch), so
the machine's noise hits both alike. Decode (1 row), verification (16 rows) and a 64-row prefill
chunk after a 64-token prompt, and with --drafter the drafter's 16-row block over that context;
medians over the repeats, and a check that both paths give the same hidden states bit for bit.
A Qwen3.5 hybrid target (its Gated DeltaNet and gated full-attention layers fused) works too: its
cache, whose recurrent states cannot be cropped, is rewound to the prompt's copy instead.

    python bench/fused_layers.py --target model/default/target --drafter model/default/drafter
    python bench/fused_layers.py --target ~/.cache/dflash_kernels/SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter model/default/smollm2-drafter
    python bench/scale.py --shape Qwen3.5-0.8B --keep /tmp/q08 --ks 15 --repeats 1   # writes a random pair
    python bench/fused_layers.py --target /tmp/q08/target --drafter /tmp/q08/drafter --precision medium
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dflash_kernels.model import load
from dflash_kernels.runtime import PRECISIONS


def _rewind(cache, prompt_state) -> None:
    """Back to the 64-token prompt: a KV cache is cut; a hybrid cache gets the prompt's states back."""
    if prompt_state is None:
        cache.truncate(64)
        return
    cache.conv[...], cache.state[...] = prompt_state
    cache.length, cache._rec = 64, None


def _time(t, cache, rows: int, steps: int, prompt_state) -> float:
    """Seconds per forward of `rows` tokens, appended after the 64-token prompt `steps` times."""
    _rewind(cache, prompt_state)
    t0 = time.perf_counter()
    for i in range(steps):
        t.forward(np.arange(rows) + 100 + i, cache, last_only=rows == 1)
        if rows > 1:
            cache.truncate(64 + i + 1)  # verification keeps one row, as an accepted-nothing round
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="model/default/target", help="checkpoint directory or .gguf file")
    ap.add_argument("--drafter", default=None, help="DFlash drafter directory (times its block forward too)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="forwards per timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--precision", default=None, choices=PRECISIONS,
                    help="the target's matmul precision (default: the model's default, \"highest\")")
    a = ap.parse_args(argv)
    eng = load(a.target, a.drafter, n_threads=a.threads, precision=a.precision)
    t, d = eng.target, eng.drafter
    if not t.fused_layers:
        raise SystemExit("this backend has no fused layers (they are Cython's)")
    cache = t.new_cache(64 + a.steps + 64 + 1)
    taps = t.forward(list(range(1, 65)), cache)[1]
    prompt_state = (cache.conv.copy(), cache.state.copy()) if hasattr(cache, "state") else None
    for rows in (1, 16, 64):
        res = {True: [], False: []}
        for _ in range(a.repeats):
            for fused in (True, False):
                t.fused_layers = fused
                res[fused].append(_time(t, cache, rows, a.steps if rows < 64 else max(2, a.steps // 8),
                                        prompt_state))
        outs = []
        for fused in (True, False):
            t.fused_layers = fused
            _rewind(cache, prompt_state)
            outs.append(t.forward(np.arange(rows) + 7, cache)[0])
        t.fused_layers = True
        _report(f"target, {rows:3d} rows", res, outs)
    if d is not None:
        dc = d.new_cache(64 + 16)
        d.add_context(taps, dc)
        res = {True: [], False: []}
        for _ in range(a.repeats):
            for fused in (True, False):
                d.fused_layers = fused
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    d.block_hidden(7, 15, dc)
                res[fused].append((time.perf_counter() - t0) / a.steps)
        outs = []
        for fused in (True, False):
            d.fused_layers = fused
            outs.append(d.block_hidden(7, 15, dc))
        _report("drafter block, 16 rows", res, outs)


def _report(what: str, res: dict, outs: list) -> None:
    f, c = np.median(res[True]) * 1e3, np.median(res[False]) * 1e3
    same = "identical" if np.array_equal(outs[0], outs[1]) else "DIFFERENT"
    print(f"{what}: fused {f:8.3f} ms  composed {c:8.3f} ms  {c / f:5.2f}x  (hidden states {same})")


if __name__ == "__main__":
    main()
