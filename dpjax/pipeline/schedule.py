"""What every stage does at every tick of a pipeline schedule: a timetable.

dpjax's schedules are SPMD and run in lockstep: every device runs the same program, and
at each tick each stage runs at most one forward and one backward, each of one chunk of
its layers (of different micro-batches), then passes activations to the next stage and
gradients to the previous one with one send each. A timetable says, for tick t on
stage s, which micro-batch m and which of the stage's V chunks r the forward (and the
backward) works on, and whether that slot holds real work at all: in the pipeline's fill
and drain it does not, and the stage computes on whatever it holds and throws the result
away. Those slots are the bubble; in lockstep they cost what real work costs, so the
FLOPs XLA counts in the compiled program measure them (`dpjax.plan.pipeline_cost`).

The index maps are plain integer arithmetic (`//`, `%`, comparisons, `&`), so they run on
Python ints (the tests walk every schedule tick by tick) and on traced scalars (the
engine). Chunk r of stage s is virtual stage r*S + s: a micro-batch visits stages
0..S-1 for chunk 0, then again for chunk 1, and so on (V = 1 but for interleaved).

phases: runs of ticks that do forwards only, both, or backwards only; a phase whose ticks
    hold no valid backward traces none (and likewise forwards), so the work executed is
    the schedule's, slot for slot.
stash: the input of each chunk's forward, kept until its backward, which recomputes the
    chunk's forward from it (GPipe's re-materialisation: only stage-boundary activations
    are stored). `stash_slots` slots; the forward of (m, r) on stage s keeps its input in
    `stash_slot(m, r, s)`, which no other forward overwrites before that backward.
seeds: the loss gradient of the model's output, computed with the loss at the forward of
    the last chunk, kept until that chunk's backward, in slot m % `seed_slots`.

A schedule is one file that makes its timetable and states its bubble, and one
`Schedule` record of both, registered in `dpjax.pipeline.SCHEDULES` (the CLI's choices,
the checks and the tests read the names there).
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class Schedule(NamedTuple):
    """A pipeline schedule: its name, `timetable(S, M, V)` and the bubble its paper states,
    `bubble(S, M, V)` (the idle share of a stage's executed slots). virtual_stages: it
    runs V > 1 chunks a stage (else V is 1). stash(S, M, V): the most micro-batch inputs
    a stage holds at once (its activation memory, in micro-batches): by default all M,
    kept until the backwards begin."""

    name: str
    timetable: Callable  # (stages S, microbatches M, virtual_stages V) -> Timetable
    bubble: Callable  # (S, M, V) -> float
    virtual_stages: bool = False
    stash: Callable = lambda S, M, V: M  # (S, M, V) -> int


class Phase(NamedTuple):
    start: int  # first tick
    ticks: int
    forward: bool
    backward: bool


def phases(fill: int, steady: int, drain: int) -> tuple:
    """Forward-only, then both, then backward-only ticks (empty runs left out)."""
    out, start = [], 0
    for n, f, b in ((fill, True, False), (steady, True, True), (drain, False, True)):
        if n > 0:
            out.append(Phase(start, n, f, b))
        start += n
    return tuple(out)


class Timetable(NamedTuple):
    name: str
    stages: int  # S
    microbatches: int  # M
    chunks: int  # V: chunks (virtual stages) per stage
    phases: tuple  # of Phase
    forward: Callable  # (t, s) -> (m, r, valid)
    backward: Callable  # (t, s) -> (m, r, valid)
    stash_slots: int
    stash_slot: Callable  # (m, r, s) -> slot of the forward's input
    seed_slots: int

    @property
    def ticks(self) -> int:
        return sum(p.ticks for p in self.phases)

    def slots(self) -> tuple[int, int]:
        """(forward slots, backward slots) each stage executes: ticks of phases that run one."""
        return (sum(p.ticks for p in self.phases if p.forward), sum(p.ticks for p in self.phases if p.backward))

    def bubble(self) -> float:
        """The idle share of the executed slots, from the phases alone: 1 - M*V / slots.
        Every schedule here executes as many backward slots as forward ones, so the share
        is the same whatever a backward costs relative to a forward."""
        f, b = self.slots()
        assert f == b, (self.name, f, b)
        return 1 - self.microbatches * self.chunks / f
