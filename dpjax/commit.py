"""Per-step commits of the training state to fast local storage, plus a neighbour copy.

Horovod elastic's `state.commit()` keeps the state in host memory and TorchFT heals a
rejoining replica from a live peer; here each process writes, every `--commit-every`
steps, its own shards of the state (parameters, optimizer and update-rule state, RNG
key data) with their global index, and the step and data cursor, to a file on local
storage (`<commit dir>/<host>/own/r<rank>/`), written to a temporary name and renamed
(a reader never sees half a commit), the last `keep` kept. Only the shards of replica 0
are written, so the processes' files together hold each array once.

The neighbour copy: the same bytes go to the process with the same local rank on the
next host (rank + processes per host), which writes them into ITS host's folder
(`<its host>/peer/r<rank>/`): losing a whole host loses nothing committed. The bytes
travel through the `jax.distributed` coordinator's key-value store, the one channel
every process of a job already has, between hosts as on 127.0.0.1 (a shared folder
would only work on one machine or a shared file system); it suits states of up to some
hundreds of MiB, and the copy runs on a background thread, off the step's path.

Restore (`restore`): every process publishes what its host's folder holds; the newest
step that every old rank has committed (own copy or neighbour's) is chosen; each old
rank's bytes come from a local file or from the one process that holds it; the global
arrays are put back together and laid out as the new plan's arrays are (any mesh: the
plan was made for the devices that are left), bit for bit what was committed.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import threading
import time

import numpy as np

from dpjax.errors import UserError

MAGIC = b"DPJC1"
CHUNK = 1 << 20  # bytes per key-value entry: far below the coordination service's message cap
WAIT_MS = 60_000  # a neighbour that does not send its commit within this is gone or stuck


class CommitError(UserError):
    """Commits that cannot be used; the message says why."""


def encode(meta: dict, arrays: list) -> bytes:
    head = json.dumps(meta).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, *(np.ascontiguousarray(a).tobytes() for a in arrays)])


def decode(blob: bytes) -> tuple[dict, list]:
    """(meta, the arrays of its pieces) of a commit's bytes."""
    import jax.numpy as jnp

    if not blob.startswith(MAGIC):
        raise CommitError("a commit file is not one (bad magic)")
    n = struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])[0]
    at = len(MAGIC) + 8
    meta = json.loads(blob[at:at + n])
    at += n
    arrays = []
    for leaf in meta["leaves"]:
        dtype = np.dtype(jnp.dtype(leaf["dtype"]))
        for index in leaf["pieces"]:
            shape = tuple(stop - start for start, stop in index)
            size = int(np.prod(shape)) * dtype.itemsize
            arrays.append(np.frombuffer(blob, dtype, count=int(np.prod(shape)), offset=at).reshape(shape))
            at += size
    return meta, arrays


def _pieces(leaf):
    """(global index as [start, stop] per dimension, host array) of each replica-0 shard."""
    out = []
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
            index = [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(shard.index, leaf.shape)]
            out.append((index, np.asarray(shard.data)))
    return out


def _name(step: int, world: int) -> str:
    return f"s{step:09d}_w{world}.bin"


def _parse_name(name: str):
    if not (name.startswith("s") and name.endswith(".bin") and "_w" in name):
        return None
    step, world = name[1:-4].split("_w")
    return int(step), int(world)


def _write(folder: str, name: str, blob: bytes, keep: int) -> None:
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(blob)
    os.replace(tmp, os.path.join(folder, name))  # atomic: all of a commit or none of it
    done = sorted((p, f) for f in os.listdir(folder) if (p := _parse_name(f)))
    for _, f in done[:-keep]:
        os.remove(os.path.join(folder, f))


