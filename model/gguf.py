"""GGUF checkpoints (llama.cpp's single-file format) read into the Hugging Face layout.

The file is parsed by the ``gguf`` package (llama.cpp's own reader). What this module adds is the
translation to what the rest of the model layer reads from a Hugging Face directory:

- a config dict (``LlamaForCausalLM`` or ``Qwen3ForCausalLM``) from the ``<arch>.*`` metadata;
- tensors under their Hugging Face names. F32 / F16 / BF16 tensors stay zero-copy views of the
  memory-mapped file; quantized ones (Q8_0, Q4_0, Q4_1, and every other type ``gguf`` can
  dequantize) are expanded at load to float32 (exact: every Q8_0/Q4 value is a float16 scale times
  a small integer, plus a float16 offset for Q4_1) or to bf16 (half the bytes, rounded to nearest even);
  or, with dtype "blocks", Q4_0 / Q4_1 / Q8_0 matmul weights (the layers' projections, the embedding
  and LM head) stay in their blocks (``dflash_kernels.quant.QuantizedRows``: the kernels read them as
  they are, exactly as their float32 expansion, 5 or 8.5 bits a weight) and other quantized tensors
  expand to bf16;
- llama.cpp's converter permutes the rows of a Llama q/k projection so that RoPE rotates adjacent
  pairs (GPT-J style); this module undoes it, back to the rotate-half (NeoX) layout the kernels use;
- a ``tokenizers.Tokenizer`` from the ``tokenizer.ggml.*`` metadata (byte-level BPE, "gpt2"), the
  chat template and the stop ids.

Errors are ``WeightsError`` / ``TokenizerError`` naming the file and the tensor or key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_kernels import f32_to_bf16
from dflash_kernels.quant import BLOCK_BYTES, QuantizedRows

from .weights import WeightsError

# what a GGUF's quantized tensors become (read_gguf's dtype, load's gguf_dtype)
GGUF_DTYPES = ("bfloat16", "float32", "blocks", "blocks-int8")
# the matmul weights (the layers' projections, the embedding / LM head), which dtypes "blocks" and
# "blocks-int8" keep in their blocks (an embedding lookup expands its rows exactly); "blocks-int8"
# multiplies Q4 blocks with int8 activations (dflash_kernels.quant.pack_quantized)
_MATMULS = tuple(f"{n}_proj.weight" for n in ("q", "k", "v", "o", "gate", "up", "down")) + \
    ("embed_tokens.weight", "lm_head.weight")

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# general.architecture -> Hugging Face architecture, model_type
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split regex the vocabulary was learnt
# with. "smollm" (and the StarCoder family it comes from) splits every digit apart first, then uses
# GPT-2's regex; names not listed get GPT-2's regex alone.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
_CONTROL = 3  # tokenizer.ggml.token_type of special tokens (<|im_end|>, ...)


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in the shapes a Hugging Face directory gives them."""

    path: Path
    config: dict  # config.json equivalent
    tensors: dict  # HF name -> numpy array (uint16 = bf16 bits, float32, or float16)
    origin: dict  # HF name -> "file (gguf tensor name, type)"
    tokenizer: object | None  # tokenizers.Tokenizer
    chat_template: str | None
    eos_token_ids: tuple


def find_gguf(path) -> Path:
    """A .gguf file, or the one .gguf file of a directory (without config.json)."""
    path = Path(path)
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(files) != 1:
        what = "no" if not files else f"{len(files)}"
        raise WeightsError(f"{path}: {what} .gguf files (need exactly one, or pass the file itself)")
    return files[0]


def is_gguf(path) -> bool:
    """True for a .gguf file or a directory holding one and no config.json."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def _reader(path: Path):
    """gguf.GGUFReader over a plain ndarray view of its file mapping. The reader slices and views its
    np.memmap once per metadata value, and np.memmap's indexing runs Python code each time (as in
    weights.py): SmolLM2's 147k tokenizer parts took 1.65 s to parse, 0.56 s this way (session 31).
    The views still read the mapping; nothing is copied."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapping):  # GGUFReader.__init__ assigns its np.memmap here
            self._data = mapping.view(np.ndarray) if isinstance(mapping, np.memmap) else mapping

    return Reader(path, "r")


def read_gguf(path, dtype: str = "bfloat16", with_tokenizer: bool = True, mmap: bool = True) -> GGUFCheckpoint:
    """Read a GGUF checkpoint (see the module docstring). dtype: what quantized tensors are expanded
    to, "float32" or "bfloat16", or "blocks" (Q4_0 / Q4_1 / Q8_0 matmul weights kept as
    ``QuantizedRows``, the rest in bf16), or "blocks-int8" (the same, their Q4 blocks to be multiplied
    with int8 activations: ``QuantizedRows.activations``); F32 / F16 / BF16 tensors keep their own type (memory-mapped,
    or copied into memory with mmap=False)."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {GGUF_DTYPES}, got {dtype!r}")
    path = find_gguf(path)
    try:
        reader = _reader(path)
    except FileNotFoundError:
        raise WeightsError(f"{path}: file not found") from None
    except Exception as err:  # the reader raises ValueError, struct.error, IndexError... on corrupt files
        raise WeightsError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise WeightsError(f"{path}: general.architecture {arch!r} is not supported (only {sorted(_ARCHS)})")
    config = _config(meta, arch, reader)
    tensors, origin = _tensors(reader, path, arch, config, dtype)
    if not mmap:  # nothing may keep the mapping: a later truncation of the file would SIGBUS
        tensors = {k: _in_memory(v) for k, v in tensors.items()}
    tokenizer = _tokenizer(meta) if with_tokenizer else None
    eos = [i for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
           if i is not None]
    return GGUFCheckpoint(path, config, tensors, origin, tokenizer, meta.get("tokenizer.chat_template"),
                          tuple(dict.fromkeys(int(i) for i in eos)))


def read_gguf_tokenizer(path):
    """(tokenizers.Tokenizer, chat template or None) from a GGUF's metadata only: no tensor is read."""
    path = find_gguf(path)
    try:
        reader = _reader(path)
    except Exception as err:
        raise WeightsError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    meta = _Metadata(reader, path)
    return _tokenizer(meta), meta.get("tokenizer.chat_template")


