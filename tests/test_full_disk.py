"""Files the filesystem refuses, and files cut short, end a command in one line (exit 2)
with the last good state kept: an orbax checkpoint onto a full or read-only folder,
`--metrics` onto one, a truncated safetensors file to `hf import` / `--init-from`. The
folders are small tmpfs mounts (tests run as root, where chmod stops no write); where
mounting is not permitted the tests say so and skip."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from dpjax.recovery import sums
from dpjax.recovery.checkpoint import CheckpointError, Checkpointer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama_tiny")


@pytest.fixture
def mount(tmp_path):
    """mount(size_kb, read_only=False) -> a fresh tmpfs folder, unmounted after the test."""
    made = []

    def make(size_kb: int, read_only: bool = False):
        where = tmp_path / f"mnt{len(made)}"
        where.mkdir()
        opts = f"size={size_kb}k" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here ({r.stderr.strip()})")
        made.append(where)
        return where

    yield make
    for where in made:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(folder, leave_kb: int) -> None:
    """Fills a tmpfs but for about `leave_kb`."""
    free = shutil.disk_usage(folder).free
    (folder / "filler").write_bytes(b"\0" * max(0, free - leave_kb * 1024))


def _state(step):
    return {"w": jax.numpy.full((8, 6), float(step)), "n": jax.numpy.int32(step)}


def test_a_checkpoint_onto_a_full_folder_is_one_line_and_the_last_good_one_kept(mount):
    folder = mount(512)
    ck = Checkpointer(str(folder / "ck"))
    ck.save(1, _state(1), {"step": 1})
    ck._settle()  # step 1 written and sealed: then the disk fills
    _fill(folder, 8)
    ck.save(2, _state(2), {"step": 2})
    with pytest.raises(CheckpointError) as got:
        ck.close()
    line = str(got.value)
    assert "\n" not in line and f"{folder}/ck/2 cannot be written (No space left on device)" in line, line
    assert line.endswith(f"the last good one is {folder}/ck/1"), line
    assert sums.problem(str(folder / "ck"), 1) is None
    (folder / "filler").unlink()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))
    again = Checkpointer(str(folder / "ck"))
    state, record = again.restore(abstract)
    again.close()
    assert record["step"] == 1 and np.all(np.asarray(state["w"]) == 1.0)


def test_a_checkpoint_folder_on_a_read_only_filesystem_is_one_line(mount):
    folder = mount(64, read_only=True)
    with pytest.raises(CheckpointError, match=r"cannot be used \(Read-only file system\)"):
        Checkpointer(str(folder / "ck"))


def test_a_commit_onto_a_full_folder_is_one_line_and_the_one_before_kept(mount):
    from dpjax.recovery.commit import Committer
    from dpjax.recovery.file_format import CommitError

    folder = mount(64)
    c = Committer(str(folder / "c"), "h0", 0, 1)
    c.commit(1, _state(1), {"cursor": 1})
    c.flush()
    _fill(folder, 0)
    c.commit(2, _state(2), {"cursor": 2})
    with pytest.raises(CommitError) as got:
        c.flush()
    assert str(got.value) == (f"the commit of step 2 cannot be written to {folder}/c/h0/own/r0 (No space left on "
                              "device); the newest kept is step 1")
    (folder / "filler").unlink()
    state, meta = Committer(str(folder / "c"), "h0", 0, 1, fresh=False).restore(_state(0))
    assert meta["step"] == 1 and np.all(np.asarray(state["w"]) == 1.0)


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600)


def test_hf_import_of_a_truncated_safetensors_file_is_one_line(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(FIXTURE, src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:len(data) // 2])
    r = _run("dpjax.hf", "import", str(src), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"{src}/model.safetensors: cut short ({len(data) // 2} bytes" in r.stderr
    assert not (tmp_path / "out").exists()


def _train(*extra):
    return ["dpjax.train", "--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
            "--batch-size", "8", "--data", "synthetic", "--eval-every", "0", "--progress", "none", "--mesh", "8",
            *extra]


@pytest.mark.slow
def test_training_onto_full_or_read_only_folders_is_one_line(mount, tmp_path):
    """A run whose --ckpt-dir fills, whose --metrics is on a read-only or a full
    filesystem, or whose --init-from is cut short: one line each, exit 2."""
    full = mount(64)
    r = _run(*_train("--steps", "2", "--ckpt-dir", str(full / "ck"), "--ckpt-every", "1"))
    # the last line is the run's; before it tensorstore may still print its writer's callbacks into
    # orbax's closed event loop ("RuntimeError: Event loop is closed", 0-30 lines): none is dpjax's
    assert r.returncode == 2 and "dpjax/" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: checkpoint {full}/ck/1 cannot be written (No space left on device)"), r.stderr[-3000:]
    ro = mount(64, read_only=True)
    r = _run(*_train("--steps", "1", "--metrics", str(ro / "m.jsonl")))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]  # refused before the run starts
    assert r.stderr.startswith(f"error: --metrics {ro}/m.jsonl") and "not writable" in r.stderr, r.stderr
    r = _run(*_train("--steps", "1", "--ckpt-dir", str(ro / "ck")))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"--ckpt-dir {ro}/ck" in r.stderr, r.stderr[-3000:]
    full = mount(64)
    _fill(full, 0)
    r = _run(*_train("--steps", "3", "--metrics", str(full / "m.jsonl")))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "No space left on device" in r.stderr, r.stderr[-3000:]
    src = tmp_path / "hf"
    shutil.copytree(FIXTURE, src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-100])
    r = _run("dpjax.train", "--init-from", f"hf:{src}", "--mesh", "2x4", "--steps", "1", "--batch-size", "8",
             "--seq-len", "8", "--data", "synthetic", "--eval-every", "0", "--progress", "none")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "model.safetensors: cut short" in r.stderr, r.stderr
