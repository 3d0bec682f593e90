"""One host's agent: meet the others at the rendezvous, run this host's processes of
each round, and on any failure stop them and meet again (torchrun's elastic agent, with
dpjax's commits so that a restart loses at most a step; see the package docstring)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time

from dpjax import distributed
from dpjax.agent import rendezvous as rdzv
from dpjax.agent import sizes
from dpjax.recovery.env import ENV
from dpjax.agent.spare import command_module
from dpjax.agent.workers import Spares, Workers
from dpjax.distributed.output import log_dir

POLL_S = 0.1  # how often the processes are looked at
ASK_S = 0.25  # how often the rendezvous is asked how the round goes
ALIVE_S = 1.0  # how often the agent's own thread says it is alive (the rendezvous's --host-timeout)


class RendezvousLost(ConnectionError):
    pass


def cause(failures: list) -> dict | None:
    """The failure that started it: a hang (the longest silent) or a death by signal or
    a lost host before an exit code (the survivors of a lost peer exit with errors)."""
    if not failures:
        return None
    stopped = [f for f in failures if f.get("stopped")]
    if stopped:
        return min(stopped, key=lambda f: f["silent_since"])
    hung = [f for f in failures if f.get("hang")]
    if hung:
        return min(hung, key=lambda f: f.get("silent_since", f["t"]))
    return min(failures, key=lambda f: (not (f.get("signal") or "lost" in f["how"]), bool(f.get("echo")), f["t"]))


def failure_line(f: dict) -> str:
    rank = f"rank {f['rank']} on host {f['host']}" if f.get("rank") is not None else f"host {f['host']}"
    return f"{rank} failed: {f['how']}"


class Agent:
    def __init__(self, args, command):
        self.a, self.command = args, command
        self.host = args.host_id
        # built-in (HOST:PORT) or etcd (etcd://...): an etcd cluster that does not answer is a UserError here
        self.rdzv = rdzv.connect(args.rdzv, self.host, args.host_timeout)
        self.stopped = None
        self.leaving = threading.Event()
        # the command's dpjax.train settings, parsed when first needed (a round smaller than asked) or once the
        # first round trains, in a thread (`read_settings`): the parse imports JAX, which this process had not
        self.settings, self.skipped, self.reading = False, [], None
        self.spares = None  # the next round's processes, started while this one trains (--spares)

    def say(self, text: str) -> None:
        print(f"dpjax.agent[{self.host}]: {text}", file=sys.stderr, flush=True)

    def ask(self, op: str, **kw) -> dict:
        """A request to the rendezvous, tried for about 10 s (it may be starting)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                return self.rdzv.request({"op": op, "host": self.host, **kw})
            except OSError:
                time.sleep(0.25)
        raise RendezvousLost(f"the rendezvous at {self.a.rdzv} cannot be reached (its host is lost, or it "
                             "finished); stopping this host's processes")

    def _serve(self) -> None:
        mn, mx, a = *self.a.nnodes, self.a
        self.rdzv.start(lambda clock: rdzv.State(mn, mx, a.max_restarts, last_call=a.rdzv_last_call,
                                                 first_wait=a.rdzv_wait, lost_after=a.host_timeout, clock=clock))
        for line in self.rdzv.unanswered:
            self.say(f"etcd endpoint {line} does not answer; going on with the others")

    def env(self, view: dict) -> dict:
        a = self.a
        env = dict(os.environ)
        env.update({distributed.COORDINATOR: view["coordinator"], distributed.NUM_PROCESSES: str(view["world"]),
                    "PYTHONUNBUFFERED": "1", ENV["restart"]: str(view["round"] - 1), ENV["host"]: self.host,
                    ENV["per_host"]: str(view["nproc"]), ENV["commit_dir"]: a.commit_dir,
                    ENV["agent_pid"]: str(os.getpid())})
        # a restarted command skips compiling (dpjax.train keeps its own programs: dpjax.recovery.programs)
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(a.commit_dir, "jit-cache"))
        # The agent stops every process on any failure, so jax.distributed's own heartbeat
        # need not: it must outlast --hang-timeout, or the coordination service aborts the
        # survivors of a stopped (SIGSTOP) process first and the hang is blamed on them.
        env.setdefault(distributed.HEARTBEAT_ENV, str(max(distributed.HEARTBEAT_S, math.ceil(a.hang_timeout) + 10)))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        last = view.get("last")
        if last and cause(last["failures"]):
            f = cause(last["failures"])
            first = min(x["t"] for x in last["failures"])  # the first sign of it, an echo perhaps
            env[ENV["failure"]] = json.dumps({"line": failure_line(f), "t": first, "completed": last["completed"],
                                              "restarted": time.time(), "skipped": self.skipped})
        if a.devices_per_process:
            flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={a.devices_per_process}".strip()
            env[ENV["devices"]] = str(a.devices_per_process)
        return env

    def _alive(self) -> None:
        """A thread's: tells the rendezvous this agent lives every ALIVE_S, whatever its
        loop is doing (starting or stopping processes, parsing the command's settings,
        waiting for a dead process's last lines): silence means a lost host, not a busy one."""
        while not self.leaving.wait(ALIVE_S):
            try:
                self.rdzv.beat(ALIVE_S)
            except (OSError, ValueError):
                pass  # the loop's own requests find out whether the rendezvous is lost

    def run(self) -> int:
        self._serve()
        try:  # before the join: the built-in's connection held from the start (rendezvous.py)
            self.rdzv.beat(ALIVE_S)
        except (OSError, ValueError):
            pass  # not up yet: the thread's beats and the join's tries wait for it
        threading.Thread(target=self._alive, daemon=True, name="dpjax-agent-alive").start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        addr = self.rdzv.local_address()
        completed, my_round = None, 0
        try:
            while True:
                port = rdzv.free_port(addr)
                view = self.ask("join", addr=addr, port=port, nproc=self.a.nproc_per_node, completed=completed,
                                agent=self.rdzv.instance)
                while not (view["round"] > my_round and self.host in view["members"] and view["state"] == "running") \
                        and view["state"] != "gave_up":
                    time.sleep(ASK_S)
                    view = self.ask("poll")
                if view["state"] == "gave_up":
                    return self._give_up(view)
                my_round = view["round"]
                view = self._size(view)
                self._announce(view)
                outcome, completed = self._run_round(view)
                if outcome == "done":
                    self.say(self._done_line(view))
                    return 0
                if outcome == "gave_up":
                    return self._give_up(self.ask("poll"))
        except KeyboardInterrupt:
            return 130
        except RendezvousLost as e:
            self.say(str(e))
            return 1
        except sizes.NoSize as e:  # every agent finds the same: each says it and ends
            self.say(f"giving up: {e}; no process left running")
            return 1
        finally:
            self.leaving.set()
            if self.spares is not None:
                self.spares.close()
            self.rdzv.close()  # the built-in's host waits for the others to hear how it ended

    def _size(self, view: dict) -> dict:
        """The round's view with the processes per host that hold the run (`sizes`): the
        sizes skipped are said, one line each."""
        hosts, k = len(view["members"]), self.a.nproc_per_node
        self.skipped = []
        if view["world"] != hosts * k or hosts == self.a.nnodes[1]:
            return {**view, "nproc": k}  # the size asked for (or hosts of unequal sizes): as formed
        self.read_settings()
        k, self.skipped = sizes.choose(self.settings, hosts, k, self.a.devices_per_process)
        for line in self.skipped:
            self.say(f"skipping size {line}")
        return {**view, "nproc": k, "world": hosts * k, "first_rank": view["node_rank"] * k}

    def read_settings(self) -> None:
        """The command's settings, once (`sizes.train_settings`)."""
        if self.settings is False:
            self.settings = sizes.train_settings(self.command)

    def _announce(self, view: dict) -> None:
        hosts = ",".join(view["members"])
        where = f"hosts {hosts} ({view['world']} processes, ranks {view['first_rank']}.."
        where += f"{view['first_rank'] + view['nproc'] - 1} here)"
        if view["round"] == 1:
            self.say(f"round 1: {where}")
        else:
            f = cause((view.get("last") or {}).get("failures") or [])
            self.say(f"round {view['round']} (restart {view['restarts']} of at most {view['max_restarts']}): {where}"
                     + (f", after {failure_line(f)}" if f else ""))

    def _run_round(self, view: dict):
        a = self.a
        w = Workers(self.command, self.env(view), view["first_rank"], view["nproc"],
                    os.path.join(a.commit_dir, "heartbeat", self.host), self.host,
                    log_dir=os.path.join(log_dir("agent", self.rdzv.tag), self.host), verbose=a.verbose,
                    spares=self.spares)
        self.workers, self.spares = w, None
        want_spares = a.spares and command_module(self.command) is not None
        asked, reported, told = 0.0, False, {}
        try:
            while True:
                if self.stopped is not None:
                    self.leaving.set()  # its beats stop first: after "leave" it is gone
                    self.ask("leave")
                    raise KeyboardInterrupt
                result = w.check(a.hang_timeout, a.start_timeout)
                if want_spares and self.spares is None and w.completed() is not None:
                    # the round trains (its first step done): the next round's processes start now, not
                    # when a failure has stopped these, and not beside this round's own start
                    self.spares = Spares(self.command, self.env(view), view["nproc"])
                if self.reading is None and w.completed() is not None:  # ahead of a round that needs them
                    self.reading = threading.Thread(target=self.read_settings, daemon=True, name="dpjax-agent-settings")
                    self.reading.start()
                end = w.end()
                if end != told and (end["final"] or end["ended"]):  # the job's end, as far as it has come
                    self.ask("end", round=view["round"], **end)
                    told = end
                if result == "done" and not reported:
                    self.ask("done", round=view["round"])
                    reported = True
                elif isinstance(result, dict) and not reported:
                    f = {**result, "host": self.host}
                    w.stop()
                    now = self.ask("fail", round=view["round"], completed=w.completed(), **w.end(), **f)
                    if now["state"] == "done":  # after the job's end: not a reason to restart (_done_line)
                        return "done", w.completed()
                    self.say(failure_line(f))
                    return "failed", w.completed()
                if time.time() - asked >= ASK_S:
                    asked = time.time()
                    now = self.ask("poll")
                    if now["round"] != view["round"] or now["state"] in ("failed", "gave_up"):
                        for f in w.post_mortem():  # a cause here, found after another host's echo of it
                            f["host"] = self.host
                            self.say(failure_line(f))
                            self.ask("fail", round=view["round"], **f)
                        w.stop()
                        return ("gave_up" if now["state"] == "gave_up" else "failed"), w.completed()
                    if now["state"] == "done":
                        if now["after_end"]:  # a failure after the end elsewhere: what failed here, too
                            for f in w.post_mortem():
                                self.ask("fail", round=view["round"], **{**f, "host": self.host})
                        return "done", w.completed()
                time.sleep(POLL_S)
        finally:
            w.stop()

    def _done_line(self, view: dict) -> str:
        """The job's last line: done; and what failed after its end (every step trained and
        committed), as every host that heard of it names it (after a moment for the others'
        reports: a stopped process rather than those its hang held up)."""
        last = cause((view.get("last") or {}).get("failures") or [])
        if self.workers.end()["nothing_left"] and last:
            return (f"done: the job had trained and committed every step when {failure_line(last)}; round "
                    f"{view['round']} found nothing left to train")
        try:
            now = self.rdzv.request({"op": "poll", "host": self.host})
            if now["after_end"]:
                time.sleep(3 * ASK_S)
                now = self.rdzv.request({"op": "poll", "host": self.host})
        except OSError:  # the rendezvous's host finished first
            now = {"after_end": []}
        line = f"done: the job finished in round {view['round']}"
        if now["after_end"]:
            line += (f"; after its end {failure_line(cause(now['after_end']))} (not restarted: every step was trained "
                     "and committed)")
        return line

    def _give_up(self, view: dict) -> int:
        f = cause(view["failures"])
        why = view.get("why") or f"{view['restarts']} failures, more than --max-restarts {view['max_restarts']}"
        self.say(f"giving up: {why}" + (f"; the last: {failure_line(f)}" if f else "") + "; no process left running")
        return 1

    def _on_signal(self, signum, frame):
        self.stopped = signum
        w = getattr(self, "workers", None)
        if w is not None:
            w.stop()
        raise KeyboardInterrupt
