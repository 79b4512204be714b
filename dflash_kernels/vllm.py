"""vLLM general plugin: vLLM's CPU path runs this library's linear layers and greedy acceptance.

vLLM calls ``register`` in every process it starts (entry point group ``vllm.general_plugins``,
declared in pyproject.toml). The plugin stays inert unless all of these hold:

- ``DFLASH_VLLM=1`` in the environment (it is off by default, so installing this library never
  changes what vLLM computes);
- vLLM runs on its CPU platform;
- the installed vLLM is a version the plugin was tested against (``TESTED_VLLM``). On any other
  version it logs one line and changes nothing, rather than patch code it has not seen.

When active it routes:

- **Unquantized linear layers** (every projection and the LM head). vLLM picks a per-layer CPU GEMM
  at load (``dispatch_cpu_unquantized_gemm`` sets ``layer.cpu_linear``); the plugin wraps that
  function so that float32 and bf16 weights are packed once (``pack_weight``) and run through
  ``torch.ops.dflash.linear_packed``, a torch custom op, so that vLLM's torch.compile mode traces
  through it. Precision follows vLLM's dtype: bf16 runs as "medium" (bf16 products, fp32 sums:
  what vLLM's own bf16 GEMMs compute, in another order), float32 as "highest" (exact fp32).
  Other dtypes and shapes keep vLLM's choice.
- **Greedy acceptance** of a speculative round. vLLM's kernel registry
  (``vllm.triton_utils.dispatcher.register_kernels``, its sanctioned way to replace a kernel on a
  platform without Triton) gets ``accept_greedy`` for ``rejection_greedy_sample_kernel``. The CPU
  platform registers its own C++ fallbacks after the plugins load, so the plugin registers right
  after the platform does.

Not routed, and why: vLLM's random-sampling acceptance draws its recovered tokens in a separate
kernel with each request's own generator, so one-pass ``rejection_sample`` would change what a
seeded request emits; attention, drafter and target alike, reads vLLM's paged KV cache through
block tables, a layout the attention kernels here do not take. Both stay vLLM's.

Kernel threads: ``DFLASH_NUM_THREADS`` if set, else torch's thread count in vLLM's worker when it
loads the weights (what ``VLLM_CPU_OMP_THREADS_BIND`` gave it), so both libraries use the same cores.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

from .dense import PackedWeight, linear, prepare_weight  # loaded with the package already: free here

ENABLE_ENV = "DFLASH_VLLM"
TESTED_VLLM = ("0.32.0",)
GREEDY_KERNEL = "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel"

log = logging.getLogger("vllm.dflash_kernels")  # under vLLM's logger: its handlers and format
_active = False
_routed = {"linear_layers": 0, "greedy_rounds": 0}


def stats() -> dict:
    """This process's plugin state: ``active``, linear layers routed, greedy acceptance calls run."""
    return {"active": _active, **_routed}


def enabled() -> bool:
    """Whether the environment asks for the plugin (``DFLASH_VLLM=1``)."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The ``vllm.general_plugins`` entry point. vLLM may call it more than once per process."""
    global _active
    if _active or not enabled():
        return
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        log.info("dflash_kernels plugin: vLLM runs on %s, not CPU; inert", current_platform.device_type)
        return
    if vllm.__version__ not in TESTED_VLLM:
        log.warning("dflash_kernels plugin: vLLM %s is untested (tested: %s); inert, vLLM runs as it is",
                    vllm.__version__, ", ".join(TESTED_VLLM))
        return
    _route_linear_layers()
    _route_greedy_acceptance(type(current_platform))
    _active = True
    from . import active_tier

    log.info("dflash_kernels plugin: linear layers and greedy acceptance run on dflash_kernels (tier %s)",
             active_tier())


# ---- linear layers -------------------------------------------------------------------------------

