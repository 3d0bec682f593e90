"""What the busiest device sends in one step of a run, read from its compiled program.

A step's program can hold exchanges that run on some steps only, each under a named
`lax.cond`:

    dpjax:compression(start=S)   lax.cond(t < S, exact, compressed): the exact exchange
                                 for the first S exchanges, the compressed one after
                                 (`compression.feedback`, `compression.sharded`)
    dpjax:average(period=P)      lax.cond(t % P == 0, average, identity): sparse:P's
                                 average, once every P steps (`updates.sparse`)

`cost.hlo_comm` alone adds every branch of every cond. Here a step is charged what it
runs: the computations reachable from the entry that follow only the taken branch of
each marked cond (other conds and calls are followed whole, as hlo_comm counts them,
and a while loop's body trip-count times, `hlo.Module.times`). A cond's
branch_computations are {false, true}: lax.cond turns the predicate into branch index 0
for False, 1 for True.
"""

from __future__ import annotations

import re

from dpjax.collectives.cost import hlo_comm
from dpjax.compression import accounting
from dpjax.hlo import Module
from dpjax.timeline import compiled_text

# a marked cond: its op_name ends in the scope's cond (a cond nested in a marked
# branch carries the outer name too, further up its op_name)
_MARK = re.compile(r'op_name="[^"]*dpjax:(compression|average)\([^()"]*\)/cond"')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


class StepBytes:
    """`at(compressed, averaged)`: the busiest device's bytes in a step that runs the
    compressed (else the exact) exchange, and averages (else skips sparse:P's average)."""

    def __init__(self, hlo_text: str):
        self.module = Module(hlo_text)
        self._memo: dict = {}

    def at(self, compressed: bool, averaged: bool = True) -> int:
        key = (bool(compressed), bool(averaged))
        if key not in self._memo:
            take = {"compression": not compressed, "average": averaged}

            def follow(ins):  # the taken branch of a marked cond; every branch of others
                mark, branches = _MARK.search(ins.attrs), _BRANCHES.search(ins.attrs)
                if not (mark and branches):
                    return None
                false, true = (b.strip().lstrip("%") for b in branches.group(1).split(","))
                return [true if take[mark.group(1)] else false]

            self._memo[key] = hlo_comm(self.module, follow).max_bytes
        return self._memo[key]


def averages_at(plan, step: int) -> bool:
    """Whether step `step` (0-based) runs the rule's exchange between workers: every step
    but under sparse:P, whose average ends every P-th step (`accounting.period`)."""
    return (step + 1) % accounting.period(plan) == 0


class CommBytes:
    """What the busiest device sends in step i of a run, its program read once per
    compiled step (JAX's cached executable, so no compile), charged the branches step i
    runs (`StepBytes`), not all of them."""

    def __init__(self, plan=None):
        self._sent, self.plan = {}, plan

    def __call__(self, step, args, step_i: int = 0) -> int:
        if id(step) not in self._sent:
            self._sent[id(step)] = StepBytes(compiled_text(step.train, *args))
        if self.plan is None:
            return self._sent[id(step)].at(True, True)
        return self._sent[id(step)].at(accounting.compressed_at(self.plan, step_i), averages_at(self.plan, step_i))
