"""End-to-end training: data, tensor and fully sharded data parallelism equal one device,
the default model's numerics are pinned, resume equals no interruption (also on another
mesh, and under a rule between workers), and every bad input gets one clear line while
our own bugs keep their traceback."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dpjax.collectives import ALGORITHMS
from dpjax.train import main

from conftest import read_losses as losses

STEPS = 20


def tiny(corpus, *extra):
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "8", "--seq-len", "16",
            "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", *extra]


# Plain SGD without clipping: Adam and clipping would hide a gradient summed where it
# should be averaged (Adam is blind to the gradient's scale), SGD's step is not.
SGD = ("--optimizer", "sgd", "--lr", "0.1", "--clip-norm", "0")  # a stable lr: no chaos to amplify round-off


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "m.jsonl"
    assert main(tiny(corpus, *SGD, "--mesh", "1x1", "--steps", str(STEPS), "--metrics", str(path))) == 0
    out = losses(path)
    assert len(out) == STEPS and out[-1] < out[0] - 0.5  # it really trains
    return out


SLOW = pytest.mark.slow  # the same property on more meshes and algorithms: `pytest -m slow`


@pytest.mark.parametrize("mesh,algorithm,extra",
                         [pytest.param("8x1", a, (), marks=() if a == "ring" else SLOW)
                          for a in ALGORITHMS if a != "hierarchical"]
                         + [("2x4x1", "hierarchical", ()), pytest.param("4x2x1", "ring", (), marks=SLOW)]
                         # tensor parallelism over `model`, then FSDP (ZeRO-3) over `data`
                         + [("2x4", "ring", ()), pytest.param("1x8", "ring", (), marks=SLOW),
                            pytest.param("4x2", "ring", (), marks=SLOW),
                            pytest.param("2x4", "ring", ("--tp-allreduce", "butterfly"), marks=SLOW),
                            ("8x1", "ring", ("--fsdp",)), pytest.param("2x4", "butterfly", ("--fsdp",), marks=SLOW),
                            ("2x2x2", "hierarchical", ("--fsdp",))])
def test_parallel_equals_one_device(corpus, reference, tmp_path, mesh, algorithm, extra):
    path = tmp_path / "m.jsonl"
    assert main(tiny(corpus, *SGD, "--mesh", mesh, "--allreduce", algorithm, "--steps", str(STEPS),
                     "--metrics", str(path), *extra)) == 0
    # float32 round-off: the 8 partial gradients are summed in another order than the
    # single device's batch sum, and training carries the difference for 20 steps.
    np.testing.assert_allclose(losses(path), reference, rtol=2e-5, atol=0)


def test_metrics_and_summary(corpus, tmp_path, capsys, monkeypatch):
    from dpjax.train.builtin import Evaluation

    evaluate = Evaluation.loss
    monkeypatch.setattr(Evaluation, "loss", lambda self, trainer: (time.sleep(1.5), evaluate(self, trainer))[1])  # slow
    path = tmp_path / "m.jsonl"
    assert main(tiny(corpus, "--mesh", "8x1", "--steps", "6", "--eval-every", "3", "--metrics", str(path),
                     "--progress", "log")) == 0
    out = capsys.readouterr().out
    recs = [json.loads(line) for line in open(path)]
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 7))
    # one numbering: the console's "step 3/6  loss X" is the metrics row of step 3 (it counted from 0)
    console = [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^step (\d+)/6  loss (\S+)", out, re.M)]
    assert console and all(f"{train[n - 1]['loss']:.4f}" == loss for n, loss in console), (console, train)
    assert all(r["tokens_per_s"] > 0 and r["step_time"] > 0 for r in train)
    assert train[3]["step_time"] < 1.5  # the evaluation before step 4 is not its time
    assert [r["step"] for r in recs if "eval_loss" in r] == [3, 6]  # after step 3 and step 6
    last = out.strip().splitlines()[-1]
    assert last.startswith("done: 6 steps on mesh 8x1, train loss ") and "eval loss" in last and "tokens/s" in last


def _wait_for_steps(path, n, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path) and len(losses(path)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("training did not reach the step in time")


# Killed: the composed case (two sites doing local SGD with each other, each an FSDP group
# of 2 ranks with 2-way tensor parallelism, bf16 on the wire, 2 micro-batches a step).
# Ctrl-C: plain data parallelism.
COMPOSED = ("--mesh", "2x2x2", "--fsdp", "--update", "sparse:4", "--workers", "node", "--compression", "bf16",
            "--backward-passes", "2")


@pytest.mark.parametrize("how,extra", [("kill", COMPOSED), pytest.param("ctrl-c", ("--mesh", "8x1"), marks=SLOW)],
                         ids=["kill", "ctrl-c"])
def test_interrupt_and_resume_equals_uninterrupted(corpus, tmp_path, how, extra):
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    steps = 30  # interrupted after ~10, so well before the end
    args = tiny(corpus, *extra, "--steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "4",
                "--metrics", str(path))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dpjax.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_steps(path, 10, proc)
    proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if how == "ctrl-c":
        assert proc.returncode == 130, err
        assert out.strip().splitlines()[-1].startswith("interrupted: ")
        assert "Traceback" not in err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert len(losses(path)) < steps
    assert main(args + ["--resume"]) == 0
    resumed = losses(path)
    assert len(resumed) == steps
    # one row a step: the rows the killed run wrote after its last checkpoint are not repeated
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))
    # the same mesh, the same state restored bit for bit: the same losses as one run
    straight = tmp_path / "straight.jsonl"
    assert main(tiny(corpus, *extra, "--steps", str(steps), "--metrics", str(straight))) == 0
    assert resumed == losses(straight)


@pytest.mark.parametrize("first,second", [pytest.param(("2x4",), ("4x2",), marks=SLOW),
                                          pytest.param(("2x4",), ("1x1",), marks=SLOW),
                                          (("8x1", "--fsdp"), ("1x8",))])
def test_resume_on_another_mesh(corpus, reference, tmp_path, first, second):
    """Checkpoints hold global arrays: half the run on one layout, the rest on another,
    equals the single-device run (to float32 round-off, as above)."""
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    base = tiny(corpus, *SGD, "--ckpt-dir", str(ckpt), "--metrics", str(path))
    assert main(base + ["--mesh", *first, "--steps", str(STEPS // 2)]) == 0
    assert main(base + ["--mesh", *second, "--steps", str(STEPS), "--resume"]) == 0
    np.testing.assert_allclose(losses(path), reference, rtol=2e-5, atol=0)


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("extra,needle", [
    (["--mesh", "3x3"], "'3x3' needs 9 devices (8 devices available)"),
    (["--mesh", "data=2,modle=4"], "names an unknown axis 'modle' (did you mean model?)"),
    (["--mesh", "8x1", "--batch-size", "12"], "--batch-size 12 is not divisible by the 8 data-parallel ranks"),
    (["--model", "resnet"], "unknown model 'resnet'; choose one of llama, gemma2, gemma3, gpt, mistral, qwen2, "
                            "qwen3, mixtral, qwen3_moe, mlp"),
    (["--allreduce", "nccl"], "unknown --allreduce algorithm 'nccl'; choose one of"),
    (["--allreduce", "hierarchical", "--mesh", "8x1"], "needs a node axis"),
    (["--seq-len", "200000"], "this run needs about"),  # the plan's memory estimate refuses it first
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--mesh", "1x8", "--n-heads", "4"], "wo_LsxHmxKxD (1, 4, 8, 32): dimension 1 of size 4 does not split "
                                          "over the 8 devices of mesh axis 'model'"),
    (["--fsdp", "--allreduce", "tree"], "--fsdp all-gathers and reduce-scatters with the --allreduce algorithm"),
    (["--tp-allreduce", "nccl"], "unknown --tp-allreduce algorithm 'nccl'"),
])
def test_bad_input_one_line(corpus, capsys, extra, needle):
    assert main(tiny(corpus, "--steps", "2", *extra)) == 2
    assert needle in _one_error_line(capsys)


def test_bad_data_paths(tmp_path, capsys):
    assert main(tiny(str(tmp_path / "missing"), "--steps", "2")) == 2
    assert "does not exist" in _one_error_line(capsys)
    (tmp_path / "empty.txt").write_text("")
    assert main(tiny(str(tmp_path / "empty.txt"), "--steps", "2")) == 2
    assert "is empty" in _one_error_line(capsys)
    (tmp_path / "short.txt").write_text("x" * 1000)
    assert main(tiny(str(tmp_path / "short.txt"), "--steps", "2", "--seq-len", "600")) == 2
    assert "use a shorter --seq-len" in _one_error_line(capsys)


def _snapshot(folder):
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f))
            for d, _, fs in os.walk(folder) for f in fs}


def test_checkpoint_refusals_lose_nothing(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    base = tiny(corpus, "--mesh", "8x1", "--ckpt-dir", str(ckpt))
    assert main(base + ["--steps", "2"]) == 0
    capsys.readouterr()
    before = _snapshot(ckpt)
    assert before
    # a fresh run into a folder with checkpoints: refused, nothing overwritten
    assert main(base + ["--steps", "4"]) == 2
    assert _one_error_line(capsys) == (f"error: --ckpt-dir {ckpt} already holds checkpoints (latest step 2); pass "
                                       "--resume to continue that run, --overwrite to replace them, or another "
                                       "--ckpt-dir (nothing was overwritten)")
    # another model: refused, naming the difference
    assert main(tiny(corpus, "--mesh", "8x1", "--ckpt-dir", str(ckpt), "--d-model", "64", "--steps", "4",
                     "--resume")) == 2
    assert "model.d_model: saved 32, now 64" in _one_error_line(capsys)
    assert _snapshot(ckpt) == before
    # a corrupt checkpoint: refused with a clear line
    for path in before:
        if "state" in path and os.path.getsize(path) > 0:
            with open(path, "wb") as fh:
                fh.write(b"garbage")
    assert main(base + ["--steps", "4", "--resume"]) == 2
    assert f"checkpoint {ckpt}/2 is corrupt: state/" in _one_error_line(capsys)  # its checksums say so


def test_a_fresh_run_replaces_saved_state_only_with_overwrite(corpus, tmp_path, capsys):
    """--commit-dir follows --ckpt-dir's rule: a fresh run into a folder holding another
    run's commits is refused in one line and removes nothing; --overwrite replaces them (a
    later --resume continues the new run, not the old one's newer step); --resume continues."""
    from dpjax.recovery.checkpoint import Checkpointer
    from dpjax.recovery.commit import inventory

    root, ckpt = tmp_path / "commits", tmp_path / "ckpt"
    base = tiny(corpus, "--mesh", "1x1", "--commit-every", "1")
    assert main(base + ["--steps", "4", "--commit-dir", str(root), "--ckpt-dir", str(ckpt)]) == 0
    capsys.readouterr()
    before = _snapshot(root)
    assert max(step for _, step, *_ in inventory(str(root))) == 4
    assert main(base + ["--steps", "2", "--commit-dir", str(root)]) == 2
    assert _one_error_line(capsys) == (f"error: --commit-dir {root} already holds commits (latest step 4); pass "
                                       "--resume to continue that run, --overwrite to replace them, or another "
                                       "--commit-dir (nothing was overwritten)")
    assert _snapshot(root) == before
    assert main(base + ["--steps", "2", "--commit-dir", str(root), "--ckpt-dir", str(ckpt), "--overwrite"]) == 0
    assert max(step for _, step, *_ in inventory(str(root))) == 2  # the old run's step 4 is gone
    assert Checkpointer(str(ckpt)).latest_step() == 2
    capsys.readouterr()
    assert main(base + ["--steps", "3", "--commit-dir", str(root), "--resume"]) == 0
    assert "restored step 2 from commits" in capsys.readouterr().out