def _route_linear_layers() -> None:
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if not route_linear(layer, remove_weight):
            original(layer, remove_weight)

    # linear.py and vocab_parallel_embedding.py import it from this module when they load weights
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def route_linear(layer, remove_weight: bool) -> bool:
    """Give ``layer`` (a vLLM linear or LM-head layer with a 2-D ``weight``) a ``cpu_linear`` that
    runs this library's packed linear. Returns False, changing nothing, for weights it does not take
    (meta, not 2-D, not float32 or bf16, empty) or where no compiled kernels run here."""
    import torch

    w = layer.weight
    if w.is_meta or w.ndim != 2 or w.dtype not in (torch.float32, torch.bfloat16) or not w.numel():
        return False
    packed = prepare_weight(w.detach())
    if not isinstance(packed, PackedWeight):  # no Cython kernels: vLLM's GEMM is the better one
        return False
    n, k = packed.shape
    layer.cpu_linear = functools.partial(cpu_linear, prepared=packed, packed=packed.to_tensor(), n=n, k=k,
                                         finite=packed.finite,
                                         precision="medium" if w.dtype == torch.bfloat16 else "highest",
                                         n_threads=_threads())
    if remove_weight:  # as vLLM's own dispatch does: the packed copy is the weight now
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    _routed["linear_layers"] += 1
    return True


def _threads() -> int:
    """DFLASH_NUM_THREADS if set, else torch's thread count here: in vLLM's worker at load time, the
    cores VLLM_CPU_OMP_THREADS_BIND gave it."""
    import torch

    from ._threads import default_threads

    return default_threads() if os.environ.get("DFLASH_NUM_THREADS") else torch.get_num_threads()


def cpu_linear(x, weight, bias, *, prepared, packed, n: int, k: int, finite: bool, precision: str, n_threads: int):
    """vLLM's ``cpu_linear(x, weight, bias)``; ``weight`` is unused (the packed copy is read).

    Traced (vLLM's torch.compile mode), it is the op ``torch.ops.dflash.linear_packed``, opaque to
    dynamo. Run eagerly it calls ``linear`` on the prepared weight: the same kernel without the
    dispatcher's round trip into the custom op and the rebuilt ``PackedWeight`` (bench/vllm_linear.py
    prints both costs per call)."""
    import torch

    if torch.compiler.is_compiling():
        y = torch.ops.dflash.linear_packed(x, packed, n, k, finite, bias, precision, n_threads)
    else:
        y = linear(x, prepared, bias, precision=precision, n_threads=n_threads)
    return y if y.dtype == x.dtype else y.to(x.dtype)


# ---- greedy acceptance ---------------------------------------------------------------------------

def _route_greedy_acceptance(platform_cls) -> None:
    original = platform_cls.register_triton_kernel_overrides  # a bound classmethod

    def register_triton_kernel_overrides(cls) -> None:
        original()
        from vllm.triton_utils.dispatcher import register_kernels

        quiet = logging.getLogger("vllm.triton_utils.dispatcher")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # "already registered, overwriting" is this plugin's intent
        try:
            register_kernels({GREEDY_KERNEL: greedy_sample_kernel})
        finally:
            quiet.setLevel(level)

    platform_cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


def greedy_sample_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                         is_greedy, max_spec_len, uniform_probs=None, synthetic_conditional_rates=None,
                         SYNTHETIC_MODE=False):  # noqa: N803 (vLLM's kernel argument name)
    """vLLM's ``rejection_greedy_sample_kernel`` contract on ``accept_greedy``: for each request
    whose row ``is_greedy`` marks (all when None), write the accepted drafts, then the target's
    token at the first mismatch or the bonus token, into ``output_token_ids`` (B, max_spec_len + 1)."""
    import torch

    from .acceptance import accept_greedy

    if SYNTHETIC_MODE:
        raise NotImplementedError("synthetic acceptance rates are not supported by the dflash_kernels plugin")
    ends = cu_num_draft_tokens.cpu().numpy().astype(np.int64)
    b_sz, k = len(ends), int(max_spec_len)
    num_draft = np.diff(ends, prepend=0)
    used = np.arange(k) < num_draft[:, None]  # (B, K): row-major order = the flat token order
    drafts = np.zeros((b_sz, k), np.int64)
    drafts[used] = draft_token_ids.cpu().numpy()
    targets = np.zeros((b_sz, k + 1), np.int64)
    targets[:, :k][used] = target_argmax.cpu().numpy()
    targets[np.arange(b_sz), num_draft] = bonus_token_ids.reshape(-1).cpu().numpy()
    _, out = accept_greedy(drafts, targets, num_draft)
    _routed["greedy_rounds"] += 1
    out = torch.from_numpy(out).to(output_token_ids.dtype)
    if is_greedy is None:
        output_token_ids[:, :k + 1] = out
    else:
        rows = is_greedy.cpu()
        output_token_ids[rows, :k + 1] = out[rows]
