"""Tiny random checkpoints in the exact public layout (docs/models.md 1, 3, 6; docs/dflash.md 6).

Target: config.json (transformers 4.x or 5.x spelling), generation_config.json, tokenizer.json
(a byte-level BPE trained here with ``tokenizers``), safetensors single file ``model.safetensors``
or shards ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``, tensors named as
Qwen3ForCausalLM saves them. Drafter: DFlashDraftModel config + un-prefixed tensors. head_dim is
deliberately != hidden / heads.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

_CORPUS = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts a block of tokens
and the target verifies them in one forward pass. def add(a, b):\n    return a + b\n
Numbers 0123456789 and punctuation: ,.;:!?()[]{} "quotes" 'single'. Über café naïve 東京 こんにちは 🙂.
Block diffusion drafters predict many tokens in parallel; the longest correct prefix is kept.
"""


@cache
def tokenizer_json(vocab_size: int = 320) -> str:
    """A Qwen-style byte-level BPE (no BOS, ByteLevel decoder) trained on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(SPECIALS)  # added after the regular vocabulary, as in Qwen
    return tok.to_str()


def _tok_size() -> int:
    return len(json.loads(tokenizer_json())["model"]["vocab"]) + len(SPECIALS)


def special_id(name: str) -> int:
    data = json.loads(tokenizer_json())
    return next(t["id"] for t in data["added_tokens"] if t["content"] == name)


def _store(arrays: dict[str, np.ndarray], dtype: str) -> dict[str, torch.Tensor]:
    tdt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(tdt).contiguous()
            for k, v in arrays.items()}


def _write_tensors(d: Path, tensors: dict[str, torch.Tensor], shards: int,
                   pattern: str = "model-{:05d}-of-{:05d}.safetensors"):
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards] if s else names[0::shards]
        fname = pattern.format(s + 1, shards)
        save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def qwen3_config(*, hidden=64, inter=96, layers=3, heads=4, kv=2, head_dim=24, vocab=384, tie=True,
                 rope_theta=1e6, style="v4", max_pos=512) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": special_id("<|endoftext|>"), "eos_token_id": special_id("<|im_end|>"),
        "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": inter, "max_position_embeddings": max_pos, "max_window_layers": layers,
        "model_type": "qwen3", "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": kv, "rms_norm_eps": 1e-6, "sliding_window": None,
        "tie_word_embeddings": tie, "use_cache": True, "use_sliding_window": False, "vocab_size": vocab,
    }
    if style == "v4":
        cfg.update(rope_scaling=None, rope_theta=rope_theta, torch_dtype="bfloat16", transformers_version="4.51.0")
    else:
        cfg.update(rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, dtype="bfloat16",
                   layer_types=["full_attention"] * layers, transformers_version="5.0.0")
    return cfg


def _lin(rng, n, k):
    return rng.standard_normal((n, k)) / np.sqrt(k)


def _norm(rng, n):
    return 1.0 + 0.1 * rng.standard_normal(n)


def _random_layer(rng, p: str, cfg: dict) -> dict[str, np.ndarray]:
    """One Qwen3 decoder layer's random weights under prefix p (targets and drafters alike)."""
    H, inter, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {
        p + "input_layernorm.weight": _norm(rng, H), p + "post_attention_layernorm.weight": _norm(rng, H),
        p + "self_attn.q_proj.weight": _lin(rng, nq * D, H), p + "self_attn.k_proj.weight": _lin(rng, nkv * D, H),
        p + "self_attn.v_proj.weight": _lin(rng, nkv * D, H), p + "self_attn.o_proj.weight": _lin(rng, H, nq * D),
        p + "self_attn.q_norm.weight": _norm(rng, D), p + "self_attn.k_norm.weight": _norm(rng, D),
        p + "mlp.gate_proj.weight": _lin(rng, inter, H), p + "mlp.up_proj.weight": _lin(rng, inter, H),
        p + "mlp.down_proj.weight": _lin(rng, H, inter),
    }