class Committer:
    """Commits of one process. root: the commit folder of the run; host: this host's
    name (its folder); rank, world: this process among the job's; per_host: processes per
    host (the neighbour is rank + per_host); client: the jax.distributed client (None in
    a single process: no neighbour)."""

    def __init__(self, root: str, host: str, rank: int, world: int, per_host: int = 1, client=None,
                 keep: int = 2, fresh: bool = True):
        self.root, self.host, self.rank, self.world, self.keep, self.client = root, host, rank, world, keep, client
        self.own = os.path.join(root, host, "own", f"r{rank}")
        self.neighbour = (rank + per_host) % world if world > 1 else None
        self.sender = (rank - per_host) % world if world > 1 else None  # whose copy this process keeps
        self.peer = None if self.sender is None else os.path.join(root, host, "peer", f"r{self.sender}")
        if fresh:  # a new run: what an earlier run left here must not be mistaken for this one's
            for folder in (self.own, self.peer):
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
        self._queue: queue.Queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._work, daemon=True, name="dpjax-commit")
        self._thread.start()
        self._copy = None
        self.completed, self.completed_at = -1, None  # the newest step whose state reached the host

    # --- writing ---

    def commit(self, step: int, state, meta: dict, losses: dict | None = None) -> None:
        """Commits `state` (a pytree of global arrays) as of `step` (steps done). Returns
        once the previous commit is written: the state is copied on the devices (the next
        step donates its buffers) and written by a background thread while the next step
        runs. losses: {step: scalar array} kept in the meta as numbers (what the metrics
        of a restarted run must not miss)."""
        import jax
        import jax.numpy as jnp

        # The previous commit must be written first: then no process's commits run more
        # than one step ahead of another's (the steps' collectives pace them), and the
        # last two kept always include a step that every process has.
        self.flush()
        if self._copy is None:
            self._copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
        self._queue.put((step, self._copy(state), meta, losses or {}))

    def _work(self):
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except BaseException as e:  # surfaced on the next commit / flush
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, step, state, meta, losses):
        import jax

        leaves, treedef = jax.tree.flatten(state)
        jax.block_until_ready(leaves)  # the step is done here, whether or not this process holds replica 0
        meta = {**meta, "losses": {str(s): float(v) for s, v in losses.items()}, "step": step, "world": self.world,
                "rank": self.rank, "treedef": str(treedef), "leaves": []}
        arrays = []
        for leaf in leaves:
            pieces = _pieces(leaf)  # waits for the step
            meta["leaves"].append({"shape": list(leaf.shape), "dtype": str(leaf.dtype),
                                   "pieces": [index for index, _ in pieces]})
            arrays += [a for _, a in pieces]
        self.completed, self.completed_at = step, time.time()
        blob, name = encode(meta, arrays), _name(step, self.world)
        _write(self.own, name, blob, self.keep)
        if self.neighbour is not None:
            key = f"dpjax/commit/{step}/{self.rank}"
            _send(self.client, key, blob)
            theirs = _receive(self.client, f"dpjax/commit/{step}/{self.sender}", WAIT_MS)
            self.client.key_value_delete(f"dpjax/commit/{step}/{self.sender}")
            _write(self.peer, _name(step, self.world), theirs, self.keep)

    def flush(self) -> None:
        """Waits until every commit asked for is written (and copied to the neighbour)."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()

    # --- restoring ---

    def inventory(self) -> list:
        """[old rank, step, world, path] of every commit file in this host's folder (one
        process alone is the whole job: then every host's folder under the root is its)."""
        hosts = [self.host] if self.world > 1 or not os.path.isdir(self.root) else sorted(os.listdir(self.root))
        out = []
        for host in hosts:
            for kind in ("own", "peer"):
                base = os.path.join(self.root, host, kind)
                for sub in sorted(os.listdir(base)) if os.path.isdir(base) else ():
                    for f in sorted(os.listdir(os.path.join(base, sub))):
                        if parsed := _parse_name(f):
                            out.append([int(sub[1:]), parsed[0], parsed[1], os.path.join(base, sub, f)])
        return out

    def restore(self, template, expect: dict | None = None):
        """(state laid out like `template`'s arrays, meta) of the newest step every old
        rank committed, or None when there is none. Called by every process of the job."""
        mine = self.inventory()
        everyone = _all_gather_json(self.client, "dpjax/restore/inv", self.rank, self.world, mine)
        holders: dict = {}  # (step, world) -> {old rank: the lowest process that holds it}
        for proc, inv in enumerate(everyone):
            for old, step, world, _ in inv:
                holders.setdefault((step, world), {}).setdefault(old, proc)
        complete = [sw for sw, ranks in holders.items() if set(ranks) >= set(range(sw[1]))]
        if not complete:
            if holders:
                newest = max(holders)
                raise CommitError(f"no step that every process committed: the newest, step {newest[0]}, has "
                                  f"ranks {sorted(holders[newest])} of {newest[1]} (own and neighbour copies lost)")
            return None
        step, world = max(complete)
        local = {}
        for old, s, w, path in mine:  # the own copy where both are here
            if (s, w) == (step, world) and (old not in local or "/own/" in path):
                local[old] = path
        where = {old: everyone[proc] for old, proc in holders[(step, world)].items()}
        sources = {old: next(os.path.relpath(p, self.root) for o, s, w, p in inv if (o, s, w) == (old, step, world))
                   for old, inv in where.items()}
        for old, proc in sorted(holders[(step, world)].items()):
            if proc == self.rank and self.client is not None:
                with open(local[old], "rb") as fh:
                    _send(self.client, f"dpjax/restore/data/{old}", fh.read())
        blobs = {}
        for old in range(world):
            if old in local:
                with open(local[old], "rb") as fh:
                    blobs[old] = fh.read()
            else:
                blobs[old] = _receive(self.client, f"dpjax/restore/data/{old}", WAIT_MS)
        decoded = [decode(blobs[old]) for old in range(world)]
        meta = {k: v for k, v in decoded[0][0].items() if k not in ("leaves", "treedef", "rank")}
        return _assemble(template, decoded, expect), {**meta, "sources": sources}


