"""Shapes of the real models the benchmarks are named after (facts: docs/models.md, docs/dflash.md)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


SMOLLM2_135M = ModelShape("SmolLM2-135M", 576, 1536, 30, 9, 3, 64, 49152)
SHIPPED_TARGET = ModelShape("shipped-target", 256, 768, 4, 4, 2, 64, 4160)  # model/default/target
QWEN3_0_6B = ModelShape("Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936)
QWEN3_1_7B = ModelShape("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936)
QWEN3_8B = ModelShape("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936)
# The 5-layer drafters of Qwen3-8B and Qwen3.5-9B: 32/8 heads x 128, hidden 4096.
DFLASH_QWEN3_8B = ModelShape("Qwen3-8B-DFlash-b16", 4096, 12288, 5, 32, 8, 128, 151936)
DFLASH_QWEN3_5_9B = ModelShape("Qwen3.5-9B-DFlash", 4096, 12288, 5, 32, 8, 128, 248320)

BLOCK = 16  # queries per drafting / verification round (block_size 16)
CONTEXTS = (1024, 4096, 16384)
