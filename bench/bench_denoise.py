"""Drafter token choice (denoise_block) vs torch at the drafter shape.

Qwen3-8B-DFlash-b16: 16 block rows x 4096 against the target's 151936 x 4096 bf16 LM head. The torch
peer runs fp32 F.linear on an fp32 copy of the head (bf16 matmul is ~100x slower on this CPU) + argmax.
The smoke run (benchmarks disabled) uses a vocabulary slice to stay under the memory budget.
"""

import pytest
import torch

import dflash_kernels as dk
from benchsupport import THREADS, record
from shapes import BLOCK, DFLASH_QWEN3_8B

H = DFLASH_QWEN3_8B.hidden


@pytest.fixture(scope="module")
def drafter_head(request):
    opt = request.config.getoption
    smoke = opt("benchmark_disable", False) and not opt("benchmark_enable", False)
    v = DFLASH_QWEN3_8B.vocab // (16 if smoke else 1)
    g = torch.Generator().manual_seed(0)
    lm_head = torch.empty(v, H, dtype=torch.bfloat16)
    for i in range(0, v, 16384):  # fill in slices: no full-size fp32 temporary
        lm_head[i:i + 16384] = torch.randn(min(16384, v - i), H, generator=g) * 0.02
    hidden = torch.randn(BLOCK, H, generator=g)
    return hidden, lm_head, lm_head.float()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_denoise_block(benchmark, contender, drafter_head, temperature):
    hidden, lm_head, lm_head_f32 = drafter_head
    if contender == "torch-peer":
        if temperature == 0:
            def fn():
                return torch.nn.functional.linear(hidden, lm_head_f32).argmax(-1)
        else:
            g = torch.Generator().manual_seed(1)
            def fn():
                return torch.multinomial(
                    torch.softmax(torch.nn.functional.linear(hidden, lm_head_f32) / temperature, -1), 1, generator=g)
    else:
        def fn():
            return dk.denoise_block(hidden, lm_head, temperature=temperature, generator=1, backend=contender,
                                    n_threads=THREADS)
    fn()  # warm-up (JIT)
    benchmark(fn)
    v = lm_head.shape[0]
    record(benchmark, flops=2.0 * BLOCK * v * H, bytes_moved=v * H * 2,
           shape=f"{DFLASH_QWEN3_8B.name} 16x{H} head {v}x{H} bf16 T={temperature}")
