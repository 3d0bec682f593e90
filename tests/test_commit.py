"""dpjax.commit: a commit restored on the same and on a smaller mesh is the committed
state bit for bit (against the numpy arrays it was made from); the newest step every
rank committed is the one restored; commits are atomic and the last two are kept; a
process whose own commit is lost restores from its neighbour's copy (two processes)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.commit import Committer, CommitError, decode

from conftest import read_losses


def _state(mesh, arrays, specs):
    return {k: jax.device_put(arrays[k], NamedSharding(mesh, specs[k])) for k in arrays}


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "b": rng.standard_normal((4,)).astype(jax.numpy.bfloat16),
            "key": rng.integers(0, 2**32, (2,), dtype=np.uint32),
            "count": np.int32(7)}


SAVE_SPECS = {"w": P("data", "model"), "b": P("model"), "key": P(), "count": P()}


@pytest.mark.parametrize("spec,count,specs", [
    ("4x2", 8, SAVE_SPECS),                                                # the same mesh and layout
    ("2x2", 4, {"w": P(None, "data"), "b": P("data"), "key": P(), "count": P()}),  # smaller, resharded
    ("1x1", 1, {"w": P(), "b": P(), "key": P(), "count": P()}),
])
def test_restore_equals_what_was_committed(tmp_path, spec, count, specs):
    arrays = _arrays()
    devs = jax.devices()
    saved = _state(dpjax.make_mesh("4x2", devs[:8]), arrays, SAVE_SPECS)
    c = Committer(str(tmp_path), "h0", 0, 1)
    c.commit(5, saved, {"cursor": 80, "record": {"model": "m"}})
    c.close()
    target = dpjax.make_mesh(spec, devs[:count])
    template = _state(target, {k: np.zeros_like(v) for k, v in arrays.items()}, specs)
    state, meta = Committer(str(tmp_path), "h0", 0, 1, fresh=False).restore(template, expect={"model": "m"})
    assert (meta["step"], meta["cursor"], meta["world"]) == (5, 80, 1)
    for k, v in arrays.items():
        assert state[k].sharding == template[k].sharding
        assert state[k].dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(state[k]), v)  # bit for bit (bf16 included)


def test_newest_step_kept_atomic_and_pruned(tmp_path):
    mesh = dpjax.make_mesh("4x2", jax.devices()[:8])
    c = Committer(str(tmp_path), "h0", 0, 1)
    for step in range(1, 5):
        c.commit(step, _state(mesh, _arrays(step), SAVE_SPECS), {"cursor": step})
    c.flush()
    own = tmp_path / "h0" / "own" / "r0"
    assert sorted(os.listdir(own)) == ["s000000003_w1.bin", "s000000004_w1.bin"]  # the last two, no temp files
    assert c.completed == 4
    meta, _ = decode((own / "s000000004_w1.bin").read_bytes())
    assert meta["cursor"] == 4
    template = _state(mesh, {k: np.zeros_like(v) for k, v in _arrays().items()}, SAVE_SPECS)
    state, meta = c.restore(template)
    assert meta["step"] == 4
    np.testing.assert_array_equal(np.asarray(state["w"]), _arrays(4)["w"])
    c.close()


def test_an_incomplete_newest_step_is_not_restored(tmp_path):
    """Rank 1 of a two-process job committed step 3 only, rank 0 steps 3 and 4: step 3
    is the newest every rank has (read by one process: every host's folder is its)."""
    mesh = dpjax.make_mesh("4x2", jax.devices()[:8])
    ones = {"w": P(), "b": P(), "key": P(), "count": P()}  # replicated: rank 0's pieces hold everything
    c = Committer(str(tmp_path), "h0", 0, 1)
    for step in (3, 4):
        c.commit(step, _state(mesh, _arrays(step), ones), {"cursor": step})
    c.close()
    for f in os.listdir(tmp_path / "h0" / "own" / "r0"):  # as if a world of 2: rank 1 holds no pieces
        os.rename(tmp_path / "h0" / "own" / "r0" / f, tmp_path / "h0" / "own" / "r0" / f.replace("_w1", "_w2"))
    empty = Committer(str(tmp_path / "x"), "h1", 0, 1)
    empty.commit(3, {}, {"cursor": 3})
    empty.close()
    os.makedirs(tmp_path / "h1" / "own" / "r1")
    os.rename(tmp_path / "x" / "h1" / "own" / "r0" / "s000000003_w1.bin",
              tmp_path / "h1" / "own" / "r1" / "s000000003_w2.bin")
    template = _state(mesh, {k: np.zeros_like(v) for k, v in _arrays().items()}, ones)
    with pytest.raises(CommitError, match="another state structure"):  # rank 1's file says {} (no leaves)
        Committer(str(tmp_path), "h0", 0, 1, fresh=False).restore(template)
    os.remove(tmp_path / "h1" / "own" / "r1" / "s000000003_w2.bin")
    with pytest.raises(CommitError, match=r"newest, step 4, has ranks \[0\] of 2"):
        Committer(str(tmp_path), "h0", 0, 1, fresh=False).restore(template)


# ---------------------------------------------------------------------------------------
# two real processes: the neighbour copy


def _train(corpus, *extra):
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
            "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", "--mesh", "4x2", "--optimizer", "adamw", *extra]


def _launch(*args):
    cmd = [sys.executable, "-m", "dpjax.launch", "-n", "2", "--devices-per-process", "4", "--",
           sys.executable, "-m", "dpjax.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_lost_own_commit_restores_from_the_neighbour(corpus, tmp_path):
    straight, path, root = tmp_path / "s.jsonl", tmp_path / "m.jsonl", tmp_path / "commits"
    r = _launch(*_train(corpus, "--steps", "8", "--metrics", str(straight)))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _launch(*_train(corpus, "--steps", "5", "--metrics", str(path), "--commit-dir", str(root)))
    assert r.returncode == 0, r.stderr[-2000:]
    # one host here: both processes' folders are "local"; rank 0 keeps rank 1's copy and back
    assert sorted(os.listdir(root / "local" / "peer")) == ["r0", "r1"]
    import shutil

    shutil.rmtree(root / "local" / "own" / "r1")
    r = _launch(*_train(corpus, "--steps", "8", "--metrics", str(path), "--commit-dir", str(root), "--resume"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "restored step 5 from commits" in r.stdout and "1: 'local/peer/r1/s000000005_w2.bin'" in r.stdout
    assert read_losses(path) == read_losses(straight)  # bit for bit
