"""Serving several threads and loading defensively: Engine.clone over shared weights,
load(mmap=False) against files changed under a running process, load(check_weights=True)."""

import subprocess
import sys
import textwrap
import threading

import pytest
from safetensors.torch import load_file, save_file

import dflash_kernels.model as dm
from checkpoints import write_dflash, write_qwen3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    target = write_qwen3(root / "target", layers=3, hot_tokens=6)
    drafter = write_dflash(root / "drafter", target, target_layer_ids=(0, 2), block_size=8)
    return target, drafter


def test_clones_share_weights_and_run_concurrently(pair):
    engine = dm.load(*pair, max_len=256, n_threads=1)
    clones = [engine.clone() for _ in range(3)]
    assert all(c.target.layers is engine.target.layers and c.drafter.layers is engine.drafter.layers
               for c in clones)  # the weights are not copied
    prompts = [[3 + i, 40 + i, 7] for i in range(4)]
    expected = [engine.generate(p, 48, ignore_eos=True).token_ids for p in prompts]
    results, errors = {}, []

    def serve(i, eng):
        try:
            for rep in range(3):
                results[(i, rep)] = eng.generate(prompts[i], 48, ignore_eos=True).token_ids
        except Exception as err:  # reported below: a thread's exception would otherwise vanish
            errors.append(err)

    threads = [threading.Thread(target=serve, args=(i, e)) for i, e in enumerate([engine, *clones])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[(i, rep)] == expected[i] for i in range(4) for rep in range(3))


def test_clone_keeps_its_own_metrics_and_settings(pair):
    engine = dm.load(*pair, max_len=128, n_threads=2)
    twin = engine.clone(n_threads=1)
    twin.generate([5, 6], 8, ignore_eos=True)
    assert len(twin.history) == 1 and not engine.history
    assert twin.ops.kw["n_threads"] == 1 and engine.ops.kw["n_threads"] == 2


def test_mmap_false_survives_the_file_being_truncated(pair, tmp_path):
    # In a child process: a memory-mapped checkpoint truncated under a loaded model faults with SIGBUS
    # (inherent to mapping); mmap=False read the file into memory and keeps generating.
    import shutil

    target = shutil.copytree(pair[0], tmp_path / "target")
    script = textwrap.dedent(f"""
        import os, dflash_kernels.model as dm
        engine = dm.load({str(target)!r}, max_len=64, mmap=False, fuse_weights=False)
        before = engine.generate([5, 6, 7], 8, ignore_eos=True).token_ids
        os.truncate({str(target / "model.safetensors")!r}, 16)
        after = engine.generate([5, 6, 7], 8, ignore_eos=True).token_ids
        print(before == after)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"


def test_check_weights_names_the_non_finite_tensor(pair, tmp_path):
    import shutil

    target = shutil.copytree(pair[0], tmp_path / "target")
    tensors = load_file(str(target / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] = float("inf")
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(dm.WeightsError, match=rf"model.safetensors.*{name}.*\(3, 5\)"):
        dm.load(target, check_weights=True)
    dm.load(pair[0], pair[1], check_weights=True)  # clean files pass
