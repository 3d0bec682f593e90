"""The agent's parts without processes: the rendezvous's rounds on a hand-driven clock,
DPJAX_FAULT's grammar, the mesh resized for the hosts that are left, the cause named;
and one agent as a process over stand-in processes (no JAX) for a failure after the end."""

import json
import os
import subprocess
import sys
import time

import pytest

from dpjax.recovery import fault
from dpjax.agent.rendezvous import State
from dpjax.agent.supervisor import cause
from dpjax.errors import UserError
from dpjax.plan import UsageError, fit_mesh
from dpjax.settings import Settings


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _join(s, host, port=1000):
    return s.handle({"op": "join", "host": host, "addr": "127.0.0.1", "port": port, "nproc": 2})


def test_a_round_forms_with_max_hosts_in_name_order():
    clock = Clock()
    s = State(1, 2, max_restarts=1, clock=clock)
    assert _join(s, "b", 1111)["state"] == "forming"  # waits for MAX in the first round
    v = _join(s, "a", 2222)
    assert v["state"] == "running" and v["members"] == ["a", "b"] and v["coordinator"] == "127.0.0.1:2222"
    assert (v["node_rank"], v["first_rank"], v["world"]) == (0, 0, 4)


def test_the_first_round_starts_with_min_hosts_after_the_wait():
    clock = Clock()
    s = State(1, 2, max_restarts=1, first_wait=10, last_call=1, clock=clock)
    _join(s, "a")
    clock.t = 9.9
    assert s.handle({"op": "poll", "host": "a"})["state"] == "forming"
    clock.t = 10.0
    assert s.handle({"op": "poll", "host": "a"})["members"] == ["a"]


def test_a_failure_restarts_at_the_size_left_and_a_lost_host_is_dropped():
    clock = Clock()
    s = State(1, 2, max_restarts=3, last_call=1, lost_after=3, clock=clock)
    _join(s, "a"), _join(s, "b")
    v = s.handle({"op": "fail", "host": "b", "round": 1, "rank": 2, "how": "killed by signal SIGKILL", "t": 5.0,
                  "signal": True})
    assert (v["state"], v["restarts"]) == ("failed", 1)
    assert s.handle({"op": "fail", "host": "a", "round": 1, "rank": 0, "how": "exit code 1", "t": 5.5})["failures"]
    _join(s, "a")  # b's agent is gone (its host lost) and never rejoins
    clock.t = 2.0
    assert s.handle({"op": "poll", "host": "a"})["state"] == "failed"  # b still counts as live
    clock.t = 3.5
    v = s.handle({"op": "poll", "host": "a"})
    assert (v["round"], v["state"], v["members"], v["world"]) == (2, "running", ["a"], 2)
    assert cause(v["last"]["failures"])["rank"] == 2  # the killed rank, not the survivor's echo
    _join(s, "b")  # it comes back: taken in at the next restart
    assert s.handle({"op": "poll", "host": "b"})["members"] == ["a"]
    s.handle({"op": "fail", "host": "a", "round": 2, "rank": 0, "how": "exit code 1", "t": 9})
    v = _join(s, "a")
    clock.t = 5.0
    v = s.handle({"op": "poll", "host": "a"})
    assert v["members"] == ["a", "b"] and v["round"] == 3  # by name


def test_more_failures_than_max_restarts_give_up():
    clock = Clock()
    s = State(1, 1, max_restarts=1, clock=clock)
    _join(s, "a")
    s.handle({"op": "fail", "host": "a", "round": 1, "rank": 0, "how": "exit code 1", "t": 1})
    assert _join(s, "a")["round"] == 2
    assert s.handle({"op": "fail", "host": "a", "round": 2, "rank": 0, "how": "exit code 1", "t": 2})["state"] == \
        "gave_up"


