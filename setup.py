"""Builds the Cython kernels in pyx/ into dflash_kernels._cython.<stem>.

Environment switches:
  DFLASH_NO_CYTHON=1       build no extension (the Numba and torch backends still work)
  DFLASH_REQUIRE_CYTHON=1  a failed Cython build is fatal instead of a warning
  DFLASH_MARCH=...         -march value (default "native": the build runs where it is used;
                           set e.g. "x86-64-v3" for a wheel meant for other machines)
"""

import os
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
NO_CYTHON = os.environ.get("DFLASH_NO_CYTHON") == "1"
REQUIRE_CYTHON = os.environ.get("DFLASH_REQUIRE_CYTHON") == "1"
MARCH = os.environ.get("DFLASH_MARCH", "native")
ONLY = os.environ.get("DFLASH_ONLY")  # developers: rebuild just pyx/<ONLY>.pyx

# Reassociation lets gcc vectorise float reductions; deliberately NOT -ffast-math, whose
# -ffinite-math-only would break the -inf masks and NaN checks the kernels rely on.
FLOAT_FLAGS = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]


def _openmp_flags():
    """Return (compile, link) OpenMP flags if the compiler accepts them, else ([], [])."""
    import distutils.ccompiler  # noqa: F401  (setuptools provides the shim)
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
    extensions = [
        Extension(
            f"dflash_kernels._cython.{pyx.stem}",
            [str(pyx.relative_to(HERE))],
            include_dirs=[np.get_include(), str(HERE / "pyx")],
            extra_compile_args=["-O3", f"-march={MARCH}", *FLOAT_FLAGS, *omp_compile],
            extra_link_args=omp_link,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for pyx in sorted((HERE / "pyx").glob("*.pyx"))
        if ONLY is None or pyx.stem == ONLY
    ]
    return cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "nonecheck": False,
        },
    )


class OptionalBuildExt(build_ext):
    """A failed compile leaves the pure-Python backends usable unless DFLASH_REQUIRE_CYTHON=1."""

    def run(self):
        try:
            super().run()
        except Exception as err:
            if REQUIRE_CYTHON:
                raise
            print(f"dflash_kernels: Cython build failed ({err}); using Numba/torch backends", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as err:
            if REQUIRE_CYTHON:
                raise
            print(f"dflash_kernels: could not build {ext.name} ({err})", file=sys.stderr)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
