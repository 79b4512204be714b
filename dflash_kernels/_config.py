"""dflash_kernels.show_config(): what runs here and how fast it can go."""

from __future__ import annotations

import platform
import sys

from . import _isa
from ._backends import BACKENDS, backend_error, resolve, tier_built
from ._precision import PRECISIONS, bf16_dot_of, get_matmul_precision
from ._threads import default_threads


def isa_summary() -> str:
    flags = _isa.cpu_flags()
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    have = [f for f in wanted if f in flags]
    return " ".join(have) if have else "unknown (no /proc/cpuinfo flags)"


def tier_lines() -> list[str]:
    """The ISA tier: what the machine has, the cap, what runs, and the path each matmul takes."""
    built = [t for t in (*_isa.TIERS, _isa.NATIVE) if tier_built("dense", t)]
    lines = [
        f"ISA tier: machine {_isa.machine_tier() or 'below avx2'}, cap {_isa.current_cap() or 'none'} "
        f"(DFLASH_ISA / set_isa), running {_isa.active_tier() or 'none'}; compiled tiers: "
        f"{', '.join(built) or 'none'}",
    ]
    try:
        name, dense = resolve("cython", "dense")
    except RuntimeError as err:
        return [*lines, f"Cython kernels unavailable ({err}): ops run on Numba or torch"]
    prec = get_matmul_precision()
    parts = PRECISIONS[prec]
    lines.append(f"cython module tier: {dense.TIER}; matmul precision: {prec} (set_matmul_precision)")
    for rows, what in ((1, "decode"), (16, "verify/draft block"), (512, "prefill chunk")):
        paths = {p: dense.path_name(rows, 4096, 4096, True, PRECISIONS[p]) for p in PRECISIONS}
        lines.append(f"linear bf16 weights, M={rows} ({what}): "
                     + ", ".join(f"{p} -> {v}" for p, v in paths.items()))
    lines.append(f"linear fp32 weights, M=16: {dense.path_name(16, 4096, 4096, False, parts)}")
    for rows in (1, 16):
        paths = {p: dense.packed_path_name(rows, True, PRECISIONS[p]) for p in PRECISIONS}
        lines.append(f"linear bf16 weights packed (dk.prepare_weight, as the model layer holds them), M={rows}: "
                     + ", ".join(f"{p} -> {v}" for p, v in paths.items()))
    lines.append("linear GGUF blocks (dk.pack_quantized; load(..., gguf_dtype=\"blocks\")), every M and precision: "
                 f"{dense.packed_path_name(1, 2)} (bit-identical to their float32 expansion); Q4 blocks times int8 "
                 f"activations (gguf_dtype=\"blocks-int8\"): {dense.packed_path_name(1, 4)}")
    from ._autotune import cache_file, delegated_entries

    entries = sorted(delegated_entries(default_threads()))
    lines.append(f"linear shapes delegated to torch here (tune_linear / dflash tune-kernels, {cache_file()}): "
                 + (", ".join(entries) if entries else "none"))
    dot = bf16_dot_of(dense)
    medium = f"{dot} on bf16 pair words" if dot else "FMA on operands rounded to bf16"
    highest = ("AMX tiles on three exact bf16 parts of the queries and P over a bf16 cache, fma over a "
               "float32 one" if dense.amx_available() else "fma")
    lines.append(f"attention \"medium\": {dense.TIER}:{medium}; \"highest\" / \"high\": {dense.TIER}:{highest}; "
                 f"decode steps (<= 4 query rows per kv head): {dense.TIER}:fma on K/V read in place")
    lines.append("drafter precision (model.load's draft_precision=\"auto\"): "
                 + ("medium: a bf16 dot product runs it here" if dot
                    else "the target's: no bf16 dot product pays here"))
    lines.append(f"attention, denoise_block, norms, RoPE, linear attention: {dense.TIER} vectors "
                 f"({'16' if dense.TIER != 'avx2' else '8'}-float FMA where the compiler vectorises)")
    return lines


def fast_path_line() -> str:
    """Whether the public ops' compiled fast path (dflash_kernels/_fastpath.py) is there."""
    from ._fastpath import FAST, _NoFast

    if isinstance(FAST, _NoFast):
        return "public ops' checks: Python only (no compiled fast path: no Cython build)"
    return ("public ops' checks: compiled fast path (pyx/fastpath.pyx) for numpy arrays and CPU tensors with "
            "backend \"auto\" on Cython; Python checks for the rest")


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
        f"cpu: {_isa.cpu_model()}; ISA flags: {isa_summary()}",
        *tier_lines(),
        fast_path_line(),
        f"threads: default {default_threads()}, numba pool {numba.config.NUMBA_NUM_THREADS}, "
        f"torch {torch.get_num_threads()}",
        f"numpy {numpy.__version__}, numba {numba.__version__}, torch {torch.__version__}",
    ]
    return lines


def show_config() -> None:
    """Print backends, ISA, thread counts and versions."""
    print("\n".join(config_lines()))
