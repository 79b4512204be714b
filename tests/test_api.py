"""The public API as an engine sees it: every op in dflash_kernels.__all__ has type hints for every
parameter and its result, and a docstring that names every parameter (n_threads and backend, which
every op takes, are documented once, in the package docstring)."""

import inspect
import re
import typing
from pathlib import Path

import pytest

import dflash_kernels as dk

COMMON = {"n_threads", "backend"}
FUNCTIONS = [n for n in dk.__all__ if inspect.isfunction(getattr(dk, n))]


def test_every_public_name_exists_and_common_parameters_are_documented_once():
    assert all(hasattr(dk, n) for n in dk.__all__)
    assert all(f"``{p}" in dk.__doc__ for p in COMMON)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_public_op_has_type_hints_and_documents_its_parameters(name):
    fn = getattr(dk, name)
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)  # resolves: no dangling names in the annotations
    missing_hints = [p for p in sig.parameters if p not in hints]
    assert not missing_hints, f"{name}: no type hint for {missing_hints}"
    assert "return" in hints, f"{name}: no return annotation"
    doc = inspect.getdoc(fn) or ""
    undocumented = [p for p in sig.parameters if p not in COMMON and p not in doc]
    assert not undocumented, f"{name}: docstring does not mention {undocumented}"


PRIVATE_IMPORT = re.compile(r"(?:from|import)\s+dflash_kernels\._[a-z]|from\s+dflash_kernels\s+import\s+[^#\n]*\b_[a-z]"
                            r"|\bdk\._[a-z]")


def private_imports(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if PRIVATE_IMPORT.search(line.split("#")[0])]


def test_model_and_bench_use_only_public_names():
    root = Path(__file__).resolve().parent.parent
    found = {str(p.relative_to(root)): hits for p in sorted([*root.glob("model/**/*.py"), *root.glob("bench/*.py")])
             if (hits := private_imports(p.read_text()))}
    assert not found, f"private dflash_kernels names used outside the package: {found}"


def test_the_private_import_check_sees_each_form():
    assert private_imports("from dflash_kernels._tensors import f32_to_bf16")
    assert private_imports("    from dflash_kernels import _isa")
    assert private_imports("x = dk._isa.cpu_model()")
    assert not private_imports("from dflash_kernels import f32_to_bf16  # not dflash_kernels._tensors")
    assert not private_imports("root = dflash_kernels.__file__")


def test_user_cache_dir_follows_its_variable_then_xdg_then_home(monkeypatch, tmp_path):
    from dflash_kernels.runtime import tuning_cache_file, user_cache_dir
    from model.benchmark import tuned_path
    from model.defaults import cache_dir

    for var in ("DFLASH_CACHE_DIR", "DFLASH_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "dflash_kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == user_cache_dir() == tmp_path / "xdg" / "dflash_kernels"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "measured"))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "models"))
    assert tuned_path() == tmp_path / "measured" / "tuned.json"
    assert tuning_cache_file() == tmp_path / "measured" / "kernel_autotune.json"
    assert cache_dir() == tmp_path / "models"
