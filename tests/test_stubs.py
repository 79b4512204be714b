"""The compiled modules' stubs (pyx/<stem>.pyi) name every public function with its parameters, and
the build installs them beside each tier's module."""

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

import dflash_kernels as dk
from dflash_kernels._backends import load_tier
from support import MACHINE_TIERS

PYX = Path(__file__).resolve().parents[1] / "pyx"
# compiled once per tier (dflash_kernels._cython.<tier>.<stem>), or once (dflash_kernels._cython.<stem>)
UNTIERED = sorted(p.stem for p in PYX.glob("*.pyx") if importlib.util.find_spec(f"dflash_kernels._cython.{p.stem}"))
STEMS = sorted(p.stem for p in PYX.glob("*.pyx") if p.stem not in UNTIERED)


def _stub_params(stem: str) -> dict[str, list[tuple[str, str]]]:
    """function name -> [(parameter, kind)] as the stub declares them."""
    tree = ast.parse((PYX / f"{stem}.pyi").read_text())
    out = {}
    methods = [(f"{c.name}.", n) for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
    for prefix, fn in [("", n) for n in tree.body] + methods:
        if isinstance(fn, ast.FunctionDef) and (not fn.name.startswith("_") or not prefix):
            a = fn.args
            out[prefix + fn.name] = ([(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
                                     + [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs])
    return out


def _module_params(module, stem: str) -> dict[str, list[tuple[str, str]]]:
    """The module's own public functions (their __module__ is the generic dflash_kernels._cython.<stem>
    each tier's C was translated from; imported names such as np are left out)."""
    own = {name: f for name, f in vars(module).items()
           if callable(f) and not name.startswith("_") and getattr(f, "__module__", "").endswith(f".{stem}")}
    for cls in [f for f in own.values() if isinstance(f, type)]:  # a class: its public methods
        del own[cls.__name__]
        own.update({f"{cls.__name__}.{n}": m for n, m in vars(cls).items() if not n.startswith("_")})
    return {name: [(p.name, p.kind.name) for p in inspect.signature(f).parameters.values()]
            for name, f in own.items()}


@pytest.mark.parametrize("stem", STEMS)
def test_stub_matches_the_compiled_module(stem):
    module = dk.kernel_module(stem, "cython")
    assert _stub_params(stem) == _module_params(module, stem)


@pytest.mark.parametrize("tier", MACHINE_TIERS)
def test_stubs_installed_beside_each_tier(tier):
    for stem in STEMS:
        built = Path(load_tier(stem, tier).__file__).parent
        assert (built / f"{stem}.pyi").read_text() == (PYX / f"{stem}.pyi").read_text(), (tier, stem)


@pytest.mark.parametrize("stem", UNTIERED)
def test_untiered_stub_matches_and_is_installed(stem):
    module = importlib.import_module(f"dflash_kernels._cython.{stem}")
    assert _stub_params(stem) == _module_params(module, stem)
    assert (Path(module.__file__).parent / f"{stem}.pyi").read_text() == (PYX / f"{stem}.pyi").read_text()
