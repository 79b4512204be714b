"""torch.ops.dflash: every op passes torch.library.opcheck (schema, fake shapes and dtypes against the
real outputs, mutation declarations), equals the public function, and traces under torch.compile."""

import numpy as np
import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import torch_ops

G = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


def _cases():
    """(op, args, kwargs) per op: realistic small shapes, bf16 where the op reads bf16."""
    T, H, D, V = 5, 64, 16, 300
    bf = torch.bfloat16
    drafts = torch.randint(0, V, (2, 4), generator=G)
    logits = randn(2, 5, V) * 3
    yield torch_ops.linear, (randn(3, H), randn(48, H, dtype=bf)), {}
    yield torch_ops.linear, (randn(2, 3, H), randn(48, H), randn(48)), {"precision": "medium"}
    for w, extra in ((randn(40, 50, dtype=bf), {}), (randn(33, H), {"bias": randn(33), "precision": "high"})):
        pw = dk.pack_weight(w)
        yield torch_ops.linear_packed, (randn(3, w.shape[1]), pw.to_tensor(), *pw.shape, pw.finite), extra
    yield torch_ops.rms_norm, (randn(T, H), randn(H)), {"eps": 1e-5}
    yield torch_ops.rms_norm_residual, (randn(T, H), randn(T, H), randn(H)), {}
    yield torch_ops.apply_rope, (randn(T, 4, D), torch.arange(7, 7 + T), 1e4), {}
    yield torch_ops.apply_rope, (randn(T, 4, D), torch.arange(T), 1e4), {
        "rotary_dim": 8, "inv_freq": torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)}
    yield torch_ops.silu_and_mul, (randn(T, 2 * H, dtype=bf),), {}
    yield torch_ops.cached_attention, (randn(2, 4, D), randn(9, 2, D, dtype=bf), randn(9, 2, D, dtype=bf)), {
        "window": 4}
    yield torch_ops.injected_kv_attention, (randn(3, 4, D), randn(7, 2, D), randn(7, 2, D), randn(3, 2, D),
                                            randn(3, 2, D)), {"causal_block": True}
    yield torch_ops.denoise_block, (randn(3, H), randn(V, H, dtype=bf)), {}
    yield torch_ops.denoise_block, (randn(3, H), randn(V, H)), {
        "temperature": 0.7, "top_k": 20, "uniforms": torch.rand(3, generator=G, dtype=torch.float64)}
    yield torch_ops.make_draft_block, (torch.tensor([5, 9]), 3, 4), {}
    yield torch_ops.accept_greedy, (drafts, torch.cat([drafts, drafts[:, :1]], 1)), {}
    yield torch_ops.rejection_sample, (drafts, logits, torch.rand(2, 5, 2, generator=G, dtype=torch.float64)), {
        "temperature": 0.8, "top_p": 0.9}
    yield torch_ops.filtered_probs, (logits[0],), {"temperature": 0.7, "top_k": 10}
    yield torch_ops.sample_filtered, (logits[0], torch.rand(5, generator=G, dtype=torch.float64)), {
        "temperature": 0.7, "top_p": 0.9}
    yield torch_ops.gated_delta_rule, (randn(T, 2, D), randn(T, 2, D), randn(T, 4, D), -torch.rand(T, 4),
                                       torch.rand(T, 4), randn(4, D, D) * 0.1), {}
    yield torch_ops.causal_conv1d, (randn(T, 24), randn(24, 4), randn(24, 3)), {}
    yield torch_ops.conv_state_at, (randn(24, 3), randn(T, 24), 2), {}
    yield torch_ops.gated_rms_norm, (randn(T, 4, D), randn(T, 4, D), randn(D)), {}
    yield torch_ops.split_query_gate, (randn(T, 4 * 2 * D),), {"n_heads": 4, "head_dim": D}
    yield torch_ops.apply_output_gate, (randn(T, 4, D), randn(T, 4 * D)), {}


CASES = list(_cases())


def test_every_op_is_covered():
    assert {c[0] for c in CASES} == set(torch_ops.OPS)
    for op in torch_ops.OPS:
        assert hasattr(torch.ops.dflash, op._name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0]._name)
