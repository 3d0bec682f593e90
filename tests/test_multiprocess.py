"""Real processes on 127.0.0.1: two processes of four CPU devices each, joined by
jax.distributed (gloo), against the single-process eight-device run."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dpjax.train import main

from conftest import pids_running
from conftest import read_losses as _losses

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 10


def _launch(*args, per_process=True, **kw):
    """Two processes of 4 CPU devices; per_process=False leaves the count to the command
    (dpjax.train simulates mesh size / process count), as a user's plain launch does."""
    opts = ["--devices-per-process", "4"] if per_process else []
    if not per_process:  # conftest's XLA_FLAGS (8 devices) would otherwise reach the processes
        kw["env"] = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "dpjax.launch", "-n", "2", *opts, "--", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)


def _train_args(corpus, *extra):
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
            "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", "--mesh", "2x2x2", *extra]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The same run in this process, on its 8 devices: the reference."""
    path = tmp_path_factory.mktemp("single") / "m.jsonl"
    assert main(_train_args(corpus, "--steps", str(STEPS), "--metrics", str(path))) == 0
    return _losses(path)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_two_processes_equal_one(corpus, single, tmp_path, algorithm):
    path = tmp_path / "m.jsonl"
    r = _launch(sys.executable, "-m", "dpjax.train",
                *_train_args(corpus, "--allreduce", algorithm, "--steps", str(STEPS), "--metrics", str(path)),
                per_process=algorithm == "hierarchical")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[0] done: 10 steps on mesh 2x2x2" in r.stdout
    # float32 round-off only: the same global batch, summed across processes in another order
    np.testing.assert_allclose(_losses(path), single, rtol=2e-5, atol=0)


def test_every_collective_across_processes():
    r = _launch(sys.executable, os.path.join(HERE, "mp_collectives.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("collectives ok") == 2


def test_checkpoint_of_two_processes_resumes_in_one(corpus, single, tmp_path):
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = _train_args(corpus, "--ckpt-dir", str(ckpt), "--ckpt-every", "5", "--metrics", str(path))
    r = _launch(sys.executable, "-m", "dpjax.train", *common, "--steps", "5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert main(common + ["--steps", str(STEPS), "--resume"]) == 0
    np.testing.assert_allclose(_losses(path), single, rtol=2e-5, atol=0)


def _env_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)


def test_a_killed_process_stops_the_launcher(corpus, tmp_path):
    marker = str(tmp_path / "killme.jsonl")
    cmd = [sys.executable, "-m", "dpjax.launch", "-n", "2", "--devices-per-process", "4", "--",
           sys.executable, "-m", "dpjax.train", *_train_args(corpus, "--steps", "100000", "--metrics", marker)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (os.path.exists(marker) and os.path.getsize(marker) > 0):
        assert time.time() < deadline and launcher.poll() is None, "training never started"
        time.sleep(0.2)
    workers = [p for p in pids_running(marker) if p != launcher.pid and b"dpjax.train" in open(
        f"/proc/{p}/cmdline", "rb").read()]
    victim = next(p for p in workers if _env_of(p).get(b"DPJAX_PROCESS_ID") == b"1")
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    out, err = launcher.communicate(timeout=120)
    assert time.time() - t0 < 60
    assert launcher.returncode != 0
    assert "rank 1 failed (signal 9)" in err
    time.sleep(0.5)
    assert pids_running(marker) == []  # nothing left behind


# ---------------------------------------------------------------------------------------
# ranks that disagree, and processes that do not stop




STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "(time.sleep(1), sys.exit(3)) if sys.argv[1] == 'fail' and __import__('os').environ['DPJAX_PROCESS_ID'] "
            "== '1' else time.sleep(600)")
# (rank 1 fails a second after it starts: by then rank 0 ignores the signals, which the
# launcher, stopping the others at once when a rank fails, would otherwise beat)


@pytest.mark.parametrize("how", ["ctrl-c", "a-rank-fails"])
def test_the_launcher_escalates_to_sigkill(tmp_path, how):
    """Processes that ignore SIGINT and SIGTERM (stuck as a hung collective is) still
    stop: SIGINT, then SIGTERM after the grace period, then SIGKILL."""
    marker = str(tmp_path / "stubborn")
    cmd = [sys.executable, "-m", "dpjax.launch", "-n", "2", "--", sys.executable, "-c", STUBBORN,
           "fail" if how == "a-rank-fails" else "wait", marker]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "DPJAX_LAUNCH_GRACE": "1"})
    try:
        deadline = time.time() + 30
        # the launcher and its two processes; a failing rank 1 may be gone before it is seen
        while len(pids_running(marker)) < (3 if how == "ctrl-c" else 2):
            assert time.time() < deadline, "processes never started"
            time.sleep(0.1)
        time.sleep(0.5)  # past the children's signal set-up
        t0 = time.time()
        if how == "ctrl-c":
            launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=30)
        assert time.time() - t0 < 10  # 1 s after SIGINT, 1 s after SIGTERM
        assert "sending SIGTERM" in err and "sending SIGKILL" in err, err
        assert launcher.returncode != 0
        if how == "a-rank-fails":
            assert "rank 1 failed (exit code 3)" in err
        time.sleep(0.5)
        assert pids_running(marker) == []
    finally:  # whatever failed above, leave nothing of this test running
        for pid in pids_running(marker):
            os.kill(pid, signal.SIGKILL)
