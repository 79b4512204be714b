"""Cython kernels compiled for the avx512_bf16 tier (see setup.py)."""
