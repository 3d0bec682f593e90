"""What a run measures about itself beside the loss: each step's figures in its metrics
row (`Figures`: the bytes it sends, `comm_bytes.py`; the compression ratio; the
efficiency of its compiled program, `efficiency.py`) and the `--timeline` of a few
profiled steps."""

from __future__ import annotations

import os

import jax

from dpjax.train.comm_bytes import CommBytes
from dpjax.train.efficiency import Efficiency
from dpjax.train.hooks import Hook
from dpjax.compression import accounting
from dpjax.timeline import Recorder, summarize
from dpjax.timeline.program import abstract


class Figures(Hook):
    """The figures of each step's row beside its loss, where a metrics file takes them:
    comm_bytes and compression_ratio once the step is dispatched, the efficiency of its
    compiled program (looked up by its arguments' shapes) once its step_time is known;
    the summary's efficiency at the end."""

    def __init__(self, trainer, tokens_per_step: int):
        cfg, self.trainer = trainer.cfg, trainer
        # the peak of the dtype the matmuls run in (bf16's is twice TF32's: the H200 summary said MFU 91.6% for 46%)
        self.efficiency = Efficiency(trainer.model, trainer.mesh, tokens_per_step, cfg.peak_tflops,
                                     trainer.plan.policy.dtype)
        self.tokens_per_step = tokens_per_step
        self.shapes: dict[int, object] = {}  # id(program) -> its argument shapes
        self.programs: dict[int, object] = {}  # step index -> the program that ran it (its figures, later)
        plan = trainer.plan
        self.comm_bytes = CommBytes(plan)
        self.compression_ratio = CompressionRatio(plan) if plan.exchange.compression else None

    def dispatched(self, loop, flight) -> None:
        program, extra = flight.program, flight.extra
        if loop.writers:
            extra["comm_bytes"] = self.comm_bytes(program, loop.args, flight.step_i)
            if self.compression_ratio is not None:
                extra["compression_ratio"] = self.compression_ratio(flight.step_i)
        if id(program) not in self.shapes:  # the step's argument shapes: its compiled figures are looked up by them
            self.shapes[id(program)] = shapes(loop.args)
        self.programs[flight.step_i] = program

    def step(self, loop, row: dict) -> None:
        program = self.programs.pop(row["step"] - 1)
        if loop.writers:
            row.update(self.efficiency.row(row["step_time"], program, self.shapes[id(program)]))

    def summary(self, tokens_per_s: float) -> dict:
        """The efficiency at the run's median tokens/s, of the program it ended with."""
        program = self.trainer.step
        if not tokens_per_s or id(program) not in self.shapes:
            return {}
        return self.efficiency.row(self.tokens_per_step / tokens_per_s, program, self.shapes[id(program)])


class CompressionRatio:
    """The compression ratio of each step (bytes uncompressed / bytes sent in the
    exchange, `compression.accounting`): 1.0 before a start step, the method's after."""

    def __init__(self, plan):
        self.plan, self.whole = plan, accounting.ratio(plan)

    def __call__(self, step_i: int) -> float:
        return accounting.ratio_at(self.plan, step_i, self.whole)


def recorder(cfg):
    """--timeline's Recorder (None without): each process profiles its own devices, its
    --profile-dir trace kept in a folder of its rank when there are several."""
    if not cfg.timeline:
        return None
    keep = cfg.profile_dir
    if keep and jax.process_count() > 1:
        keep = os.path.join(keep, f"rank{jax.process_index()}")
    return Recorder(keep=keep)


def shapes(args):
    """The abstract values (shape, dtype, sharding) of a step's arguments: what its
    compiled program is looked up by, kept once the arrays themselves are donated."""
    return abstract(args)


def write_timeline(recorder, path: str, step, args, write, steps, say) -> None:
    """The profiled steps' timeline to `path` (each process its own, named by rank); their
    comm_fraction to the metrics; one line saying where it went."""
    recorder.stop()
    if jax.process_count() > 1:  # each process profiles its own devices
        path = os.path.join(os.path.dirname(path), f"rank{jax.process_index()}-{os.path.basename(path)}")
    recorder.program(step.train, *args)
    summary = summarize(recorder.write(path))
    for row in summary.steps:
        write({"step": row["step"], "comm_fraction": round(row["comm_fraction"], 4)})
    share = sum(r["comm_fraction"] for r in summary.steps) / len(summary.steps)
    say(f"timeline: steps {steps.start + 1}-{steps[-1] + 1} in {path}, communication {100 * share:.0f}% of a step "
        f"(python -m dpjax.timeline {path})")
    for note in summary.notes:  # e.g. a GPU's command buffers, whose ops the profile cannot name
        say(f"timeline: {note}")
