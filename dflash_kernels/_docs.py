"""Docstring text that every public op shares, written once: a line holding only ``{name}`` in an
op's docstring is replaced, at import, by SHARED[name] at that line's indentation (``@shared_doc``)."""

from __future__ import annotations

SHARED = {
    "n_threads": """n_threads : int, optional
    Threads to use; None = ``DFLASH_NUM_THREADS``, else the CPUs this process may run on.""",
    "backend": """backend : {"auto", "cython", "numba", "torch"}, default "auto"
    Implementation to run; "auto" takes the first available (``available_backends()``).""",
    # every op but linear (whose backend entry says more)
    "run_options": """{n_threads}
{backend}""",
    # the two acceptance ops
    "acceptance_returns": """Returns
-------
num_accepted : ndarray or torch.Tensor, shape (B,)
    int64 accepted drafts per sequence, in [0, num_draft[b]]; 0-d for unbatched inputs.""",
    # the decoder-layer ops
    "layer_rows": """x : ndarray or torch.Tensor, shape (T, H)
    Rows of the residual stream, float32 (bf16 is upcast).""",
    "layer_precision": """precision : {"highest", "high", "medium"}, optional
    As ``linear``; None = the process default.""",
    # the two attention ops
    "attention_precision": """precision : {"highest", "high", "medium"}, optional
    Of both products, see the module docstring; None = the process default
    (``set_matmul_precision``).""",
    "attention_tail": """{attention_precision}
{run_options}

{attention_returns}""",
    "attention_returns": """Returns
-------
ndarray or torch.Tensor, shape (T_q, H_q, D)
    float32; a torch tensor if any input is one. Inputs must be finite: NaN/inf in q, K or V give
    unspecified (typically NaN) outputs for the rows that see them.""",
    # the decoder-layer ops' Examples: a tiny random layer's weights
    "layer_weights_example": """>>> rng = np.random.default_rng(0)
>>> H, I, D = 8, 16, 4  # hidden, intermediate, head dim; 2 query heads, 1 kv head
>>> shapes = {"input_layernorm": (H,), "post_attention_layernorm": (H,), "self_attn.q_proj": (2 * D, H),
...           "self_attn.k_proj": (D, H), "self_attn.v_proj": (D, H), "self_attn.o_proj": (H, 2 * D),
...           "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
>>> weights = {f"{k}.weight": rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}""",
    # the Gated DeltaNet layer's: one key head, two value heads of d_v = 4, conv of 4 taps
    "gdn_weights_example": """>>> rng = np.random.default_rng(0)
>>> H, I, d_k, d_v = 8, 16, 4, 4
>>> C = 2 * d_k + 2 * d_v  # conv channels: q | k | v
>>> shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
...           "linear_attn.in_proj_qkv.weight": (C, H), "linear_attn.in_proj_z.weight": (2 * d_v, H),
...           "linear_attn.in_proj_b.weight": (2, H), "linear_attn.in_proj_a.weight": (2, H),
...           "linear_attn.conv1d.weight": (C, 1, 4), "linear_attn.A_log": (2,),
...           "linear_attn.dt_bias": (2,), "linear_attn.norm.weight": (d_v,),
...           "linear_attn.out_proj.weight": (H, 2 * d_v), "mlp.gate_proj.weight": (I, H),
...           "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
>>> weights = {k: rng.standard_normal(s, dtype=np.float32) * 0.3 for k, s in shapes.items()}
>>> layer = dk.prepare_gated_deltanet_layer(weights, linear_num_key_heads=1, linear_num_value_heads=2,
...                                         linear_key_head_dim=d_k, linear_value_head_dim=d_v)""",
}


def _expand(text: str) -> str:
    """text with each line holding only ``{name}`` replaced by SHARED[name] (expanded in turn: an entry
    may be built of others) at that line's indentation; an unknown name is an error."""
    out = []
    for line in text.splitlines():
        key = line.strip()
        if key.startswith("{") and key.endswith("}"):
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + part if part else "" for part in _expand(SHARED[key[1:-1]]).splitlines()]
        else:
            out.append(line)
    return "\n".join(out)


def shared_doc(fn):
    """Fill the ``{name}`` lines of fn's docstring from SHARED."""
    fn.__doc__ = _expand(fn.__doc__)
    return fn
