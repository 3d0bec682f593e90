"""A lost host found when the kernel says so, not after --host-timeout (issue 51, the
chaos soak's host fault): an agent's process that dies closes the connection it holds
open to the built-in rendezvous, and an agent started again on a host whose round still
runs replaces a dead one. A host gone silent (no kernel left to close anything) is still
found by the timeout (tests/test_heartbeat.py)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from dpjax.agent import rendezvous
from dpjax.agent.rendezvous import State, TcpRendezvous

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DPJAX_FAULT")}, "PYTHONPATH": ROOT}
LONG = 60.0  # --host-timeout in these tests: anything found sooner was not found by it

# a stand-in agent (no dpjax import: a bare process): holds its connection as the agent's thread
# does, joins, says so, sleeps until it is killed
HOLDER = """import json, socket, sys, time
addr, port = sys.argv[1], int(sys.argv[2])
held = socket.create_connection((addr, port))
held.sendall((json.dumps({"op": "hold", "host": "h1", "agent": "A"}) + "\\n").encode())
held.recv(65536)
with socket.create_connection((addr, port)) as s:
    join = {"op": "join", "host": "h1", "addr": addr, "port": 1, "nproc": 1, "agent": "A"}
    s.sendall((json.dumps(join) + "\\n").encode())
    s.recv(65536)
