"""`--commit-every auto`: the smallest commit interval whose measured cost stays within 5%
of the step time, measured as the run goes.

Others fix the interval by hand (orbax's emergency checkpoints: local every 10 steps by
default; Horovod's elastic docs: commit every N batches). Here it is measured, from the
loop's iteration times (in steady state the step time) and each commit's end-to-end
seconds:

    step_s   the median iteration with no commit's effect in it: no commit in flight and
             none finished within `lag` iterations (a commit's device copy delays steps
             the loop waits for up to MAX_IN_FLIGHT iterations later)
    cost_s   what one commit adds to the loop: over the last `window` iterations, the
             seconds of the iterations beside a commit (one began in them, one was in
             flight, or one finished within `lag`) beyond the mean iteration free of
             commits (in the window), per commit begun in them. Not bounded by the commit's own seconds:
             a commit also slows the steps it shares the machine with (on CPU its copy
             and writing take cores the step's threads use; on a GPU its copy shares the
             link and memory bandwidth): on a 2-core VM the 1.2 GB GPT at the interval
             chosen from the commits' own seconds (every 4 steps) ran at 1.20x the step
             without commits. Until a commit's effect is measured: its own end-to-end seconds.
    every    max(ceil(cost_s / (target x step_s)), ceil(commit_s / step_s)): the cost
             within `target` of the step, and no commit asked for before the previous
             one is written (the loop would wait for it); at most `max_every`

The first commit comes once `warm` iterations are measured (the first `skip`, which
compile, are not: `first`), the second lag + 2 steps later (the first one's effect
seen whole); from then on the interval is decided at each commit for the gap to the
next one, and what a failure loses is at most that gap plus the step in flight. When no
iteration has been free of commits for `stale` iterations (a small interval), the next
gap is made long enough to measure the step again (the iterations a commit's effect
lasts, plus `warm`).

`--max-lost-steps N` caps the gap: a failure loses the steps done since the newest commit
written, at most gap + min(k, gap) - 1 where k = ceil(commit_s / step_s) is how many steps
one commit's write spans (each commit waits for the one before it), so the gap is the
largest whose loss stays within N (k unknown: as if the write spanned the whole gap). A gap
the cap makes smaller than the target asks costs more than the target: `describe` says how
much. A gap of a few steps leaves no iteration free of commits, so the step (and the cost)
cannot be measured in the run: `describe` says so rather than guess.
"""

from __future__ import annotations

import collections
import math

TARGET = 0.05


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return None if not n else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


