"""Environment settings read on every public call, parsed only when they change.

The settings (DFLASH_ISA, DFLASH_BACKEND, DFLASH_NUM_THREADS) take effect when changed at run time,
so they are looked up on every call. ``os.environ.get`` costs ~1.4 us on Zen 2 (key encoding, the
Mapping machinery, value decoding): three of them were most of a tiny op's API cost
(bench/validation_cost.py). ``os.environ`` keeps the raw values in a dict keyed by the encoded name;
a lookup there is ~30 ns, and the value is decoded and parsed again only when the raw value changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# CPython's os.environ stores {encoded name: encoded value} in _data, updated by every change made
# through it (os.environ[...] = ..., .pop, monkeypatch.setenv, mock.patch.dict). Not seen: os.environ
# replaced by another object. Without _data: os.environ itself, slower.
_HAS_DATA = isinstance(getattr(os.environ, "_data", None), dict)
_RAW = os.environ._data if _HAS_DATA else os.environ  # type: ignore[attr-defined]
_UNREAD = object()


class EnvSetting:
    """One environment variable and its parsed value (``parse(raw str or None)``)."""

    __slots__ = ("name", "_key", "_parse", "_raw", "_value")

    def __init__(self, name: str, parse: Callable[[str | None], Any]):
        self.name, self._parse = name, parse
        self._key = os.environ.encodekey(name) if _HAS_DATA else name  # type: ignore[attr-defined]
        self._raw, self._value = _UNREAD, None

    def get(self) -> Any:
        """The parsed value now. A parse error is raised on every call while the value stays bad
        (nothing is cached then)."""
        raw = _RAW.get(self._key)
        if raw != self._raw:
            self._value = self._parse(os.environ.get(self.name))
            self._raw = raw
        return self._value


def settings_changed() -> None:
    """A process setting changed (ISA cap, default precision): the public ops' compiled fast path
    (dflash_kernels/_fastpath.py) resolves its settings again at the next call."""
    try:
        from ._cython.fastpath import settings_changed as changed
    except ImportError:  # no compiled fast path: nothing is kept
        return
    changed()


def user_cache_dir(variable: str = "DFLASH_CACHE_DIR") -> Path:
    """This library's per-user cache directory: ``$variable`` when set, else
    ``$XDG_CACHE_HOME/dflash_kernels``, else ``~/.cache/dflash_kernels``. Two variables can move it:
    DFLASH_CACHE_DIR for this machine's measurements (the tuned k, the kernel autotune) and
    DFLASH_CACHE for fetched model files, so that a test run can start from no measurements and still
    find the fetched model."""
    if os.environ.get(variable):
        return Path(os.environ[variable])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_kernels"
