"""The training recipe runs, the loss falls, and the outputs load through the inference layer."""

import json

import numpy as np
import pytest
import torch

from dflash_kernels.model import training as T
from dflash_kernels.model.corpus import HELD_OUT, eval_prompts, stdlib_dir, stdlib_files
from dflash_kernels.model.torch_qwen3 import DFlashDrafter, block_loss_weights

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16, num_attention_heads=4,
            num_key_value_heads=2)


def test_corpus_split_holds_out_whole_modules():
    evals = stdlib_files("eval")
    assert evals and stdlib_files("train")
    root = stdlib_dir()
    assert all(f.relative_to(root).parts[0].removesuffix(".py") in HELD_OUT for f in evals)
    assert not any(f.relative_to(root).parts[0].removesuffix(".py") in HELD_OUT for f in stdlib_files("train"))
    assert len(eval_prompts(4)) == 4


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("train")
    tok = T.train_tokenizer(out / "tok", vocab_size=512)
    target = T.train_target(out / "target", tok, steps=40, batch=4, seq=64, lr=3e-3, eval_every=20, quiet=True,
                            config_overrides=TINY)
    drafter = T.train_drafter(out / "drafter", out / "target", steps=30, layers=2, batch=4, anchors=4,
                              prompt_len=16, new_tokens=40, n_sequences=32, lr=3e-3, quiet=True)
    return out, target, drafter


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def test_target_loss_falls_and_resumes(tiny_pair):
    out, target, _ = tiny_pair
    losses = _losses(out / "target" / "train_log.jsonl")
    assert len(losses) == 40
    assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 0.5
    assert np.isfinite(target["held_out_loss"])
    assert torch.load(out / "target" / "train_state.pt")["step"] == 40


def test_target_training_resumes(tiny_pair, tmp_path):
    import shutil

    out, _, _ = tiny_pair
    run = tmp_path / "target"
    shutil.copytree(out / "target", run)
    with open(run / "train_log.jsonl", "a") as f:  # rows of an interrupted run after the last save
        f.write(json.dumps({"step": 41, "loss": 9.0}) + "\n")
    result = T.train_target(run, out / "tok" / "tokenizer.json", steps=50, batch=4, seq=64, lr=3e-3,
                            eval_every=20, quiet=True, config_overrides=TINY)
    steps = [json.loads(line)["step"] for line in open(run / "train_log.jsonl")]
    assert steps == list(range(1, 51)) and result["steps"] == 50


def test_drafter_loss_falls(tiny_pair):
    out, _, drafter = tiny_pair
    losses = _losses(out / "drafter" / "train_log.jsonl")
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert 1.0 <= drafter["eval_tau_estimate"] <= 16.0
    assert (out / "drafter" / "loss.png").stat().st_size > 1000  # the model card's loss curve


def test_trained_pair_loads_in_public_layout(tiny_pair):
    from dflash_kernels.model import load

    out, _, _ = tiny_pair
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg
    eng = load(out / "target", out / "drafter")
    ar = eng.generate("def f(x):", 12, num_speculative_tokens=0, ignore_eos=True)
    sd = eng.generate("def f(x):", 12, ignore_eos=True)
    assert ar.token_ids == sd.token_ids and len(ar.token_ids) == 12


def test_block_mask_sees_only_earlier_context_and_own_block():
    cfg = dict(TINY, num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=1e4)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg, n_taps=1).eval()
    taps = torch.randn(1, 20, 64)
    anchors = torch.tensor([[5, 12]])
    pos = (anchors[..., None] + torch.arange(4)).flatten(1)
    emb = torch.randn(1, 8, 64)
    base = d(emb, pos, taps, anchors)
    taps2 = taps.clone()
    taps2[:, 5:] += 1.0  # context at or after block 0's anchor: invisible to block 0
    emb2 = emb.clone()
    emb2[:, 4:] += 1.0  # block 1's rows: invisible to block 0
    again = d(emb2, pos, taps2, anchors)
    torch.testing.assert_close(again[:, :4], base[:, :4])
    assert not torch.allclose(again[:, 4:], base[:, 4:])


def test_loss_weights_decay():
    w = block_loss_weights(16)
    assert w.shape == (15,) and w[0] == 1.0 and torch.all(w[1:] < w[:-1])


