"""Autotune: time candidate exchange settings on the run's first steps, then keep the best.

Horovod's autotune (`horovodrun --autotune`, docs/autotune.rst) spends the first steps of
training trying values of its knobs (fusion threshold, cycle time, hierarchical
collectives), scores each sample by bytes allreduced per second, searches with Bayesian
optimisation (a Gaussian process), and then fixes the best for the rest of the run.

dpjax's knobs are discrete: the allreduce algorithm, and a fusion cap, of which only the
caps that change the bucket plan matter (every cap between two plans' thresholds compiles
the same program: `fusion_caps` keeps one per plan). So the search is successive halving
(Karnin, Koren & Somekh 2013; Jamieson & Talwalkar 2016) over that short list: every
candidate runs `per_round` real training steps, in passes that run every candidate once
back to back (the starting candidate rotating) so that the load of a shared machine
hits all alike; the slower half by median step time is dropped; repeat until one is
left, which takes ceil(log2 k) rounds: it converges by construction. A winner that is
not the starting setting must then confirm, in 2 x `per_round` fresh passes of the two,
that it is faster (the median of their paired ratio at least MIN_GAIN), or the starting
setting stays: a winner is partly the luckiest of its last round, and fresh passes are
not biased by that choice.
The score is the step time, not bytes per second: candidates move different bytes (the
parameter server sends four times the ring's), and the step is what the user waits
for. Each candidate's first step compiles it and is not timed. With both knobs asked for, they are searched one
after the other (the algorithm at the given cap, then the cap for that algorithm).

The steps are the run's own: the candidates compute the same update (up to float
round-off), so no step is wasted. The choice and its measured gain over the starting
setting are logged, written to the metrics and recorded in the checkpoint, so a resumed
run keeps it (`dpjax.train`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass

from dpjax.fusion import plan_buckets

# Fusion caps tried, in MiB: Horovod's default 64 down to 1/64, then 0 (no fusion).
CAPS = tuple(2.0 ** k for k in range(6, -7, -1)) + (0.0,)
# A search's winner replaces the starting value only if, paired over the confirmation's
# passes, it is at least this much faster. Not more than 1: other jobs' load stretches every
# step while a communication saving stays what it is, so a relative margin would keep the
# default exactly when the machine is busy (experiments/RESULTS.md: psum's 7% over the
# ring in a quiet grid measured 2.9% in a busier search).
MIN_GAIN = 1.0


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
    which candidate runs the next step and whether it is timed; `tell()` reports it.

    A round is `per_round` passes; a pass runs every candidate still in once, back to
    back, the first one rotating; candidates are ranked by their median step time. The
    passes are kept (`by_pass`) for paired comparisons (`paired_ratio`)."""

    def __init__(self, candidates, per_round: int = 3, compiled=()):
        if per_round < 1 or not candidates:
            raise ValueError(f"need candidates and per_round >= 1, got {len(candidates)}, {per_round}")
        self.alive = list(dict.fromkeys(candidates))
        self.per_round, self.round, self.passes = per_round, 0, 0
        self.samples: dict = {c: [] for c in self.alive}  # seconds of each timed step
        self.by_pass: dict = defaultdict(dict)  # pass -> {candidate: seconds}
        # (candidate, timed, the pass it belongs to: None for a compile's untimed first step)
        self.queue: deque[tuple[object, bool, int | None]] = deque((c, False, None) for c in self.alive
                                                                    if c not in compiled)
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

    def paired_ratio(self, a, b) -> float | None:
        """Median over the passes that ran both of a's step time / b's."""
        rel = [p[a] / p[b] for p in self.by_pass.values() if a in p and b in p]
        return statistics.median(rel) if rel else None

    def ask(self):
        return None if self.done else self.queue[0][:2]

    def tell(self, candidate, seconds: float, timed: bool) -> None:
        if (candidate, timed) != self.queue[0][:2]:
            raise ValueError(f"told {candidate} (timed={timed}), but {self.queue[0][:2]} was asked for")
        _, _, pass_id = self.queue.popleft()
        if timed:
            self.samples[candidate].append(seconds)
            self.by_pass[pass_id][candidate] = seconds
        if not self.queue:  # a round is over: keep the faster half
            ranked = sorted(self.alive, key=self.median)
            self.alive = ranked[:math.ceil(len(ranked) / 2)]
            self.round += 1
            if not self.done:
                self._fill()

    def _fill(self) -> None:
        n = len(self.alive)
        for _ in range(self.per_round):
            shift = self.passes % n  # the starting candidate rotates
            self.queue.extend((c, True, self.passes) for c in self.alive[shift:] + self.alive[:shift])
            self.passes += 1


