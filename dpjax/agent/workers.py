"""The processes one agent runs on its host: started in one process group with the
job's `jax.distributed` settings, their output prefixed with their rank, watched for an
abnormal exit or a stale heartbeat, and stopped all at once.

What a failure is called is decided here, from what the operating system says (the
exit code, the signal, the process state, the heartbeat's age), never from a line the
process printed: a survivor's transport error ("connection reset", a gloo status) is
a consequence, and is named as one.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from dpjax import distributed
from dpjax.agent import spare
from dpjax.recovery import heartbeat
from dpjax.recovery.env import ENV
from dpjax.distributed.output import RankOutput

PR_SET_PDEATHSIG = 1
# what a process prints when a peer went away under it (gloo, gRPC, the coordination service)
TRANSPORT = re.compile(r"Gloo .*failed|Connection (reset|closed|refused)|Socket closed|coordination service|"
                       r"DEADLINE_EXCEEDED|UNAVAILABLE")


def _die_with_agent():
    """In the child before exec: killed when the agent dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"killed by signal {name}"
    return f"exit code {code}"


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T for stopped...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Spares:
    """K spare processes for the next round (`dpjax.agent.spare`), in one process group;
    `Workers` takes them when the round has K processes here, `close` ends them otherwise."""

    def __init__(self, command, env: dict, k: int):
        self.k, self.procs, pgid = k, [], 0
        for _ in range(k):
            # the file, not `-m dpjax.agent.spare`: a spare imports nothing but what the command's package does
            p = subprocess.Popen([command[0], spare.__file__, spare.command_module(command), *command[3:]],
                                 env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, bufsize=1, process_group=pgid, preexec_fn=_die_with_agent)
            pgid = pgid or p.pid
            self.procs.append(p)
        self.pgid = pgid

    def ready(self, k: int) -> bool:
        return k == self.k and all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.procs:
            p.wait()


