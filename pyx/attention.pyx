# cython: language_level=3
"""Cython kernels for attention: flash-style online softmax over key tiles, GQA heads packed.

One core serves both ops. Keys are the virtual concatenation of two sources ([injected context |
block] for the drafter, [cache | nothing] for cached attention), each float32 or bf16, read in
place and upcast per tile into scratch. Query i sits at position q_off + i and sees the keys at
positions lo(i) .. hi(i) (see dflash_kernels/attention.py), so the mask is one interval per query.

Work item = (block of query positions, key split). Per key tile, every kv head g in turn: the
`group` query heads reading g are packed with the block's positions into up to QROWS rows, so a
K/V tile is loaded (copied, upcast) once for all of them. On the FMA tiles the scores are kept
transposed, S^T = K Q^T with the rows in the vector lanes, so the masked online softmax runs down
the keys without horizontal reductions; acc += P V runs on register blocks of 8 or 6 rows. With
bf16 pair words ("medium" on vdpbf16ps, or 16-row AMX tiles; "highest" over bf16 K and V on AMX
tiles too, with the queries and P as three exact bf16 parts) S = Q K^T keeps rows of keys.
A decode step (at most 4 rows per kv head) has too few rows to pay for tiles: its K and V rows are
read in place, every head of a key in address order (dk_qk_direct; at "medium", FMA on the operands
rounded as they are read). The kv-head loop sits inside the tile loop
because one key's rows of all heads share a page: TLB misses are paid once per key, not per head.
The key split depends on the shape only (never on n_threads); once every item is done, each (query
block, kv head) merges its partials in split order, so results are identical for every n_threads.

The SIMD micro-kernels (exp, register blocks, the softmax over a tile, and the bf16 pair words with
their vdpbf16ps and AMX kernels) are small C functions in dk_attention.h: GCC vector
extensions (AVX-512, AVX2 or SSE) and intrinsics with a scalar fallback. The core (attention_core.pxi) is included here and in dense.pyx, whose fused decoder
layers call it at C level.
"""

cimport numpy as cnp

import numpy as np

cnp.import_array()

import importlib

include "attention_core.pxi"


cdef const void* _ptr(cnp.ndarray a):
    return <const void*>cnp.PyArray_DATA(a)


def _dense():
    """This tier's dense module: its rules for vdpbf16ps (bf16dot_pays) and AMX (amx_available) hold
    for "medium" attention too, so that set_bf16dot_enabled / set_amx_enabled there switch both."""
    return importlib.import_module(__name__.rpartition(".")[0] + ".dense")


def _attend(q, k1, v1, k2, v2, out, Py_ssize_t q_off, bint causal, window, float scale, int n_threads, int parts):
    cdef Problem P
    cdef int dot = ATT_DOT and parts == 1 and _dense().bf16dot_pays()
    cdef int amx = ATT_AMX and _dense().amx_available()
    _problem_init(&P, _ptr(k1), _ptr(v1), k1.dtype == np.uint16, k1.shape[0], _ptr(k2), _ptr(v2),
                  k2.dtype == np.uint16, k2.shape[0], q.shape[0], q.shape[1], k1.shape[1], q.shape[2], q_off,
                  0 if window is None else window, causal, scale, parts, dot, amx)
    cdef cnp.ndarray qa = q
    cdef cnp.ndarray oa = out
    cdef int rc
    with nogil:
        rc = _attend_run(&P, <const float*>cnp.PyArray_DATA(qa), <float*>cnp.PyArray_DATA(oa), n_threads)
    if rc:
        raise MemoryError()


def injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, out, *, int n_threads, float scale,
                          bint causal_block, window, int parts=3):
    _attend(q, k_ctx, v_ctx, k_blk, v_blk, out, k_ctx.shape[0], causal_block, window, scale, n_threads, parts)


def cached_attention(q, k_cache, v_cache, out, *, int n_threads, bint causal, float scale, window,
                     int parts=3):
    empty = k_cache[:0]
    _attend(q, k_cache, v_cache, empty, empty, out, k_cache.shape[0] - q.shape[0], causal, window,
            scale, n_threads, parts)
