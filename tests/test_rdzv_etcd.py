"""The agents' rendezvous in etcd (`--rdzv etcd://...`, dpjax/agent/rendezvous_etcd.py) against a
3-member etcd cluster on 127.0.0.1 (tests/etcd_cluster.py): its state machine decides as the
built-in service's does, concurrent joins agree through compare-and-swap, a dead agent's lease
expires, and losing the host that started the job (its agent and its etcd member, the cluster's
leader) lets the other host go on alone. Beside it, the built-in rendezvous's host lost: the one-line
stop the docs describe; and an endpoint that does not answer: one line, exit 2, nothing written.

Every test starts processes (etcd members, agents): the file is extended, the training run slow.
The tests that need the etcd binary skip, saying so, where it is not installed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import pids_running
from etcd_cluster import MISSING, Cluster

pytestmark = pytest.mark.extended
needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason=MISSING)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DPJAX_FAULT")}, "PYTHONPATH": ROOT}


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("etcd") is None:
        pytest.skip(MISSING)
    c = Cluster()
    yield c
    c.close()


def _state(mn, mx, clock, lost_after=10.0):
    from dpjax.agent.rendezvous import State

    return State(mn, mx, 3, last_call=0.0, first_wait=60.0, lost_after=lost_after, clock=clock)


def _clients(cluster, job, hosts, lost_after=10.0, mn=2, mx=2):
    from dpjax.agent.rendezvous_etcd import EtcdRendezvous

    out = {}
    for h in hosts:
        out[h] = EtcdRendezvous(f"{cluster.spec}/{job}", h, lost_after)
        out[h].start(lambda clock: _state(mn, mx, clock, lost_after))
    return out


def _join(h, port, completed=None):
    return {"op": "join", "host": h, "addr": "127.0.0.1", "port": port, "nproc": 2, "completed": completed}


# a job's life as the agents tell it: a round, a failure on h1 (a killed rank), both rejoin, the end
SCRIPT = [_join("h1", 11), _join("h0", 10), {"op": "poll", "host": "h0"},
          {"op": "fail", "host": "h1", "round": 1, "rank": 3, "how": "killed by signal SIGKILL", "t": 5.0,
           "signal": True, "completed": 7},
          {"op": "poll", "host": "h0"}, _join("h0", 20, 6), _join("h1", 21, 7), {"op": "poll", "host": "h1"},
          {"op": "end", "host": "h0", "round": 2, "final": True}, {"op": "done", "host": "h0", "round": 2},
          {"op": "end", "host": "h1", "round": 2, "final": True}, {"op": "done", "host": "h1", "round": 2},
          {"op": "poll", "host": "h0"}]


@needs_etcd
def test_the_state_in_etcd_decides_as_the_built_in_service(cluster):
    reference = _state(2, 2, time.monotonic)  # the built-in service's, in this process
    clients = _clients(cluster, "script", ["h0", "h1"])
    for req in SCRIPT:
        want = reference.handle(dict(req))
        assert clients[req["host"]].request(dict(req)) == want, req
    assert want["state"] == "done" and want["round"] == 2 and want["last"]["completed"] == 7
    for c in clients.values():
        c.close()
    # the last agent out of a finished job deletes its state: the name can start a new job
    assert clients["h0"].etcd.get_prefix("/dpjax/script/") == {}


@needs_etcd
def test_concurrent_joins_agree_on_one_round(cluster):
    hosts = [f"h{i}" for i in range(6)]
    clients = _clients(cluster, "race", hosts, mn=6, mx=6)
    barrier, views = threading.Barrier(len(hosts)), {}

    def join(h):
        barrier.wait()  # every join at once: only compare-and-swap keeps each of them
        clients[h].request(_join(h, 30 + int(h[1:])))
        barrier.wait()  # every join answered: the round has formed, or a join was lost
        views[h] = clients[h].request({"op": "poll", "host": h})

    threads = [threading.Thread(target=join, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {v["round"] for v in views.values()} == {1} and {v["state"] for v in views.values()} == {"running"}
    assert all(v["members"] == hosts for v in views.values())
    assert sorted(v["node_rank"] for v in views.values()) == list(range(6))
    assert [views[h]["first_rank"] for h in hosts] == [0, 2, 4, 6, 8, 10] and views["h5"]["world"] == 12
    for c in clients.values():
        c.close()


@needs_etcd
def test_a_dead_agents_lease_expires_and_its_host_is_lost(cluster):
    clients = _clients(cluster, "lease", ["h0", "h1"], lost_after=2.0, mn=1)
    clients["h0"].request(_join("h0", 40))
    assert clients["h1"].request(_join("h1", 41))["state"] == "running"
    t0 = time.time()
    while time.time() - t0 < 8:  # past any TTL etcd grants (its minimum is 1.5 election timeouts: 4 s here)
        clients["h0"].beat(1.0)
        clients["h1"].beat(1.0)
        assert clients["h1"].request({"op": "poll", "host": "h1"})["state"] == "running"  # beats keep h0
        time.sleep(0.5)
    stopped = time.time()  # h0's agent dies: no more beats, no leave
    while True:
        clients["h1"].beat(1.0)
        view = clients["h1"].request({"op": "poll", "host": "h1"})
        if view["state"] != "running" or time.time() - stopped > 30:
            break
        time.sleep(0.25)
    assert view["state"] == "failed" and view["failures"][0]["line"] == "host h0 lost (its agent is silent)", view
    assert 1.5 <= time.time() - stopped < 12  # its lease's TTL: at least the 2 s asked, at most etcd's 4 s + a poll
    clients["h1"].close()


@needs_etcd
def test_an_endpoint_of_several_that_does_not_answer_is_passed_over(cluster):
    from dpjax.agent.rendezvous import free_port
    from dpjax.agent.rendezvous_etcd import EtcdRendezvous

    dead = f"127.0.0.1:{free_port()}"
    client = EtcdRendezvous(f"etcd://{dead},{','.join(cluster.endpoints)}/partial", "h0", 10.0)
    assert client.unanswered == [f"{dead} ([Errno 111] Connection refused)"]
    client.start(lambda clock: _state(1, 1, clock))
    assert client.request(_join("h0", 50))["members"] == ["h0"]
    client.etcd.current = 0  # the silent one first: the request goes on to the next
    assert client.request({"op": "poll", "host": "h0"})["state"] == "running" and client.etcd.current == 1
    client.close()


def _agents(tmp, spec, command, hosts=2, extra=()):
    cmd = [sys.executable, "-m", "dpjax.agent", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv", spec,
           "--rdzv-wait", "60", *extra]
    out = []
    for i in range(hosts):
        log = open(tmp / f"agent{i}.err", "w")
        out.append(subprocess.Popen([*cmd, "--commit-dir", str(tmp / f"c{i}"), "--host-id", f"h{i}", "--",
                                     *command], env=ENV, stdout=subprocess.DEVNULL, stderr=log))
        if i == 0 and not spec.startswith("etcd://"):  # h0 runs the built-in rendezvous
            _wait_listening(spec)
    return out


def _wait_listening(spec, timeout=60):
    import socket

    host, port = spec.rsplit(":", 1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no rendezvous at {spec}")


def _wait_for(path, text, proc, timeout=300, every=0.1):
    """Seconds until `text` is in the file at `path` (where `proc` writes)."""
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if text in path.read_text():
            return time.time() - t0
        time.sleep(every)
    if text in path.read_text():
        return time.time() - t0
    raise AssertionError(f"{text!r} not in {path} after {time.time() - t0:.0f} s (exit code {proc.poll()}): "
                         f"{path.read_text()}")


# a stand-in process: the first attempt runs until it is stopped, a restart's ends at once (the job done)
STAND_IN = "import os, time\nif os.environ['DPJAX_RESTART'] == '0':\n    time.sleep(600)\n"


def _kill_host_zero(agents, tmp):
    """h0's agent SIGKILLed once both agents run round 1 (its process dies with it)."""
    for i in range(2):
        _wait_for(tmp / f"agent{i}.err", "round 1:", agents[i], timeout=120)
    agents[0].kill()
    agents[0].wait()
    return time.time()


