"""Surviving failures, end to end: two agents on 127.0.0.1 standing for two hosts, two
processes of two CPU devices each (`--mesh 4x2`), a fault injected by DPJAX_FAULT,
against the same job without a failure. The issue's must-show scenarios, short (40
steps, the fault at step 10); RESULTS.md has the long ones (experiments/elastic.py). And
faults after the last commit (issue 53), which end the job with exit 0."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import pids_running, read_losses

pytestmark = pytest.mark.slow
STEPS, AT = 40, 10


def tiny(corpus, *extra):
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
            "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1", "--progress", "none",
            "--mesh", "4x2", "--steps", str(STEPS), *extra]


def _free_port():
    from dpjax.agent.rendezvous import free_port

    return free_port()


def run_agents(tmp, train_args, *, fault=None, nnodes="2:2", hosts=2, agent_args=(), timeout=500):
    """Runs `hosts` agents of 2 processes each; (return codes, stderr of each, seconds,
    metrics path, commit root)."""
    port, root, metrics = _free_port(), tmp / "commits", tmp / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DPJAX_FAULT")}
    if fault:
        env["DPJAX_FAULT"] = fault
    cmd = [sys.executable, "-m", "dpjax.agent", "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv",
           f"127.0.0.1:{port}", "--devices-per-process", "2", "--commit-dir", str(root), "--rdzv-wait", "60",
           *agent_args]
    logs = [open(tmp / f"agent{i}.err", "w+") for i in range(hosts)]
    t0 = time.time()
    agents = []
    for i in range(hosts):
        agents.append(subprocess.Popen([*cmd, "--host-id", f"h{i}", "--", sys.executable, "-m", "dpjax.train",
                                        *train_args, "--metrics", str(metrics)], env=env, stdout=subprocess.DEVNULL,
                                       stderr=logs[i], text=True))
        if i == 0:  # h0 runs the rendezvous (the faults strike h1: a lost rendezvous host ends the job)
            wait_listening(port)
    try:
        codes = [a.wait(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    errs = []
    for log in logs:
        log.seek(0)
        errs.append(log.read())
        log.close()
    return codes, errs, time.time() - t0, metrics, root


def wait_listening(port, timeout=60):
    import socket

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no rendezvous on port {port}")


def events(metrics):
    with open(metrics) as fh:
        return [r for r in map(json.loads, fh) if r.get("event") == "restart"]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The same job without a failure: the reference."""
    tmp = tmp_path_factory.mktemp("straight")
    codes, errs, _, metrics, _ = run_agents(tmp, tiny(corpus))
    assert codes == [0, 0], errs
    return read_losses(metrics)


def test_same_size_kill_is_bit_for_bit(corpus, straight, tmp_path):
    codes, errs, _, metrics, _ = run_agents(tmp_path, tiny(corpus), fault=f"rank=2,step={AT},kind=kill")
    assert codes == [0, 0], errs
    assert "rank 2 on host h1 failed: killed by signal SIGKILL" in errs[1]
    assert "round 2 (restart 1 of at most 3): hosts h0,h1 (4 processes" in errs[0]
    (ev,) = events(metrics)
    assert ev["processes"] == 4 and ev["mesh"] == {"data": 4, "model": 2}
    # --commit-every auto (the default): at most the interval in force plus the step in flight lost
    every = ev["commit_every"]
    assert every >= 1 and ev["restored_step"] >= AT - every - 1 and ev["steps_lost"] <= every + 1
    # the restarted processes load their programs from the commit folder: none compiled again
    assert ev["programs"]["compiled"] == 0 and ev["programs"]["loaded"] >= 3, ev["programs"]
    assert read_losses(metrics) == straight  # bit for bit


