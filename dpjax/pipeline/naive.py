"""The naive schedule: one stage at work at a time, all forwards, then all backwards.

What "send a different partition of the model to each device" gives without a pipeline
(GPipe, Huang et al. 2019, figure 2b; picotron's naive model parallelism): micro-batch m's
forward runs on stage 0, then on stage 1, ..., then the next micro-batch's; after the
last forward, the backwards run the same way in reverse. Stages never overlap, so at
every tick S - 1 of the S stages wait:

    bubble = (S - 1) / S        (whatever M)

Forward of m on stage s at tick m*S + s; backward at M*S + m*S + (S-1-s). Each stage keeps
the input of all M micro-batches (and the last stage all M loss gradients) until the
backward: memory grows with M. It is the teaching baseline the real schedules are
measured against.
"""

from __future__ import annotations

from dpjax.pipeline.schedule import Phase, Schedule, Timetable


def timetable(stages: int, microbatches: int, virtual_stages: int = 1) -> Timetable:
    S, M = stages, microbatches
    assert virtual_stages == 1, "naive: one chunk a stage (checked in dpjax.pipeline.check)"
    n = M * S  # forward ticks, then as many backward ticks

    def forward(t, s):
        m = t // S
        return m, 0, (t % S == s) & (m >= 0) & (m < M)

    def backward(t, s):
        u = t - n
        m = u // S
        return m, 0, (S - 1 - u % S == s) & (m >= 0) & (m < M)

    return Timetable("naive", S, M, 1, (Phase(0, n, True, False), Phase(n, n, False, True)), forward, backward,
                     stash_slots=M, stash_slot=lambda m, r, s: m, seed_slots=M)


SCHEDULE = Schedule("naive", timetable, bubble=lambda S, M, V: (S - 1) / S)
