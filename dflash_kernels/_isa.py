"""Runtime ISA dispatch: which tier of the compiled kernels runs on this CPU.

The Cython kernels are compiled once per tier (setup.py), into dflash_kernels._cython.<tier>:

    avx2         x86-64-v3: AVX2 + FMA (8-float vectors)
    avx512       x86-64-v4: AVX-512 F/BW/CD/DQ/VL (16-float vectors)
    avx512_bf16  + AVX512-BF16 and AVX512-VNNI: vdpbf16ps for bf16 weights and K/V, vpdpbusd for int8
    amx          + AMX-BF16 tiles: TDPBF16PS for bf16-weight blocks

The tier is the highest one the CPU (CPUID flags as Linux reports them) and the OS (AMX tile state
must be granted by the kernel) support, lowered by a cap: the environment variable DFLASH_ISA at
import, or `set_isa()` at run time. A cap above what the machine has falls back to the machine's
tier with a warning; it never runs an instruction the CPU lacks. A local build made with
DFLASH_MARCH (dflash_kernels._cython.native) is used as is, whatever the cap.
"""

from __future__ import annotations

import ctypes
import warnings
from functools import cache

from ._env import EnvSetting, settings_changed

TIERS = ("avx2", "avx512", "avx512_bf16", "amx")
NATIVE = "native"

# /proc/cpuinfo flags each tier needs on top of the tiers below it.
TIER_FLAGS = {
    "avx2": ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"),
    "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),  # every AVX512-BF16 CPU has VNNI (vpdpbusd)
    "amx": ("amx_tile", "amx_bf16"),
}

# The same caps for the other runtimes, so that a benchmark compares like with like.
ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
              "amx": "AVX512_CORE_AMX"}
NUMBA_CPU = {"avx2": "haswell", "avx512": "skylake-avx512", "avx512_bf16": "cooperlake",
             "amx": "sapphirerapids"}


@cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags as Linux reports them (empty when /proc/cpuinfo is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@cache
def _amx_granted() -> bool:
    """Ask Linux for AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0
    except (OSError, AttributeError):
        return False


def tier_tuple(flags) -> tuple[str, ...]:
    """Tiers a CPU with these flags can run, lowest first (no OS check)."""
    have = []
    for tier in TIERS:
        if not all(f in flags for f in TIER_FLAGS[tier]):
            break
        have.append(tier)
    return tuple(have)


@cache
def machine_tier() -> str | None:
    """The highest tier this CPU and OS support; None below AVX2 (no compiled kernels then)."""
    tiers = tier_tuple(cpu_flags())
    if tiers and tiers[-1] == "amx" and not _amx_granted():
        tiers = tiers[:-1]
    return tiers[-1] if tiers else None


def parse_cap(value, source: str = "DFLASH_ISA") -> str | None:
    """Validate a tier cap ("" or None: no cap)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{source} must be one of {TIERS} or None, got {value!r}")
    v = value.strip().lower()
    if not v:
        return None
    if v not in TIERS:
        raise ValueError(f"{source} must be one of {', '.join(TIERS)}, got {value!r}")
    return v


_UNSET = object()
_runtime_cap: object = _UNSET
_warned: set[tuple[str, str | None]] = set()
_ENV_CAP = EnvSetting("DFLASH_ISA", parse_cap)  # read on every call (cheaply): a change takes effect


def current_cap() -> str | None:
    """The cap in force: set_isa()'s if called, else DFLASH_ISA."""
    if _runtime_cap is not _UNSET:
        return _runtime_cap  # type: ignore[return-value]
    return _ENV_CAP.get()


def cap_tier(cap: str | None, machine: str | None) -> str | None:
    """The tier that runs under `cap` on a machine whose highest tier is `machine`."""
    if machine is None:
        return None
    if cap is None or TIERS.index(cap) >= TIERS.index(machine):
        if cap is not None and cap != machine and (cap, machine) not in _warned:
            _warned.add((cap, machine))
            warnings.warn(f"dflash_kernels: ISA cap {cap!r} asks for a tier this CPU or OS lacks; "
                          f"running the highest supported tier, {machine!r}", RuntimeWarning,
                          stacklevel=3)
        return machine
    return cap


def active_tier() -> str | None:
    """The tier the compiled kernels run at now (before falling back to a tier that was built).

    The machine's highest tier, lowered by the cap in force (``set_isa``, else DFLASH_ISA).

    Returns
    -------
    str or None
        "avx2", "avx512", "avx512_bf16" or "amx"; None on a CPU below AVX2 (no compiled kernels then).

    Examples
    --------
    >>> dk.active_tier() in ("avx2", "avx512", "avx512_bf16", "amx", None)
    True
    """
    return cap_tier(current_cap(), machine_tier())


def set_isa(cap: str | None) -> str | None:
    """Cap the compiled kernels' ISA tier for this process; None restores DFLASH_ISA's cap.

    Like ``ONEDNN_MAX_CPU_ISA`` for torch, this lowers the tier, never raises it past the machine's: a
    cap above it falls back with a warning. Objects that resolved their kernels earlier
    (``dflash_kernels.model`` engines) keep their tier.

    Parameters
    ----------
    cap : {"avx2", "avx512", "avx512_bf16", "amx"} or None
        The highest tier to run (case-insensitive; "" = no cap); None restores DFLASH_ISA's cap.

    Returns
    -------
    str or None
        The tier in force after the call (``active_tier()``); None on a CPU below AVX2.

    Raises
    ------
    ValueError
        If cap is not one of the tier names.
    TypeError
        If cap is neither a str nor None.

    Warns
    -----
    RuntimeWarning
        If the cap is above what this CPU and OS support (once per cap and machine tier).

    Examples
    --------
    >>> dk.set_isa("avx2") in ("avx2", None)  # None: no compiled kernels on this CPU
    True
    >>> dk.set_isa(None) == dk.active_tier()
    True
    """
    global _runtime_cap
    _runtime_cap = _UNSET if cap is None else parse_cap(cap, "set_isa(cap)")
    settings_changed()
    return active_tier()


def tiers_to_try() -> tuple[str, ...]:
    """Tier package names to import from, best first: native, then the active tier and below."""
    tier = active_tier()
    below = TIERS[: TIERS.index(tier) + 1][::-1] if tier else ()
    return (NATIVE, *below)
