"""The heartbeat file a process under `dpjax.agent` keeps, and how the agent reads it.

Two questions, two clocks, one file (rewritten atomically, JSON):

    alive   is the process running at all? A thread of its own rewrites the file every
            `EVERY_S`, whatever the training loop is doing (a step, an orbax save, an
            evaluation's compile): a stopped process (SIGSTOP, the kernel's state T) whose
            file is older than --hang-timeout has hung. (A running one's thread can be
            silent too, in a call that holds the interpreter: the clock below judges it.)
    t       is it making progress? The loop stamps it at every step it dispatches. Between
            steps a part of the run may be `busy` (the hooks after a step: a checkpoint save,
            an evaluation; the run's end: the last commit, the checkpoints' close), named in
            the file: its progress is then held to --start-timeout, not --hang-timeout, so
            that a slow save on a loaded machine is not taken for a hang (each restart it
            caused would save again: a job that never ends). A process whose peers are
            stopped waits in a collective, not busy: its steps stop, and the stopped one is
            found first (it has no heartbeat at all).

Before its first step is done (start, compile, restore) a process is held to
--start-timeout too; the alive clock applies from the moment the thread runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

EVERY_S = 1.0  # how often the thread rewrites the file


class Heartbeat:
    """The process's side: `fields()` (called at every write) gives what the agent reads
    beside the clocks (how far the job got, the marks of its end)."""

    def __init__(self, path: str, fields=dict, every: float = EVERY_S):
        self.path, self.fields, self.every = path, fields, every
        self.dispatched, self.t = None, time.time()
        self.busy_with, self.busy_since = None, None
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.write()
        threading.Thread(target=self._beat, daemon=True, name="dpjax-heartbeat").start()

    def _beat(self) -> None:
        while not self.stopped.wait(self.every):
            self.write()

    def write(self) -> None:
        """The file rewritten; a full or vanished folder (the heartbeat shares the commits'
        tmpfs) is no failure of the run: the file ages and the agent judges by its age."""
        with self.lock:  # the loop's thread and the beat's: one writer at a time (one .tmp)
            beat = {**self.fields(), "dispatched": self.dispatched, "t": self.t, "alive": time.time(),
                    "busy": self.busy_with, "busy_since": self.busy_since,
                    "pid": os.getpid()}  # which process is the rank (a spare's environment does not say)
            tmp = f"{self.path}.tmp"
            try:
                with open(tmp, "w") as fh:
                    json.dump(beat, fh)
                os.replace(tmp, self.path)
            except OSError:
                pass

    def step(self, dispatched: int) -> None:
        """Progress: step `dispatched` is dispatched (its predecessors done)."""
        self.dispatched, self.t = dispatched, time.time()
        self.busy_with = self.busy_since = None
        self.write()

    def busy(self, what: str) -> None:
        """From now until the next `step` (or `idle`), the run is busy with `what`."""
        if self.busy_with is None:
            self.busy_since = time.time()
        self.busy_with = what  # the thread writes it within `every` (no write per step here)

    def idle(self) -> None:
        """No longer busy: the progress clock starts again from now."""
        if self.busy_with is not None:
            self.busy_with, self.busy_since, self.t = None, None, time.time()

    @contextlib.contextmanager
    def busy_in(self, what: str):
        self.busy(what)
        try:
            yield
        finally:
            self.idle()

    def close(self) -> None:
        self.stopped.set()


def read(path: str):
    """(seconds since the file was written, what it says); (None, {}) before the first."""
    try:
        with open(path) as fh:
            beat = json.load(fh)
        return time.time() - os.path.getmtime(path), beat
    except (OSError, ValueError):
        return None, {}


def judge(age, beat: dict, started: float, hang_timeout: float, start_timeout: float, now: float | None = None,
          stopped: bool = False):
    """The agent's verdict on one process: None while it is well, else (seconds silent,
    what passed its limit, in words). `age`: of the file (None: none yet); `started`:
    when the agent started the process; `stopped`: the kernel says it is (SIGSTOP)."""
    now = time.time() if now is None else now
    if age is None:
        silent = now - started
        return (silent, f"no heartbeat for {silent:.0f} s since its start") if silent > start_timeout else None
    if age > hang_timeout and stopped:
        # Stopped, and for that long (its thread's last beat). A running process whose thread
        # is silent is in a call that holds the interpreter (jax.distributed's shutdown
        # barrier held one 10 s on a loaded machine): its steps' clocks judge it, below.
        return age, f"no heartbeat for {age:.0f} s"
    if beat.get("busy"):
        silent = now - beat["busy_since"]
        return (silent, f"busy for {silent:.0f} s with {beat['busy']}") if silent > start_timeout else None
    if beat.get("dispatched") is None:  # starting, compiling, restoring
        silent = now - started
        return (silent, f"no step for {silent:.0f} s since its start") if silent > start_timeout else None
    silent = now - beat["t"]
    return (silent, f"no step for {silent:.0f} s since its last step") if silent > hang_timeout else None
