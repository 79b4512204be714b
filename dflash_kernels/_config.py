"""dflash_kernels.show_config(): what runs here and how fast it can go."""

from __future__ import annotations

import platform
import sys

from ._backends import BACKENDS, backend_error
from ._threads import default_threads


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_summary() -> str:
    flags = _cpu_flags()
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    have = [f for f in wanted if f in flags]
    return " ".join(have) if have else "unknown (no /proc/cpuinfo flags)"


def _block_linear_path() -> str:
    try:
        from ._cython.dense import amx_available
    except ImportError:
        return "FMA (no Cython kernels)"
    return "AMX-BF16 tiles (fp32-exact 3-part activations)" if amx_available() else "FMA"


def config_lines() -> list[str]:
    import numba
    import numpy
    import torch

    from . import __version__

    lines = [f"dflash_kernels {__version__}", f"python {sys.version.split()[0]} on {platform.machine()}"]
    for b in BACKENDS:
        err = backend_error(b)
        lines.append(f"backend {b:7s} {'available' if err is None else f'unavailable: {err}'}")
    lines += [
        f"cpu ISA: {isa_summary()}",
        f"linear, bf16 weights, M > 4 rows: {_block_linear_path()}",
        f"threads: default {default_threads()}, numba pool {numba.config.NUMBA_NUM_THREADS}, "
        f"torch {torch.get_num_threads()}",
        f"numpy {numpy.__version__}, numba {numba.__version__}, torch {torch.__version__}",
    ]
    return lines


def show_config() -> None:
    """Print backends, ISA, thread counts and versions."""
    print("\n".join(config_lines()))
