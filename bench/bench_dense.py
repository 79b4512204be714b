"""Dense ops vs their torch peers at real model shapes."""

import numpy as np
import pytest
import torch

import dflash_kernels as dk
from benchsupport import THREADS, record
from shapes import BLOCK, QWEN3_8B


@pytest.mark.parametrize("m", [1, BLOCK])
def test_silu_and_mul(benchmark, contender, m):
    x = torch.randn(m, 2 * QWEN3_8B.intermediate)
    if contender == "torch-peer":
        fn = lambda: torch.nn.functional.silu(x[:, : QWEN3_8B.intermediate]) * x[:, QWEN3_8B.intermediate :]
    else:
        fn = lambda: dk.silu_and_mul(x, backend=contender, n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    record(benchmark, bytes_moved=x.numel() * 4 * 1.5, shape=f"{QWEN3_8B.name} M={m}")
