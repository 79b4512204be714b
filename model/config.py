"""config.json readers for the Qwen3 target and the DFlash drafter (docs/dflash.md 6, docs/models.md 1.1, 5).

Both readers accept the transformers 4.x and 5.x spellings (``rope_theta`` or
``rope_parameters.rope_theta``, ``torch_dtype`` or ``dtype``, ``layer_types`` present or not) and
raise ``ConfigError`` naming the file and the key on anything missing or inconsistent.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json (or generation_config.json) that cannot describe a supported model."""


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, where the JSON file should be") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


class _Reader:
    """Typed access to one config dict; errors name the file and the key."""

    def __init__(self, data: dict, path: Path):
        self.data, self.path = data, path

    def fail(self, key: str, what: str):
        raise ConfigError(f"{self.path}: key {key!r} {what}")

    def int(self, key: str, default=None, minimum: int = 1) -> int:
        v = self.data.get(key, default)
        if v is None:
            self.fail(key, "is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {v!r}")
        return v

    def float(self, key: str, default=None, maximum: float = math.inf) -> float:
        """A finite number in (0, maximum]: JSON's NaN and Infinity parse as floats and would pass
        a plain > 0 check (an rms_norm_eps of NaN generated token 0 everywhere)."""
        v = self.data.get(key, default)
        if v is None:
            self.fail(key, "is missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= maximum) or not math.isfinite(v):
            bound = "" if maximum == math.inf else f" <= {maximum:g}"
            self.fail(key, f"must be a finite positive number{bound}, got {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.fail(key, f"must be true or false, got {v!r}")
        return v

    def rope_theta(self, default: float | None = None) -> float:
        params = self.data.get("rope_parameters")
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            theta = params["rope_theta"]
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
                self.fail("rope_parameters.rope_theta", f"must be a finite positive number, got {theta!r}")
            return float(theta)
        if self.data.get("rope_theta") is None and default is None:
            self.fail("rope_theta", "is missing (neither rope_theta nor rope_parameters.rope_theta)")
        return self.float("rope_theta", default)

    def rope_scaling(self) -> tuple | None:
        """The rope_scaling dict as sorted items (None: plain RoPE); "linear" and "llama3" are
        supported (dflash_kernels.rope_inv_freq), anything else is an error naming the key."""
        scaling = self.data.get("rope_scaling")
        params = self.data.get("rope_parameters")
        if not isinstance(scaling, dict):
            scaling = params if isinstance(params, dict) else None
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            return None
        if kind not in ("linear", "llama3"):
            self.fail("rope_scaling", f"type {kind!r} is not supported (default, linear, llama3)")
        import dflash_kernels as dk

        try:
            dk.rope_inv_freq(1e4, 64, scaling)
        except (TypeError, ValueError) as err:
            self.fail("rope_scaling", f"is invalid: {err}")
        return tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_theta"))

    def dtype(self) -> str:
        return str(self.data.get("dtype") or self.data.get("torch_dtype") or "bfloat16").replace("torch.", "")

    def hidden_act(self):
        act = self.data.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            self.fail("hidden_act", f"must be 'silu', got {act!r}")

    def attention_bias(self):
        if self.data.get("attention_bias"):
            self.fail("attention_bias", "true is not supported (Qwen3 has no attention bias)")

    def decoder_shape(self, *, kv_default=None, head_dim_default=None, even_head_dim: bool = True) -> dict:
        """The DecoderShape fields but rope_theta (its spelling differs by family), checked: the kv
        heads divide the query heads, and head_dim is even where all of it is rotated.
        head_dim_default may be a function of the query heads."""
        heads = self.int("num_attention_heads")
        kv = self.int("num_key_value_heads", kv_default)
        if heads % kv:
            self.fail("num_key_value_heads", f"({kv}) must divide num_attention_heads ({heads})")
        if callable(head_dim_default):
            head_dim_default = head_dim_default(heads)
        head_dim = self.int("head_dim", head_dim_default)
        if even_head_dim and head_dim % 2:
            self.fail("head_dim", f"must be even for RoPE, got {head_dim}")
        return dict(hidden_size=self.int("hidden_size"), intermediate_size=self.int("intermediate_size"),
                    num_hidden_layers=self.int("num_hidden_layers"), num_attention_heads=heads,
                    num_key_value_heads=kv, head_dim=head_dim,
                    rms_norm_eps=self.float("rms_norm_eps", 1e-6, maximum=1.0))

    def layer_types(self, n_layers: int, default: str = "full_attention") -> list[str]:
        types = self.data.get("layer_types")
        if types is None:
            return [default] * n_layers
        if not isinstance(types, list) or len(types) != n_layers:
            self.fail("layer_types", f"must list {n_layers} entries (num_hidden_layers), got {types!r}")
        for t in types:
            if t not in ("full_attention", "sliding_attention"):
                self.fail("layer_types", f"entry {t!r} is not full_attention or sliding_attention")
        return list(types)


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The sizes every decoder stack here has (targets and drafter alike)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True, kw_only=True)
class Qwen3Config(DecoderShape):
    """Qwen3 dense target (architecture Qwen3ForCausalLM), or a Llama-family target
    (LlamaForCausalLM: the same decoder layer without the per-head q/k norms, qk_norm False)."""

    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    path: str = ""
    qk_norm: bool = True
    architecture: str = "Qwen3ForCausalLM"
    rope_scaling: tuple | None = None  # sorted (key, value) items of a linear / llama3 rope_scaling

    @functools.cached_property
    def rope_inv_freq(self):
        """Scaled RoPE frequencies for the kernels, or None for plain theta RoPE."""
        return _inv_freq(self)


def _eos_ids(value, reader: _Reader, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            reader.fail(key, f"must be a token id or a list of ids, got {value!r}")
    return tuple(ids)


def load_qwen3_config(model_dir) -> Qwen3Config:
    """Read <model_dir>/config.json of a Qwen3ForCausalLM or LlamaForCausalLM checkpoint."""
    path = Path(model_dir) / "config.json"
    return qwen3_config_from_dict(read_json(path), path)


def qwen3_config_from_dict(data: dict, path) -> Qwen3Config:
    """A Qwen3 / Llama config from its config.json contents (or a GGUF's translation of them);
    errors name ``path`` and the key."""
    r = _Reader(data, path)
    archs = r.data.get("architectures") or []
    mt = r.data.get("model_type")
    llama = "LlamaForCausalLM" in archs or (not archs and mt == "llama")
    if not llama and "Qwen3ForCausalLM" not in archs and (archs or mt != "qwen3"):
        r.fail("architectures", f"must contain 'Qwen3ForCausalLM' or 'LlamaForCausalLM', got {archs!r} "
                                f"(model_type {mt!r})")
    r.hidden_act()
    r.attention_bias()
    if r.data.get("mlp_bias"):
        r.fail("mlp_bias", "true is not supported (no bias in the MLP)")
    scaling = r.rope_scaling()
    hidden = r.int("hidden_size")
    # Qwen3 always states head_dim (0.6B, 4B differ from hidden / heads); Llama configs may omit it,
    # and their kv heads too
    shape = r.decoder_shape(
        kv_default=r.data.get("num_attention_heads") if llama else None,
        head_dim_default=lambda heads: hidden // heads if llama and hidden % heads == 0 else None)
    n_layers = shape["num_hidden_layers"]
    window = None
    if r.data.get("use_sliding_window"):
        window = r.int("sliding_window")
    types = r.layer_types(n_layers)
    if "sliding_attention" in types and window is None:
        window = r.int("sliding_window")
    return Qwen3Config(
        **shape,
        vocab_size=r.int("vocab_size"),
        rope_theta=r.rope_theta(10000.0 if llama else None),
        max_position_embeddings=r.int("max_position_embeddings", 40960),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        dtype=r.dtype(),
        eos_token_ids=_eos_ids(r.data.get("eos_token_id"), r, "eos_token_id"),
        layer_types=tuple(types),
        sliding_window=window,
        path=str(path),
        qk_norm=not llama,
        architecture="LlamaForCausalLM" if llama else "Qwen3ForCausalLM",
        rope_scaling=scaling,
    )


def _inv_freq(cfg):
    if cfg.rope_scaling is None:
        return None
    import dflash_kernels as dk

    return dk.rope_inv_freq(cfg.rope_theta, cfg.head_dim, dict(cfg.rope_scaling))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Tap rule used when a drafter config lacks target_layer_ids (docs/dflash.md 6)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(DecoderShape):
    """DFlash drafter (architecture DFlashDraftModel), Qwen3-style layers, no embedding / lm_head."""

    vocab_size: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]  # per layer: causal inside the block
    dtype: str = "bfloat16"
    path: str = ""
    qk_norm: bool = True  # DFlash drafters use Qwen3 layers, whatever the target
    rope_scaling: tuple | None = None

    @functools.cached_property
    def rope_inv_freq(self):
        return _inv_freq(self)

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def load_dflash_config(drafter_dir, num_target_layers: int | None = None) -> DFlashConfig:
    """Read <drafter_dir>/config.json of a z-lab DFlash drafter.

    num_target_layers (the target's layer count) is needed only when the config lacks
    target_layer_ids and num_target_layers, for the default tap rule.
    """
    path = Path(drafter_dir) / "config.json"
    r = _Reader(read_json(path), path)
    archs = r.data.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        r.fail("architectures", f"must contain 'DFlashDraftModel', got {archs!r}")
    r.hidden_act()
    r.attention_bias()
    scaling = r.rope_scaling()
    dcfg = r.data.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        r.fail("dflash_config", f"must be an object, got {dcfg!r}")
    d = _Reader(dcfg, f"{path} (dflash_config)")

    shape = r.decoder_shape()
    n_layers = shape["num_hidden_layers"]

    if "mask_token_id" in dcfg:
        mask = d.int("mask_token_id", minimum=0)
    else:
        mask = r.int("mask_token_id", minimum=0) if "mask_token_id" in r.data else None
        if mask is None:
            r.fail("dflash_config.mask_token_id", "is missing")
    if dcfg.get("block_size") is not None:
        block = d.int("block_size", minimum=2)
    else:
        block = r.int("block_size", minimum=2)  # older drafters: top level only

    n_target = r.data.get("num_target_layers", num_target_layers)
    if n_target is not None:
        n_target = r.int("num_target_layers", n_target)
    ids = dcfg.get("target_layer_ids")
    if ids is None:
        if n_target is None:
            r.fail("dflash_config.target_layer_ids", "is missing and so is num_target_layers")
        ids = default_target_layer_ids(n_target, n_layers)
    if not isinstance(ids, list) or not ids or any(type(i) is not int or i < 0 for i in ids):
        r.fail("dflash_config.target_layer_ids", f"must be a non-empty list of layer ids >= 0, got {ids!r}")

    types = r.layer_types(n_layers)
    window = None
    if "sliding_attention" in types:
        window = r.int("sliding_window")
    # Masks (docs/dflash.md 1): full layers bidirectional, sliding layers causal inside the block; an
    # explicit is_causal / dflash_config.causal overrides every layer.
    override = dcfg.get("causal", r.data.get("is_causal"))
    if override is not None and not isinstance(override, bool):
        r.fail("is_causal", f"must be true or false, got {override!r}")
    causal = tuple(override if override is not None else t == "sliding_attention" for t in types)

    vocab = r.data.get("vocab_size")
    return DFlashConfig(
        **shape,
        rope_theta=r.rope_theta(),
        vocab_size=r.int("vocab_size") if vocab is not None else None,
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=tuple(ids),
        num_target_layers=n_target,
        layer_types=tuple(types),
        sliding_window=window,
        causal=causal,
        dtype=r.dtype(),
        path=str(path),
        rope_scaling=scaling,
    )


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)


def load_generation_config(model_dir) -> GenerationConfig:
    """generation_config.json (optional): eos_token_id is an int or a list."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return GenerationConfig()
    r = _Reader(read_json(path), path)
    return GenerationConfig(_eos_ids(r.data.get("eos_token_id"), r, "eos_token_id"), r.data)