def test_drafter_fine_tunes_from_checkpoint_with_chosen_taps(tiny_pair, tmp_path):
    out, _, _ = tiny_pair
    kw = dict(steps=3, layers=2, batch=4, anchors=4, prompt_len=16, new_tokens=40, n_sequences=32, lr=0.0,
              quiet=True)
    tuned = T.train_drafter(tmp_path / "tuned", out / "target", init_from=out / "drafter", **kw)
    # with a zero learning rate the fine-tuned weights are exactly the checkpoint's (bf16 round trip)
    from safetensors.torch import load_file

    a = load_file(str(out / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "tuned" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert tuned["taps"] == json.loads((out / "drafter" / "config.json").read_text())["dflash_config"][
        "target_layer_ids"]
    # no steps: an evaluation of the starting weights (no log, no loss plot)
    start = T.train_drafter(tmp_path / "eval", out / "target", init_from=out / "drafter", **{**kw, "steps": 0})
    assert start["steps"] == 0 and np.isfinite(start["eval_loss"])
    chosen = T.train_drafter(tmp_path / "taps", out / "target", taps=[0, 3], **kw)
    assert chosen["taps"] == [0, 3]
    cfg = json.loads((tmp_path / "taps" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 3]
    with pytest.raises(ValueError, match="target_layer_ids"):  # a checkpoint trained on other taps
        T.train_drafter(tmp_path / "bad", out / "target", init_from=tmp_path / "taps", **kw)
    with pytest.raises(ValueError, match="taps must be"):
        T.train_drafter(tmp_path / "bad2", out / "target", taps=[4], **kw)


def test_deeper_drafter_grows_from_checkpoint_as_identity_layers(tiny_pair, tmp_path):
    """--init-from a shallower drafter: the extra layers start as identities, so the grown drafter's
    first evaluation is the checkpoint's own."""
    out, _, _ = tiny_pair
    taps = json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    kw = dict(steps=0, batch=4, anchors=4, prompt_len=16, new_tokens=40, n_sequences=32, quiet=True, taps=taps)
    start = T.train_drafter(tmp_path / "start", out / "target", init_from=out / "drafter", layers=2, **kw)
    grown = T.train_drafter(tmp_path / "grown", out / "target", init_from=out / "drafter", layers=4, **kw)
    assert grown["eval_loss"] == start["eval_loss"]
    assert grown["eval_tau_estimate"] == start["eval_tau_estimate"]
    trained = T.train_drafter(tmp_path / "trained", out / "target", init_from=out / "drafter", layers=3,
                              **{**kw, "steps": 2})
    assert np.isfinite(trained["eval_loss"])
    with pytest.raises(ValueError, match="does not match the drafter"):  # fewer layers than the checkpoint
        T.train_drafter(tmp_path / "shrunk", out / "target", init_from=out / "drafter", layers=1, **kw)


def test_drafter_data_from_prompts_of_any_length_equals_one_by_one(tiny_pair):
    """Left-padded batches (prompts of different lengths) give each row the tokens, stop and tap
    features of generating it alone."""
    out, _, _ = tiny_pair
    target = T.load_torch_target(out / "target")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 500, n).tolist() for n in (3, 9, 6, 12)]
    stop = 7
    batched = T.generate_drafter_data(target, prompts, 10, [0, 2], batch=4, stop_ids=(stop,), quiet=True)
    for i, p in enumerate(prompts):
        alone = T.generate_drafter_data(target, [p], 10, [0, 2], batch=1, stop_ids=(stop,), quiet=True)
        n = int(alone["length"][0])
        assert int(batched["length"][i]) == n and int(batched["prompt_len"][i]) == len(p)
        assert batched["tokens"][i, :n].tolist() == alone["tokens"][0, :n].tolist()
        assert batched["tokens"][i, :len(p)].tolist() == p
        torch.testing.assert_close(batched["feats"][i, :n].float(), alone["feats"][0, :n].float(),
                                   rtol=2e-2, atol=2e-2)  # bf16 storage; padding changes the sum order
        assert not batched["feats"][i, n:].any()
        gen = batched["tokens"][i, len(p):n].tolist()
        assert stop not in gen[:-1] and (n == len(p) + 10 or gen[-1] == stop)


def test_mask_token_is_an_unused_row_or_an_unused_special_token():
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    tok.add_special_tokens(["<eos>", "<x>", "<y>"])  # ids 2, 3, 4
    assert T.mask_token_id({"vocab_size": 8}, tok) == 7  # a padded embedding row
    assert T.mask_token_id({"vocab_size": 5, "eos_token_id": 2, "bos_token_id": 4}, tok) == 3


def test_default_taps_tap_each_layer_once():
    assert T.default_taps(4, 2) == [1]  # the rule's [1, 1]: vLLM gathers each layer once
    assert T.default_taps(30, 3) == [1, 14, 27]


def test_merge_repeated_taps_sums_the_fc_blocks(tmp_path):
    from safetensors.torch import load_file

    from checkpoints import write_dflash, write_qwen3
    from dflash_kernels.model import load

    target = write_qwen3(tmp_path / "t", layers=3)
    drafter = write_dflash(tmp_path / "d", target, target_layer_ids=(0, 2, 0))
    fc = load_file(str(drafter / "model.safetensors"))["fc.weight"].float()
    h = fc.shape[1] // 3
    assert T.merge_repeated_taps(drafter) == [0, 2]
    assert json.loads((drafter / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]
    merged = load_file(str(drafter / "model.safetensors"))["fc.weight"]
    want = torch.cat([fc[:, :h] + fc[:, 2 * h:], fc[:, h:2 * h]], dim=1).to(torch.bfloat16)
    assert torch.equal(merged, want)
    engine = load(target, drafter)
    ids = engine.generate([5, 9, 11], 12, num_speculative_tokens=4, ignore_eos=True).token_ids
    assert ids == engine.generate([5, 9, 11], 12, num_speculative_tokens=0, ignore_eos=True).token_ids


def test_drafter_data_final_states_give_the_targets_choices_and_samples_a_fraction(tiny_pair):
    """The stored final-normed states are the target's next-token logits (its LM head on them picks
    each greedy row's next token), and a `sampled` fraction of the rows is drawn at a temperature:
    those leave the greedy path somewhere, reproducibly for a seed."""
    out, _, _ = tiny_pair
    target = T.load_torch_target(out / "target")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 500, n).tolist() for n in (4, 7, 5, 9, 6, 8, 3, 10)]
    data = T.generate_drafter_data(target, prompts, 12, [0, 2], batch=4, quiet=True, sampled=0.5,
                                   temperature=1.5, seed=3)
    again = T.generate_drafter_data(target, prompts, 12, [0, 2], batch=4, quiet=True, sampled=0.5,
                                    temperature=1.5, seed=3)
    assert torch.equal(data["tokens"], again["tokens"]) and torch.equal(data["sampled"], again["sampled"])
    assert 0 < int(data["sampled"].sum()) < len(prompts)
    assert data["final"].shape == (len(prompts), data["tokens"].shape[1], target.cfg["hidden_size"])
    left_greedy = 0
    for i, p in enumerate(prompts):
        n = int(data["length"][i])
        with torch.no_grad():
            choice = target.lm_head(data["final"][i, len(p) - 1: n - 1].float()).argmax(-1)
        follows = choice == data["tokens"][i, len(p): n]
        if bool(data["sampled"][i]):
            left_greedy += int(not follows.all())
        else:  # bf16 states: a near tie may flip, the rest is the target's own choice
            assert follows.float().mean() >= 0.9
    assert left_greedy >= 1
    with pytest.raises(ValueError, match="sampled"):
        T.generate_drafter_data(target, prompts, 4, [0], quiet=True, sampled=1.5)


