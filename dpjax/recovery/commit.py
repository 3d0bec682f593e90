"""Per-step commits of the training state to fast local storage, plus a neighbour copy.

Horovod elastic's `state.commit()` keeps the state in host memory and TorchFT heals a
rejoining replica from a live peer; here each process writes, every `--commit-every`
steps (`dpjax.recovery.interval`: by default the smallest interval that costs at most 5% of
the step), its own shards of the state (parameters, optimizer and update-rule state, RNG
key data) with their global index, and the step and data cursor, to a file on local
storage (`<commit dir>/<host>/own/r<rank>/`), written to a temporary name and renamed
(a reader never sees half a commit), the last `keep` kept. Only the shards of replica 0
are written, so the processes' files together hold each array once.

The path, near the hardware (orbax's async checkpointing does the same): right after
the step the state is staged into host memory (`dpjax.recovery.stage`: one jitted copy
into the backend's pinned host memory, dispatched, not waited for; it aliases nothing
the next step donates, and reuses the last commit's staging buffers where the backend
allows); the writer thread, which holds nothing the loop waits on, writes each staged
array's bytes straight into the file (no serialised copy of the state: the header says
where each piece goes), reusing the oldest kept file's pages (on tmpfs an overwrite is
about twice a fresh write, which must first allocate and zero every page).

The neighbour copy: the same file goes to the process with the same local rank on the
next host (rank + processes per host), which writes it into ITS host's folder
(`<its host>/peer/r<rank>/`): losing a whole host loses nothing committed. The bytes go
over a TCP connection between the two processes (`dpjax.recovery.peer`: the file sent
with sendfile, received into a reused buffer), not through `jax.distributed`'s key-value
store (1 MiB entries through the coordinator), between hosts as on 127.0.0.1. A commit
is complete once its neighbour holds it.

Every finished commit is measured: `commit_s` (from the end of its step until written
and held by the neighbour) and `commit_bytes` (this process's file), in the metrics row
of the step it finished in (`dpjax.train.elastic`).

Restore (`restore`): every process publishes what its host's folder holds; the newest
step that every old rank has committed (own copy or neighbour's) is chosen; every old
rank's header is read (a local file is mapped, not read; another host's header comes
over the same TCP channel), and each of this process's devices gets its block of each
array cut from the pieces that overlap it (`place`), laid out as the new plan's arrays
are (any mesh: the plan was made for the devices that are left), bit for bit what was
committed. No global array is put together on the host, and a file none of whose pieces
this process needs is never read or fetched.

The file's format is `dpjax.recovery.file_format`'s; laying a commit's pieces out on the devices,
`dpjax.recovery.place`'s.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import queue
import shutil
import sys
import threading
import time

import jax
import numpy as np

from dpjax.recovery.file_format import CommitError, check_file, crc, header, raw, trailer
from dpjax.recovery.file_format import name as _name
from dpjax.recovery.file_format import parse_name as _parse_name
from dpjax.recovery.file_format import write_file
from dpjax.recovery.peer import PeerError, Peers, recv_into_file
from dpjax.recovery.place import LocalFile, RemoteFile, place
from dpjax.recovery.stage import Stager

FULL = (errno.ENOSPC, errno.EDQUOT)
REFUSALS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM)  # the filesystem says no
WAIT_MS = 60_000  # a process that does not publish what it holds within this is gone or stuck


def _pieces(leaf):
    """(global index as [start, stop] per dimension, single-device array) of each replica-0 shard."""
    out = []
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
            index = [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(shard.index, leaf.shape)]
            out.append((index, shard.data))
    return out


class Committer:
    """Commits of one process. root: the commit folder of the run; host: this host's
    name (its folder); rank, world: this process among the job's; per_host: processes per
    host (the neighbour is rank + per_host); client: the jax.distributed client (None in
    a single process: no neighbour); coordinator: its address (the route to the others)."""

    def __init__(self, root: str, host: str, rank: int, world: int, per_host: int = 1, client=None,
                 keep: int = 2, fresh: bool = True, coordinator: str | None = None):
        self.root, self.host, self.rank, self.world, self.keep, self.client = root, host, rank, world, keep, client
        self.own = os.path.join(root, host, "own", f"r{rank}")
        self.neighbour = (rank + per_host) % world if world > 1 else None
        self.sender = (rank - per_host) % world if world > 1 else None  # whose copy this process keeps
        self.peer = None if self.sender is None else os.path.join(root, host, "peer", f"r{self.sender}")
        if fresh:  # a new run: what an earlier run left here must not be mistaken for this one's
            for folder in (self.own, self.peer):
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
        self.peers = None
        if client is not None and world > 1:
            os.makedirs(root, exist_ok=True)
            self.peers = Peers(root, rank, client, self._store, coordinator)
        self._queue: queue.Queue = queue.Queue()
        self._error = None
        self.skip_full, self.refused = False, None  # --on-full-disk skip-commits; (step, why) of a refused write
        self._finished: collections.deque = collections.deque()  # measured commits not yet polled
        self._thread = threading.Thread(target=self._work, daemon=True, name="dpjax-commit")
        self._thread.start()
        self.stager = Stager()
        self.completed, self.completed_at = -1, None  # the newest step whose state left the step's buffers
        self.written = None  # the newest step this process's own file holds

    # --- writing ---

    def commit(self, step: int, state, meta: dict, losses: dict | None = None, ready=None) -> None:
        """Commits `state` (a pytree of global arrays) as of `step` (steps done). Returns
        once the previous commit is written and this one's device copy is dispatched
        (the next step donates the state's buffers); the rest runs on the writer thread
        while the next steps run. losses: {step: scalar array} kept in the meta as
        numbers (what the metrics of a restarted run must not miss); ready: an output
        of the step (its loss), whose arrival marks the step's end (commit_s's start)."""
        # The previous commit must be written first: then no process's commits run more
        # than one commit ahead of another's (the steps' collectives pace them), and the
        # last two kept always include a step that every process has.
        self.flush()
        self._queue.put((step, self.stager(state), meta, losses or {}, ready))

    @property
    def busy(self) -> bool:
        """Whether a commit is being made (asked for and not yet written and copied)."""
        return self._queue.unfinished_tasks > 0

    def poll(self) -> list:
        """The commits finished since the last poll: {"step", "commit_s", "commit_bytes"}."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def _work(self):
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError as e:  # a full or read-only commit folder: one line, the commits before kept
                if self.skip_full and e.errno in FULL:  # --on-full-disk skip-commits: the loop decides (full_disk)
                    self.refused = (item[0], os.strerror(e.errno))
                else:
                    peer = isinstance(e, PeerError)  # the neighbour's disk refused its copy
                    where = f"process {self.neighbour} (the neighbour copy)" if peer else self.own
                    self._error = _refused(e, item[0], self.written, where) if e.errno in REFUSALS else e
            except BaseException as e:  # surfaced on the next commit / flush
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, step, snapshot, meta, losses, ready):
        if ready is not None:
            jax.block_until_ready(ready)
        t0 = time.perf_counter()  # the step is done: the commit's own time starts
        leaves, treedef = jax.tree.flatten(snapshot)
        meta = {**meta, "losses": {str(s): float(v) for s, v in losses.items()}, "step": step, "world": self.world,
                "rank": self.rank, "treedef": str(treedef), "leaves": []}
        arrays = []
        for leaf in leaves:
            pieces = _pieces(leaf)
            meta["leaves"].append({"shape": list(leaf.shape), "dtype": str(leaf.dtype),
                                   "pieces": [index for index, _ in pieces]})
            arrays += [a for _, a in pieces]
        if self.stager.kind is None:  # staged on the device: every device-to-host copy at once
            for a in arrays:
                a.copy_to_host_async()
        jax.block_until_ready(leaves)  # the staged copy is made: the step's buffers are no longer read
        self.completed, self.completed_at = step, time.time()

        def fill(fh):
            head, crcs = header(meta), []
            fh.write(head)
            for a in arrays:  # noqa: F821  (fill runs inside write_file, before the del below)
                view = raw(np.asarray(a))  # waits for this piece's copy only
                fh.write(view)
                crcs.append(crc(view))
            fh.write(trailer(head, crcs))  # the checksums after the data: a torn file has none

        name = _name(step, self.world)
        path, size = write_file(self.own, name, self.keep, fill)
        self.written = step
        del arrays, leaves  # no view of the staged buffers is left: the next commit may write into them
        self.stager.give_back(snapshot)
        del snapshot
        if self.neighbour is not None:
            self.peers.put(self.neighbour, name, path)
        self._finished.append({"step": step, "commit_s": time.perf_counter() - t0, "commit_bytes": size})

    def _store(self, sender: int, name: str, size: int, sock) -> None:
        """A neighbour's commit arriving (the peer server's thread): into this host's folder."""
        if _parse_name(name) is None:
            raise CommitError(f"{name!r} is not a commit's name")
        folder = os.path.join(self.root, self.host, "peer", f"r{sender}")
        write_file(folder, name, self.keep, lambda fh: recv_into_file(sock, fh, size))

    def flush(self) -> None:
        """Waits until every commit asked for is written (and copied to the neighbour)."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def close(self, finished: bool = True) -> None:
        """finished: the run ended as planned, every process closing too (they wait for
        each other: every last commit reaches its neighbour before any server goes); not
        on a failure's way out, where the others may never come."""
        self.flush()
        self._queue.put(None)
        self._thread.join()
        if self.peers is not None:
            if finished:
                self.client.wait_at_barrier("dpjax/commit/close", WAIT_MS)
            self.peers.close()

    # --- restoring ---

    def inventory(self) -> list:
        """[old rank, step, world, path relative to the root] of every commit file in this
        host's folder (one process alone is the whole job: then every host's folder under
        the root is its)."""
        return inventory(self.root, [self.host] if self.world > 1 else None)

    def restore(self, template, expect: dict | None = None):
        """(state laid out like `template`'s arrays, meta) of the newest step every old
        rank committed in files whose checksums match, or None when there is none. Called
        by every process of the job. A corrupt file is named in one line (stderr) by the
        process that holds it and passed over: its other copy, or an older step, is used."""
        mine = self.inventory()
        everyone = _all_gather_json(self.client, "dpjax/restore/inv", self.rank, self.world, mine)
        bad: set = set()  # (process, path) of the files found corrupt
        checked: dict = {}  # path -> None (good) or why not, for this process's files
        for attempt in range(1 + sum(map(len, everyone))):  # each round passes over one file at least
            got = _newest(everyone, bad)
            if got is None:
                break
            step, world, holder = got
            found = []
            for old in range(world):  # the files this process would read or send for the step: checked first
                rel = _file_of(mine, old, step, world, {r for p, r in bad if p == self.rank})
                if rel is not None and rel not in checked:
                    try:
                        check_file(os.path.join(self.root, rel))
                        checked[rel] = None
                    except (CommitError, OSError) as e:
                        checked[rel] = str(e)
                        found.append(rel)
                        print(f"dpjax.recovery: commit {os.path.join(self.root, rel)} is corrupt ({e}); passed over",
                              file=sys.stderr, flush=True)
            news = _all_gather_json(self.client, f"dpjax/restore/bad/{attempt}", self.rank, self.world, found)
            if not any(news):
                break
            bad |= {(p, rel) for p, rels in enumerate(news) for rel in rels}
        if got is None:
            if bad:
                raise CommitError(f"no good commit left in {self.root}: {len(bad)} corrupt file(s) passed over "
                                  "(python -m dpjax.recovery verify lists them)")
            return None
        mine_bad = {r for p, r in bad if p == self.rank}
        local = {old: rel for old in range(world) if (rel := _file_of(mine, old, step, world, mine_bad))}
        sources = {old: local.get(old) or _file_of(everyone[proc], old, step, world, {r for p, r in bad if p == proc})
                   for old, proc in holder.items()}
        peers = self.peers

        def source(old):  # where old rank's commit is read from: the local file, or the holder's over TCP
            if old in local:
                return LocalFile(os.path.join(self.root, local[old]))
            return RemoteFile(lambda n=None: peers.get(holder[old], sources[old], n))

        files = [source(old) for old in range(world)]
        meta = {k: v for k, v in files[0].meta.items() if k not in ("leaves", "treedef", "rank")}
        return place(template, files, expect), {**meta, "sources": sources}


