"""The loop of a run: data -> step -> metrics / evaluation / checkpoint, with a few
steps in flight, Ctrl-C finishing the step and saving, and the autotune's and the
timeline's steps run alone to their end."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import sys
import time

from dpjax.train import nonfinite, observe, resume, sample, tuning
from dpjax.train.efficiency import Efficiency
from dpjax.train.metrics import open_writers
from dpjax.train.progress import Progress

# Dispatched-but-unfinished steps allowed in flight: one, queued behind the one running,
# hides the host's work for the next step (its batch, its dispatch) behind the device's.
# More let several steps finish while the loop looks elsewhere (the first step's
# figures, a busy host), and a metrics row could not time its own step: with 4 in
# flight, runs on CPU wrote rows of 0.0 s beside rows holding several steps' time.
MAX_IN_FLIGHT = 1


def run_loop(self) -> dict:
    """Runs `self` (a `dpjax.train.loop.Trainer`) to --steps; returns the summary."""
    import jax
    import numpy as np

    cfg, is_main = self.cfg, jax.process_index() == 0
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.backward_passes
    # JSON lines (and TensorBoard): process 0's rows; the run record first
    # ... each step once: a resumed run's file loses the rows after the restored step (run again now)
    metrics = open_writers(cfg.metrics, cfg.tensorboard, append=resume.metrics_append(cfg),
                           resumed_at=self.start if resume.resuming(cfg) else None) if is_main else None
    # the peak of the dtype the matmuls run in (bf16's is twice TF32's: the H200 summary said MFU 91.6% for 46%)
    efficiency = Efficiency(self.model, self.mesh, tokens_per_step, cfg.peak_tflops, self.plan.policy.dtype)
    stop = {"now": False, "stepping": False}  # stepping: the first step is compiled and dispatched
    set_aside = []  # a checkpoint saved at the step whose loss turned out not finite

    def on_sigint(signum, frame):
        """The first Ctrl-C finishes the step and saves; a second one leaves at once,
        in one line and without a traceback (the save under way is not finished: orbax
        finalises a checkpoint only once it is whole, so --resume takes the one before).
        Until the first step is compiled there is no step to finish: Ctrl-C stops the
        compile (a KeyboardInterrupt, as Python's own handler raises; the compile that
        took minutes on a large model used to run to its end first)."""
        if not stop["stepping"]:
            raise KeyboardInterrupt
        if stop["now"]:
            print("interrupted again: stopped at once, without waiting for the save", file=sys.stderr, flush=True)
            os._exit(130)
        stop["now"] = True
        if is_main:
            print("Ctrl-C: finishing the step" + (" and saving" if self.ckpt else "") + "; Ctrl-C again stops at "
                  "once", file=sys.stderr, flush=True)

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    progress = Progress(cfg.progress if is_main else "none", cfg.steps, self.start)
    in_flight: collections.deque = collections.deque()
    finished: dict = {}  # step -> when it was first seen finished (`seen_finished`)
    last_done = t0 = time.perf_counter()
    last = {"loss": float("nan"), "eval_loss": None, "tokens_per_s": 0.0}
    tps_window: collections.deque = collections.deque(maxlen=20)
    lr_at = self.opt.schedule(cfg.batch_size * cfg.backward_passes)
    # --timeline: the steps profiled, fixed at the first step of the final setting;
    # host phases are annotations that cost nothing outside the profile
    rec, window = self.recorder, None
    phase = rec.phase if rec is not None else (lambda _: contextlib.nullcontext())

    def write(row):
        if metrics:
            metrics.write(row)

    write({"record": self.run_record})

    def seen_finished():
        """Stamps the steps in flight that have finished, oldest first, without waiting:
        a row's step_time runs from the previous step's end to its own, each seen as soon
        as the loop looks (a backend that runs a program inside its dispatch, as XLA's CPU
        one does on one device, has finished it when the dispatch returns)."""
        for step_i, loss, *_ in in_flight:
            if step_i not in finished:
                if not loss.is_ready():
                    break
                finished[step_i] = time.perf_counter()

    def retire():
        nonlocal last_done
        step_i, loss, extra, step = in_flight.popleft()
        with phase("host_wait"):
            loss = float(loss)  # waits for the step
        if not math.isfinite(loss):  # the state of step_i steps done gives it: no step after is worth running
            write({"event": "non_finite_loss", "step": step_i + 1, "value": str(loss)})
            if step_i in self.saved and is_main:
                set_aside.append(step_i)
            raise nonfinite.stop(f"the loss is {loss} at step {step_i + 1}", step_i, cfg, self.saved)
        now = finished.pop(step_i, None) or time.perf_counter()
        dt, last_done = now - last_done, now
        tps_window.append(tokens_per_step / dt)
        last.update(loss=loss, tokens_per_s=float(np.median(tps_window)))
        if metrics:
            extra.update(efficiency.row(dt, step, shapes[id(step)]))
        write({"step": step_i + 1, "loss": loss, "step_time": dt, "tokens_per_s": tokens_per_step / dt,
               "lr": float(lr_at(step_i)),
               **{k: float(v) if isinstance(v, jax.Array) else v for k, v in extra.items()}})  # a MoE's drops: floats
        progress.update(step_i, loss, last["tokens_per_s"])

    def drain():
        while in_flight:
            retire()

    def record_eval(done):
        last["eval_loss"] = self.evaluate()
        write({"step": done, "eval_loss": last["eval_loss"],  # of the state after step `done`; a MoE's drops too
               **{f"eval_{k}": v for k, v in self.model_stats().items()}})

    step_i, shapes = self.start, {}
    try:
        for step_i in range(self.start, cfg.steps):
            trial = self.tuner.ask() if self.tuner is not None else None  # (setting, timed) while tuning
            if self.tuner is not None and trial is None:  # nothing left to compare (one candidate)
                tuning.finish(self, write, step_i + 1)
            step = self.step if trial is None else self.step_for(trial[0])
            if rec is not None and window is None and trial is None:
                window = range(step_i + 1, min(cfg.steps, step_i + 1 + cfg.timeline_steps))
            profiled = window is not None and step_i in window
            if profiled and step_i == window.start:
                drain()
                jax.block_until_ready((self.params, self.opt_state))  # no earlier step's tail in the trace
                rec.start()
            host = contextlib.ExitStack()
            if profiled:
                host.enter_context(rec.step(step_i + 1))  # the timeline numbers steps as the metrics do
            with phase("data"):
                cursor = self.cursor  # the step's first sample: the step log shows none read twice or skipped
                batch = self.batch()
            seen_finished()
            args, began = (self.params, self.opt_state, batch), time.perf_counter()
            with phase("dispatch"):
                self.params, self.opt_state, loss, *stats = step.train(*args)  # a MoE's drops: of its own forward
            stop["stepping"] = True
            extra = {"cursor": cursor, **({"trial": str(trial[0])} if trial is not None else {}), **dict(*stats)}
            in_flight.append((step_i, loss, extra, step))
            seen_finished()  # before the row's figures below: the first step's take a compile
            if metrics:
                extra["comm_bytes"] = self.comm_bytes(step, args, step_i)
                if self.compression_ratio is not None:
                    extra["compression_ratio"] = self.compression_ratio(step_i)
            if id(step) not in shapes:  # the step's argument shapes: its compiled figures are looked up by them
                shapes[id(step)] = observe.shapes(args)
            if self.elastic is not None:  # commit, heartbeat, injected fault (dpjax.train.elastic)
                self.elastic.after_step(self, step_i + 1, write, in_flight)
            if trial is not None or profiled:  # autotuned and profiled steps run alone, to their end
                retire()
                with phase("host_wait"):
                    jax.block_until_ready((self.params, self.opt_state))
            elif len(in_flight) > MAX_IN_FLIGHT:
                retire()
            if trial is not None:
                self.tuner.tell(trial[0], time.perf_counter() - began, trial[1])
                if self.tuner.done:
                    tuning.finish(self, write, step_i + 1)
            done = step_i + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                drain()
                with phase("eval"):
                    record_eval(done)
                last_done = time.perf_counter()  # evaluating is not the next step's time
            if self.ckpt and (done % cfg.ckpt_every == 0 or done == cfg.steps or stop["now"]):
                drain()
                with phase("checkpoint"):
                    self.save(done)
                last_done = time.perf_counter()  # nor is saving
            host.close()
            if profiled and step_i == window[-1]:
                observe.write_timeline(rec, cfg.timeline, self.step, args, write, window, self.say)
                last_done = time.perf_counter()  # reading the trace is not the next step's time
            if stop["now"]:
                break
        drain()
        if not stop["now"]:
            record_eval(cfg.steps)
            line = sample.sample_line(self)
            if line:
                self.say(line)
    finally:
        if rec is not None and rec.active:
            rec.stop()  # interrupted inside the profiled steps
        progress.close()
        if metrics:
            metrics.close()
        if self.ckpt:
            self.ckpt.close()
            for step in set_aside:  # its save finished (close waits)
                nonfinite.set_aside(self.ckpt.directory, step)
        if self.elastic is not None:
            self.elastic.close()
        if not stop["now"]:  # interrupted, the handler stays until the process ends: a second Ctrl-C leaves
            signal.signal(signal.SIGINT, old_handler)  # at once wherever it lands (saving, the summary)
    fig = (efficiency.row(tokens_per_step / last["tokens_per_s"], self.step, shapes[id(self.step)])
           if last["tokens_per_s"] and id(self.step) in shapes else {})
    return {"steps": step_i + 1, "interrupted": stop["now"], "saved": self.saved[-1] if self.saved else None,
            "loss": last["loss"],
            "eval_loss": last["eval_loss"], "tokens_per_s": last["tokens_per_s"],
            "seconds": time.perf_counter() - t0, "mesh": dict(self.mesh.shape), "efficiency": fig}