def test_a_resumed_metrics_file_keeps_one_row_a_step(tmp_path):
    """Resumed at step 2 (steps done): the rows of later steps, written by the run that
    died, go (they are run again), the half-written last line too; a loss row for a step
    the file holds (a restart's rows from its commit) is not written twice."""
    from dpjax.train.metrics import JsonLines

    path = tmp_path / "m.jsonl"
    old = [{"record": {}}, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval_loss": 2.5},
           {"step": 3, "loss": 1.0}, {"event": "restart"}, {"step": 3, "commit_s": 0.1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old) + '{"step": 4, "lo')
    w = JsonLines(str(path), append=True, resumed_at=2)
    for row in ({"step": 2, "loss": 2.0, "from_commit": True}, {"step": 3, "loss": 1.5}, {"step": 3, "loss": 9.0}):
        w.write(row)
    w.close()
    assert [json.loads(line) for line in open(path)] == [*old[:4], old[5], {"step": 3, "loss": 1.5}]
    JsonLines(str(path), append=True).close()  # a plain append (no resume) keeps every row
    assert len(open(path).readlines()) == 6


def test_golden_losses_of_the_default_model():
    """The default GPT (every model option at its default) on the default mesh with the
    default optimizer, seed 0, synthetic tokens: its first losses, stored. A change in
    initialisation, data order, numerics or the optimizer moves them."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.jsonl")
        assert main(["--data", "synthetic", "--steps", "4", "--batch-size", "8", "--eval-every", "0",
                     "--eval-batches", "1", "--progress", "none", "--metrics", path]) == 0
        recs = [json.loads(line) for line in open(path)]
    # 2026-11-22, 8 simulated CPU devices (mesh 8x1), jax 0.10.2; float32 round-off only
    np.testing.assert_allclose([r["loss"] for r in recs if "loss" in r],
                               [5.583644866943359, 5.586156368255615, 5.587194919586182, 5.592854976654053],
                               rtol=1e-5)
    np.testing.assert_allclose([r["eval_loss"] for r in recs if "eval_loss" in r], [5.5807342529296875], rtol=1e-5)


def test_a_bug_of_ours_keeps_its_traceback(corpus, monkeypatch):
    """Only user errors become one line: a ValueError from inside the library is raised."""
    from dpjax.step import entry

    def broken(*args, **kwargs):
        raise ValueError("an internal inconsistency")

    monkeypatch.setattr(entry, "build", broken)  # where the trainer's steps are built (dpjax.step.for_plan)
    with pytest.raises(ValueError, match="an internal inconsistency"):
        main(tiny(corpus, "--mesh", "8x1", "--steps", "2"))


def test_resume_needs_the_same_number_of_workers(corpus, tmp_path, capsys):
    """Every worker's copy is in the checkpoint: two sites (workers=node on 2x2x2) resume as
    the two data ranks of 2x4 and match a straight run there to float32 round-off, but not
    as the 8 workers of 8x1."""
    ckpt, path, straight = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "s.jsonl"
    base = tiny(corpus, *SGD, "--update", "sparse:3", "--ckpt-dir", str(ckpt), "--metrics", str(path))
    assert main(base + ["--mesh", "2x2x2", "--workers", "node", "--steps", "4"]) == 0
    assert main(base + ["--mesh", "2x4", "--steps", "8", "--resume"]) == 0
    assert main(tiny(corpus, *SGD, "--update", "sparse:3", "--mesh", "2x4", "--steps", "8",
                     "--metrics", str(straight))) == 0
    np.testing.assert_allclose(losses(path), losses(straight), rtol=2e-5)
    capsys.readouterr()
    assert main(base + ["--mesh", "8x1", "--steps", "12", "--resume"]) == 2
    assert "optimizer.workers: saved 2, now 8" in _one_error_line(capsys)
