"""Gated DeltaNet ops (Qwen3.5 linear attention) against the float64 torch reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import dflash_kernels.linear_attention as la
from dflash_kernels.reference import linear_attention as ref
from support import ALL_BACKENDS, KERNEL_BACKENDS, TOLERANCE, as_f64, as_torch, assert_close, make_float, readonly

# The state carries the whole history: errors of 130 recurrent steps stay ~1e-7 on O(1) values.
TOL_STATE = dict(rtol=2e-5, atol=2e-5)


def gdn_inputs(seed, T, hk, ratio, dk, dv, dtype="float32"):
    """q, k, v in storage dtype; g (log-decay <= 0), beta in (0, 1), state float32."""
    rng = np.random.default_rng(seed)
    hv = hk * ratio
    q = make_float(rng, (T, hk, dk), dtype)
    k = make_float(rng, (T, hk, dk), dtype)
    v = make_float(rng, (T, hv, dv), dtype)
    g = -(rng.random((T, hv)) * 1.5).astype(np.float32)
    beta = rng.random((T, hv)).astype(np.float32)
    state = (rng.standard_normal((hv, dk, dv)) * 0.5).astype(np.float32)
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state, **kw):
    o, s, _ = ref.gated_delta_rule(*(as_f64(x) for x in (q, k, v, g, beta, state)), **kw)
    return o, s


shapes = dict(T=st.sampled_from([1, 2, 16, 17, 100, 130]), hk=st.integers(1, 2), ratio=st.sampled_from([1, 2, 4]),
              dk=st.sampled_from([16, 32, 128]), dv=st.sampled_from([16, 32, 128]), seed=st.integers(0, 2**32 - 1))


@given(**shapes, dtype=st.sampled_from(["float32", "bfloat16"]), chunk_size=st.sampled_from([None, 0, 64]))
def test_gated_delta_rule_matches_reference(T, hk, ratio, dk, dv, seed, dtype, chunk_size):
    q, k, v, g, beta, state = gdn_inputs(seed, T, hk, ratio, dk, dv, dtype)
    o_ref, s_ref = reference(q, k, v, g, beta, state)  # once for all backends: the float64 oracle is the slow part
    for backend in ALL_BACKENDS:
        s = state.copy()
        o = la.gated_delta_rule(q, k, v, g, beta, s, chunk_size=chunk_size, backend=backend)
        assert o.dtype == np.float32 and o.shape == (T, hk * ratio, dv)
        assert_close(o, o_ref, **TOL_STATE, what=f"{backend} o")
        assert_close(s, s_ref, **TOL_STATE, what=f"{backend} state")


@given(T=st.integers(1, 140), dv=st.sampled_from([16, 19, 32]), chunk_size=st.sampled_from([1, 16, 64]),
       seed=st.integers(0, 2**32 - 1))
def test_chunked_equals_recurrent(kernel_backend, T, dv, chunk_size, seed):
    # (the torch forms: test_reference_chunked_equals_recurrence)
    q, k, v, g, beta, state = gdn_inputs(seed, T, 2, 2, 32, dv)
    s_rec, s_chunk = state.copy(), state.copy()
    o_rec = la.gated_delta_rule(q, k, v, g, beta, s_rec, chunk_size=0, backend=kernel_backend)
    o_chunk = la.gated_delta_rule(q, k, v, g, beta, s_chunk, chunk_size=chunk_size, backend=kernel_backend)
    assert_close(o_chunk, o_rec, **TOL_STATE, what="o")
    assert_close(s_chunk, s_rec, **TOL_STATE, what="state")


def test_reference_chunked_equals_recurrence():
    q, k, v, g, beta, state = gdn_inputs(1, 130, 2, 2, 16, 32)
    o1, s1 = reference(q, k, v, g, beta, state)
    o2, s2 = ref.chunk_gated_delta_rule(*(as_f64(x) for x in (q, k, v, g, beta, state)))
    assert_close(o2, o1, rtol=1e-10, atol=1e-10, what="o")
    assert_close(s2, s1, rtol=1e-10, atol=1e-10, what="state")


def test_raw_qk_option_matches_prenormalised():
    q, k, v, g, beta, state = gdn_inputs(2, 9, 2, 2, 16, 16)
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * 0.3
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    s1, s2 = state.copy(), state.copy()
    o1 = la.gated_delta_rule(q, k, v, g, beta, s1, scale=0.3)
    o2 = la.gated_delta_rule(qn, kn, v, g, beta, s2, use_qk_l2norm=False, scale=1.0)
    assert_close(o1, o2, **TOLERANCE["float32"], what="o")
    assert_close(s1, s2, **TOLERANCE["float32"], what="state")


@given(a=st.integers(0, 15), seed=st.integers(0, 2**32 - 1), dv=st.sampled_from([16, 20]))
def test_checkpoint_restore_prefix(backend, a, seed, dv):
    # Verify k+1 = 16 tokens with checkpoints, restore the accepted prefix a: the same state as feeding
    # tokens 0..a one by one (the decode path).
    q, k, v, g, beta, state = gdn_inputs(seed, 16, 2, 2, 32, dv)
    s = state.copy()
    o, ckpts = la.gated_delta_rule(q, k, v, g, beta, s, checkpoints=True, backend=backend)
    assert ckpts.shape == (16, 4, 32, dv)
    np.testing.assert_array_equal(ckpts[-1], s)
    restored = ckpts[a].copy()
    step = state.copy()
    for t in range(a + 1):
        o_t = la.gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], step,
                                  backend=backend)
        assert_close(o_t[0], o[t], **TOL_STATE, what=f"o[{t}]")
    assert_close(restored, step, **TOL_STATE, what="restored state")
    # restore by recompute: re-running the prefix 0..a as one block reproduces the checkpoint exactly
    s3 = state.copy()
    o3 = la.gated_delta_rule(q[: a + 1], k[: a + 1], v[: a + 1], g[: a + 1], beta[: a + 1], s3, backend=backend)
    np.testing.assert_array_equal(s3, ckpts[a])
    np.testing.assert_array_equal(o3, o[: a + 1])
    # a subset of checkpoints, in the caller's order
    s2 = state.copy()
    keep = [a] + [i for i in (15, 0) if i != a]
    o2, some = la.gated_delta_rule(q, k, v, g, beta, s2, checkpoints=keep, backend=backend)
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(some, ckpts[keep])
    # into a caller's reusable buffer (torch here), returned as is
    buf = torch.full((len(keep), 4, 32, dv), np.nan)
    _, got = la.gated_delta_rule(q, k, v, g, beta, state.copy(), checkpoints=keep, checkpoints_out=buf,
                                 backend=backend)
    assert got is buf
    np.testing.assert_array_equal(buf.numpy(), some)


def test_state_updated_in_place_torch_and_numpy(backend):
    q, k, v, g, beta, state = gdn_inputs(3, 5, 1, 2, 16, 16)
    _, s_ref = reference(q, k, v, g, beta, state)
    st_t = torch.from_numpy(state.copy())
    ptr = st_t.data_ptr()
    o = la.gated_delta_rule(*(torch.from_numpy(x) for x in (q, k, v, g, beta)), st_t, backend=backend)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
    assert st_t.data_ptr() == ptr
    assert_close(st_t, s_ref, **TOL_STATE, what="torch state")
    st_n = state.copy()
    o_n = la.gated_delta_rule(q, k, v, g, beta, st_n, backend=backend)
    assert isinstance(o_n, np.ndarray)
    assert_close(st_n, s_ref, **TOL_STATE, what="numpy state")


def test_torch_bf16_readonly_and_strided_inputs(backend):
    q, k, v, g, beta, state = gdn_inputs(4, 17, 2, 2, 16, 32, "bfloat16")
    o_ref, s_ref = reference(q, k, v, g, beta, state)
    s = torch.from_numpy(state.copy())
    o = la.gated_delta_rule(as_torch(q), as_torch(k), as_torch(v), torch.from_numpy(g), torch.from_numpy(beta), s,
                            backend=backend)
    assert_close(o, o_ref, **TOL_STATE, what="o bf16 torch")
    q32, k32 = (np.asarray(as_f64(x), np.float32) for x in (q, k))
    v_strided = np.asarray(as_f64(v), np.float32)[:, ::-1][:, ::-1]  # non-contiguous view
    s2 = state.copy()
    o2 = la.gated_delta_rule(readonly(q32), readonly(k32), v_strided, readonly(g), beta, s2, backend=backend)
    assert_close(o2, o_ref, **TOL_STATE, what="o readonly/strided")


@pytest.mark.skipif(len(KERNEL_BACKENDS) < 2, reason="needs both compiled backends")
@given(**shapes)
def test_cython_equals_numba(T, hk, ratio, dk, dv, seed):
    q, k, v, g, beta, state = gdn_inputs(seed, T, hk, ratio, dk, dv)
    s1, s2 = state.copy(), state.copy()
    o1, c1 = la.gated_delta_rule(q, k, v, g, beta, s1, checkpoints=[T - 1], backend="cython")
    o2, c2 = la.gated_delta_rule(q, k, v, g, beta, s2, checkpoints=[T - 1], backend="numba")
    assert_close(o1, o2, **TOL_STATE, what="o")
    assert_close(s1, s2, **TOL_STATE, what="state")
    assert_close(c1, c2, **TOL_STATE, what="checkpoint")


@pytest.mark.parametrize("chunk_size", [0, 64])
def test_n_threads_independence(kernel_backend, chunk_size):
    q, k, v, g, beta, state = gdn_inputs(5, 70, 2, 4, 32, 48)
    outs = []
    for n in (1, 2, 3):
        s = state.copy()
        outs.append((la.gated_delta_rule(q, k, v, g, beta, s, chunk_size=chunk_size, backend=kernel_backend,
                                         n_threads=n), s))
    for o, s in outs[1:]:  # one value head per task: bit-identical
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(s, outs[0][1])


def test_empty_block_leaves_state(backend):
    q, k, v, g, beta, state = gdn_inputs(6, 0, 1, 1, 16, 16)
    s = state.copy()
    o = la.gated_delta_rule(q, k, v, g, beta, s, backend=backend)
    assert o.shape == (0, 1, 16)
    np.testing.assert_array_equal(s, state)


def test_gated_delta_rule_bad_input():
    q, k, v, g, beta, state = gdn_inputs(7, 4, 2, 2, 16, 16)
    f = la.gated_delta_rule
    with pytest.raises(ValueError, match="k must"):
        f(q, k[:, :1], v, g, beta, state)
    with pytest.raises(ValueError, match="multiple"):
        f(q, k, v[:, :3], g[:, :3], beta[:, :3], state[:3])
    with pytest.raises(ValueError, match="v must"):
        f(q, k, v[:3], g, beta, state)
    with pytest.raises(ValueError, match="g must"):
        f(q, k, v, g[:, :2], beta, state)
    with pytest.raises(ValueError, match="beta must"):
        f(q, k, v, g, beta[:3], state)
    with pytest.raises(ValueError, match="state must have shape"):
        f(q, k, v, g, beta, state[:, :8])
    with pytest.raises(TypeError, match="state"):
        f(q, k, v, g, beta, state.astype(np.float64))
    with pytest.raises(ValueError, match="writable"):
        f(q, k, v, g, beta, readonly(state))
    with pytest.raises(ValueError, match="contiguous"):
        f(q, k, v, g, beta, np.asfortranarray(state))
    with pytest.raises(TypeError, match="q"):
        f(q.astype(np.float64), k, v, g, beta, state)
    with pytest.raises(ValueError, match="q must have 3"):
        f(q[0], k, v, g, beta, state)
    with pytest.raises(ValueError, match="checkpoints"):
        f(q, k, v, g, beta, state, checkpoints=[4])
    with pytest.raises(ValueError, match="distinct"):
        f(q, k, v, g, beta, state, checkpoints=[1, 1])
    with pytest.raises(ValueError, match="chunk_size"):
        f(q, k, v, g, beta, state, chunk_size=-2)
    with pytest.raises(ValueError, match="checkpoints"):
        f(q, k, v, g, beta, state, chunk_size=64, checkpoints=True)
    with pytest.raises(ValueError, match="checkpoints_out must have shape"):
        f(q, k, v, g, beta, state, checkpoints=True, checkpoints_out=np.zeros((3, 4, 16, 16), np.float32))
    with pytest.raises(ValueError, match="checkpoints_out needs"):
        f(q, k, v, g, beta, state, checkpoints_out=np.zeros((4, 4, 16, 16), np.float32))


# ------------------------------------------------------------------------- causal conv1d


@given(T=st.integers(0, 20), C=st.integers(1, 70), K=st.integers(1, 5), dtype=st.sampled_from(["float32", "bfloat16"]),
       silu=st.booleans(), conv3d=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_causal_conv1d_matches_reference(backend, T, C, K, dtype, silu, conv3d, seed):
    rng = np.random.default_rng(seed)
    x = make_float(rng, (T, C), dtype)
    w = make_float(rng, (C, 1, K) if conv3d else (C, K), dtype)
    state = rng.standard_normal((C, K - 1)).astype(np.float32)
    act = "silu" if silu else None
    y_ref, s_ref, ck_ref = ref.causal_conv1d(as_f64(x), as_f64(w).reshape(C, K), as_f64(state), activation=act,
                                             checkpoints=True)
    s = state.copy()
    y, ck = la.causal_conv1d(x, w, s, activation=act, checkpoints=True, backend=backend)
    assert_close(y, y_ref, **TOLERANCE[dtype], what="y")
    np.testing.assert_array_equal(s, s_ref.numpy().astype(np.float32))  # states are copies of inputs
    np.testing.assert_array_equal(ck, ck_ref.numpy().astype(np.float32).reshape(ck.shape))
    for n in range(T + 1):  # the compact restore agrees with the per-token states
        want = state if n == 0 else ck[n - 1]
        np.testing.assert_array_equal(la.conv_state_at(state, x, n), want)


def test_causal_conv1d_chained_blocks_equal_one_block(backend):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((12, 9)).astype(np.float32)
    w = rng.standard_normal((9, 4)).astype(np.float32)
    s_all, s_parts = np.zeros((9, 3), np.float32), np.zeros((9, 3), np.float32)
    y_all = la.causal_conv1d(x, w, s_all, backend=backend)
    y_parts = np.concatenate([la.causal_conv1d(x[a:b], w, s_parts, backend=backend)
                              for a, b in ((0, 1), (1, 7), (7, 12))])
    assert_close(y_parts, y_all, **TOLERANCE["float32"], what="y")
    np.testing.assert_array_equal(s_parts, s_all)
    st_t = torch.zeros(9, 3)
    y_t = la.causal_conv1d(torch.from_numpy(x), torch.from_numpy(w), st_t, backend=backend)
    assert isinstance(y_t, torch.Tensor)
    np.testing.assert_array_equal(st_t.numpy(), s_all)


def test_causal_conv1d_bad_input():
    x, w, s = np.zeros((3, 4), np.float32), np.zeros((4, 4), np.float32), np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="conv_state"):
        la.causal_conv1d(x, w, np.zeros((4, 2), np.float32))  # K mismatch
    with pytest.raises(ValueError, match="weight"):
        la.causal_conv1d(x, np.zeros((5, 4), np.float32), s)
    with pytest.raises(ValueError, match="weight"):
        la.causal_conv1d(x, np.zeros((4, 2, 4), np.float32), s)
    with pytest.raises(ValueError, match="activation"):
        la.causal_conv1d(x, w, s, activation="gelu")
    with pytest.raises(ValueError, match="writable"):
        la.causal_conv1d(x, w, readonly(s))
    with pytest.raises(TypeError, match="conv_state"):
        la.causal_conv1d(x, w, s.astype(np.float64))
    with pytest.raises(ValueError, match="x must have 2"):
        la.causal_conv1d(x[0], w, s)
    with pytest.raises(ValueError, match="n must"):
        la.conv_state_at(s, x, 4)


# ------------------------------------------------------------------------- gating helpers


@given(rows=st.integers(1, 9), heads=st.integers(1, 4), d=st.sampled_from([1, 16, 128, 130]),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_gated_rms_norm_and_output_gate(backend, rows, heads, d, dtype, seed):
    rng = np.random.default_rng(seed)
    x, z = make_float(rng, (rows, heads, d), dtype), make_float(rng, (rows, heads, d), dtype, scale=3.0)
    w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    got = la.gated_rms_norm(x, z, w, 1e-6, backend=backend)
    assert got.shape == (rows, heads, d) and got.dtype == np.float32
    assert_close(got, ref.gated_rms_norm(as_f64(x), as_f64(z), as_f64(w), eps=1e-6), **TOLERANCE[dtype],
                 what="gated_rms_norm")
    gate = make_float(rng, (rows, heads * d), dtype, scale=3.0)
    out = la.apply_output_gate(x, gate, backend=backend)
    assert out.shape == (rows, heads * d)
    assert_close(out, ref.apply_output_gate(as_f64(x).reshape(rows, -1), as_f64(gate)), **TOLERANCE[dtype],
                 what="apply_output_gate")


def test_split_query_gate_per_head_layout():
    T, H, D = 3, 4, 8
    qg = np.arange(T * H * 2 * D, dtype=np.float32).reshape(T, H * 2 * D)
    query, gate = la.split_query_gate(qg, H, D)
    assert query.shape == (T, H, D) and gate.shape == (T, H * D)
    np.testing.assert_array_equal(query[1, 2], qg[1, 2 * 2 * D : 2 * 2 * D + D])  # head 2's [query | gate]
    np.testing.assert_array_equal(gate[1, 2 * D : 3 * D], qg[1, 2 * 2 * D + D : 3 * 2 * D])
    rq, rg = ref.split_query_gate(torch.from_numpy(qg), H, D)
    np.testing.assert_array_equal(query, rq.numpy())
    np.testing.assert_array_equal(gate, rg.numpy())
    tq, tg = la.split_query_gate(torch.from_numpy(qg).bfloat16(), H, D)
    assert tq.dtype == torch.bfloat16 and torch.equal(tq.float(), torch.from_numpy(query))


def test_gating_helpers_bad_input():
    with pytest.raises(ValueError, match="qg"):
        la.split_query_gate(np.zeros((2, 30), np.float32), 2, 8)
    with pytest.raises(ValueError, match="head_dim"):
        la.split_query_gate(np.zeros((2, 32), np.float32), 2, 0)
    with pytest.raises(ValueError, match="z must"):
        la.gated_rms_norm(np.zeros((2, 8), np.float32), np.zeros((2, 7), np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="weight"):
        la.gated_rms_norm(np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32), np.ones(7, np.float32))
    with pytest.raises(ValueError, match="o must"):
        la.apply_output_gate(np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32))
