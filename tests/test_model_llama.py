"""Llama-family targets (LlamaForCausalLM checkpoints) on the dk kernels vs transformers' LlamaForCausalLM."""

import numpy as np
import pytest
import torch

import dflash_kernels.model as dm
from checkpoints import write_dflash, write_llama
from support import assert_close, greedy_runs

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "tied-gqa": dict(tie=True, heads=4, kv=2),
    "untied-mha-f32": dict(tie=False, heads=4, kv=4, dtype="f32"),
    "explicit-head-dim": dict(tie=True, heads=4, kv=1, head_dim=24),
    "llama3-rope-scaling": dict(tie=True, heads=4, kv=2, max_pos=4096, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "linear-rope-scaling": dict(tie=False, heads=4, kv=2, rope_scaling={"rope_type": "linear", "factor": 3.0}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_prefill_and_decode_match_transformers(tmp_path, variant):
    path = write_llama(tmp_path / variant, layers=3, **VARIANTS[variant])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    engine = dm.load(path, max_len=64)
    target = engine.target
    assert target.cfg.architecture == "LlamaForCausalLM" and not target.cfg.qk_norm
    assert (target.cfg.rope_inv_freq is None) == ("rope_scaling" not in VARIANTS[variant])
    prompt = np.random.default_rng(1).integers(0, 380, 40).tolist()  # past the llama3 variant's 64 // 4
    cache = target.new_cache(64)
    hidden, _ = target.forward(prompt, cache)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert_close(target.logits(hidden), ref, rtol=2e-4, atol=2e-4, what="prefill logits")
    ids, tok = list(prompt), int(target.greedy(hidden[-1:])[0])
    for step in range(8):
        ids.append(tok)
        h, _ = target.forward([tok], cache, taps=False)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert_close(target.logits(h)[0], ref, rtol=2e-4, atol=2e-4, what=f"decode step {step}")
        tok = int(target.greedy(h)[0])


def test_llama_config_defaults_and_errors(tmp_path):
    path = write_llama(tmp_path / "m", hidden=64, heads=4)
    cfg = dm.load_qwen3_config(path)
    assert cfg.head_dim == 16 and not cfg.qk_norm
    import json

    data = json.loads((path / "config.json").read_text())
    for key, value, match in (("mlp_bias", True, "mlp_bias"), ("attention_bias", True, "attention_bias"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling")):
        bad = dict(data, **{key: value})
        (path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(dm.ConfigError, match=match):
            dm.load_qwen3_config(path)


def test_dflash_on_a_llama_target_equals_autoregressive(tmp_path):
    target = write_llama(tmp_path / "t", layers=3, hot_tokens=6)
    drafter = write_dflash(tmp_path / "d", target, target_layer_ids=(0, 2), block_size=8)
    engine = dm.load(target, drafter, max_len=128)
    for ar, sd in greedy_runs(engine, n=32):
        assert sd.token_ids == ar.token_ids
        assert sd.metrics.rounds < 32  # some drafts were accepted (hot tokens make that likely)