class _Metadata:
    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as err:
            raise WeightsError(f"{self.path}: metadata {key!r} cannot be read ({err})") from None

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise WeightsError(f"{self.path}: metadata key {key!r} is missing")
        return v


def _config(meta: _Metadata, arch: str, reader) -> dict:
    n = meta.need
    heads = int(n(f"{arch}.attention.head_count"))
    hidden = int(n(f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = meta.get(f"{arch}.vocab_size") or (int(embed.shape[1]) if embed is not None else len(tokens or ()))
    cfg = {
        "architectures": [_ARCHS[arch][0]],
        "model_type": _ARCHS[arch][1],
        "hidden_size": hidden,
        "intermediate_size": int(n(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(n(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(n(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    for key, gkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = meta.get(f"tokenizer.ggml.{gkey}")
        if v is not None:
            cfg[key] = int(v)
    return cfg


def _in_memory(v):
    """v with its values copied out of the file mapping (an array whose base is the mapping)."""
    if isinstance(v, QuantizedRows):
        return v if v.blocks.base is None else QuantizedRows(np.array(v.blocks), v.qtype, v.activations)
    return v if v.base is None else np.array(v)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to rotate-half halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader, path: Path, arch: str, cfg: dict, dtype: str):
    from gguf import GGMLQuantizationType as Q, quants

    tensors, origin = {}, {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise WeightsError(f"{path}: tensor {t.name!r} is not part of a {arch} model")
        where = f"{path} (tensor {t.name}, {t.tensor_type.name})"
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the fastest dimension first
        try:
            if t.tensor_type == Q.F32:
                arr = np.asarray(t.data, np.float32).reshape(shape)
            elif t.tensor_type == Q.F16:
                arr = np.asarray(t.data).view(np.float16).reshape(shape)
            elif t.tensor_type == Q.BF16:
                arr = np.asarray(t.data).view(np.uint16).reshape(shape)
            elif dtype.startswith("blocks") and t.tensor_type.name in BLOCK_BYTES and name.endswith(_MATMULS):
                arr = QuantizedRows.from_bytes(t.data, shape, t.tensor_type.name)
                if dtype == "blocks-int8":
                    arr.activations = "int8"
            else:
                full = quants.dequantize(t.data, t.tensor_type).reshape(shape)
                arr = np.ascontiguousarray(full, np.float32) if dtype == "float32" else f32_to_bf16(full)
        except (NotImplementedError, ValueError, TypeError) as err:
            raise WeightsError(f"{where}: cannot be read ({err})") from None
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
            if shape[0] % (2 * heads):
                raise WeightsError(f"{where}: {shape[0]} rows do not split into {heads} heads of even size")
            if isinstance(arr, QuantizedRows):  # whole rows of blocks move
                arr = QuantizedRows(np.ascontiguousarray(_unpermute(arr.blocks, heads)), arr.qtype, arr.activations)
            else:
                arr = np.ascontiguousarray(_unpermute(arr, heads))
        if name in tensors:
            raise WeightsError(f"{where}: tensor appears twice")
        tensors[name], origin[name] = arr, where
    return tensors, origin


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def _tokenizer(meta: _Metadata):
    """tokenizers.Tokenizer from the metadata: byte-level BPE ("gpt2") with its pre-tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from .tokenizer import TokenizerError

    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{meta.path}: no tokenizer in the metadata (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise TokenizerError(f"{meta.path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level "
                             "BPE, 'gpt2')")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise TokenizerError(f"{meta.path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"{meta.path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level])
    elif pre in _DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or ()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL]
    tok.add_special_tokens(special)
    return tok


def convert_gguf(path, out_dir, dtype: str = "bfloat16") -> Path:
    """Write a GGUF checkpoint as a Hugging Face directory that transformers, vLLM and this library
    load: config.json, model.safetensors (every tensor in ``dtype``), tokenizer.json,
    tokenizer_config.json (chat template, special tokens) and generation_config.json. Returns out_dir."""
    import json

    import torch
    from safetensors.torch import save_file

    from .weights import as_f32

    ck = read_gguf(path, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, arr in ck.tensors.items():
        if dtype == "float32":
            tensors[name] = torch.from_numpy(np.array(as_f32(arr)))
        else:
            bits = arr if arr.dtype == np.uint16 else f32_to_bf16(as_f32(arr))
            tensors[name] = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    if ck.config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(ck.config, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ck.tokenizer.save(str(out / "tokenizer.json"))
    vocab = ck.tokenizer.get_vocab(with_added_tokens=True)
    names = {i: t for t, i in vocab.items()}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
               "clean_up_tokenization_spaces": False, "model_max_length": ck.config["max_position_embeddings"]}
    for key in ("bos_token", "eos_token"):
        i = ck.config.get(key + "_id")
        if i in names:
            tok_cfg[key] = names[i]
    if ck.chat_template is not None:
        tok_cfg["chat_template"] = ck.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": ck.config.get("bos_token_id"), "eos_token_id": list(ck.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
