"""The commits' own channel between processes: a small TCP server per process.

A commit's neighbour copy and a restore's fetch of another host's commit file move
gigabytes; `jax.distributed`'s key-value store, the channel every process of a job
already has, carries them in 1 MiB entries through the coordinator (two hops, every
byte through one process), which is what limited commits to some hundreds of MiB. Here
each process listens on a port of its own (its address is the one small thing put in
the key-value store), and the bytes go straight from the file on one host to the file
on the other: `socket.sendfile` on the sending side (the kernel copies from the page
cache), `recv_into` a reused buffer and a write on the receiving side. TorchFT heals a
replica the same way, over a plain HTTP transport between peers.

Two requests, one per connection: `put` (the bytes of a commit file, stored by the
receiver's `store` callback; answered once stored, so a commit is complete only when
its neighbour holds it) and `get` (a file under the commit root, or its first bytes: a
restore reads every commit's header and only the files it needs, sent back). A request
is a 4-byte length and a JSON head; a put's bytes follow it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading

TIMEOUT_S = 60.0  # a peer silent this long is gone or stuck
BUF = 8 << 20


class PeerError(ConnectionError):
    pass


def _recv_exact(sock, n: int, who: str = "the peer", what: str = "") -> bytearray:
    """Exactly n bytes from sock; PeerError naming `who` (and `what` was being read) if it closes first."""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise PeerError(f"{who} closed the connection after {got} of {n} bytes{what}")
        got += k
    return out


def _head(sock) -> dict:
    n = struct.unpack("<I", _recv_exact(sock, 4))[0]
    return json.loads(_recv_exact(sock, n))


def _send_head(sock, head: dict) -> None:
    b = json.dumps(head).encode()
    sock.sendall(struct.pack("<I", len(b)) + b)


def recv_into_file(sock, fh, n: int, buf: bytearray | None = None) -> None:
    """Copies n bytes from the socket to the open file through one reused buffer."""
    buf = buf or bytearray(min(BUF, max(n, 1)))
    view, left = memoryview(buf), n
    while left:
        k = sock.recv_into(view[:min(len(buf), left)])
        if not k:
            raise PeerError(f"the peer closed the connection with {left} of {n} bytes unsent")
        fh.write(view[:k])
        left -= k


def local_address(towards: str | None) -> str:
    """The address of this host that reaches `towards` (the coordinator's host)."""
    if not towards:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((towards, 9))  # no packet is sent: the kernel only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class Peers:
    """This process's server and its client side. root: the commit root (what `get`
    serves); store(sender rank, name, size, sock): writes a put's bytes (read from sock);
    client: the jax.distributed client (addresses are exchanged through it)."""

    def __init__(self, root: str, rank: int, client, store, coordinator: str | None = None):
        self.root, self.rank, self.client, self.store = os.path.realpath(root), rank, client, store
        host = local_address((coordinator or "").rsplit(":", 1)[0] or None)
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._addrs: dict = {}
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="dpjax-commit-peer")
        self._thread.start()
        client.key_value_set(f"dpjax/commit/addr/{rank}", self.address)

    def _serve(self):
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="dpjax-commit-peer-conn").start()

    def _handle(self, conn):
        with conn:
            conn.settimeout(TIMEOUT_S)
            try:
                head = _head(conn)
                if head["op"] == "put":
                    self.store(int(head["from"]), head["name"], int(head["size"]), conn)
                    _send_head(conn, {"ok": True})
                elif head["op"] == "get":
                    path = os.path.realpath(os.path.join(self.root, head["path"]))
                    if not path.startswith(self.root + os.sep):
                        raise PeerError(f"{head['path']!r} is not under the commit root")
                    with open(path, "rb") as fh:
                        size = os.fstat(fh.fileno()).st_size
                        if head.get("length") is not None:  # the first bytes only (a commit's header)
                            size = min(size, int(head["length"]))
                        _send_head(conn, {"ok": True, "size": size})
                        conn.sendfile(fh, count=size)
            except Exception as e:  # the requester hears it (and the errno: a full disk is told apart)
                try:
                    _send_head(conn, {"ok": False, "error": f"{type(e).__name__}: {e}",
                                      "errno": e.errno if isinstance(e, OSError) else None})
                except OSError:
                    pass

    def _connect(self, rank: int):
        if rank not in self._addrs:
            try:
                self._addrs[rank] = self.client.blocking_key_value_get(f"dpjax/commit/addr/{rank}",
                                                                       int(TIMEOUT_S * 1000))
            except Exception:  # the client reports a deadline as an XlaRuntimeError
                raise PeerError(f"process {rank} published no commit address within {TIMEOUT_S:g} s; it is "
                                "gone or stuck") from None
        host, port = self._addrs[rank].rsplit(":", 1)
        try:
            return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
        except OSError as e:
            raise PeerError(f"process {rank}'s commit server at {self._addrs[rank]} cannot be reached ({e})") from None

    @staticmethod
    def _answer(sock, what: str) -> dict:
        ans = _head(sock)
        if not ans.get("ok"):
            if ans.get("errno"):
                raise PeerError(ans["errno"], f"{what}: {ans.get('error')}")
            raise PeerError(f"{what}: {ans.get('error')}")
        return ans

    def put(self, rank: int, name: str, path: str) -> int:
        """Sends the file at `path` to process `rank` as this process's commit `name`;
        returns once that process has stored it; the bytes sent."""
        with self._connect(rank) as sock, open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            _send_head(sock, {"op": "put", "from": self.rank, "name": name, "size": size})
            sock.sendfile(fh)
            self._answer(sock, f"process {rank} storing {name}")
        return size

    def get(self, rank: int, path: str, length: int | None = None) -> bytearray:
        """The bytes of the file `path` (relative to the commit root) that process `rank`
        holds; its first `length` bytes only when given."""
        with self._connect(rank) as sock:
            _send_head(sock, {"op": "get", "path": path, "length": length})
            size = self._answer(sock, f"process {rank} sending {path}")["size"]
            return _recv_exact(sock, size, f"process {rank}", f" of {path}")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class LocalKV:
    """jax.distributed's key-value client for servers that share one process (what the
    commits use of it): tests and experiments."""

    def __init__(self):
        self.kv, self.cv = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cv:
            self.kv[key] = value
            self.cv.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise TimeoutError(f"{key}: DEADLINE_EXCEEDED")
            return self.kv[key]

    def wait_at_barrier(self, name, timeout_ms):
        pass
