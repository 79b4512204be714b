"""DFlash drafter on the dk kernels vs dflash_kernels/reference/drafter.py (plain torch, float64)."""

import numpy as np
import pytest
import torch

import dflash_kernels.model as dm
from checkpoints import write_dflash
from dflash_kernels.reference.drafter import drafter_hidden
from support import as_f64, assert_close

TOL = dict(rtol=1e-4, atol=1e-4)

DRAFTERS = {
    "full-b16": dict(layers=2, block_size=16, target_layer_ids=(0, 2)),
    "sliding-b8": dict(layers=3, block_size=8, target_layer_ids=(2, 0, 1), sliding=True, window=6),
    "causal-override": dict(layers=2, block_size=8, target_layer_ids=(1,), is_causal=True),
    "default-taps-toplevel-block": dict(layers=3, block_size=6, target_layer_ids=None, top_level_block=True),
}


@pytest.fixture(scope="module")
def target_dir(ckpt_dir):
    return ckpt_dir("target", shards=2, tie=False, style="v5")


def build(target_dir, drafter_dir):
    tcfg = dm.load_qwen3_config(target_dir)
    dcfg = dm.load_dflash_config(drafter_dir, tcfg.num_hidden_layers)
    tt, to = dm.read_checkpoint(target_dir)
    target = dm.Qwen3Model(tcfg, tt, to, tap_layer_ids=dcfg.target_layer_ids)
    dt, do = dm.read_checkpoint(drafter_dir)
    drafter = dm.DFlashDrafter(dcfg, dt, target.embed, target.lm_head, origin=do, target_hidden=tcfg.hidden_size)
    return target, drafter, dcfg, dt


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafter_matches_reference_over_rounds(tmp_path, target_dir, name):
    d = write_dflash(tmp_path / name, target_dir, **DRAFTERS[name])
    target, drafter, dcfg, dt = build(target_dir, d)
    weights = {k: as_f64(v) for k, v in dt.items()}
    embed = as_f64(np.asarray(target.embed))
    lm_head = as_f64(np.asarray(target.lm_head))
    cache, ctx = target.new_cache(96), drafter.new_cache(96)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 380, 9).tolist()
    _, taps = target.forward(prompt, cache)
    all_taps = [taps]
    drafter.add_context(taps, ctx)
    anchor = int(rng.integers(0, 380))
    for rnd in range(4):  # context grows by a different accepted count each round
        k = [dcfg.block_size - 1, 3, 1, dcfg.block_size - 2][rnd]
        h = drafter.block_hidden(anchor, k, ctx)
        block = torch.cat([embed[anchor : anchor + 1], embed[dcfg.mask_token_id].expand(k, -1)])
        ref = drafter_hidden(weights, dcfg, as_f64(np.concatenate(all_taps)), block)
        assert_close(h, ref, **TOL, what=f"{name} round {rnd} hidden")
        drafts = drafter.draft(anchor, k, ctx)
        ref_logits = ref[1:] @ lm_head.T
        top2 = torch.topk(ref_logits, 2).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # compare ids where the argmax is not a near-tie
        assert np.array_equal(np.asarray(drafts)[clear.numpy()], torch.argmax(ref_logits, -1)[clear].numpy())
        # commit: verify [anchor, drafts] in the target, keep a+1 rows of taps as new context
        a = min(rnd % 3, k)
        start = cache.length
        _, vt = target.forward([anchor, *np.asarray(drafts).tolist()], cache)
        cache.truncate(start + a + 1)
        drafter.add_context(vt[: a + 1], ctx)
        all_taps.append(vt[: a + 1])
        anchor = int(rng.integers(0, 380))
        assert ctx.length == cache.length


