"""Loading: config.json variants, safetensors (single / sharded, memory-mapped bf16), tokenizer, and
clear errors for broken checkpoints and mismatched drafter/target pairs."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import dflash_kernels as dk
import dflash_kernels.model as dm
from checkpoints import SPECIALS, special_id, write_dflash


@pytest.fixture
def target(ckpt_dir, tmp_path):
    """A fresh, writable copy of a small sharded untied target."""
    src = ckpt_dir("base", shards=2, tie=False)
    dst = tmp_path / "target"
    shutil.copytree(src, dst)
    return dst


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


# -- config ---------------------------------------------------------------------------------------

def test_config_v4_and_v5_spellings(ckpt_dir):
    v4 = dm.load_qwen3_config(ckpt_dir("v4", style="v4", rope_theta=5e5))
    v5 = dm.load_qwen3_config(ckpt_dir("v5", style="v5", rope_theta=5e5))
    for c in (v4, v5):
        assert c.rope_theta == 5e5 and c.dtype == "bfloat16" and c.head_dim == 24 and c.hidden_size == 64
        assert c.layer_types == ("full_attention",) * 3 and c.tie_word_embeddings
    assert v4.q_dim == 4 * 24 != v4.hidden_size  # head_dim read, not derived


@pytest.mark.parametrize("key,value,match", [
    ("head_dim", None, "'head_dim' is missing"),
    ("num_key_value_heads", 3, "must divide"),
    ("hidden_size", "64", "'hidden_size' must be an integer"),
    ("architectures", ["MistralForCausalLM"], "Qwen3ForCausalLM.*LlamaForCausalLM"),
    ("rope_theta", None, "rope_theta"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "not supported"),
    ("hidden_act", "gelu", "silu"),
    ("layer_types", ["full_attention"], "layer_types"),
])
def test_config_errors_name_file_and_key(target, key, value, match):
    path = target / "config.json"
    edit_json(path, **{key: value})
    with pytest.raises(dm.ConfigError, match=match) as err:
        dm.load_qwen3_config(target)
    assert str(path) in str(err.value)


def test_config_not_json(target):
    (target / "config.json").write_text("{not json")
    with pytest.raises(dm.ConfigError, match="not valid JSON"):
        dm.load(target)
    with pytest.raises(dm.ConfigError, match="file not found"):
        dm.load_qwen3_config(target / "nowhere")


def test_drafter_config_variants(target, tmp_path):
    d = write_dflash(tmp_path / "d1", target, layers=3, block_size=10, target_layer_ids=None, top_level_block=True,
                     sliding=True, window=7)
    c = dm.load_dflash_config(d)
    # default rule round(1 + i * (L - 4) / (n - 1)) with Python's round: L = 3 -> 1, round(0.5) = 0, 0
    assert c.block_size == 10 and c.target_layer_ids == (1, 0, 0)
    assert c.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert c.causal == (True, True, False) and c.window(0) == 7 and c.window(2) is None
    assert c.rope_theta == 1e7 and c.mask_token_id == 383
    d2 = write_dflash(tmp_path / "d2", target, layers=2, is_causal=False, sliding=True)
    assert dm.load_dflash_config(d2).causal == (False, False)
    edit_json(d2 / "config.json", dflash_config={"mask_token_id": 5, "target_layer_ids": [0], "causal": True})
    with pytest.raises(dm.ConfigError, match="'block_size' is missing"):
        dm.load_dflash_config(d2)
    edit_json(d2 / "config.json", dflash_config={"mask_token_id": 5, "target_layer_ids": [0], "causal": True,
                                                 "block_size": 12})
    c2 = dm.load_dflash_config(d2)
    assert c2.causal == (True, True) and c2.block_size == 12 and c2.mask_token_id == 5
    edit_json(d2 / "config.json", dflash_config={"target_layer_ids": [0]})
    with pytest.raises(dm.ConfigError, match="mask_token_id"):
        dm.load_dflash_config(d2)


# -- weights --------------------------------------------------------------------------------------

def _is_mmapped(arr):
    while getattr(arr, "base", None) is not None and not isinstance(arr, np.memmap):
        arr = arr.base
    return isinstance(arr, np.memmap)


def test_weights_memory_mapped_bf16(target):
    tensors, origin = dm.read_checkpoint(target)
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == np.uint16 and not w.flags.writeable and _is_mmapped(w)  # bf16 bit patterns, mmapped
    assert origin["lm_head.weight"].endswith(".safetensors")
    assert len({origin[n] for n in tensors}) == 2  # both shards read via the index
    eng = dm.load(target, max_len=16, n_threads=1, fuse_weights=False)
    layer = eng.target.layers[0]
    for arr in (layer.w_down, layer.w_o, *layer.w_qkv, *layer.w_gate_up, eng.target.embed, eng.target.lm_head):
        assert arr.dtype == np.uint16 and _is_mmapped(arr)  # no copy of any weight
    fused = dm.load(target, max_len=16, n_threads=1, fuse_weights=True)
    assert fused.target.layers[0].w_qkv.dtype == np.uint16  # one bf16 copy, never fp32
    a = eng.generate([1, 2, 3], 6, ignore_eos=True).token_ids
    assert a == fused.generate([1, 2, 3], 6, ignore_eos=True).token_ids
    with pytest.raises(ValueError, match="fuse_weights"):
        dm.load(target, fuse_weights="yes")


def _rewrite(path, change):
    """Rewrite one safetensors file after `change(dict of numpy arrays)`."""
    arrays = {k: np.array(v) for k, v in dm.read_safetensors(path).items()}
    change(arrays)
    path.unlink()
    tensors = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == np.uint16
               else torch.from_numpy(v) for k, v in arrays.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _shard_of(target, name):
    index = json.loads((target / "model.safetensors.index.json").read_text())
    return target / index["weight_map"][name], index


def _drop_tensor(target, name):
    """Remove tensor `name` from its shard and from the index."""
    shard, index = _shard_of(target, name)
    _rewrite(shard, lambda a: a.pop(name))
    del index["weight_map"][name]
    (target / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor(target):
    name = "model.layers.1.self_attn.k_norm.weight"
    _drop_tensor(target, name)
    with pytest.raises(dm.WeightsError, match=r"missing tensors \(1\): model.layers.1.self_attn.k_norm.weight"):
        dm.load(target)


def test_extra_tensor_and_wrong_shape(target):
    name = "model.layers.0.mlp.up_proj.weight"
    shard, index = _shard_of(target, name)

    def change(a):
        a["model.layers.9.mlp.up_proj.weight"] = np.zeros((4, 4), np.float32)
        a[name] = np.zeros((5, 64), np.float32)

    _rewrite(shard, change)
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard.name
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(dm.WeightsError) as err:
        dm.load(target)
    msg = str(err.value)
    assert "unexpected tensors (1): model.layers.9.mlp.up_proj.weight" in msg
    assert f"{name} in {shard}: shape [5, 64], expected [96, 64]" in msg


def test_untied_without_lm_head(target):
    _drop_tensor(target, "lm_head.weight")
    with pytest.raises(dm.WeightsError, match="lm_head.weight"):
        dm.load(target)
    edit_json(target / "config.json", tie_word_embeddings=True)  # tied: lm_head = embed_tokens
    eng = dm.load(target, max_len=16, n_threads=1)
    # the head reads embed_tokens (packed for linear where the tier packs: dk.prepare_weight)
    head = eng.target.lm_head
    assert head is eng.target.embed or (isinstance(head, dk.PackedWeight) and np.array_equal(np.asarray(head),
                                                                                           eng.target.embed))


def test_truncated_and_corrupt_files(target):
    shard = sorted(target.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(dm.WeightsError, match=f"{shard}: truncated file"):
        dm.load(target)
    shard.write_bytes(data[:5])
    with pytest.raises(dm.WeightsError, match="truncated safetensors file"):
        dm.load(target)
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(dm.WeightsError, match="truncated or corrupt"):
        dm.load(target)
    shard.write_bytes(len(b"{nope").to_bytes(8, "little") + b"{nope")
    with pytest.raises(dm.WeightsError, match="corrupt safetensors header"):
        dm.load(target)
    shard.unlink()
    with pytest.raises(dm.WeightsError, match=f"shard '{shard.name}' listed in weight_map is missing"):
        dm.load(target)


def test_no_weights(tmp_path, target):
    for f in target.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(dm.WeightsError, match="no \\*.safetensors"):
        dm.load(target)


# -- drafter / target mismatch --------------------------------------------------------------------

@pytest.mark.parametrize("change,match", [
    (dict(vocab_size=500), "vocab_size 500 != target vocab_size 384"),
    (dict(dflash_config={"mask_token_id": 384, "target_layer_ids": [0, 2], "block_size": 16}),
     "mask_token_id 384 outside"),
    (dict(dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 3], "block_size": 16}),
     r"\[3\] beyond the target's 3 layers"),
    (dict(num_target_layers=36), "num_target_layers 36"),
    (dict(hidden_size=32), "hidden_size 32 != target hidden_size 64"),
])
def test_drafter_target_mismatch(target, tmp_path, change, match):
    d = write_dflash(tmp_path / "d", target, layers=2, target_layer_ids=(0, 2))
    edit_json(d / "config.json", **change)
    with pytest.raises(ValueError, match=match):
        dm.load(target, d)


def test_drafter_missing_and_misshaped_tensors(target, tmp_path):
    d = write_dflash(tmp_path / "d", target, layers=2, target_layer_ids=(0, 2))
    dm.load(target, d, max_len=16)  # fine as written

    def change(a):
        a.pop("layers.1.mlp.gate_proj.weight")
        a["fc.weight"] = np.ascontiguousarray(a["fc.weight"][:, :64])  # one tap's width instead of two
        a["model.layers.0.input_layernorm.weight"] = np.ones(64, np.float32)  # prefixed name: not DFlash

    _rewrite(d / "model.safetensors", change)
    with pytest.raises(dm.WeightsError) as err:
        dm.load(target, d)
    msg = str(err.value)
    assert "missing tensors (1): layers.1.mlp.gate_proj.weight" in msg
    assert "fc.weight" in msg and "expected [64, 128]" in msg
    assert "unexpected tensors (1): model.layers.0.input_layernorm.weight" in msg


# -- tokenizer ------------------------------------------------------------------------------------

def test_tokenizer_roundtrip_specials_and_stream(target):
    tok = dm.Tokenizer(target / "tokenizer.json")
    text = "Hello Über café 東京 🙂 <|im_end|> done"
    ids = tok.encode(text)
    assert special_id("<|im_end|>") in ids and tok.decode(ids) == text
    assert tok.vocab_size == 320 + len(SPECIALS)
    # streaming: pieces never contain half a character and add up to the full text
    dec = tok.stream()
    pieces = [dec.push([i]) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some byte tokens of multi-byte chars were held back


def test_chat_template_and_stops(target):
    assert dm.render_chat("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    no_think = dm.render_chat(msgs, enable_thinking=False)
    assert no_think.startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="role"):
        dm.render_chat([{"role": "tool", "content": "x"}])
    eng = dm.load(target, max_len=32, n_threads=1)
    ids = eng.encode(eng.chat_prompt("hi"))
    assert ids[0] == special_id("<|im_start|>")
    assert set(eng.stop_ids) == {special_id("<|im_end|>"), special_id("<|endoftext|>")}
    edit_json(target / "generation_config.json", eos_token_id=7)  # int form + config eos
    assert set(dm.stop_token_ids(target, (special_id("<|im_end|>"),))) == {7, special_id("<|im_end|>")}


def test_unreadable_or_missing_tokenizer(target):
    (target / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(dm.TokenizerError, match="tokenizer.json: cannot load tokenizer"):
        dm.load(target)
    (target / "tokenizer.json").unlink()
    eng = dm.load(target, max_len=32, n_threads=1)  # ids only: no text
    res = eng.generate([1, 2, 3], 4, ignore_eos=True)
    assert len(res.token_ids) == 4 and res.text is None
    with pytest.raises(ValueError, match="no tokenizer.json"):
        eng.generate("text", 4)


@pytest.mark.parametrize("key,value,match", [
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite positive number <= 1"),
    ("rms_norm_eps", 1e300, "'rms_norm_eps' must be a finite positive number <= 1"),
    ("rope_theta", float("inf"), "'rope_theta' must be a finite positive number"),
    ("rope_theta", float("nan"), "'rope_theta' must be a finite positive number"),
])
def test_non_finite_config_floats_named(tmp_path, key, value, match):
    """JSON NaN / Infinity parse as floats; they loaded and generated token 0 or other tokens."""
    import json

    from checkpoints import write_qwen3
    from dflash_kernels.model.config import ConfigError

    d = write_qwen3(tmp_path / "t")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        dm.load(d)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_pages_drops_mapped_pages_and_keeps_values(tmp_path):
    from dflash_kernels.model.weights import read_safetensors, release_pages

    w = torch.randn(4096, 4096).to(torch.bfloat16)  # 32 MiB
    save_file({"w": w, "small": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    t = read_safetensors(tmp_path / "m.safetensors")
    expect = w.view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(t["w"], expect)  # every page read: resident
    before = _rss_bytes()
    release_pages(t["w"], np.ones(3), t["small"])  # (arrays that are not mapped are skipped)
    assert before - _rss_bytes() > 24 << 20
    assert np.array_equal(t["w"], expect)  # the mapping still reads the file
