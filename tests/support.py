"""Shared test helpers: tolerance table, backends, input builders.

Hypothesis profiles: DFLASH_HYPOTHESIS_PROFILE = dev (few examples) | ci (default) | nightly.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from hypothesis import HealthCheck, settings

import dflash_kernels as dk
from dflash_kernels import _isa
from dflash_kernels._tensors import bf16_to_f32, f32_to_bf16

_common = dict(deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=10, **_common)
settings.register_profile("ci", max_examples=25, **_common)
settings.register_profile("nightly", max_examples=300, **_common)
settings.load_profile(os.environ.get("DFLASH_HYPOTHESIS_PROFILE", "ci"))

# Per storage dtype of the weights / K / V (activations are float32; references run in float64 on
# the same rounded inputs, so the only error left is the kernel's float32 accumulation).
TOLERANCE = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=1e-5, atol=1e-5),  # inputs already rounded to bf16: same as fp32
}
# Looser tolerance for long float32 reductions (K in the thousands): error grows ~sqrt(K) * eps.
TOLERANCE_LONG = dict(rtol=2e-4, atol=2e-4)

KERNEL_BACKENDS = [b for b in ("cython", "numba") if b in dk.available_backends()]
# Every ISA tier this machine can run, lowest first: the Cython kernels are tested at each of them
# through the cap (dk.set_isa), so a lower tier's code is exercised on a higher machine.
MACHINE_TIERS = _isa.TIERS[: _isa.TIERS.index(_isa.machine_tier()) + 1] if _isa.machine_tier() else ()
# "cython/<tier>" per tier, then "numba": what the kernel_backend fixture runs
KERNEL_CASES = [f"cython/{t}" for t in MACHINE_TIERS if "cython" in KERNEL_BACKENDS] + \
    [b for b in KERNEL_BACKENDS if b != "cython"]
ALL_BACKENDS = list(dk.available_backends())


def make_float(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Random operand in kernel storage: float32, or uint16 bf16 bit patterns for 'bfloat16'."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return f32_to_bf16(x) if dtype == "bfloat16" else x


def as_f64(x) -> torch.Tensor:
    """Exact float64 torch copy of a float32 / bf16 (uint16 or torch.bfloat16) operand."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    x = np.asarray(x)
    if x.dtype == np.uint16:
        x = bf16_to_f32(x)
    return torch.from_numpy(np.array(x, dtype=np.float64))


def as_torch(x: np.ndarray) -> torch.Tensor:
    """numpy operand (uint16 = bf16) as a torch tensor of the matching dtype."""
    if x.dtype == np.uint16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def readonly(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    y.flags.writeable = False
    return y


def assert_close(actual, expected, *, rtol, atol, what=""):
    """allclose that reports the worst indices on failure."""
    a = actual.detach().double().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float64)
    e = expected.detach().double().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    err = np.abs(a - e) - (atol + rtol * np.abs(e))
    if np.any(err > 0) or np.any(np.isnan(a) != np.isnan(e)):
        idx = np.unravel_index(np.argmax(np.where(np.isnan(err), np.inf, err)), a.shape)
        bad = int(np.sum(err > 0))
        raise AssertionError(
            f"{what}: {bad} of {a.size} elements out of tolerance (rtol={rtol}, atol={atol}); "
            f"worst at {idx}: got {a[idx]!r}, expected {e[idx]!r}"
        )


def chi2_ok(counts: dict, probs: np.ndarray, z: float = 3.29):
    """Pearson chi-square of observed counts vs probs (cells with expected < 5 pooled); True if the
    statistic is below the Wilson-Hilferty approximation of the 1 - 5e-4 quantile."""
    n = sum(counts.values())
    exp = probs * n
    big = np.flatnonzero(exp >= 5)
    obs_big = np.array([counts.get(int(i), 0) for i in big], float)
    rest_obs = n - obs_big.sum()
    rest_exp = n - exp[big].sum()
    stat = float(((obs_big - exp[big]) ** 2 / exp[big]).sum())
    df = len(big) - 1
    if rest_exp >= 1:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    if df < 1:
        return True, stat, 0.0
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


def greedy_runs(engine, prompts=("The quick brown fox", "def add(a, b):"), n: int = 24):
    """(autoregressive, DFlash) greedy results per prompt, for lossless checks."""
    return [(engine.generate(p, n, num_speculative_tokens=0, ignore_eos=True), engine.generate(p, n, ignore_eos=True))
            for p in prompts]
