"""Compiled Cython kernels (built from pyx/ by setup.py)."""
