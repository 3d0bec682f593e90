"""The collective algorithms by name: one registration per algorithm, read by everyone.

An algorithm is one module that ends with one `register(Algorithm(...))`: the
primitives it implements (`allreduce`, `reduce_scatter`, `all_gather`, `broadcast`,
`all_to_all`; None where it has no such schedule) and its cost formula. The public
calls (`dpjax.collectives.allreduce(..., algorithm=)`), their checks and error
messages, the cost model (`cost.schedule`), the CLI's choices, the tests'
parametrisation and the benchmarks' variants all read the names from here, so adding
an algorithm touches no other file. `ALGORITHMS` and friends in `dpjax.collectives`
are live views (`names(primitive)`): an algorithm registered later shows in them.

The primitive functions take the local block inside `shard_map` and the axis
(`x, axis_name, *, op=` for the reductions, `root=` for broadcast), and are called by
the public calls after those have checked the arguments and put a tuple of axes in the
mesh's order (unless `nested_axes`: "hierarchical" reads (outer, inner) as two levels);
over process sets (`groups=`) they run unchanged on a `ranks.Subgroups` view of the
axis, unless the algorithm says `groups=False` (XLA's own collectives cannot address a
subset).

cost(primitive, n, nelems, itemsize, **options) -> `cost.Schedule`: the steps and bytes
the busiest device sends (see `cost.schedule` for what n and nelems mean per
primitive; options are the algorithm's own, such as `num_servers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from dpjax.registry import Registry

PRIMITIVES = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm: its name, the primitives it implements, its cost formula."""

    name: str
    cost: Callable
    allreduce: Callable | None = None
    reduce_scatter: Callable | None = None
    all_gather: Callable | None = None
    broadcast: Callable | None = None
    all_to_all: Callable | None = None
    groups: bool = True  # runs within process sets (on a Subgroups view of the axis)
    nested_axes: bool = False  # axis_name is (outer, inner) levels, not a tuple read as one flat axis

    def implements(self, primitive: str) -> bool:
        return getattr(self, primitive) is not None


def _has_cost(algorithm: Algorithm) -> None:
    if not callable(algorithm.cost):
        raise TypeError(f"collective algorithm {algorithm.name!r} needs a cost formula")


_ALGORITHMS: Registry[Algorithm] = Registry("collective algorithm", validate=_has_cost)
register, unregister, registered = _ALGORITHMS.register, _ALGORITHMS.unregister, _ALGORITHMS.registered


def get(name: str) -> Algorithm:
    """The algorithm `name`; KeyError if there is none."""
    return _ALGORITHMS[name]


def nested(name) -> bool:
    """Whether the algorithm `name` reads its axis as (outer, inner) levels (`nested_axes`):
    it needs two axes. False for a name that is not registered ("auto", None)."""
    alg = _ALGORITHMS.get(name) if isinstance(name, str) else None
    return alg is not None and alg.nested_axes


def names(primitive: str | None = None) -> tuple[str, ...]:
    """Every registered name, in registration order; with `primitive`, those implementing it."""
    if primitive is not None and primitive not in PRIMITIVES:
        raise ValueError(f"unknown collective primitive {primitive!r}; choose one of {', '.join(PRIMITIVES)}")
    return tuple(n for n, a in _ALGORITHMS.items() if primitive is None or a.implements(primitive))


class Names(Sequence):
    """The names implementing `primitive`, read from the registry at every use: a tuple
    that follows later registrations (`"ring" in ALGORITHMS`, `", ".join(ALGORITHMS)`,
    argparse's `choices=`)."""

    def __init__(self, primitive: str):
        names(primitive)  # a typo fails here, not at the first read
        self.primitive = primitive

    def __getitem__(self, i):
        return names(self.primitive)[i]

    def __len__(self) -> int:
        return len(names(self.primitive))

    def __contains__(self, name) -> bool:
        return name in names(self.primitive)

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # its value changes with the registry

    def __repr__(self) -> str:
        return repr(names(self.primitive))
