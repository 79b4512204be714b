"""Builds the Cython kernels in pyx/ once per ISA tier: dflash_kernels._cython.<tier>.<stem>.

Each .pyx is translated to C once; the C is compiled once per tier with that tier's -march flags
(`TIERS` below), so one build (one wheel) carries code for every x86-64 class and the tier is
chosen from CPUID at import (dflash_kernels/_isa.py), never by the build machine.

Environment switches:
  DFLASH_NO_CYTHON=1       build no extension (the Numba and torch backends still work)
  DFLASH_REQUIRE_CYTHON=1  a failed Cython build is fatal instead of a warning
  DFLASH_MARCH=...         build one local set, dflash_kernels._cython.native.<stem>, with
                           -march=<value> (e.g. "native") instead of the tiers; it is used as is
  DFLASH_TIERS=a,b         build only these tiers (developers: faster rebuilds)
  DFLASH_ONLY=stem         build only pyx/<stem>.pyx (developers)
  DFLASH_DEBUG=1           bounds-checked, -O1 -g build: Cython boundscheck, _FORTIFY_SOURCE and
                           AddressSanitizer (run with LD_PRELOAD=$(gcc -print-file-name=libasan.so))
"""

import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
NO_CYTHON = os.environ.get("DFLASH_NO_CYTHON") == "1"
REQUIRE_CYTHON = os.environ.get("DFLASH_REQUIRE_CYTHON") == "1"
MARCH = os.environ.get("DFLASH_MARCH")
ONLY = os.environ.get("DFLASH_ONLY")
DEBUG = os.environ.get("DFLASH_DEBUG") == "1"

# Tier -> compiler flags. The same names and order as dflash_kernels/_isa.py (TIERS); each tier's
# flags are a superset of the one before. x86-64-v3 = AVX2 + FMA + F16C + BMI; v4 adds AVX-512
# F/BW/CD/DQ/VL. -mtune stays generic: the tier, not the build machine, decides the code.
TIERS = {
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
}

# Reassociation lets gcc vectorise float reductions; deliberately NOT -ffast-math, whose
# -ffinite-math-only would break the -inf masks and NaN checks the kernels rely on.
# pyx stems compiled once, not per tier (dflash_kernels._cython.<stem>): the public ops' fast path
UNTIERED = ("fastpath",)
FLOAT_FLAGS = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]
# DFLASH_DEBUG: AddressSanitizer catches an out-of-bounds read or write in the C kernels (the headers'
# pointer arithmetic, which Cython's boundscheck never sees). Python must load the ASan runtime first:
# LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 (what .ci/run does).
SANITIZE = ["-fsanitize=address", "-fno-omit-frame-pointer"]
OPT_FLAGS = ["-O1", "-g", "-D_FORTIFY_SOURCE=2", *SANITIZE] if DEBUG else ["-O3"]
LINK_FLAGS = ["-fsanitize=address"] if DEBUG else []


