"""The fault suite: the hostile-user probe's root causes (the issue "Nothing crashes"), as one run.

Each case is the probe's own example of a root cause, with the outcome it must now have: a clear
ValueError / TypeError / RuntimeError naming what was wrong, raised by this library's own checks (not
from deep inside numpy or torch), or the correct result. All cases run in
one child process, which reports each outcome as a JSON line before and after it runs: a segfault or
an abort fails the test and names the case it happened in, instead of killing the test run.
"""

import json
import subprocess
import sys

import pytest

# (name, code, expected): code runs with np, dk, load_default, the stdlib pair's Engine `eng`, its
# directories `target` / `drafter` and a scratch directory `tmp` in scope; expected is an exception
# type name and a pattern its message must contain, or "ok" (then `assert`s in the code check the result)
CASES = [
    # 1. crash: thread counts far above the machine
    *[(f"n_threads=10**6, {b}", f"dk.rms_norm(x, w, n_threads=10**6, backend='{b}')", ("ValueError", "n_threads"))
      for b in ("cython", "numba", "torch")],
    ("denoise_block n_threads=10**6", "dk.denoise_block(x, big, n_threads=10**6)", ("ValueError", "n_threads")),
    ("load n_threads=10**6", "load_default('stdlib', n_threads=10**6)", ("ValueError", "n_threads")),
    ("DFLASH_NUM_THREADS=1000000", "os.environ['DFLASH_NUM_THREADS'] = '1000000'\n"
     "try:\n    dk.rms_norm(x, w)\nfinally:\n    del os.environ['DFLASH_NUM_THREADS']",
     ("ValueError", "DFLASH_NUM_THREADS")),
    ("n_threads=2**70", "dk.rms_norm(x, w, n_threads=2**70)", ("ValueError", "n_threads")),
    ("np.int64 threads accepted", "assert dk.rms_norm(x, w, n_threads=np.int64(1)).shape == x.shape", "ok"),
    # 2. silent: one Engine from two places at once
    ("generate inside its own stream", "eng.generate([5, 6, 7], 4, ignore_eos=True, "
     "stream=lambda ids, text: eng.generate([1, 2], 1))", ("RuntimeError", "already running")),
    ("two threads, one Engine", "import threading\nerr = []\nstarted, release = threading.Event(), threading.Event()\n"
     "def slow(ids, text):\n    started.set(); release.wait(5)\n"
     "t = threading.Thread(target=lambda: eng.generate([5, 6, 7], 3, ignore_eos=True, stream=slow))\n"
     "t.start(); started.wait(5)\n"
     "try:\n    eng.generate([1, 2], 1)\nexcept RuntimeError as e:\n    err.append(str(e))\n"
     "release.set(); t.join()\nassert err and 'already running' in err[0], err", "ok"),
    # 3. silent: temperatures too small to invert sample greedily, on every backend
    *[(f"temperature 3e-39, {b}", f"assert np.array_equal(dk.denoise_block(x, big, temperature=3e-39, generator=0, "
       f"backend='{b}'), dk.denoise_block(x, big, backend='{b}'))", "ok") for b in ("cython", "numba", "torch")],
    ("generate at temperature 1e-40", "assert eng.generate([5, 6, 7], 6, temperature=1e-40, seed=1, "
     "ignore_eos=True).token_ids == eng.generate([5, 6, 7], 6, ignore_eos=True).token_ids", "ok"),
    # 4. silent: non-finite config values refused at load, naming the file and key
    ("rms_norm_eps NaN", "bad_config('rms_norm_eps', float('nan'))", ("ConfigError", "rms_norm_eps")),
    ("rope_theta Infinity", "bad_config('rope_theta', float('inf'))", ("ConfigError", "rope_theta")),
    ("rms_norm_eps 1e300", "bad_config('rms_norm_eps', 1e300)", ("ConfigError", "rms_norm_eps")),
    # 5. silent: NaN weights raise on the autoregressive path as on the DFlash path
    ("NaN lm_head, autoregressive", "nan_engine().generate([5, 6, 7], 3, num_speculative_tokens=0)",
     ("ValueError", "not finite")),
    ("NaN weights, check_weights=True", "nan_engine(check_weights=True)", ("WeightsError", "non-finite value")),
    # 6. backends disagree: an all -inf row at temperature 0 raises on every backend
    *[(f"all -inf row, {b}", f"dk.rejection_sample(np.array([[1]]), np.full((1, 2, 4), -np.inf, np.float32), "
       f"temperature=0.0, uniforms=np.full((1, 2, 2), 0.5), backend='{b}')", ("ValueError", "no finite logit"))
      for b in ("cython", "numba", "torch")],
    # 7. silent: bytes as a stop string
    ("stop=b'\\n'", "eng.generate('hello', 4, stop=b'\\n')", ("TypeError", "stop")),
    # 8. late or unclear errors, now named up front
    ("window=2**70 is no window", "assert np.array_equal(dk.cached_attention(q, k, v, window=2**70), "
     "dk.cached_attention(q, k, v))", "ok"),
    ("seed 'abc'", "eng.generate([5], 2, temperature=0.7, seed='abc')", ("ValueError", "seed")),
    ("seed 1.5", "eng.generate([5], 2, temperature=0.7, seed=1.5)", ("ValueError", "seed")),
    ("seed -1 at T=0", "eng.generate([5], 2, seed=-1)", ("ValueError", "seed")),
    ("eps=None", "dk.rms_norm(x, w, eps=None)", ("TypeError", "eps")),
    ("offset='a'", "dk.rms_norm(x, w, offset='a')", ("TypeError", "offset")),
    ("scale='x'", "dk.cached_attention(q, k, v, scale='x')", ("TypeError", "scale")),
    ("block_size=2**62", "dk.make_draft_block(5, 99, 2**62)", ("ValueError", "block_size")),
    ("stop=1.5", "eng.generate([5], 2, stop=1.5)", ("TypeError", "stop")),
    ("stream=5", "eng.generate([5], 2, stream=5)", ("TypeError", "stream")),
    ("temperature=True", "eng.generate([5], 2, temperature=True)", ("ValueError", "temperature")),
    ("prefill_chunk='x'", "load_default('stdlib', prefill_chunk='x')", ("ValueError", "prefill_chunk")),
    ("backend='nonsense'", "load_default('stdlib', backend='nonsense')", ("ValueError", "backend")),
    ("a directory where config.json goes", "d = tmp / 'dir_config'; shutil.copytree(target, d)\n"
     "(d / 'config.json').unlink(); (d / 'config.json').mkdir()\nload(d)", ("ConfigError", "config.json")),
    ("a sparse tensor operand", "import torch\ndk.rms_norm(torch.from_numpy(x).to_sparse(), w)",
     ("TypeError", "x must be a dense (strided) tensor")),
    ("a negative view operand", "import torch\ndk.rms_norm(torch._neg_view(torch.from_numpy(-x)), w)",
     ("ValueError", "x is a negative view")),
    ("a negative view as out", "import torch\n"
     "dk.apply_rope(q, np.arange(2), 1e4, out=torch._neg_view(torch.zeros(q.shape)))",
     ("ValueError", "out is a negative view")),
    # 9. SIGBUS after truncating a mapped file: mmap=False reads the weights into memory instead
    ("mmap=False survives truncation", "d = tmp / 'copy'; shutil.copytree(target, d)\n"
     "e = load(d, mmap=False)\nfor f in d.glob('*.safetensors'):\n    f.write_bytes(b'')\n"
     "assert len(e.generate([5, 6, 7], 3, ignore_eos=True).token_ids) == 3", "ok"),
]

