"""Cython kernels compiled for the locally built (DFLASH_MARCH) set (see setup.py)."""
