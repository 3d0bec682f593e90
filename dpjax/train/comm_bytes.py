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
each marked cond (other conds, loops and calls are followed whole, as hlo_comm counts
them). A cond's branch_computations are {false, true}: lax.cond turns the predicate
into branch index 0 for False, 1 for True.
"""

from __future__ import annotations

import re

# a marked cond: its op_name ends in the scope's cond (a cond nested in a marked
# branch carries the outer name too, further up its op_name)
_MARK = re.compile(r'op_name="[^"]*dpjax:(compression|average)\([^()"]*\)/cond"')
_HEAD = re.compile(r"(ENTRY\s+)?%([^\s(]+)\s.*\{\s*$")


class StepBytes:
    """`at(compressed, averaged)`: the busiest device's bytes in a step that runs the
    compressed (else the exact) exchange, and averages (else skips sparse:P's average)."""

    def __init__(self, hlo_text: str):
        self.comps, self.entry, cur = {}, None, None
        for line in hlo_text.splitlines():
            head = _HEAD.match(line)
            if head and not line.startswith(" "):
                cur = self.comps.setdefault(head.group(2), [])
                self.entry = head.group(2) if head.group(1) else self.entry
            elif line.startswith("}"):
                cur = None
            elif cur is not None:
                cur.append(line)
        self._memo: dict = {}

    def _reached(self, take: dict) -> set:
        """Computations run from the entry, taking branch `take[kind]` of each marked cond."""
        seen, todo = set(), [self.entry]
        while todo:
            name = todo.pop()
            if name in seen or name not in self.comps:
                continue
            seen.add(name)
            for line in self.comps[name]:
                mark = _MARK.search(line) if " conditional(" in line else None
                branches = re.search(r"branch_computations=\{([^}]*)\}", line) if mark else None
                if branches:
                    false, true = (b.strip().lstrip("%") for b in branches.group(1).split(","))
                    todo.append(true if take[mark.group(1)] else false)
                    continue
                todo.extend(ref for ref in re.findall(r"%([\w.\-]+)", line) if ref in self.comps)
        return seen

    def at(self, compressed: bool, averaged: bool = True) -> int:
        from dpjax.collectives.cost import hlo_comm

        key = (bool(compressed), bool(averaged))
        if key not in self._memo:
            names = self._reached({"compression": not compressed, "average": averaged})
            lines = [line for n in self.comps if n in names for line in self.comps[n]]
            self._memo[key] = max(hlo_comm("\n".join(lines)).bytes_per_device.values(), default=0)
        return self._memo[key]


def averages_at(plan, step: int) -> bool:
    """Whether step `step` (0-based) runs the rule's exchange between workers: every step
    but under sparse:P, whose average ends every P-th step (`accounting.period`)."""
    from dpjax.compression import accounting

    return (step + 1) % accounting.period(plan) == 0


class CommBytes:
    """What the busiest device sends in step i of a run, its program read once per
    compiled step (JAX's cached executable, so no compile), charged the branches step i
    runs (`StepBytes`), not all of them."""

    def __init__(self, plan=None):
        self._sent, self.plan = {}, plan

    def __call__(self, step, args, step_i: int = 0) -> int:
        from dpjax.compression import accounting

        if id(step) not in self._sent:
            from dpjax.timeline import compiled_text

            self._sent[id(step)] = StepBytes(compiled_text(step.train, *args))
        if self.plan is None:
            return self._sent[id(step)].at(True, True)
        return self._sent[id(step)].at(accounting.compressed_at(self.plan, step_i), averages_at(self.plan, step_i))
