"""The vLLM plugin's parts that need no vLLM: its greedy acceptance against vLLM's kernel contract,
the linear routing on a layer-shaped module, and staying inert when not asked for. Inside vLLM
(token identity, inert on other versions and platforms) the plugin is tested by tests_vllm/, in
vLLM's own environment (.ci/run)."""

import sys

import numpy as np
import pytest
import torch

from dflash_kernels import vllm as plugin

G = torch.Generator().manual_seed(0)


def reference_greedy(out, cu, drafts, argmax, bonus, is_greedy):
    """vLLM's rejection_greedy_sample_kernel, one request at a time."""
    start = 0
    for b, end in enumerate(cu.tolist()):
        if is_greedy is None or is_greedy[b]:
            for j in range(end - start):
                out[b, j] = argmax[start + j]
                if drafts[start + j] != argmax[start + j]:
                    break
            else:
                out[b, end - start] = bonus[b, 0]
        start = end


@pytest.mark.parametrize("trial", range(30))
def test_greedy_kernel_follows_vllms_contract(trial):
    rng = np.random.default_rng(trial)
    b_sz, k, vocab = int(rng.integers(1, 6)), int(rng.integers(1, 16)), 7  # a small vocab: drafts often match
    num_draft = rng.integers(0, k + 1, b_sz)
    cu = torch.tensor(np.cumsum(num_draft), dtype=torch.int32)
    n = int(num_draft.sum())
    argmax = torch.tensor(rng.integers(0, vocab, n))
    drafts = torch.where(torch.tensor(rng.random(n) < 0.8), argmax, torch.tensor(rng.integers(0, vocab, n)))
    bonus = torch.tensor(rng.integers(0, vocab, (b_sz, 1)))
    is_greedy = None if trial % 3 else torch.tensor(rng.random(b_sz) < 0.5)
    got = torch.full((b_sz, k + 1), -1, dtype=torch.int32)
    want = got.clone()
    before = plugin.stats()["greedy_rounds"]
    plugin.greedy_sample_kernel(got, cu, drafts, argmax, bonus, is_greedy, k)
    reference_greedy(want, cu, drafts, argmax, bonus, is_greedy)
    assert torch.equal(got, want)
    assert plugin.stats()["greedy_rounds"] == before + 1


def test_greedy_kernel_refuses_synthetic_mode():
    out = torch.full((1, 3), -1)
    with pytest.raises(NotImplementedError, match="synthetic"):
        plugin.greedy_sample_kernel(out, torch.tensor([2]), torch.tensor([1, 2]), torch.tensor([1, 2]),
                                    torch.tensor([[3]]), None, 2, SYNTHETIC_MODE=True)


class Layer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_linear_computes_the_layer(dtype):
    w = torch.randn(40, 72, generator=G).to(dtype)
    layer = Layer(w.clone())
    assert plugin.route_linear(layer, remove_weight=True)
    assert layer.weight.numel() == 0  # the packed copy replaced it, as vLLM's dispatch does
    x = torch.randn(5, 72, generator=G).to(dtype)
    bias = torch.randn(40, generator=G).to(dtype)
    y = layer.cpu_linear(x, layer.weight, bias)
    assert y.dtype == dtype and y.shape == (5, 40)
    want = x.float() @ w.float().T + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 output rounding
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="x and weight disagree on K"):
        layer.cpu_linear(torch.randn(5, 71), layer.weight, None)


def test_linear_keeps_vllms_choice_for_weights_it_does_not_take():
    for w in (torch.randint(0, 9, (16, 32), dtype=torch.int8), torch.randn(4, 1, 4), torch.empty(16, 32, device="meta"),
              torch.randn(16, 32, dtype=torch.float16)):
        layer = Layer(w)
        assert not plugin.route_linear(layer, remove_weight=True)
        assert not hasattr(layer, "cpu_linear") and layer.weight is not None and layer.weight.shape == w.shape


def test_register_is_inert_unless_asked(monkeypatch):
    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM would raise: register must not try
    plugin.register()
    assert not plugin.stats()["active"]
    monkeypatch.setenv(plugin.ENABLE_ENV, "0")
    plugin.register()
    assert not plugin.stats()["active"]


def test_routed_linear_is_the_op_when_traced():
    # eager calls take the Python API on the prepared weight; under torch.compile the same layer
    # must trace to torch.ops.dflash.linear_packed: fullgraph=True fails on a graph break, which the
    # eager branch (numpy and Cython) would be
    w = torch.randn(48, 64, generator=G).to(torch.bfloat16)
    layer = Layer(w.clone())
    assert plugin.route_linear(layer, remove_weight=True)
    x = torch.randn(16, 64, generator=G).to(torch.bfloat16)
    eager = layer.cpu_linear(x, layer.weight, None)
    compiled = torch.compile(lambda t: layer.cpu_linear(t, layer.weight, None), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
