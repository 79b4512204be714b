"""The plugin inside vLLM (run in vLLM's environment: .ci/run builds it; see docs/engines.md).

Token identity on a tiny float32 pair: vLLM with the plugin, vLLM without it and this library's
own engine give the same greedy tokens, DFlash k = 4 and 15. Each vLLM engine runs in a child
process (tests_vllm/run_vllm.py), with DFLASH_VLLM set or not. In this process: the plugin stays
inert on another platform or an untested vLLM version, saying so in one log line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_kernels import vllm as plugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import checkpoints  # noqa: E402  (the tests' tiny checkpoints in the public layout)

RUN_VLLM = Path(__file__).with_name("run_vllm.py")
PROMPT = [5, 9, 11, 40, 7]
NEW = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A float32 Qwen3 target and DFlash drafter in vLLM's CPU attention's head size (32). Seed 3,
    untied head: its greedy continuation varies (many tiny random models repeat one token)."""
    d = tmp_path_factory.mktemp("pair")
    target = checkpoints.write_qwen3(d / "target", dtype="f32", hidden=128, inter=192, layers=4, heads=4, kv=2,
                                     head_dim=32, vocab=384, seed=3, tie=False)
    drafter = checkpoints.write_dflash(d / "drafter", target, dtype="f32", layers=2, heads=4, kv=2, head_dim=32,
                                       inter=160, target_layer_ids=(1, 2), seed=4)
    return target, drafter


def run_vllm(target, drafter, k: int, plugin_on: bool, prompt=PROMPT) -> dict:
    env = dict(os.environ, DFLASH_VLLM="1" if plugin_on else "0", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, str(RUN_VLLM), str(target), "--drafter", str(drafter), "--k", str(k), "--dtype", "float32",
           "--prompt", ",".join(map(str, prompt)), "--new", str(NEW)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ours(pair):
    from dflash_kernels.model import load

    engine = load(*pair, precision="highest")
    return engine.generate(PROMPT, NEW, num_speculative_tokens=0, ignore_eos=True).token_ids


@pytest.mark.parametrize("k", [4, 15])
def test_plugin_tokens_equal_vllm_and_ours(pair, ours, k):
    with_plugin = run_vllm(*pair, k, plugin_on=True)
    without = run_vllm(*pair, k, plugin_on=False)
    assert with_plugin["active"] and with_plugin["linear_layers"] > 0 and with_plugin["greedy_rounds"] > 0
    assert not without["active"] and without["linear_layers"] == 0 and without["greedy_rounds"] == 0
    assert len(set(ours)) > 8  # a continuation worth comparing
    assert with_plugin["tokens"] == without["tokens"] == list(ours)


def test_vllm_loads_the_shipped_pair():
    """The pair this project ships (model/default) loads in vLLM as a DFlash pair; in float32, with and
    without the plugin, its greedy tokens are this library's."""
    from dflash_kernels.model import default_model_dirs, load

    target, drafter = default_model_dirs()
    ids = [int(t) for t in load(target).tokenizer.encode("def parse_args(argv):\n    ")]
    ours = load(target, drafter, precision="highest").generate(ids, NEW, num_speculative_tokens=15, ignore_eos=True)
    for plugin_on in (False, True):
        got = run_vllm(target, drafter, 15, plugin_on=plugin_on, prompt=ids)
        assert got["tokens"] == list(ours.token_ids)


@pytest.fixture
def fresh_plugin(monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.setattr(plugin, "_active", False)
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)
    return utils


def test_inert_on_an_untested_vllm_version(fresh_plugin, monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    original = fresh_plugin.dispatch_cpu_unquantized_gemm
    with caplog.at_level(logging.INFO, logger="vllm.dflash_kernels"):
        plugin.register()
    assert not plugin.stats()["active"]
    assert fresh_plugin.dispatch_cpu_unquantized_gemm is original
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dflash_kernels"]
    assert len(lines) == 1 and "0.99.0 is untested" in lines[0] and "inert" in lines[0]


def test_inert_on_a_gpu_platform(fresh_plugin, monkeypatch, caplog):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    original = fresh_plugin.dispatch_cpu_unquantized_gemm
    with caplog.at_level(logging.INFO, logger="vllm.dflash_kernels"):
        plugin.register()
    assert not plugin.stats()["active"]
    assert fresh_plugin.dispatch_cpu_unquantized_gemm is original
    assert any("not CPU; inert" in r.getMessage() for r in caplog.records)


def test_a_bad_operand_inside_vllm_gets_the_librarys_error():
    """What vLLM's worker sees when a routed layer gets a bad input: the API's ValueError/TypeError."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(48, 64, dtype=torch.bfloat16), requires_grad=False)
    assert plugin.route_linear(layer, remove_weight=False)
    with pytest.raises(ValueError, match="x and weight disagree on K"):
        layer.cpu_linear(torch.randn(2, 63, dtype=torch.bfloat16), layer.weight, None)
    with pytest.raises(TypeError, match="x must have dtype"):
        layer.cpu_linear(torch.ones(2, 64, dtype=torch.int32), layer.weight, None)
