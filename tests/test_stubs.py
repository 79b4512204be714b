"""The compiled modules' stubs (pyx/<stem>.pyi) name every public function with its parameters, and
the build installs them beside each tier's module."""

import ast
import inspect
from pathlib import Path

import pytest

import dflash_kernels as dk
from dflash_kernels._backends import load_tier
from support import MACHINE_TIERS

PYX = Path(__file__).resolve().parents[1] / "pyx"
STEMS = sorted(p.stem for p in PYX.glob("*.pyx"))


def _stub_params(stem: str) -> dict[str, list[tuple[str, str]]]:
    """function name -> [(parameter, kind)] as the stub declares them."""
    tree = ast.parse((PYX / f"{stem}.pyi").read_text())
    out = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        a = fn.args
        out[fn.name] = ([(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
                        + [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs])
    return out


def _module_params(module, stem: str) -> dict[str, list[tuple[str, str]]]:
    """The module's own public functions (their __module__ is the generic dflash_kernels._cython.<stem>
    each tier's C was translated from; imported names such as np are left out)."""
    return {name: [(p.name, p.kind.name) for p in inspect.signature(f).parameters.values()]
            for name, f in vars(module).items()
            if callable(f) and not name.startswith("_") and getattr(f, "__module__", "").endswith(f".{stem}")}


@pytest.mark.parametrize("stem", STEMS)
def test_stub_matches_the_compiled_module(stem):
    module = dk.kernel_module(stem, "cython")
    assert _stub_params(stem) == _module_params(module, stem)


@pytest.mark.parametrize("tier", MACHINE_TIERS)
def test_stubs_installed_beside_each_tier(tier):
    for stem in STEMS:
        built = Path(load_tier(stem, tier).__file__).parent
        assert (built / f"{stem}.pyi").read_text() == (PYX / f"{stem}.pyi").read_text(), (tier, stem)