def test_fewer_than_min_hosts_wait_first_wait_for_a_host_to_come_back_then_give_up():
    """A lost host of a 2:2 job: the other waits --rdzv-wait (first_wait) for it to be restarted
    (its new agent's start takes tens of seconds on a loaded machine), not 2 x --host-timeout."""
    for back_at, state in ((29.0, "running"), (40.0, "gave_up")):
        clock = Clock()
        s = State(2, 2, max_restarts=3, first_wait=30.0, lost_after=3.0, clock=clock)
        _join(s, "a"), _join(s, "b")
        for t in range(1, int(back_at) + 1):  # a polls on; b's agent is gone from t = 0
            clock.t = float(t)
            s.handle({"op": "poll", "host": "a"})
        if state == "running":
            assert s.state == "failed" and clock.t > 2 * 3.0  # still waiting, past the old window
            _join(s, "a"), _join(s, "b")
            clock.t += 2.0
            s.handle({"op": "poll", "host": "a"})
        assert s.state == state, (back_at, s.state)


def test_a_job_is_done_when_every_host_is():
    s = State(2, 2, max_restarts=0, clock=Clock())
    _join(s, "a"), _join(s, "b")
    assert s.handle({"op": "done", "host": "a", "round": 1})["state"] == "running"
    assert s.handle({"op": "done", "host": "b", "round": 1})["state"] == "done"


def test_a_failure_after_every_host_is_final_is_after_the_end_not_a_restart():
    clock = Clock()
    s = State(2, 2, max_restarts=0, lost_after=3, clock=clock)
    _join(s, "a"), _join(s, "b")
    s.handle({"op": "end", "host": "a", "round": 1, "final": True, "ended": False})
    # b not final yet: a failure now is a failure (with no restarts left: the end of the job)
    assert s.state == "running"
    v = s.handle({"op": "fail", "host": "b", "round": 1, "rank": 2, "how": "killed by signal SIGKILL", "t": 1.0,
                  "signal": True, "final": True, "ended": False})  # its processes had all made their last commit
    assert (v["state"], v["restarts"], v["failures"]) == ("done", 0, [])
    assert [f["rank"] for f in v["after_end"]] == [2]
    # what other hosts report then joins it; the round stays done
    v = s.handle({"op": "fail", "host": "a", "round": 1, "rank": 0, "how": "exit code 1", "t": 1.5})
    assert v["state"] == "done" and cause(v["after_end"])["rank"] == 2


def test_a_failure_heard_before_the_news_of_the_end_is_taken_back():
    clock = Clock()
    s = State(2, 2, max_restarts=3, lost_after=3, clock=clock)
    _join(s, "a"), _join(s, "b")
    v = s.handle({"op": "fail", "host": "b", "round": 1, "rank": 2, "how": "killed by signal SIGKILL", "t": 1.0,
                  "signal": True})
    assert (v["state"], v["restarts"]) == ("failed", 1)
    v = s.handle({"op": "end", "host": "a", "round": 1, "final": True, "ended": True})  # every process committed
    assert (v["state"], v["restarts"], v["failures"]) == ("done", 0, [])
    assert v["after_end"][0]["rank"] == 2


def test_a_host_lost_after_the_end_ends_the_job_done():
    clock = Clock()
    s = State(1, 2, max_restarts=3, lost_after=3, clock=clock)
    _join(s, "a"), _join(s, "b")
    s.handle({"op": "end", "host": "a", "round": 1, "final": True, "ended": True})
    clock.t = 3.5  # b's agent is silent: its host is lost
    v = s.handle({"op": "poll", "host": "a"})
    assert (v["state"], v["restarts"], v["round"]) == ("done", 0, 1)
    assert "host lost" in v["after_end"][0]["how"]
    # a round that did not end: the same loss is a restart, as before
    s = State(1, 2, max_restarts=3, lost_after=3, clock=Clock())
    _join(s, "a"), _join(s, "b")
    s.clock.t = 3.5
    assert s.handle({"op": "poll", "host": "a"})["state"] == "failed"


