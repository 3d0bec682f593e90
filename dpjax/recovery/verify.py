"""What a folder of commits or of orbax checkpoints holds, checked against its checksums.

`python -m dpjax.recovery verify DIR` prints one line per commit file (`--commit-dir`:
every host's own and neighbour copies) or per checkpoint step (`--ckpt-dir`), good or
not and why, then what a restore would use. Exit 0: the newest step is good; 1: it is
not (corrupt, cut short, incomplete or, for a checkpoint, without checksums), and a
restore passes over it to the older good one the last line names; 2: nothing here is
good, or DIR holds neither commits nor checkpoints. Neither orbax nor a device is used:
it runs beside a job.
"""

from __future__ import annotations

import os

from dpjax.errors import UserError
from dpjax.recovery import sums
from dpjax.recovery.commit import inventory
from dpjax.recovery.file_format import CommitError, check_file


def _steps(folder: str) -> list:
    """The orbax steps in `folder` (its integer-named folders), newest first."""
    names = os.listdir(folder)
    return sorted((int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(folder, n))), reverse=True)


def checkpoints(folder: str) -> tuple[list, int]:
    lines, good = [], []
    steps = _steps(folder)
    for step in steps:
        why = sums.problem(folder, step)
        if why is None:
            good.append(step)
        lines.append(f"{'good' if why is None else 'NOT VERIFIED' if why == sums.UNSEALED else 'CORRUPT':<12} "
                     f"checkpoint {os.path.join(folder, str(step))}" + ("" if why is None else f": {why}"))
    return lines + _verdict("checkpoint", steps[0], good), _code(steps[0], good)


def commits(folder: str, files: list) -> tuple[list, int]:
    lines, held = [], {}  # (step, world) -> old ranks with a good copy
    for old, step, world, rel in files:
        held.setdefault((step, world), set())
        try:
            check_file(os.path.join(folder, rel))
            held[(step, world)].add(old)
            lines.append(f"{'good':<12} commit {rel} (step {step}, rank {old} of {world})")
        except (CommitError, OSError) as e:
            lines.append(f"{'CORRUPT':<12} commit {rel} (step {step}, rank {old} of {world}): {e}")
    for (step, world), ranks in sorted(held.items()):
        if ranks != set(range(world)):
            lines.append(f"{'INCOMPLETE':<12} step {step} of {world} processes: no good copy of rank(s) "
                         f"{sorted(set(range(world)) - ranks)}")
    whole = sorted((sw for sw, ranks in held.items() if ranks == set(range(sw[1]))), reverse=True)
    newest = max(held)
    return lines + _verdict("commit", newest[0], [s for s, _ in whole]), _code(newest, whole)


def _verdict(kind: str, newest: int, good: list) -> list:
    if good and good[0] == newest:
        return [f"the newest {kind}, step {newest}, is good"]
    if good:
        return [f"the newest {kind}, step {newest}, is not good: a restore uses step {good[0]}"]
    return [f"no good {kind} here: nothing to restore"]


def _code(newest, good: list) -> int:
    return 0 if good and good[0] == newest else 1 if good else 2


def verify(folder: str) -> tuple[list, int]:
    """(the lines to print, the exit code) for a folder of commits or checkpoints."""
    if not os.path.isdir(folder):
        raise UserError(f"{folder} is not a folder")
    if _steps(folder):
        return checkpoints(folder)
    files = inventory(folder)
    if files:
        return commits(folder, files)
    raise UserError(f"{folder} holds no commits (a --commit-dir) and no checkpoints (a --ckpt-dir)")
