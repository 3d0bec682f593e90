"""Alpha-beta cost model of each algorithm, and the same figures read from compiled HLO.

Hockney's model: a step that sends m bytes over a link costs alpha + m / bandwidth.
An algorithm's time is `steps * alpha + bytes_sent / bandwidth`, where bytes_sent is
what the busiest device sends (each algorithm module's docstring derives it). For
"hierarchical" the inner and outer phases run on their own links.

`schedule(...)` gives the (steps, bytes) of an algorithm from its formula, exactly
(padding included; each algorithm registers its own formula beside its code,
`registry.py`); `hlo_comm(compiled_text)` counts the same from a compiled
program, so the two can be checked against each other and against the
Patarasuk-Yuan lower bound `2(n-1)/n * N` for allreduce.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dpjax import hlo
from dpjax.collectives import registry


@dataclass(frozen=True)
class Link:
    """A network link: latency in seconds per message, bandwidth in bytes per second."""

    latency: float
    bandwidth: float

    @classmethod
    def from_ms_mbps(cls, ms: float, mbps: float) -> "Link":
        return cls(latency=ms / 1e3, bandwidth=mbps * 1e6 / 8)


@dataclass(frozen=True)
class Schedule:
    """Steps and bytes sent by the busiest device; `outer_*` is the hierarchical slow level."""

    steps: int
    bytes: int
    outer_steps: int = 0
    outer_bytes: int = 0

    @property
    def total_steps(self) -> int:
        return self.steps + self.outer_steps

    @property
    def total_bytes(self) -> int:
        return self.bytes + self.outer_bytes

    def time(self, link: Link, outer_link: Link | None = None) -> float:
        """Seconds under the alpha-beta model (outer phases on `outer_link`, default `link`)."""
        out = outer_link or link
        return (self.steps * link.latency + self.bytes / link.bandwidth
                + self.outer_steps * out.latency + self.outer_bytes / out.bandwidth)


def ceil_log2(n: int) -> int:
    """ceil(log2 n), 0 for n <= 1: the rounds of a binomial tree or a butterfly."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def no_model(primitive: str, algorithm: str) -> ValueError:
    """The error of a cost formula asked for a primitive its algorithm does not have."""
    return ValueError(f"no cost model for {primitive} with algorithm {algorithm!r}")


def schedule(algorithm: str, n: int, nelems: int, itemsize: int = 4, *,
             primitive: str = "allreduce", **options) -> Schedule:
    """(steps, bytes the busiest device sends) for one collective: the registered
    algorithm's own formula (`registry.Algorithm.cost`, derived in its module's docstring).

    n: ranks along the axis (for "hierarchical", the inner size L; `groups=` is G).
    nelems: elements of the full vector (for all_gather, of the gathered result; for
    all_to_all, of one rank's whole input).
    primitive: "allreduce", "reduce_scatter", "all_gather", "broadcast" or "all_to_all".
    options: the algorithm's own (`num_servers` for "ps", `groups` for "hierarchical";
    algorithm "adasum", the Adasum allreduce, takes `tensors`, the fused tensors).
    """
    if n < 1 or nelems < 0:
        raise ValueError(f"need n >= 1 and nelems >= 0, got n={n}, nelems={nelems}")
    try:
        formula = registry.get(algorithm).cost
    except KeyError:
        raise no_model(primitive, algorithm) from None
    return formula(primitive, n, nelems, itemsize, **options)


