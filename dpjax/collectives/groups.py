"""Process sets: collectives over subsets of an axis's ranks (Horovod's process sets).

`groups=[[0, 2, 4], [1, 3]]`: each group runs the chosen algorithm among its own
members exactly as over an axis of its size, its i-th listed member acting as rank i
(so `root=0` is each group's first member). The algorithms address ranks only through
`ranks.index` / `permute`, which a `Subgroups` view maps onto the members: every
step of all the groups of one size is one `ppermute` whose pairs stay inside groups.
Groups of different sizes run one after another, one pass per size, and each rank
keeps its own group's result; a rank in no group keeps its input (allreduce,
broadcast). A collective that changes the shape (reduce_scatter, all_gather,
all_to_all) needs groups of one size covering the axis, since shard_map gives every
rank the same output shape.

Per device: what the algorithm sends over an axis of its group's size; steps: the sum
of the algorithm's steps over the distinct group sizes (`cost.schedule_sets`).
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

from dpjax.collectives.ranks import Subgroups


def check_groups(groups, n: int, what: str, *, partition: bool) -> tuple[tuple[int, ...], ...]:
    """Validated groups as tuples; one-line ValueErrors for anything that does not fit."""
    try:
        members = tuple(tuple(operator.index(r) for r in g) for g in groups)
    except TypeError:
        raise ValueError(f"{what}: groups must be lists of integer ranks, got {groups!r}") from None
    seen: set[int] = set()
    for g in members:
        if not g:
            raise ValueError(f"{what}: groups {list(map(list, members))} include an empty group")
        for r in g:
            if not 0 <= r < n:
                raise ValueError(f"{what}: rank {r} of group {list(g)} is outside the axis of size {n}")
            if r in seen:
                raise ValueError(f"{what}: rank {r} is in two groups of {list(map(list, members))}; "
                                 f"groups must be disjoint")
            seen.add(r)
    if partition and (len({len(g) for g in members}) > 1 or len(seen) != n):
        raise ValueError(f"{what}: groups {list(map(list, members))} must all have one size and cover every "
                         f"rank 0..{n - 1} (every rank returns an array of one shape)")
    return members


def run(fn, x, axis_name, members, n: int):
    """fn(x, view) within every group; each rank keeps its own group's result."""
    by_size: dict[int, list] = {}
    for g in members:
        by_size.setdefault(len(g), []).append(g)
    if len(by_size) == 1 and sum(map(len, members)) == n:
        return fn(x, Subgroups(axis_name, members))
    r, out = lax.axis_index(axis_name), x
    for gs in by_size.values():
        mine = np.zeros(n, bool)
        mine[[m for g in gs for m in g]] = True
        out = jnp.where(jnp.asarray(mine)[r], fn(x, Subgroups(axis_name, tuple(gs))), out)
    return out
