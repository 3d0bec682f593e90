"""1F1B (PipeDream-Flush): each stage alternates one forward and one backward.

Narayanan, Phanishayee, Shi, Chen & Zaharia, "Memory-efficient pipeline-parallel DNN
training" (PipeDream-2BW / PipeDream-Flush, ICML 2021), the schedule Megatron-LM trains
with (Narayanan et al., SC 2021, section 2.2.1). A micro-batch's backward starts as soon
as its forward leaves the last stage, so a stage holds the activations of only the
micro-batches in flight between it and the last stage, not of all M.

Written SPMD, in lockstep: at tick t stage s runs the forward of micro-batch t - s and,
in the same tick, the backward of micro-batch t - (2S-2-s) (different micro-batches;
the last stage runs both of the same one: forward, loss and its gradient, backward).
Every hop is one tick, so the phases are: S-1 ticks of forwards only (fill), M ticks of
one forward and one backward (steady), S-1 ticks of backwards only (drain). Each stage
executes M + S - 1 forward and M + S - 1 backward slots, M of each real:

    bubble = (S - 1) / (M + S - 1)        (GPipe's, with bounded memory)

The forward of m on stage s is undone at tick m + 2S-2-s, 2(S-1-s) ticks later: stage s
keeps at most 2(S-1-s) + 1 <= 2S - 1 stage inputs, in slots indexed by the forward's
tick mod 2S-1, whatever M is. (The asynchronous original keeps S - s: there a hop costs
one forward or one backward, here one tick of both.)
"""

from __future__ import annotations

from dpjax.pipeline.schedule import Schedule, Timetable, phases


def timetable(stages: int, microbatches: int, virtual_stages: int = 1) -> Timetable:
    S, M = stages, microbatches
    assert virtual_stages == 1, "1f1b: one chunk a stage (checked in dpjax.pipeline.check)"
    K = 2 * S - 1  # stash slots: a forward's input lives 2(S-1-s) + 1 ticks at most

    def forward(t, s):
        m = t - s
        return m, 0, (m >= 0) & (m < M)

    def backward(t, s):
        m = t - (2 * S - 2 - s)
        return m, 0, (m >= 0) & (m < M)

    return Timetable("1f1b", S, M, 1, phases(S - 1, M, S - 1), forward, backward,
                     stash_slots=K, stash_slot=lambda m, r, s: (m + s) % K, seed_slots=1)


SCHEDULE = Schedule("1f1b", timetable, bubble=lambda S, M, V: (S - 1) / (M + S - 1),
                    stash=lambda S, M, V: min(M, 2 * S - 1))  # bounded by the stages, not by M
