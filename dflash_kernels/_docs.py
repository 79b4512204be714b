"""Docstring text that every public op shares, written once: a line holding only ``{name}`` in an
op's docstring is replaced, at import, by SHARED[name] at that line's indentation (``@shared_doc``)."""

from __future__ import annotations

SHARED = {
    "n_threads": """n_threads : int, optional
    Threads to use; None = ``DFLASH_NUM_THREADS``, else the CPUs this process may run on.""",
    "backend": """backend : {"auto", "cython", "numba", "torch"}, default "auto"
    Implementation to run; "auto" takes the first available (``available_backends()``).""",
}


def shared_doc(fn):
    """Fill the ``{name}`` lines of fn's docstring from SHARED (an unknown name is an error)."""
    lines = []
    for line in fn.__doc__.splitlines():
        key = line.strip()
        if key.startswith("{") and key.endswith("}"):
            indent = line[: len(line) - len(line.lstrip())]
            lines += [indent + part for part in SHARED[key[1:-1]].splitlines()]
        else:
            lines.append(line)
    fn.__doc__ = "\n".join(lines)
    return fn
