"""The loop of a run: data -> step -> hooks, with a step in flight behind the one
running. Everything beside the step (metrics, progress, evaluation, checkpoints,
commits, the NaN stop, Ctrl-C, the autotune, the timeline) is a hook
(`dpjax.train.hooks`, the built-in ones in `builtin.py`)."""

from __future__ import annotations

import collections
import contextlib
import time
from typing import NamedTuple

import jax
import numpy as np

from dpjax.train.hooks import Hooks
from dpjax.train.observe import Figures

# Dispatched-but-unfinished steps allowed in flight: one, queued behind the one running,
# hides the host's work for the next step (its batch, its dispatch) behind the device's.
# More let several steps finish while the loop looks elsewhere (the first step's
# figures, a busy host), and a metrics row could not time its own step: with 4 in
# flight, runs on CPU wrote rows of 0.0 s beside rows holding several steps' time.
MAX_IN_FLIGHT = 1


class Flight(NamedTuple):
    """A step dispatched whose row is not written yet: its index (from 0), its loss (a
    device array), the fields its row carries beside the loss, the program that ran it."""

    step_i: int
    loss: object
    extra: dict
    program: object


class Loop:
    """One run of a `dpjax.train.trainer.Trainer` to --steps (or a stop), and what its hooks
    may use (`dpjax.train.hooks`)."""

    def __init__(self, trainer, hooks=()):
        cfg, self.trainer = trainer.cfg, trainer
        # the slots a step computes: --batch-size rows a micro-batch, or the packed rows they fill (--pack)
        self.tokens_per_step = (trainer.rows or cfg.batch_size) * cfg.seq_len * cfg.backward_passes
        self.figures = Figures(trainer, self.tokens_per_step)
        self.hooks = Hooks(trainer.parts.hooks(self.figures, hooks))
        self.writers = None  # the metrics writers (builtin.Metrics); None: this process writes no rows
        self.in_flight: collections.deque = collections.deque()
        self.finished: dict = {}  # step index -> when it was first seen finished (`_seen_finished`)
        self.tps_window: collections.deque = collections.deque(maxlen=20)
        self.lr_at = trainer.opt.schedule(cfg.batch_size * cfg.backward_passes)
        self.loss, self.eval_loss, self.tokens_per_s = float("nan"), None, 0.0
        self.stopping = self.interrupted = False
        self.outcome: dict = {"saved": None}  # what hooks add to the summary (the Checkpoints part: the last saved)
        self.done, self.args, self.began = trainer.start, None, 0.0
        self.program, self.alone, self.tags = None, False, {}
        rec = trainer.parts.recorder  # host phases are annotations that cost nothing outside the profile
        self.phase = rec.phase if rec is not None else (lambda _: contextlib.nullcontext())

    # --- what hooks use ---

    def write(self, row: dict) -> None:
        """A row to the metrics file (process 0; nothing without --metrics)."""
        if self.writers:
            self.writers.write(row)

    def stop(self, interrupted: bool = False) -> None:
        """Ends the run after the step under way: it finishes and is saved (--ckpt-dir).
        `interrupted` (Ctrl-C): the summary says so, the run exits 130, nothing is
        evaluated at the end; otherwise the run ends as if this step were the last."""
        self.stopping = True
        self.interrupted = self.interrupted or interrupted

    def reset_clock(self) -> None:
        """What the host did since the last step's end is not the next step's step_time."""
        self.last_done = time.perf_counter()

    def drain(self) -> None:
        """Waits for every step in flight, writing their rows."""
        while self.in_flight:
            self._retire()

    def tag(self, **fields) -> None:
        """From a hook's `before`: `fields` go into this step's metrics row (a GRPO batch's reward)."""
        self.tags.update(fields)

    def isolate(self, program=None, **tags) -> None:
        """From a hook's `before`: this step runs alone, waited for to its end before the
        next is dispatched (an autotune trial, a profiled step), with `program` (a
        `dpjax.step` program: another exchange setting) instead of the trainer's step;
        `tags` go into its metrics row."""
        self.alone = True
        self.program = program or self.program
        self.tags.update(tags)

    # --- the loop ---

    def run(self) -> dict:
        """The steps from the trainer's start to --steps; returns the summary."""
        t0 = self.last_done = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:  # each hook's close once it has started: reversed, every one called
                hook.start(self)
                stack.callback(hook.close, self)
            for step in range(self.trainer.start + 1, self.trainer.cfg.steps + 1):
                self._iterate(step)
                if self.stopping:
                    break
            self.drain()
            if not self.interrupted:
                self.hooks.end(self)
        return self.summary(time.perf_counter() - t0)

    def _iterate(self, step: int) -> None:
        """Step `step` (from 1): data -> step -> hooks. A step runs alone to its end when a
        hook asks (`alone`: autotune trials, profiled steps); else one stays in flight."""
        trainer = self.trainer
        self.program, self.alone, self.tags = None, False, {}  # before-hooks may isolate the step (`isolate`)
        self.hooks.before(self, step)
        program = self.program or trainer.step
        with self.phase("data"):
            cursor = trainer.cursor  # the step's first sample: the step log shows none read twice or skipped
            batch = trainer.batch()
        self._seen_finished()
        self.args, self.began = (trainer.params, trainer.opt_state, batch), time.perf_counter()
        with self.phase("dispatch"):
            trainer.params, trainer.opt_state, loss, *stats = program.train(*self.args)  # a MoE's drops: its own
        self.done = step
        flight = Flight(step - 1, loss, {"cursor": cursor, **self.tags, **dict(*stats)}, program)
        self.in_flight.append(flight)
        self._seen_finished()  # before the row's figures: the first step's take a compile
        self.hooks.dispatched(self, flight)
        if self.alone:
            self._retire()
            with self.phase("host_wait"):
                jax.block_until_ready((trainer.params, trainer.opt_state))
        elif len(self.in_flight) > MAX_IN_FLIGHT:
            self._retire()
        self.hooks.after(self, step)

    def _seen_finished(self) -> None:
        """Stamps the steps in flight that have finished, oldest first, without waiting:
        a row's step_time runs from the previous step's end to its own, each seen as soon
        as the loop looks (a backend that runs a program inside its dispatch, as XLA's CPU
        one does on one device, has finished it when the dispatch returns)."""
        for flight in self.in_flight:
            if flight.step_i not in self.finished:
                if not flight.loss.is_ready():
                    break
                self.finished[flight.step_i] = time.perf_counter()

    def _retire(self) -> None:
        """The oldest step in flight: waits for its loss, then its row to the hooks."""
        step_i, loss, extra, _ = self.in_flight.popleft()
        with self.phase("host_wait"):
            loss = float(loss)  # waits for the step
        now = self.finished.pop(step_i, None) or time.perf_counter()
        dt, self.last_done = now - self.last_done, now
        self.tps_window.append(self.tokens_per_step / dt)
        self.loss, self.tokens_per_s = loss, float(np.median(self.tps_window))
        row = {"step": step_i + 1, "loss": loss, "step_time": dt, "tokens_per_s": self.tokens_per_step / dt,
               "lr": float(self.lr_at(step_i)),
               **{k: float(v) if isinstance(v, jax.Array) else v for k, v in extra.items()}}  # a MoE's drops
        self.hooks.step(self, row)

    def summary(self, seconds: float) -> dict:
        return {"steps": self.done, "interrupted": self.interrupted, **self.outcome,
                "loss": self.loss, "eval_loss": self.eval_loss, "tokens_per_s": self.tokens_per_s,
                "seconds": seconds, "mesh": dict(self.trainer.mesh.shape),
                "efficiency": self.figures.summary(self.tokens_per_s)}


def run_loop(trainer, hooks=()) -> dict:
    """Runs `trainer` (a `dpjax.train.trainer.Trainer`) to --steps with the built-in hooks
    and `hooks` (`dpjax.train.hooks.Hook`s); returns the summary."""
    return Loop(trainer, hooks).run()
