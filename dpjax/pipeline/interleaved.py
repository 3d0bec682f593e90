"""Interleaved 1F1B: V chunks of layers per stage, visited round robin.

Narayanan et al., "Efficient large-scale language model training on GPU clusters using
Megatron-LM" (SC 2021), section 2.2.2. The L layers are cut into S*V chunks and chunk
c = r*S + s lives on stage s (`--virtual-stages V`): a micro-batch goes through stages
0..S-1 for chunk 0, wraps around from the last stage to the first for chunk 1, and so
on V times (the circular pipeline of GPipe-style frameworks, here with 1F1B's order). A
tick now costs one chunk, 1/V of a stage's layers, and the fill still takes S - 1 ticks:

    bubble = (S - 1) / (V*M + S - 1)

at the price of V times as many sends. Micro-batches enter in groups of S (M must be a
multiple of S, as in Megatron-LM): micro-batch m = g*S + i runs chunk r on stage s
forward at tick

    F(m, r, s) = (g*V + r)*S + i + s,

so each stage runs one forward per tick from tick s to V*M + s - 1, and the backward
mirrors it from the last chunk down, starting in the tick of the last chunk's forward:

    B(m, r, s) = F(m, V-1, S-1) + (V-1-r)*S + (S-1-s).

Phases: V*S - 1 ticks of forwards only, V*M - (V-1)*S ticks of both, V*S - 1 of
backwards only. A chunk's input lives B - F = 2S(V-1-r) + 2(S-1-s) ticks, so 2SV - 1
stash slots (indexed by the forward's tick) hold every stage's in-flight inputs,
whatever M is. V = 1 is 1F1B exactly (tests/test_pipeline.py checks the timetables).
"""

from __future__ import annotations

from dpjax.pipeline.schedule import Schedule, Timetable, phases


def timetable(stages: int, microbatches: int, virtual_stages: int) -> Timetable:
    S, M, V = stages, microbatches, virtual_stages
    assert V == 1 or M % S == 0, "interleaved: micro-batches enter in groups of S (checked in dpjax.pipeline.check)"
    K = 2 * S * V - 1

    def unpack(u):  # u = (g*V + q)*S + i  ->  micro-batch g*S + i, q
        i, q = u % S, u // S
        return (q // V) * S + i, q % V

    def forward(t, s):
        u = t - s
        m, r = unpack(u)
        return m, r, (u >= 0) & (m < M)

    def backward(t, s):
        u = t - (2 * S - 2 - s) - (V - 1) * S
        m, q = unpack(u)
        return m, V - 1 - q, (u >= 0) & (m < M)

    def stash_slot(m, r, s):
        return ((m // S * V + r) * S + m % S + s) % K  # F(m, r, s) mod K

    return Timetable("interleaved", S, M, V, phases(V * S - 1, V * M - (V - 1) * S, V * S - 1), forward, backward,
                     stash_slots=K, stash_slot=stash_slot, seed_slots=1)


SCHEDULE = Schedule("interleaved", timetable, bubble=lambda S, M, V: (S - 1) / (V * M + S - 1),
                    virtual_stages=True, stash=lambda S, M, V: min(M * V, 2 * S * V - 1))