class Workers:
    """K processes of `command` on this host, ranks first_rank .. first_rank+K-1 (a
    restart's from `spares` when they are ready: Python and JAX started before the failure)."""

    def __init__(self, command, env: dict, first_rank: int, k: int, heartbeat_dir: str, tag: str,
                 log_dir: str | None = None, verbose: bool = False, spares: Spares | None = None):
        os.makedirs(heartbeat_dir, exist_ok=True)
        self.first, self.k, self.tag = first_rank, k, tag
        self.heartbeats = [os.path.join(heartbeat_dir, f"heartbeat-{first_rank + i}") for i in range(k)]
        for path in self.heartbeats:
            if os.path.exists(path):
                os.remove(path)
        self.last_line: dict = {}
        self.echo: set = set()  # ranks that printed a transport error (a peer went away)
        self.procs, self.pumps, self.lock = [], [], threading.Lock()
        self.started = time.time()
        if spares is not None and not spares.ready(k):
            spares.close()
            spares = None
        pgid = spares.pgid if spares is not None else 0
        for i in range(k):
            rank = first_rank + i
            e = {**env, distributed.PROCESS_ID: str(rank), distributed.LOCAL_RANK: str(i),
                 ENV["heartbeat"]: self.heartbeats[i]}
            if spares is not None:  # told its rank's environment: it runs the command from there
                p = spares.procs[i]
                p.stdin.write(json.dumps(e) + "\n")
                p.stdin.close()
            else:
                p = subprocess.Popen(command, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1, process_group=pgid, preexec_fn=_die_with_agent)
            pgid = pgid or p.pid  # one group for the host's processes: stopped together, lost together
            self.procs.append(p)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                shown = RankOutput(rank, out, self.lock, log_dir or heartbeat_dir, verbose)
                t = threading.Thread(target=self._pump, args=(rank, stream, shown), daemon=True)
                t.start()
                self.pumps.append(t)
        self.pgid = pgid

    def _pump(self, rank, stream, shown: RankOutput):
        for line in iter(stream.readline, ""):
            if line.strip():
                self.last_line[rank] = line.rstrip()
                if TRANSPORT.search(line):
                    self.echo.add(rank)
            shown.line(line)  # shown as dpjax.distributed.output says; every line in the rank's log
        stream.close()
        shown.close()

    def heartbeat(self, i: int):
        """(age in seconds, what the heartbeat says) of local process i; (None, {}) before its first."""
        return heartbeat.read(self.heartbeats[i])

    def completed(self) -> int | None:
        """The furthest step whose state any of these processes had on its host."""
        done = [self.heartbeat(i)[1].get("completed") for i in range(self.k)]
        done = [d for d in done if d is not None]
        return max(done) if done else None

    def end(self) -> dict:
        """How far the job's end has come, from what the heartbeats say (dpjax.train.elastic's
        marks): `final`, every process here made its last commit and wrote its rows;
        `ended`, one of them saw every process of the job do so; `nothing_left`, every one
        restored a state at --steps (a restart after the job had finished)."""
        beats = [self.heartbeat(i)[1] for i in range(self.k)]
        return {"final": all(b.get("final") for b in beats), "ended": any(b.get("ended") for b in beats),
                "nothing_left": all(b.get("nothing_left") for b in beats)}

    def check(self, hang_timeout: float, start_timeout: float):
        """None while all is well; "done" when every process exited 0; else a failure
        {rank, how, line, t, silent_since?} of the first process that failed or hung."""
        codes = [p.poll() for p in self.procs]
        dead = []
        for i, code in enumerate(codes):
            if code not in (None, 0):
                rank = self.first + i
                for t in self.pumps[2 * i:2 * i + 2]:
                    t.join(timeout=1.0)  # its last lines, to tell an error of its own from an echo
                how, echo = describe_exit(code), rank in self.echo
                tail = self.last_line.get(rank, "")
                if code > 0 and tail and not echo:
                    how += f" ({tail[:160]})"  # an exception of its own
                elif echo:
                    how += " (a transport error: a peer went away)"
                dead.append({"rank": rank, "how": how, "signal": code < 0, "echo": echo, "user_error": code == 2,
                             "t": time.time()})
        if dead:  # a signal or an error of its own before an echo of another's failure
            return min(dead, key=lambda f: (not f["signal"], f["echo"], f["rank"]))
        if all(c == 0 for c in codes):
            return "done"
        hung = [self._hang(i, hang_timeout, start_timeout) for i in range(self.k) if codes[i] is None]
        hung = [h for h in hung if h is not None]
        # the stopped one first: the others went silent waiting for it in a collective
        return min(hung, key=lambda h: (not h["stopped"], h["silent_since"])) if hung else None

    def _hang(self, i: int, hang_timeout: float = -1.0, start_timeout: float = -1.0) -> dict | None:
        """Local process i as a hang when its heartbeat says it is one (`heartbeat.judge`:
        no beat, or no step outside a busy phase, for longer than its limit); None if not.
        With the default limits (post_mortem: it is stopped) always."""
        now, (age, beat) = time.time(), self.heartbeat(i)
        state = process_state(self.procs[i].pid)
        verdict = heartbeat.judge(age, beat, self.started, hang_timeout, start_timeout, now, stopped=state == "T")
        if verdict is None:
            return None
        silent, what = verdict
        why = " (stopped: SIGSTOP)" if state == "T" else f" (state {state})" if state else ""
        at = f" after step {beat['dispatched']}" if beat.get("dispatched") is not None else ""
        return {"rank": self.first + i, "how": f"hung: {what}{at}{why}", "hang": True, "stopped": state == "T",
                "silent_since": now - silent, "t": now}

    def post_mortem(self) -> list:
        """What this host's processes died of, or are stopped by, when the round failed
        elsewhere first (so that the cause can be told from its echoes)."""
        out = []
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and code < 0:
                out.append({"rank": self.first + i, "how": describe_exit(code), "signal": True, "t": time.time()})
            elif code is None and process_state(p.pid) == "T":
                out.append(self._hang(i))
        return out

    def stop(self) -> None:
        """Kills every process of this host at once (SIGKILL to the group: their state is
        committed, nothing is worth waiting for) and waits for them."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
            p.wait()
        for t in self.pumps:
            t.join(timeout=2)
