"""GGUF checkpoints: quant types read against an independent dequantizer, the Llama q/k row order,
Llama parity with transformers through a GGUF, the tokenizer from GGUF metadata, the converter, and
clear errors on bad files. Files are written here with the gguf package's own writer."""

import json

import numpy as np
import pytest
import torch

import dflash_kernels.model as dm
from checkpoints import llama_config, llama_tensors, tokenizer_json, write_dflash
from dflash_kernels.model.gguf import convert_gguf, read_gguf
from dflash_kernels.model.weights import WeightsError, as_f32
from support import greedy_runs

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType


# -- an independent reference for the block formats (ggml-common.h: 32 values per block) ----------
def ref_dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    rows = raw.reshape(raw.shape[0], -1)
    if qtype == Q.Q8_0:  # fp16 scale d, 32 int8: d * q
        blocks = rows.reshape(rows.shape[0], -1, 34)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        return (d * blocks[..., 2:].view(np.int8).astype(np.float32)).reshape(rows.shape[0], -1)
    if qtype in (Q.Q4_0, Q.Q4_1):  # fp16 d (and min m), 16 bytes: low nibbles = values 0..15, high = 16..31
        size = 18 if qtype == Q.Q4_0 else 20
        blocks = rows.reshape(rows.shape[0], -1, size)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        nib = blocks[..., size - 16:]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.float32)
        if qtype == Q.Q4_0:
            return (d * (q - 8)).reshape(rows.shape[0], -1)
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        return (d * q + m).reshape(rows.shape[0], -1)
    raise AssertionError(qtype)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for Llama q/k rows (convert_hf_to_gguf: LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def write_gguf(path, cfg: dict, tensors: dict, *, qtype=Q.F32, tokenizer: bool = True, pre: str = "qwen2",
               chat_template: str | None = None, skip_keys=(), arch: str = "llama"):
    """A GGUF as llama.cpp's converter writes it: Llama q/k rows permuted (Qwen3's are not), matmul
    weights in qtype (norms stay F32), tokenizer.ggml.* from tokenizer_json()."""
    w = gguf.GGUFWriter(str(path), arch)
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
          "embedding_length": H, "feed_forward_length": cfg["intermediate_size"], "head_count": heads,
          "head_count_kv": cfg["num_key_value_heads"], "layer_norm_rms_eps": cfg["rms_norm_eps"],
          "rope_freq_base": cfg["rope_theta"]}
    for key, value in kv.items():
        if key not in skip_keys:
            getattr(w, f"add_{key}")(value)
    if "head_dim" in cfg and "key_length" not in skip_keys:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if tokenizer:
        tok = json.loads(tokenizer_json())
        vocab = dict(tok["model"]["vocab"])
        for t in tok["added_tokens"]:
            vocab[t["content"]] = t["id"]
        tokens = [None] * cfg["vocab_size"]
        for t, i in vocab.items():
            tokens[i] = t
        types = [3 if t is not None and t.startswith("<") and t.endswith(">") and i >= len(tok["model"]["vocab"])
                 else 1 for i, t in enumerate(tokens)]
        tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        if chat_template:
            w.add_chat_template(chat_template)
    for name, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        if arch != "llama":
            pass
        elif name.endswith("q_proj.weight"):
            arr = llama_permute(arr, heads)
        elif name.endswith("k_proj.weight"):
            arr = llama_permute(arr, cfg["num_key_value_heads"])
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny(tie=True, **kw):
    cfg = llama_config(hidden=64, heads=4, kv=2, layers=2, inter=96, tie=tie, **kw)
    return cfg, llama_tensors(cfg, seed=3)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quant_types_read_against_a_reference(tmp_path, qtype):
    cfg, tensors = tiny()
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, qtype=qtype)
    ck = read_gguf(path, "float32")
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, src in tensors.items():
        got = as_f32(ck.tensors[name])
        if src.ndim == 1 or qtype == Q.F32:
            expected = src.astype(np.float32)
        elif qtype == Q.F16:
            expected = src.astype(np.float32).astype(np.float16).astype(np.float32)
        elif qtype == Q.BF16:
            expected = torch.from_numpy(src.astype(np.float32)).bfloat16().float().numpy()
        else:  # the block formats: our reader vs the independent formula above, on the file's bytes
            expected = ref_dequantize(np.asarray(raw[gguf_name(name)].data), qtype).reshape(src.shape)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
                expected = expected.reshape(heads, -1, 2, src.shape[1]).swapaxes(1, 2).reshape(src.shape)
            assert np.abs(expected - src).max() < 0.3  # and the format is what we think it is
        np.testing.assert_array_equal(got, expected, err_msg=name)
    # quantized tensors expanded to bf16: the float32 values rounded to nearest even; F32 / F16 /
    # BF16 tensors keep their own type either way
    ck16 = read_gguf(path, "bfloat16")
    w = "model.layers.0.mlp.up_proj.weight"
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        expected16 = torch.from_numpy(np.array(as_f32(ck.tensors[w]))).bfloat16().float().numpy()
        assert ck16.tensors[w].dtype == np.uint16
        np.testing.assert_array_equal(as_f32(ck16.tensors[w]), expected16)
    else:
        assert ck16.tensors[w].dtype == ck.tensors[w].dtype


