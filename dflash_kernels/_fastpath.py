"""``FAST``: the public ops' compiled fast path (pyx/fastpath.pyx), and the settings it runs with.

Each public op first asks ``FAST.<op>(<its arguments>)``; a result other than None is the op's result,
None sends the call through the op's Python checks and dispatch. Without the compiled module (no
Cython build) or without ``os.environ``'s raw dict, ``FAST`` answers None to every call.
"""

from __future__ import annotations

import os

import torch

from ._autotune import delegates, has_table
from ._backends import _ENV_BACKEND, resolve
from ._env import _HAS_DATA
from ._isa import _ENV_CAP
from ._precision import parts as precision_parts
from ._threads import _ENV_THREADS, max_threads

# the environment settings the resolved settings depend on (dflash_kernels/_env.py: read every call)
WATCHED = (_ENV_CAP, _ENV_BACKEND, _ENV_THREADS)
FAMILIES = ("dense", "attention", "acceptance", "denoise", "linear_attention")


def _kernels(family: str):
    name, module = resolve("auto", family)
    return module if name == "cython" else None


def settings() -> dict:
    """What ``Fast`` runs with, by the Python rules; raises as a public call would on a bad setting."""
    from .acceptance import MIN_TEMPERATURE, draw_uniforms  # here: these modules import this one
    from .dense import PackedWeight

    env_threads = _ENV_THREADS.get()
    return {**{family: _kernels(family) for family in FAMILIES}, "env_threads": env_threads or 0,
            "max_threads": max_threads(), "parts": precision_parts(None),
            # with a tuning table, the fast path asks delegates() per linear call (keyed by thread count)
            "delegates": delegates if has_table() else None,
            "packed_type": PackedWeight, "draw_uniforms": draw_uniforms, "min_temperature": MIN_TEMPERATURE,
            "torch": torch}


class _NoFast:
    """Every op takes the Python path."""

    def __getattr__(self, name):
        return lambda *args: None


def _make():
    if not _HAS_DATA:
        return _NoFast()
    try:
        from ._cython.fastpath import Fast
    except ImportError:
        return _NoFast()
    return Fast(settings, os.environ._data, [s._key for s in WATCHED])  # type: ignore[attr-defined]


FAST = _make()
