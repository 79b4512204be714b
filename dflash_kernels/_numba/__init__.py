"""Numba JIT kernels (the "numba" backend)."""
