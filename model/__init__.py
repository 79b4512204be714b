"""dflash_kernels.model: the thin model layer (Qwen3 / Qwen3.5 hybrid targets, DFlash drafter,
decoding engine).

    import dflash_kernels.model as dm
    engine = dm.load(target_dir, drafter_dir)            # drafter optional
    result = engine.generate("prompt", max_new_tokens=64, temperature=0.0)
    result.token_ids, result.text, result.metrics.summary()
"""

from .config import (
    ConfigError,
    DFlashConfig,
    Qwen3Config,
    default_target_layer_ids,
    load_dflash_config,
    load_generation_config,
    load_qwen3_config,
)
from .defaults import default_model_dirs, load_default
from .drafter import ContextCache, DFlashDrafter
from .engine import Engine, GenerationResult, load
from .metrics import Metrics, aggregate, speedup
from .qwen3 import KVCache, Qwen3Model
from .qwen35 import HybridCache, Qwen35Model
from .qwen35_config import Qwen35Config, load_qwen35_config, load_target_config
from .tokenizer import StreamDecoder, Tokenizer, TokenizerError, render_chat, stop_token_ids
from .weights import WeightsError, read_checkpoint, read_safetensors

__all__ = [
    "ConfigError", "ContextCache", "DFlashConfig", "DFlashDrafter", "Engine", "GenerationResult",
    "HybridCache", "KVCache", "Metrics", "Qwen3Config", "Qwen3Model", "Qwen35Config", "Qwen35Model",
    "StreamDecoder", "Tokenizer", "TokenizerError", "WeightsError", "aggregate", "default_model_dirs",
    "default_target_layer_ids", "load_default",
    "load", "load_dflash_config", "load_generation_config", "load_qwen3_config", "load_qwen35_config",
    "load_target_config", "read_checkpoint", "read_safetensors", "render_chat", "speedup", "stop_token_ids",
]
