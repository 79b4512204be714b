"""Never slower than torch: the linear shapes where torch's own kernel (oneDNN / MKL) wins here.

Our kernels win most shapes on every tier measured (docs/benchmarks.md), but not all: small
matrices, where MKL's fp32 GEMM has less overhead, and tiers where a vendor kernel has an edge. A
rule fixed in code would be right on one CPU and wrong on the next, so the rule is measured:
``tune_linear(shapes)`` times ours against torch for each shape, at this machine's tier, thread
count and precision, and stores the shapes torch wins (by more than 5%) in a per-machine JSON file
(``DFLASH_CACHE_DIR``, default ~/.cache/dflash_kernels). ``linear`` with ``backend="auto"`` and the
model layer then send exactly those shapes to torch; ``show_config()`` lists them.

What torch computes for a delegated shape is the same precision: fp32 weights run fp32 F.linear on
the rounded activations (identical semantics); bf16 weights run torch's bf16 F.linear only for
"medium", whose output torch also rounds to bf16 (one more rounding of 2^-9 relative,
docs/conventions.md). bf16 weights at "high" / "highest" are never delegated: torch has no kernel
for them short of upcasting the whole matrix.
"""

from __future__ import annotations

import json
import statistics
import time
from functools import cache
from pathlib import Path

import numpy as np
import torch

from . import _isa
from ._env import settings_changed, user_cache_dir

M_BUCKETS = (1, 4, 16, 64, 256)  # rows are bucketed: the smallest bucket >= M (the last above it)
MARGIN = 1.05                    # torch must win by more than this to be delegated to


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def cache_file() -> Path:
    return user_cache_dir() / "kernel_autotune.json"


def machine_key(n_threads: int) -> str:
    """What a measurement holds for: this CPU, the active tier, the thread count, the versions."""
    return _machine_key(_isa.active_tier(), n_threads)


@cache
def _machine_key(tier: str | None, n_threads: int) -> str:
    # memoized: linear with backend="auto" asks on every call, and the string is not free to build
    from . import __version__

    return f"{_isa.cpu_model()} | tier {tier} | {n_threads} threads | torch {torch.__version__} | " \
           f"dflash_kernels {__version__}"


def _entry(m: int, n: int, k: int, bf16: bool, parts: int) -> str:
    return f"M{m_bucket(m)} N{n} K{k} {'bf16' if bf16 else 'fp32'} p{parts}"


@cache
def _delegated_set(key: str, stamp: float) -> frozenset[str]:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return frozenset()
    return frozenset(data.get(key, {}).get("torch", ()))


def _stamp() -> float:
    try:
        return cache_file().stat().st_mtime
    except OSError:
        return 0.0


_state = {"stamp": None, "checked": 0.0}


def table_written() -> None:
    """The table file changed in this process: read it again at the next call."""
    _state["stamp"] = None
    settings_changed()  # the public ops' fast path asks has_table() again


def has_table() -> bool:
    """Whether a tuning table exists here (its file's change time, checked once a second)."""
    now = time.monotonic()
    if _state["stamp"] is None or now - _state["checked"] > 1.0:
        _state["stamp"], _state["checked"] = _stamp(), now
    return bool(_state["stamp"])


def delegated_entries(n_threads: int) -> frozenset[str]:
    """The shapes delegated to torch here (re-read when the file changes, checked once a second)."""
    if not has_table():  # never tuned here: nothing to look up, on every linear call
        return frozenset()
    return _delegated_set(machine_key(n_threads), _state["stamp"])


def delegates(m: int, n: int, k: int, bf16: bool, parts: int, n_threads: int) -> bool:
    """True when torch runs this linear faster here (bf16 weights only at parts 1, see above)."""
    if bf16 and parts != 1:
        return False
    entries = delegated_entries(n_threads)
    return bool(entries) and _entry(m, n, k, bf16, parts) in entries


def torch_linear(x: np.ndarray, w: np.ndarray, bias, parts: int, out: np.ndarray, n_threads: int) -> None:
    """The delegate: torch's F.linear at the same precision, written into out (M, N) float32."""
    from ._threads import torch_threads
    from .reference.dense import round_activations

    xt = torch.from_numpy(x)
    with torch_threads(n_threads), torch.no_grad():
        if w.dtype == np.uint16:  # bf16 weights, "medium": torch's bf16 GEMM
            wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
            bt = None if bias is None else torch.from_numpy(bias).bfloat16()
            res = torch.nn.functional.linear(xt.bfloat16(), wt, bt)
        else:
            bt = None if bias is None else torch.from_numpy(bias)
            res = torch.nn.functional.linear(round_activations(xt, parts), torch.from_numpy(w), bt)
        out[...] = res.float().numpy()


def tune_linear(shapes: list, *, m_values: tuple = (1, 16), precision: str | None = None, n_threads: int | None = None,
                rounds: int = 7, save: bool = True) -> list[dict]:
    """Time ours against torch for each (N, K) weight shape, both weight dtypes, each M; store the
    shapes torch wins into the per-machine table. Returns one row per case.

    shapes: (N, K) weight shapes (``Ops.linear_shapes`` of a model); m_values: the row counts M to time
    (decode 1, a verification block 16); precision: as ``linear``; rounds: timed calls per case (the
    median counts); save: write the winners to the table ``linear`` consults."""
    from ._backends import kernel_module
    from ._precision import parts as precision_parts
    from ._threads import resolve_threads

    nt = resolve_threads(n_threads)
    parts = precision_parts(precision)
    dense = kernel_module("dense", "cython")
    rng = np.random.default_rng(0)
    rows = []
    for n, k in sorted(set(map(tuple, shapes))):
        wf = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        wb = (wf.view(np.uint32) >> 16).astype(np.uint16)
        for m in m_values:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), np.float32)
            for w in (wb, wf):
                bf16 = w is wb
                if bf16 and parts != 1:
                    continue
                fns = {"ours": lambda w=w, x=x, out=out: dense.linear(x, w, None, out, n_threads=nt, parts=parts),
                       "torch": lambda w=w, x=x, out=out: torch_linear(x, w, None, parts, out, nt)}
                inner = max(1, int(2e6 // max(1, m * n * k)))  # small shapes: several calls per sample
                times = {key: [] for key in fns}
                for f in fns.values():
                    f()
                for _ in range(rounds):
                    for key, f in fns.items():
                        t = time.perf_counter()
                        for _ in range(inner):
                            f()
                        times[key].append((time.perf_counter() - t) / inner)
                ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
                rows.append({"entry": _entry(m, n, k, bf16, parts), "ours_s": ours, "torch_s": theirs,
                             "torch_wins": ours > MARGIN * theirs})
    if save:
        _save(machine_key(nt), rows)
    return rows


def _save(key: str, rows: list[dict]) -> None:
    path = cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    rec = data.setdefault(key, {"torch": [], "measured": {}})
    torch_set = set(rec.get("torch", ()))
    for r in rows:
        rec["measured"][r["entry"]] = [round(r["ours_s"], 9), round(r["torch_s"], 9)]
        (torch_set.add if r["torch_wins"] else torch_set.discard)(r["entry"])
    rec["torch"] = sorted(torch_set)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    table_written()
