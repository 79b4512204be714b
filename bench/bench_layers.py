"""One decoder layer: the fused kernel (one compiled call) against the composition of the single ops.

Both compute the same bits (tests/test_layers.py); the difference is the work between kernels (Python
wrappers, checks, allocations), which decides small models and decode steps. Shapes: the shipped
target (hidden 256), SmolLM2-135M (576) and Qwen3-1.7B (2048), bf16 weights, a 256-position cache,
decode (1 row) and verification (16 rows). Results: docs/benchmarks.md.
"""

import numpy as np
import pytest

import dflash_kernels as dk
from benchsupport import THREADS, record
from dflash_kernels import f32_to_bf16
from dflash_kernels.layers import compose_qwen3_layer
from shapes import BLOCK, QWEN3_1_7B, SHIPPED_TARGET, SMOLLM2_135M

CONTEXT = 256
SHAPES = [SHIPPED_TARGET, SMOLLM2_135M, pytest.param(QWEN3_1_7B, marks=pytest.mark.timed_only)]


def _layer(m):
    rng = np.random.default_rng(0)
    qd, kvd = m.heads * m.head_dim, m.kv_heads * m.head_dim

    def w(*shape):
        return f32_to_bf16((rng.standard_normal(shape) * 0.05).astype(np.float32))

    weights = {
        "input_layernorm.weight": np.ones(m.hidden, np.float32),
        "post_attention_layernorm.weight": np.ones(m.hidden, np.float32),
        "self_attn.q_proj.weight": w(qd, m.hidden), "self_attn.k_proj.weight": w(kvd, m.hidden),
        "self_attn.v_proj.weight": w(kvd, m.hidden), "self_attn.o_proj.weight": w(m.hidden, qd),
        "self_attn.q_norm.weight": np.ones(m.head_dim, np.float32),
        "self_attn.k_norm.weight": np.ones(m.head_dim, np.float32),
        "mlp.gate_proj.weight": w(m.intermediate, m.hidden), "mlp.up_proj.weight": w(m.intermediate, m.hidden),
        "mlp.down_proj.weight": w(m.hidden, m.intermediate),
    }
    return dk.prepare_qwen3_layer(weights, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                                  head_dim=m.head_dim)


@pytest.mark.skipif("cython" not in dk.available_backends(), reason="the fused kernel is Cython's")
@pytest.mark.parametrize("rows", [1, BLOCK])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda m: m.name)
@pytest.mark.parametrize("how", ["fused", "composed"])
def test_qwen3_layer(benchmark, how, shape, rows):
    layer = _layer(shape)
    x = np.random.default_rng(1).standard_normal((rows, shape.hidden)).astype(np.float32)
    kc = np.zeros((CONTEXT + rows, shape.kv_heads, shape.head_dim), np.float32)
    vc = np.zeros_like(kc)
    if how == "fused":
        def step():
            return dk.qwen3_layer(x, layer, kc, vc, CONTEXT, n_threads=THREADS)
    else:
        def step():
            return compose_qwen3_layer(x, layer, kc, vc, CONTEXT, n_threads=THREADS, backend="cython")
    benchmark(step)
    weights = sum(getattr(layer, n).nbytes for n in ("w_qkv", "w_o", "w_gate_up", "w_down"))
    record(benchmark, bytes_moved=weights, flops=2.0 * rows * weights / 2)
