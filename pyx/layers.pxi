"""Fused decoder layers (dflash_kernels/layers.py): a whole Qwen3 / Llama target layer, or a DFlash
drafter layer, in one call.

Included into dense.pyx, which owns linear's paths and their state (AMX on or off, whether
vdpbf16ps pays), with the attention core (attention_core.pxi). The layer calls the same C functions
as the single ops, in the same order and with the same work splits, so its output is bit-identical
to composing rms_norm, linear, rope, cached_attention and silu_and_mul (the oracle in the tests).
What it saves is everything between the kernels: per op, the Python wrapper, the memoryview
acquisition and the output allocation (~5-15 us each, ~14 ops per layer); one malloc serves every
intermediate of the layer.
"""

# A block of at most this many rows over int8-activation weights (DK_Q4X / DK_Q8X: a DFlash verification)
# attends row by row (qwen3_layer); model/qwen3.py's composed path keeps the same bound (tests/test_quant.py).
cdef enum:
    _ROW_EXACT_ROWS = 32
ROW_EXACT_ROWS = _ROW_EXACT_ROWS


ctypedef fused ctype:  # KV cache storage
    float
    unsigned short  # bf16 bit patterns


cdef inline unsigned short _to_bf16(float f) noexcept nogil:
    """float32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0 (as _tensors.f32_to_bf16)."""
    cdef unsigned int u
    memcpy(&u, &f, 4)
    return 0x7FC0 if f != f else dk_bf16_rne(u)


cdef float *_workspace = NULL  # the fused layers' intermediates, kept between calls
cdef Py_ssize_t _workspace_floats = 0
cdef bint _workspace_busy = False


cdef inline Py_ssize_t _lines(Py_ssize_t n) noexcept nogil:
    """n floats rounded up to whole 64-byte lines: each intermediate starts on a line of its own."""
    return (n + 15) // 16 * 16


cdef float *_take_workspace(Py_ssize_t floats, bint *own) except? NULL:
    """A 64-byte aligned block of `floats` floats for one fused-layer call (with the GIL held).

    The layers' intermediates are large at prefill (150-180 MB at 512 rows of the 9B shape), above
    glibc's mmap threshold when allocated per call: every call faulted in and zeroed fresh pages
    (a 4-layer 9B prefill of 512 tokens took 913 ms fused against 710 ms composed, whose numpy
    outputs are freed and reused one by one; docs/benchmarks.md, session 19). So one block is kept and grown to the largest call;
    a call that finds it taken (another thread, re-entry) allocates its own (own = True)."""
    global _workspace, _workspace_floats, _workspace_busy
    cdef float *p
    if _workspace_busy:
        own[0] = True
        p = <float *> aligned_alloc(64, _lines(floats) * sizeof(float))
    else:
        own[0] = False
        if floats > _workspace_floats:
            free(_workspace)
            _workspace_floats = 0
            _workspace = <float *> aligned_alloc(64, _lines(floats) * sizeof(float))
            if _workspace != NULL:
                _workspace_floats = floats
        p = _workspace
        _workspace_busy = p != NULL
    if p == NULL:
        raise MemoryError()
    return p


cdef void _give_workspace(float *p, bint own):
    global _workspace_busy
    if own:
        free(p)
    else:
        _workspace_busy = False


cdef inline float *_carve(float **cursor, Py_ssize_t n) noexcept nogil:
    """The next n floats of a workspace, on lines of their own."""
    cdef float *p = cursor[0]
    cursor[0] = p + _lines(n)
    return p


