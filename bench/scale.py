"""Scale benchmark: random-weight bf16 checkpoints at real Qwen3 or Qwen3.5 (hybrid Gated DeltaNet) shapes
with a matching 5-layer DFlash drafter (written on the fly to a temporary directory, never committed).

Measures, side by side in one process: T_ar (one decode step: target forward + greedy choice),
T_draft(k) (drafter block forward + token choice), T_verify(k) (target forward over k+1 rows + greedy),
T_accept (accept_greedy + cache cut + drafter context append) and the projected speedup
tau(k) * T_ar / (T_draft(k) + T_verify(k) + T_accept) (docs/dflash.md 5) for a given tau table; and the
AR step against the weight-streaming roofline (bytes read per step / streaming read bandwidth measured
in the same run). For a Qwen3.5 target it also times the rollback after a k=15 verification
(``HybridCache.truncate`` to an accepted prefix of 6 drafts: restoring the Gated DeltaNet states).
It also projects the speedup at the k that auto's rule picks from these costs (geometric acceptance
fitted to the seed's tau), and with --prefill N the time to first token of an N-token prompt and the
prefill's rate against the tier's register-only peaks.

    python bench/scale.py --shape Qwen3-1.7B --tau-json trained_tau.json --out results.json
    python bench/scale.py --shape Qwen3.5-0.8B --repeats 3
    python bench/scale.py --shape Qwen3.5-9B --layers 4 --keep /tmp/q9 --ks 7,15 --prefill 512
    python bench/scale.py --target SmolLM2-135M-Instruct.Q4_1.gguf --drafter model/default/smollm2-drafter

With --target / --drafter it times those checkpoints (a real model; its shape read from its config)
instead of writing a random pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from shapes import QWEN3_0_6B, QWEN3_1_7B, QWEN3_8B, ModelShape  # noqa: E402


@dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5 dense text model (docs/models.md 2.2): Gated DeltaNet layers with one gated full-attention
    layer every ``interval``; and the Qwen3-style layers of its DFlash drafter."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int  # full-attention query heads (head_dim 256, q_proj rows = 2 x heads x head_dim: query | gate)
    kv_heads: int
    head_dim: int
    vocab: int
    lin_k_heads: int = 16
    lin_v_heads: int = 16
    lin_k_dim: int = 128
    lin_v_dim: int = 128
    conv_kernel: int = 4
    interval: int = 4  # full_attention_interval: layer i is full attention iff (i + 1) % 4 == 0
    partial_rotary: float = 0.25
    rope_theta: float = 1e7
    tie: bool = True
    # Drafter attention. The released Qwen3.5-9B drafter has 32/8 heads x 128 at width 4096
    # (q width = hidden). No small Qwen3.5 drafter is public; we keep 16 query heads x 128 as the
    # smallest Qwen3 family does (Qwen3-0.6B / 1.7B) and the drafter's 4:1 GQA: 16/4 for 1024 and 2048.
    draft_heads: int = 16
    draft_kv_heads: int = 4
    draft_head_dim: int = 128

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.interval == 0 else "linear_attention" for i in range(self.layers)]

    @property
    def conv_dim(self) -> int:  # GDN conv channels [q | k | v]
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim


QWEN3_5_0_8B = HybridShape("Qwen3.5-0.8B", 1024, 3584, 24, 8, 2, 256, 248320)
QWEN3_5_2B = HybridShape("Qwen3.5-2B", 2048, 6144, 24, 8, 2, 256, 248320)
# The seed's configuration (docs/models.md, docs/dflash.md): 32 layers in the 3:1 pattern, 16/32 linear
# key/value heads, untied head; its drafter has 32/8 heads x 128 at width 4096 and 6 layers (the
# larger of the two public counts).
QWEN3_5_9B = HybridShape("Qwen3.5-9B", 4096, 12288, 32, 16, 4, 256, 248320, lin_v_heads=32, tie=False,
                         draft_heads=32, draft_kv_heads=8)
DRAFT_LAYERS = {"Qwen3.5-9B": 6}  # else 5
SHAPES = {s.name: s for s in (QWEN3_0_6B, QWEN3_1_7B, QWEN3_8B, QWEN3_5_0_8B, QWEN3_5_2B, QWEN3_5_9B)}
PUBLISHED_TAU_RANGE = (6.01, 6.5, 7.08)  # the seed's tau at concurrency 1 (docs/dflash.md 8), k = 15
QWEN35_MASK_TOKEN_ID = 248070  # docs/dflash.md 2: mask token of the Qwen3.5 drafters
PUBLISHED_TAU = {15: 6.93}  # Qwen3.5-9B-DFlash on HumanEval (docs/dflash.md 8)


def _randn_bf16(*shape, std=0.02, gen=None):
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def _qwen3_layer(prefix, h, i, hd, nh, nkv, gen):
    """One Qwen3 decoder layer (target or drafter), norms at one."""
    return {
        f"{prefix}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{prefix}self_attn.q_proj.weight": _randn_bf16(nh * hd, h, gen=gen),
        f"{prefix}self_attn.k_proj.weight": _randn_bf16(nkv * hd, h, gen=gen),
        f"{prefix}self_attn.v_proj.weight": _randn_bf16(nkv * hd, h, gen=gen),
        f"{prefix}self_attn.o_proj.weight": _randn_bf16(h, nh * hd, gen=gen),
        f"{prefix}self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
        f"{prefix}self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
        f"{prefix}mlp.gate_proj.weight": _randn_bf16(i, h, gen=gen),
        f"{prefix}mlp.up_proj.weight": _randn_bf16(i, h, gen=gen),
        f"{prefix}mlp.down_proj.weight": _randn_bf16(h, i, gen=gen),
    }


def _default_taps(n_target_layers: int, draft_layers: int) -> list[int]:
    """docs/dflash.md 6: round(1 + j (L - 4) / (n - 1)) for j in 0..n-1."""
    return [round(1 + j * (n_target_layers - 4) / (draft_layers - 1)) for j in range(draft_layers)]


def _write_drafter(d_dir: Path, dcfg: dict, *, draft_layers: int, n_target_layers: int, mask_token_id: int,
                   gen) -> None:
    """The DFlash drafter: Qwen3-style layers at the attention shape in dcfg, fc over the taps."""
    h, i, hd = dcfg["hidden_size"], dcfg["intermediate_size"], dcfg["head_dim"]
    nh, nkv = dcfg["num_attention_heads"], dcfg["num_key_value_heads"]
    taps = _default_taps(n_target_layers, draft_layers)
    dcfg = dict(dcfg, architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=draft_layers,
                num_target_layers=n_target_layers, block_size=16, tie_word_embeddings=False,
                torch_dtype="bfloat16", layer_types=["full_attention"] * draft_layers,
                dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": taps, "block_size": 16})
    (d_dir / "config.json").write_text(json.dumps(dcfg))
    dt = {"fc.weight": _randn_bf16(h, len(taps) * h, gen=gen),
          "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
          "norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for li in range(draft_layers):
        dt.update(_qwen3_layer(f"layers.{li}.", h, i, hd, nh, nkv, gen))
    save_file(dt, str(d_dir / "model.safetensors"), metadata={"format": "pt"})


def write_pair(root: Path, s, draft_layers: int = 5, seed: int = 0, layers: int | None = None) -> tuple[Path, Path]:
    """A random target at shape `s` (tied embeddings as in the real 0.6B/1.7B) and a 5-layer drafter
    (`layers`: only that many target layers, Qwen3.5 shapes)."""
    if isinstance(s, HybridShape):
        return write_pair_qwen35(root, s, draft_layers, seed, layers)
    gen = torch.Generator().manual_seed(seed)
    t_dir, d_dir = root / "target", root / "drafter"
    t_dir.mkdir(parents=True)
    d_dir.mkdir(parents=True)
    h, i, hd, nh, nkv = s.hidden, s.intermediate, s.head_dim, s.heads, s.kv_heads
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=h, intermediate_size=i,
               num_hidden_layers=s.layers, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
               vocab_size=s.vocab, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
               tie_word_embeddings=s.hidden < 4096, torch_dtype="bfloat16", hidden_act="silu",
               attention_bias=False, bos_token_id=151643, eos_token_id=151645)
    (t_dir / "config.json").write_text(json.dumps(cfg))
    tensors = {"model.embed_tokens.weight": _randn_bf16(s.vocab, h, std=1.0, gen=gen),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = _randn_bf16(s.vocab, h, gen=gen)
    for li in range(s.layers):
        tensors.update(_qwen3_layer(f"model.layers.{li}.", h, i, hd, nh, nkv, gen))
    save_file(tensors, str(t_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    dcfg = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                "hidden_act", "attention_bias")}
    _write_drafter(d_dir, dcfg, draft_layers=draft_layers, n_target_layers=s.layers, mask_token_id=151669, gen=gen)
    return t_dir, d_dir


def write_pair_qwen35(root: Path, s: HybridShape, draft_layers: int = 5, seed: int = 0,
                      layers: int | None = None) -> tuple[Path, Path]:
    """A random Qwen3.5 target in the text-only ``Qwen3_5ForCausalLM`` layout (prefix ``model.``, A_log
    and linear_attn.norm.weight F32, the rest bf16; docs/models.md 2.3) and its 5-layer DFlash drafter.
    Init as the trained models look: zero-centred norm weights near 0, gated-norm weights near 1,
    A_log = log(U(1, 16)), dt_bias near 1, projections std 0.02."""
    gen = torch.Generator().manual_seed(seed)
    t_dir, d_dir = root / "target", root / "drafter"
    t_dir.mkdir(parents=True)
    d_dir.mkdir(parents=True)
    if layers is not None:  # the first `layers` layers of the pattern, at full width (see main)
        s = dataclasses.replace(s, layers=layers)
    h, i, hd, nh, nkv = s.hidden, s.intermediate, s.head_dim, s.heads, s.kv_heads
    Hv, dv, K, C = s.lin_v_heads, s.lin_v_dim, s.conv_kernel, s.conv_dim
    n_freq = int(hd * s.partial_rotary) // 2
    cfg = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=h, intermediate_size=i,
               num_hidden_layers=s.layers, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
               hidden_act="silu", attention_bias=False, attention_dropout=0.0, attn_output_gate=True,
               rms_norm_eps=1e-6, vocab_size=s.vocab, max_position_embeddings=262144,
               full_attention_interval=s.interval, layer_types=s.layer_types, linear_conv_kernel_dim=K,
               linear_key_head_dim=s.lin_k_dim, linear_value_head_dim=dv, linear_num_key_heads=s.lin_k_heads,
               linear_num_value_heads=Hv, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
               rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta,
                                "partial_rotary_factor": s.partial_rotary, "mrope_interleaved": True,
                                "mrope_section": [n_freq - 2 * (n_freq // 3), n_freq // 3, n_freq // 3]},
               partial_rotary_factor=s.partial_rotary, tie_word_embeddings=s.tie, dtype="bfloat16",
               eos_token_id=248044, bos_token_id=None, pad_token_id=None)
    (t_dir / "config.json").write_text(json.dumps(cfg))

    def znorm(n):  # zero-centred RMSNorm weight: the scale is 1 + w
        return (0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": _randn_bf16(s.vocab, h, std=1.0, gen=gen), "model.norm.weight": znorm(h)}
    if not s.tie:
        tensors["lm_head.weight"] = _randn_bf16(s.vocab, h, gen=gen)
    for li, kind in enumerate(s.layer_types):
        p = f"model.layers.{li}."
        tensors.update({
            p + "input_layernorm.weight": znorm(h), p + "post_attention_layernorm.weight": znorm(h),
            p + "mlp.gate_proj.weight": _randn_bf16(i, h, gen=gen),
            p + "mlp.up_proj.weight": _randn_bf16(i, h, gen=gen),
            p + "mlp.down_proj.weight": _randn_bf16(h, i, gen=gen),
        })
        if kind == "full_attention":
            a = p + "self_attn."
            tensors.update({
                a + "q_proj.weight": _randn_bf16(2 * nh * hd, h, gen=gen),  # per head [query | gate]
                a + "k_proj.weight": _randn_bf16(nkv * hd, h, gen=gen),
                a + "v_proj.weight": _randn_bf16(nkv * hd, h, gen=gen),
                a + "o_proj.weight": _randn_bf16(h, nh * hd, gen=gen),
                a + "q_norm.weight": znorm(hd), a + "k_norm.weight": znorm(hd),
            })
        else:
            a = p + "linear_attn."
            tensors.update({
                a + "in_proj_qkv.weight": _randn_bf16(C, h, gen=gen),
                a + "in_proj_z.weight": _randn_bf16(Hv * dv, h, gen=gen),
                a + "in_proj_b.weight": _randn_bf16(Hv, h, gen=gen),
                a + "in_proj_a.weight": _randn_bf16(Hv, h, gen=gen),
                a + "conv1d.weight": _randn_bf16(C, 1, K, std=K ** -0.5, gen=gen),
                a + "A_log": torch.log(1.0 + 15.0 * torch.rand(Hv, generator=gen)),  # F32, log U(1, 16)
                a + "dt_bias": (1.0 + 0.1 * torch.randn(Hv, generator=gen)).to(torch.bfloat16),
                a + "norm.weight": 1.0 + 0.1 * torch.randn(dv, generator=gen),  # F32, gated norm near 1
                a + "out_proj.weight": _randn_bf16(h, Hv * dv, gen=gen),
            })
    save_file(tensors, str(t_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    dcfg = dict(hidden_size=h, intermediate_size=i, num_attention_heads=s.draft_heads,
                num_key_value_heads=s.draft_kv_heads, head_dim=s.draft_head_dim, vocab_size=s.vocab,
                rms_norm_eps=1e-6, rope_theta=s.rope_theta, max_position_embeddings=262144, hidden_act="silu",
                attention_bias=False)
    _write_drafter(d_dir, dcfg, draft_layers=draft_layers, n_target_layers=s.layers,
                   mask_token_id=QWEN35_MASK_TOKEN_ID, gen=gen)
    return t_dir, d_dir


def step_bytes(s, context: int) -> tuple[int, int]:
    """(bf16 weight bytes one decode step streams, cache bytes it reads/writes at `context`).

    Qwen3: every layer's projections + the LM head; K/V (float32 cache) of every layer are read.
    Qwen3.5: linear layers read [in_proj_qkv; z; b; a], conv1d and out_proj, full layers the gated
    q_proj (2 x q width), k/v/o; both the MLP. Cache: K/V of the full layers only, plus each linear
    layer's recurrent state (H_v, d_k, d_v) and conv state (C, K-1) float32, read and written back.
    """
    if not isinstance(s, HybridShape):
        per_layer = 2 * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.hidden * s.heads * s.head_dim
                         + 3 * s.hidden * s.intermediate)
        weights = s.layers * per_layer + 2 * s.vocab * s.hidden  # bf16 weights + the LM head read per step
        return weights, s.layers * 2 * context * s.kv_heads * s.head_dim * 4
    h, mlp = s.hidden, 3 * s.hidden * s.intermediate
    vd = s.lin_v_heads * s.lin_v_dim
    lin = h * (s.conv_dim + vd + 2 * s.lin_v_heads) + s.conv_dim * s.conv_kernel + h * vd + mlp
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    full = h * (2 * qd + 2 * kvd) + h * qd + mlp
    n_full = s.layer_types.count("full_attention")
    n_lin = s.layers - n_full
    weights = 2 * (n_lin * lin + n_full * full + s.vocab * h)
    kv = n_full * 2 * context * kvd * 4
    states = n_lin * 2 * 4 * (s.lin_v_heads * s.lin_k_dim * s.lin_v_dim + s.conv_dim * (s.conv_kernel - 1))
    return weights, kv + states


def stream_read_gbs(n_bytes: int, n_threads: int, repeats: int = 5) -> float:
    """Streaming read bandwidth over a buffer of the given size (Numba parallel sum)."""
    import numba

    @numba.njit(parallel=True, cache=False, fastmath=True)
    def _sum(a):
        acc = 0.0
        for j in numba.prange(a.shape[0]):
            acc += a[j]
        return acc

    buf = np.ones(n_bytes // 4, np.float32)
    numba.set_num_threads(n_threads)
    _sum(buf)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _sum(buf)
        times.append(time.perf_counter() - t)
    return n_bytes / statistics.median(times) / 1e9


def _medians(calls, n):
    """Median wall times of calls [(fn, after), ...] timed in turn, n rounds after one warm-up each;
    after() (untimed, may be None) runs after its fn. Parts of one step timed in turn see the same
    conditions, where this machine's memory bandwidth moves from minute to minute."""
    for fn, after in calls:
        fn()
        if after:
            after()
    times = [[] for _ in calls]
    for _ in range(n):
        for (fn, after), ts in zip(calls, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
            if after:
                after()
    return [statistics.median(ts) for ts in times]


def _median(fn, n, after=None):
    """Median wall time of fn over n calls after one warm-up; after() (untimed) runs after each call."""
    return _medians([(fn, after)], n)[0]


def _rewinder(cache, base: int):
    """A function that puts `cache` back to `base` positions between timed calls (untimed).

    A Qwen3 KV cache is cut. The hybrid cache's Gated DeltaNet states can only be restored to a
    position inside the last verification block (HybridCache.truncate: start+1 .. start+n, never back
    to start itself), so its conv/recurrent states are copied back from a snapshot taken at `base`;
    the full-attention K/V rows past `base` are simply overwritten later. The checkpoints of the last
    verification are left in place, so an accept / rollback timing can still truncate into that block.
    """
    if not hasattr(cache, "state"):
        return lambda: cache.truncate(base)
    conv, state = cache.conv.copy(), cache.state.copy()

    def rewind():
        cache.length = base
        np.copyto(cache.conv, conv)
        np.copyto(cache.state, state)

    return rewind


def measure(target_dir, drafter_dir, *, n_threads, context=256, repeats=7, ks=range(1, 16),
            rollback=(15, 6), precision=None, draft_precision="auto", kv_dtype="float32",
            draft_vocab_size=None, prefill=0, read_gbs=None, split_head=False) -> dict:
    """rollback (k, accepted): for a hybrid target also time cache.truncate(base + accepted + 1) right
    after a k-draft verification (the Gated DeltaNet state restore), None to skip. kv_dtype: the
    target's KV cache storage ("float32" or "bfloat16"). draft_vocab_size: None, the drafter's
    draft_vocab.json if it has one; 0, none; N, the first N token ids (a stand-in that times a
    drafting vocabulary of that size: which ids does not change the time). prefill: also time the
    first token of a prompt of this many tokens (measure_prefill), 0 to skip. read_gbs: a function
    measuring the streaming read (GB/s), run right before and right after the AR step's timing: the
    memory bandwidth of a shared machine moves within minutes (33-63 GB/s on one Zen 4), so a read
    measured at another moment puts T_ar anywhere from 0.5x to 2x its roofline. split_head: also
    time the target's forward without the LM head's greedy pass, alternating with that pass
    (t_fwd_*_s, t_head_*_s; the step is their sum), for scaling the layers' time (main --layers): a
    difference of two separately timed medians, scaled 8x, turned the bandwidth's drift into T_ar of
    0.58x its roofline."""
    from dflash_kernels.model import load

    # packed weights (fuse_weights): the layout a model that fits in memory runs with
    max_len = max(context, prefill) + 64
    eng = load(target_dir, drafter_dir, n_threads=n_threads, max_len=max_len, precision=precision,
               draft_precision=draft_precision, kv_dtype=kv_dtype, fuse_weights=True,
               draft_vocab=draft_vocab_size is None)
    tgt, dr = eng.target, eng.drafter
    if draft_vocab_size:
        dr.set_draft_vocab(np.arange(draft_vocab_size, dtype=np.int64), tgt.lm_head_table)
    rng = np.random.default_rng(0)
    res = {"context": context}
    if prefill:
        res["prefill"] = measure_prefill(tgt, dr, rng.integers(0, min(151643, tgt.cfg.vocab_size), prefill).tolist(),
                                         kv_dtype=kv_dtype, repeats=max(1, min(repeats, 3)))
    cache, ctx = tgt.new_cache(context + 64, kv_dtype), dr.new_cache(context + 64)
    prompt = rng.integers(0, min(151643, tgt.cfg.vocab_size), context).tolist()
    _, taps = tgt.forward(prompt, cache, last_only=True, taps=True)
    dr.add_context(taps, ctx)
    base = cache.length
    anchor = int(prompt[-1])
    rewind = _rewinder(cache, base)
    hybrid = hasattr(cache, "state")

    def ar_step():
        h, _ = tgt.forward([anchor], cache, taps=False)
        tgt.greedy(h)

    gbs_before = read_gbs() if read_gbs else None
    # the LM head's share (greedy pass over the vocabulary), kept apart when layers are scaled (main)
    h1, _ = tgt.forward([anchor], cache, taps=False)
    rewind()
    if split_head:  # the step in its two parts, timed in turn; the whole step is their sum
        res["t_fwd_ar_s"], res["t_head_ar_s"] = _medians(
            [(lambda: tgt.forward([anchor], cache, taps=False), rewind), (lambda: tgt.greedy(h1), None)], repeats)
        t_ar = res["t_fwd_ar_s"] + res["t_head_ar_s"]
    else:
        t_ar = _median(ar_step, repeats, rewind)
        res["t_head_ar_s"] = _median(lambda: tgt.greedy(h1), repeats)
    if read_gbs:
        res["stream_read_gbs_around_ar"] = (gbs_before, read_gbs())
    res.update(t_ar_s=t_ar, k={}, draft_precision=dr.ops.precision,
               draft_vocab=None if dr.draft_ids is None else len(dr.draft_ids))
    for k in ks:
        drafts = dr.draft(anchor, k, ctx)
        block = np.concatenate([[anchor], drafts]).astype(np.int64)

        def verify(block=block):
            h, _ = tgt.forward(block, cache, taps=True)
            tgt.greedy(h)

        h, vt = tgt.forward(block, cache, taps=True)  # leaves the block's checkpoints for accept()
        choice = tgt.greedy(h)
        rewind()
        n_ctx = ctx.length

        def accept(drafts=drafts, choice=choice, k=k, vt=vt, n_ctx=n_ctx):
            n_acc, _ = eng.ops.accept_greedy(drafts[None], choice[None])
            cache.length = base + k + 1  # as after a verification
            cache.truncate(base + int(np.asarray(n_acc)[0]) + 1)
            dr.add_context(vt[: int(np.asarray(n_acc)[0]) + 1], ctx)
            ctx.length = n_ctx

        r = res["k"][k] = {"t_draft_s": _median(lambda k=k: dr.draft(anchor, k, ctx), repeats),
                           "t_accept_s": _median(accept, repeats, rewind)}
        if split_head:
            r["t_fwd_verify_s"], r["t_head_verify_s"] = _medians(
                [(lambda block=block: tgt.forward(block, cache, taps=True), rewind), (lambda h=h: tgt.greedy(h), None)],
                repeats)
            r["t_verify_s"] = r["t_fwd_verify_s"] + r["t_head_verify_s"]
        else:
            r["t_verify_s"] = _median(verify, repeats, rewind)
            r["t_head_verify_s"] = _median(lambda h=h: tgt.greedy(h), repeats)
        if hybrid and rollback and k == rollback[0]:
            kept = base + rollback[1] + 1  # anchor + accepted drafts

            def cut(k=k, kept=kept):
                cache.length = base + k + 1  # as right after the verification whose checkpoints are kept
                cache.truncate(kept)

            t_cut = _median(cut, repeats, rewind)
            res["rollback"] = {"k": k, "accepted": rollback[1], "t_truncate_s": t_cut,
                               "vs_verify": t_cut / res["k"][k]["t_verify_s"]}
    return res


def measure_prefill(tgt, dr, prompt: list, *, kv_dtype: str, repeats: int) -> dict:
    """Time to first token for `prompt`, in its three parts (median of `repeats`, each on fresh
    caches, as a new request starts): the target's forward over the prompt (its prefill chunks,
    with the taps the drafter reads), the drafter's context K/V built from those taps, and the
    first token's greedy pass over the vocabulary."""
    def target_forward():
        return tgt.forward(prompt, tgt.new_cache(len(prompt) + 1, kv_dtype), last_only=True, taps=True)

    h, taps = target_forward()
    return {"tokens": len(prompt), "t_target_s": _median(target_forward, repeats),
            "t_draft_context_s": _median(lambda: dr.add_context(taps, dr.new_cache(len(prompt) + 1)), repeats),
            "t_first_token_s": _median(lambda: tgt.greedy(h), repeats)}


def prefill_flops(s, tokens: int) -> float:
    """Matmul FLOPs of a target forward over `tokens` prompt rows (LM head excluded: one row): every
    layer's projections (2 x params per row) and the causal attention of its full-attention layers
    (Q.K^T and P.V over the rows before each). The Gated DeltaNet recurrence (a few % of a layer) and
    the norms are not counted, so the rate quoted is a lower bound."""
    weights, _ = step_bytes(s, 0)
    layer_params = weights / 2 - s.vocab * s.hidden
    n_full = s.layer_types.count("full_attention") if isinstance(s, HybridShape) else s.layers
    pairs = tokens * (tokens + 1) / 2  # (query, key) pairs under the causal mask
    return 2.0 * tokens * layer_params + n_full * 2 * 2 * pairs * s.heads * s.head_dim


def best_k_projection(res: dict, tau15: float) -> dict:
    """The k that auto's rule (model/adaptive.py: the largest E(k) / C(k)) picks from this run's
    costs, with acceptance geometric in the position and fitted to tau at k = 15:
    E(k) = 1 + a + ... + a^k, a solving E(15) = tau15. Returns {"k", "alpha", "speedup"}."""
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E(15) rises with a
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** j for j in range(16)) < tau15 else (lo, a)
    rates = {k: sum(a ** j for j in range(k + 1)) / sum(r[t] for t in ("t_draft_s", "t_verify_s", "t_accept_s"))
             for k, r in res["k"].items()}
    k = max(rates, key=rates.get)
    return {"k": k, "alpha": a, "speedup": rates[k] * res["t_ar_s"]}