def test_q_and_k_rows_come_back_in_hugging_face_order(tmp_path):
    cfg, tensors = tiny()
    ck = read_gguf(write_gguf(tmp_path / "m.gguf", cfg, tensors), "float32")
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(ck.tensors[name], tensors[name].astype(np.float32))


@pytest.mark.parametrize("tie", [True, False])
def test_llama_gguf_matches_transformers(tmp_path, tie):
    cfg, tensors = tiny(tie=tie)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    state = {k: torch.from_numpy(v.astype(np.float32)) for k, v in tensors.items()}
    if tie:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors)
    engine = dm.load(path, gguf_dtype="float32", max_len=64)
    assert engine.target.cfg.architecture == "LlamaForCausalLM" and engine.target.cfg.tie_word_embeddings == tie
    prompt = list(np.random.default_rng(0).integers(0, 300, 9))
    cache = engine.target.new_cache(64)
    logits, _ = engine.target.prefill(prompt, cache)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]
    np.testing.assert_allclose(logits[0], ref.numpy(), rtol=2e-4, atol=2e-4)
    res = engine.generate(prompt, 12, ignore_eos=True)
    with torch.no_grad():
        hf_ids = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert res.token_ids == hf_ids[0, len(prompt):].tolist()


def test_qwen3_gguf_matches_the_same_checkpoint_from_safetensors(tmp_path):
    from checkpoints import qwen3_config, qwen3_tensors, write_qwen3

    hf_dir = write_qwen3(tmp_path / "hf", dtype="f32", layers=2, head_dim=24)
    cfg = qwen3_config(layers=2, head_dim=24)
    path = write_gguf(tmp_path / "q.gguf", cfg, qwen3_tensors(cfg), arch="qwen3")
    ours, ref = dm.load(path, gguf_dtype="float32", max_len=32), dm.load(hf_dir, max_len=32)
    assert ours.target.cfg.qk_norm and ours.target.cfg.head_dim == 24
    prompt = [4, 8, 15, 16, 23, 42]
    a, _ = ours.target.prefill(prompt, ours.target.new_cache(32))
    b, _ = ref.target.prefill(prompt, ref.target.new_cache(32))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dflash_over_a_gguf_target_is_lossless(tmp_path):
    cfg, tensors = tiny()
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors)
    hf_dir = tmp_path / "cfg"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    drafter = write_dflash(tmp_path / "drafter", hf_dir, target_layer_ids=(0, 1), block_size=8)
    engine = dm.load(path, drafter, max_len=128)
    for ar, sd in greedy_runs(engine):
        assert sd.token_ids == ar.token_ids


