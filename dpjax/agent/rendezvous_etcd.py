"""The rendezvous kept in an etcd cluster (`--rdzv etcd://H1:P,H2:P,H3:P[/JOB]`), so that
it survives the host that started the job: with 3 members, losing any one host, its
agent and its etcd member is an ordinary host loss (torchrun's etcd rendezvous does the
same for its agents).

The same state machine as the built-in service decides (`rendezvous.State`: rounds,
membership, failures, the end); only where it lives differs. Its state is one JSON
value at /dpjax/JOB/state; each request reads it, applies the request and, when that
changed it, writes it back with a compare-and-swap on its revision: of two agents
writing at once one wins and the other reads again and re-applies its request, so every
decision (a round's members and world, a failure's restart) is taken on the state as it
stands. A request that changes nothing (most of an agent's polls) writes nothing.

Liveness is etcd's, not a clock's: each agent holds a lease of --host-timeout seconds
with a key /dpjax/JOB/alive/HOST on it, renewed every second by its own thread; a dead
agent's lease expires and its key goes with it, and the state machine takes a host
whose key is gone for a host silent past --host-timeout (lost). The state's other times
(the first round's wait, the last call after a failure) are wall-clock seconds, taken
on whichever host's agent applies a request: hosts' clocks must agree to within a
fraction of --rdzv-last-call (NTP does).

A job's name (JOB, default `dpjax`) is its identity, as torchrun's --rdzv-id: agents
started again with the same name after all of a job's agents were killed continue that
job (its commits restore); the last agent out of a finished job deletes its state, and
a finished job's state that no live agent holds is replaced by the next job's first.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

from dpjax.agent.etcd_v3 import Etcd, Unreachable
from dpjax.errors import UserError

ENDPOINT = re.compile(r"[A-Za-z0-9.\-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}")
JOB = re.compile(r"[A-Za-z0-9._\-]+")
ENDED = ("done", "gave_up")  # a job's state once its agents have left it


def parse(text: str) -> tuple[list[str], str]:
    """`etcd://H1:P,H2:P,H3:P[/JOB]` -> (["H1:P", ...], JOB); ValueError saying what is wrong."""
    rest = text[len("etcd://"):]
    hosts, _, job = rest.partition("/")
    endpoints = hosts.split(",")
    bad = [e for e in endpoints if not ENDPOINT.fullmatch(e)]
    if bad or not hosts:
        raise ValueError(f"expected etcd://HOST:PORT[,HOST:PORT...][/JOB], got {text!r}"
                         + (f" ({bad[0]!r} is not HOST:PORT)" if bad and bad[0] else ""))
    job = job or "dpjax"
    if not JOB.fullmatch(job):
        raise ValueError(f"the job name {job!r} in {text!r} may hold letters, digits, '.', '_' and '-' only")
    return endpoints, job


def dump(state) -> str:
    """The state machine as stored: its fields, sets as sorted lists, the hosts seen
    without their times (etcd's leases say who lives), its lock and clock left out."""
    out = {}
    for k, v in vars(state).items():
        if k in ("lock", "clock"):
            continue
        out[k] = sorted(v) if k == "seen" or isinstance(v, set) else v
    return json.dumps(out, sort_keys=True)


def load(text: str, fresh, alive: set, now: float):
    """The state machine `dump` stored, into `fresh` (a new State of the same class):
    the hosts whose lease holds are seen now, the others long ago (the machine drops
    them as lost at its next tick)."""
    fields = json.loads(text)
    kinds = vars(fresh)
    for k, v in fields.items():
        if k == "seen":
            v = {h: (now if h in alive else float("-inf")) for h in v}
        elif isinstance(kinds.get(k), set):
            v = set(v)
        setattr(fresh, k, v)
    return fresh


class EtcdRendezvous:
    """The agents' rendezvous in etcd; the same face as the built-in one
    (`rendezvous.TcpRendezvous`): start, request, beat, local_address, close."""

    def __init__(self, spec: str, host: str, lost_after: float, timeout: float = 2.0):
        endpoints, self.job = parse(spec)
        self.where, self.host, self.ttl = spec, host, lost_after
        self.tag = f"etcd-{self.job}"  # names the agent's default commit and log folders, as the port does
        self.etcd = Etcd(endpoints, timeout)
        self.prefix = f"/dpjax/{self.job}/"
        self.key, self.alive_key = self.prefix + "state", f"{self.prefix}alive/{host}"
        self.lease, self.make, self.joined, self.closed = 0, None, False, False
        self.instance = uuid.uuid4().hex  # this agent's id (a new agent of a host in a running round: its loss)
        ok, bad = self.etcd.answering()
        if not ok:  # the command line's mistake, or no cluster running: nothing is started
            raise UserError(f"no etcd endpoint of --rdzv {spec} answers: {'; '.join(bad)}")
        self.unanswered = bad  # a lost member is survivable; the agent says which
        self.etcd.current = endpoints.index(ok[0])  # not the silent one first at every request

    def start(self, make_state) -> None:
        """`make_state(clock)`: a new state machine, for a job that has none stored yet."""
        self.make = make_state
        self._hold()

    def _hold(self) -> None:
        """A new lease and this host's alive key on it."""
        self.lease = self.etcd.grant(self.ttl)
        self.etcd.put(self.alive_key, self.host, lease=self.lease)

    def beat(self, timeout: float) -> None:
        """Renews this agent's lease; a lease that expired (an agent silent too long: its
        host was taken for lost) is taken out again, as the built-in's next poll is heard."""
        if not self.etcd.keepalive(self.lease, timeout) and not self.closed:
            self._hold()

    def _read(self, timeout):
        kvs = self.etcd.get_prefix(self.prefix, timeout)
        alive = {k.rsplit("/", 1)[1] for k in kvs if k.startswith(self.prefix + "alive/")}
        return kvs.get(self.key, (None, 0)), alive

    def request(self, req: dict, timeout: float = 5.0) -> dict:
        """One request to the state machine: the answer as the built-in service gives it.
        OSError (Unreachable) when no member of the cluster answers."""
        timeout = min(timeout, self.etcd.timeout)
        while True:
            (text, revision), alive = self._read(timeout)
            now = time.time()
            state = self.make(time.time)
            if text is not None:
                load(text, state, alive, now)
                if not self.joined and req["op"] == "join" and state.state in ENDED and alive <= {self.host}:
                    state = self.make(time.time)  # a finished job's, that no live agent holds: a new job
            state.seen.update({h: now for h in alive})  # an agent whose lease holds lives
            answer = state.handle(req)
            new = dump(state)
            if new == text or self.etcd.put_if(self.key, new, revision, timeout):
                self.joined = self.joined or req["op"] == "join"
                return answer
            # another agent wrote first: apply the request again to the state as it now stands

    def local_address(self) -> str:
        """The address of this machine that reaches the cluster (where the others reach it)."""
        host, _, port = self.etcd.endpoints[self.etcd.current].rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5.0) as s:
            return s.getsockname()[0]

    def close(self) -> None:
        """Gives up this agent's lease; the last agent out of a finished job deletes its
        state (so that the job's name can start a new job)."""
        self.closed = True
        try:
            if self.lease:
                self.etcd.revoke(self.lease)
            (text, revision), alive = self._read(None)
            if text is not None and not alive and json.loads(text)["state"] in ENDED:
                self.etcd.delete_if(self.key, revision)
        except Unreachable:
            pass  # the cluster is lost too: the lease expires by itself
