"""Runtime ISA dispatch: tier detection, the cap, and proof that a capped tier runs its own code."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dflash_kernels as dk
from dflash_kernels import _isa
from support import MACHINE_TIERS

pytestmark = pytest.mark.skipif("cython" not in dk.available_backends(), reason="tiers are the Cython build's")

FLAGS_ZEN2 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
FLAGS_ZEN4 = FLAGS_ZEN2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}
FLAGS_SPR = FLAGS_ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags,tiers", [
    (set(), ()),
    ({"avx", "avx2"}, ()),  # no FMA: below x86-64-v3
    (FLAGS_ZEN2, ("avx2",)),
    (FLAGS_ZEN4, ("avx2", "avx512", "avx512_bf16")),
    (FLAGS_SPR, _isa.TIERS),
    (FLAGS_SPR - {"avx512_bf16"}, ("avx2", "avx512")),  # tiers are cumulative
    (FLAGS_ZEN4 - {"avx512_vnni"}, ("avx2", "avx512")),  # the avx512_bf16 tier's int8 tiles use vpdpbusd
])
def test_tiers_from_cpu_flags(flags, tiers):
    assert _isa.tier_tuple(flags) == tiers


def test_cap_above_the_machine_falls_back_with_a_warning():
    _isa._warned.clear()
    with pytest.warns(RuntimeWarning, match="'amx' asks for a tier this CPU or OS lacks.*'avx2'"):
        assert _isa.cap_tier("amx", "avx2") == "avx2"
    assert _isa.cap_tier("avx2", "amx") == "avx2"
    assert _isa.cap_tier(None, "avx512_bf16") == "avx512_bf16"
    assert _isa.cap_tier("avx512", None) is None  # below AVX2: no compiled tier at all


@pytest.mark.parametrize("bad", ["avx3", "AVX-512", "sse4"])
def test_bad_cap_named(bad):
    with pytest.raises(ValueError, match="set_isa\\(cap\\) must be one of avx2, avx512, avx512_bf16, amx"):
        dk.set_isa(bad)
    with pytest.raises(TypeError, match="set_isa"):
        dk.set_isa(3)


def test_bad_env_cap_is_a_clear_error():
    env = dict(os.environ, DFLASH_ISA="avx1024")
    res = subprocess.run([sys.executable, "-c", "import dflash_kernels"], env=env, capture_output=True, text=True)
    assert res.returncode != 0
    assert "DFLASH_ISA must be one of avx2, avx512, avx512_bf16, amx, got 'avx1024'" in res.stderr


@pytest.mark.parametrize("tier", MACHINE_TIERS)
def test_set_isa_selects_the_tier_module(tier):
    try:
        assert dk.set_isa(tier) == tier
        dense = dk.kernel_module("dense", "cython")
        assert dense.TIER == tier
        x = np.ones((16, 64), np.float32)
        w = np.ones((64, 64), np.uint16) * 0x3F80  # bf16 1.0
        assert np.array_equal(dk.linear(x, w, backend="cython"), np.full((16, 64), 64.0, np.float32))
        assert dense.last_path().startswith(f"{tier}:")
        assert dense.last_path() == dense.path_name(16, 64, 64, True)
        if tier != "amx":
            assert "amx" not in dense.last_path()
    finally:
        dk.set_isa(None)


@pytest.mark.parametrize("tier", MACHINE_TIERS)
def test_peak_rates_follow_the_tier(tier):
    """The register-only ceilings: each instruction's loop runs only where the tier and the CPU have it."""
    try:
        dk.set_isa(tier)
        dense = dk.kernel_module("dense", "cython")
        assert dense.peak_gflops("fma", 1, 0.01) > 0
        assert (dense.peak_gflops("bf16dot", 1, 0.01) > 0) == (tier in ("avx512_bf16", "amx"))
        assert (dense.peak_gflops("amx", 1, 0.01) > 0) == (tier == "amx" and dense.amx_available())
        with pytest.raises(ValueError, match="kind must be 'fma', 'bf16dot' or 'amx', got 'avx'"):
            dense.peak_gflops("avx")
    finally:
        dk.set_isa(None)


# What a tier's compiled code must not contain: a register or instruction of a higher tier.
FORBIDDEN = {"avx2": ("zmm", "vdpbf16ps", "tdpbf16ps"), "avx512": ("vdpbf16ps", "tdpbf16ps"),
             "avx512_bf16": ("tdpbf16ps", "ldtilecfg")}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
@pytest.mark.parametrize("tier", ["avx2", "avx512", "avx512_bf16"])
def test_lower_tiers_carry_no_higher_instructions(tier):
    """Under DFLASH_ISA=avx2 no AVX-512 path can execute: the avx2 modules contain none."""
    pkg = Path(dk.__file__).parent / "_cython" / tier
    libs = sorted(pkg.glob("*.so"))
    assert libs, f"no compiled modules for tier {tier} in {pkg}"
    for lib in libs:
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                             check=True).stdout
        for word in FORBIDDEN[tier]:
            assert word not in asm, f"{lib.name} ({tier}) contains {word}"


def test_higher_tiers_use_their_instructions():
    """The opposite check, so that the one above cannot pass on empty disassembly."""
    if shutil.which("objdump") is None:
        pytest.skip("needs binutils' objdump")
    base = Path(dk.__file__).parent / "_cython"
    for tier, word in (("avx512", "zmm"), ("avx512_bf16", "vdpbf16ps"), ("amx", "tdpbf16ps")):
        lib = next((base / tier).glob("dense*.so"))
        asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
        assert word in asm, f"{lib.name} ({tier}) lacks {word}"


CAPPED_RUN = """
import numpy as np, dflash_kernels as dk, numba
from dflash_kernels import _isa
x = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
w = (np.random.default_rng(1).integers(0x3C00, 0x3F00, (96, 256))).astype(np.uint16)
for p in ("highest", "high", "medium"):
    dk.linear(x, w, precision=p)
q = np.random.default_rng(2).standard_normal((4, 8, 64)).astype(np.float32)
kv = np.random.default_rng(3).standard_normal((100, 2, 64)).astype(np.float32)
dk.cached_attention(q, kv, kv)
dk.denoise_block(x[:, :64], w[:, :64])
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    dk.show_config()  # lists the compiled tiers without importing those above the cap
maps = open("/proc/self/maps").read()
# the tier packages' modules (dflash_kernels/_cython/<tier>/<stem>), not the untiered fast path
tiers = sorted({l.split("/_cython/")[1].split("/")[0] for l in maps.splitlines() if "/_cython/" in l
                and "/" in l.split("/_cython/")[1]})
print(dk.active_tier(), dk.kernel_module("dense").last_path(), ",".join(tiers), numba.config.CPU_NAME)
"""


def test_env_cap_runs_only_that_tier():
    """DFLASH_ISA=avx2: the tier reported is avx2, the avx2 modules are the only ones mapped into the
    process after linear, attention, denoise and show_config ran, and Numba compiles for haswell.
    (A higher tier's module executes its instructions at import: SIGILL on an AVX2-only CPU.)"""
    env = dict(os.environ, DFLASH_ISA="avx2")
    env.pop("NUMBA_CPU_NAME", None)
    out = subprocess.run([sys.executable, "-c", CAPPED_RUN], env=env, capture_output=True, text=True, check=True)
    active, path, mapped, numba_cpu = out.stdout.split()
    assert active == "avx2" and path.startswith("avx2:") and mapped == "avx2" and numba_cpu == "haswell"
