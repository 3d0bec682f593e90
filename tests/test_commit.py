"""dpjax.recovery.commit: a commit restored on the same and on a smaller mesh is the committed
state bit for bit (against the numpy arrays it was made from); the newest step every
rank committed is the one restored; commits are atomic and the last two are kept; a
process whose own commit is lost restores from its neighbour's copy (two processes)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.recovery.commit import Committer
from dpjax.recovery.file_format import CommitError, decode

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


# ---------------------------------------------------------------------------------------
# the path near the hardware: files reused, the commits' own channel, the measured rows


def test_a_commit_file_reuses_the_oldest_kept_files_pages(tmp_path):
    """Against the bytes each commit was made of: the third commit is written into the
    first's file (same inode: its tmpfs pages overwritten, not allocated again), the
    last two kept, no temporary file left; a shorter commit is cut to its size."""
    from dpjax.recovery.commit import write_file

    blobs = [bytes([i]) * (1000 - 100 * i) for i in range(4)]
    inodes = []
    for step, blob in enumerate(blobs, 1):
        path, size = write_file(str(tmp_path), f"s{step:09d}_w1.bin", 2, lambda fh, b=blob: fh.write(b))
        assert size == len(blob) and open(path, "rb").read() == blob
        inodes.append(os.stat(path).st_ino)
    assert sorted(os.listdir(tmp_path)) == ["s000000003_w1.bin", "s000000004_w1.bin"]
    assert inodes[2] == inodes[0] and inodes[3] == inodes[1]


def test_the_commits_channel_moves_files_bit_for_bit(tmp_path):
    """Two processes' servers in one: a put lands as the sender's file in the receiver's
    peer folder, a get returns a file under the root, both the bytes sent; a path out
    of the root and a process that never published an address are refused."""
    from dpjax.recovery.peer import PeerError, Peers, TIMEOUT_S

    from dpjax.recovery.peer import LocalKV

    client, got = LocalKV(), {}

    def store(rank):
        def _store(sender, name, size, sock):
            from dpjax.recovery.peer import recv_into_file

            with open(tmp_path / f"at{rank}-from{sender}-{name}", "wb") as fh:
                recv_into_file(sock, fh, size, bytearray(4096))  # a buffer smaller than the file
            got[rank] = name
        return _store

    a, b = (Peers(str(tmp_path), r, client, store(r)) for r in (0, 1))
    blob = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8).tobytes()
    (tmp_path / "c.bin").write_bytes(blob)
    assert a.put(1, "s000000001_w2.bin", str(tmp_path / "c.bin")) == len(blob)
    assert got == {1: "s000000001_w2.bin"}
    assert (tmp_path / "at1-from0-s000000001_w2.bin").read_bytes() == blob
    assert bytes(b.get(0, "c.bin")) == blob
    with pytest.raises(PeerError, match="not under the commit root"):
        b.get(0, "../etc/passwd")
    import dpjax.recovery.peer as cp

    old, cp.TIMEOUT_S = TIMEOUT_S, 0.2
    try:
        with pytest.raises(PeerError, match="process 7 published no commit address"):
            a.get(7, "c.bin")
    finally:
        cp.TIMEOUT_S = old
    a.close()
    b.close()


def test_every_commit_is_measured(tmp_path):
    """commit_bytes is the file's size, commit_s is positive; poll hands each once."""
    mesh = dpjax.make_mesh("4x2", jax.devices()[:8])
    c = Committer(str(tmp_path), "h0", 0, 1)
    for step in (1, 2):
        c.commit(step, _state(mesh, _arrays(step), SAVE_SPECS), {"cursor": step})
    c.flush()
    rows = c.poll()
    assert [r["step"] for r in rows] == [1, 2] and c.poll() == []
    for r in rows:
        assert r["commit_bytes"] == os.path.getsize(tmp_path / "h0" / "own" / "r0" / f"s{r['step']:09d}_w1.bin")
        assert r["commit_s"] > 0
    c.close()


def _rows(path):
    import json

    with open(path) as fh:
        return [json.loads(line) for line in fh]