class AutoInterval:
    def __init__(self, target: float = TARGET, lag: int = 5, max_every: int = 100, window: int = 32,
                 stale: int = 64, skip: int = 2, warm: int = 3, max_lost: int | None = None):
        self.target, self.lag, self.max_every, self.stale, self.skip, self.warm = \
            target, lag, max_every, stale, skip, warm
        self.max_lost = max_lost  # --max-lost-steps: the most steps a failure may lose (None: no cap)
        self.clean: collections.deque = collections.deque(maxlen=16)  # iteration seconds free of commits
        self.recent: collections.deque = collections.deque(maxlen=window)  # (seconds, began, beside one)
        self.commit_s: collections.deque = collections.deque(maxlen=5)  # end-to-end seconds of the last commits
        self.seen, self.since_clean, self.quiet_after = 0, 0, 0
        self.began_at, self.span = None, 2 * lag  # iterations one commit's effect lasts (until measured: a guess)
        self.every: int | None = None  # the gap to the next commit, decided at the last commit
        self.measured = False  # whether that gap came from a measured cost
        self.basis: dict = {}  # the figures the last measured gap was chosen from
        self.remeasure = False  # whether it was made long to measure the step again
        self.wanted: int | None = None  # the gap the target alone asked for (above the cap: capped)

    # --- what the loop tells it ---

    def tick(self, seconds: float, busy: bool, began: bool) -> None:
        """One loop iteration's seconds; busy: a commit was in flight during it (or
        finished less than `lag` iterations ago); began: a commit was asked for in it."""
        self.seen += 1
        if began:
            self.began_at = self.seen
        if self.seen <= self.skip:
            return
        self.quiet_after = self.lag if busy else max(0, self.quiet_after - 1)
        self.recent.append((seconds, int(began), bool(began or busy or self.quiet_after)))
        if busy or self.quiet_after:
            self.since_clean += 1
        else:
            if self.since_clean and self.began_at is not None:  # a commit's effect is over: how long it lasted
                self.span = self.seen - self.began_at
            self.clean.append(seconds)
            self.since_clean = 0

    def finished(self, commit_s: float) -> None:
        """A commit's end-to-end seconds (from its step's end until written and copied)."""
        self.commit_s.append(commit_s)

    # --- what it tells the loop ---

    @property
    def step_s(self) -> float | None:
        return _median(self.clean) if len(self.clean) >= self.warm else None

    @property
    def cost_s(self) -> float | None:
        """One commit's cost to the loop, in seconds (None: nothing measured yet): the
        iterations beside the commits begun in the window against those free of them
        in the same window (means on both sides, the same load: a loaded machine's
        noise is in both alike)."""
        own = _median(self.commit_s)
        if own is None or self.step_s is None:
            return None
        commits = sum(b for _, b, _ in self.recent)
        if not commits:
            return own
        free = [s for s, _, beside in self.recent if not beside]  # the same window's: the same load
        free = free if len(free) >= self.warm else self.clean
        plain = sum(free) / len(free)
        slowdown = sum(s - plain for s, _, beside in self.recent if beside) / commits
        return max(0.0, slowdown)

    @property
    def spans(self) -> int | None:
        """k: the steps one commit's write spans (None: not measured)."""
        own, step = _median(self.commit_s), self.step_s
        return None if own is None or step is None else max(1, _ceil(own / step))

    def can_lose(self, every: int) -> int:
        """The most steps done that a failure loses at this gap (k unknown: the whole gap)."""
        k = self.spans
        return every + min(every if k is None else k, every) - 1

    def cap(self) -> int | None:
        """The largest gap whose loss stays within --max-lost-steps (None: no cap)."""
        if self.max_lost is None:
            return None
        return max(e for e in range(1, self.max_lost + 1) if self.can_lose(e) <= self.max_lost)

    def choose(self) -> int | None:
        """The interval for the next gap (None: not measured yet, no commit but the first)."""
        step, cost = self.step_s, self.cost_s
        if step is None or cost is None:
            return None
        self.basis = {"step_s": step, "cost_s": cost, "commit_s": _median(self.commit_s)}  # what decided it
        every = max(_ceil(cost / (self.target * step)), _ceil(_median(self.commit_s) / step), 1)
        every = self.wanted = min(every, self.max_every)
        self.remeasure = self.since_clean >= self.stale
        if self.remeasure:  # measure the step again: a gap with `warm` iterations free of commits
            every = max(every, self.span + self.warm)
            self.since_clean = 0
        return every

    def committed(self) -> int:
        """At a commit: the gap to the next one, decided now (recorded in its meta). Until
        a commit's cost is measured: lag + 2, long enough to see its effect whole; never
        over --max-lost-steps' cap."""
        chosen = self.choose()
        self.every = chosen if chosen is not None else self.lag + 2
        self.measured = chosen is not None
        cap = self.cap()
        if cap is not None and self.every > cap:
            self.every, self.remeasure = cap, False  # the bound first: the step is measured only where it allows
        return self.every

    @property
    def first(self) -> int:
        """Steps from the start (or a restart) to the first commit: the step measured first
        (sooner under --max-lost-steps: a failure before it loses the steps from the start)."""
        cap = self.cap()
        return self.skip + self.warm + 1 if cap is None else min(self.skip + self.warm + 1, cap)

    @property
    def iteration_s(self) -> float | None:
        """The median iteration of the window, commits and all (what the loop runs at)."""
        return _median([s for s, _, _ in self.recent])

    def describe(self) -> dict:
        """The last gap chosen and the figures it was chosen from (not those of now: the
        loop has measured more iterations since)."""
        basis = self.basis if self.measured else {"step_s": self.step_s, "cost_s": self.cost_s,
                                                  "commit_s": _median(self.commit_s)}
        out = {"every": self.every, **{k: _round(v) for k, v in basis.items()}, "target": self.target,
               "can_lose": self.can_lose(self.every)}
        if self.max_lost is not None:
            step, cost = basis["step_s"], basis["cost_s"]
            out.update(max_lost_steps=self.max_lost, iteration_s=_round(self.iteration_s),
                       # the cost at the gap in force, as a share of the step (over `target` when capped)
                       cost_share=None if step is None or cost is None else _round(cost / (self.every * step)),
                       wanted=self.wanted if self.measured else None)
        return out


    @property
    def settled(self) -> bool:
        """Whether the interval is worth saying: decided here (process 0 decides, the others
        read its gaps), and measured or under a cap that leaves no iteration free of commits
        for long (nothing more will be measured)."""
        stuck = self.max_lost is not None and self.commit_s and self.since_clean >= self.lag + 2 + self.warm
        return self.every is not None and (self.measured or bool(stuck))

    def line(self) -> str:
        """The one line that says the interval, what it was chosen from and what a failure loses."""
        d = self.describe()
        if d["cost_s"] is not None and d["step_s"] is not None and self.measured:
            cost = (f"a commit costs {d['cost_s']:.3g} s of the loop and takes {d['commit_s']:.3g} s, "
                    f"a step {d['step_s']:.3g} s")
        else:
            cost = (f"a commit takes {d['commit_s']:.3g} s; its cost to the loop is not measured: no iteration "
                    f"is free of commits at this interval (an iteration, commits and all: {d['iteration_s']:.3g} s)")
        if self.max_lost is None:
            why = f"--commit-every auto: {cost}; within {100 * self.target:g}% of the step"
        else:
            why = f"--max-lost-steps {self.max_lost}: {cost}"
            if d["cost_share"] is not None:
                over = d["cost_share"] > self.target
                why += (f"; commits cost {100 * d['cost_share']:.3g}% of the step"
                        + (f", over the {100 * self.target:g}% target (auto alone: every {d['wanted']} steps)"
                           if over else ""))
        return (f"dpjax.recovery.commit: committing every {d['every']} steps ({why}); a failure loses at most "
                f"{d['can_lose']} steps done and the step in flight. Fewer: --max-lost-steps N")


def _ceil(x: float) -> int:
    """ceil, but a ratio that is whole up to round-off (0.2 / 0.05) stays whole."""
    return math.ceil(x - 1e-9)


def _round(x):
    return None if x is None else round(x, 4)