def _refused(e: OSError, step: int, written, folder: str) -> CommitError:
    kept = f"the newest kept is step {written}" if written is not None else "none was kept before it"
    return CommitError(f"the commit of step {step} cannot be written to {folder} ({os.strerror(e.errno)}); {kept}")


def _file_of(inv, old: int, step: int, world: int, bad) -> str | None:
    """The file of old rank's commit of (step, world) that a process with inventory
    `inv` reads or sends: its own copy before a neighbour's, none found corrupt."""
    rels = [r for o, s, w, r in inv if (o, s, w) == (old, step, world) and r not in bad]
    return next((r for r in rels if f"{os.sep}own{os.sep}" in r), rels[0] if rels else None)


def _newest(everyone, bad):
    """(step, world, {old rank: the lowest process that holds it}) of the newest step every
    old rank committed, none of the files found corrupt; None when nothing was committed;
    CommitError when something was but no step is whole."""
    holders: dict = {}
    for proc, inv in enumerate(everyone):
        for old, step, world, rel in inv:
            if (proc, rel) not in bad:
                holders.setdefault((step, world), {}).setdefault(old, proc)
    complete = [sw for sw, ranks in holders.items() if set(ranks) >= set(range(sw[1]))]
    if not complete:
        if holders:
            newest = max(holders)
            raise CommitError(f"no step that every process committed: the newest, step {newest[0]}, has "
                              f"ranks {sorted(holders[newest])} of {newest[1]} (own and neighbour copies lost"
                              f"{' or corrupt' if bad else ''})")
        return None
    step, world = max(complete)
    return step, world, holders[(step, world)]


def inventory(root: str, hosts=None) -> list:
    """[old rank, step, world, path relative to `root`] of every commit file in the
    folders of `hosts` (default: every host's folder under `root`)."""
    if hosts is None:
        hosts = sorted(os.listdir(root)) if os.path.isdir(root) else []
    out = []
    for host in hosts:
        for kind in ("own", "peer"):
            base = os.path.join(root, host, kind)
            for sub in sorted(os.listdir(base)) if os.path.isdir(base) else ():
                for f in sorted(os.listdir(os.path.join(base, sub))):
                    if parsed := _parse_name(f):
                        out.append([int(sub[1:]), parsed[0], parsed[1], os.path.join(host, kind, sub, f)])
    return out


def _all_gather_json(client, key: str, rank: int, world: int, value) -> list:
    if client is None or world == 1:
        return [value]
    client.key_value_set(f"{key}/{rank}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", WAIT_MS)) for p in range(world)]