def test_a_hang_is_the_cause_before_the_exits_it_provokes():
    failures = [{"rank": 0, "how": "exit code 1", "t": 1.0}, {"rank": 3, "how": "hung", "hang": True, "t": 2.0,
                                                             "silent_since": 0.5},
                {"rank": 1, "how": "hung", "hang": True, "t": 2.1, "silent_since": 0.9}]
    assert cause(failures)["rank"] == 3
    echo = {"rank": 0, "how": "exit code 1 (a transport error)", "echo": True, "t": 0.5}
    own = {"rank": 1, "how": "exit code 1 (FaultInjected)", "t": 0.6}
    assert cause([echo, own])["rank"] == 1  # an error of its own, not the echo that came first
    stopped = {"rank": 2, "how": "hung (stopped)", "hang": True, "stopped": True, "t": 3.0, "silent_since": 0.7}
    assert cause(failures + [stopped])["rank"] == 2  # the stopped one, not those waiting for it


def test_fault_grammar():
    assert fault.parse("rank=2,step=30,kind=kill") == (fault.Fault(2, 30, "kill"),)
    f, g = fault.parse("rank=1,step=3,kind=raise,forever; rank=0,step=5,kind=kill,host,wipe")
    assert (f.forever, f.kind, g.host, g.wipe) == (True, "raise", True, True)
    assert fault.for_process(2, {"DPJAX_FAULT": "rank=2,step=30"}) == {30: fault.Fault(2, 30)}
    assert fault.for_process(2, {"DPJAX_FAULT": "rank=2,step=30", "DPJAX_RESTART": "1"}) == {}  # once
    assert fault.for_process(1, {"DPJAX_FAULT": "rank=2,step=30"}) == {}
    assert fault.parse("rank=1,step=end,kind=hang; rank=2,step=committed") == (
        fault.Fault(1, "end", "hang"), fault.Fault(2, "committed"))
    for bad in ("rank=2", "rank=2,step=3,kind=melt", "rank=x,step=3", "rank=1,step=2,sometimes", "rank=1,step=later"):
        with pytest.raises(UserError):
            fault.parse(bad)


@pytest.mark.parametrize("mesh,devices,want", [
    ("4x2", 4, "data=2,model=2"), ("4x2", 8, "4x2"), ("2x2x2", 4, "node=1,data=2,model=2"),
    ("-1x2", 4, "-1x2"), ("stage=2,data=4", 4, "stage=2,data=2"),
])
def test_the_mesh_for_the_devices_left(mesh, devices, want):
    assert fit_mesh(Settings(mesh=mesh), devices).mesh == want


def test_a_size_that_cannot_hold_the_mesh_is_one_line():
    with pytest.raises(UsageError, match="cannot be resized to 3 devices"):
        fit_mesh(Settings(mesh="4x2"), 3)


# what a stand-in process does: its heartbeat says the job ended (dpjax.train.elastic's marks),
# then rank 1 is killed and rank 0 hangs (a peer gone from jax.distributed's shutdown)
AFTER_END = """
import json, os, signal, time
with open(os.environ["DPJAX_HEARTBEAT"], "w") as fh:
    json.dump({"dispatched": 5, "completed": 5, "t": time.time(), "final": True, "ended": True}, fh)
if os.environ["DPJAX_PROCESS_ID"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def test_a_process_killed_after_the_end_ends_the_job_with_0_and_one_line(tmp_path):
    from dpjax.agent.rendezvous import free_port

    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "dpjax.agent", "--nproc-per-node", "2", "--rdzv",
                        f"127.0.0.1:{free_port()}", "--host-id", "h0", "--commit-dir", str(tmp_path), "--",
                        sys.executable, "-c", AFTER_END], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "dpjax.agent[h0]: done: the job finished in round 1; after its end rank 1 on host h0 failed: killed by signal "
        "SIGKILL (not restarted: every step was trained and committed)"), r.stderr
    assert "round 2" not in r.stderr and time.time() - t0 < 110  # rank 0's sleep (120 s) was not waited for


# a stand-in for `python -m dpjax.train` (a package run by -m): its package records when it was
# imported; round 1's rank 1 dies once the round trains, round 2 says when its package was imported
STANDIN_INIT = """
import os, time
IMPORTED_AT = time.time()
open(os.path.join(os.environ["STANDIN_OUT"], f"imported-{os.getpid()}"), "w").close()
"""
STANDIN_MAIN = """
import json, os, signal, time
import standin
rank, attempt, out = os.environ["DPJAX_PROCESS_ID"], os.environ["DPJAX_RESTART"], os.environ["STANDIN_OUT"]
def beat(**marks):
    with open(os.environ["DPJAX_HEARTBEAT"], "w") as fh:
        json.dump({"dispatched": 1, "completed": 1, "t": time.time(), **marks}, fh)
