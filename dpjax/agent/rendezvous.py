"""The rendezvous: a small TCP service where the agents (one per host) meet, agree on a
job's membership, hear of each other's failures and of the end.

The first agent that can listen on --rdzv HOST:PORT runs it (a thread); every agent,
that one too, talks to it as a client: one JSON request per connection, one JSON
answer (torchrun's c10d rendezvous is the same idea on a TCP store). A TCP service
rather than a file in a shared folder because hosts share a network, not always a file
system; on one machine (the tests: agents on 127.0.0.1 standing for hosts) it is the
same code.

Rounds: agents `join`; a round forms once at least MIN hosts have joined and either
MAX have, or every live host has and none joined for `last_call` seconds (the first
round waits up to `first_wait` for MAX, and a job left with fewer than MIN live hosts waits as
long for them to come back before it gives up). A round's members get node ranks in the order
of their names (a restarted host keeps its place) and the coordinator address
of node 0. Agents `poll` every fraction of a second; one silent for `lost_after`
seconds has lost its host and is dropped (a running round with it fails). Sooner when
the kernel says so: each agent also `hold`s one connection open, and when it closes
without a `leave` (the agent's process died: a SIGKILLed process's sockets close, on
any host whose kernel still runs) its host is lost at once; a host gone silent (power,
network) keeps no kernel to close it and is found by the timeout. An agent started
again on a host whose round still runs (`join` with another agent id) is that host's
loss too: its old agent is gone. A `fail` ends the running round for everyone; more
than `max_restarts` failures end the job.

The end: an agent says `end` once its processes have all made their last commit
(`final`) or one of them saw every process's (`ended`). Once every member host is
final, or one says ended, the job has trained and committed every step: a failure
from then on (a process, a hang, a lost host) is after its end, kept in `after_end`,
and the round is done, not failed (a failure heard before the news is taken back).
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
import uuid

from dpjax.agent.rendezvous_etcd import EtcdRendezvous

# An agent's own thread says it lives every second (supervisor.ALIVE_S); 3 s of silence was
# seen from a live agent on a 2-core machine at load 40, so the default is --host-timeout 10
LOST_AFTER_S = 10.0


class State:
    """The service's state (pure: `handle(request) -> answer`, given the time)."""

    def __init__(self, min_hosts: int, max_hosts: int, max_restarts: int, last_call: float = 1.0,
                 first_wait: float = 60.0, lost_after: float = LOST_AFTER_S, clock=time.monotonic):
        # first_wait serves twice: how long the first round waits for MAX hosts, and how long a job
        # that a failure left with fewer than MIN live hosts waits for them to come back (a host
        # restarted or replaced: its new agent's start alone takes tens of seconds on a loaded machine)
        self.min, self.max, self.max_restarts = min_hosts, max_hosts, max_restarts
        self.last_call, self.first_wait, self.lost_after, self.clock = last_call, first_wait, lost_after, clock
        self.seen: dict = {}  # host -> last time heard from
        self.order: list = []  # every host that ever joined, by name
        self.waiting: dict = {}  # host -> {"addr", "port", "nproc", "at"} joined for the next round
        self.round, self.state, self.members, self.coordinator = 0, "forming", [], None
        self.failures: list = []  # of the current round
        self.restarts, self.done, self.started = 0, set(), clock()
        # the furthest step the last job had completed; its failures
        self.reached, self.last, self.failed_at = -1, None, 0.0
        self.why = None  # why the job was given up, when not for --max-restarts
        self.final, self.ended, self.after_end = set(), False, []  # the round's end (see the module's text)
        self.agents, self.holds = {}, {}  # host -> the id of its agent in the round; of its held connection
        self.lock = threading.Lock()

    def handle(self, req: dict) -> dict:
        with self.lock:
            now, host = self.clock(), req.get("host")
            if host is not None:
                self.seen[host] = now
            getattr(self, "_" + req["op"])(req, now)
            self._tick(now)
            return self._view(host)

    def _join(self, req, now):
        host = req["host"]
        if self.state == "running" and host in self.members and req.get("agent") is not None and \
                self.agents.get(host) not in (None, req["agent"]):  # a new agent: the round's is dead
            self._lost(host, now, "agent started again (host lost)", f"host {host} lost (its agent was started "
                       "again)")
            self.seen[host] = now  # the new agent lives
        if host not in self.order:  # sorted by name: node ranks do not depend on who was quicker
            self.order = sorted([*self.order, host])
        self.waiting[host] = {"addr": req["addr"], "port": req["port"], "nproc": req["nproc"], "at": now,
                              "agent": req.get("agent")}
        if req.get("completed") is not None:  # how far its processes got in the job that ended
            self.reached = max(self.reached, req["completed"])

    def _poll(self, req, now):
        pass

    def _hold(self, req, now):  # the connection the service keeps open until the agent's process ends
        self.holds[req["host"]] = req["agent"]

    def gone(self, host: str, agent: str) -> None:
        """An agent's held connection closed: lost at once, unless it left first or a
        newer agent of the same host holds one now."""
        with self.lock:
            now = self.clock()
            if self.holds.get(host) == agent:
                del self.holds[host]
                self._lost(host, now, "agent gone: its connection closed (host lost)",
                           f"host {host} lost (its agent's connection closed)")
                self._tick(now)

    def _lost(self, host, now, how, line):
        self.seen.pop(host, None)
        self.waiting.pop(host, None)
        if self.state in ("running", "failed") and host in self.members:  # a cause, or the cause
            self._fail({"round": self.round, "host": host, "how": how, "line": line, "t": time.time()}, now)

    def _fail(self, req, now):
        if req.get("round") != self.round:
            return
        self._end(req, now)  # how far the failing host's processes got
        failure = {k: req[k] for k in ("host", "rank", "how", "line", "t", "signal", "hang", "stopped",
                                       "silent_since", "user_error", "echo") if k in req}
        if self.ended and self.state in ("running", "done"):
            self.after_end.append(failure)
            self.state = "done"
        elif self.state in ("running", "failed"):
            self.failures.append(failure)
            if self.state == "running":
                self.state, self.failed_at = "failed", now
                self.restarts += 1

    def _end(self, req, now):
        if req.get("round") != self.round:
            return
        if req.get("final"):
            self.final.add(req["host"])
        if req.get("ended") or (self.members and self.final >= set(self.members)):
            self.ended = True
        if self.ended and self.state == "failed":  # its failures came before the news: after the end
            self.state, self.after_end, self.failures = "done", self.after_end + self.failures, []
            self.restarts -= 1

    def _done(self, req, now):
        if req.get("round") == self.round and self.state == "running":
            self.done.add(req["host"])
            if self.done >= set(self.members):
                self.state = "done"

    def _leave(self, req, now):  # an agent that gives up or is interrupted
        self.seen.pop(req["host"], None)
        self.waiting.pop(req["host"], None)
        self.holds.pop(req["host"], None)

    def _tick(self, now):
        for host, t in list(self.seen.items()):
            if now - t > self.lost_after:  # its agent is gone: so is its host
                self._lost(host, now, f"agent silent for {self.lost_after:g} s (host lost)",
                           f"host {host} lost (its agent is silent)")
        if self.state == "failed" and self.restarts > self.max_restarts:
            self.state = "gave_up"
        if self.state == "failed" and any(f.get("user_error") for f in self.failures):
            # exit code 2 is a one-line user error (dpjax's CLIs): the same again would fail the same way
            self.state, self.why = "gave_up", "a process stopped with a user error (exit code 2)"
        if self.state == "failed" and len(self.seen) < self.min and now - self.failed_at > self.first_wait:
            self.state, self.why = "gave_up", f"{len(self.seen)} hosts left, fewer than MIN {self.min}"
        if self.state not in ("forming", "failed"):
            return
        live = {h for h in self.seen}
        ready = [h for h in self.order if h in self.waiting and h in live]
        if len(ready) < self.min:
            return
        newest = max(self.waiting[h]["at"] for h in ready)
        first = self.round == 0
        if len(ready) >= self.max or (not first and set(ready) >= live and now - newest >= self.last_call) or \
                (first and now - self.started >= self.first_wait and now - newest >= self.last_call):
            self._start(ready[:self.max], now)

    def _start(self, hosts, now):
        if self.round:
            self.last = {"failures": self.failures, "completed": self.reached}
        self.round += 1
        self.reached = -1
        self.state, self.members, self.failures, self.done = "running", list(hosts), [], set()
        self.final, self.ended, self.after_end = set(), False, []
        head = self.waiting[hosts[0]]
        self.coordinator = f"{head['addr']}:{head['port']}"
        self.nproc = {h: self.waiting[h]["nproc"] for h in hosts}
        self.agents = {h: self.waiting[h].get("agent") for h in hosts}
        for h in hosts:
            del self.waiting[h]

    def _view(self, host) -> dict:
        out = {"round": self.round, "state": self.state, "members": self.members, "restarts": self.restarts,
               "max_restarts": self.max_restarts, "failures": self.failures, "coordinator": self.coordinator,
               "last": self.last, "why": self.why, "after_end": self.after_end}
        if host in self.members:
            i = self.members.index(host)
            out.update(node_rank=i, first_rank=sum(self.nproc[h] for h in self.members[:i]),
                       world=sum(self.nproc.values()))
        return out


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        line = self.rfile.readline()
        if line:
            req = json.loads(line)
            answer = self.server.state.handle(req)
            self.wfile.write((json.dumps(answer) + "\n").encode())
            if req["op"] == "hold":  # kept open until the agent's end: then the kernel closes it
                try:
                    while self.rfile.read(1):
                        pass
                except OSError:
                    pass
                self.server.state.gone(req["host"], req["agent"])


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(host: str, port: int, state: State):
    """Starts the service on host:port in a thread; the server, or None when the port is
    taken (another agent runs it)."""
    try:
        server = _Server((host, port), _Handler)
    except OSError:
        return None
    server.state = state
    threading.Thread(target=server.serve_forever, daemon=True, name="dpjax-rdzv").start()
    return server


