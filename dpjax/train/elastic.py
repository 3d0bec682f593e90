"""The training loop's side of surviving failures: commits, heartbeat, injected faults,
and the restart's account of itself.

    restart.fit(settings)   (dpjax.train.restart) the mesh and micro-batches for the devices this
                            job has now (an elastic restart on fewer hosts), and the kept programs
    attach(trainer)         the Committer (dpjax.recovery.commit); on a restart (DPJAX_RESTART > 0,
                            set by dpjax.agent) or --resume, the newest step every shard
                            committed, laid out for this plan
    Elastic.after_step      once per step: injected fault (dpjax.recovery.fault), commit every
                            --commit-every steps, heartbeat file (dpjax.agent's hang check)

Everything the agent tells a process comes in environment variables (dpjax.recovery.env); a run
without the agent commits only when --commit-dir is given, and restores with --resume.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import threading

import jax
from jax._src import distributed as jax_distributed

from dpjax.recovery import fault as faults  # noqa: E402
from dpjax.recovery.heartbeat import Heartbeat  # noqa: E402
from dpjax.recovery.env import restart_number  # noqa: E402
from dpjax.train.restart import breakdown, env as _env, micro_batches, stamp  # noqa: E402
from dpjax.recovery import full_disk  # noqa: E402
from dpjax.recovery.commit import Committer, WAIT_MS  # noqa: E402
from dpjax.recovery.interval import AutoInterval  # noqa: E402
from dpjax.train.loop import MAX_IN_FLIGHT  # noqa: E402
from dpjax.train.metrics import open_writers  # noqa: E402

stamp("start_import")  # the process started, Python and JAX and dpjax imported (the restart's breakdown)


def _say(line: str) -> None:
    """What changed is always said (process 0), whatever --progress is: a restart is news."""
    if jax.process_index() == 0:
        print(line, flush=True)


class Elastic:
    def __init__(self, trainer, committer, heartbeat: str | None):
        self.cfg, self.committer = trainer.cfg, committer
        self.faults = faults.for_process(jax.process_index())
        # the commit restored (its step, cursor, sources, when), None: a start from the beginning
        self.restored: dict | None = None
        self.reported = False
        every = trainer.cfg.commit_every
        # auto: a commit's device copy shows in the loop's iterations up to MAX_IN_FLIGHT later
        auto = str(every) == "auto"
        self.auto = AutoInterval(lag=MAX_IN_FLIGHT + 1, max_lost=trainer.cfg.max_lost_steps) if auto else None
        self.every = None if self.auto else int(every)
        self.next_commit = self.first_commit(trainer.start)
        self.last_t: float | None = None  # when the last iteration ended (the auto interval times each)
        self.announced = False
        self.gaps: dict[int, int] = {}  # the gap decided at each commit not yet finished
        self.finished = 0  # steps whose results the loop has
        self.first_done_at: float | None = None  # when the restart's first step was done
        self.first_step: threading.Thread | None = None  # the thread that stamps first_done_at
        self.beaten = False  # whether this process's first step is done (its progress clock runs)
        self.marks: dict = {}  # how far the run's end has come, in every heartbeat from then on (`close`)
        # the agent's hang check (dpjax.recovery.heartbeat): a thread's beats, the loop's progress
        self.beat = Heartbeat(heartbeat, self._beat_fields) if heartbeat else None

    def first_commit(self, start: int) -> int:
        """The step of the first commit from `start`: under auto, once the interval has
        timed its first iterations (the first iteration has none before it to be timed from)."""
        if self.every is not None:  # a fixed interval (None: auto)
            return start + self.every
        assert self.auto is not None
        cap = self.auto.cap()  # --max-lost-steps: a failure before the first commit loses the steps from the start
        return start + (self.auto.first + 1 if cap is None else min(self.auto.first + 1, cap))

    def _due(self, done: int) -> bool:
        if done == self.cfg.steps:  # the last step is always committed
            return True
        if self.every is not None:
            return done % self.every == 0
        return done >= self.next_commit

    def _gap(self, done: int) -> int:
        """At a commit under --commit-every auto: the gap to the next one, decided by
        process 0 (every process must commit the same steps) and read by the others."""
        if self.every is not None:
            return self.every
        assert self.auto is not None
        key = f"dpjax/commit/every/{_env('restart', '0')}/{done}"
        client = getattr(self.committer, "client", None)
        if jax.process_index() == 0 or client is None:
            gap = self.auto.committed()
            if client is not None and jax.process_count() > 1:
                client.key_value_set(key, str(gap))
        else:
            gap = int(client.blocking_key_value_get(key, WAIT_MS))
        return gap

    def after_step(self, trainer, done: int, write, in_flight=()) -> None:
        """After step `done` (steps done) is dispatched; `in_flight`: the loop's steps
        whose metrics are not written yet, (step, loss, extra)."""
        c = self.committer
        if self.restored is not None and not self.reported and done == self.restored["step"] + 1:
            self._commit_rows(write)
        self.finished = max(self.finished, done - len(in_flight))  # the loop has these steps' results
        if done in self.faults:
            if c is not None:
                c.flush()  # the fault strikes at a step boundary: what was asked for before is written
            if len(in_flight) > 1:  # ... and the steps before this one are done: what the failure loses
                in_flight[-2][1].block_until_ready()
                self.finished = done - 1
            self.heartbeat(done)
            faults.fire(self.faults[done])
        began, finished = False, []
        if c is not None and self._due(done):
            c.flush()  # the previous commit (commit() waits for it anyway): its figures go into the choice
            if c.skip_full:
                self._full_disk(done)
            finished = self._finished()
            # the losses of the steps up to this one that the loop has not written yet: a
            # restart from this commit writes them, so that the metrics miss no step
            losses = {step_i + 1: loss for step_i, loss, *_ in in_flight}  # numbered as the metrics rows
            gap = self._gap(done)
            self.next_commit, self.gaps[done], began = done + gap, gap, True
            meta = {"cursor": trainer.cursor, "record": trainer.record, "commit_every": gap}
            c.commit(done, trainer.state(), meta, losses, ready=in_flight[-1][1] if in_flight else None)
            if done == self.cfg.steps:
                c.flush()  # the last commit's figures land in the last row
        if c is not None:
            self._measure(done, began, write, in_flight, finished)
        if not self.beaten and in_flight and self.beat is not None:
            # the first heartbeat once this process's first step is done, which takes every process
            # (its collectives): until then --start-timeout applies, not --hang-timeout, so that a
            # process whose peers are still starting or restoring is not taken for hung
            in_flight[-1][1].block_until_ready()
        self.beaten = True
        self.heartbeat(done)
        if self.restored is not None and done == self.restored["step"] + 1 and in_flight:
            self._stamp_first(in_flight[-1][1])
        if self.restored is not None and not self.reported and self.first_done_at is not None:
            self.report(trainer, write)

    def _full_disk(self, done: int) -> bool:
        """--on-full-disk skip-commits: whether any process's previous commit met a full disk;
        if so it is skipped on every process (dpjax.recovery.full_disk), and said."""
        c = self.committer
        who = full_disk.agree(c.client, _env("restart", "0"), done, jax.process_index(), jax.process_count(),
                              c.refused, c.written)
        c.refused = None
        if who is None:
            return False
        full_disk.drop(c, who[1])
        if jax.process_index() == 0:
            print(full_disk.line(who, c.root), file=sys.stderr, flush=True)
        return True

    def _commit_rows(self, write) -> None:
        """The rows of the restored commit's steps that the lost job may not have written
        (the metrics writer skips a step it holds)."""
        r, per_step = self.restored, self.cfg.batch_size * self.cfg.backward_passes
        assert r is not None  # called once a commit is restored
        for step, loss in sorted(r.get("losses", {}).items(), key=lambda kv: int(kv[0])):
            # step s (1-based) read from cursor(commit) - (commit - s + 1) steps' batches
            cursor = r["cursor"] - (r["step"] - int(step) + 1) * per_step
            write({"step": int(step), "loss": loss, "cursor": cursor, "from_commit": True})

    def _stamp_first(self, loss) -> None:
        """When the first step after a restore is done (a thread waits for its loss)."""
        def wait():
            loss.block_until_ready()
            stamp("first_step")  # before first_done_at, which lets after_step report
            self.first_done_at = time.time()

        self.first_step = threading.Thread(target=wait, daemon=True, name="dpjax-first-step")
        self.first_step.start()

    def end(self, trainer, write) -> None:
        """At the loop's end (its steps drained, the rows still open): the restart's row when no
        step after the first wrote it (the first was the job's last, or its thread was late)."""
        if self.restored is not None and not self.reported and self.first_step is not None:
            self.first_step.join()
            self.report(trainer, write)

    def _finished(self) -> list:
        """The commits finished since the last look, their seconds told to the auto interval."""
        finished = self.committer.poll()
        for f in finished:
            if self.auto is not None:
                self.auto.finished(f["commit_s"])
        return finished

    def _measure(self, done: int, began: bool, write, in_flight, finished) -> None:
        """Finished commits into the metrics rows of the steps in flight (the newest
        into this step's); the iteration's time into the auto interval; its choice said
        once."""
        now = time.perf_counter()
        finished = [*finished, *self._finished()]
        free = [extra for _, _, extra, *_ in reversed(in_flight) if "commit_s" not in extra]  # newest first
        for back, f in enumerate(reversed(finished)):
            row = {"commit_s": round(f["commit_s"], 4), "commit_bytes": f["commit_bytes"],
                   "commit_every": self.gaps.pop(f["step"], None), "commit_step": f["step"]}
            if back < len(free):
                free[back].update(row)
            else:
                write({"step": done, **row})
        if self.auto is not None and self.last_t is not None:
            self.auto.tick(now - self.last_t, busy=self.committer.busy or bool(finished), began=began)
        self.last_t = now
        if self.auto is not None and began and self.auto.settled and not self.announced:
            self.announced = True
            write({"step": done, "commit_every": self.auto.describe()})
            if jax.process_index() == 0:
                print(self.auto.line(), flush=True)

    def _beat_fields(self) -> dict:
        # the furthest step done (its state committed, or its results in the loop's hands): a
        # failure loses the steps from the restored commit to this one (steps_lost)
        completed = max(self.finished, self.committer.completed) if self.committer is not None else None
        return {"completed": completed, **self.marks}

    def heartbeat(self, done: int) -> None:
        """Step `done` dispatched: progress once the first step is done (before, the
        start's limit holds: its peers may still be compiling or restoring)."""
        if self.beat is not None:
            if self.beaten:
                self.beat.step(done)
            else:
                self.beat.write()

    def busy(self, what: str | None) -> None:
        """Between steps: the run is busy with `what` (a save, an evaluation, its end), held
        to the agent's --start-timeout rather than --hang-timeout; None: stepping again."""
        if self.beat is not None:
            self.beat.busy(what) if what else self.beat.idle()

    def report(self, trainer, write) -> None:
        """The restart's account: size, mesh, where the state came from, steps and seconds lost."""
        self.reported = True
        r, failure = self.restored, json.loads(_env("failure", "{}"))
        assert r is not None and self.first_done_at is not None  # called after the first step of a restore
        row = {"event": "restart", "attempt": int(_env("restart", "0")), "processes": jax.process_count(),
               "devices": jax.device_count(), "mesh": dict(trainer.mesh.shape), "restored_step": r["step"],
               "from": r["sources"], "commit_every": r.get("commit_every"),
               **micro_batches(trainer.cfg, trainer.mesh)}
        if failure.get("skipped"):  # sizes the agent could have formed that cannot hold the run
            row["sizes_skipped"] = failure["skipped"]
        if failure:
            reached = failure.get("completed")
            row.update(failed=failure.get("line"), steps_lost=None if reached is None else max(0, reached - r["step"]),
                       restart_s=round(failure["restarted"] - failure["t"], 2),
                       seconds_lost=round(self.first_done_at - failure["t"], 2),
                       # where the seconds went: processes started -> imports done -> joined -> planned ->
                       # parameters made -> restored -> first step (compiled or from the cache) done, wall and CPU
                       breakdown=breakdown(failure["restarted"]))
        if trainer.programs is not None:  # compiled programs loaded from the run's folder / compiled again
            row["programs"] = {"loaded": trainer.programs.loaded, "compiled": trainer.programs.compiled}
        write(row)
        _say("dpjax.elastic: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "event"))

    def close(self) -> None:
        """Once the last step's commit is made and the loop ended as planned (close runs in
        its exit stack: sys.exc_info() is an exception leaving), the heartbeat tells the
        agent `final` (this process's last commit held by its neighbour, its rows written),
        then `ended` (every process's: they meet in the committer's close). A failure from
        then on is after the job's end (dpjax.agent.rendezvous)."""
        c = self.committer
        if c is None:
            return
        skipped = False
        if c.skip_full and sys.exc_info()[0] is None:
            c.flush()  # the last commit, too, may meet a full disk: said, and the end is not `final`
            skipped = self._full_disk(self.cfg.steps + 1)
        last = c.completed == self.cfg.steps and not skipped
        planned = last and sys.exc_info()[0] is None
        if planned:
            c.flush()
            self._at_end("committed")
            self.mark(final=True)
        c.close(finished=last)
        if planned:
            self.mark(ended=True)
            self._at_end("end")

    def mark(self, **marks) -> None:
        self.marks.update(marks)
        if self.beat is not None:
            self.beat.write()

    def _at_end(self, moment: str) -> None:
        if moment in self.faults:  # DPJAX_FAULT's step=committed / step=end
            faults.fire(self.faults[moment])

    def finish_restored(self, trainer) -> None:
        """An agent's restart whose restored state is at --steps: the job had trained and
        committed every step when it failed, so every process ends it, exit 0 (--resume by
        hand is refused, in `Trainer`), after the commit's rows, a restart row, the marks."""
        cfg, failure = self.cfg, json.loads(_env("failure", "{}"))
        step = self.restored["step"] if self.restored else trainer.start
        if jax.process_index() == 0 and (cfg.metrics or cfg.tensorboard):
            writers = open_writers(cfg.metrics, cfg.tensorboard, append=True, resumed_at=trainer.start)
            if self.restored:
                self._commit_rows(writers.write)
            writers.write({"event": "restart", "attempt": restart_number(), "processes": jax.process_count(),
                           "restored_step": step, "failed": failure.get("line"), "nothing_left": True})
            writers.close()
        self.committer.close(finished=True)  # every process restored (their files served until then)
        self.mark(final=True, ended=True, nothing_left=True)
        _say(f"dpjax.elastic: restored step {step} of --steps {cfg.steps}: the job had trained and committed "
             f"every step before it failed{' (' + failure['line'] + ')' if failure.get('line') else ''}; nothing "
             "left to train")
        sys.stdout.flush()
        raise SystemExit(0)


def _exit_now(kind, value, tb):
    """Prints the traceback and exits with status 1 without the interpreter's exit
    handlers: jax.distributed's would wait at the shutdown barrier for processes that
    are still stepping (300 s), and the agent would see a hang rather than the error."""
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def attach(trainer) -> Elastic | None:
    """The run's Elastic (the Commits hook owns it) (None when nothing elastic is asked for); restores the newest
    complete commit on a restart."""
    cfg, restart = trainer.cfg, restart_number()
    root = cfg.commit_dir or _env("commit_dir")
    heartbeat = _env("heartbeat")
    if root is None and heartbeat is None and not os.environ.get(faults.VAR):
        return None
    committer = None
    if root is not None:
        restoring = restart > 0 or cfg.resume
        committer = Committer(os.path.abspath(root), _env("host", "local"), jax.process_index(), jax.process_count(),
                              int(_env("per_host", "1")), jax_distributed.global_state.client, fresh=not restoring,
                              coordinator=jax_distributed.global_state.coordinator_address)
        committer.skip_full = cfg.on_full_disk == "skip-commits"
        trainer.run_record["commit"] = {"dir": os.path.abspath(root), "every": cfg.commit_every,
                                        "max_lost_steps": cfg.max_lost_steps}
    if heartbeat is not None:  # under the agent: an exception ends this process at once
        sys.excepthook = _exit_now
    elastic = Elastic(trainer, committer, heartbeat)
    if committer is not None and (restart > 0 or cfg.resume):
        restoring_at = time.time()
        stamp("init")
        got = committer.restore(trainer.state(), expect=trainer.record)
        if got is None and restart > 0:  # failed before the first commit: from the start, and said so
            elastic.restored = {"step": trainer.start, "cursor": trainer.cursor, "sources": {}, "commit_every": None,
                                "restoring_at": restoring_at, "restored_at": time.time()}
            stamp("restore")
        if got is not None and got[1]["step"] > trainer.start:  # newer than the orbax checkpoint
            state, meta = got
            trainer.load_state(state, meta["step"], meta["cursor"])
            elastic.restored = {**meta, "restoring_at": restoring_at, "restored_at": time.time()}
            stamp("restore")
            elastic.next_commit = elastic.first_commit(trainer.start)
            _say(f"dpjax.elastic: restored step {meta['step']} from commits {meta['sources']} onto mesh "
                        f"{dict(trainer.mesh.shape)}")
    if committer is not None and restart > 0 and trainer.start >= cfg.steps:
        elastic.finish_restored(trainer)
    return elastic