def test_dpjax_train_commits_at_the_interval_auto_chose_and_says_so(corpus, tmp_path, capsys):
    """--commit-dir with the default --commit-every auto: the run record says auto; the
    commits come where the rows' intervals say (each commit's gap to the next is the
    commit_every its row carries; the last step is always committed); every row that
    finished a commit carries commit_s, commit_bytes (its file's size: one process) and
    commit_every; the choice is a row and one printed line; a restart from the last
    commit gives the straight run's losses bit for bit."""
    from dpjax.train import main

    from conftest import tiny_gpt

    root, path, straight = tmp_path / "c", tmp_path / "m.jsonl", tmp_path / "s.jsonl"
    args = tiny_gpt(corpus, "--mesh", "4x2", "--commit-dir", str(root), "--metrics", str(path))
    assert main([*args, "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert out.count("dpjax.recovery.commit: committing every") == 1
    rows = _rows(path)
    assert rows[0]["record"]["commit"]["every"] == "auto"
    (chosen,) = [r["commit_every"] for r in rows if isinstance(r.get("commit_every"), dict)]
    assert f"committing every {chosen['every']} steps" in out and chosen["step_s"] > 0
    # a finished commit's figures ride in the row of a step still in flight, or in a row of their
    # own written at once when two finish together: the file's order is not the commits' order
    done = sorted((r for r in rows if "commit_s" in r), key=lambda r: r["commit_step"])
    steps = [r["commit_step"] for r in done]
    assert len(set(steps)) == len(steps)  # each commit's figures once
    assert steps[0] == 7  # the first iteration is not timed, 2 compile, 3 measured, then the first commit
    for a, b in zip(done, done[1:]):
        assert b["commit_step"] - a["commit_step"] == a["commit_every"] or b["commit_step"] == 40
    assert steps[-1] == 40 and all(r["commit_s"] > 0 and r["commit_bytes"] > 0 for r in done)
    assert done[-1]["commit_bytes"] == os.path.getsize(root / "local" / "own" / "r0" / "s000000040_w1.bin")
    assert main([*tiny_gpt(corpus, "--mesh", "4x2"), "--steps", "48", "--metrics", str(straight)]) == 0
    assert main([*args, "--steps", "48", "--resume"]) == 0
    assert "restored step 40 from commits" in capsys.readouterr().out
    assert read_losses(path) == read_losses(straight)


def test_a_fixed_interval_and_bad_ones(corpus, tmp_path, capsys):
    from dpjax.train import main

    from conftest import tiny_gpt

    path = tmp_path / "m.jsonl"
    args = tiny_gpt(corpus, "--mesh", "2x4", "--commit-dir", str(tmp_path / "c"), "--metrics", str(path))
    assert main([*args, "--steps", "10", "--commit-every", "4"]) == 0
    done = [r for r in _rows(path) if "commit_s" in r]
    assert [(r["commit_step"], r["commit_every"]) for r in done] == [(4, 4), (8, 4), (10, 4)]
    assert "committing every" not in capsys.readouterr().out
    for bad in ("0", "two"):
        assert main([*args, "--steps", "10", "--commit-every", bad]) == 2
        assert f"--commit-every takes a number of steps (at least 1) or auto, got '{bad}'" in capsys.readouterr().err


def test_a_finished_run_restored_is_one_line_by_hand_and_the_end_under_the_agent(corpus, tmp_path, capsys,
                                                                                  monkeypatch):
    """A run whose commit is at --steps: `--resume` by hand is refused in one line (ask for
    more steps); an agent's restart (DPJAX_RESTART=1) that restores it is the job's end,
    exit 0 (the job failed after its last commit): the rows of the commit's last steps
    that the lost job had not written come from the commit, once; a restart row says
    nothing was left; the heartbeat tells the agent."""
    from dpjax.train import main

    from conftest import tiny_gpt

    path, beat = tmp_path / "m.jsonl", tmp_path / "heartbeat"
    args = tiny_gpt(corpus, "--mesh", "1x1", "--commit-dir", str(tmp_path / "c"), "--metrics", str(path), "--steps",
                    "4", "--commit-every", "2")
    assert main(args) == 0
    want = read_losses(path)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    refusal = "error: the checkpoint is at step 4, not before --steps 4; ask for more steps"
    assert capsys.readouterr().err.strip() == refusal
    rows = _rows(path)
    with open(path, "w") as fh:  # the lost job died before its last rows: steps 3 and 4 were in flight at the commit
        fh.writelines(json.dumps(r) + "\n" for r in rows if r.get("step", 0) < 3)
    monkeypatch.setenv("DPJAX_RESTART", "1")
    monkeypatch.setenv("DPJAX_HEARTBEAT", str(beat))
    monkeypatch.setenv("DPJAX_LAST_FAILURE", json.dumps({"line": "rank 1 on host h1 failed: killed by signal SIGKILL"}))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # a process under the agent leaves at once on an exception
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0
    assert ("dpjax.elastic: restored step 4 of --steps 4: the job had trained and committed every step before it "
            "failed (rank 1 on host h1 failed: killed by signal SIGKILL); nothing left to train"
            ) in capsys.readouterr().out
    rows = _rows(path)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4] and read_losses(path) == want
    (ev,) = [r for r in rows if r.get("event") == "restart"]
    assert ev["nothing_left"] and ev["restored_step"] == 4 and ev["failed"].startswith("rank 1 on host h1")
    marks = json.loads(beat.read_text())
    assert marks["final"] and marks["ended"] and marks["nothing_left"]


@pytest.mark.slow
def test_the_paths_experiment_smoke():
    """experiments/elastic.py --paths --smoke (test_experiments runs the other modes):
    every path is timed and its restore checked against the state (the script asserts)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, os.path.join("experiments", "elastic.py"), "--paths", "--smoke"], cwd=root,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    for path in ("commit", "plain write", "orbax save: written", "fetch from the neighbour (TCP)", "orbax restore"):
        assert f"| {path} |" in r.stdout


def test_pieces_from_several_files_are_placed_on_any_layout(tmp_path):
    """Three old ranks' files whose pieces cut the arrays unlike the target's blocks (and
    the third fetched from a "remote" holder) are placed bit for bit, every device's block
    cut from the pieces that overlap it."""
    from dpjax.recovery.file_format import encode, header
    from dpjax.recovery.place import LocalFile, RemoteFile, place

    arrays = _arrays(3)
    boxes = {  # old rank -> {leaf: global index of its piece}
        0: {"w": [[0, 3], [0, 6]], "key": [[0, 2]]},
        1: {"w": [[3, 8], [0, 2]], "b": [[0, 4]]},
        2: {"w": [[3, 8], [2, 6]], "count": []},
    }
    target = dpjax.make_mesh("2x2", jax.devices()[:4])
    template = _state(target, {k: np.zeros_like(v) for k, v in arrays.items()},
                      {"w": P("model", "data"), "b": P("data"), "key": P(), "count": P()})
    leaves, treedef = jax.tree.flatten(template)
    names = list(jax.tree.unflatten(treedef, list(range(len(leaves)))))  # the dict's keys in leaf order
    paths = []
    for rank, mine in boxes.items():
        meta = {"step": 9, "cursor": 0, "record": {}, "treedef": str(treedef), "leaves": []}
        blob = []
        for k in names:
            pieces = [mine[k]] if k in mine else []
            meta["leaves"].append({"shape": list(arrays[k].shape), "dtype": str(arrays[k].dtype), "pieces": pieces})
            blob += [np.asarray(arrays[k])[tuple(slice(a, b) for a, b in p)] for p in pieces]
        paths.append(tmp_path / f"r{rank}.bin")
        paths[-1].write_bytes(encode(meta, blob))
    fetched = []

    def fetch(n=None):
        fetched.append(n)
        data = paths[2].read_bytes()
        return data if n is None else data[:n]

    state = place(template, [LocalFile(str(paths[0])), LocalFile(str(paths[1])), RemoteFile(fetch)])
    for k, v in arrays.items():
        assert state[k].sharding == template[k].sharding
        np.testing.assert_array_equal(np.asarray(state[k]), v)
    assert fetched[:2] != [None, None] and fetched.count(None) == 1  # the header first, then the file once
    paths[1].write_bytes(header({**json.loads(json.dumps(meta)), "treedef": "other"}))
    with pytest.raises(CommitError, match="another state structure"):
        place(template, [LocalFile(str(p)) for p in paths])


def test_a_restart_whose_first_step_is_the_last_writes_its_restart_row(corpus, tmp_path, monkeypatch):
    """An agent's restart restored at --steps - 1: its first step is the job's last, so no later
    step writes the restart row (it waited for a thread to see the first step's loss): the loop's
    end writes it, once, with the seconds the failure cost (issue 51's soak lost such a row)."""
    import time

    from dpjax.train import main

    from conftest import tiny_gpt

    path = tmp_path / "m.jsonl"
    args = tiny_gpt(corpus, "--mesh", "1x1", "--commit-dir", str(tmp_path / "c"), "--metrics", str(path),
                    "--commit-every", "1")
    assert main([*args, "--steps", "4"]) == 0
    want = read_losses(path)
    rows = _rows(path)
    with open(path, "w") as fh:  # the lost job: 3 steps trained, written and committed, its 4th lost
        fh.writelines(json.dumps(r) + "\n" for r in rows if r.get("step", 0) < 4)
    for f in (tmp_path / "c").rglob("s000000004_*"):
        f.unlink()  # the commits of step 4 never made: the newest every rank has is step 3
    t = time.time()
    monkeypatch.setenv("DPJAX_RESTART", "1")
    monkeypatch.setenv("DPJAX_HEARTBEAT", str(tmp_path / "heartbeat"))
    monkeypatch.setenv("DPJAX_LAST_FAILURE", json.dumps({"line": "rank 0 on host local failed: killed by signal "
                                                         "SIGKILL", "t": t - 2.0, "completed": 3, "restarted": t}))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    assert main([*args, "--steps", "4"]) == 0
    rows = _rows(path)
    (ev,) = [r for r in rows if r.get("event") == "restart"]
    assert ev["restored_step"] == 3 and ev["steps_lost"] == 0 and ev["failed"].startswith("rank 0 on host local")
    assert 2.0 <= ev["seconds_lost"] < 2.0 + (time.time() - t), ev
    # wall and CPU seconds of each phase, the first step's ending when the row's seconds_lost does
    assert set(ev["breakdown"]["wall"]) == set(ev["breakdown"]["cpu"]) == {
        "start_import", "join", "plan", "init", "restore", "first_step"}
    assert all(s >= 0 for s in ev["breakdown"]["cpu"].values()), ev["breakdown"]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4] and read_losses(path) == want