@needs_etcd
def test_the_rendezvous_host_lost_with_etcd_the_other_host_goes_on(tmp_path):
    c, agents = Cluster(), []
    try:
        c.make_leader(0)  # h0's member leads: its loss is the cluster's worst case
        agents = _agents(tmp_path, c.spec + "/lost", [sys.executable, "-c", STAND_IN, str(tmp_path)])
        killed = _kill_host_zero(agents, tmp_path)
        c.kill(0)
        took = _wait_for(tmp_path / "agent1.err", "round 2", agents[1], timeout=120)
        assert agents[1].wait(timeout=120) == 0
    finally:
        for a in agents:
            a.kill()
        c.close()
    err = (tmp_path / "agent1.err").read_text().strip().splitlines()
    assert err[-2] == ("dpjax.agent[h1]: round 2 (restart 1 of at most 3): hosts h1 (1 processes, ranks 0..0 here), "
                       "after host h0 failed: agent silent for 10 s (host lost)"), err
    assert err[-1] == "dpjax.agent[h1]: done: the job finished in round 2", err
    # the lease of --host-timeout 10 s, extended by the new leader's election (2.5 s timeouts here), a
    # request timed out on a member without a leader, a poll: h1's round 2 about 20 s after the kill
    assert 9 <= time.time() - killed and took < 45, took
    print(f"etcd: h1 in round 2 {took:.1f} s after h0's agent and the etcd leader were killed")
    assert pids_running(str(tmp_path)) == []


