"""config.json reader for Qwen3.5 hybrid targets (docs/models.md 2.1, 2.2, 2.8) and the target-kind switch.

Two layouts are accepted:

* multimodal (what the dense releases ship): architectures ``Qwen3_5ForConditionalGeneration``,
  model_type ``qwen3_5``, the text model under ``text_config`` (model_type ``qwen3_5_text``),
  tensors under ``model.language_model.``; ``vision_config`` and the vision / MTP tensors are ignored.
* text-only (``Qwen3_5ForCausalLM.save_pretrained``): flat config, model_type ``qwen3_5_text``,
  tensors under ``model.``.

Errors are ``ConfigError`` naming the file and the key (``text_config.<key>`` in the nested layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import DecoderShape, Qwen3Config, _eos_ids, _Reader, load_qwen3_config, read_json

QWEN35_ARCHS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
QWEN35_TYPES = ("qwen3_5", "qwen3_5_text")
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class Qwen35Config(DecoderShape):
    """Qwen3.5 text model: Gated DeltaNet ("linear_attention") + gated full-attention layers."""

    vocab_size: int
    partial_rotary_factor: float
    rotary_dim: int  # int(head_dim * partial_rotary_factor): RoPE on the first rotary_dim dims only
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    multimodal: bool  # nested layout: tensors under model.language_model.
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    path: str = ""

    @property
    def prefix(self) -> str:
        """Tensor name prefix of the text model."""
        return "model.language_model." if self.multimodal else "model."

    @property
    def lin_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def lin_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short conv: [q | k | v]."""
        return 2 * self.lin_key_dim + self.lin_value_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


def is_qwen35(data: dict) -> bool:
    """A config.json dict that describes a Qwen3.5 checkpoint (either layout)."""
    archs = data.get("architectures") or []
    return any(a in QWEN35_ARCHS for a in archs) or data.get("model_type") in QWEN35_TYPES


def load_target_config(model_dir) -> Qwen3Config | Qwen35Config:
    """The target's config: Qwen3.5 (by architecture / model_type) or else Qwen3."""
    path = Path(model_dir) / "config.json"
    if is_qwen35(read_json(path)):
        return load_qwen35_config(model_dir)
    return load_qwen3_config(model_dir)


def _layer_types(r: _Reader, n_layers: int) -> list[str]:
    types = r.data.get("layer_types")
    if types is None:  # docs/models.md 2.1: layer i is full attention iff (i + 1) % interval == 0
        interval = r.int("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        r.fail("layer_types", f"must list {n_layers} entries (num_hidden_layers), got {types!r}")
    for t in types:
        if t not in LAYER_KINDS:
            r.fail("layer_types", f"entry {t!r} is not linear_attention or full_attention")
    return list(types)


def _rotary(r: _Reader, head_dim: int) -> tuple[float, float, int]:
    """(rope_theta, partial_rotary_factor, rotary_dim) from rope_parameters or the top-level keys."""
    params = r.data.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        r.fail("rope_parameters", f"must be an object, got {params!r}")
    params = params or {}
    kind = params.get("rope_type", "default")
    scaling = r.data.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", kind))
    if kind not in (None, "default"):
        r.fail("rope_parameters.rope_type", f"{kind!r} is not supported (only default RoPE)")
    theta = r.rope_theta()
    key, factor = "rope_parameters.partial_rotary_factor", params.get("partial_rotary_factor")
    if factor is None:
        key, factor = "partial_rotary_factor", r.data.get("partial_rotary_factor", 0.25)  # HF default
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        r.fail(key, f"must be a number in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        r.fail(key, f"gives rotary dim int({head_dim} * {factor}) = {rotary_dim}; it must be even and >= 2")
    # mrope_section / mrope_interleaved: for text all three M-RoPE position streams are equal, so
    # M-RoPE reduces exactly to plain partial RoPE (docs/models.md 2.6.3); the fields are not needed.
    return theta, float(factor), rotary_dim


def load_qwen35_config(model_dir) -> Qwen35Config:
    """Read <model_dir>/config.json of a Qwen3.5 checkpoint (multimodal or text-only layout)."""
    path = Path(model_dir) / "config.json"
    top = _Reader(read_json(path), path)
    if not is_qwen35(top.data):
        top.fail("architectures", f"must contain one of {list(QWEN35_ARCHS)} (or model_type one of "
                                  f"{list(QWEN35_TYPES)}), got {top.data.get('architectures')!r} "
                                  f"(model_type {top.data.get('model_type')!r})")
    archs = top.data.get("architectures") or []
    nested = "text_config" in top.data or "Qwen3_5ForConditionalGeneration" in archs \
        or top.data.get("model_type") == "qwen3_5"
    if nested:
        text = top.data.get("text_config")
        if not isinstance(text, dict):
            top.fail("text_config", f"must be an object holding the text model's config, got {text!r}")
        r = _Reader(text, f"{path} (text_config)")
    else:
        r = top
    r.hidden_act()
    if r.data.get("attention_bias"):
        r.fail("attention_bias", "true is not supported (Qwen3.5 has no attention bias)")
    if not r.bool("attn_output_gate", True):
        r.fail("attn_output_gate", "false is not supported (Qwen3.5 full attention is always gated)")
    # partial RoPE: _rotary checks the rotated part's width, not head_dim's
    shape = r.decoder_shape(head_dim_default=256, even_head_dim=False)
    n_layers, head_dim = shape["num_hidden_layers"], shape["head_dim"]
    lin_k = r.int("linear_num_key_heads")
    lin_v = r.int("linear_num_value_heads")
    if lin_v % lin_k:
        r.fail("linear_num_value_heads", f"({lin_v}) must be a multiple of linear_num_key_heads ({lin_k}): "
                                         "value head h reads key head h // (H_v / H_k)")
    theta, factor, rotary_dim = _rotary(r, head_dim)
    types = _layer_types(r, n_layers)
    # The lm_head belongs to the outer model in the nested layout, so its tie flag wins there.
    tie_default = r.bool("tie_word_embeddings", False)
    tie = top.bool("tie_word_embeddings", tie_default) if nested else tie_default
    eos_src, eos_key = (r, "eos_token_id") if r.data.get("eos_token_id") is not None else (top, "eos_token_id")
    return Qwen35Config(
        **shape,
        vocab_size=r.int("vocab_size"),
        rope_theta=theta,
        partial_rotary_factor=factor,
        rotary_dim=rotary_dim,
        max_position_embeddings=r.int("max_position_embeddings", 32768),
        tie_word_embeddings=tie,
        layer_types=tuple(types),
        linear_num_key_heads=lin_k,
        linear_num_value_heads=lin_v,
        linear_key_head_dim=r.int("linear_key_head_dim"),
        linear_value_head_dim=r.int("linear_value_head_dim"),
        linear_conv_kernel_dim=r.int("linear_conv_kernel_dim", 4, minimum=2),
        multimodal=nested,
        dtype=r.dtype() if (r.data.get("dtype") or r.data.get("torch_dtype")) else top.dtype(),
        eos_token_ids=_eos_ids(eos_src.data.get("eos_token_id"), eos_src, eos_key),
        path=str(path),
    )
