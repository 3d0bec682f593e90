"""Explicit collective algorithms, dispatched by name. Call these inside `jax.shard_map`.

Each algorithm is one module that registers itself (`registry.py`: its primitives and
its cost formula); the calls below dispatch through the registry, and `ALGORITHMS`,
`REDUCE_SCATTER_ALGORITHMS`, ... are live views of it. Every algorithm except the XLA
baselines (`"psum"`, and `"xla"` for all-to-all, `xla.py`) is
written as point-to-point `lax.ppermute` steps plus local arithmetic, so the schedule
a gradient follows across the machines is there to read. Each matches `lax.psum` /
`lax.psum_scatter` / `lax.all_gather` / `lax.all_to_all` (tiled, dimension 0) for any
shape, dtype and axis size >= 1. `axis_name` may be a tuple of axes, which the flat
algorithms treat as one flattened axis; `"hierarchical"` takes `(outer, inner)`, or one
axis name as its one-level case (the inner ring alone).

Beyond lax (Horovod's collective API): `op` in sum, mean, min, max, product and adasum
(`ops.py`, `adasum.py`), `prescale_factor` / `postscale_factor`, process sets
(`groups=`, `groups.py`), uneven pieces (`sizes=`, `uneven.py`), grouped calls
(`grouped_*`, `grouped.py`) and all-to-all (`alltoall.py`).

Autodiff follows JAX's convention: the transpose of an all-gather or a broadcast sums
the cotangents over ranks, and that of a reduce-scatter all-gathers them. Horovod
averages instead for all-gather and broadcast, and scales by the size for a sum
reduce-scatter; `dpjax.horovod` follows Horovod's, these follow JAX's.

Across processes, every call first checks that all processes are about to make the
same call (`dpjax.distributed.agree`: shape, dtype, op, root, algorithm, groups,
sizes), so ranks that disagree get one clear error instead of garbage or a hang.

Simulated CPU devices need two guards on XLA:CPU's collectives (`cpu_runtime.py`); importing
this package applies neither: `dpjax.simulate_cpu_devices` and `dpjax.cpu_guards` do.
"""

from __future__ import annotations

from dpjax.collectives import registry  # noqa: F401  (first: the algorithms register into it)

# Each algorithm registers itself when imported; this order is the order of the views.
from dpjax.collectives import xla, ring, butterfly, tree, ps, hierarchical, alltoall, adasum  # noqa: E401
from dpjax.collectives.calls import (ALGORITHMS, ALL_GATHER_ALGORITHMS, ALL_TO_ALL_ALGORITHMS, BROADCAST_ALGORITHMS,
                                     REDUCE_SCATTER_ALGORITHMS, all_gather, all_to_all, allreduce, broadcast,
                                     check_algorithm, reduce_scatter)
from dpjax.collectives.grouped import all_gather as grouped_all_gather
from dpjax.collectives.grouped import allreduce as grouped_allreduce
from dpjax.collectives.grouped import reduce_scatter as grouped_reduce_scatter
from dpjax.collectives.ops import REDUCE_OPS

REGISTERED_BY = (xla, ring, butterfly, tree, ps, hierarchical, alltoall, adasum)

__all__ = [
    "ALGORITHMS", "ALL_GATHER_ALGORITHMS", "ALL_TO_ALL_ALGORITHMS", "BROADCAST_ALGORITHMS",
    "REDUCE_OPS", "REDUCE_SCATTER_ALGORITHMS",
    "all_gather", "all_to_all", "allreduce", "broadcast", "check_algorithm",
    "grouped_all_gather", "grouped_allreduce", "grouped_reduce_scatter", "reduce_scatter",
]
