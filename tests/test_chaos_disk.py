"""Commits onto a full or read-only disk, and a checkpoint of another run to --resume
(issue 51, item 4), as processes: one line, exit 2, the last good state kept; or, with
`--on-full-disk skip-commits`, the commit is skipped, said, and the run trains on.
The folders are small tmpfs mounts (test_full_disk's `mount`)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_full_disk import _fill, mount  # noqa: F401  (mount: the fixture)

from dpjax.recovery import full_disk


class Store:
    """jax.distributed's key-value client as far as full_disk uses it (a dict)."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, k, v):
        self.kv[k] = v

    def blocking_key_value_get(self, k, ms):
        return self.kv[k]


def test_one_refusal_anywhere_stops_every_process_at_the_same_commit():
    store = Store()
    # ranks 0, 1 and 3 wrote their commit of step 20; rank 2's met a full disk (its newest: 10)
    for rank in (0, 1, 3):
        store.key_value_set(f"dpjax/commit/full/0/30/{rank}", "")
    store.key_value_set("dpjax/commit/full/0/30/2", "20 10 No space left on device")
    said = [full_disk.agree(store, "0", 30, r, 4, None, 20) for r in (0, 1, 3)]
    assert said == [(2, 20, 10, "No space left on device")] * 3
    assert "commit of step 20 cannot be written on rank 2 (No space left on device)" in full_disk.line(said[0], "/c")
    assert "the newest kept is step 10" in full_disk.line(said[0], "/c")
    # every process wrote: nobody stops (each reads the others' answers once they are set)
    store = Store()
    for rank in range(3):
        store.key_value_set(f"dpjax/commit/full/1/8/{rank}", "")
    assert full_disk.agree(store, "1", 8, 0, 3, None, 6) is None
    assert full_disk.agree(None, "0", 8, 0, 1, (8, "Disk quota exceeded"), 6) == (0, 8, 6, "Disk quota exceeded")


def test_a_process_that_wrote_the_refused_step_removes_it(tmp_path):
    """After a refusal elsewhere, the step's own file and the neighbour copy held here go;
    the step before stays (every process then keeps the same steps)."""
    import jax

    from dpjax.recovery.commit import Committer

    c = Committer(str(tmp_path), "h0", 0, 1)
    c.peer = str(tmp_path / "h0" / "peer" / "r1")  # as a process of 2 hosts keeps its neighbour's copies
    os.makedirs(c.peer)
    for step in (10, 20):
        c.commit(step, {"w": jax.numpy.full((4,), float(step))}, {"cursor": step})
        c.flush()
        (tmp_path / "h0" / "peer" / "r1" / f"s{step:09d}_w1.bin").write_bytes(b"x")
    full_disk.drop(c, 20)
    c.close()
    assert sorted(os.listdir(c.own)) == sorted(os.listdir(c.peer)) == ["s000000010_w1.bin"]
    assert c.written is None


def _train(*extra):
    return [sys.executable, "-m", "dpjax.train", "--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads",
            "2", "--seq-len", "16", "--batch-size", "8", "--data", "synthetic", "--eval-every", "0", "--progress",
            "none", "--mesh", "8", *extra]


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_commits_onto_a_full_disk_stop_or_are_skipped(mount, tmp_path):  # noqa: F811
    # a first run: its compiled programs (copied beside the later runs' commits: loaded, not
    # compiled) and the size of one commit
    first = tmp_path / "first"
    r = _run(_train("--steps", "2", "--commit-dir", str(first), "--commit-every", "2", "--ckpt-dir",
                    str(tmp_path / "ck"), "--ckpt-every", "2"))
    assert r.returncode == 0, r.stderr[-3000:]
    size = os.path.getsize(first / "local" / "own" / "r0" / "s000000002_w1.bin")

    def disk():
        """A tmpfs commit folder holding the programs, with room for one commit, not two."""
        where = mount(4096)
        shutil.copytree(first / "local" / "programs", where / "c" / "local" / "programs")
        _fill(where, int(1.5 * size) // 1024)
        return where / "c"

    c = disk()  # (every run has a --ckpt-dir: the programs' key counts it, and the first run's are loaded)
    r = _run(_train("--steps", "6", "--commit-dir", str(c), "--commit-every", "2", "--ckpt-dir", str(tmp_path / "k1"),
                    "--ckpt-every", "100"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr == (f"error: the commit of step 4 cannot be written to {c}/local/own/r0 (No space left on "
                        "device); the newest kept is step 2\n")
    v = _run([sys.executable, "-m", "dpjax.recovery", "verify", str(c)])
    assert v.returncode == 0 and "step 2" in v.stdout.splitlines()[-1], v.stdout + v.stderr

    c = disk()
    metrics = tmp_path / "m.jsonl"
    r = _run(_train("--steps", "6", "--commit-dir", str(c), "--commit-every", "2", "--on-full-disk",
                    "skip-commits", "--metrics", str(metrics), "--ckpt-dir", str(tmp_path / "k2"), "--ckpt-every",
                    "100"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"dpjax.recovery: the commit of step 4 cannot be written on rank 0 (No space left on device) to {c}; "
            "--on-full-disk skip-commits: skipped on every process, training goes on and the next commit is tried; "
            "the newest kept is step 2") in r.stderr
    assert "the commit of step 6 cannot be written on rank 0" in r.stderr  # the last, too (the disk stays full)
    with open(metrics) as fh:
        rows = [json.loads(line) for line in fh]
    assert sorted(x["step"] for x in rows if "loss" in x) == list(range(1, 7))  # trained on
    assert sorted(x["commit_step"] for x in rows if "commit_step" in x) == [2]
    assert sorted(os.listdir(c / "local" / "own" / "r0")) == ["s000000002_w1.bin"]  # no half-written file left


@pytest.mark.slow
def test_a_read_only_commit_dir_and_another_runs_checkpoint_are_one_line(mount, tmp_path):  # noqa: F811
    ro = mount(64, read_only=True)
    r = _run(_train("--steps", "2", "--commit-dir", str(ro / "c")))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr == f"error: --commit-dir {ro}/c: cannot be created under {ro} (not a writable folder)\n"

    # another run's checkpoint (another model) to --resume: one line naming what differs, nothing written
    r = _run(_train("--steps", "2", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run([*_train("--steps", "4", "--ckpt-dir", str(tmp_path / "ck"), "--resume"), "--d-model", "64"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"checkpoint {tmp_path}/ck/2 was made with another configuration (model.d_model: saved 32, now 64" \
        in r.stderr, r.stderr
    assert [f for f in os.listdir(tmp_path / "ck") if f.isdigit()] == ["2"]  # no step of the refused run
