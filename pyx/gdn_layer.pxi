"""The fused Qwen3.5 Gated DeltaNet layer (dflash_kernels/gdn_layer.py ``gated_deltanet_layer``): a whole
linear-attention decoder layer in one call.

Included into dense.pyx after layers.pxi (linear_packed's paths, the row functions) and gdn_core.pxi
(the recurrence of linear_attention.pyx). The layer runs the single ops' C code in the same order:
zero-centred RMSNorm, the stacked input projection [W_qkv; W_z; W_b; W_a], the causal conv + SiLU,
the gates, the gated delta rule with q/k l2-normalised, the gated RMSNorm, out_proj, the residual
add and post-norm, and the SwiGLU MLP, so its output is bit-identical to the composition of the
single ops (tests/test_gdn_layer.py).
"""


def gated_deltanet_layer(float[:, ::1] x, const float[::1] w_in, const wtype[::1] w_proj, const float[:, ::1] conv_w,
                         const float[::1] neg_a, const float[::1] dt_bias, const float[::1] w_norm,
                         const wtype[::1] w_out, const float[::1] w_post, const wtype[::1] w_gate_up,
                         const wtype[::1] w_down, float[:, ::1] conv_state, float[:, :, ::1] state, *,
                         int n_k_heads, int intermediate, float eps, int n_threads, int parts=3,
                         int finite_mask=15, float[:, ::1] mixed_out=None, float[:, ::1] conv_out=None,
                         float[:, ::1] g_out=None, float[:, ::1] beta_out=None):
    """x (T, H) <- the layer's output for the residual stream x; conv_state (C, K-1) and state
    (H_v, d_k, d_v) advance over the T tokens, in place.

    Weights packed (linear_packed's layout): w_proj [W_qkv; W_z; W_b; W_a] (C + H_v d_v + 2 H_v, H),
    w_out (H, H_v d_v), w_gate_up [Wgate; Wup] (2 I, H), w_down (H, I); conv_w (C, K), neg_a =
    -exp(A_log), dt_bias (H_v,), w_norm (d_v,) and the zero-centred norms w_in / w_post (H,) float32.
    C = 2 H_k d_k + H_v d_v. The four optional outputs receive what a rollback re-runs (HybridCache):
    the conv inputs (T, C), the conv outputs (T, C: q | k | v) and g, beta (T, H_v). finite_mask: bit
    i set when matmul weight i (proj, out, gate_up, down) is finite. The caller validates shapes."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], Hv = state.shape[0], dk = state.shape[1], dv = state.shape[2]
    cdef Py_ssize_t Hk = n_k_heads, kd = Hk * dk, vd = Hv * dv, C = conv_w.shape[0], Kc = conv_w.shape[1]
    cdef Py_ssize_t nproj = C + vd + 2 * Hv, I = intermediate, t, r, j, c0
    cdef int bf16 = 0 if wtype is float else 1
    cdef int group = <int> (Hv // Hk), h, tid, n, b
    cdef int nb = <int> ((C + CONV_CB - 1) // CONV_CB)
    cdef int nt_conv = max(1, min(n_threads, nb)), nt_rule = max(1, min(n_threads, <int> Hv))
    cdef float scale = <float> (dk ** -0.5)
    if T == 0:
        return
    if parts < 3:  # the vdpbf16ps rule is measured once, before the C code reads it
        bf16dot_pays()
    # the intermediates: h (norm outputs), ao (out_proj), x1 (residual), mlp, proj, y (conv out), v, o
    # (delta rule), on (gated norm), g, beta, gu, act; then the per-thread scratch of the conv and of
    # the recurrence. The conv reads its inputs in place from proj; y, g and beta go straight to the
    # record buffers when given.
    cdef Py_ssize_t n_h = T * H, per_conv = (2 * Kc - 1) * CONV_CB, per_rule = 2 * T * dk + dk * BW
    cdef bint own
    cdef float *ws = _take_workspace(4 * _lines(n_h) + _lines(T * nproj) + _lines(T * C) + 3 * _lines(T * vd)
                                     + 2 * _lines(T * Hv) + _lines(2 * T * I) + _lines(T * I)
                                     + _lines(nt_conv * per_conv) + _lines(nt_rule * per_rule), &own)
    cdef float *cur = ws
    cdef float *hb = _carve(&cur, n_h)
    cdef float *ao = _carve(&cur, n_h)
    cdef float *x1 = _carve(&cur, n_h)
    cdef float *mlp = _carve(&cur, n_h)
    cdef float *proj = _carve(&cur, T * nproj)
    cdef float *y = _carve(&cur, T * C)
    cdef float *vb = _carve(&cur, T * vd)
    cdef float *o = _carve(&cur, T * vd)
    cdef float *on = _carve(&cur, T * vd)
    cdef float *gb = _carve(&cur, T * Hv)
    cdef float *bb = _carve(&cur, T * Hv)
    cdef float *gu = _carve(&cur, 2 * T * I)
    cdef float *act = _carve(&cur, T * I)
    cdef float *conv_scratch = _carve(&cur, nt_conv * per_conv)
    cdef float *rule_scratch = _carve(&cur, nt_rule * per_rule)
    if conv_out is not None:
        y = &conv_out[0, 0]
    if g_out is not None:
        gb = &g_out[0, 0]
    if beta_out is not None:
        bb = &beta_out[0, 0]
    cdef bint keep_mixed = mixed_out is not None
    cdef float *mixed = &mixed_out[0, 0] if keep_mixed else NULL
    cdef float *xp = &x[0, 0]
    cdef float *sp = &conv_state[0, 0] if Kc > 1 else NULL
    cdef float *qn
    cdef float *kn
    cdef int64_t no_slot = -1
    cdef int64_t *slots = <int64_t *> malloc(T * sizeof(int64_t))
    cdef int nt_h = _threads(n_h, PARALLEL_ELEMS, n_threads)
    cdef int nt_i = _threads(T * I, PARALLEL_ELEMS, n_threads)
    cdef int nt_v = _threads(T * vd, PARALLEL_ELEMS, n_threads)
    if slots == NULL:
        _give_workspace(ws, own)
        raise MemoryError()
    try:
        for t in range(T):
            slots[t] = no_slot  # no per-token checkpoints: a rollback re-runs the recorded inputs
        for t in prange(T, nogil=True, num_threads=nt_h, schedule="static"):
            dk_rms_norm_row(xp + t * H, NULL, &w_in[0], 1.0, eps, H, hb + t * H, NULL)
        _linear_packed_run(hb, T, H, nproj, &w_proj[0], bf16, NULL, proj, n_threads, parts, finite_mask & 1)
        with nogil:
            for t in range(T):
                if keep_mixed:
                    memcpy(mixed + t * C, proj + t * nproj, C * sizeof(float))
                gdn_gates_row(proj + t * nproj + C + vd + Hv, proj + t * nproj + C + vd, &neg_a[0], &dt_bias[0], Hv,
                              gb + t * Hv, bb + t * Hv)
        for b in prange(nb, nogil=True, num_threads=nt_conv, schedule="static"):  # as causal_conv1d
            tid = threadid()
            c0 = <Py_ssize_t> b * CONV_CB
            n = <int> (C - c0 if C - c0 < CONV_CB else CONV_CB)
            la_conv_block(proj + c0, nproj, &conv_w[c0, 0], sp + c0 * (Kc - 1) if sp != NULL else NULL, y + c0, C,
                          NULL, 0, T, n, <int> Kc, 1, conv_scratch + tid * per_conv,
                          conv_scratch + tid * per_conv + Kc * CONV_CB)
        with nogil:
            for t in range(T):
                memcpy(vb + t * vd, y + t * C + 2 * kd, vd * sizeof(float))
        for h in prange(<int> Hv, nogil=True, num_threads=nt_rule, schedule="static"):  # as gated_delta_rule
            tid = threadid()
            qn = rule_scratch + tid * per_rule
            kn = qn + T * dk
            gdn_prepare_qk(y + (h // group) * dk, y + kd + (h // group) * dk, T, C, <int> dk, scale, True, qn, kn)
            gdn_recurrent_head(vb, gb, bb, &state[h, 0, 0], slots, o, NULL, T, <int> Hv, h, <int> dk, <int> dv, qn, kn,
                               kn + T * dk)
        for r in prange(T * Hv, nogil=True, num_threads=nt_v, schedule="static"):
            t = r // Hv
            gdn_gated_norm_row(o + r * dv, proj + t * nproj + C + (r % Hv) * dv, &w_norm[0], dv, eps, on + r * dv)
        _linear_packed_run(on, T, vd, H, &w_out[0], bf16, NULL, ao, n_threads, parts, finite_mask & 2)
        for t in prange(T, nogil=True, num_threads=nt_h, schedule="static"):
            dk_rms_norm_row(ao + t * H, xp + t * H, &w_post[0], 1.0, eps, H, hb + t * H, x1 + t * H)
        _linear_packed_run(hb, T, H, 2 * I, &w_gate_up[0], bf16, NULL, gu, n_threads, parts, finite_mask & 4)
        for t in prange(T, nogil=True, num_threads=nt_i, schedule="static"):
            dk_silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I)
        _linear_packed_run(act, T, I, H, &w_down[0], bf16, NULL, mlp, n_threads, parts, finite_mask & 8)
        for t in prange(T, nogil=True, num_threads=nt_h, schedule="static"):
            for j in range(H):
                xp[t * H + j] = mlp[t * H + j] + x1[t * H + j]
    finally:
        _give_workspace(ws, own)
        free(slots)