def test_the_rendezvous_host_lost_built_in_is_the_one_line_stop(tmp_path):
    from dpjax.agent.rendezvous import free_port

    spec = f"127.0.0.1:{free_port()}"
    agents = _agents(tmp_path, spec, [sys.executable, "-c", STAND_IN, str(tmp_path)])
    try:
        _kill_host_zero(agents, tmp_path)
        t0 = time.time()
        assert agents[1].wait(timeout=120) == 1
    finally:
        for a in agents:
            a.kill()
    err = (tmp_path / "agent1.err").read_text().strip().splitlines()
    assert err[-1] == (f"dpjax.agent[h1]: the rendezvous at {spec} cannot be reached (its host is lost, or it "
                       "finished); stopping this host's processes"), err
    assert 5 < time.time() - t0 < 40  # the docs: "the other agents stop with one line after 10 s"
    assert pids_running(str(tmp_path)) == []


@pytest.mark.parametrize("entry", ["dpjax.agent", "dpjax.launch"])
def test_an_etcd_endpoint_that_does_not_answer_is_one_line(tmp_path, entry):
    from dpjax.agent.rendezvous import free_port

    port = free_port()  # nothing listens there
    r = subprocess.run([sys.executable, "-m", entry, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv",
                        f"etcd://127.0.0.1:{port}/bad", "--commit-dir", str(tmp_path / "c"), "--",
                        sys.executable, "-c", "pass"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [f"dpjax.agent: no etcd endpoint of --rdzv etcd://127.0.0.1:{port}/bad "
                                     f"answers: 127.0.0.1:{port} ([Errno 111] Connection refused)"], r.stderr
    assert os.listdir(tmp_path) == []  # nothing written: no commit folder
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "dpjax-agent-etcd-bad-logs"))


def test_a_malformed_etcd_rdzv_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dpjax.agent", "--rdzv", "etcd://127.0.0.1:2379,hostonly", "--",
                        sys.executable, "-c", "pass"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "'hostonly' is not HOST:PORT" in r.stderr, r.stderr


def _metrics_rows(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@needs_etcd
@pytest.mark.slow
def test_etcd_host_lost_mid_training_the_other_host_finishes_at_its_size(corpus, tmp_path):
    steps, metrics = 40, tmp_path / "m.jsonl"
    train = [sys.executable, "-m", "dpjax.train", "--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads",
             "2", "--seq-len", "16", "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches",
             "1", "--progress", "none", "--mesh", "2x2", "--steps", str(steps), "--metrics", str(metrics)]
    c, agents = Cluster(), []
    try:
        c.make_leader(0)
        agents = _agents(tmp_path, c.spec + "/train", train, extra=("--devices-per-process", "2"))
        while not (metrics.exists() and any(r.get("step", 0) >= 8 for r in _metrics_rows(metrics))):
            assert agents[0].poll() is None and agents[1].poll() is None
            time.sleep(0.05)
        agents[0].kill()  # the host that started the job: its agent (its process dies with it) ...
        c.kill(0)  # ... and its etcd member, the leader
        killed = time.time()
        took = _wait_for(tmp_path / "agent1.err", "round 2", agents[1], timeout=300)
        codes = [a.wait(timeout=600) for a in agents]
    finally:
        for a in agents:
            a.kill()
        c.close()
    err1 = (tmp_path / "agent1.err").read_text()
    assert codes == [-signal.SIGKILL, 0], err1
    assert "round 2 (restart 1 of at most 3): hosts h1 (1 processes, ranks 0..0 here), after host h0 failed" in err1
    rows = _metrics_rows(metrics)
    (ev,) = [r for r in rows if r.get("event") == "restart"]
    # at its size: one process of 2 devices, the data axis 1, the 16 sequences a step in 2 passes of 8
    assert ev["processes"] == 1 and ev["mesh"] == {"data": 1, "model": 2} and ev["global_batch"] == 16, ev
    # h0's own commit folder went with it: its state came from the copy its neighbour h1 held
    assert all(src.startswith("h1/") for src in ev["from"].values()), ev["from"]
    applied = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(applied) == list(range(1, steps + 1))
    assert [applied[s]["cursor"] for s in range(1, steps + 1)] == [16 * s for s in range(steps)]
    print(f"etcd, training: h1 in round 2 {took:.1f} s after the kill, its first step {ev['seconds_lost']} s after "
          f"the failure (restart_s {ev['restart_s']}), {time.time() - killed:.0f} s to the job's end")
    assert pids_running(str(tmp_path)) == []