def test_smaller_when_the_host_does_not_come_back(corpus, straight, tmp_path):
    codes, errs, _, metrics, _ = run_agents(tmp_path, tiny(corpus), fault=f"rank=2,step={AT},kind=kill,forever",
                                            nnodes="1:2")
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, errs
    assert "round 2 (restart 1 of at most 3): hosts h0 (2 processes" in errs[0]
    (ev,) = events(metrics)
    assert ev["processes"] == 2 and ev["mesh"] == {"data": 2, "model": 2} and ev["global_batch"] == 16
    # 2 data ranks instead of 4: the same 16 sequences a step, in 2 passes of 8, 4 per device and pass as before
    assert (ev["backward_passes"], ev["batch_per_pass"], ev["per_device"]) == (2, 8, 4)
    restored = ev["restored_step"]
    rows = [json.loads(line) for line in open(metrics)]
    applied = {}  # the step log of the run that finished: each step's last record
    for r in rows:
        if "loss" in r:
            applied[r["step"]] = r
    assert sorted(applied) == list(range(1, STEPS + 1))  # every step applied exactly once in the final lineage
    # the step log says where each step read: the data position is the step, so step s read samples
    # [16 (s - 1), 16 s), none twice, none skipped, before the failure and after it
    assert [applied[s]["cursor"] for s in range(1, STEPS + 1)] == [16 * s for s in range(STEPS)]
    windows = [w for s in sorted(applied) for w in range(applied[s]["cursor"], applied[s]["cursor"] + 16)]
    assert len(windows) == len(set(windows)) == 16 * STEPS
    losses = read_losses(metrics)
    assert losses[:restored] == straight[:restored]
    # after it, the same sums in another order (2 data ranks instead of 4): float32 round-off
    np.testing.assert_allclose(losses[restored:], straight[restored:], rtol=2e-5, atol=0)
    assert pids_running(str(tmp_path)) == []


def test_fsdp_sparse_workers_node_host_lost_restores_from_the_neighbour(corpus, tmp_path):
    args = tiny(corpus, "--mesh", "2x2x2", "--fsdp", "--update", "sparse:4", "--workers", "node", "--optimizer",
                "sgd", "--lr", "0.3", "--commit-every", "1")
    ref = tmp_path / "ref"
    ref.mkdir()
    codes, errs, _, ref_metrics, _ = run_agents(ref, args)
    assert codes == [0, 0], errs
    codes, errs, _, metrics, root = run_agents(tmp_path, args, fault=f"rank=2,step={AT},kind=kill,host,wipe")
    assert codes == [0, 0], errs
    (ev,) = events(metrics)
    # host h1 (ranks 2, 3) lost its folder: their shards came from h0's neighbour copies
    assert ev["from"]["2"].startswith("h0/peer/r2/") and ev["from"]["3"].startswith("h0/peer/r3/"), ev["from"]
    assert ev["commit_every"] == 1 and ev["steps_lost"] <= 1  # every step committed: at most one step lost
    assert read_losses(metrics) == read_losses(ref_metrics)  # bit for bit


def test_a_hung_rank_is_detected_and_the_run_recovers(corpus, straight, tmp_path):
    hang = 8
    codes, errs, _, metrics, _ = run_agents(tmp_path, tiny(corpus), fault=f"rank=2,step={AT},kind=hang",
                                            agent_args=("--hang-timeout", str(hang)))
    assert codes == [0, 0], errs
    for err in errs:  # both agents name the stopped rank as the cause, not the ranks waiting for it
        line = next(s for s in err.splitlines() if "round 2 (restart 1" in s)
        assert "after rank 2 on host h1 failed: hung: no heartbeat for" in line and "(stopped: SIGSTOP)" in line
        silent = float(line.split("no heartbeat for ")[1].split(" s")[0])
        assert silent <= hang + 5  # detected within --hang-timeout + 5 s of its last step
    assert read_losses(metrics) == straight


def test_more_failures_than_max_restarts_is_one_line_and_nothing_left(corpus, tmp_path):
    codes, errs, seconds, _, _ = run_agents(tmp_path, tiny(corpus), fault="rank=1,step=3,kind=raise,forever",
                                            agent_args=("--max-restarts", "1"))
    assert codes == [1, 1], errs
    for err in errs:
        (line,) = [s for s in err.splitlines() if "giving up" in s]
        assert "2 failures, more than --max-restarts 1; the last: rank 1 on host h0 failed: exit code 1" in line
        assert "FaultInjected" in line
    time.sleep(1)
    assert pids_running(str(tmp_path)) == []