def test_drafter_distills_from_the_target_distribution(tiny_pair, tmp_path):
    out, _, _ = tiny_pair
    kw = dict(steps=20, layers=2, batch=4, anchors=4, prompt_len=16, new_tokens=40, n_sequences=32, lr=3e-3,
              quiet=True)
    res = T.train_drafter(tmp_path / "kd", out / "target", distill=0.5, sampled=0.5, **kw)
    assert res["distill"] == 0.5 and res["sampled"] == 0.5
    assert 1.0 <= res["eval_tau_estimate_t0.7"] <= 16.0
    losses = _losses(tmp_path / "kd" / "train_log.jsonl")
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    data = torch.load(tmp_path / "kd" / "drafter_data.pt")
    assert data["sampled_fraction"] == 0.5 and "final" in data
    with pytest.raises(ValueError, match="delete it to regenerate"):  # the data was made greedy-and-sampled
        T.train_drafter(tmp_path / "kd", out / "target", distill=0.5, sampled=0.0, **kw)
    with pytest.raises(ValueError, match="distill"):
        T.train_drafter(tmp_path / "kd2", out / "target", distill=1.5, **kw)


def test_drafter_data_resumes_from_its_checkpoint_as_if_never_interrupted(tiny_pair, tmp_path):
    out, _, _ = tiny_pair
    target = T.load_torch_target(out / "target")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, 500, n).tolist() for n in (4, 7, 5, 9, 6, 8)]
    kw = dict(batch=2, quiet=True, sampled=0.5, temperature=1.5, seed=4)
    whole = T.generate_drafter_data(target, prompts, 8, [0, 2], **kw)

    class Counted:  # the target, counting batches (prompt forwards); stopped at stop_at (Ctrl-C)
        cfg = target.cfg

        def __init__(self, stop_at=None):
            self.prefills, self.stop_at = 0, stop_at

        def new_cache(self, *a):
            return target.new_cache(*a)

        def parameters(self):
            return target.parameters()

        def __call__(self, x, cache=None, **a):
            if cache.length == 0:
                self.prefills += 1
                if self.prefills == self.stop_at:
                    raise KeyboardInterrupt
            return target(x, cache=cache, **a)

    ckpt = tmp_path / "partial.pt"
    with pytest.raises(KeyboardInterrupt):
        T.generate_drafter_data(Counted(stop_at=3), prompts, 8, [0, 2], checkpoint=ckpt, checkpoint_every_s=0.0, **kw)
    assert torch.load(ckpt)["done"] == 4
    counted = Counted()
    resumed = T.generate_drafter_data(counted, prompts, 8, [0, 2], checkpoint=ckpt, **kw)
    assert counted.prefills == 1  # only the batch that was not done
    for k in ("tokens", "length", "prompt_len", "sampled"):
        assert torch.equal(resumed[k], whole[k]), k
    torch.testing.assert_close(resumed["feats"].float(), whole["feats"].float())
    with pytest.raises(ValueError, match="another run"):  # other settings never mix with a partial file
        T.generate_drafter_data(target, prompts, 9, [0, 2], checkpoint=ckpt, **kw)


