"""Cython kernels compiled for the avx512 tier (see setup.py)."""