def _assemble(template, decoded, expect):
    import jax

    from dpjax.checkpoint import check_compatible

    leaves, treedef = jax.tree.flatten(template)
    meta0 = decoded[0][0]
    if expect is not None:
        check_compatible(meta0.get("record", {}), expect, f"the commit of step {meta0['step']}")
    if any(m["treedef"] != str(treedef) or len(m["leaves"]) != len(leaves) for m, _ in decoded):
        raise CommitError(f"the commit of step {meta0['step']} holds another state structure than this run's")
    out, at = [], [0] * len(decoded)
    for i, leaf in enumerate(leaves):
        info = meta0["leaves"][i]
        if tuple(info["shape"]) != leaf.shape or info["dtype"] != str(leaf.dtype):
            raise CommitError(f"commit leaf {i} is {info['dtype']}{info['shape']}, this run's is "
                              f"{leaf.dtype}{list(leaf.shape)}; restart with the same settings")
        whole = np.empty(leaf.shape, np.dtype(leaf.dtype))
        filled = 0
        for d, (meta, arrays) in enumerate(decoded):
            for index in meta["leaves"][i]["pieces"]:
                whole[tuple(slice(a, b) for a, b in index)] = arrays[at[d]]
                filled += arrays[at[d]].size
                at[d] += 1
        if filled != whole.size:  # replica-0 pieces tile each array exactly once
            raise CommitError(f"commit leaf {i}: the pieces cover {filled} of {whole.size} elements")
        out.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda idx, w=whole: w[idx]))
    return jax.tree.unflatten(treedef, out)


# --- the key-value store as a channel (None: one process, nothing to send) ---


def _send(client, key: str, blob: bytes) -> None:
    chunks = [blob[i:i + CHUNK] for i in range(0, len(blob), CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        client.key_value_set_bytes(f"{key}/{i}", chunk)
    client.key_value_set(f"{key}/n", str(len(chunks)))  # last: its presence means every chunk is there


def _receive(client, key: str, wait_ms: int) -> bytes:
    try:
        n = int(client.blocking_key_value_get(f"{key}/n", wait_ms))
    except Exception:  # the client reports a deadline as an XlaRuntimeError
        raise CommitError(f"{key}: not sent within {wait_ms / 1000:g} s; its process is gone or stuck") from None
    return b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", wait_ms) for i in range(n))


def _all_gather_json(client, key: str, rank: int, world: int, value) -> list:
    if client is None or world == 1:
        return [value]
    client.key_value_set(f"{key}/{rank}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", WAIT_MS)) for p in range(world)]
