"""Backend registry: which implementations of the kernels can run here.

"cython" are the compiled kernels in dflash_kernels._cython, "numba" the JIT kernels in
dflash_kernels._numba, "torch" the reference implementations (dflash_kernels.reference) run in float32.
`backend="auto"` picks the first available of ``DFLASH_BACKEND`` (if set), cython, numba, torch.
"""

from __future__ import annotations

import importlib
import logging
import os
from functools import lru_cache
from types import ModuleType

log = logging.getLogger("dflash_kernels")

BACKENDS = ("cython", "numba", "torch")
_PACKAGES = {
    "cython": "dflash_kernels._cython",
    "numba": "dflash_kernels._numba",
    "torch": "dflash_kernels.reference",
}


@lru_cache(maxsize=None)
def _load(backend: str, family: str) -> ModuleType | Exception:
    """Import the module implementing `family` for `backend`, or return the import error."""
    try:
        return importlib.import_module(f"{_PACKAGES[backend]}.{family}")
    except Exception as err:  # ImportError, or a broken compiled module
        return err


def backend_error(backend: str, family: str = "dense") -> Exception | None:
    """The import error that makes `backend` unavailable, or None when it loads."""
    mod = _load(backend, family)
    return mod if isinstance(mod, Exception) else None


def available_backends() -> tuple[str, ...]:
    """Backends whose kernels import on this machine, fastest first."""
    return tuple(b for b in BACKENDS if backend_error(b) is None)


_warned: set[str] = set()


def resolve(backend: str | None, family: str) -> tuple[str, ModuleType]:
    """Return (name, module) of the backend that runs `family`.

    An explicitly requested backend that does not load raises with its import error; "auto" falls back
    quietly to the next backend (logged once per backend).
    """
    if backend is None:
        backend = "auto"
    if not isinstance(backend, str) or backend not in (*BACKENDS, "auto"):
        raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
    if backend != "auto":
        mod = _load(backend, family)
        if isinstance(mod, Exception):
            raise RuntimeError(f"backend {backend!r} is not available: {mod}") from mod
        return backend, mod
    preferred = os.environ.get("DFLASH_BACKEND", "").strip().lower()
    order = ((preferred,) if preferred in BACKENDS else ()) + BACKENDS
    for name in order:
        mod = _load(name, family)
        if not isinstance(mod, Exception):
            return name, mod
        if name not in _warned:
            _warned.add(name)
            log.info("dflash_kernels: backend %s unavailable (%s), falling back", name, mod)
    raise RuntimeError(f"no backend can run {family}")  # torch always imports; unreachable in practice
