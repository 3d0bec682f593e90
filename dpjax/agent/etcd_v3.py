"""A small etcd v3 client: the calls the agents' etcd rendezvous makes, over etcd's own
JSON gateway (`POST /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant` ...; keys and values
base64, 64-bit numbers as strings), with failover across the cluster's members.

urllib only: the rendezvous needs seven calls, not a dependency (a gRPC client would
bring protobuf and grpcio to every host for them). Failover is the point of a 3-member
cluster: a request goes to the member that answered last and, when it does not answer
(refused, timed out, or answering without a quorum: `etcdserver: request timed out`,
`no leader`), to the next one; `Unreachable` (an OSError, as the built-in rendezvous's
connection errors are) once none has.

A write retried on another member after a timeout may have been applied by the first
(etcd's own clients have the same caveat); the rendezvous's compare-and-swap then sees
its own write as another's, reads again and applies its request again, which its
requests are written to survive (joining, failing, ending twice is once).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

# gRPC codes the gateway returns for a member that cannot serve now: ask the next one
# (1 cancelled, 2 unknown: "context deadline exceeded", 4 deadline exceeded, 14 unavailable)
FAILOVER = {1, 2, 4, 14}
NOT_FOUND = 5  # a lease that expired or was revoked


class Unreachable(OSError):
    """No member of the cluster answered."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def _prefix_end(prefix: str) -> str:
    """The key just past every key that starts with `prefix` (etcd's range_end for a prefix)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class Etcd:
    """A client of the etcd cluster whose members answer at `endpoints` ("HOST:PORT")."""

    def __init__(self, endpoints: list[str], timeout: float = 2.0):
        self.endpoints, self.timeout = list(endpoints), timeout
        self.current = 0  # the member that answered last

    def _post(self, endpoint: str, path: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(f"http://{endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:  # the gateway's error: a JSON body with a gRPC code
            try:
                return json.loads(e.read())
            except ValueError:
                raise OSError(f"HTTP {e.code}") from None
        except urllib.error.URLError as e:  # refused, no route: its reason says which
            raise OSError(str(e.reason)) from None

    def call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST /v3/`path` to the members in turn, from the one that answered last; the
        answer, or {"code": NOT_FOUND, ...}. Unreachable when none answered."""
        why = []
        for i in range(len(self.endpoints)):
            k = (self.current + i) % len(self.endpoints)
            try:
                out = self._post(self.endpoints[k], path, body, timeout or self.timeout)
            except (OSError, ValueError) as e:  # refused, timed out, not etcd's JSON
                why.append(f"{self.endpoints[k]}: {e}")
                continue
            code = out.get("code", 0)
            if code in FAILOVER:
                why.append(f"{self.endpoints[k]}: {out.get('message') or out.get('error')}")
                continue
            if code not in (0, NOT_FOUND):  # a request of ours etcd refuses: a bug, not a lost member
                raise RuntimeError(f"etcd at {self.endpoints[k]} refused /v3/{path}: {out}")
            self.current = k
            return out
        raise Unreachable("; ".join(why))

    def answering(self, timeout: float | None = None) -> tuple[list[str], list[str]]:
        """(the endpoints that answer, each one that does not with why), asking each once."""
        ok, bad = [], []
        for e in self.endpoints:
            try:
                out = self._post(e, "kv/range", {"key": _b64("/")}, timeout or self.timeout)
                if out.get("code", 0) in FAILOVER:
                    raise OSError(out.get("message") or out.get("error"))
                if "header" not in out:
                    raise OSError(f"not etcd's v3 gateway (answered {str(out)[:60]})")
                ok.append(e)
            except (OSError, ValueError) as err:
                bad.append(f"{e} ({err})")
        return ok, bad

    def get_prefix(self, prefix: str, timeout: float | None = None) -> dict:
        """{key: (value, mod_revision)} of every key under `prefix`."""
        out = self.call("kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)}, timeout)
        return {_text(kv["key"]): (_text(kv.get("value", "")), int(kv["mod_revision"]))
                for kv in out.get("kvs", [])}

    def put_if(self, key: str, value: str, mod_revision: int, timeout: float | None = None) -> bool:
        """Writes `key` if its mod_revision is still `mod_revision` (0: the key does not
        exist); whether it wrote (compare-and-swap)."""
        cmp = ({"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"} if not mod_revision
               else {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)})
        out = self.call("kv/txn", {"compare": [cmp], "success": [{"request_put": {"key": _b64(key),
                                                                                   "value": _b64(value)}}]}, timeout)
        return bool(out.get("succeeded"))  # the gateway leaves false out

    def delete_if(self, key: str, mod_revision: int, timeout: float | None = None) -> bool:
        cmp = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        out = self.call("kv/txn", {"compare": [cmp], "success": [{"request_delete_range": {"key": _b64(key)}}]},
                        timeout)
        return bool(out.get("succeeded"))

    def put(self, key: str, value: str, lease: int = 0, timeout: float | None = None) -> bool:
        """Writes `key` (held by `lease`: gone when it expires); False when the lease is."""
        body = {"key": _b64(key), "value": _b64(value), **({"lease": str(lease)} if lease else {})}
        return self.call("kv/put", body, timeout).get("code", 0) != NOT_FOUND

    def grant(self, ttl: float, timeout: float | None = None) -> int:
        """A new lease of `ttl` seconds (rounded up; etcd may grant more); its id."""
        return int(self.call("lease/grant", {"TTL": str(max(1, int(-(-ttl // 1))))}, timeout)["ID"])

    def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renews `lease`; the seconds it now has, 0 when it expired or was revoked."""
        out = self.call("lease/keepalive", {"ID": str(lease)}, timeout)
        return int(out.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        self.call("lease/revoke", {"ID": str(lease)}, timeout)
