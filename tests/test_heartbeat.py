"""A healthy but slow job is never declared lost (issue 51, the agent under load): the
heartbeat's two clocks (dpjax.recovery.heartbeat) judged by hand, one agent as a process
over stand-in processes (no JAX) whose save stalls far longer than --hang-timeout, and an
agent's own thread keeping its host alive while its loop is held up."""

import argparse
import subprocess
import sys
import threading
import time

from dpjax.agent import rendezvous
from dpjax.agent.supervisor import Agent
from dpjax.recovery import heartbeat
from dpjax.recovery.heartbeat import judge

HANG, START = 2.0, 30.0


def test_each_clock_is_held_to_its_own_limit():
    t0 = 1000.0
    stepping = {"dispatched": 7, "t": t0, "busy": None}
    assert judge(0.5, stepping, t0 - 100, HANG, START, now=t0 + 1.9) is None
    assert judge(0.5, stepping, t0 - 100, HANG, START, now=t0 + 2.1)[1] == "no step for 2 s since its last step"
    saving = {**stepping, "busy": "a save", "busy_since": t0}  # a save: the start's limit, not the hang's
    assert judge(0.5, saving, t0 - 100, HANG, START, now=t0 + 29) is None
    assert judge(0.5, saving, t0 - 100, HANG, START, now=t0 + 31)[1] == "busy for 31 s with a save"
    # a stopped process's thread beats no more: its file's age is the hang, busy or not
    assert judge(2.5, saving, t0 - 100, HANG, START, now=t0 + 3, stopped=True)[1] == "no heartbeat for 2 s"
    # a running one's thread may be silent in a call that holds the interpreter: not a hang in a save ...
    assert judge(9.0, saving, t0 - 100, HANG, START, now=t0 + 9) is None
    # ... and when stepping, its steps' clock
    assert judge(9.0, stepping, t0 - 100, HANG, START, now=t0 + 9)[1] == "no step for 9 s since its last step"
    starting = {"dispatched": None, "t": t0}  # before its first step: the start's limit
    assert judge(0.5, starting, t0, HANG, START, now=t0 + 29) is None
    assert judge(None, {}, t0, HANG, START, now=t0 + 31)[1] == "no heartbeat for 31 s since its start"


def test_the_thread_beats_while_the_loop_is_held_up(tmp_path):
    path = str(tmp_path / "hb")
    beat = heartbeat.Heartbeat(path, lambda: {"completed": 3}, every=0.1)
    try:
        beat.step(3)
        beat.busy("a save")
        time.sleep(0.5)  # the loop is in the save: no step, and the thread's beats go on
        age, got = heartbeat.read(path)
        assert age < 0.3 and got["busy"] == "a save" and got["dispatched"] == 3 and got["completed"] == 3
        beat.idle()  # the progress clock from now: the save's seconds are not a step's
        assert time.time() - beat.t < 0.1
    finally:
        beat.close()


# A stand-in process (the heartbeat module loaded alone: no JAX). Round 1: a step, then a
# "save" of 3 x --hang-timeout, after which rank 0 stops itself (SIGSTOP) while rank 1 saves on;
# round 2: a step and exit 0.
STALL = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("hb", sys.argv[1])
hb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hb)
beat = hb.Heartbeat(os.environ["DPJAX_HEARTBEAT"], every=0.2)
beat.step(1)
if os.environ["DPJAX_RESTART"] == "0":
    beat.busy("a checkpoint's save")
    time.sleep(6.0)
    if os.environ["DPJAX_PROCESS_ID"] == "0":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)
"""


def test_a_save_longer_than_the_hang_timeout_is_not_a_hang_and_a_stop_in_it_is(tmp_path):
    started = time.time()
    r = subprocess.run([sys.executable, "-m", "dpjax.agent", "--nproc-per-node", "2", "--rdzv",
                        f"127.0.0.1:{rendezvous.free_port()}", "--host-id", "h0", "--commit-dir", str(tmp_path),
                        "--hang-timeout", str(HANG), "--", sys.executable, "-c", STALL, heartbeat.__file__],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (line,) = [s for s in r.stderr.splitlines() if "round 2 (restart 1 of at most 3)" in s]
    # the cause is the stop, found by its beats' silence, not the save of 3 x --hang-timeout before it
    assert "after rank 0 on host h0 failed: hung: no heartbeat for" in line, r.stderr
    assert line.endswith("after step 1 (stopped: SIGSTOP)"), line
    assert float(line.split("no heartbeat for ")[1].split(" s")[0]) <= HANG + 2
    assert "round 3" not in r.stderr and time.time() - started < 120


def test_an_agent_whose_loop_is_held_up_keeps_its_host(tmp_path):
    state = rendezvous.State(1, 1, max_restarts=3, lost_after=2.5)
    port = rendezvous.free_port()
    server = rendezvous.serve("127.0.0.1", port, state)
    args = argparse.Namespace(host_id="h0", rdzv=f"127.0.0.1:{port}", host_timeout=2.5)
    agent = Agent(args, ["true"])
    try:
        state.handle({"op": "join", "host": "h0", "addr": "127.0.0.1", "port": 1, "nproc": 1})
        assert state.state == "running"
        threading.Thread(target=agent._alive, daemon=True).start()
        time.sleep(5.0)  # the loop asks nothing (held up: starting processes, a slow import)
        assert state.handle({"op": "poll"})["state"] == "running" and "h0" in state.seen
        agent.leaving.set()  # its thread stops: silence, and the host is lost
        time.sleep(3.5)
        assert state.handle({"op": "poll"})["state"] == "failed"
    finally:
        agent.leaving.set()
        server.shutdown()


def test_a_full_folder_is_no_failure_of_the_run(tmp_path):
    """The heartbeat shares the commits' tmpfs, which the soak fills: a write that fails
    leaves the file to age (the agent judges its age), it raises nothing."""
    path = tmp_path / "gone" / "hb"  # a folder that is not there: every write fails
    beat = heartbeat.Heartbeat(str(path), every=0.05)
    try:
        beat.step(1)
        beat.busy("a save")
        beat.idle()
        time.sleep(0.2)
        assert heartbeat.read(str(path)) == (None, {})
    finally:
        beat.close()