def projected(res: dict, tau: dict) -> dict:
    out = {}
    for k, _t in tau.items():
        r = res["k"].get(int(k))
        if r:
            out[int(k)] = tau[k] * res["t_ar_s"] / (r["t_draft_s"] + r["t_verify_s"] + r["t_accept_s"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="Qwen3-0.6B", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tau-json", help="measured tau per k: {k: tau}, or the JSON of `dflash tune --out`")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--keep", metavar="DIR", help="write the pair to DIR/target and DIR/drafter and keep it "
                                                  "(reused when DIR already holds one)")
    ap.add_argument("--precision", default="highest", choices=("highest", "high", "medium"))
    ap.add_argument("--draft-precision", default="auto", choices=("auto", "target", "highest", "high", "medium"),
                    help="the drafter's (model.load's draft_precision; target: the same as --precision)")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"), help="target KV cache")
    ap.add_argument("--isa", default=None, help="cap the ISA tier (as DFLASH_ISA)")
    ap.add_argument("--target", help="time this checkpoint (directory or GGUF) instead of a random --shape pair")
    ap.add_argument("--drafter", help="its DFlash drafter (with --target)")
    ap.add_argument("--ks", default="1-15", help="k values: a range a-b or a comma list (default 1-15)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="time the drafter over a drafting vocabulary of this many tokens (0: none; "
                         "default: the drafter's draft_vocab.json if it has one)")
    ap.add_argument("--layers", type=int, default=None,
                    help="Qwen3.5 shapes: write and time only this many target layers (a multiple of 4 keeps "
                         "the 3:1 pattern) at full width, with the full LM head and drafter, and scale the "
                         "layers' time to the full depth (for shapes that do not fit in memory)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also time the first token of an N-token prompt (prefill, the drafter's context, the "
                         "first greedy pass) and its rate against this tier's register-only peaks")
    args = ap.parse_args(argv)
    if args.isa:
        import dflash_kernels as dk

        dk.set_isa(args.isa)
    ks = (range(int(args.ks.split("-")[0]), int(args.ks.split("-")[1]) + 1) if "-" in args.ks
          else [int(k) for k in args.ks.split(",")])
    if args.target:
        if not args.drafter:
            ap.error("--target needs --drafter")
        from dflash_kernels.model import load

        c = load(args.target, max_len=64).target.cfg
        s = ModelShape(Path(args.target).stem, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                       c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    else:
        s = SHAPES[args.shape]
    if args.layers is not None and (not isinstance(s, HybridShape) or not 1 <= args.layers <= s.layers):
        ap.error(f"--layers needs a Qwen3.5 shape and 1 <= layers <= {s.layers}")
    torch.set_num_threads(args.threads)
    weight_bytes, kv_bytes = step_bytes(s, args.context)
    read_bytes = min(weight_bytes, 2 << 30)
    written = False
    with tempfile.TemporaryDirectory(prefix="dflash_scale_") as tmp:
        t0 = time.time()
        root = Path(args.keep or tmp)
        if args.target:
            t_dir, d_dir = Path(args.target), Path(args.drafter)
        elif (root / "target" / "config.json").exists() and (root / "drafter" / "config.json").exists():
            t_dir, d_dir = root / "target", root / "drafter"
        else:  # written aside, then moved in: an interrupted write leaves no half pair for --keep to reuse
            stage = root / ".writing"
            shutil.rmtree(stage, ignore_errors=True)
            write_pair(stage, s, draft_layers=DRAFT_LAYERS.get(s.name, 5), layers=args.layers)
            t_dir, d_dir = root / "target", root / "drafter"
            for final in (t_dir, d_dir):
                shutil.rmtree(final, ignore_errors=True)
                (stage / final.name).rename(final)
            stage.rmdir()
            print(f"wrote random {s.name} pair in {time.time() - t0:.0f} s", file=sys.stderr)
            written = True
        n_layers = s.layers if args.target else json.loads((t_dir / "config.json").read_text())["num_hidden_layers"]
        res = measure(t_dir, d_dir, n_threads=args.threads, context=args.context, repeats=args.repeats, ks=ks,
                      precision=args.precision, kv_dtype=args.kv_dtype, draft_vocab_size=args.draft_vocab_size,
                      draft_precision=None if args.draft_precision == "target" else args.draft_precision,
                      prefill=args.prefill, read_gbs=lambda: stream_read_gbs(read_bytes, args.threads),
                      split_head=n_layers < s.layers)
        import dflash_kernels as dk

        res.update(tier=dk.active_tier(), precision=args.precision, kv_dtype=args.kv_dtype)
        if args.prefill:  # the ceilings, measured in the same run (the best of three: noise only slows them)
            dense = dk.kernel_module("dense", "cython")
            res["peak_fma_gflops"] = max(dense.peak_gflops("fma", args.threads, 0.2) for _ in range(3))
            res["peak_bf16dot_gflops"] = max(dense.peak_gflops("bf16dot", args.threads, 0.2) for _ in range(3))
            res["peak_amx_gflops"] = max(dense.peak_gflops("amx", args.threads, 0.2) for _ in range(3))
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if n_layers < s.layers:  # layers timed at full width, scaled to the full depth; LM head as is
        f = s.layers / n_layers
        res["timed_layers"] = n_layers
        res["t_ar_timed_s"] = res["t_ar_s"]  # the timed layers' step (forward + head)
        res["t_ar_s"] = res["t_head_ar_s"] + f * res["t_fwd_ar_s"]
        for r in res["k"].values():
            r["t_verify_timed_s"] = r["t_verify_s"]
            r["t_verify_s"] = r["t_head_verify_s"] + f * r["t_fwd_verify_s"]
    if args.prefill:  # the rate from the layers timed; the time to first token at the full depth
        pf = res["prefill"]
        timed = dataclasses.replace(s, layers=n_layers) if n_layers < s.layers else s
        pf["gflops"] = prefill_flops(timed, pf["tokens"]) / pf["t_target_s"] / 1e9
        pf["ttft_s"] = (s.layers / n_layers * pf["t_target_s"] + pf["t_draft_context_s"] + pf["t_first_token_s"])
    gbs = statistics.mean(res["stream_read_gbs_around_ar"])
    res.update(shape=s.name, threads=args.threads, step_weight_bytes=weight_bytes, kv_bytes=kv_bytes,
               stream_read_gbs=gbs, roofline_step_s=(weight_bytes + kv_bytes) / gbs / 1e9)
    res["ar_vs_roofline"] = res["t_ar_s"] / res["roofline_step_s"]
    res["projected_published"] = projected(res, PUBLISHED_TAU)
    if args.tau_json:
        taus = json.loads(Path(args.tau_json).read_text())
        if "sweep" in taus:  # `dflash tune --out` JSON
            taus = {s_["k"]: s_["tau"] for s_ in taus["sweep"]}
        res["tau_measured"] = {int(k): v for k, v in taus.items()}
        res["projected_measured"] = projected(res, res["tau_measured"])
    vocab = "" if res["draft_vocab"] is None else f", drafting vocabulary {res['draft_vocab']} tokens"
    print(f"tier {res['tier']}, precision {res['precision']} (drafter {res['draft_precision']}), "
          f"KV cache {res['kv_dtype']}{vocab}")
    if "timed_layers" in res:
        print(f"timed {res['timed_layers']} of {s.layers} target layers at full width (with the full LM head "
              f"and drafter) and scaled the layers' time to {s.layers} layers")
    print(f"peak RSS {res['peak_rss_bytes'] / 2**30:.1f} GiB"
          + (" (includes writing the random pair in this process)" if written else ""))
    print(f"{s.name}: T_ar {res['t_ar_s'] * 1e3:.1f} ms, roofline {res['roofline_step_s'] * 1e3:.1f} ms "
          f"({res['ar_vs_roofline']:.2f}x), stream read {gbs:.1f} GB/s (mean of "
          + " and ".join(f"{g:.1f}" for g in res["stream_read_gbs_around_ar"])
          + " right before and after the AR timings)")
    print("| k | T_draft ms | T_verify ms | T_accept ms | verify/AR "
          "| projected (tau 6.93 at 15) | projected (measured tau) |")
    print("|---|---|---|---|---|---|---|")
    for k, r in res["k"].items():
        pm = res.get("projected_measured", {}).get(k)
        pp = res["projected_published"].get(k)
        print(f"| {k} | {r['t_draft_s'] * 1e3:.1f} | {r['t_verify_s'] * 1e3:.1f} | {r['t_accept_s'] * 1e3:.2f} | "
              f"{r['t_verify_s'] / res['t_ar_s']:.2f} | {f'{pp:.2f}x' if pp else '-'} | "
              f"{f'{pm:.2f}x' if pm else '-'} |")
    k_max = max(res["k"])
    rnd = sum(res["k"][k_max][t] for t in ("t_draft_s", "t_verify_s", "t_accept_s"))
    res["projected_tau_range"] = {tau: tau * res["t_ar_s"] / rnd for tau in PUBLISHED_TAU_RANGE}
    print(f"projected at k={k_max} for the seed's tau range: "
          + ", ".join(f"tau {tau}: {v:.2f}x" for tau, v in res["projected_tau_range"].items()))
    tau_best = PUBLISHED_TAU_RANGE[1]
    res["best_k_projected"] = best_k_projection(res, tau_best)
    bk = res["best_k_projected"]
    print(f"best k by auto's rule (acceptance {bk['alpha']:.3f} per position, tau {tau_best} at k=15): "
          f"k={bk['k']}, projected {bk['speedup']:.2f}x")
    pf = res.get("prefill")
    if pf:
        peaks = f"FMA peak {res['peak_fma_gflops']:.0f} GFLOP/s: {100 * pf['gflops'] / res['peak_fma_gflops']:.0f}%"
        if res["peak_bf16dot_gflops"]:
            peaks += (f"; vdpbf16ps peak {res['peak_bf16dot_gflops']:.0f} GFLOP/s: "
                      f"{100 * pf['gflops'] / res['peak_bf16dot_gflops']:.0f}%")
        if res.get("peak_amx_gflops"):
            peaks += (f"; AMX peak {res['peak_amx_gflops']:.0f} GFLOP/s: "
                      f"{100 * pf['gflops'] / res['peak_amx_gflops']:.0f}%")
        print(f"prefill {pf['tokens']} tokens: time to first token {pf['ttft_s'] * 1e3:.0f} ms (target forward "
              f"{pf['t_target_s'] * 1e3:.0f} ms over {n_layers} layers, drafter context "
              f"{pf['t_draft_context_s'] * 1e3:.0f} ms, first greedy pass {pf['t_first_token_s'] * 1e3:.0f} ms); "
              f"target {pf['gflops']:.0f} GFLOP/s ({peaks})")
    rb = res.get("rollback")
    if rb:
        print(f"rollback after k={rb['k']} verification to {rb['accepted']} accepted (HybridCache.truncate): "
              f"{rb['t_truncate_s'] * 1e3:.2f} ms = {rb['vs_verify'] * 100:.2f}% of T_verify({rb['k']})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
