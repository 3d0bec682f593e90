"""The parts of every run beside the step itself, each a `dpjax.train.hooks.Hook`:

    Interrupt     Ctrl-C: the first finishes the step (and saves), a second leaves at once
    Autotune      --allreduce / --fusion-mb auto: the trial steps, then the choice (tuning.py)
    NonFiniteStop a loss that turns NaN or Inf stops the run in one line (nonfinite.py)
    Metrics       the rows to --metrics / --tensorboard (metrics.py); the run record first
    Progress      the bar or the log lines (progress.py)
    Commits       commits, heartbeat, injected faults: the trainer's Elastic (elastic.py)
    Evaluation    --eval-every, and the evaluation after the last step
    Checkpoints   --ckpt-every, the last step, a stop; a NaN's checkpoint set aside
    Timeline      --timeline: a few steps profiled, run alone (observe.py)
    Sample        the greedy continuation printed at the end (sample.py)

`parts(trainer, own)` puts them in the order each event needs them in (the loop calls
every hook's method in list order); a run's own hooks come before the evaluation, so
that a stop asked for in `after` still saves the step. How much a step moves and how fast
it ran (comm_bytes, compression_ratio, efficiency) is `observe.Figures`, a hook too,
whose summary the loop's last line reads.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time

from dpjax import interrupt
from dpjax.train import nonfinite, observe, resume, sample, tuning
from dpjax.train.hooks import Hook
from dpjax.train.metrics import open_writers
from dpjax.train.progress import Progress as Bar


def _main() -> bool:
    import jax

    return jax.process_index() == 0


class Interrupt(Hook):
    """The first Ctrl-C finishes the step and saves; a second one leaves at once, in one
    line and without a traceback (the save under way is not finished: orbax finalises a
    checkpoint only once it is whole, so --resume takes the one before). Until the first
    step is compiled and dispatched there is no step to finish: Ctrl-C stops the compile
    (a KeyboardInterrupt, as Python's own handler raises; the compile that took minutes on
    a large model used to run to its end first)."""

    def start(self, loop) -> None:
        self.stepping, self.loop = False, loop
        self.old = signal.signal(signal.SIGINT, self.on_sigint)
        interrupt.quiet_dropped()
        interrupt.check()  # a Ctrl-C while the initialisation compiled that Python dropped

    def on_sigint(self, signum, frame) -> None:
        if not self.stepping:
            interrupt.raise_on_sigint(signum, frame)
        if self.loop.interrupted:
            print("interrupted again: stopped at once, without waiting for the save", file=sys.stderr, flush=True)
            os._exit(130)
        self.loop.stop(interrupted=True)
        if _main():
            print("Ctrl-C: finishing the step" + (" and saving" if self.loop.trainer.ckpt else "") + "; Ctrl-C "
                  "again stops at once", file=sys.stderr, flush=True)

    def dispatched(self, loop, flight) -> None:
        interrupt.check()  # a Ctrl-C while the first step compiled that Python dropped: no step to finish yet
        self.stepping = True

    def close(self, loop) -> None:
        if not loop.interrupted:  # interrupted, the handler stays until the process ends: a second Ctrl-C
            signal.signal(signal.SIGINT, self.old)  # leaves at once wherever it lands (saving, the summary)


class Autotune(Hook):
    """While the search runs, each step is a trial of one setting, run alone and timed;
    the choice then runs from the next step on (`tuning.finish`)."""

    def before(self, loop, step: int) -> None:
        trainer = loop.trainer
        self.trial = trainer.tuner.ask() if trainer.tuner is not None else None  # (setting, timed)
        if trainer.tuner is not None and self.trial is None:  # nothing left to compare (one candidate)
            tuning.finish(trainer, loop.write, step)
        if self.trial is not None:
            loop.program, loop.alone = trainer.step_for(self.trial[0]), True
            loop.tags["trial"] = str(self.trial[0])

    def after(self, loop, step: int) -> None:
        trainer = loop.trainer
        if self.trial is not None:
            trainer.tuner.tell(self.trial[0], time.perf_counter() - loop.began, self.trial[1])
            if trainer.tuner.done:
                tuning.finish(trainer, loop.write, step)


class NonFiniteStop(Hook):
    """A step's loss is computed from the state after the steps before it: a loss that is
    not finite stops the run before its row is written (an event row says so), and a
    checkpoint saved at that state is set aside once its save is finished."""

    def step(self, loop, row: dict) -> None:
        if math.isfinite(row["loss"]):
            return
        done, trainer = row["step"] - 1, loop.trainer  # the state of `done` steps gave it
        loop.write({"event": "non_finite_loss", "step": row["step"], "value": str(row["loss"])})
        if done in trainer.saved and _main():
            loop.set_aside.append(done)
        raise nonfinite.stop(f"the loss is {row['loss']} at step {row['step']}", done, trainer.cfg, trainer.saved)


class Metrics(Hook):
    """Process 0's rows to the --metrics file (and --tensorboard), the run record first;
    a resumed run's file loses the rows after the restored step (this run writes them again)."""

    def start(self, loop) -> None:
        cfg, trainer = loop.trainer.cfg, loop.trainer
        self.writers = open_writers(cfg.metrics, cfg.tensorboard, append=resume.metrics_append(cfg),
                                    resumed_at=trainer.start if resume.resuming(cfg) else None) if _main() else None
        loop.writers = self.writers
        loop.write({"record": trainer.run_record})

    def step(self, loop, row: dict) -> None:
        loop.write(row)

    def close(self, loop) -> None:
        if self.writers:
            self.writers.close()


