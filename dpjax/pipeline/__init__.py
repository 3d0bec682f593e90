"""Pipeline parallelism over the `stage` mesh axis: the depth of a model split into stages.

A model with a stack of layers (`model.LAYERS`, e.g. the GPT's `blocks`, every leaf with
a leading layer axis L) is cut along that axis: with S stages, stage s holds layers
s*L/S .. (s+1)*L/S - 1 (`dpjax.sharding.make_layout` splits the layer axis over `stage`,
so each stage's parameters and optimizer state are born on its devices only). The rest
(the embedding, tied to the output head, and the final norm) is small and used by the
first stage (embedding) and the last (head and loss); it is kept on every stage and its
gradient summed over the stage axis, Megatron-LM's embedding all-reduce between the
first and last stage.

Each data-parallel replica's batch is cut into M micro-batches that flow through the
stages by a schedule, one file each, each citing its source and stating its bubble, and
registered in `SCHEDULES` (a `schedule.Schedule`: the one list of schedule names):

    naive        one stage at a time, all forwards then all backwards    (S-1)/S
    gpipe        Huang et al. 2019: all forwards, then all backwards     (S-1)/(M+S-1)
    1f1b         PipeDream-Flush, Narayanan et al. 2021                  (S-1)/(M+S-1)
    interleaved  Megatron-LM (Narayanan et al. 2021), V chunks a stage    (S-1)/(V*M+S-1)

A schedule is a `Timetable` (who does what at which tick); `engine.run` executes it with
explicit VJPs, one send (`collectives.p2p.send`) forward and one backward per tick;
`staged.for_model` wires a model into `dpjax.step.build`; `cost` measures the bubble
from compiled programs.
Activation memory: gpipe and naive keep every micro-batch's stage input until the
backward (grows with M), 1f1b at most 2S - 1 of them, interleaved 2SV - 1 chunk inputs
(both bounded by the stages, not by M).

Under interleaved the layer axis is stored as V x L/V (layer r*L/V + j at [r, j]) and
split over `stage` on its second dimension: stage s then holds chunks s, S+s, 2S+s, ...
of L/(SV) layers each, the round robin the schedule needs (`store`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from dpjax.errors import UserError
from dpjax.mesh import STAGE
from dpjax.pipeline import gpipe, interleaved, naive, one_f_one_b
from dpjax.pipeline.schedule import Phase, Schedule, Timetable
from dpjax.registry import Registry

SCHEDULES: Registry[Schedule] = Registry("pipeline schedule")  # name -> Schedule: the one list of schedules
register = SCHEDULES.register  # a schedule is one file: its timetable and its bubble


for _module in (naive, gpipe, one_f_one_b, interleaved):
    register(_module.SCHEDULE)


@dataclass(frozen=True)
class Pipeline:
    """How a stage axis runs: the schedule, micro-batches per data-parallel replica per
    backward pass (None: one per stage), chunks per stage (interleaved only); unroll:
    tick loops as straight-line code (for XLA's cost analysis, which counts a loop once)."""

    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    unroll: bool = False

    def resolved(self, stages: int) -> "Pipeline":
        m = stages if self.microbatches is None else self.microbatches
        return Pipeline(self.schedule, m, self.virtual_stages, self.unroll)


def timetable(pipe: Pipeline, stages: int) -> Timetable:
    return SCHEDULES[pipe.schedule].timetable(stages, pipe.resolved(stages).microbatches, pipe.virtual_stages)


def bubble_formula(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a stage's executed work, as the papers state it."""
    return SCHEDULES[schedule].bubble(stages, microbatches, virtual_stages)


def check(model, mesh, pipe: Pipeline) -> Pipeline:
    """The pipeline for `model` on `mesh` (micro-batches resolved), or a UserError (one
    line) saying what to change. The batch is checked by `check_batch`."""
    S = mesh.shape[STAGE]
    if pipe.schedule not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {pipe.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    layers = model.LAYERS
    if layers is None:
        raise UserError(f"model {model.name} has no stack of layers to split over the stage axis; use --model gpt")
    pipe = pipe.resolved(S)  # --microbatches and --virtual-stages themselves: dpjax.plan.check
    M, V = pipe.microbatches, pipe.virtual_stages
    L = jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))[layers])[0].shape[0]
    if L % (S * V):
        chunks = f"{S} stages" + (f" x {V} virtual stages" if V > 1 else "")
        raise UserError(f"{model.name} has {L} layers, which do not split evenly into the {chunks} of mesh "
                        f"{dict(mesh.shape)}: use a multiple of {S * V} layers (--n-layers) or another stage count")
    if V > 1 and M % S:
        raise UserError(f"--schedule {pipe.schedule} feeds micro-batches in groups of the {S} stages: "
                        f"--microbatches {M} is not a multiple of {S}")
    return pipe


def check_batch(pipe: Pipeline, rows: int, how: str) -> None:
    """Each replica's batch of `rows` sequences must cut into the micro-batches."""
    if rows % pipe.microbatches:
        raise UserError(f"--microbatches {pipe.microbatches} does not divide the per-replica batch of {rows} "
                        f"sequences ({how}); use a divisor of {rows}")


def store(params, layers: str, virtual_stages: int):
    """The parameters as a pipelined layout keeps them: under V > 1 virtual stages each
    leaf of the layer stack, L x ..., becomes V x L/V x ... (layers in order)."""
    if virtual_stages == 1:
        return params
    V = virtual_stages
    stack = jax.tree.map(lambda x: x.reshape(V, x.shape[0] // V, *x.shape[1:]), params[layers])
    return {**params, layers: stack}


def unstore(params, layers: str, virtual_stages: int):
    """`store`'s inverse: the model's own tree (V x L/V x ... back to L x ...), which its
    `apply` outside a pipeline (the end-of-run sample, `dpjax.generate`) takes."""
    if virtual_stages == 1:
        return params
    stack = jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), params[layers])
    return {**params, layers: stack}


def layer_dims(pipe: Pipeline | None) -> int:
    """Leading dimensions of a stored layer-stack leaf that number layers (never split by FSDP)."""
    return 2 if pipe is not None and pipe.virtual_stages > 1 else 1


__all__ = ["Phase", "Pipeline", "SCHEDULES", "Schedule", "Timetable", "bubble_formula", "check", "check_batch",
           "layer_dims", "register", "store", "timetable", "unstore"]