beat()
if attempt == "0":
    if rank == "1":
        # the agent starts the spares once the round trains: dies once they (and round 1's 2) imported
        t = time.time()
        while len([f for f in os.listdir(out) if f.startswith("imported-")]) < 4 and time.time() - t < 90:
            time.sleep(0.1)
        with open(os.path.join(out, "killed"), "w") as fh:
            fh.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
with open(os.path.join(out, f"r{rank}"), "w") as fh:
    json.dump({"imported_at": standin.IMPORTED_AT, "pid": os.getpid(), "argv": __import__("sys").argv[1:]}, fh)
beat(final=True, ended=True)
"""


def test_spares_are_the_restarted_processes_imported_before_the_failure(tmp_path):
    """--spares: once a round trains, the agent starts the next round's processes of a `python -m
    PACKAGE` command, which import the package and wait; the restart hands them their ranks, so
    the restarted processes had imported before the failure (and got the command's arguments)."""
    from dpjax.agent.rendezvous import free_port

    pkg = tmp_path / "standin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(STANDIN_INIT)
    (pkg / "__main__.py").write_text(STANDIN_MAIN)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root]), "STANDIN_OUT": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "dpjax.agent", "--nproc-per-node", "2", "--rdzv",
                        f"127.0.0.1:{free_port()}", "--host-id", "h0", "--commit-dir", str(tmp_path / "c"),
                        "--spares", "--", sys.executable, "-m", "standin", "--an", "argument"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "round 2 (restart 1 of at most 3)" in r.stderr and "rank 1 on host h0 failed: killed by signal SIGKILL" \
        in r.stderr, r.stderr
    killed = float((tmp_path / "killed").read_text())
    for rank in (0, 1):
        got = json.loads((tmp_path / f"r{rank}").read_text())
        assert got["imported_at"] < killed and got["argv"] == ["--an", "argument"], got


def test_the_agent_process_imports_no_jax():
    """`python -m dpjax.agent` starts and watches processes: its imports take no JAX (a lost host's
    restart starts a new agent, and JAX's import was 3-9 s of that restart at load); `import dpjax`
    in any other process is the whole API."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "dpjax.agent", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "dpjax.agent.supervisor" in imported and "dpjax.distributed.launchers" in imported, sorted(imported)
    assert not {m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "numpy")}, sorted(imported)
    r = subprocess.run([sys.executable, "-c", "import dpjax, sys; print(dpjax.jit.__module__, 'jax' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["dpjax.wrap.jit", "True"], r.stderr
    # the agent's process once a round needs its command's settings: JAX and dpjax.distributed's rooms then
    r = subprocess.run([sys.executable, "-c", AS_AGENT], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "True", "2", "gloo"], r.stderr


AS_AGENT = """
import sys
sys.orig_argv = [sys.executable, "-m", "dpjax.agent"]
from dpjax.agent import sizes
from dpjax.distributed import output  # a submodule asked for by name: not a JAX room's name
print("jax" in sys.modules)
s = sizes.train_settings([sys.executable, "-m", "dpjax.train", "--mesh", "4x2", "--batch-size", "16"])
print("jax" in sys.modules, sizes.choose(s, 1, 2, 2)[0])
from dpjax.distributed import COLLECTIVES
print(next(iter(COLLECTIVES)))
"""
