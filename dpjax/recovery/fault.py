"""Fault injection for tests and users: `DPJAX_FAULT`, read once by the training loop.

    DPJAX_FAULT="rank=2,step=30,kind=kill"            SIGKILL rank 2 when it reaches step 30
    DPJAX_FAULT="rank=2,step=30,kind=hang"            SIGSTOP it there (a hung process)
    DPJAX_FAULT="rank=2,step=30,kind=raise"           raise FaultInjected there (an exception)
    DPJAX_FAULT="rank=2,step=30,kind=kill,forever"    the host is lost for good: the process,
                                                      its agent and the agent's other processes
                                                      are killed, so the host never rejoins
    DPJAX_FAULT="rank=2,step=30,kind=kill,host,wipe"  the host's processes all die (its agent
                                                      lives on and restarts them) and with
                                                      `wipe` its local commits are gone too
                                                      (a host replaced or rebooted)

"At step S" means when S steps are done, before step S+1 starts (before step S's commit). Two
moments after the last step, for what a failure at a run's end does (docs/recovery.md):

    DPJAX_FAULT="rank=2,step=committed,kind=kill"     when this process's last commit is made,
                                                      before it tells its agent it is done
                                                      (a restart finds every step committed)
    DPJAX_FAULT="rank=2,step=end,kind=hang"           when every process has committed the last
                                                      step and said so (the job is over)

A commit's write is struck from outside (experiments/chaos.py) through a folder:

    DPJAX_FAULT_ARM=DIR       a process that finds DIR/kill-in-write-<its pid> when it writes a
                              commit file cuts that file to half its bytes (torn, never
                              renamed into place), writes its name into the arming file and
                              SIGKILLs itself: killed during a commit's write, every time

`once` (the default) fires only in the first attempt of a job (DPJAX_RESTART, set by
`dpjax.agent`, is 0 or unset), so the restarted job runs through. Several faults are separated by ';'.
"""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass

from dpjax.recovery.env import ENV
from dpjax.errors import UserError

VAR = "DPJAX_FAULT"
KINDS = ("kill", "hang", "raise")
AFTER_LAST = ("committed", "end")  # the moments after the last step (`step=`), in their order


class FaultInjected(RuntimeError):
    """The exception `kind=raise` raises (a bug in the step, as far as anyone can tell)."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int | str  # steps done, or one of AFTER_LAST
    kind: str = "kill"
    forever: bool = False
    host: bool = False  # every process of the host, not only this one
    wipe: bool = False  # and the host's commit folder

    def __str__(self):
        extra = "".join(f",{name}" for name in ("host", "wipe") if getattr(self, name))
        return f"rank={self.rank},step={self.step},kind={self.kind},{'forever' if self.forever else 'once'}{extra}"


def parse(text: str) -> tuple[Fault, ...]:
    """The faults of a DPJAX_FAULT value; a UserError (one line) for anything else."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields, flags = {}, set()
        for item in (i.strip() for i in part.split(",")):
            name, eq, value = item.partition("=")
            if eq:
                fields[name] = value
            else:
                flags.add(name)
        unknown = (set(fields) - {"rank", "step", "kind"}) | (flags - {"once", "forever", "host", "wipe"})
        if unknown or "rank" not in fields or "step" not in fields:
            raise UserError(f"{VAR}={text!r}: expected 'rank=R,step=S|{'|'.join(AFTER_LAST)}"
                            f"[,kind={'|'.join(KINDS)}][,once|forever]"
                            "[,host][,wipe]'")
        kind = fields.get("kind", "kill")
        if kind not in KINDS:
            raise UserError(f"{VAR}: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
        step = fields["step"]
        try:
            out.append(Fault(int(fields["rank"]), step if step in AFTER_LAST else int(step), kind, "forever" in flags,
                             "host" in flags, "wipe" in flags))
        except ValueError:
            raise UserError(f"{VAR}={text!r}: rank is an integer, step an integer or one of "
                            f"{', '.join(AFTER_LAST)}") from None
    return tuple(out)


def for_process(rank: int, env=None) -> dict[int | str, Fault]:
    """{step: fault} of this process in this attempt (empty when none applies); a step
    is steps done or one of AFTER_LAST."""
    env = os.environ if env is None else env
    attempt = int(env.get(ENV["restart"], "0") or 0)
    return {f.step: f for f in parse(env.get(VAR, "")) if f.rank == rank and (f.forever or attempt == 0)}


def fire(fault: Fault) -> None:
    """Does what `fault` says, to this process (and its host for `forever`)."""
    print(f"dpjax.recovery.fault: injecting {fault}", flush=True)
    if fault.kind == "raise":
        raise FaultInjected(f"injected by {VAR}: {fault}")
    if fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if fault.host or fault.wipe:
        group = os.getpgid(0)
        for pid in _group_members(group):  # the host's other processes stop first: nothing more is written
            os.kill(pid, signal.SIGSTOP)
        if fault.wipe and os.environ.get(ENV["commit_dir"]):
            shutil.rmtree(os.path.join(os.environ[ENV["commit_dir"]], os.environ.get(ENV["host"], "local")),
                          ignore_errors=True)
        os.killpg(group, signal.SIGKILL)
    if fault.forever and os.environ.get(ENV["agent_pid"]):
        # the whole host: its agent first (so it cannot restart anything), then the
        # processes it started (one process group per agent, see dpjax.agent)
        try:
            os.kill(int(os.environ[ENV["agent_pid"]]), signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


ARM = "DPJAX_FAULT_ARM"


def in_write(fh) -> None:
    """Called by a commit file's write once its bytes are in the temporary file, before the
    rename: dies there, the file torn, when armed (`DPJAX_FAULT_ARM`)."""
    folder = os.environ.get(ARM)
    if not folder:
        return
    armed = os.path.join(folder, f"kill-in-write-{os.getpid()}")
    if os.path.exists(armed):
        fh.flush()
        fh.truncate(fh.tell() // 2)
        with open(armed, "w") as out:
            out.write(fh.name)
        os.kill(os.getpid(), signal.SIGKILL)


def _group_members(group: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                if os.getpgid(int(name)) == group:
                    out.append(int(name))
            except (ProcessLookupError, PermissionError):
                pass
    return out
