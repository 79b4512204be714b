"""Dense ops vs their torch peers at real model shapes.

linear has two peers, selected by `weights`: with bf16 weights the torch peer is bf16 F.linear, with
fp32 weights fp32 F.linear (MKL); our kernels read the same stored weights. `test_stream_read` is
the memory roofline for the M=1 rows: a parallel streaming read of a buffer of the weights' size,
measured in the same run.

Goals vs results (2026-12-02, docs/benchmarks.md): M=1 bf16 4096x4096 is 1.47x torch bf16 (goal 2x:
missed; torch bf16 uses AVX512-BF16 here) and reads at 143% of the streaming-read figure (goal 80%:
met; the 33.5 MB buffer is partly L3-resident). M=16 is 1.22-1.34x torch fp32 (goal 2.5x: missed; the
kernel is compute-bound at 129-141 GFLOP/s vs ~106 for MKL) and 0.3x torch bf16 (goal 7x: impossible
against AMX without an AMX path of our own).
"""

import time
from functools import lru_cache

import numpy as np
import pytest
import torch
from numba import njit, prange

import dflash_kernels as dk
from benchsupport import THREADS, record
from dflash_kernels.runtime import numba_threads
from shapes import BLOCK, QWEN3_0_6B, QWEN3_8B

# (name, N, K) of the weight matrices: attention q/o projection and the MLP up projection.
LINEAR_SHAPES = [
    (f"{QWEN3_8B.name} q_proj", QWEN3_8B.heads * QWEN3_8B.head_dim, QWEN3_8B.hidden),
    (f"{QWEN3_8B.name} up_proj", QWEN3_8B.intermediate, QWEN3_8B.hidden),
    (f"{QWEN3_0_6B.name} q_proj", QWEN3_0_6B.heads * QWEN3_0_6B.head_dim, QWEN3_0_6B.hidden),
    (f"{QWEN3_0_6B.name} up_proj", QWEN3_0_6B.intermediate, QWEN3_0_6B.hidden),
]
LINEAR_IDS = [s[0].replace(" ", "-") for s in LINEAR_SHAPES]


@lru_cache(maxsize=2)
def _weights(n, k, dtype):
    w = torch.empty(n, k).uniform_(-0.05, 0.05)
    return w.bfloat16() if dtype == "bf16" else w


def _pedantic_if_slow(benchmark, fn, seconds):
    """torch's bf16 matmul takes seconds on CPUs without AMX: a few fixed rounds instead of calibration."""
    if seconds > 0.2:
        benchmark.pedantic(fn, rounds=3, iterations=1)
    else:
        benchmark(fn)


@pytest.mark.parametrize("weights", ["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, BLOCK])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=LINEAR_IDS)
def test_linear(benchmark, contender, shape, m, weights):
    name, n, k = shape
    w = _weights(n, k, weights)
    x = torch.randn(m, k)
    if contender == "torch-peer":
        xp = x.to(w.dtype)
        def fn():
            return torch.nn.functional.linear(xp, w)
    else:
        def fn():
            return dk.linear(x, w, backend=contender, n_threads=THREADS)
    if benchmark.disabled:  # smoke run: one call (torch's bf16 matmul alone takes seconds on AVX2 CPUs)
        benchmark(fn)
    else:
        t0 = time.perf_counter()
        fn()  # warm-up (JIT, page-in)
        _pedantic_if_slow(benchmark, fn, time.perf_counter() - t0)
    record(benchmark, flops=2.0 * m * n * k, bytes_moved=w.numel() * w.element_size() + 4.0 * m * (n + k),
           shape=f"{name} M={m} {weights} weights", peer=f"torch {weights} F.linear")


@njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc"})
def _stream_sum(words, n_chunks):
    """Parallel read of a buffer seen as float32 (a vectorised sum: the read is the only cost)."""
    per = (words.shape[0] + n_chunks - 1) // n_chunks
    part = np.zeros(n_chunks, np.float32)
    for c in prange(n_chunks):
        s = np.float32(0.0)
        for i in range(c * per, min(words.shape[0], (c + 1) * per)):
            s += words[i]
        part[c] = s
    return part.sum()


@pytest.mark.parametrize("reader", ["numba-parallel", "numpy-sum"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES[:2], ids=LINEAR_IDS[:2])
def test_stream_read(benchmark, shape, reader):
    """Memory roofline for M=1: read a buffer as large as the bf16 weights (THREADS threads, or
    numpy's single-threaded sum as a second opinion)."""
    name, n, k = shape
    buf = _weights(n, k, "bf16").view(torch.int16).numpy().view(np.float32).reshape(-1)
    if reader == "numpy-sum":
        buf.sum()
        benchmark(buf.sum)
    else:
        with numba_threads(THREADS):
            _stream_sum(buf, 8 * THREADS)  # warm-up (JIT)
            benchmark(_stream_sum, buf, 8 * THREADS)
    record(benchmark, bytes_moved=buf.nbytes, shape=f"{name} bf16 weights, streaming read")


@pytest.mark.parametrize("m", [1, BLOCK])
def test_rms_norm(benchmark, contender, m):
    h = QWEN3_8B.hidden
    x, w = torch.randn(m, h), torch.rand(h) + 0.5
    if contender == "torch-peer":  # Qwen3RMSNorm's forward in fp32
        def fn():
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    else:
        def fn():
            return dk.rms_norm(x, w, 1e-6, backend=contender, n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, bytes_moved=x.numel() * 8 + h * 4, shape=f"{QWEN3_8B.name} [{m} x {h}]")


@pytest.mark.parametrize("m", [1, BLOCK])
def test_rms_norm_residual(benchmark, contender, m):
    h = QWEN3_8B.hidden
    x, res, w = torch.randn(m, h), torch.randn(m, h), torch.rand(h) + 0.5

    def peer():
        r = x + res
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * w, r

    fn = peer if contender == "torch-peer" else lambda: dk.rms_norm(x, w, 1e-6, residual=res, backend=contender,
                                                                    n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, bytes_moved=x.numel() * 16 + h * 4, shape=f"{QWEN3_8B.name} [{m} x {h}] + residual")


@pytest.mark.parametrize("t", [1, BLOCK])
def test_apply_rope(benchmark, contender, t):
    heads, d = QWEN3_8B.heads, QWEN3_8B.head_dim
    x, pos = torch.randn(t, heads, d), torch.arange(4096, 4096 + t)

    def peer():  # HF Qwen3: cos/sin from fp32 inv_freq per forward, then rotate_half
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        emb = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * cos + rot * sin

    fn = peer if contender == "torch-peer" else lambda: dk.apply_rope(x, pos, 1e6, backend=contender,
                                                                     n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, bytes_moved=x.numel() * 8, shape=f"{QWEN3_8B.name} q [{t} x {heads} x {d}]")


@pytest.mark.parametrize("m", [1, BLOCK])
def test_silu_and_mul(benchmark, contender, m):
    x = torch.randn(m, 2 * QWEN3_8B.intermediate)
    if contender == "torch-peer":
        def fn():
            return torch.nn.functional.silu(x[:, : QWEN3_8B.intermediate]) * x[:, QWEN3_8B.intermediate :]
    else:
        def fn():
            return dk.silu_and_mul(x, backend=contender, n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, bytes_moved=x.numel() * 4 * 1.5, shape=f"{QWEN3_8B.name} M={m}")
