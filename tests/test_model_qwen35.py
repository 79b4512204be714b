"""Qwen3.5 hybrid target (Gated DeltaNet + gated attention) vs transformers' Qwen3_5ForCausalLM,
exact rollback of the linear-attention states, and lossless DFlash decoding on a hybrid target.

Tiny random checkpoints in the real layouts (tests/checkpoints_qwen35.py): the multimodal release
layout (nested text_config, model.language_model.*, dummy vision / MTP tensors, F32 A_log and gated
norm weight, shards model.safetensors-0000K-of-0000N) and the flat text-only layout.
"""

import json

import numpy as np
import pytest
import torch

import dflash_kernels as dk
import dflash_kernels.model as dm
from checkpoints import write_qwen3
from checkpoints_qwen35 import write_dflash_for_qwen35, write_qwen35
from dflash_kernels.model._ops import Ops
from support import assert_close

transformers = pytest.importorskip("transformers")

# The GDN layers amplify float32 rounding on these random weights: HF fp32 itself differs from HF fp64
# by ~2e-4 in the logits (|logit| <= 16), ours by 1e-4..4e-4 depending on the backend's summation
# order. Real bugs (a missing 1 + w, wrong head grouping, rotary span, gate layout) give > 1e-1.
LOGIT_TOL = dict(rtol=1e-3, atol=1e-3)
# Verification rows vs single-token decode: same math, GEMMs of different M round differently.
STATE_TOL = dict(rtol=1e-4, atol=1e-4)
EXACT_TOL = dict(rtol=1e-5, atol=1e-5)

VARIANTS = {
    # 3 linear + 1 full, untied, sharded, nested config with explicit layer_types
    "mm-4-untied": dict(multimodal=True, shards=3, tie=False, layers=4),
    # 6 linear + 2 full from full_attention_interval (no layer_types), tied, single file, text-only
    "text-8-tied": dict(multimodal=False, shards=1, tie=True, layers=8, explicit_layer_types=False),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35")
    made = {}

    def make(name, **kw):
        if name not in made:
            made[name] = write_qwen35(root / name, **(VARIANTS.get(name, {}) | kw))
        return made[name]

    return make


def hf_model(path):
    m = transformers.Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                        attn_implementation="eager")
    return m.eval()


def load_target(path, **kw):
    cfg = dm.load_qwen35_config(path)
    tensors, origin = dm.read_checkpoint(path)
    return dm.Qwen35Model(cfg, tensors, origin, **kw)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


# -- config and checkpoint layout ---------------------------------------------------------------

def test_configs_of_both_layouts(ckpt):
    mm = dm.load_target_config(ckpt("mm-4-untied"))
    assert isinstance(mm, dm.Qwen35Config) and mm.multimodal and mm.prefix == "model.language_model."
    assert mm.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (mm.rotary_dim, mm.rope_theta, mm.tie_word_embeddings) == (8, 1e7, False)
    assert (mm.conv_dim, mm.lin_value_dim) == (2 * 2 * 16 + 4 * 16, 64)
    txt = dm.load_target_config(ckpt("text-8-tied"))
    assert not txt.multimodal and txt.prefix == "model." and txt.tie_word_embeddings
    assert txt.full_layers == (3, 7) and len(txt.linear_layers) == 6  # interval rule
    tensors, _ = dm.read_checkpoint(ckpt("mm-4-untied"))
    a_log = tensors["model.language_model.layers.0.linear_attn.A_log"]
    assert a_log.dtype == np.float32 and tensors["model.language_model.layers.0.linear_attn.norm.weight"].dtype \
        == np.float32 and tensors["model.language_model.layers.0.linear_attn.dt_bias"].dtype == np.uint16
    assert any(n.startswith("model.visual.") for n in tensors) and any(n.startswith("mtp.") for n in tensors)


