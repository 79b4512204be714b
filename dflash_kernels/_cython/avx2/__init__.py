"""Cython kernels compiled for the avx2 tier (see setup.py)."""
