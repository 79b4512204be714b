"""Qwen3 target on the dk kernels vs transformers' Qwen3ForCausalLM (fp32 eager, same bf16 weights)."""

import numpy as np
import pytest
import torch

import dflash_kernels.model as dm
from support import assert_close

transformers = pytest.importorskip("transformers")

LOGIT_TOL = dict(rtol=2e-4, atol=2e-4)


def hf_model(path):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def load_target(path, **kw):
    tcfg = dm.load_qwen3_config(path)
    tensors, origin = dm.read_checkpoint(path)
    return dm.Qwen3Model(tcfg, tensors, origin, **kw)


VARIANTS = {
    "single-tied-v4": dict(shards=1, tie=True, style="v4"),
    "sharded-untied-v5": dict(shards=2, tie=False, style="v5"),
    "sharded3-tied-f32": dict(shards=3, tie=True, dtype="f32", style="v5"),
}
FUSE = {"single-tied-v4": True, "sharded-untied-v5": False, "sharded3-tied-f32": True}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(ckpt_dir, variant):
    path = ckpt_dir(variant, **VARIANTS[variant])
    hf = hf_model(path)
    ours = load_target(path, tap_layer_ids=(0, 2, 1), fuse=FUSE[variant])
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 380, 11).tolist()
    cache = ours.new_cache(64)
    hidden, taps = ours.forward(prompt, cache)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    assert_close(ours.logits(hidden), out.logits[0], **LOGIT_TOL, what="prefill logits")
    # taps = residual stream after layers 0, 2, 1 = HF hidden_states[id + 1] (last one final-normed)
    hs = out.hidden_states
    for slot, layer in enumerate((0, 2, 1)):
        assert_close(taps[:, slot * 64 : (slot + 1) * 64], hs[layer + 1][0], **LOGIT_TOL, what=f"tap {layer}")

    # greedy decode step by step: tokens identical, per-step logits close
    ids = list(prompt)
    tok = int(ours.greedy(hidden[-1:])[0])
    for step in range(12):
        ids.append(tok)
        h, _ = ours.forward([tok], cache, taps=False)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert_close(ours.logits(h)[0], ref, **LOGIT_TOL, what=f"decode step {step}")
        tok = int(ours.greedy(h)[0])
        assert tok == int(torch.argmax(ref)), f"greedy token differs at step {step}"
    assert cache.length == len(ids)
    # the logits-returning wrappers agree with forward + logits
    c2 = ours.new_cache(64)
    lg, tp = ours.prefill(prompt, c2)
    assert_close(lg, out.logits[0, -1:], **LOGIT_TOL, what="prefill()")
    assert tp.shape == (len(prompt), 3 * 64)
    assert_close(ours.decode(ids[len(prompt)], c2), hf(torch.tensor([ids[: len(prompt) + 1]])).logits[0, -1:].detach(),
                 **LOGIT_TOL, what="decode()")
    lv, tv = ours.verify(ids[len(prompt) + 1 : len(prompt) + 5], c2)
    assert lv.shape == (4, 384) and tv.shape == (4, 192) and c2.length == len(prompt) + 5
    with torch.no_grad():
        ref = hf(torch.tensor([ids[: len(prompt) + 5]])).logits[0, -4:]
    assert_close(lv, ref, **LOGIT_TOL, what="verify()")


def test_hf_greedy_generate_matches_engine(ckpt_dir):
    path = ckpt_dir("single-tied-v4", **VARIANTS["single-tied-v4"])
    hf = hf_model(path)
    prompt = [5, 17, 99, 250, 3]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    eng = dm.load(path, max_len=64)
    res = eng.generate(prompt, 20, ignore_eos=True)
    assert res.token_ids == ref


def test_chunked_prefill_verify_rows_and_truncate(ckpt_dir):
    path = ckpt_dir("sharded-untied-v5", **VARIANTS["sharded-untied-v5"])
    full = load_target(path, tap_layer_ids=(1,))
    chunked = load_target(path, tap_layer_ids=(1,), prefill_chunk=4)
    prompt = list(range(3, 40, 2))  # 19 tokens: chunks 4+4+4+4+3
    c1, c2 = full.new_cache(64), chunked.new_cache(64)
    h1, t1 = full.forward(prompt, c1)
    h2, t2 = chunked.forward(prompt, c2)
    assert_close(h2, h1, rtol=1e-5, atol=1e-5, what="chunked prefill hidden")
    assert_close(t2, t1, rtol=1e-5, atol=1e-5, what="chunked prefill taps")
    got = []
    h_cb, none = chunked.forward(prompt, chunked.new_cache(64), on_taps=lambda t: got.append(t.copy()))
    assert none is None and [len(g) for g in got] == [4, 4, 4, 4, 3]
    assert_close(np.concatenate(got), t1, rtol=1e-5, atol=1e-5, what="streamed taps")
    h_last, _ = chunked.forward(prompt, chunked.new_cache(64), last_only=True)
    assert h_last.shape == (1, 64)
    assert_close(h_last, h1[-1:], rtol=1e-5, atol=1e-5, what="last_only")
    # verify 5 rows, keep 2, then decode: same as decoding those 2 tokens directly
    c1.truncate(len(prompt))
    hv, _ = full.forward([7, 8, 9, 10, 11], c1)
    c1.truncate(len(prompt) + 2)
    hn, _ = full.forward([12], c1)
    ref = full.new_cache(64)
    full.forward(prompt + [7, 8], ref)
    hr, _ = full.forward([12], ref)
    assert_close(hn, hr, rtol=1e-5, atol=1e-5, what="decode after truncate")
    with pytest.raises(ValueError, match="truncate"):
        c1.truncate(c1.length + 1)


def test_bf16_kv_cache_close_to_fp32(ckpt_dir):
    path = ckpt_dir("single-tied-v4", **VARIANTS["single-tied-v4"])
    m = load_target(path)
    prompt = list(range(10, 30))
    h32, _ = m.forward(prompt, m.new_cache(32, "float32"))
    h16, _ = m.forward(prompt, m.new_cache(32, "bfloat16"))
    assert_close(h16, h32, rtol=5e-2, atol=5e-2, what="bf16 KV cache")
    with pytest.raises(ValueError, match="kv_dtype"):
        m.new_cache(8, "float16")


def test_cache_overflow_and_empty_input(ckpt_dir):
    m = load_target(ckpt_dir("single-tied-v4", **VARIANTS["single-tied-v4"]))
    with pytest.raises(ValueError, match="overflow"):
        m.forward(list(range(9)), m.new_cache(8))
    with pytest.raises(ValueError, match="at least one"):
        m.forward([], m.new_cache(8))
    with pytest.raises(ValueError, match="outside the target"):
        m.set_taps((0, 3))
