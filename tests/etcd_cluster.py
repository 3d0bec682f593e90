"""A 3-member etcd cluster on 127.0.0.1 for the tests (and by hand: `python tests/etcd_cluster.py`
runs one until Ctrl-C): free ports, temporary data folders, member i's process in `procs[i]`.
The etcd binary is Debian's `etcd-server` (`.ci/run` installs it as root); without it the
tests that need one skip, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

MISSING = "the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it when run as root)"


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def post(endpoint: str, path: str, body: dict, timeout: float = 2.0) -> dict:
    req = urllib.request.Request(f"http://{endpoint}/v3/{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Cluster:
    def __init__(self, n: int = 3, root: str | None = None):
        self.root = root or tempfile.mkdtemp(prefix="dpjax-etcd-")
        ports = _free_ports(2 * n)
        self.clients, peers = ports[:n], ports[n:]
        self.endpoints = [f"127.0.0.1:{p}" for p in self.clients]
        initial = ",".join(f"e{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
        self.procs = []
        for i in range(n):
            # a loaded 2-core machine misses 100 ms heartbeats: elections slower than etcd's defaults
            cmd = ["etcd", "--name", f"e{i}", "--data-dir", os.path.join(self.root, f"e{i}"),
                   "--listen-client-urls", f"http://{self.endpoints[i]}", "--advertise-client-urls",
                   f"http://{self.endpoints[i]}", "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}", "--initial-cluster", initial,
                   "--initial-cluster-state", "new", "--initial-cluster-token", os.path.basename(self.root),
                   "--heartbeat-interval", "250", "--election-timeout", "2500"]
            log = open(os.path.join(self.root, f"e{i}.log"), "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        self.wait_leader()

    @property
    def spec(self) -> str:
        return "etcd://" + ",".join(self.endpoints)

    def status(self, i: int) -> dict:
        return post(self.endpoints[i], "maintenance/status", {})

    def wait_leader(self, timeout: float = 60.0, among=None) -> int:
        """The index of the leader once the members `among` (default all) agree on one."""
        among = range(len(self.procs)) if among is None else among
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                s = [self.status(i) for i in among]
                leaders = {x.get("leader") for x in s}
                if len(leaders) == 1 and None not in leaders:
                    ids = [x["header"]["member_id"] for x in s]
                    return [i for i, m in zip(among, ids) if m == s[0]["leader"]][0]
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"etcd at {self.endpoints} has no leader after {timeout} s (logs in {self.root})")

    def make_leader(self, i: int) -> None:
        """Moves the cluster's leadership to member i (its loss is then the worst case)."""
        lead = self.wait_leader()
        if lead != i:
            target = self.status(i)["header"]["member_id"]
            post(self.endpoints[lead], "maintenance/transfer-leadership", {"targetID": target}, timeout=10)
        assert self.wait_leader() == i

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    c = Cluster()
    print(c.spec, "in", c.root, flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        c.close()
