"""The shipped trained pair (a small Qwen3 target and its DFlash drafter, trained on this CPU)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = Path(__file__).parent / "default"


def default_model_dirs() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the shipped pair, in the public checkpoint layout, so other engines
    can load the same files."""
    target, drafter = DEFAULT_DIR / "target", DEFAULT_DIR / "drafter"
    for d in (target, drafter):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"the shipped model is missing: {d}/config.json not found "
                                    "(pass --target/--drafter, or train one with dflash train-*)")
    return target, drafter


def load_default(**opts):
    """The shipped pair loaded through dflash_kernels.model.load."""
    from .engine import load

    target, drafter = default_model_dirs()
    return load(target, drafter, **opts)
