"""Tiny random Qwen3.5 checkpoints in the real public layouts (docs/models.md 2.2, 2.3, 6).

Multimodal: ``Qwen3_5ForConditionalGeneration`` config with ``text_config`` (rope_parameters with
partial_rotary_factor and the M-RoPE fields, layer_types and full_attention_interval) and a
``vision_config``; text tensors under ``model.language_model.``, ``lm_head.weight`` top level (absent
when tied), a few dummy ``model.visual.*`` and ``mtp.*`` tensors, shards named
``model.safetensors-0000K-of-0000N.safetensors``. Text-only: flat ``qwen3_5_text`` config, prefix
``model.`` (what ``Qwen3_5ForCausalLM.save_pretrained`` writes). A_log and linear_attn.norm.weight
are stored F32, everything else BF16. Norms are initialised realistically: zero-centred norm weights
near 0, gated-norm weights near 1, A_log = log(U(1, 16)), dt_bias near 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from checkpoints import _write_tensors, dflash_config, dflash_tensors, special_id, tokenizer_json

F32_SUFFIXES = (".linear_attn.A_log", ".linear_attn.norm.weight")
SHARD_PATTERN = "model.safetensors-{:05d}-of-{:05d}.safetensors"


def _mrope_section(head_dim, partial):
    """t/h/w split of the rotary frequencies (sums to rotary_dim / 2; [11, 11, 10] for 9B)."""
    n = int(head_dim * partial) // 2
    return [n - 2 * (n // 3), n // 3, n // 3]


def qwen35_text_config(*, hidden=64, inter=96, layers=4, heads=4, kv=2, head_dim=32, lin_k=2, lin_v=4,
                       lin_dk=16, lin_dv=16, conv=4, vocab=384, rope_theta=1e7, partial=0.25, tie=False,
                       interval=4, explicit_layer_types=True, max_pos=512) -> dict:
    cfg = {
        "model_type": "qwen3_5_text", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "attn_output_gate": True, "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": max_pos,
        "full_attention_interval": interval, "linear_conv_kernel_dim": conv, "linear_key_head_dim": lin_dk,
        "linear_value_head_dim": lin_dv, "linear_num_key_heads": lin_k, "linear_num_value_heads": lin_v,
        "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial,
                            "mrope_interleaved": True, "mrope_section": _mrope_section(head_dim, partial)},
        "partial_rotary_factor": partial, "eos_token_id": special_id("<|im_end|>"), "tie_word_embeddings": tie,
        "dtype": "bfloat16", "initializer_range": 0.02, "mlp_only_layers": [], "use_cache": True,
        "bos_token_id": None, "pad_token_id": None,
    }
    if explicit_layer_types:
        cfg["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                              for i in range(layers)]
    return cfg


def qwen35_config(text: dict, *, multimodal=True) -> dict:
    """The config.json dict: nested (multimodal release layout) or flat text-only."""
    if not multimodal:
        return {"architectures": ["Qwen3_5ForCausalLM"], **text, "transformers_version": "5.2.0"}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
        "vision_end_token_id": 248054, "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 16,
                          "out_hidden_size": text["hidden_size"], "hidden_act": "gelu_pytorch_tanh",
                          "deepstack_visual_indexes": []},
        "transformers_version": "5.2.0",
    }


def qwen35_tensors(text: dict, seed: int = 0, *, prefix="model.language_model.", extras=True,
                   hot_tokens: int = 0, hot_scale: float = 3.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, inter, D, V = text["hidden_size"], text["intermediate_size"], text["head_dim"], text["vocab_size"]
    nq, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    Hk, Hv, dk, dv = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
                      text["linear_value_head_dim"])
    K = text["linear_conv_kernel_dim"]
    C = 2 * Hk * dk + Hv * dv
    types = text.get("layer_types") or ["full_attention" if (i + 1) % text["full_attention_interval"] == 0
                                        else "linear_attention" for i in range(text["num_hidden_layers"])]

    def lin(n, k):
        return rng.standard_normal((n, k)) / np.sqrt(k)

    def znorm(n):  # zero-centred: the effective scale is 1 + w
        return 0.1 * rng.standard_normal(n)

    t = {prefix + "embed_tokens.weight": 0.5 * rng.standard_normal((V, H)), prefix + "norm.weight": znorm(H)}
    for i, kind in enumerate(types):
        p = f"{prefix}layers.{i}."
        t.update({
            p + "input_layernorm.weight": znorm(H), p + "post_attention_layernorm.weight": znorm(H),
            p + "mlp.gate_proj.weight": lin(inter, H), p + "mlp.up_proj.weight": lin(inter, H),
            p + "mlp.down_proj.weight": lin(H, inter),
        })
        if kind == "full_attention":
            a = p + "self_attn."
            t.update({
                a + "q_proj.weight": lin(2 * nq * D, H), a + "k_proj.weight": lin(nkv * D, H),
                a + "v_proj.weight": lin(nkv * D, H), a + "o_proj.weight": lin(H, nq * D),
                a + "q_norm.weight": znorm(D), a + "k_norm.weight": znorm(D),
            })
        else:
            a = p + "linear_attn."
            t.update({
                a + "in_proj_qkv.weight": lin(C, H), a + "in_proj_z.weight": lin(Hv * dv, H),
                a + "in_proj_b.weight": lin(Hv, H), a + "in_proj_a.weight": lin(Hv, H),
                a + "conv1d.weight": rng.standard_normal((C, 1, K)) / np.sqrt(K),
                a + "A_log": np.log(rng.uniform(1.0, 16.0, Hv)), a + "dt_bias": 1.0 + 0.1 * rng.standard_normal(Hv),
                a + "norm.weight": 1.0 + 0.1 * rng.standard_normal(dv), a + "out_proj.weight": lin(H, Hv * dv),
            })
    tie = text["tie_word_embeddings"]
    head = t[prefix + "embed_tokens.weight"] if tie else 0.5 * rng.standard_normal((V, H))
    if hot_tokens:
        # a direction shared by every embedding survives to the final hidden state, so lm_head rows
        # along it are likely everywhere and a random drafter's drafts are accepted now and then
        c = rng.standard_normal(H)
        t[prefix + "embed_tokens.weight"] += c
        head[:hot_tokens] = hot_scale * c / H + 0.5 * rng.standard_normal((hot_tokens, H)) / np.sqrt(H)
    if not tie:
        t["lm_head.weight"] = head
    if extras:  # must be skipped by the loader (and by HF Qwen3_5ForCausalLM)
        t.update({
            "model.visual.patch_embed.proj.weight": rng.standard_normal((32, 3, 2, 4, 4)),
            "model.visual.blocks.0.attn.qkv.weight": lin(96, 32),
            "model.visual.merger.linear_fc2.weight": lin(H, 64),
            "mtp.fc.weight": lin(H, 2 * H), "mtp.norm.weight": znorm(H),
            "mtp.layers.0.self_attn.q_proj.weight": lin(2 * nq * D, H),
        })
    return t


def _store(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    out = {}
    for name, v in arrays.items():
        dt = torch.float32 if name.endswith(F32_SUFFIXES) else torch.bfloat16
        out[name] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(dt).contiguous()
    return out


def write_qwen35(d, *, multimodal=True, shards=2, seed=0, hot_tokens=0, hot_scale=3.0, tokenizer=True,
                 **text_kw) -> Path:
    """Write a tiny Qwen3.5 checkpoint into directory d; return d."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    text = qwen35_text_config(**text_kw)
    (d / "config.json").write_text(json.dumps(qwen35_config(text, multimodal=multimodal), indent=2))
    gen = {"eos_token_id": [special_id("<|im_end|>"), special_id("<|endoftext|>")], "do_sample": True,
           "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer:
        (d / "tokenizer.json").write_text(tokenizer_json())
    prefix = "model.language_model." if multimodal else "model."
    arrays = qwen35_tensors(text, seed, prefix=prefix, extras=multimodal, hot_tokens=hot_tokens,
                            hot_scale=hot_scale)
    _write_tensors(d, _store(arrays), shards, pattern=SHARD_PATTERN)
    return d


def text_config_of(target_dir) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def write_dflash_for_qwen35(d, target_dir, *, seed=1, **cfg_kw) -> Path:
    """A DFlash drafter (Qwen3-style layers, its own rope_theta) for the Qwen3.5 target in target_dir."""
    from checkpoints import _store as store_uniform

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    text = text_config_of(target_dir)
    cfg = dflash_config(text, **cfg_kw)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])
    _write_tensors(d, store_uniform(dflash_tensors(cfg, text["hidden_size"], n_taps, seed), "bf16"), 1)
    return d
