"""Gated DeltaNet ops vs their torch peers at Qwen3.5-9B shapes (16 key heads, 32 value heads, 128 x 128 state).

Peers: the torch reference recurrence in float32 for decode (T=1) and verification (T=16), the torch
chunked reference for prefill (T=512). Restoring a prefix after verification is a state copy.

Goals vs results (2026-12-02, docs/benchmarks.md): cython decode 6.4x and 16-token verification 12x the
torch reference (goal 5x: met); numba decode 1.8x (missed; Numba's code for the state update does not
vectorise like the Cython C block).
"""

import pytest
import torch

import dflash_kernels.linear_attention as la
from benchsupport import KERNELS, THREADS, record
from dflash_kernels.reference import linear_attention as ref
from shapes import BLOCK

HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4  # Qwen3.5-9B linear_attention layers (docs/models.md 2.2)
CONV_DIM = 2 * HK * DK + HV * DV  # 8192 channels [q | k | v]
NAME = "Qwen3.5-9B GDN"


def gdn_inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, HK, DK, generator=g), torch.randn(T, HK, DK, generator=g)
    v = torch.randn(T, HV, DV, generator=g)
    decay = -torch.rand(T, HV, generator=g) * 0.5
    beta = torch.rand(T, HV, generator=g)
    state = torch.randn(HV, DK, DV, generator=g) * 0.1
    return q, k, v, decay, beta, state


def gdn_flops(T):
    return 7.0 * T * HV * DK * DV  # decay 1, S^T k 2, update 2, S^T q 2 per state element


@pytest.mark.parametrize("T", [1, BLOCK], ids=["decode", "verify16"])
def test_gated_delta_rule(benchmark, contender, T):
    q, k, v, g, beta, state = gdn_inputs(T)
    if contender == "torch-peer":
        fn = lambda: ref.gated_delta_rule(q, k, v, g, beta, state)  # noqa: E731
    else:
        fn = lambda: la.gated_delta_rule(q, k, v, g, beta, state, backend=contender, n_threads=THREADS)  # noqa: E731
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, flops=gdn_flops(T), bytes_moved=2 * state.numel() * 4, shape=f"{NAME} T={T}")


@pytest.mark.parametrize("contender,buffer", [("torch-peer", "fresh")]
                         + [(c, b) for c in KERNELS for b in ("fresh", "reused")])
def test_gated_delta_rule_checkpoints(benchmark, contender, buffer):
    """Verification with the state after every token kept (16 x 2 MiB per layer)."""
    q, k, v, g, beta, state = gdn_inputs(BLOCK)
    out = torch.empty(BLOCK, HV, DK, DV) if buffer == "reused" else None
    if contender == "torch-peer":
        slots = torch.arange(BLOCK)
        fn = lambda: ref.gated_delta_rule(q, k, v, g, beta, state, slots)  # noqa: E731
    else:
        fn = lambda: la.gated_delta_rule(q, k, v, g, beta, state, checkpoints=True, checkpoints_out=out,  # noqa: E731
                                         backend=contender, n_threads=THREADS)
    fn()
    benchmark(fn)
    record(benchmark, flops=gdn_flops(BLOCK), bytes_moved=(2 + BLOCK) * state.numel() * 4,
           shape=f"{NAME} T={BLOCK} checkpoints")


def test_restore_prefix(benchmark):
    """Restoring the accepted prefix: copy one checkpoint (2 MiB) into the live state."""
    q, k, v, g, beta, state = gdn_inputs(BLOCK)
    _, ckpts = la.gated_delta_rule(q, k, v, g, beta, state, checkpoints=True)
    benchmark(lambda: state.copy_(ckpts[7]))
    record(benchmark, bytes_moved=2 * state.numel() * 4, shape=f"{NAME} restore")


@pytest.mark.parametrize("contender,form", [("torch-peer", "auto")]  # the torch peer is the chunked reference
                         + [(c, f) for c in KERNELS for f in ("auto", "chunk64")])
def test_gated_delta_rule_prefill(benchmark, contender, form):
    T = 512
    q, k, v, g, beta, state = gdn_inputs(T)
    if contender == "torch-peer":
        fn = lambda: ref.chunk_gated_delta_rule(q, k, v, g, beta, state)  # noqa: E731
    else:
        chunk = None if form == "auto" else 64
        fn = lambda: la.gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk, backend=contender,  # noqa: E731
                                         n_threads=THREADS)
    fn()
    benchmark(fn)
    record(benchmark, flops=gdn_flops(T), shape=f"{NAME} prefill T={T} {form}")


@pytest.mark.parametrize("T", [1, BLOCK], ids=["decode", "verify16"])
def test_causal_conv1d(benchmark, contender, T):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, CONV_DIM, generator=gen)
    w = torch.randn(CONV_DIM, CONV_K, generator=gen)
    conv_state = torch.randn(CONV_DIM, CONV_K - 1, generator=gen)
    if contender == "torch-peer":
        fn = lambda: ref.causal_conv1d(x, w, conv_state)  # noqa: E731
    else:
        fn = lambda: la.causal_conv1d(x, w, conv_state, backend=contender, n_threads=THREADS)  # noqa: E731
    fn()
    benchmark(fn)
    record(benchmark, bytes_moved=(2 * x.numel() + w.numel() + 2 * conv_state.numel()) * 4,
           shape=f"{NAME} conv T={T}")


def test_gated_rms_norm(benchmark, contender):
    gen = torch.Generator().manual_seed(2)
    x, z = torch.randn(BLOCK, HV, DV, generator=gen), torch.randn(BLOCK, HV, DV, generator=gen)
    w = torch.ones(DV)
    if contender == "torch-peer":
        fn = lambda: ref.gated_rms_norm(x, z, w, eps=1e-6)  # noqa: E731
    else:
        fn = lambda: la.gated_rms_norm(x, z, w, 1e-6, backend=contender, n_threads=THREADS)  # noqa: E731
    fn()
    benchmark(fn)
    record(benchmark, bytes_moved=3 * x.numel() * 4, shape=f"{NAME} norm T={BLOCK}")
