"""Cython kernels compiled for the amx tier (see setup.py)."""