print("joined", flush=True)
time.sleep(600)
"""


def _join(s, host, agent):
    return s.handle({"op": "join", "host": host, "addr": "127.0.0.1", "port": 1, "nproc": 1, "agent": agent})


def _until(pred, limit):
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < limit:
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_killed_agents_host_is_lost_at_once_not_after_the_timeout():
    state = State(2, 2, max_restarts=3, lost_after=LONG)
    port = rendezvous.free_port()
    server = rendezvous.serve("127.0.0.1", port, state)
    p = subprocess.Popen([sys.executable, "-c", HOLDER, "127.0.0.1", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "joined\n"
        assert _join(state, "h0", "B")["state"] == "running"
        p.send_signal(signal.SIGKILL)
        took = _until(lambda: state.state == "failed", 10.0)
        assert state.state == "failed", state.failures
        assert [f["line"] for f in state.failures] == ["host h1 lost (its agent's connection closed)"]
        assert "h1" not in state.seen and took < 5.0  # not the 60 s of silence
    finally:
        p.kill()
        p.wait()
        server.shutdown()


def test_the_agents_beat_holds_the_connection_and_a_leave_or_a_newer_agent_is_no_loss():
    state = State(2, 2, max_restarts=3, lost_after=LONG)
    port = rendezvous.free_port()
    server = rendezvous.serve("127.0.0.1", port, state)
    agents = [TcpRendezvous(f"127.0.0.1:{port}", h) for h in ("h0", "h1", "h1")]
    try:
        for a in agents[:2]:
            a.beat(5.0)
            a.request({"op": "join", "host": a.host, "addr": "127.0.0.1", "port": 1, "nproc": 1,
                       "agent": a.instance})
        assert state.handle({"op": "poll"})["members"] == ["h0", "h1"]
        agents[0].request({"op": "leave", "host": "h0"})
        agents[0].close()  # left first: its connection's end is no loss
        agents[2].beat(5.0)  # a newer agent of h1 holds one now (its old one's end is not the host's)
        agents[1].close()
        time.sleep(0.5)
        assert state.state == "running" and state.failures == []
        agents[2].held.shutdown(socket.SHUT_RDWR)  # what the kernel does when the agent's process dies
        _until(lambda: state.state == "failed", 5.0)
        assert [f["line"] for f in state.failures] == ["host h1 lost (its agent's connection closed)"]
    finally:
        for a in agents:
            a.close(linger=0)
        server.shutdown()


def test_an_agent_started_again_on_a_host_of_the_running_round_is_that_hosts_loss():
    s = State(2, 2, max_restarts=3, lost_after=LONG)
    _join(s, "h0", "A"), _join(s, "h1", "B")
    assert s.state == "running"
    assert _join(s, "h1", "B")["state"] == "running"  # its own agent (nothing new): no loss
    v = _join(s, "h1", "C")  # a new agent: the round's h1 agent is dead, its processes with it
    assert (v["state"], v["restarts"]) == ("failed", 1)
    assert [f["line"] for f in v["failures"]] == ["host h1 lost (its agent was started again)"]
    v = _join(s, "h0", "A")  # both in the next round, the new agent of h1 with it
    assert (v["round"], v["state"], v["members"]) == (2, "running", ["h0", "h1"])
    assert s.agents == {"h0": "A", "h1": "C"}


# the stand-in command: the first attempt runs until it is stopped, a restart's ends at once (the job done)
STAND_IN = "import os, time\nif os.environ['DPJAX_RESTART'] == '0':\n    time.sleep(600)\n"


def _agent(tmp, spec, host, nnodes):
    log = open(tmp / f"agent-{host}.err", "a")
    return subprocess.Popen([sys.executable, "-m", "dpjax.agent", "--nnodes", nnodes, "--nproc-per-node", "1",
                             "--rdzv", spec, "--rdzv-wait", "60", "--host-timeout", str(LONG), "--commit-dir",
                             str(tmp / f"c-{host}"), "--host-id", host, "--", sys.executable, "-c", STAND_IN],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=log)


def _wait_for(path, text, limit=120):
    t0 = time.time()
    while time.time() - t0 < limit:
        if path.exists() and text in path.read_text():
            return time.time() - t0
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {limit} s: {path.read_text() if path.exists() else ''}")


def _job(tmp, spec, nnodes):
    agents = {"h0": _agent(tmp, spec, "h0", nnodes)}
    if not spec.startswith("etcd://"):
        while socket.socket().connect_ex(("127.0.0.1", int(spec.rsplit(":", 1)[1]))):
            time.sleep(0.1)
    agents["h1"] = _agent(tmp, spec, "h1", nnodes)
    for h in agents:
        _wait_for(tmp / f"agent-{h}.err", "round 1:")
    return agents


@pytest.mark.extended
def test_agents_the_host_of_a_killed_agent_is_dropped_at_once(tmp_path):
    """Built-in: h1's agent SIGKILLed (its stand-in with it, h0's sleeps on) and never back:
    h0 goes on alone long before --host-timeout 60."""
    spec = f"127.0.0.1:{rendezvous.free_port()}"
    agents = _job(tmp_path, spec, "1:2")
    try:
        agents["h1"].kill()
        agents["h1"].wait()
        took = _wait_for(tmp_path / "agent-h0.err", "round 2", limit=LONG)
        assert agents["h0"].wait(timeout=60) == 0
    finally:
        for a in agents.values():
            a.kill()
    err = (tmp_path / "agent-h0.err").read_text().strip().splitlines()
    assert err[-2] == ("dpjax.agent[h0]: round 2 (restart 1 of at most 3): hosts h0 (1 processes, ranks 0..0 here), "
                       "after host h1 failed: agent gone: its connection closed (host lost)"), err
    assert took < 15, took


def _started_again(tmp, spec):
    """h1's agent SIGKILLed and started again at once (h0's stand-in sleeps on: nothing else
    fails): the new agent's join ends the round; both go on in round 2 (the job done)."""
    agents = _job(tmp, spec, "2:2")
    try:
        agents["h1"].kill()
        agents["h1"].wait()
        agents["h1"] = _agent(tmp, spec, "h1", "2:2")
        took = _wait_for(tmp / "agent-h0.err", "round 2", limit=LONG)
        assert [agents[h].wait(timeout=60) for h in ("h0", "h1")] == [0, 0]
    finally:
        for a in agents.values():
            a.kill()
    return took, (tmp / "agent-h0.err").read_text().strip().splitlines()


@pytest.mark.extended
def test_agents_an_agent_started_again_ends_the_round_its_old_one_ran(tmp_path):
    took, err = _started_again(tmp_path, f"127.0.0.1:{rendezvous.free_port()}")
    # the connection's close or the new agent's join, whichever the service hears first
    assert "round 2 (restart 1 of at most 3): hosts h0,h1 (2 processes, ranks 0..0 here), after host h1 failed: " \
           "agent " in err[-2] and "(host lost)" in err[-2], err
    assert took < 30, took


@pytest.mark.extended
@pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary")
def test_agents_with_etcd_an_agent_started_again_ends_the_round_its_old_one_ran(tmp_path):
    from etcd_cluster import Cluster

    c = Cluster()
    try:
        took, err = _started_again(tmp_path, c.spec + "/again")
    finally:
        c.close()
    assert err[-2] == ("dpjax.agent[h0]: round 2 (restart 1 of at most 3): hosts h0,h1 (2 processes, ranks 0..0 "
                       "here), after host h1 failed: agent started again (host lost)"), err
    assert took < 30, took  # the lease of 60 s has not expired: its join said so
    print(json.dumps({"etcd_round_2_after_s": round(took, 1)}))
