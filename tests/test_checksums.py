"""Checksummed state (dpjax.recovery.file_format, sums, verify): one byte flipped in any
part of a commit file (magic, header length, header, each piece, each checksum, the end
mark) or of an orbax checkpoint's files (data, metadata, orbax's index, the manifest),
or a file cut short, is caught; a restore names the file in one line and restores the
step before, equal to the arrays that step was made from; `python -m dpjax.recovery
verify` says the same with its exit code. One fixture writes two steps of a tiny state;
each case corrupts a copy."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.recovery import sums
from dpjax.recovery.commit import Committer
from dpjax.recovery.file_format import CommitError, check, read_header, trailer_size
from dpjax.recovery.verify import verify

SPECS = {"w": P("data", "model"), "b": P("model"), "n": P()}
NEWEST = os.path.join("h0", "own", "r0", "s000000002_w1.bin")


def _arrays(step):
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "b": rng.standard_normal((4,)).astype(jax.numpy.bfloat16), "n": np.int32(step)}


def _state(arrays):
    mesh = dpjax.make_mesh("4x2", jax.devices()[:8])
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A commit folder and a checkpoint folder, each with steps 1 and 2."""
    from dpjax.recovery.checkpoint import Checkpointer

    root = tmp_path_factory.mktemp("saved")
    c = Committer(str(root / "commits"), "h0", 0, 1)
    ck = Checkpointer(str(root / "ckpt"))
    for step in (1, 2):
        c.commit(step, _state(_arrays(step)), {"cursor": step})
        ck.save(step, _state(_arrays(step)), {"step": step, "cursor": step})
    c.close()
    ck.close()
    return root


def _copy(saved, tmp_path, kind):
    shutil.copytree(saved / kind, tmp_path / kind)
    return tmp_path / kind


def _flip(path, at):
    b = bytearray(path.read_bytes())
    b[at] ^= 0x5A
    path.write_bytes(bytes(b))


def _same(state, step):
    for k, v in _arrays(step).items():
        np.testing.assert_array_equal(np.asarray(state[k]), v)


def test_every_byte_of_a_commit_file_is_covered(saved):
    """Each of the file's bytes flipped, and the file cut at each length: `check` refuses."""
    blob = (saved / "commits" / NEWEST).read_bytes()
    assert check(blob)["step"] == 2
    for at in range(len(blob)):
        b = bytearray(blob)
        b[at] ^= 0x01
        with pytest.raises(CommitError):
            check(bytes(b))
    for n in range(len(blob)):
        with pytest.raises(CommitError):
            check(blob[:n])


def _parts(blob):
    """Offsets of one byte in each part of a commit file."""
    meta, at = read_header(blob)
    tail = len(blob) - trailer_size(sum(len(leaf["pieces"]) for leaf in meta["leaves"]))
    return {"magic": 0, "header length": 6, "header": at - 20, "first piece": at + 3, "last piece": tail - 1,
            "piece checksum": tail + 1, "header checksum": len(blob) - 10, "piece count": len(blob) - 6,
            "end mark": len(blob) - 1}


@pytest.mark.parametrize("part", ["magic", "header length", "header", "first piece", "last piece",
                                  "piece checksum", "header checksum", "piece count", "end mark", "cut short"])
def test_a_corrupt_newest_commit_is_named_and_the_one_before_restored(saved, tmp_path, capfd, part):
    root = _copy(saved, tmp_path, "commits")
    path = root / NEWEST
    if part == "cut short":
        path.write_bytes(path.read_bytes()[:-7])
    else:
        _flip(path, _parts(path.read_bytes())[part])
    state, meta = Committer(str(root), "h0", 0, 1, fresh=False).restore(_state(_arrays(0)))
    assert meta["step"] == 1
    _same(state, 1)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "passed over" in err[0], err
    lines, code = verify(str(root))
    assert code == 1 and any(line.startswith("CORRUPT") and NEWEST in line for line in lines), lines


def test_no_good_commit_left_is_one_line(saved, tmp_path, capfd):
    root = _copy(saved, tmp_path, "commits")
    for f in os.listdir(root / "h0" / "own" / "r0"):
        _flip(root / "h0" / "own" / "r0" / f, 30)
    with pytest.raises(CommitError, match="no good commit left"):
        Committer(str(root), "h0", 0, 1, fresh=False).restore(_state(_arrays(0)))
    assert len(capfd.readouterr().err.strip().splitlines()) == 2  # each file named
    assert verify(str(root))[1] == 2