RUNNER = r'''
import json, os, shutil, sys, tempfile, traceback
from pathlib import Path
import numpy as np
import dflash_kernels as dk
from dflash_kernels.model import load, load_default
from dflash_kernels.model.defaults import default_model_dirs

cases = json.loads(sys.argv[1])
import dflash_kernels.model
# where a clear error comes from: the library's own checks, not numpy's or torch's insides
ROOTS = (Path(dk.__file__).resolve().parent, Path(dflash_kernels.model.__file__).resolve().parent)
target, drafter = (Path(p) for p in default_model_dirs("stdlib"))
eng = load_default("stdlib", n_threads=1)
rng = np.random.default_rng(0)
x, w = rng.standard_normal((2, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
big = rng.standard_normal((50, 8), dtype=np.float32)
q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((2, 4, 8), (5, 2, 8), (5, 2, 8)))
tmp = Path(tempfile.mkdtemp())


def bad_config(key, value):
    d = tmp / f"config_{key}_{value}"
    shutil.copytree(target, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity as JSON writes them
    load(d)


def nan_engine(**opts):
    import torch
    from safetensors.torch import load_file, save_file
    d = tmp / f"nan_{len(list(tmp.iterdir()))}"
    shutil.copytree(target, d)
    for f in d.glob("*.safetensors"):
        tensors = load_file(f)
        for name in tensors:
            if "lm_head" in name or "embed_tokens" in name:
                tensors[name] = torch.full_like(tensors[name], float("nan"))
        save_file(tensors, f)
    return load(d, **opts)


for name, code in cases:
    print(json.dumps({"start": name}), flush=True)
    try:
        exec(code, dict(globals()))
        out = {"name": name, "outcome": "ok"}
    except AssertionError as err:
        out = {"name": name, "outcome": "AssertionError", "message": str(err)}
    except Exception as err:
        raised_in = Path(traceback.extract_tb(err.__traceback__)[-1].filename).resolve()
        out = {"name": name, "outcome": type(err).__name__, "message": str(err),
               "ours": any(root in raised_in.parents for root in ROOTS)}
    print(json.dumps(out), flush=True)
shutil.rmtree(tmp)
'''


@pytest.fixture(scope="module")
def outcomes():
    cases = [(name, code) for name, code, _ in CASES]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                          timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    if proc.returncode != 0:
        pytest.fail(f"the fault run died (exit {proc.returncode}) in case {started[-1] if started else None!r}:\n"
                    f"{proc.stderr[-3000:]}")
    return {line["name"]: line for line in lines if "name" in line}


@pytest.mark.parametrize("name,code,expected", CASES, ids=[c[0] for c in CASES])
def test_fault_case(outcomes, name, code, expected):
    got = outcomes[name]
    if expected == "ok":
        assert got["outcome"] == "ok", got
    else:
        kind, pattern = expected
        assert got["outcome"] == kind and pattern in got["message"], got
        assert got["ours"], f"raised from deep inside another library, not by a check of this one: {got}"
