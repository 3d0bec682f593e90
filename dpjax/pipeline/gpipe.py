"""GPipe: all forwards of M micro-batches through the pipeline, then all backwards.

Huang et al., "GPipe: Efficient training of giant neural networks using pipeline
parallelism" (NeurIPS 2019), section 2.2. The batch is cut into M micro-batches; stage s
runs the forward of micro-batch m at tick m + s (so S stages work at once once the pipe
is full), and after the last forward the backwards flow back the same way: micro-batch
m's backward on stage s at tick (M+S-1) + m + (S-1-s). Both passes take M + S - 1 ticks
of which M are work, so

    bubble = (S - 1) / (M + S - 1)

As in the paper, only stage-boundary activations are kept (re-materialisation: the
backward recomputes the stage's forward from its input), but every stage keeps them for
all M micro-batches until the backward begins, and the last stage the M loss gradients:
activation memory grows with M (1F1B's does not).
"""

from __future__ import annotations

from dpjax.pipeline.schedule import Phase, Schedule, Timetable


def timetable(stages: int, microbatches: int, virtual_stages: int = 1) -> Timetable:
    S, M = stages, microbatches
    assert virtual_stages == 1, "gpipe: one chunk a stage (checked in dpjax.pipeline.check)"
    n = M + S - 1  # ticks of each pass

    def forward(t, s):
        m = t - s
        return m, 0, (m >= 0) & (m < M)

    def backward(t, s):
        m = t - n - (S - 1 - s)
        return m, 0, (m >= 0) & (m < M)

    return Timetable("gpipe", S, M, 1, (Phase(0, n, True, False), Phase(n, n, False, True)), forward, backward,
                     stash_slots=M, stash_slot=lambda m, r, s: m, seed_slots=M)


SCHEDULE = Schedule("gpipe", timetable, bubble=lambda S, M, V: (S - 1) / (M + S - 1))