def test_real_9b_config_values(tmp_path):
    """The Qwen3.5-9B config.json as released (docs/models.md 2.2, trimmed vision_config)."""
    text = {
        "model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
        "attention_bias": False, "attn_output_gate": True, "rms_norm_eps": 1e-06, "vocab_size": 248320,
        "max_position_embeddings": 262144, "full_attention_interval": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "partial_rotary_factor": 0.25, "eos_token_id": 248044, "tie_word_embeddings": False, "dtype": "bfloat16",
    }
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": False, "text_config": text, "vision_config": {"model_type": "qwen3_5_vision"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = dm.load_target_config(tmp_path)
    assert (c.rotary_dim, c.rope_theta, c.conv_dim, c.lin_value_dim, c.q_dim) == (64, 1e7, 8192, 4096, 4096)
    assert c.full_layers == tuple(range(3, 32, 4)) and c.eos_token_ids == (248044,)
    shapes = dm.qwen35.qwen35_tensor_shapes(c)
    assert len(shapes) == 427  # 3 + 24 * 14 + 8 * 11 text tensors (docs/models.md 2.3)
    assert shapes["model.language_model.layers.3.self_attn.q_proj.weight"] == (8192, 4096)
    assert shapes["model.language_model.layers.0.linear_attn.conv1d.weight"] == (8192, 1, 4)


