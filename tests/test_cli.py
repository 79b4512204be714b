"""The `dflash` command line end to end on tiny checkpoints written by the tests."""

import json

import pytest

from checkpoints import write_dflash, write_qwen3
from dflash_kernels.model.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = write_qwen3(root / "target", hot_tokens=24)
    drafter = write_dflash(root / "drafter", target)
    return target, drafter


def test_generate_streams_text(pair, capsys):
    target, drafter = pair
    rc = main(["generate", "hello world", "--target", str(target), "--drafter", str(drafter),
               "--max-new-tokens", "10"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("hello world") and "tok/s" in captured.err


def test_generate_and_bench_take_a_bf16_cache(pair, tmp_path, capsys, monkeypatch):
    """--kv-dtype reaches the engine (and bench.json); greedy DFlash stays identical to AR with it."""
    from dflash_kernels.model import cli

    target, drafter = pair
    loaded = []
    real_load = cli._load
    monkeypatch.setattr(cli, "_load", lambda args: loaded.append(real_load(args)) or loaded[-1])
    rc = main(["generate", "hello world", "--target", str(target), "--drafter", str(drafter),
               "--max-new-tokens", "10", "--kv-dtype", "bfloat16", "--precision", "medium"])
    assert rc == 0 and capsys.readouterr().out.startswith("hello world")
    assert loaded[-1].kv_dtype == "bfloat16"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hello", "world of tokens"]))
    rc = main(["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
               "--max-new-tokens", "12", "--temperatures", "0", "--kv-dtype", "bfloat16", "--precision", "medium",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["kv_dtype"] == "bfloat16" and report["greedy_identical"] == {"0.0": True}


def test_generate_bad_target_is_a_clear_error(tmp_path, capsys):
    rc = main(["generate", "x", "--target", str(tmp_path / "nope")])
    assert rc == 2
    assert "nope" in capsys.readouterr().err


def test_bench_writes_json_markdown_and_plots(pair, tmp_path, capsys):
    target, drafter = pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hello", "world of tokens", "abc abc"]))
    rc = main(["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
               "--max-new-tokens", "12", "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    modes = {(r["mode"], r["temperature"]) for r in report["rows"]}
    assert modes == {("autoregressive", 0.0), ("dflash", 0.0), ("autoregressive", 0.7), ("dflash", 0.7)}
    assert report["greedy_identical"] == {"0.0": True}
    for png in ("tau_histogram.png", "per_position_acceptance.png", "throughput_vs_k.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000
    assert "| dflash |" in capsys.readouterr().out
    assert report["k_sweep"][-1]["k"] == "auto"  # the sweep ends with the adaptive choice
    # what the figures depend on: machine, tier, backend, threads, versions
    assert report["threads"] >= 1 and report["backend"] in ("cython", "numba", "torch", "auto")
    assert report["machine"]["cpu"] and report["versions"]["torch"]


def test_bench_at_a_sampling_temperature_only_writes_its_plots(pair, tmp_path, capsys, monkeypatch):
    """Without T = 0 among the temperatures there is no greedy autoregressive row for the (greedy)
    k sweep's plot to draw against: the plot goes without it (it raised StopIteration). Without -k
    the sampled row drafts what `dflash generate` drafts unseeded (untuned: auto), although the
    bench seeds its runs."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))  # no tuned k
    target, drafter = pair
    rc = main(["bench", "--target", str(target), "--drafter", str(drafter), "--n-prompts", "2",
               "--max-new-tokens", "8", "--temperatures", "0.7", "--seed", "0", "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert {(r["mode"], r["temperature"]) for r in report["rows"]} == {("autoregressive", 0.7), ("dflash", 0.7)}
    assert next(r for r in report["rows"] if r["mode"] == "dflash")["num_speculative_tokens"] == "auto"
    assert (tmp_path / "out" / "per_position_acceptance.png").stat().st_size > 1000


def test_generate_and_bench_take_k_auto(pair, tmp_path, capsys):
    target, drafter = pair
    rc = main(["generate", "hello world", "--target", str(target), "--drafter", str(drafter),
               "--max-new-tokens", "10", "-k", "auto"])
    assert rc == 0 and capsys.readouterr().out.startswith("hello world")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hello", "world of tokens"]))
    rc = main(["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
               "--max-new-tokens", "12", "--temperatures", "0", "-k", "auto", "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    row = next(r for r in report["rows"] if r["mode"] == "dflash")
    assert row["num_speculative_tokens"] == "auto" and report["greedy_identical"] == {"0.0": True}
    assert sum(row["k_histogram"].values()) > 0


def test_tune_stores_best_k_and_generate_uses_it(pair, tmp_path, monkeypatch):
    from dflash_kernels.model import load
    from dflash_kernels.model.benchmark import run_tune, tuned_num_speculative_tokens

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    target, drafter = pair
    eng = load(target, drafter)
    result = run_tune(eng, prompts=["hello", "abc"], max_new_tokens=10, ks=[1, 3, 5], max_spread=float("inf"))
    best = max(result["sweep"], key=lambda s: s["tokens_per_second"])
    ar = max(result["ar_tokens_per_second"], result["ar_tokens_per_second_after"])
    assert result["best_k"] == (best["k"] if best["tokens_per_second"] > ar else 0)
    assert result["stored_in"] == str(tmp_path / "tuned.json")
    assert tuned_num_speculative_tokens(eng) == result["best_k"]
    # the Python API drafts the tuned k by default, as the CLI does
    assert eng.default_speculative_tokens() == result["best_k"]
    m = eng.generate("hello", 12, ignore_eos=True).metrics
    assert max(m.drafted, default=0) == result["best_k"]


def _fake_tune(monkeypatch, tps):
    """run_tune over fake runs: tokens/s per k from tps(k, call index)."""
    from types import SimpleNamespace

    from dflash_kernels.model import benchmark

    calls = []

    def fake_run(eng, prompts, n, temperature, k, seed):
        return [SimpleNamespace(metrics=SimpleNamespace(k=k))]

    def fake_aggregate(metrics):
        k = next(iter(metrics)).k
        calls.append(k)
        return SimpleNamespace(tokens_per_second=tps(k, len(calls)), tau=1.0, acceptance_rate=0.0)

    monkeypatch.setattr(benchmark, "_run", fake_run)
    monkeypatch.setattr(benchmark, "aggregate", fake_aggregate)
    ops = SimpleNamespace(tier=None, governor=None, kw={"n_threads": 2, "backend": "torch"}, precision="highest")
    eng = SimpleNamespace(drafter=SimpleNamespace(ops=ops), default_num_speculative_tokens=15,
                          generate=lambda *a, **k: None, ops=ops)
    return benchmark, eng


def test_tune_stores_zero_when_no_k_beats_autoregressive(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    benchmark, eng = _fake_tune(monkeypatch, lambda k, i: 100.0 if k == 0 else 60.0 + k)
    result = benchmark.run_tune(eng, prompts=["a"], ks=[1, 2, 3])
    assert result["best_k"] == 0 and "no k beat autoregressive" in result["warnings"][0]
    assert benchmark.tuned_num_speculative_tokens(eng) == 0


def test_tune_refuses_to_store_a_run_under_load(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    # autoregressive at 100 tokens/s before the sweep, 60 after it: the machine got busy
    benchmark, eng = _fake_tune(monkeypatch, lambda k, i: (100.0 if i == 1 else 60.0) if k == 0 else 150.0)
    result = benchmark.run_tune(eng, prompts=["a"], ks=[1, 2])
    assert result["best_k"] == 1 and result["stored_in"] is None
    assert "not stored" in result["warnings"][0]
    assert not (tmp_path / "tuned.json").exists()


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend cython" in out and "default" in out


def test_validate_passes_on_this_machine(capsys):
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and " 0 failed" in out


@pytest.mark.parametrize("argv,match", [
    (["tune", "--max-k", "0"], "--max-k must be an int >= 1"),
    (["bench", "--n-prompts", "0"], "--n-prompts must be an int >= 1"),
    (["tune", "--n-prompts", "0"], "--n-prompts must be an int >= 1"),
    (["generate", "x", "-k", "fast"], "-k must be an int >= 0 or 'auto'"),
    (["bench", "-k", "-1"], "-k must be an int >= 0 or 'auto'"),
])
def test_cli_bad_counts_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_cli_paths_checked_before_work(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert main(["generate", "x", "--target", str(f)]) == 2
    assert "not a checkpoint directory (it is a file" in capsys.readouterr().err
    assert main(["bench", "--out", "/proc/nope"]) == 2
    assert "--out /proc/nope: cannot write there" in capsys.readouterr().err


def test_cli_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 8)" in out and "(default: highest)" in out