class Tuner:
    """The search over the knobs asked for, from `start` (the setting a run would use).

    algorithms: candidate algorithms, or None to keep start's; caps_for(algorithm) -> the
    fusion caps to try (`fusion_caps`, with start's cap among them), or None to keep
    start's cap. Each knob is searched (successive halving), then, if the winner is not
    the setting the knob started from, confirmed: 2 x `per_round` fresh passes of the
    two, and the winner is kept only if the median of its paired speed-up over the
    starting value is at least `min_gain`; else the starting value stays."""

    def __init__(self, start: Setting, algorithms=None, caps_for=None, per_round: int = 3,
                 min_gain: float = MIN_GAIN):
        self.start = self.current = start
        self.algorithms, self.caps_for, self.per_round, self.min_gain = algorithms, caps_for, per_round, min_gain
        self.pending = [k for k, on in (("allreduce", algorithms), ("fusion_mb", caps_for is not None)) if on]
        self.compiled: set = set()
        self.stages: list[dict] = []  # {"knob", "from", "search": Halving, "confirm": Halving or None, ...}
        self.steps = 0
        # at most this many steps (the confirmation runs only if a search's winner is new;
        # the cap search's candidate at the chosen algorithm and starting cap has compiled)
        k1 = len(set(algorithms or ()))
        caps = caps_for(start.algorithm) if caps_for is not None else []
        k2, warm2 = len(set(caps)), len(set(caps)) - (k1 > 0 and start.fusion_mb in caps)
        self.budget = sum(halving_steps(k, per_round, warm) + 4 * per_round
                          for k, warm in ((k1, k1), (k2, warm2)) if k > 1)
        self._advance()

    def _candidates(self, knob: str) -> list:
        if knob == "allreduce":
            return [Setting(a, self.current.fusion_mb) for a in self.algorithms]
        return [Setting(self.current.algorithm, c) for c in self.caps_for(self.current.algorithm)]

    def _advance(self) -> None:
        """Moves on from every finished stage: confirm a new winner, decide, open the next knob."""
        while True:
            stage = self.stages[-1] if self.stages else None
            if stage is not None and "choice" not in stage:
                h = stage["confirm"] or stage["search"]
                if not h.done:
                    return
                winner, ref = stage["search"].winner, stage["from"]
                if winner != ref and stage["confirm"] is None:
                    stage["confirm"] = Halving([ref, winner], 2 * self.per_round, compiled=self.compiled)
                    continue
                ratio = stage["confirm"].paired_ratio(ref, winner) if winner != ref else 1.0
                stage["ratio"] = ratio
                stage["choice"] = winner if ratio is not None and ratio >= self.min_gain else ref
                self.current = stage["choice"]
                continue
            if not self.pending:
                return
            knob = self.pending.pop(0)
            self.stages.append({"knob": knob, "from": self.current, "confirm": None,
                                "search": Halving(self._candidates(knob), self.per_round, compiled=self.compiled)})

    @property
    def done(self) -> bool:
        return not self.pending and all("choice" in st for st in self.stages)

    def ask(self):
        """(setting, timed) for the next step; None once the search is over."""
        if self.done:
            return None
        st = self.stages[-1]
        return (st["confirm"] or st["search"]).ask()

    def tell(self, setting: Setting, seconds: float, timed: bool) -> None:
        st = self.stages[-1]
        (st["confirm"] or st["search"]).tell(setting, seconds, timed)
        self.compiled.add(setting)
        self.steps += 1
        self._advance()

    @property
    def choice(self) -> Setting:
        return self.current

    def gain(self) -> float:
        """How much faster the choice ran than the starting setting: the product over the
        knobs of the paired ratio of the knob's starting value to its choice (1 where the
        starting value stayed)."""
        g = 1.0
        for st in self.stages:
            if st["choice"] != st["from"]:
                g *= st["ratio"]
        return g

    def record(self) -> dict:
        """What the metrics and the checkpoint keep: the choice, its gain, and per knob the
        search's median step time (ms) per candidate, its winner and the confirmation."""
        return {"allreduce": self.choice.algorithm, "fusion_mb": self.choice.fusion_mb,
                "tuned": [st["knob"] for st in self.stages], "gain": round(self.gain(), 4), "steps": self.steps,
                "start": str(self.start), "min_gain": self.min_gain,
                "stages": [{"knob": st["knob"], "from": str(st["from"]), "winner": str(st["search"].winner),
                            "winner_vs_from": None if st.get("ratio") is None else round(st["ratio"], 4),
                            "choice": str(st["choice"]),
                            "medians_ms": {str(c): round(st["search"].median(c) * 1e3, 3)
                                           for c in st["search"].samples if st["search"].samples[c]}}
                           for st in self.stages]}