def test_a_size_that_cannot_hold_the_run_is_skipped_for_the_next_smaller(corpus, tmp_path):
    """Two hosts of 3 processes x 1 device on --mesh 3x2; one lost for good: 3 devices
    cannot hold a model axis of 2, so the agent skips that size, says why, and runs 2
    processes, the global batch of 6 in 3 passes of 2 (each device's share as before)."""
    steps = 12
    args = tiny(corpus, "--mesh", "3x2", "--batch-size", "6", "--steps", str(steps))
    codes, errs, _, metrics, _ = run_agents(tmp_path, args, fault="rank=3,step=4,kind=kill,forever", nnodes="1:2",
                                            agent_args=("--nproc-per-node", "3", "--devices-per-process", "1"))
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, errs
    why = "3 processes (3 devices): --mesh 3x2 cannot be resized to 3 devices: its non-data axes need a multiple of 2"
    assert f"skipping size {why}" in errs[0]
    assert "round 2 (restart 1 of at most 3): hosts h0 (2 processes, ranks 0..1 here)" in errs[0]
    (ev,) = events(metrics)
    assert ev["processes"] == 2 and ev["mesh"] == {"data": 1, "model": 2} and ev["sizes_skipped"] == [why]
    assert (ev["global_batch"], ev["backward_passes"], ev["batch_per_pass"], ev["per_device"]) == (6, 3, 2, 2)
    applied = {r["step"]: r for r in map(json.loads, open(metrics)) if "loss" in r}
    assert sorted(applied) == list(range(1, steps + 1))
    # none twice, none skipped
    assert [applied[s]["cursor"] for s in range(1, steps + 1)] == [6 * s for s in range(steps)]
    assert pids_running(str(tmp_path)) == []


def _once_each(metrics):
    """Whether every step's loss row is in the metrics once (no step missing, none twice)."""
    steps = [r["step"] for r in map(json.loads, open(metrics)) if "loss" in r]
    return sorted(steps) == list(range(1, STEPS + 1))


def _done_line(err):
    (line,) = [s for s in err.splitlines() if s.startswith("dpjax.agent[") and ": done: " in s]
    return line.split(": ", 1)[1]


@pytest.mark.parametrize("kind,how,agent_args", [
    ("kill", "killed by signal SIGKILL", ()),
    # stopped while the processes finish; a timeout that the end's evaluation (compiled then) fits in, on a loaded
    # machine: a process silent longer before its last commit is taken for hung (a restart finds nothing left)
    ("hang", "hung: no heartbeat for", ("--hang-timeout", "20")),
])
def test_a_failure_after_the_end_ends_the_job_with_0_and_one_line(corpus, straight, tmp_path, kind, how, agent_args):
    codes, errs, _, metrics, _ = run_agents(tmp_path, tiny(corpus), fault=f"rank=2,step=end,kind={kind}",
                                            agent_args=agent_args)
    assert codes == [0, 0], errs
    for err in errs:  # both agents name rank 2, not the processes its end held up; nothing restarted
        assert _done_line(err).startswith(f"done: the job finished in round 1; after its end rank 2 on host h1 "
                                          f"failed: {how}"), err
        assert _done_line(err).endswith("(not restarted: every step was trained and committed)")
        assert "round 2" not in err
    assert events(metrics) == [] and _once_each(metrics)
    assert read_losses(metrics) == straight
    time.sleep(1)
    assert pids_running(str(tmp_path)) == []


def test_an_agent_lost_after_the_end_ends_the_job_with_0_and_one_line(corpus, straight, tmp_path):
    codes, errs, _, metrics, _ = run_agents(tmp_path, tiny(corpus), fault="rank=2,step=end,kind=kill,forever",
                                            nnodes="1:2")
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, errs
    # the built-in rendezvous holds each agent's connection: a killed agent's host is lost when it closes
    assert _done_line(errs[0]) == ("done: the job finished in round 1; after its end host h1 failed: agent gone: its "
                                   "connection closed (host lost) (not restarted: every step was trained and "
                                   "committed)")
    assert events(metrics) == [] and _once_each(metrics)
    assert read_losses(metrics) == straight
    time.sleep(1)
    assert pids_running(str(tmp_path)) == []


def test_a_failure_after_the_last_commit_restarts_and_finds_nothing_left(corpus, straight, tmp_path):
    """Rank 2 killed once its last commit is made, before it says so: the agents restart the
    job, whose processes restore step STEPS and end it, exit 0 (not the user error a
    --resume by hand on a finished run gets)."""
    codes, errs, _, metrics, _ = run_agents(tmp_path, tiny(corpus), fault="rank=2,step=committed,kind=kill")
    assert codes == [0, 0], errs
    for err in errs:
        assert _done_line(err) == ("done: the job had trained and committed every step when rank 2 on host h1 "
                                   "failed: killed by signal SIGKILL; round 2 found nothing left to train"), err
    (ev,) = events(metrics)
    assert ev["nothing_left"] and ev["restored_step"] == STEPS
    assert _once_each(metrics) and read_losses(metrics) == straight
    time.sleep(1)
    assert pids_running(str(tmp_path)) == []