def _openmp_flags():
    """Return (compile, link) OpenMP flags if the compiler accepts them, else ([], [])."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    cc = new_compiler()
    customize_compiler(cc)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        try:
            objs = cc.compile([str(src)], output_dir=tmp, extra_postargs=["-fopenmp"])
            cc.link_executable(objs, str(Path(tmp) / "probe"), extra_postargs=["-fopenmp"])
        except Exception:  # no OpenMP: kernels still build, single-threaded
            print("dflash_kernels: compiler has no OpenMP, Cython kernels run single-threaded")
            return [], []
    return ["-fopenmp"], ["-fopenmp"]


def _selected_tiers() -> dict[str, list[str]]:
    if MARCH:
        return {"native": [f"-march={MARCH}"]}
    if platform.machine().lower() not in ("x86_64", "amd64"):  # the tiers are x86-64 levels
        return {"native": ["-march=native"]}
    wanted = os.environ.get("DFLASH_TIERS")
    if not wanted:
        return TIERS
    names = [t.strip() for t in wanted.split(",") if t.strip()]
    unknown = [t for t in names if t not in TIERS]
    if unknown:
        raise SystemExit(f"DFLASH_TIERS: unknown tier(s) {unknown}; choose from {list(TIERS)}")
    return {t: TIERS[t] for t in names}


def _extensions():
    if NO_CYTHON:
        return []
    try:
        import numpy as np
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError as err:
        if REQUIRE_CYTHON:
            raise
        print(f"dflash_kernels: Cython unavailable ({err}); building without compiled kernels")
        return []
    omp_compile, omp_link = _openmp_flags()
    # Translate each .pyx once (module dflash_kernels._cython.<stem>) ...
    generic = cythonize(
        [
            Extension(f"dflash_kernels._cython.{pyx.stem}", [str(pyx.relative_to(HERE))])
            for pyx in sorted((HERE / "pyx").glob("*.pyx"))
            if (ONLY is None or pyx.stem == ONLY) and pyx.stem not in UNTIERED
        ],
        language_level=3,
        # debug C (boundscheck on) apart from the release C: Cython does not regenerate a .c when only
        # the directives change, so a release build after a debug one would reuse the checked code
        build_dir="build/debug-c" if DEBUG else None,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": DEBUG,
            "nonecheck": False,
        },
    )
    # ... then compile the C once per tier. Only the last name component must match the C file's
    # PyInit_<stem>; Python imports it as dflash_kernels._cython.<tier>.<stem>.
    # checks and dispatch only: compiled once, for any x86-64 (or other) CPU, beside the tier packages
    extensions = [
        Extension(f"dflash_kernels._cython.{stem}", [f"pyx/{stem}.pyx"], include_dirs=[np.get_include()],
                  extra_compile_args=OPT_FLAGS, extra_link_args=LINK_FLAGS,
                  define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
        for stem in UNTIERED if ONLY is None or stem == ONLY
    ]
    extensions = cythonize(extensions, language_level=3, build_dir="build/debug-c" if DEBUG else None,
                           compiler_directives={"boundscheck": DEBUG, "wraparound": False, "cdivision": True})
    for tier, march in _selected_tiers().items():
        for ext in generic:
            stem = ext.name.rsplit(".", 1)[1]
            extensions.append(Extension(
                f"dflash_kernels._cython.{tier}.{stem}",
                list(ext.sources),
                include_dirs=[np.get_include(), str(HERE / "pyx")],
                extra_compile_args=[*OPT_FLAGS, *march, *FLOAT_FLAGS, *omp_compile],
                extra_link_args=[*omp_link, *LINK_FLAGS],
                # the kernels live in headers: an edit to one rebuilds the modules
                depends=[str(h.relative_to(HERE)) for pat in ("*.h", "*.pxi")
                         for h in sorted((HERE / "pyx").glob(pat))],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                               ("DK_TIER", f'"{tier}"')],
            ))
    return extensions


class OptionalBuildExt(build_ext):
    """Builds in parallel; a failed compile leaves the pure-Python backends usable unless
    DFLASH_REQUIRE_CYTHON=1."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self):
        try:
            super().run()
        except Exception as err:
            if REQUIRE_CYTHON:
                raise
            print(f"dflash_kernels: Cython build failed ({err}); using Numba/torch backends", file=sys.stderr)
        self._install_stubs()

    def _install_stubs(self):
        """pyx/<stem>.pyi beside every built <tier>/<stem> module (one stub per module, written once)."""
        for ext in self.extensions:
            stub = HERE / "pyx" / (ext.name.rsplit(".", 1)[1] + ".pyi")
            target = Path(self.get_ext_fullpath(ext.name)).parent / stub.name
            if stub.exists() and target.parent.is_dir():
                shutil.copyfile(stub, target)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as err:
            if REQUIRE_CYTHON:
                raise
            print(f"dflash_kernels: could not build {ext.name} ({err})", file=sys.stderr)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