def schedule_sets(algorithm: str, sets, nelems: int, itemsize: int = 4, **kw) -> Schedule:
    """A collective within process sets (groups.py): one pass per distinct set size, so
    the steps add up over the sizes; a device sends what its own set's pass sends."""
    passes = [schedule(algorithm, k, nelems, itemsize, **kw) for k in sorted({len(s) for s in sets})]
    return Schedule(sum(p.steps for p in passes), max(p.bytes for p in passes))


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (busbw = algbw x this): the share of N bytes the
    busiest link must carry, 2(n-1)/n for an allreduce, (n-1)/n for a reduce-scatter,
    an all-gather or an all-to-all, 1 for a broadcast. For the allreduce it is also the
    Patarasuk-Yuan lower bound on the bytes some device sends, over N."""
    if collective == "allreduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"no bus factor for collective {collective!r}")


def lower_bound_bytes(n: int, nbytes: int) -> float:
    """Patarasuk & Yuan: any allreduce sends at least 2(n-1)/n * N bytes from some device."""
    return bus_factor("allreduce", n) * nbytes


# ---------------------------------------------------------------------------------------
# Reading the compiled program

_COLLECTIVES = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS_RE = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


@dataclass
class HloComm:
    """What a compiled program sends: collective ops in program order and bytes per device;
    `unknown_trips`: collectives inside loops of unknown trip count (counted once)."""

    ops: Counter = field(default_factory=Counter)
    steps: int = 0
    bytes_per_device: Counter = field(default_factory=Counter)
    unknown_trips: int = 0

    @property
    def max_bytes(self) -> int:
        return max(self.bytes_per_device.values(), default=0)


_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _replica_groups(attrs: str) -> list[list[int]]:
    """Device groups of a collective: `{{0,1},{2,3}}`, or the newer mesh form
    `mesh['a'=4,'b'=2] {'a'}` (groups vary the listed axes; devices numbered row-major)."""
    groups = _GROUPS_RE.search(attrs)
    if groups and groups.group(1):
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", groups.group(1))]
    mesh = _MESH_GROUPS_RE.search(attrs)
    if not mesh:
        return []
    axes = [(name.strip("' "), int(size)) for name, size in
            (a.split("=") for a in mesh.group(1).split(",") if "=" in a)]
    reduced = {a.strip("' ") for a in mesh.group(2).split(",") if a.strip()}
    ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
    keep = [i for i, (name, _) in enumerate(axes) if name not in reduced]
    moved = np.moveaxis(ids, keep, list(range(len(keep))))
    return moved.reshape(math.prod(ids.shape[i] for i in keep) if keep else 1, -1).tolist()


def _sent(op: str, start: bool, ins) -> dict[int, int]:
    """Bytes each device sends in one run of collective `ins`."""
    # Compiled HLO names operands without their shapes; the result (the first array of
    # an async -start tuple) has the operand's shape for permutes and all-reduces, the
    # gathered shape for all-gather, the piece for reduce-scatter. XLA's combiner gives
    # one all-reduce a tuple of results, and an all-to-all has one result per block:
    # charge them all.
    first = hlo.SHAPE_RE.search(ins.shape)
    if op in ("all-reduce", "all-to-all") and not start:
        nbytes = hlo.shape_bytes(ins.shape)
    else:
        nbytes = hlo.shape_bytes(first.group(0)) if first else 0
    out: Counter = Counter()
    if op == "collective-permute":
        pairs = _PAIRS_RE.search(ins.attrs)
        for pair in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) if pairs else ""):
            out[int(pair[0])] += nbytes
        return out
    for group in _replica_groups(ins.attrs):
        k = len(group)
        if k < 2:
            continue
        if op == "all-reduce":
            sent = 2 * (k - 1) * math.ceil(nbytes / k)
        elif op == "reduce-scatter":
            sent = (k - 1) * nbytes
        else:  # all-gather, all-to-all
            sent = (k - 1) * nbytes // k
        for d in group:
            out[d] += sent
    return out


def hlo_comm(program, follow=None) -> HloComm:
    """Counts collective steps and bytes each device sends in compiled HLO text (or an
    `hlo.Module` of it).

    A collective-permute charges its operand's bytes to each source device of its
    `source_target_pairs`. XLA's own all-reduce / reduce-scatter / all-gather ops are
    charged as the ring would send them within each replica group (their real
    schedule is XLA's choice). A collective runs as many times as its computation does
    (`hlo.Module.times`): a while loop's body its trip count, every branch of a
    conditional unless `follow` names the branches taken.
    """
    module = program if isinstance(program, hlo.Module) else hlo.Module(program)
    out = HloComm()
    for name, runs in module.times(follow).items():
        if runs == 0:
            continue
        for ins in module.computations[name].instructions:
            start = ins.op.endswith("-start")
            op = ins.op[:-len("-start")] if start else ins.op
            if op not in _COLLECTIVES:
                continue
            n = 1 if runs is None else runs
            out.unknown_trips += runs is None
            out.ops[op] += n
            out.steps += n
            for d, sent in _sent(op, start, ins).items():
                out.bytes_per_device[d] += n * sent
    return out
