"""What the ops resolve at run time, named for engines, benchmarks and tools: the machine and its ISA
tiers, the threads, the backends, the matmul precisions, the user cache directory and where
``tune_linear`` keeps its results.

The ops resolve all of this themselves; these names are for callers that record it (``bench.json``),
set up a peer at the same tier (torch's ``ONEDNN_MAX_CPU_ISA``), call the compiled kernels of
``kernel_module`` directly (their ``parts`` argument is ``precision_parts(precision)``), or run Numba
code at the library's thread count.
"""

from __future__ import annotations

from ._autotune import cache_file as tuning_cache_file
from ._backends import resolve
from ._config import isa_summary
from ._env import user_cache_dir
from ._isa import ONEDNN_ISA, TIERS, active_tier, cpu_model, machine_tier
from ._precision import PRECISIONS, parts as precision_parts
from ._threads import default_threads, numba_threads

__all__ = ["ONEDNN_ISA", "PRECISIONS", "TIERS", "cpu_model", "default_threads", "isa_summary", "machine",
           "machine_tier", "numba_threads", "precision_parts", "resolve_backend", "tuning_cache_file",
           "user_cache_dir"]


def resolve_backend(backend: str | None, family: str) -> str:
    """The backend a kernel family ("dense", "attention", "denoise", "acceptance",
    "linear_attention") runs for ``backend`` ("auto", None = ``DFLASH_BACKEND`` or "auto", or a name)."""
    return resolve(backend, family)[0]


def machine() -> dict:
    """This machine as benchmarks record it: CPU model, the ISA flags that matter here, the highest
    tier the CPU has and the tier that runs (under ``DFLASH_ISA`` / ``set_isa``)."""
    return {"cpu": cpu_model(), "isa_flags": isa_summary(), "machine_tier": machine_tier(), "tier": active_tier()}