def qwen3_tensors(cfg: dict, seed: int = 0, hot_tokens: int = 0, hot_scale: float = 3.0) -> dict[str, np.ndarray]:
    """Random fp32 weights with sane magnitudes; hot_tokens > 0 scales the first lm_head rows so
    both the target and a random drafter favour a few tokens (drafts then get accepted sometimes)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    t = {"model.embed_tokens.weight": 0.5 * rng.standard_normal((V, H)), "model.norm.weight": _norm(rng, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(_random_layer(rng, p, cfg))
    head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else 0.5 * rng.standard_normal((V, H))
    if hot_tokens:
        # A direction shared by every embedding row survives into every final hidden state (target's
        # and drafter's); lm_head rows along it are likely everywhere, so random drafts match often.
        c = rng.standard_normal(H)
        t["model.embed_tokens.weight"] += c
        head[:hot_tokens] = hot_scale * c / H + 0.5 * rng.standard_normal((hot_tokens, H)) / np.sqrt(H)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = head
    return t


def write_qwen3(d, *, shards=1, dtype="bf16", seed=0, hot_tokens=0, hot_scale=3.0, tokenizer=True, **cfg_kw) -> Path:
    """Write a tiny Qwen3ForCausalLM checkpoint into directory d; return d."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config(**cfg_kw)
    assert cfg["vocab_size"] >= _tok_size()
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": special_id("<|endoftext|>"),
           "eos_token_id": [special_id("<|im_end|>"), special_id("<|endoftext|>")],
           "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer:
        (d / "tokenizer.json").write_text(tokenizer_json())
    _write_tensors(d, _store(qwen3_tensors(cfg, seed, hot_tokens, hot_scale), dtype), shards)
    return d


def llama_config(*, hidden=64, heads=4, kv=2, head_dim=None, tie=True, rope_theta=5e5, rope_scaling=None,
                 **kw) -> dict:
    """A LlamaForCausalLM config (transformers spelling); head_dim omitted = hidden / heads."""
    cfg = qwen3_config(hidden=hidden, heads=heads, kv=kv, head_dim=head_dim or hidden // heads, tie=tie,
                       rope_theta=rope_theta, **kw)
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", mlp_bias=False, pretraining_tp=1)
    for key in ("max_window_layers", "sliding_window", "use_sliding_window"):
        cfg.pop(key)
    if head_dim is None:
        cfg.pop("head_dim")
    return cfg


def llama_tensors(cfg: dict, seed: int = 0, **kw) -> dict[str, np.ndarray]:
    cfg = dict(cfg, head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]))
    norms = ("q_norm.weight", "k_norm.weight")
    return {k: v for k, v in qwen3_tensors(cfg, seed, **kw).items() if not k.endswith(norms)}


def write_llama(d, *, dtype="bf16", seed=0, hot_tokens=0, **cfg_kw) -> Path:
    """Write a tiny LlamaForCausalLM checkpoint into directory d; return d."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(**cfg_kw)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "tokenizer.json").write_text(tokenizer_json())
    _write_tensors(d, _store(llama_tensors(cfg, seed, hot_tokens=hot_tokens), dtype), 1)
    return d


def dflash_config(target_cfg: dict, *, layers=2, block_size=16, target_layer_ids=(0, 2), mask_token_id=None,
                  sliding=False, window=6, rope_theta=1e7, heads=4, kv=2, head_dim=20, inter=80,
                  top_level_block=False, is_causal=None) -> dict:
    V = target_cfg["vocab_size"]
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": target_cfg["hidden_size"], "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "num_target_layers": target_cfg["num_hidden_layers"], "vocab_size": V, "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": V - 1 if mask_token_id is None else mask_token_id},
    }
    if target_layer_ids is not None:
        cfg["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    if top_level_block:
        cfg["block_size"] = block_size
    else:
        cfg["dflash_config"]["block_size"] = block_size
    if sliding:
        cfg["layer_types"] = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        cfg["sliding_window"] = window
    else:
        cfg["layer_types"] = ["full_attention"] * layers
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    return cfg


def dflash_tensors(cfg: dict, target_hidden: int, n_taps: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H = cfg["hidden_size"]
    t = {"fc.weight": _lin(rng, H, n_taps * target_hidden), "hidden_norm.weight": _norm(rng, H),
         "norm.weight": _norm(rng, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update(_random_layer(rng, p, cfg))
    return t


def write_dflash(d, target_dir, *, dtype="bf16", seed=1, **cfg_kw) -> Path:
    """Write a tiny DFlashDraftModel checkpoint for the target in target_dir; return d."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = dflash_config(tcfg, **cfg_kw)
    ids = cfg["dflash_config"].get("target_layer_ids")
    if ids is None:
        from dflash_kernels.model.config import default_target_layer_ids

        ids = default_target_layer_ids(tcfg["num_hidden_layers"], cfg["num_hidden_layers"])
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_tensors(d, _store(dflash_tensors(cfg, tcfg["hidden_size"], len(ids), seed), dtype), 1)
    return d


# -- pytest fixtures shared by the tests/test_model_*.py files (tests/conftest.py imports them) ----

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A factory: ckpt_dir(name, **write_qwen3 kwargs) -> directory, written once per module."""
    root = tmp_path_factory.mktemp("ckpt")
    made = {}

    def make(name, **kw):
        if name not in made:
            made[name] = write_qwen3(root / name, **kw)
        return made[name]

    return make