def test_opcheck(case):
    op, args, kwargs = case
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0]._name)
def test_op_equals_the_public_function(case):
    op, args, kwargs = case
    name = op._name
    clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    got = getattr(torch.ops.dflash, name)(*map(clone, args), **kwargs)
    args2 = list(map(clone, args))
    if name == "rms_norm_residual":
        expect = dk.rms_norm(args2[0], args2[2], *args2[3:], residual=args2[1], **kwargs)
    elif name == "rejection_sample":
        expect = dk.rejection_sample(args2[0], args2[1], uniforms=args2[2], **kwargs)
    elif name == "sample_filtered":
        expect = dk.sample_filtered(args2[0], uniforms=args2[1], **kwargs)
    elif name == "linear_packed":  # the plain weight, unpacked from the tensor form
        w = dk.PackedWeight.from_data(args2[1], (args2[2], args2[3])).unpack()
        expect = dk.linear(args2[0], dk.pack_weight(w), **kwargs)
    elif name == "apply_rope" and "inv_freq" in kwargs:
        expect = dk.apply_rope(*args2, **{**kwargs, "inv_freq": kwargs["inv_freq"].numpy()})
    elif name in ("denoise_block", "filtered_probs", "split_query_gate"):
        expect = getattr(dk, name)(*args2, **kwargs)
    else:
        expect = getattr(dk, name)(*args2, **kwargs)
    got = got if isinstance(got, tuple) else (got,)
    expect = expect if isinstance(expect, tuple) else (expect,)
    for g, e in zip(got, expect, strict=True):
        np.testing.assert_array_equal(g.numpy(), np.asarray(e))


def test_linear_packed_matches_torch_and_names_a_bad_length():
    w = randn(70, 96, dtype=torch.bfloat16)
    pw = dk.pack_weight(w)
    x = randn(4, 96)
    got = torch.ops.dflash.linear_packed(x, pw.to_tensor(), 70, 96, pw.finite, None, "highest")
    torch.testing.assert_close(got, x @ w.float().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"packed has .* values.*\(90, 96\)"):
        torch.ops.dflash.linear_packed(x, pw.to_tensor(), 90, 96)
    with pytest.raises(TypeError, match="packed must have dtype"):
        torch.ops.dflash.linear_packed(x, pw.to_tensor().view(torch.int16), 70, 96)


def test_mutated_state_is_updated_in_place():
    q, k, v = randn(3, 1, 8), randn(3, 1, 8), randn(3, 1, 8)
    state = torch.zeros(1, 8, 8)
    torch.ops.dflash.gated_delta_rule(q, k, v, -torch.rand(3, 1), torch.rand(3, 1), state)
    assert state.abs().sum() > 0


class _Block(torch.nn.Module):
    """A decoder step's shape: norm, projection, RoPE, attention over a cache, gated MLP."""

    def __init__(self):
        super().__init__()
        self.w_norm = torch.nn.Parameter(torch.ones(64), requires_grad=False)
        self.w_q = torch.nn.Parameter(randn(4 * 16, 64, dtype=torch.bfloat16), requires_grad=False)
        self.w_gu = torch.nn.Parameter(randn(2 * 96, 64) * 0.1, requires_grad=False)

    def forward(self, x, pos, k_cache, v_cache):
        h = torch.ops.dflash.rms_norm(x, self.w_norm, 1e-6)
        q = torch.ops.dflash.linear(h, self.w_q).view(x.shape[0], 4, 16)
        q = torch.ops.dflash.apply_rope(q, pos, 1e4)
        o = torch.ops.dflash.cached_attention(q, k_cache, v_cache)
        act = torch.ops.dflash.silu_and_mul(torch.ops.dflash.linear(h, self.w_gu))
        return o.reshape(x.shape[0], -1), act * 2.0  # torch ops between ours (exact here)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_equals_eager(backend):
    m = _Block()
    args = (randn(3, 64), torch.arange(10, 13), randn(13, 2, 16), randn(13, 2, 16))
    eager = m(*args)
    compiled = torch.compile(m, fullgraph=True, backend=backend)(*args)
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