def test_cached_forward_equals_the_whole_sequence(tiny_pair):
    """Prefill then one token at a time through the in-place KVCache gives the logits and taps of one
    forward over the whole sequence, left padding included."""
    out, _, _ = tiny_pair
    target = T.load_torch_target(out / "target")
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([0, 3])
    with torch.no_grad():
        whole, taps, _ = target(ids, taps=[1], pad=pad)
        cache = target.new_cache(2, 12)
        logits, tapped, cache = target(ids[:, :8], cache=cache, taps=[1], pad=pad, last_only=True)
        torch.testing.assert_close(logits[:, 0], whole[:, 7])
        for j in range(8, 12):
            logits, tapped, cache = target(ids[:, j:j + 1], cache=cache, taps=[1], pad=pad)
            torch.testing.assert_close(logits[:, 0], whole[:, j], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tapped[0][:, 0], taps[0][:, j], rtol=1e-5, atol=1e-5)
        assert cache.length == 12
        with pytest.raises(ValueError, match="max_len 12"):
            target(ids[:, :1], cache=cache)


def test_drafter_trains_over_a_drafting_vocabulary(tiny_pair, tmp_path):
    from dflash_kernels.model import draft_vocab as dv

    out, _, _ = tiny_pair
    kw = dict(steps=12, layers=2, batch=4, anchors=4, prompt_len=16, new_tokens=40, n_sequences=32, lr=3e-3,
              quiet=True, distill=0.5)
    full = T.train_drafter(tmp_path / "full", out / "target", **kw)
    V = json.loads((out / "target" / "config.json").read_text())["vocab_size"]
    every = tmp_path / "every.json"
    dv.write(every, range(V), vocab_size=V, source="test", tokens_counted=0)
    same = T.train_drafter(tmp_path / "every", out / "target", draft_vocab=str(every), **kw)
    # the whole vocabulary as a drafting vocabulary is the unrestricted run, step for step
    assert _losses(tmp_path / "every" / "train_log.jsonl") == _losses(tmp_path / "full" / "train_log.jsonl")
    assert same["draft_vocab"] == V and full["draft_vocab"] is None
    assert same["eval_tau_estimate_t0.7"] == full["eval_tau_estimate_t0.7"]

    measured = T.train_drafter(tmp_path / "m", out / "target", draft_vocab="measure", draft_vocab_min_count=3, **kw)
    ids = dv.read(tmp_path / "m" / dv.FILE, V)
    data = torch.load(tmp_path / "m" / "drafter_data.pt")
    n_eval = max(1, data["tokens"].shape[0] // 16)
    counts = torch.zeros(V, dtype=torch.int64)
    for r in range(n_eval, data["tokens"].shape[0]):
        counts += torch.bincount(data["tokens"][r, int(data["prompt_len"][r]): int(data["length"][r])], minlength=V)
    eos = json.loads((out / "target" / "config.json").read_text())["eos_token_id"]
    expect = set(torch.nonzero(counts >= 3).flatten().tolist()) | set(eos if isinstance(eos, list) else [eos])
    assert set(ids.tolist()) == expect and measured["draft_vocab"] == len(ids) < V
    assert np.isfinite(measured["eval_loss"]) and 1.0 <= measured["eval_tau_estimate"] <= 16.0
    # the drafter directory carries its vocabulary, which the inference layer reads
    from dflash_kernels import model as M

    eng = M.load(out / "target", tmp_path / "m")
    assert np.array_equal(eng.drafter.draft_ids, ids)
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        T.train_drafter(tmp_path / "bad", out / "target", draft_vocab=str(bad), **kw)
    with pytest.raises(ValueError, match="min_count"):
        T.train_drafter(tmp_path / "bad2", out / "target", draft_vocab="measure", draft_vocab_min_count=0, **kw)
