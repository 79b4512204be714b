"""The training corpus present on every machine: the Python standard library's own source.

Whole modules are held out for evaluation (prompts for `dflash bench`), so the held-out loss and the
acceptance figures measure code the models never saw.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# Held out whole: evaluation prompts come from these modules only.
HELD_OUT = ("json", "csv", "fractions", "statistics", "textwrap", "heapq", "bisect", "calendar",
            "difflib", "shlex", "colorsys", "graphlib")
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return rel.parts[0]


def stdlib_files(split: str = "train") -> list[Path]:
    """Sorted .py files of the standard library: split 'train' excludes HELD_OUT, 'eval' is HELD_OUT."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    root = stdlib_dir()
    files = []
    for f in sorted(root.rglob("*.py")):
        if _SKIP_PARTS & set(f.relative_to(root).parts):
            continue
        held = _module_name(f, root) in HELD_OUT
        if held == (split == "eval"):
            files.append(f)
    if not files:
        raise FileNotFoundError(f"no standard-library sources found under {root} for split {split!r}")
    return files


def read_text(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few files are latin-1 test data; skipping them costs nothing
    return out


def eval_prompts(n: int = 32, prompt_chars: int = 400, seed: int = 0) -> list[str]:
    """Held-out prompts: the first lines of functions in the held-out modules, cut at a line end."""
    import random

    rnd = random.Random(seed)
    prompts = []
    for text in read_text(stdlib_files("eval")):
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and i + 3 < len(lines):
                prompts.append("".join(lines[max(0, i - 6): i + 3])[-prompt_chars:])
    rnd.shuffle(prompts)
    return prompts[:n]