def test_sliding_window_matters(tmp_path, target_dir):
    """A sliding layer run as full attention gives different drafts at long context (docs/dflash.md 9)."""
    d = write_dflash(tmp_path / "sl", target_dir, layers=2, block_size=8, target_layer_ids=(1,), sliding=True, window=3)
    target, drafter, dcfg, dt = build(target_dir, d)
    cache, ctx = target.new_cache(64), drafter.new_cache(64)
    _, taps = target.forward(list(range(5, 40)), cache)
    drafter.add_context(taps, ctx)
    h = drafter.block_hidden(9, 7, ctx)
    weights = {k: as_f64(v) for k, v in dt.items()}
    embed = as_f64(np.asarray(target.embed))
    block = torch.cat([embed[9:10], embed[dcfg.mask_token_id].expand(7, -1)])
    full = drafter_hidden(weights, dcfg, as_f64(taps), block, windows=[None, None], causal=False)
    assert np.abs(np.asarray(h) - full.numpy()).max() > 1e-2


def test_default_tap_rule():
    assert dm.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dm.default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert dm.default_target_layer_ids(36, 1) == [18]


def test_inference_drafter_matches_training_drafter(tmp_path, target_dir):
    """The drafter the training code optimises (model/torch_qwen3.py) computes the same block hidden
    as the inference drafter for one block: training and inference agree on taps, masks, RoPE."""
    from dflash_kernels.model.torch_qwen3 import DFlashDrafter as TrainDrafter

    d = write_dflash(tmp_path / "d", target_dir, layers=2, block_size=8, target_layer_ids=(0, 2))
    target, drafter, dcfg, dt = build(target_dir, d)
    cfg = {"hidden_size": dcfg.hidden_size, "intermediate_size": dcfg.intermediate_size,
           "num_hidden_layers": dcfg.num_hidden_layers, "num_attention_heads": dcfg.num_attention_heads,
           "num_key_value_heads": dcfg.num_key_value_heads, "head_dim": dcfg.head_dim,
           "rms_norm_eps": dcfg.rms_norm_eps, "rope_theta": dcfg.rope_theta, "hidden_act": "silu"}
    train = TrainDrafter(cfg, n_taps=2).eval()
    train.load_state_dict({k: as_f64(v).float() for k, v in dt.items()})
    cache, ctx = target.new_cache(64), drafter.new_cache(64)
    _, taps = target.forward(list(range(30, 43)), cache)  # 13 committed positions
    drafter.add_context(taps, ctx)
    ours = drafter.block_hidden(17, 7, ctx)
    embed = as_f64(np.asarray(target.embed)).float()
    block = torch.cat([embed[17:18], embed[dcfg.mask_token_id].expand(7, -1)])[None]
    with torch.no_grad():
        ref = train(block, torch.arange(13, 21)[None], torch.from_numpy(taps)[None], torch.tensor([[13]]))[0]
    assert_close(ours, ref, rtol=1e-4, atol=1e-4, what="training vs inference drafter")


def test_sampled_drafts_follow_the_drafters_own_distribution(tmp_path, target_dir):
    import dflash_kernels as dk
    from support import chi2_ok

    d = write_dflash(tmp_path / "d", target_dir, layers=2, block_size=8, target_layer_ids=(0, 2))
    target, drafter, _, _ = build(target_dir, d)
    cache, ctx = target.new_cache(64), drafter.new_cache(64)
    _, taps = target.forward([5, 9, 13, 2, 8], cache)
    drafter.add_context(taps, ctx)
    h = drafter.block_hidden(8, 3, ctx)
    expected = dk.filtered_probs(drafter.ops.linear(h[1:], drafter.lm_head), 0.8, 20, 0.95)
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(4000):
        drafts, q = drafter.draft_sampled(8, 3, ctx, 0.8, 20, 0.95, rng)
        np.testing.assert_array_equal(q, expected)  # q is the distribution the drafts come from
        assert (q[np.arange(3), drafts] > 0).all()
        draws.append(drafts)
    draws = np.array(draws)
    for i in range(3):
        counts = np.bincount(draws[:, i], minlength=q.shape[1])
        ok, stat, crit = chi2_ok(dict(enumerate(counts.tolist())), expected[i].astype(np.float64))
        assert ok, f"row {i}: chi2 {stat:.1f} >= {crit:.1f}"
