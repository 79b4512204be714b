"""Every public function of the kernel ops has a numpydoc docstring (Parameters naming each parameter,
Returns, Examples), and its Examples run.

The ops are found, not listed: every function in dflash_kernels.__all__ but the few configuration
helpers in NOT_OPS, so that a new op without such a docstring fails here. Examples assume
``import numpy as np`` and ``import dflash_kernels as dk`` (the package docstring says so).
"""

import doctest
import inspect
import re

import numpy as np
import pytest

import dflash_kernels as dk

# Public functions that are configuration / introspection helpers rather than kernel ops (their
# docstrings are prose). Anything else in __all__ that is a function is checked.
NOT_OPS = {"available_backends", "kernel_module", "show_config", "tune_linear"}
OPS = sorted(n for n in dk.__all__ if inspect.isfunction(getattr(dk, n)) and n not in NOT_OPS)


def sections(doc: str) -> dict[str, list[str]]:
    """numpydoc sections of a cleaned docstring: title -> its lines (a title is a line underlined by dashes)."""
    lines = doc.splitlines()
    out, current = {}, None
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and line.strip() and re.fullmatch(r"-{3,}", lines[i + 1].strip()) \
                and len(lines[i + 1].strip()) == len(line.strip()):
            current = line.strip()
            out[current] = []
        elif current is not None and not re.fullmatch(r"-{3,}", line.strip()):
            out[current].append(line)
    return out


def documented_parameters(lines: list[str]) -> set[str]:
    """Names of the entries of a Parameters section: unindented ``name : type`` or ``a, b : type`` lines."""
    names = set()
    for line in lines:
        if line and not line[0].isspace():
            names.update(n.strip().lstrip("*") for n in line.split(" : ")[0].split(","))
    return names


def test_the_ops_are_found():
    assert NOT_OPS <= set(dk.__all__), "NOT_OPS names a function that is no longer public"
    assert {"cached_attention", "linear", "rejection_sample", "qwen3_layer", "gated_delta_rule",
            "set_matmul_precision", "set_isa"} <= set(OPS)


@pytest.mark.parametrize("name", OPS)
def test_op_docstring_is_numpydoc(name):
    fn = getattr(dk, name)
    doc = inspect.getdoc(fn) or ""
    summary = doc.splitlines()[0] if doc else ""
    assert summary.strip(), f"{name}: no one-line summary"
    found = sections(doc)
    params = list(inspect.signature(fn).parameters)
    required = ["Returns", "Examples"] + (["Parameters"] if params else [])
    missing = [s for s in required if s not in found]
    assert not missing, f"{name}: docstring lacks the numpydoc section(s) {missing}"
    undocumented = [p for p in params if p not in documented_parameters(found.get("Parameters", []))]
    assert not undocumented, f"{name}: Parameters section does not document {undocumented}"
    assert ">>>" in "\n".join(found["Examples"]), f"{name}: Examples has no doctest"


@pytest.mark.parametrize("name", OPS)
def test_op_examples_run(name):
    fn = getattr(dk, name)
    tests = doctest.DocTestFinder(recurse=False).find(fn, name, globs={"np": np, "dk": dk})
    assert tests and tests[0].examples, f"{name}: no doctest examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    for test in tests:
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed\n" + "".join(report)
