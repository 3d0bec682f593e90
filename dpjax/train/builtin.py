"""The parts of every run beside the step itself, each a `dpjax.train.hooks.Hook`:

    Interrupt     Ctrl-C: the first finishes the step (and saves), a second leaves at once
    Autotune      --allreduce / --fusion-mb auto: the trial steps, then the choice (tuning.py)
    NonFiniteStop a loss that turns NaN or Inf stops the run in one line (nonfinite.py)
    Metrics       the rows to --metrics / --tensorboard (metrics.py); the run record first
    Progress      the bar or the log lines (progress.py)
    Commits       commits, heartbeat, injected faults: the run's Elastic (elastic.py)
    Evaluation    --eval-every, and the evaluation after the last step
    Checkpoints   --ckpt-every, the last step, a stop; a NaN's checkpoint set aside
    Timeline      --timeline: a few steps profiled, run alone (observe.py)
    Sample        the greedy continuation printed at the end (sample.py)

`Parts.hooks(figures, own)` puts them in the order each event needs them in (the loop
calls every hook's method in list order); a run's own hooks come before the evaluation,
so that a stop asked for in `after` still saves the step. The parts that own a component
(Checkpoints its Checkpointer, Commits the Elastic, Autotune the tuner, Timeline the
recorder) are made while the trainer starts (`Parts`): the trainer keeps the state, the
plan and the streams, and knows none of them. How much a step moves and how fast
it ran (comm_bytes, compression_ratio, efficiency) is `observe.Figures`, a hook too,
whose summary the loop's last line reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time

import jax
import numpy as np

from dpjax import interrupt
from dpjax.train import nonfinite, observe, resume, sample, tuning
from dpjax.train.checkpoints import Checkpoints
from dpjax.train.hooks import Hook
from dpjax.train.metrics import open_writers
from dpjax.train.progress import Progress as Bar
from dpjax.step import put_batch


def _main() -> bool:
    return jax.process_index() == 0


class Interrupt(Hook):
    """The first Ctrl-C finishes the step and saves; a second one leaves at once, in one
    line and without a traceback (the save under way is not finished: orbax finalises a
    checkpoint only once it is whole, so --resume takes the one before). Until the first
    step is compiled and dispatched there is no step to finish: Ctrl-C stops the compile
    (a KeyboardInterrupt, as Python's own handler raises; the compile that took minutes on
    a large model used to run to its end first)."""

    def __init__(self, checkpoints):
        self.checkpoints = checkpoints  # whether a stop saves (the line says so)

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
            print("Ctrl-C: finishing the step" + (" and saving" if self.checkpoints.ckpt else "") + "; Ctrl-C "
                  "again stops at once", file=sys.stderr, flush=True)

    def dispatched(self, loop, flight) -> None:
        interrupt.check()  # a Ctrl-C while the first step compiled that Python dropped: no step to finish yet
        self.stepping = True

    def close(self, loop) -> None:
        if not loop.interrupted:  # interrupted, the handler stays until the process ends: a second Ctrl-C
            signal.signal(signal.SIGINT, self.old)  # leaves at once wherever it lands (saving, the summary)


class Autotune(Hook):
    """--allreduce / --fusion-mb auto: owns the search (`tuning.plan_search`'s tuner, None
    when nothing is searched). While it runs, each step is a trial of one setting, run
    alone and timed; the choice then runs from the next step on (`tuning.finish`)."""

    def __init__(self, tuner):
        self.tuner = tuner

    @property
    def searching(self) -> bool:
        return self.tuner is not None

    def before(self, loop, step: int) -> None:
        trainer = loop.trainer
        self.trial = self.tuner.ask() if self.tuner is not None else None  # (setting, timed)
        if self.tuner is not None and self.trial is None:  # nothing left to compare (one candidate)
            self._finish(loop, step)
        if self.trial is not None:
            loop.isolate(trainer.step_for(self.trial[0]), trial=str(self.trial[0]))

    def after(self, loop, step: int) -> None:
        if self.trial is not None:
            self.tuner.tell(self.trial[0], time.perf_counter() - loop.began, self.trial[1])
            if self.tuner.done:
                self._finish(loop, step)

    def _finish(self, loop, step: int) -> None:
        tuning.finish(loop.trainer, self.tuner, loop.write, step)
        self.tuner = None


class NonFiniteStop(Hook):
    """A step's loss is computed from the state after the steps before it: a loss that is
    not finite stops the run before its row is written (an event row says so), and a
    checkpoint saved at that state is set aside once its save is finished (the
    Checkpoints part's)."""

    def __init__(self, checkpoints):
        self.checkpoints = checkpoints

    def step(self, loop, row: dict) -> None:
        if math.isfinite(row["loss"]):
            return
        done, saved = row["step"] - 1, self.checkpoints.saved  # the state of `done` steps gave it
        loop.write({"event": "non_finite_loss", "step": row["step"], "value": str(row["loss"])})
        if done in saved and _main():
            self.checkpoints.set_aside.append(done)
        raise nonfinite.stop(f"the loss is {row['loss']} at step {row['step']}", done, loop.trainer.cfg, saved)


class Metrics(Hook):
    """Process 0's rows to the --metrics file (and --tensorboard, --wandb), the run record first;
    a resumed run's file loses the rows after the restored step (this run writes them again)."""

    def start(self, loop) -> None:
        cfg, trainer = loop.trainer.cfg, loop.trainer
        self.writers = open_writers(cfg.metrics, cfg.tensorboard, append=resume.metrics_append(cfg),
                                    resumed_at=trainer.start if resume.resuming(cfg) else None,
                                    wandb=cfg.wandb) if _main() else None
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
        self.bar.update(row["step"] - 1, row["loss"], loop.tokens_per_s, row)

    def close(self, loop) -> None:
        self.bar.close()


class Commits(Hook):
    """Owns the run's `elastic.Elastic` (commits, heartbeat, injected faults; made, and a
    restart's commit restored, by `elastic.attach` while the trainer starts), called once
    a step is dispatched; None without --commit-dir or an agent."""

    def __init__(self, elastic):
        self.elastic = elastic

    def before(self, loop, step: int) -> None:
        if self.elastic is not None:
            self.elastic.busy(None)  # stepping again: the agent's --hang-timeout holds

    def dispatched(self, loop, flight) -> None:
        if self.elastic is not None:
            self.elastic.after_step(loop.trainer, flight.step_i + 1, loop.write, loop.in_flight)

    def after(self, loop, step: int) -> None:
        # the hooks after this one (a checkpoint's save, an evaluation, a run's own) may take
        # longer than a step: busy, held to the agent's --start-timeout (dpjax.recovery.heartbeat)
        if self.elastic is not None:
            self.elastic.busy(f"the work after step {step} (a checkpoint, an evaluation)")

    def end(self, loop) -> None:
        if self.elastic is not None:
            self.elastic.busy("the run's end (the last evaluation, checkpoint and commit)")
            self.elastic.end(loop.trainer, loop.write)

    def close(self, loop) -> None:
        if self.elastic is not None:
            self.elastic.busy("the run's end (the last commit)")
            self.elastic.close()


class Evaluation(Hook):
    """The validation loss every --eval-every steps (not at the last, which the end
    evaluates), of the state after that step, on --eval-batches validation batches; a
    mixture of experts' router figures too (the step's `stats`)."""

    at = None  # the step of the last evaluation

    def after(self, loop, step: int) -> None:
        cfg = loop.trainer.cfg
        if loop.trainer.val_stream is None:  # --task grpo: no held-out loss (its rows carry the reward)
            return
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            loop.drain()
            with loop.phase("eval"):
                self.record(loop, step)
            loop.reset_clock()  # evaluating is not the next step's time

    def end(self, loop) -> None:
        # a hook's stop at an --eval-every step evaluated it already; --task grpo has nothing held out
        if self.at != loop.done and loop.trainer.val_stream is not None:
            self.record(loop, loop.done)

    def record(self, loop, step: int) -> None:
        self.at = step
        loop.eval_loss = self.loss(loop.trainer)
        loop.write({"step": step, "eval_loss": loop.eval_loss,  # of the state after step `step`
                    **{f"eval_{k}": v for k, v in self.model_stats(loop.trainer).items()}})

    @staticmethod
    def batches(trainer):
        cfg = trainer.cfg
        return (trainer.with_reference(put_batch(trainer.val_stream, i * cfg.batch_size, cfg.batch_size, trainer.mesh))
                for i in range(cfg.eval_batches))

    def loss(self, trainer) -> float:
        return float(np.mean([float(trainer.step.evaluate(trainer.params, b)) for b in self.batches(trainer)]))

    def model_stats(self, trainer) -> dict:
        """The model's own figures on the validation batches (a mixture of experts' router
        losses and share of dropped choices: `dpjax.step`'s `stats`), {} for a model without."""
        if trainer.step.stats is None:
            return {}
        got = [trainer.step.stats(trainer.params, b) for b in self.batches(trainer)]
        return {k: float(np.mean([float(g[k]) for g in got])) for k in got[0]}


class Timeline(Hook):
    """--timeline: --timeline-steps steps profiled from the one after the first step of
    the final setting (after an autotune; that first step compiles), each run alone to its
    end, the host's phases annotated; then the timeline written and its comm_fraction rows."""

    def __init__(self, recorder, autotune):
        self.rec, self.autotune, self.window, self.host = recorder, autotune, None, contextlib.ExitStack()

    def before(self, loop, step: int) -> None:
        cfg, trainer, i = loop.trainer.cfg, loop.trainer, step - 1  # the window holds step indices, from 0
        if self.window is None and not self.autotune.searching:  # the search, if any, is over
            self.window = range(i + 1, min(cfg.steps, i + 1 + cfg.timeline_steps))
        self.host = contextlib.ExitStack()
        if self.window is None or i not in self.window:
            return
        loop.isolate()
        if i == self.window.start:
            loop.drain()
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


@dataclasses.dataclass
class Parts:
    """The built-in hooks that own a component, made while the trainer starts (the
    checkpoints and commits restore the state before the first step; the autotune's
    search is refused before anything is written if it cannot fit)."""

    checkpoints: Checkpoints
    commits: Commits
    autotune: Autotune
    recorder: object = None  # --timeline's Recorder (observe.recorder), None without
    rollouts: object = None  # --task grpo's generate-score loop (rollout.Rollouts), None without

    def hooks(self, figures, own=()) -> list:
        """Every hook of a run, in the order its events need: the interrupt's handler first
        (and restored last), the NaN stop before a row's figures and its writing, the commits
        after the step's figures, the evaluation and checkpoint after the run's own hooks,
        the timeline's step closed after them."""
        timeline = [Timeline(self.recorder, self.autotune)] if self.recorder is not None else []
        rollouts = [self.rollouts] if self.rollouts is not None else []  # its start before the metrics file opens
        return [Interrupt(self.checkpoints), self.autotune, NonFiniteStop(self.checkpoints), *rollouts, figures,
                Metrics(), Progress(), self.commits, *own, Evaluation(), self.checkpoints, *timeline, Sample()]