def _ckpt_restore(folder):
    from dpjax.recovery.checkpoint import Checkpointer

    template = _state(_arrays(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
    ck = Checkpointer(str(folder))
    try:
        return ck.restore(abstract)
    finally:
        ck.close()


def test_every_file_of_a_checkpoint_is_covered(saved, tmp_path):
    """A byte flipped in each file of step 2 (data, metadata, orbax's index), or the file
    cut short, or its manifest flipped: `sums.problem` names it; step 1 stays good."""
    root = _copy(saved, tmp_path, "ckpt")
    files = sorted(os.path.relpath(os.path.join(b, n), root / "2") for b, _, ns in os.walk(root / "2") for n in ns)
    assert any(f.startswith("state/d/") for f in files) and "state/_METADATA" in files
    assert "state/manifest.ocdbt" in files and sums.problem(str(root), 2) is None
    for rel in files:
        for harm in ("flip", "cut"):
            path = root / "2" / rel
            before = path.read_bytes()
            path.write_bytes(before[:-1]) if harm == "cut" else _flip(path, len(before) // 2)
            why = sums.problem(str(root), 2)
            assert why is not None and rel in why, (rel, harm, why)
            path.write_bytes(before)
    manifest = root / "checksums" / "2.json"
    _flip(manifest, 20)
    assert "manifest" in sums.problem(str(root), 2)
    assert sums.problem(str(root), 1) is None


@pytest.mark.parametrize("rel", ["data", "state/_METADATA", "state/manifest.ocdbt", "cut short"])
def test_a_corrupt_newest_checkpoint_is_named_and_the_one_before_restored(saved, tmp_path, capfd, rel):
    root = _copy(saved, tmp_path, "ckpt")
    if rel == "data":
        rel = next(os.path.join("state", "d", f) for f in os.listdir(root / "2" / "state" / "d"))
    if rel == "cut short":
        rel = "state/_METADATA"
        (root / "2" / rel).write_bytes((root / "2" / rel).read_bytes()[:-3])
    else:
        _flip(root / "2" / rel, 10)
    state, record = _ckpt_restore(root)
    assert record["step"] == 1
    _same(state, 1)
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("dpjax")]
    assert len(err) == 1 and f"{root}/2" in err[0] and rel in err[0] and "passed over" in err[0], err
    lines, code = verify(str(root))
    assert code == 1 and lines[0].startswith("CORRUPT") and lines[-1].endswith("a restore uses step 1"), lines


def test_verify_as_a_process(saved, tmp_path):
    """The command's exit codes: 0 for a good folder, 1 once the newest is corrupt (the
    file named), 2 for a folder of neither (one line)."""
    def run(folder):
        return subprocess.run([sys.executable, "-m", "dpjax.recovery", "verify", str(folder)],
                              capture_output=True, text=True, timeout=120)

    assert verify(str(saved / "commits"))[1] == 0
    r = run(saved / "ckpt")
    assert r.returncode == 0 and r.stdout.strip().endswith("step 2, is good"), r
    root = _copy(saved, tmp_path, "commits")
    _flip(root / NEWEST, 40)
    r = run(root)
    assert r.returncode == 1 and f"CORRUPT      commit {NEWEST}" in r.stdout, r
    assert r.stdout.strip().endswith("a restore uses step 1"), r.stdout
    with pytest.raises(dpjax.errors.UserError, match="holds no commits"):
        verify(str(root / "h0"))


def test_no_good_checkpoint_ends_a_fresh_resume_but_not_an_agents_restart(saved, tmp_path, capfd, monkeypatch):
    """Every checkpoint corrupt (the chaos soak cut the only one in half): --resume by hand
    is one line; an agent's restart says it and goes on to the job's commits (restarting
    ended every round with exit 2, and the agents gave up)."""
    from dpjax.recovery.checkpoint import NoneGood
    from dpjax.settings import Settings
    from dpjax.train.checkpoints import Checkpoints

    root = _copy(saved, tmp_path, "ckpt")
    for step in (1, 2):
        _flip(root / str(step) / "state" / "_METADATA", 10)

    class Trainer:  # what Checkpoints.restore reads of a trainer; a load would fail here
        record = None

        def state(self):
            return _state(_arrays(0))

    part = Checkpoints(Settings(ckpt_dir=str(root), resume=True))
    with pytest.raises(NoneGood, match="no good checkpoint is left"):
        part.restore(Trainer())
    monkeypatch.setenv("DPJAX_RESTART", "1")
    Checkpoints(Settings(ckpt_dir=str(root))).restore(Trainer())
    assert "the restart restores the job's commits" in capfd.readouterr().err
