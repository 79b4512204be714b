"""Backend registry: which implementations of the kernels can run here.

"cython" are the compiled kernels in dflash_kernels._cython.<tier> (the ISA tier from _isa.py),
"numba" the JIT kernels in
dflash_kernels._numba, "torch" the reference implementations (dflash_kernels.reference) run in float32.
`backend="auto"` picks the first available of ``DFLASH_BACKEND`` (if set), cython, numba, torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from functools import cache
from types import ModuleType

from . import _isa
from ._env import EnvSetting

log = logging.getLogger("dflash_kernels")

BACKENDS = ("cython", "numba", "torch")
_PACKAGES = {
    "cython": "dflash_kernels._cython",
    "numba": "dflash_kernels._numba",
    "torch": "dflash_kernels.reference",
}


@cache
def _import(name: str) -> ModuleType | Exception:
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or a broken compiled module
        return err


def load_tier(family: str, tier: str) -> ModuleType | Exception:
    """The compiled module of `family` built for `tier`, or its import error. Only for a tier this
    CPU runs: importing a higher tier's module executes its instructions (SIGILL on Zen 2 for avx512)."""
    return _import(f"dflash_kernels._cython.{tier}.{family}")


def tier_built(family: str, tier: str) -> bool:
    """Whether `family` was compiled for `tier`: looked up on disk, never imported (see load_tier)."""
    try:
        return importlib.util.find_spec(f"dflash_kernels._cython.{tier}.{family}") is not None
    except ImportError:  # the tier's package itself is missing
        return False


def _load(backend: str, family: str) -> ModuleType | Exception:
    """Import the module implementing `family` for `backend`, or return the import error.

    Cython: the best tier at or below the active one that was built (see _isa.tiers_to_try).
    """
    if backend != "cython":
        return _import(f"{_PACKAGES[backend]}.{family}")
    errors = []
    for tier in _isa.tiers_to_try():
        mod = load_tier(family, tier)
        if not isinstance(mod, Exception):
            return mod
        if tier != _isa.NATIVE:
            errors.append(mod)
    if _isa.machine_tier() is None:
        return RuntimeError("the compiled kernels need an x86-64 CPU with AVX2 and FMA")
    return errors[0] if errors else RuntimeError(f"no compiled {family} kernels")


def backend_error(backend: str, family: str = "dense") -> Exception | None:
    """The import error that makes `backend` unavailable, or None when it loads."""
    mod = _load(backend, family)
    return mod if isinstance(mod, Exception) else None


def available_backends() -> tuple[str, ...]:
    """Backends whose kernels import on this machine, fastest first."""
    return tuple(b for b in BACKENDS if backend_error(b) is None)


_warned: set[str] = set()
_NAMES = frozenset((*BACKENDS, "auto"))


def _preferred(raw: str | None) -> str:
    return (raw or "").strip().lower()


_ENV_BACKEND = EnvSetting("DFLASH_BACKEND", _preferred)  # read on every call (cheaply): a change takes effect


def resolve(backend: str | None, family: str) -> tuple[str, ModuleType]:
    """Return (name, module) of the backend that runs `family`.

    An explicitly requested backend that does not load raises with its import error; "auto" falls back
    quietly to the next backend (logged once per backend).
    """
    if backend is None:
        backend = "auto"
    # Memo keyed on everything the answer depends on (the ISA cap and DFLASH_BACKEND are read every
    # call, so changing them takes effect): this runs on every public call, and uncached it cost
    # ~10 us of the ~13 us a tiny op takes (bench/validation_cost.py). Only valid names are stored,
    # so a hit needs no other check.
    if type(backend) is str:
        hit = _resolved.get((backend, family, _ENV_BACKEND.get(), _isa.current_cap()))
        if hit is not None:
            return hit
    if not isinstance(backend, str) or backend not in _NAMES:
        raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
    backend = str(backend)
    _resolved[(backend, family, _ENV_BACKEND.get(), _isa.current_cap())] = found = _resolve(backend, family)
    return found


_resolved: dict[tuple, tuple[str, ModuleType]] = {}


def _resolve(backend: str, family: str) -> tuple[str, ModuleType]:
    if backend != "auto":
        mod = _load(backend, family)
        if isinstance(mod, Exception):
            raise RuntimeError(f"backend {backend!r} is not available: {mod}") from mod
        return backend, mod
    preferred = _ENV_BACKEND.get()
    order = ((preferred,) if preferred in BACKENDS else ()) + BACKENDS
    for name in order:
        mod = _load(name, family)
        if not isinstance(mod, Exception):
            return name, mod
        if name not in _warned:
            _warned.add(name)
            log.info("dflash_kernels: backend %s unavailable (%s), falling back", name, mod)
    raise RuntimeError(f"no backend can run {family}")  # torch always imports; unreachable in practice


def kernel_module(family: str, backend: str = "auto") -> ModuleType:
    """The kernel module of `family` ("dense", "attention", "denoise", "acceptance",
    "linear_attention") that `backend` runs here: for "cython", the one built for the active ISA tier.

    Its functions are the unchecked entry points behind the public ops: ``op(*inputs, *outs,
    n_threads=n, **params)`` on C-contiguous numpy arrays the caller owns (float32, bf16 as uint16),
    writing into the preallocated outputs. For callers that validate once and call many times (the
    model layer, engines); anything else should use the public ops.
    """
    if family not in ("dense", "attention", "denoise", "acceptance", "linear_attention"):
        raise ValueError(f"family must be one of dense, attention, denoise, acceptance, linear_attention, "
                         f"got {family!r}")
    return resolve(backend, family)[1]