def request(host: str, port: int, req: dict, timeout: float = 5.0) -> dict:
    """One request to the service; OSError when it cannot be reached."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall((json.dumps(req) + "\n").encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("the rendezvous closed the connection")
            data += chunk
    return json.loads(data)


def local_address(host: str, port: int) -> str:
    """The address of this machine that the rendezvous host reaches it by."""
    with socket.create_connection((host, port), timeout=5.0) as s:
        return s.getsockname()[0]


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class TcpRendezvous:
    """The built-in rendezvous as an agent uses it: the service on HOST:PORT (run by the
    first agent that can listen there) and requests to it. The etcd one
    (`rendezvous_etcd.EtcdRendezvous`) has the same face."""

    def __init__(self, spec: str, host: str):
        self.where, self.host = spec, host
        self.addr, self.port = spec.rsplit(":", 1)[0], int(spec.rsplit(":", 1)[1])
        self.tag = str(self.port)  # names the agent's default commit and log folders
        self.server, self.unanswered = None, []
        self.instance, self.held = uuid.uuid4().hex, None  # this agent's id; its held connection

    def start(self, make_state) -> None:
        """Runs the service here if no other agent does; `make_state(clock)` makes its state."""
        if self.server is None:
            self.server = serve(self.addr, self.port, make_state(time.monotonic))

    def request(self, req: dict, timeout: float = 5.0) -> dict:
        return request(self.addr, self.port, req, timeout)

    def beat(self, timeout: float) -> None:
        """Says this agent lives (its silence is a lost host); holds a connection open
        first, which the kernel closes when this process ends, however it ends."""
        if self.held is None:
            held = socket.create_connection((self.addr, self.port), timeout=timeout)
            try:
                held.sendall((json.dumps({"op": "hold", "host": self.host, "agent": self.instance}) + "\n").encode())
                if not held.recv(65536):  # the answer: the service holds it now
                    raise ConnectionError("the rendezvous closed the connection")
            except OSError:
                held.close()
                raise
            self.held = held
        self.request({"op": "poll", "host": self.host}, timeout)

    def local_address(self) -> str:
        return local_address(self.addr, self.port)

    def close(self, linger: float = 0.5) -> None:
        if self.held is not None:
            self.held.close()
        if self.server is not None:
            time.sleep(linger)  # the others hear how it ended before the service goes
            self.server.shutdown()


def connect(spec: str, host: str, lost_after: float):
    """The rendezvous `--rdzv` names: `etcd://H1:P,H2:P,...[/JOB]` (`rendezvous_etcd`), or
    HOST:PORT (the built-in service). An etcd cluster none of whose endpoints answers is
    a UserError (one line, before anything starts)."""
    if spec.startswith("etcd://"):
        return EtcdRendezvous(spec, host, lost_after)
    return TcpRendezvous(spec, host)
