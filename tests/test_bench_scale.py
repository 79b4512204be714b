"""bench/scale.py's own arithmetic (the prefill FLOP count, the best-k projection) and one run of it
on the shipped pair, prefill included."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import scale  # noqa: E402
from shapes import ModelShape  # noqa: E402


def test_prefill_flops_counts_projections_and_causal_attention():
    s = ModelShape("tiny", hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)
    per_layer = 8 * (2 + 2 * 1) * 4 + 8 * 2 * 4 + 3 * 8 * 16  # q,k,v; o; gate, up, down
    pairs = 3 * 4 / 2  # 3 rows under the causal mask: 1 + 2 + 3 (query, key) pairs
    assert scale.prefill_flops(s, 3) == 2 * 3 * 2 * per_layer + 2 * 2 * 2 * pairs * 2 * 4


def test_best_k_projection_fits_tau_and_takes_the_best_rate():
    # costs that make k = 4 the best rate for a 0.8-ish acceptance: flat rounds, then expensive ones
    res = {"t_ar_s": 1.0, "k": {k: {"t_draft_s": 0.5, "t_verify_s": 1.0 + (0 if k <= 4 else 2.0 * (k - 4)),
                                    "t_accept_s": 0.0} for k in range(1, 16)}}
    out = scale.best_k_projection(res, 6.5)
    a = out["alpha"]
    assert sum(a ** j for j in range(16)) == pytest.approx(6.5, rel=1e-9)
    assert out["k"] == 4
    assert out["speedup"] == pytest.approx(sum(a ** j for j in range(5)) / 1.5)


def test_scale_runs_on_the_shipped_pair_with_prefill(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert scale.main(["--target", str(ROOT / "model/default/target"), "--drafter", str(ROOT / "model/default/drafter"),
                       "--ks", "1,3", "--repeats", "1", "--prefill", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    pf = res["prefill"]
    assert pf["tokens"] == 40 and pf["t_target_s"] > 0 and pf["gflops"] > 0
    assert pf["ttft_s"] == pytest.approx(pf["t_target_s"] + pf["t_draft_context_s"] + pf["t_first_token_s"])
    assert res["best_k_projected"]["k"] in (1, 3) and res["peak_fma_gflops"] > 0
    assert "prefill 40 tokens: time to first token" in capsys.readouterr().out


def test_split_timing_of_a_hybrid_pair_times_the_forward_and_the_head_apart(tmp_path):
    """The layers-scaled path (--layers) reads the forward without the LM head and the head's greedy
    pass, timed in turn, and the streaming read around the AR timings."""
    s = scale.HybridShape("tiny", 64, 128, 4, 2, 1, 32, 248320, lin_k_heads=2, lin_v_heads=2, lin_k_dim=16,
                          lin_v_dim=16, draft_heads=2, draft_kv_heads=1, draft_head_dim=32)
    t_dir, d_dir = scale.write_pair(tmp_path, s, draft_layers=2)
    res = scale.measure(t_dir, d_dir, n_threads=1, context=16, repeats=1, ks=[3], split_head=True,
                        read_gbs=lambda: 1.0)
    r = res["k"][3]
    assert res["t_fwd_ar_s"] > 0 and res["t_head_ar_s"] > 0 and r["t_fwd_verify_s"] > 0 and r["t_head_verify_s"] > 0
    assert res["stream_read_gbs_around_ar"] == (1.0, 1.0)