def _edit(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg.get("text_config", cfg))
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update(linear_num_value_heads=3), "text_config.*linear_num_value_heads.*multiple"),
    (lambda t: t.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda t: t.update(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types"),
    (lambda t: t.update(layer_types=["linear_attention"] * 3), "layer_types.*4 entries"),
    (lambda t: t["rope_parameters"].update(partial_rotary_factor=0.1), "partial_rotary_factor.*even"),
    (lambda t: t["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    (lambda t: t.update(attn_output_gate=False), "attn_output_gate"),
    (lambda t: t.pop("linear_key_head_dim"), "linear_key_head_dim.*missing"),
])
def test_bad_configs(tmp_path, edit, match):
    d = write_qwen35(tmp_path / "c", shards=1, tokenizer=False)
    _edit(d, edit)
    with pytest.raises(dm.ConfigError, match=match):
        dm.load_qwen35_config(d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["text_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dm.ConfigError, match="text_config"):
        dm.load_qwen35_config(d)


def test_target_kind_switch(tmp_path):
    q3 = write_qwen3(tmp_path / "q3", tokenizer=False)
    assert isinstance(dm.load_target_config(q3), dm.Qwen3Config)
    with pytest.raises(dm.ConfigError, match="architectures"):
        dm.load_qwen35_config(q3)


def test_checkpoint_mismatch_names_tensors(tmp_path):
    d = write_qwen35(tmp_path / "m", shards=2, tokenizer=False)
    _edit(d, lambda t: t.update(linear_num_value_heads=8, linear_num_key_heads=4))  # heads != checkpoint
    with pytest.raises(dm.WeightsError, match=r"in_proj_qkv.weight.*shape \[128, 64\], expected \[256, 64\]"):
        load_target(d)
    d2 = write_qwen35(tmp_path / "t", shards=1, tokenizer=False, tie=True)
    _edit(d2, lambda t: t.update(num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(dm.WeightsError, match="q_proj.weight"):
        load_target(d2)


# -- numerics vs transformers -------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_decode_verify_match_transformers(ckpt, variant):
    path = ckpt(variant)
    hf = hf_model(path)
    L = dm.load_qwen35_config(path).num_hidden_layers
    tap_ids = (0, L - 1, 3, 1)
    ours = load_target(path, tap_layer_ids=tap_ids, fuse=variant != "text-8-tied")
    prompt = np.random.default_rng(1).integers(0, 380, 13).tolist()
    cache = ours.new_cache(64)
    hidden, taps = ours.forward(prompt, cache)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    assert_close(ours.logits(hidden), out.logits[0], **LOGIT_TOL, what="prefill logits")
    for slot, layer in enumerate(tap_ids):  # residual after each layer, HF hidden_states[id + 1]
        assert_close(taps[:, slot * 64 : (slot + 1) * 64], out.hidden_states[layer + 1][0], **LOGIT_TOL,
                     what=f"tap {layer}")
    ids = list(prompt)
    tok = int(ours.greedy(hidden[-1:])[0])
    for step in range(8):  # decode: one token per forward, linear states carried in the cache
        ids.append(tok)
        h, _ = ours.forward([tok], cache, taps=False)
        ref = hf_logits(hf, ids)[-1]
        assert_close(ours.logits(h)[0], ref, **LOGIT_TOL, what=f"decode step {step}")
        tok = int(ours.greedy(h)[0])
        assert tok == int(torch.argmax(ref)), f"greedy token differs at step {step}"
    # prefill()/decode()/verify() wrappers; verification of 5 rows at once == the HF rows
    c2 = ours.new_cache(64)
    lg, _ = ours.prefill(prompt, c2)
    assert_close(lg, out.logits[0, -1:], **LOGIT_TOL, what="prefill()")
    n = len(prompt)
    assert_close(ours.decode(ids[n], c2), hf_logits(hf, ids[: n + 1])[-1:], **LOGIT_TOL, what="decode()")
    lv, tv = ours.verify(ids[n + 1 : n + 6], c2)
    assert lv.shape == (5, 384) and tv.shape == (5, 4 * 64) and c2.length == n + 6
    assert_close(lv, hf_logits(hf, ids[: n + 6])[-5:], **LOGIT_TOL, what="verify()")


def test_engine_greedy_matches_hf_generate(ckpt):
    path = ckpt("mm-4-untied")
    hf = hf_model(path)
    prompt = [5, 17, 99, 250, 3, 42]
    with torch.no_grad():  # HF's own cached decode path (conv / recurrent state updates)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    eng = dm.load(path, max_len=64, n_threads=1)
    assert isinstance(eng.target, dm.Qwen35Model)
    assert eng.generate(prompt, 16, ignore_eos=True).token_ids == ref


@pytest.mark.parametrize("precision, kv", [("highest", "float32"), ("medium", "bfloat16")])
def test_fused_layers_equal_composed_bit_for_bit(ckpt, precision, kv):
    """Every layer as one compiled call (Gated DeltaNet and gated full attention) gives exactly the
    composed path's hidden rows, taps and states: a prompt, a verification block, a rollback and a
    decode step."""
    if "cython" not in dk.available_backends():
        pytest.skip("the fused layers are Cython's")
    m = load_target(ckpt("mm-4-untied"), ops=Ops(n_threads=2, precision=precision), tap_layer_ids=(0, 2))
    assert m.fused_layers
    runs = []
    for fused in (True, False):
        m.fused_layers = fused
        cache = m.new_cache(48, dtype=kv)
        out = [m.forward([3, 77, 250, 9, 41, 8, 120], cache)]
        out.append(m.forward([5, 6, 7, 8, 9], cache))  # verification: checkpoints kept
        cache.truncate(cache.length - 2)
        out.append(m.forward([11], cache))
        runs.append((out, snapshot(cache)))
    for (h1, t1), (h2, t2) in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_array_equal(h1, h2)
        np.testing.assert_array_equal(t1, t2) if t1 is not None else None
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_array_equal(a, b)


# -- rollback ------------------------------------------------------------------------------------

def snapshot(cache):
    """Copies of everything that defines the sequence state: length, linear states, live K/V rows."""
    n = cache.length
    return n, cache.state.copy(), cache.conv.copy(), cache.kv.k[:, :n].copy(), cache.kv.v[:, :n].copy()


def assert_same_state(got, ref, what):
    assert got[0] == ref[0], f"{what}: length {got[0]} != {ref[0]}"
    for name, g, r in zip(("recurrent states", "conv states", "K", "V"), got[1:], ref[1:], strict=True):
        assert_close(g, r, **STATE_TOL, what=f"{what}: {name}")


@pytest.mark.parametrize("backend", list(dk.available_backends()))
def test_truncate_restores_the_accepted_prefix(ckpt, backend):
    """Verify k+1 rows, truncate to a+1 of them: the cache equals decoding those a+1 tokens one by one."""
    m = load_target(ckpt("mm-4-untied"), ops=Ops(n_threads=1, backend=backend))
    prompt = [11, 200, 37, 5, 99, 123, 64]
    block = [7, 300, 8, 250, 3, 19]  # anchor + 5 drafts
    start = len(prompt)
    ref = m.new_cache(32)
    m.forward(prompt, ref, last_only=True)
    ref_states, ref_hidden = [], []
    for t in block:  # the exact state after each accepted prefix, token by token
        h, _ = m.forward([t], ref, taps=False)
        ref_states.append(snapshot(ref))
        ref_hidden.append(h[0])
    cache = m.new_cache(32)
    m.forward(prompt, cache, last_only=True)
    hv, _ = m.forward(block, cache)  # verification: per-row checkpoints by default
    assert_close(hv, np.stack(ref_hidden), **STATE_TOL, what="verify rows vs decode")
    for a in reversed(range(len(block))):  # a = accepted drafts; also truncating again, further down
        cache.truncate(start + a + 1)
        assert_same_state(snapshot(cache), ref_states[a], f"a={a}")
    # decoding on from a restored prefix continues exactly like the reference
    cache2 = m.new_cache(32)
    m.forward(prompt, cache2, last_only=True)
    m.forward(block, cache2)
    cache2.truncate(start + 3)
    ref2 = m.new_cache(32)
    m.forward(prompt + block[:3], ref2, last_only=True)
    h1, _ = m.forward([77], cache2, taps=False)
    h2, _ = m.forward([77], ref2, taps=False)
    assert_close(h1, h2, **STATE_TOL, what="decode after truncate")
    assert_same_state(snapshot(cache2), snapshot(ref2), "after truncate + decode")


def test_truncate_bad_positions(ckpt):
    m = load_target(ckpt("mm-4-untied"), ops=Ops(n_threads=1))
    cache = m.new_cache(32)
    m.forward([1, 2, 3, 4], cache, last_only=True)  # prompt: no checkpoints
    with pytest.raises(ValueError, match=r"\[0, 4\].*verified"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="no verification checkpoints"):
        cache.truncate(3)
    cache.truncate(4)  # no-op
    m.forward([5, 6, 7], cache)  # verification rows 5..7 -> lengths 5, 6, 7 restorable
    with pytest.raises(ValueError, match=r"\[0, 7\]"):
        cache.truncate(8)
    with pytest.raises(ValueError, match="lengths 5..7"):
        cache.truncate(4)
    with pytest.raises(TypeError, match="int"):
        cache.truncate(5.0)
    cache.truncate(6)
    with pytest.raises(ValueError, match=r"\[0, 6\]"):
        cache.truncate(7)  # beyond the kept tokens, even though checkpoints exist
    m.forward([8], cache, taps=False)  # a new forward drops the old checkpoints
    with pytest.raises(ValueError, match="no verification checkpoints"):
        cache.truncate(6)
    m.forward([9, 10], cache, checkpoints=False)
    with pytest.raises(ValueError, match="no verification checkpoints"):
        cache.truncate(8)
    cache.truncate(0)  # always possible: an empty sequence
    assert cache.length == 0 and not cache.state.any() and not cache.conv.any()
    with pytest.raises(ValueError, match="overflow"):
        m.forward(list(range(33)), cache)
    with pytest.raises(ValueError, match="at least one"):
        m.forward([], cache)
    with pytest.raises(ValueError, match="outside the target"):
        m.set_taps((0, 4))


def test_chunked_prefill_and_bf16_kv(ckpt):
    path = ckpt("text-8-tied")
    full = load_target(path, tap_layer_ids=(2, 3))
    chunked = load_target(path, tap_layer_ids=(2, 3), prefill_chunk=4)
    prompt = list(range(3, 40, 2))  # 19 tokens: chunks 4+4+4+4+3, linear states carried across chunks
    c1, c2 = full.new_cache(64), chunked.new_cache(64)
    h1, t1 = full.forward(prompt, c1)
    h2, t2 = chunked.forward(prompt, c2)
    assert_close(h2, h1, **STATE_TOL, what="chunked prefill hidden")
    assert_close(t2, t1, **STATE_TOL, what="chunked prefill taps")
    assert_close(c2.state, c1.state, **STATE_TOL, what="chunked prefill states")
    assert_close(c2.conv, c1.conv, **STATE_TOL, what="chunked prefill conv states")
    h16, _ = full.forward(prompt, full.new_cache(64, "bfloat16"))  # bf16 K/V of the 2 full layers
    rel = np.linalg.norm(h16 - h1) / np.linalg.norm(h1)
    assert 0 < rel < 2e-2, rel


# -- lossless DFlash decoding on a hybrid target -------------------------------------------------

@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory):
    """Two hot targets: 3 hot tokens (varied outputs, short accepted runs) and 1 hot token (long runs)."""
    out = []
    for name, hot in (("hot3", 3), ("hot1", 1)):
        t = ckpt(name, multimodal=True, shards=2, tie=False, layers=4, hot_tokens=hot, hot_scale=26.0)
        d = write_dflash_for_qwen35(tmp_path_factory.mktemp(name + "d"), t, layers=2, block_size=16,
                                    target_layer_ids=(0, 2, 3))
        out.append(dm.load(t, d, max_len=128, n_threads=1))
    return out


def test_greedy_lossless_every_k(engines):
    """DFlash greedy == AR greedy on a hybrid target for k = 1..15 (rollback at every accept length)."""
    rng = np.random.default_rng(0)
    hist, outputs = {}, set()
    for eng in engines:
        for _ in range(3):
            p = rng.integers(0, 320, int(rng.integers(1, 13))).tolist()
            ref = eng.generate(p, 20, num_speculative_tokens=0, ignore_eos=True)
            outputs.update(ref.token_ids)
            for k in range(1, 16):
                res = eng.generate(p, 20, num_speculative_tokens=k, ignore_eos=True)
                assert res.token_ids == ref.token_ids, f"prompt {p} k={k}"
                for n, c in res.metrics.tau_histogram.items():
                    hist[n] = hist.get(n, 0) + c
    # meaningful only if drafts were rejected and accepted in runs of many lengths, on varied outputs
    assert hist.get(1, 0) > 0 and sum(c for n, c in hist.items() if n >= 3) > 0 and max(hist) >= 10, hist
    assert len(outputs) >= 5, outputs


def test_drafter_layer_ids_checked_against_hybrid_target(ckpt, tmp_path):
    t = ckpt("mm-4-untied")
    d = write_dflash_for_qwen35(tmp_path / "d", t, layers=1, block_size=8, target_layer_ids=(0, 4))
    with pytest.raises(ValueError, match="target_layer_ids"):
        dm.load(t, d, max_len=32)


def _kept_bytes(cache) -> int:
    rec = cache._rec
    arrays = [rec.state_before, rec.conv_before, *rec.mixed, *(a for ins in rec.inputs for a in ins)]
    seen, total = set(), 0
    for a in arrays:  # q, k, v are views of one conv output per layer: count each buffer once
        base = a if a.base is None else a.base
        if id(base) not in seen:
            seen.add(id(base))
            total += base.nbytes
    return total


def test_verification_keeps_one_set_of_states_whatever_the_block(ckpt):
    """Rollback keeps the states before the block once, plus the block's inputs (a few values per row
    and channel), never a recurrent state per row (k + 1 sets: 768 MB per 16-row block at 9B)."""
    m = load_target(ckpt("mm-4-untied"), ops=Ops(n_threads=1))
    kept = {}
    for rows in (3, 12):
        cache = m.new_cache(64)
        m.forward([11, 200, 37, 5], cache, last_only=True)
        m.forward(list(range(20, 20 + rows)), cache)
        assert cache._rec.state_before.nbytes == cache.state.nbytes
        kept[rows] = _kept_bytes(cache)
    per_row = (kept[12] - kept[3]) / 9
    assert per_row < 0.5 * cache.state.nbytes, (per_row, cache.state.nbytes)