def test_tokenizer_from_metadata_matches_the_original(tmp_path):
    from tokenizers import Tokenizer

    cfg, tensors = tiny()
    ck = read_gguf(write_gguf(tmp_path / "m.gguf", cfg, tensors, pre="default"), "float32")
    original = Tokenizer.from_str(tokenizer_json())
    for text in ["The quick brown fox", "def add(a, b):\n    return a + b", "Über café 東京 🙂 <|im_end|>x"]:
        assert ck.tokenizer.encode(text, add_special_tokens=False).ids == original.encode(text).ids
        ids = original.encode(text).ids
        assert ck.tokenizer.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)


def test_chat_template_and_stops_come_from_the_file(tmp_path):
    cfg, tensors = tiny()
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    engine = dm.load(write_gguf(tmp_path / "m.gguf", cfg, tensors, chat_template=template), max_len=64)
    assert engine.chat_prompt("hi") == "[user]hi[assistant]"
    assert cfg["eos_token_id"] in engine.stop_ids


def test_converter_writes_a_directory_transformers_and_we_load(tmp_path):
    cfg, tensors = tiny(tie=False)
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, qtype=Q.Q8_0, chat_template="{{ messages[0]['content'] }}")
    out = convert_gguf(path, tmp_path / "hf", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = dm.load(out, max_len=64)
    direct = dm.load(path, gguf_dtype="float32", max_len=64)
    prompt = [5, 17, 33, 2, 90, 11]
    logits, _ = ours.target.prefill(prompt, ours.target.new_cache(64))
    logits_direct, _ = direct.target.prefill(prompt, direct.target.new_cache(64))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(logits[0], logits_direct[0])
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("The quick brown fox") == ours.tokenizer.encode("The quick brown fox")
    assert ours.chat_prompt("hello") == "hello"


def test_directory_holding_one_gguf_loads(tmp_path):
    cfg, tensors = tiny()
    (tmp_path / "d").mkdir()
    write_gguf(tmp_path / "d" / "m.gguf", cfg, tensors)
    assert dm.load(tmp_path / "d", max_len=32).target.cfg.num_hidden_layers == 2


def test_bad_gguf_files_name_the_file(tmp_path):
    cfg, tensors = tiny()
    good = write_gguf(tmp_path / "m.gguf", cfg, tensors)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="cut.gguf"):
        dm.load(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOTAGGUF" * 64)
    with pytest.raises(WeightsError, match="junk.gguf"):
        read_gguf(junk)
    notok = write_gguf(tmp_path / "notok.gguf", cfg, tensors, tokenizer=False)
    with pytest.raises(dm.TokenizerError, match="notok.gguf.*tokenizer"):
        dm.load(notok)
    nokey = write_gguf(tmp_path / "nokey.gguf", cfg, tensors, skip_keys=("feed_forward_length",))
    with pytest.raises(WeightsError, match="nokey.gguf.*feed_forward_length"):
        dm.load(nokey)
    extra = dict(tensors)
    extra["model.layers.5.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(WeightsError, match="unexpected tensors.*layers.5"):
        dm.load(write_gguf(tmp_path / "extra.gguf", cfg, extra))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(data)
    with pytest.raises(WeightsError, match="2 .gguf files"):
        read_gguf(tmp_path / "two")


def test_command_line_converts_and_generates_from_a_gguf(tmp_path, capsys):
    from dflash_kernels.model.cli import main

    cfg, tensors = tiny()
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, qtype=Q.Q4_1, chat_template=template)
    assert main(["convert-gguf", str(path), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    capsys.readouterr()
    assert main(["generate", "The quick", "--target", str(path), "--max-new-tokens", "5"]) == 0
    direct = dm.load(path, max_len=64)
    expected = direct.generate(direct.chat_prompt("The quick"), 5).text  # chat by default: it has a template
    assert capsys.readouterr().out == expected + "\n"