class Progress(Hook):
    """The bar or the log lines, with the median tokens/s of the last steps."""

    def start(self, loop) -> None:
        cfg = loop.trainer.cfg
        self.bar = Bar(cfg.progress if _main() else "none", cfg.steps, loop.trainer.start)

    def step(self, loop, row: dict) -> None:
        self.bar.update(row["step"] - 1, row["loss"], loop.tokens_per_s)

    def close(self, loop) -> None:
        self.bar.close()


class Commits(Hook):
    """The trainer's `elastic.Elastic` (commits, heartbeat, injected faults), once a step
    is dispatched; none without --commit-dir or an agent."""

    def dispatched(self, loop, flight) -> None:
        if loop.trainer.elastic is not None:
            loop.trainer.elastic.after_step(loop.trainer, flight.step_i + 1, loop.write, loop.in_flight)

    def close(self, loop) -> None:
        if loop.trainer.elastic is not None:
            loop.trainer.elastic.close()


class Evaluation(Hook):
    """The validation loss every --eval-every steps (not at the last, which the end
    evaluates), of the state after that step; a mixture of experts' router figures too."""

    at = None  # the step of the last evaluation

    def after(self, loop, step: int) -> None:
        cfg = loop.trainer.cfg
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            loop.drain()
            with loop.phase("eval"):
                self.record(loop, step)
            loop.reset_clock()  # evaluating is not the next step's time

    def end(self, loop) -> None:
        if self.at != loop.done:  # a hook's stop at an --eval-every step evaluated it already
            self.record(loop, loop.done)

    def record(self, loop, step: int) -> None:
        trainer, self.at = loop.trainer, step
        loop.eval_loss = trainer.evaluate()
        loop.write({"step": step, "eval_loss": loop.eval_loss,  # of the state after step `step`
                    **{f"eval_{k}": v for k, v in trainer.model_stats().items()}})


class Checkpoints(Hook):
    """A checkpoint every --ckpt-every steps, at the last step and at a stop (Ctrl-C's
    included); closed at the end, and one whose state gave a NaN set aside then."""

    def after(self, loop, step: int) -> None:
        trainer = loop.trainer
        if trainer.ckpt and (step % trainer.cfg.ckpt_every == 0 or step == trainer.cfg.steps or loop.stopping):
            loop.drain()
            with loop.phase("checkpoint"):
                trainer.save(step)
            loop.reset_clock()  # nor is saving

    def close(self, loop) -> None:
        ckpt = loop.trainer.ckpt
        if ckpt:
            ckpt.close()
            for step in loop.set_aside:  # its save finished (close waits)
                nonfinite.set_aside(ckpt.directory, step)


class Timeline(Hook):
    """--timeline: --timeline-steps steps profiled from the one after the first step of
    the final setting (after an autotune; that first step compiles), each run alone to its
    end, the host's phases annotated; then the timeline written and its comm_fraction rows."""

    def __init__(self, recorder):
        self.rec, self.window, self.host = recorder, None, contextlib.ExitStack()

    def before(self, loop, step: int) -> None:
        cfg, trainer, i = loop.trainer.cfg, loop.trainer, step - 1  # the window holds step indices, from 0
        if self.window is None and trainer.tuner is None:  # the search, if any, is over
            self.window = range(i + 1, min(cfg.steps, i + 1 + cfg.timeline_steps))
        self.host = contextlib.ExitStack()
        if self.window is None or i not in self.window:
            return
        loop.alone = True
        if i == self.window.start:
            loop.drain()
            import jax

            jax.block_until_ready((trainer.params, trainer.opt_state))  # no earlier step's tail in the trace
            self.rec.start()
        self.host.enter_context(self.rec.step(step))  # the timeline numbers steps as the metrics do

    def after(self, loop, step: int) -> None:
        self.host.close()
        if self.window and step - 1 == self.window[-1]:
            trainer = loop.trainer
            observe.write_timeline(self.rec, trainer.cfg.timeline, trainer.step, loop.args, loop.write, self.window,
                                   trainer.say)
            loop.reset_clock()  # reading the trace is not the next step's time

    def close(self, loop) -> None:
        if self.rec.active:
            self.rec.stop()  # interrupted inside the profiled steps


class Sample(Hook):
    """The start of a validation sequence and the model's continuation, printed at the end."""

    def end(self, loop) -> None:
        line = sample.sample_line(loop.trainer)
        if line:
            loop.trainer.say(line)


def parts(trainer, figures, own=()) -> list:
    """Every hook of a run, in the order its events need: the interrupt's handler first
    (and restored last), the NaN stop before a row's figures and its writing, the commits
    after the step's figures, the evaluation and checkpoint after the run's own hooks,
    the timeline's step closed after them."""
    timeline = [Timeline(trainer.recorder)] if trainer.recorder is not None else []
    return [Interrupt(), Autotune(), NonFiniteStop(), figures, Metrics(), Progress(), Commits(), *own,
            Evaluation(), Checkpoints(), *timeline, Sample()]
