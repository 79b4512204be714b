# cython: language_level=3
"""Cython kernels for the dense ops."""

from cython.parallel cimport prange
from libc.math cimport expf


def silu_and_mul(const float[:, ::1] x, float[:, ::1] out, *, int n_threads):
    cdef Py_ssize_t m, i, n = out.shape[1]
    cdef float g
    for m in prange(out.shape[0], nogil=True, num_threads=n_threads, schedule="static"):
        for i in range(n):  # silu(gate) * up
            g = x[m, i]
            out[m, i] = g / (1.0 + expf(-g)) * x[m, n + i]
