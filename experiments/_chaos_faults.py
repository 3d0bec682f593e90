"""The chaos soak's faults (experiments/chaos.py): each strikes the running job once."""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import time


def _kill(pid, sig=signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def inject(job, kind: str, rng: random.Random) -> str:
    """Strikes; what was done, in words."""
    ranks = job.ranks()
    if len(ranks) < 4:
        return "skipped: the job was between rounds"
    victim = rng.randrange(4)
    if kind == "kill":
        _kill(ranks[victim])
        return f"rank {victim} SIGKILL"
    if kind == "hang":
        _kill(ranks[victim], signal.SIGSTOP)
        return f"rank {victim} SIGSTOP"
    if kind == "host":
        job.agents["h1"].kill()
        job.agents["h1"].wait()
        time.sleep(1.0)
        job.start("h1")
        return "agent h1 SIGKILL, started again"
    if kind == "double":
        _kill(ranks[victim % 2])
        _kill(ranks[2 + rng.randrange(2)], signal.SIGSTOP)
        return f"rank {victim % 2} SIGKILL and a rank of h1 SIGSTOP at once"
    if kind == "in-commit":
        # armed (dpjax.recovery.fault.in_write): the rank dies in its next commit file's write,
        # the file half written under its temporary name
        pid = ranks[victim]
        armed = os.path.join(job.arm, f"kill-in-write-{pid}")
        with open(armed, "w"):
            pass
        deadline = time.time() + 60
        while time.time() < deadline and _alive(pid):
            time.sleep(0.02)
        with open(armed) as fh:
            torn = fh.read()
        os.remove(armed)
        if not torn:
            _kill(pid)
            return f"no commit written in 60 s: rank {victim} SIGKILL"
        return f"rank {victim} SIGKILL while writing {os.path.relpath(torn, job.root)} (half of it written)"
    if kind == "corrupt":
        files = sorted(glob.glob(os.path.join(job.root, "*", "own", f"r{victim}", "s*.bin")))
        if files:
            with open(files[-1], "r+b") as fh:
                size = fh.seek(0, 2)
                at = rng.randrange(size)
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0xFF]))
        _kill(ranks[rng.randrange(4)])
        return f"byte flipped in {os.path.relpath(files[-1], job.root) if files else 'nothing'}, a rank SIGKILL"
    if kind == "truncate":
        ckpt = os.path.join(job.tmp, "ckpt")
        sealed = sorted(int(f[:-5]) for f in os.listdir(os.path.join(ckpt, "checksums"))) \
            if os.path.isdir(os.path.join(ckpt, "checksums")) else []
        what = "no sealed checkpoint yet"
        if sealed:
            files = [p for p in glob.glob(os.path.join(ckpt, str(sealed[-1]), "**", "*"), recursive=True)
                     if os.path.isfile(p)]
            big = max(files, key=os.path.getsize)
            os.truncate(big, os.path.getsize(big) // 2)
            what = f"{os.path.relpath(big, job.tmp)} cut in half"
        _kill(ranks[victim])
        return f"{what}, rank {victim} SIGKILL"
    if kind == "full":
        free = shutil.disk_usage(job.root).free
        filler = os.path.join(job.root, "filler")
        with open(filler, "wb") as fh:
            fh.truncate(0)
            try:
                fh.write(b"\0" * free)
            except OSError:
                pass
        time.sleep(3.0)
        os.remove(filler)
        return f"the commit folder filled ({free >> 20} MiB) for 3 s"
    raise ValueError(kind)
