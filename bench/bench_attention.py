"""Attention vs torch SDPA at the Qwen3-8B / DFlash drafter shape (32/8 heads x 128).

Peer: torch.nn.functional.scaled_dot_product_attention on the [1, H, L, D] layout with
enable_gqa=True; cached verification gets an explicit bottom-right boolean mask (SDPA's is_causal
aligns top-left). Smoke runs (without --benchmark-enable) use only the smallest context.

Goals vs results (2026-12-02, docs/benchmarks.md has the run and the command): the 16-query goals
(>= 3x SDPA at 4096 keys) are missed: cython reaches 1.8x over fp32 SDPA at 135-150 GFLOP/s (3x would
need ~240 GFLOP/s of fp32 FMA on 2 cores), and 0.6x against bf16 SDPA, which uses AMX/AVX512-BF16 on
this Xeon while our kernels upcast bf16 to fp32. Decode (1 query, 4096 keys) meets 3x with fp32 K/V
(4.4x, 33 GB/s of KV) and misses it by 8% with bf16 K/V (2.75x).
"""

import pytest
import torch

import dflash_kernels as dk
from benchsupport import THREADS, record
from shapes import BLOCK, CONTEXTS, DFLASH_QWEN3_8B as M

# Contexts beyond the smallest run only when timing (--benchmark-enable): the smoke run in the test
# suite deselects them (bench/conftest.py) to stay fast.
SMOKE_CONTEXTS = [c if c == CONTEXTS[0] else pytest.param(c, marks=pytest.mark.timed_only) for c in CONTEXTS]


def _kv(t_kv, dtype):
    g = torch.Generator().manual_seed(t_kv)
    k = torch.randn(t_kv, M.kv_heads, M.head_dim, generator=g).to(dtype)
    v = torch.randn(t_kv, M.kv_heads, M.head_dim, generator=g).to(dtype)
    return k, v


def _sdpa(q, k, v, mask=None):
    """q (T_q, H_q, D), k/v (T_kv, H_kv, D) -> (T_q, H_q, D) through SDPA's [1, H, L, D] layout."""
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # views, like a real caller
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def _flops(t_q, t_kv):
    return 4.0 * t_q * t_kv * M.heads * M.head_dim


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t_ctx", SMOKE_CONTEXTS)
def test_injected_kv_attention(benchmark, contender, t_ctx, dtype):
    """Drafter layer: 16 block queries over [context | block], no mask."""
    tdt = getattr(torch, dtype)
    q = torch.randn(BLOCK, M.heads, M.head_dim)
    kc, vc = _kv(t_ctx, tdt)
    kb, vb = _kv(BLOCK, tdt)
    if contender == "torch-peer":
        k, v = torch.cat([kc, kb]), torch.cat([vc, vb])  # SDPA needs one tensor
        qp = q.to(tdt)
        def fn():
            return _sdpa(qp, k, v)
    else:
        def fn():
            return dk.injected_kv_attention(q, kc, vc, kb, vb, backend=contender, n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, flops=_flops(BLOCK, t_ctx + BLOCK), shape=f"{M.name} q{BLOCK} ctx{t_ctx} {dtype}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t_q,t_kv",
                         [(BLOCK, c) if c == CONTEXTS[0] else pytest.param(BLOCK, c, marks=pytest.mark.timed_only)
                          for c in CONTEXTS] + [(1, 4096)])
def test_cached_attention(benchmark, contender, t_q, t_kv, dtype):
    """Verification (16 queries, causal bottom-right over the cache) and decode (1 query)."""
    tdt = getattr(torch, dtype)
    q = torch.randn(t_q, M.heads, M.head_dim)
    k, v = _kv(t_kv, tdt)
    if contender == "torch-peer":
        mask = torch.ones(t_q, t_kv, dtype=torch.bool).tril(t_kv - t_q)  # bottom-right causal
        qp = q.to(tdt)
        def fn():
            return _sdpa(qp, k, v, mask if t_q > 1 else None)
    else:
        def fn():
            return dk.cached_attention(q, k, v, backend=contender, n_threads=THREADS)
    fn()
    benchmark(fn)
    record(benchmark, flops=_flops(t_q, t_kv), bytes_moved=2 * k.numel() * k.element_size(),
           shape=f"{M.name} q{t_q} kv{t_kv} {dtype}")
