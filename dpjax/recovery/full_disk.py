"""`--on-full-disk skip-commits`: a commit that a full disk refuses, on any process, is
skipped on every process, said in one line, and the run trains on; the next commit is tried.

Every process must skip the same commits: a restore takes the newest step every old rank
committed, and each process keeps only its last two commits, so one whose writes went on
succeeding while another's failed would soon drop the last step they have in common (two
commits are enough). So at each commit every process first says whether its previous
commit was written, and reads every other's (through jax.distributed's key-value store, as
the commit interval is shared); after a refusal anywhere, the processes that did write that
step remove it (their own file and the neighbour copy they hold), and every process keeps
the same steps again. A failure while the disk stays full loses the steps since the newest
commit kept, which the line names. The default, `stop`, ends the run with one line (exit
2) naming the newest commit kept (`dpjax.recovery.commit`).
"""

from __future__ import annotations

import contextlib
import os

from dpjax.recovery.file_format import name

WAIT_MS = 60_000  # as dpjax.recovery.commit's: a process that does not answer within this is gone


def agree(client, attempt: str, step: int, rank: int, world: int, refused, written) -> tuple | None:
    """At the commit of `step`: this process's refusal (its committer's `refused`: (step,
    why), or None) and its newest commit written, told to all; every process's read.
    (rank, refused step, newest written there, why) of the first refusal (lowest rank), or
    None when every process wrote its previous commit. `client` None or a single process:
    this process's own."""
    if client is None or world == 1:
        return None if refused is None else (rank, refused[0], written, refused[1])
    key = f"dpjax/commit/full/{attempt}/{step}"
    client.key_value_set(f"{key}/{rank}", "" if refused is None else f"{refused[0]} {written} {refused[1]}")
    for r in range(world):
        said = client.blocking_key_value_get(f"{key}/{r}", WAIT_MS)
        if said:
            at, kept, why = said.split(" ", 2)
            return r, int(at), None if kept == "None" else int(kept), why
    return None


def drop(committer, step: int) -> None:
    """Removes this process's commit of `step` (its own file and the neighbour copy its host
    holds), written here while another process's write of it was refused."""
    for folder in (committer.own, committer.peer):
        if folder:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name(step, committer.world)))
    if committer.written == step:
        committer.written = None


def line(who: tuple, folder: str) -> str:
    rank, step, kept, why = who
    kept = f"the newest kept is step {kept}" if kept is not None else "no commit was kept before it"
    return (f"dpjax.recovery: the commit of step {step} cannot be written on rank {rank} ({why}) to {folder}; "
            f"--on-full-disk skip-commits: skipped on every process, training goes on and the next commit is tried; "
            f"{kept}")