def qwen3_layer(float[:, ::1] x, Py_ssize_t start, const float[::1] w_in, const ptype[::1] w_qkv,
                const float[::1] q_norm, const float[::1] k_norm, const ptype[::1] w_o, const float[::1] w_post,
                const ptype[::1] w_gate_up, const ptype[::1] w_down, const ctype[:, :, ::1] k_cache,
                const ctype[:, :, ::1] v_cache, *, int n_heads, int n_kv_heads, int head_dim, int intermediate,
                float eps, double theta, const double[::1] inv_freq=None, Py_ssize_t window=0,
                int n_threads, int parts=3, int finite_mask=15, bint append=True, bint causal=True,
                float norm_offset=0.0, bint output_gate=False, int rotary_dim=0, int quant=0):
    """x (T, H) <- the layer's output for the residual stream x at positions start..start+T-1.

    Weights packed (linear_packed's layout): w_qkv [Wq; Wk; Wv] (q_dim + 2 kv_dim, H), w_o (H, q_dim),
    w_gate_up [Wgate; Wup] (2 I, H), w_down (H, I); norms float32; q_norm / k_norm None for a Llama
    layer. append (a target layer): the rows' K (post k_norm and RoPE) and V are written into
    k_cache / v_cache (max_len, H_kv, D) at start.., which hold every earlier position, and attention
    is causal over positions 0..start+T-1. append=False (a DFlash drafter layer): rows 0..start-1 of
    the caches are the injected context, the rows' own K/V are attended to but not stored, and
    `causal` says whether a row sees the rows after it. window > 0: only the last `window` positions.
    finite_mask: bit i set when weight i (qkv, o, gate_up, down) is finite (PackedWeight.finite).
    quant: the format of byte weights (GGUF blocks, dk_quant.h: DK_Q4, DK_Q8, DK_Q4X or DK_Q8X), the same for all four.
    A Qwen3.5 gated full-attention layer: norm_offset 1 (every norm x (1 + w)), output_gate (Wq's
    rows per head [query | gate], attention output times sigmoid(gate) before o_proj) and rotary_dim
    < head_dim (RoPE on the first dims only; 0 = head_dim). The caller validates shapes (layers.py)."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], D = head_dim, Hq = n_heads, Hkv = n_kv_heads
    cdef Py_ssize_t qd = Hq * D, kvd = Hkv * D, I = intermediate
    cdef Py_ssize_t qw = 2 * D if output_gate else D  # a query head's columns in a qkv row (+ its gate)
    cdef Py_ssize_t nqkv = Hq * qw + 2 * kvd, half = (rotary_dim if rotary_dim > 0 else D) // 2
    cdef Py_ssize_t end = start + T, t, r, hd, j, gi
    cdef int rc
    cdef int bf16 = 0 if ptype is float else (quant if ptype is gguf_byte else 1)  # the weights' format
    cdef int kv_bf16 = 0 if ctype is float else 1
    cdef bint qk = q_norm is not None
    if T == 0:
        return
    if parts < 3:  # the vdpbf16ps rule (linear and attention) is measured once, before the C code reads it
        bf16dot_pays()
    cdef int amx = amx_available()  # attention on AMX tiles: "medium", or "highest" over a bf16 cache
    if (end if append else start) > k_cache.shape[0]:
        raise ValueError(f"qwen3_layer: positions up to {end if append else start} do not fit the cache of "
                         f"{k_cache.shape[0]}")
    # the intermediates: h (norm outputs), x1 (residual after attention), o / down outputs, qkv, q,
    # attention out, k, v (a drafter block's), gate_up, act, RoPE table
    cdef Py_ssize_t n_h = T * H, n_qkv = T * nqkv, n_q = T * qd, n_k = T * kvd, n_gu = T * 2 * I
    cdef bint own
    cdef float *ws = _take_workspace(4 * _lines(n_h) + _lines(n_qkv) + 2 * _lines(n_q) + 2 * _lines(n_k)
                                     + _lines(n_gu) + _lines(T * I) + _lines(2 * T * half), &own)
    cdef float *cur = ws
    cdef float *h = _carve(&cur, n_h)
    cdef float *x1 = _carve(&cur, n_h)
    cdef float *ao = _carve(&cur, n_h)
    cdef float *mlp = _carve(&cur, n_h)
    cdef float *qkv = _carve(&cur, n_qkv)
    cdef float *q = _carve(&cur, n_q)
    cdef float *att = _carve(&cur, n_q)
    cdef float *kb = _carve(&cur, n_k)
    cdef float *vb = _carve(&cur, n_k)
    cdef float *gu = _carve(&cur, n_gu)
    cdef float *act = _carve(&cur, T * I)
    cdef float *table = _carve(&cur, 2 * T * half)
    cdef long long *pos = <long long *> malloc(T * sizeof(long long))
    if pos == NULL:
        _give_workspace(ws, own)
        raise MemoryError()
    cdef float *xp = &x[0, 0]
    cdef const float *qn = &q_norm[0] if qk else NULL
    cdef const float *kn = &k_norm[0] if qk else NULL
    cdef const float *nw
    cdef float *dst
    cdef const float *src
    # (const views so that a drafter's read-only context is accepted; append writes only where the
    # caller checked the cache writable)
    cdef ctype *kc = <ctype *> &k_cache[0, 0, 0] if k_cache.shape[0] else NULL  # a drafter's empty context
    cdef ctype *vc = <ctype *> &v_cache[0, 0, 0] if v_cache.shape[0] else NULL
    cdef int nt_h = _threads(n_h, PARALLEL_ELEMS, n_threads)
    cdef int nt_qk = _threads(T * (qd + kvd), PARALLEL_ELEMS, n_threads)
    cdef int nt_i = _threads(T * I, PARALLEL_ELEMS, n_threads)
    cdef Problem P
    cdef Problem *rows
    try:
        for t in range(T):
            pos[t] = start + t
        with nogil:
            _rope_table(pos, T, half, <int> (2 * half), theta, &inv_freq[0] if inv_freq is not None else NULL, table)
        for t in prange(T, nogil=True, num_threads=nt_h, schedule="static"):
            dk_rms_norm_row(xp + t * H, NULL, &w_in[0], norm_offset, eps, H, h + t * H, NULL)
        _linear_packed_run(h, T, H, nqkv, &w_qkv[0], bf16, NULL, qkv, n_threads, parts, finite_mask & 1)
        # per head of q and k: q_norm / k_norm (a Llama layer copies), then RoPE in place
        for r in prange(T * (Hq + Hkv), nogil=True, num_threads=nt_qk, schedule="static"):
            t = r // (Hq + Hkv)
            hd = r % (Hq + Hkv)
            # q heads (each with its gate after it when gated), then k heads, side by side in a qkv row
            if hd < Hq:
                src = qkv + t * nqkv + hd * qw
                dst = q + (t * Hq + hd) * D
                nw = qn
            else:
                src = qkv + t * nqkv + Hq * qw + (hd - Hq) * D
                dst = kb + (t * Hkv + hd - Hq) * D
                nw = kn
            if qk:
                dk_rms_norm_row(src, NULL, nw, norm_offset, eps, D, dst, NULL)
            else:
                memcpy(dst, src, D * sizeof(float))
            dk_rope_row(dst, table + 2 * t * half, table + (2 * t + 1) * half, half, D, dst)
        with nogil:
            for t in range(T):
                src = qkv + t * nqkv + Hq * qw + kvd
                if not append:  # the block's own K/V: attention's second source, never stored
                    memcpy(vb + t * kvd, src, kvd * sizeof(float))
                elif kv_bf16:
                    for j in range(kvd):
                        (<unsigned short *> kc)[(start + t) * kvd + j] = _to_bf16(kb[t * kvd + j])
                        (<unsigned short *> vc)[(start + t) * kvd + j] = _to_bf16(src[j])
                else:
                    memcpy(<float *> kc + (start + t) * kvd, kb + t * kvd, kvd * sizeof(float))
                    memcpy(<float *> vc + (start + t) * kvd, src, kvd * sizeof(float))
            if append and bf16 >= DK_Q4X and T <= _ROW_EXACT_ROWS:
                # int8 activations round each row afresh, so a verification row must give the bits
                # of the decode step at its position: each row alone over its own keys, as that
                # step computes it (the tiled block path sums in another order)
                rows = <Problem *> malloc(T * sizeof(Problem))
                rc = -1
                if rows != NULL:
                    for t in range(T):
                        _problem_init(&rows[t], kc, vc, kv_bf16, start + t + 1, kc, vc, kv_bf16, 0, 1, Hq, Hkv, D,
                                      start + t, window, 1, <float> (D ** -0.5), parts, _dp_pays == 1, amx)
                    # a decode step (T = 1) keeps its threads; a block's rows take one thread each
                    if T == 1:
                        rc = _attend_run(&rows[0], q, att, n_threads)
                    else:
                        rc = _attend_rows(rows, T, q, qd, att, n_threads)
                    free(rows)
            elif append:
                _problem_init(&P, kc, vc, kv_bf16, end, kc, vc, kv_bf16, 0, T, Hq, Hkv, D, start, window, 1,
                              <float> (D ** -0.5), parts, _dp_pays == 1, amx)
            else:
                _problem_init(&P, kc, vc, kv_bf16, start, kb, vb, 0, T, T, Hq, Hkv, D, start, window, causal,
                              <float> (D ** -0.5), parts, _dp_pays == 1, amx)
            if not (append and bf16 >= DK_Q4X and T <= _ROW_EXACT_ROWS):
                rc = _attend_run(&P, q, att, n_threads)
        if rc:
            raise MemoryError()
        if output_gate:  # as apply_output_gate: o * sigmoid(gate), the gate beside each query head
            for r in prange(T * Hq, nogil=True, num_threads=nt_qk, schedule="static"):
                t = r // Hq
                for j in range(D):
                    gi = t * nqkv + (r % Hq) * qw + D + j
                    att[r * D + j] = att[r * D + j] / (1.0 + dk_exp(-qkv[gi]))
        _linear_packed_run(att, T, qd, H, &w_o[0], bf16, NULL, ao, n_threads, parts, finite_mask & 2)
        for t in prange(T, nogil=True, num_threads=nt_h, schedule="static"):
            dk_rms_norm_row(ao + t * H, xp + t * H, &w_post[0], norm_offset, eps, H, h + t * H, x1 + t * H)
        _linear_packed_run(h, T, H, 2 * I, &w_gate_up[0], bf16, NULL, gu, n_threads, parts, finite_mask & 4)
        for t in prange(T, nogil=True, num_threads=nt_i, schedule="static"):
            dk_silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I)
        _linear_packed_run(act, T, I, H, &w_down[0], bf16, NULL, mlp, n_threads, parts, finite_mask & 8)
        for t in prange(T, nogil=True, num_threads=nt_h, schedule="static"):
            for j in range(H):
                xp[t * H + j] = mlp[t * H + j] + x1[t * H + j]
    finally:
        _give_workspace(ws, own)
        free(pos)
