"""Autotune: time candidate exchange settings on the run's first steps, then keep the best.

Horovod's autotune (`horovodrun --autotune`, docs/autotune.rst) spends the first steps of
training trying values of its knobs (fusion threshold, cycle time, hierarchical
collectives), scores each sample by bytes allreduced per second, searches with Bayesian
optimisation (a Gaussian process), and then fixes the best for the rest of the run.

dpjax's knobs are discrete: the allreduce algorithm, and a fusion cap, of which only the
caps that change the bucket plan matter (every cap between two plans' thresholds compiles
the same program: `fusion_caps` keeps one per plan). So the search is successive halving
(Karnin, Koren & Somekh 2013; Jamieson & Talwalkar 2016) over that short list: every
candidate runs `per_round` real training steps, interleaved round-robin (the starting
candidate rotating) so that the load of a shared machine hits all alike; the slower half
by median step time is dropped; repeat until one is left, which takes
ceil(log2 k) rounds: it converges by construction. The score is the step time, not
bytes per second: candidates move different bytes (the parameter server sends four
times the ring's), and the step is what the user waits for. Each candidate's first
step compiles it and is not timed. With both knobs asked for, they are searched one
after the other (the algorithm at the given cap, then the cap for that algorithm).

The steps are the run's own: the candidates compute the same update (up to float
round-off), so no step is wasted. The choice and its measured gain over the starting
setting are logged, written to the metrics and recorded in the checkpoint, so a resumed
run keeps it (`dpjax.train`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from dpjax.fusion import plan_buckets

# Fusion caps tried, in MiB: Horovod's default 64 down to 1/64, then 0 (no fusion).
CAPS = tuple(2.0 ** k for k in range(6, -7, -1)) + (0.0,)


@dataclass(frozen=True)
class Setting:
    """One candidate: the allreduce algorithm and the fusion cap (MiB)."""

    algorithm: str
    fusion_mb: float

    def __str__(self) -> str:
        return f"{self.algorithm}@{self.fusion_mb:g}"


def fusion_caps(abstract_grads, caps=CAPS) -> list[float]:
    """The caps among `caps` (largest first) that give distinct bucket plans for these
    gradients (arrays or ShapeDtypeStructs): the first cap of each plan stands for it."""
    seen: dict = {}
    for cap in caps:
        plan = plan_buckets(abstract_grads, cap * 2**20)
        seen.setdefault(tuple(b.leaves for b in plan.buckets), cap)
    return list(seen.values())


def halving_steps(k: int, per_round: int, warmup: int | None = None) -> int:
    """Steps successive halving takes over k candidates (warmup: how many compile first)."""
    steps, alive = (k if warmup is None else warmup), k
    while alive > 1:
        steps += per_round * alive
        alive = math.ceil(alive / 2)
    return steps


class Halving:
    """Successive halving over `candidates`, one training step at a time: `ask()` says
    which candidate runs the next step and whether it is timed; `tell()` reports it."""

    def __init__(self, candidates, per_round: int = 3, compiled=()):
        if per_round < 1 or not candidates:
            raise ValueError(f"need candidates and per_round >= 1, got {len(candidates)}, {per_round}")
        self.alive = list(dict.fromkeys(candidates))
        self.per_round, self.round = per_round, 0
        self.samples: dict = {c: [] for c in self.alive}
        self.queue = deque((c, False) for c in self.alive if c not in compiled)
        if len(self.alive) > 1:
            self._fill()

    @property
    def done(self) -> bool:
        return len(self.alive) == 1

    @property
    def winner(self):
        return self.alive[0] if self.done else None

    def median(self, c) -> float:
        return statistics.median(self.samples[c]) if self.samples[c] else math.inf

    def ask(self):
        return None if self.done else self.queue[0]

    def tell(self, candidate, seconds: float, timed: bool) -> None:
        if (candidate, timed) != self.queue[0]:
            raise ValueError(f"told {candidate} (timed={timed}), but {self.queue[0]} was asked for")
        self.queue.popleft()
        if timed:
            self.samples[candidate].append(seconds)
        if not self.queue:  # a round is over: keep the faster half
            ranked = sorted(self.alive, key=self.median)
            self.alive = ranked[:math.ceil(len(ranked) / 2)]
            self.round += 1
            if not self.done:
                self._fill()

    def _fill(self) -> None:
        n = len(self.alive)
        for k in range(self.per_round):
            shift = (self.round * self.per_round + k) % n
            self.queue.extend((c, True) for c in self.alive[shift:] + self.alive[:shift])


class Tuner:
    """The search over the knobs asked for, from `start` (the setting a run would use).

    algorithms: candidate algorithms, or None to keep start's; caps_for(algorithm) -> the
    fusion caps to try (`fusion_caps`, with start's cap among them so that the gain is
    measured against it), or None to keep start's cap."""

    def __init__(self, start: Setting, algorithms=None, caps_for=None, per_round: int = 3):
        self.start, self.caps_for, self.per_round = start, caps_for, per_round
        self.compiled: set = set()
        self.stages: list[tuple[str, Halving]] = []
        self.steps = 0
        # the steps the whole search takes, known before it starts (the cap stage's
        # candidate at the starting cap ran in the algorithm stage: it compiled there)
        k1 = len(set(algorithms or ()))
        caps = caps_for(start.algorithm) if caps_for is not None else []
        k2, warm2 = len(set(caps)), len(set(caps)) - (k1 > 0 and start.fusion_mb in caps)
        self.budget = (halving_steps(k1, per_round) if k1 > 1 else 0) + (
            halving_steps(k2, per_round, warm2) if k2 > 1 else 0)
        if algorithms:
            self._stage("allreduce", [Setting(a, start.fusion_mb) for a in algorithms])
        elif caps_for is not None:
            self._next_stage(start)

    def _stage(self, knob: str, candidates) -> None:
        self.stages.append((knob, Halving(candidates, self.per_round, compiled=self.compiled)))

    def _next_stage(self, best: Setting) -> None:
        caps = self.caps_for(best.algorithm)
        self._stage("fusion_mb", [Setting(best.algorithm, c) for c in caps])

    @property
    def done(self) -> bool:
        return not self.stages or (self.stages[-1][1].done and not self._more())

    def _more(self) -> bool:
        return self.caps_for is not None and self.stages[-1][0] == "allreduce"

    def ask(self):
        """(setting, timed) for the next step; None once the search is over."""
        while self.stages and self.stages[-1][1].done and self._more():
            self._next_stage(self.stages[-1][1].winner)
        return None if self.done else self.stages[-1][1].ask()

    def tell(self, setting: Setting, seconds: float, timed: bool) -> None:
        self.stages[-1][1].tell(setting, seconds, timed)
        self.compiled.add(setting)
        self.steps += 1
        self.ask()  # opens the next stage if this one just finished

    @property
    def choice(self) -> Setting:
        return self.stages[-1][1].winner if self.stages else self.start

    def gain(self) -> float | None:
        """How much faster the choice ran than the starting setting: per stage, the
        median step time of the stage's candidate with the starting value over its
        winner's (measured in the same interleaved rounds), multiplied over the stages.
        None if a stage had no candidate with the starting value."""
        g = 1.0
        for knob, h in self.stages:
            ref = Setting(h.winner.algorithm, self.start.fusion_mb) if knob == "fusion_mb" else self.start
            if not h.samples.get(ref):
                return None
            g *= h.median(ref) / h.median(h.winner)
        return g

    def record(self) -> dict:
        """What the metrics and the checkpoint keep: the choice, its gain, and each
        stage's median step time (ms) per candidate."""
        gain = self.gain()
        return {"allreduce": self.choice.algorithm, "fusion_mb": self.choice.fusion_mb,
                "tuned": [k for k, _ in self.stages], "gain": None if gain is None else round(gain, 4),
                "steps": self.steps, "start": str(self.start),
                "stages": [{"knob": k, "winner": str(h.winner),
                            "medians_ms": {str(c): round(h.median(c) * 1e3, 3) for c in h.samples if h.samples[c]}}
                           for k, h in self.stages]}
