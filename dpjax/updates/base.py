"""What every update rule is made of: the `UpdateRule` record and the helpers the rules share.

A rule is an `UpdateRule` of pure functions, called inside `shard_map` on ONE worker's
values: `step` receives `grad_fn`, which gives the worker's gradient (already averaged
over the worker's own devices and accumulated over its micro-batches by `dpjax.step`),
and the rule's exchanges between workers run over `axes`, the worker axes, through the
run's `Exchange` (`dpjax.compression.Exchange`: the plan builds it; research code may
give the allreduce's keywords instead, `Exchange.of`). A worker may be one device or a
whole group (`--workers node`: a site of several devices, synchronous inside).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from jax.sharding import PartitionSpec as P



class UpdateRule(NamedTuple):
    """One worker's side of an update rule, called inside `shard_map` on local values.

    init(params) -> state;
    step(grad_fn, params, state, batch) -> (params, state, loss), where
        grad_fn(params, batch) -> (loss, the worker's gradient);
    flush(params, state) -> (params, state): what is still in flight lands;
    specs(param_specs, state_shapes) -> a PartitionSpec per state leaf (no worker axis);
    consensus(params) -> the parameters the workers agree on (evaluation, export): their
        exact mean where they diverge (delayed, sparse), else their common copy;
    axes: the worker axes the rule exchanges over (() for a single worker);
    per_worker: whether workers' parameters or state differ (then every worker's copy is
        kept, on a leading worker axis).
    """

    name: str
    init: Callable
    step: Callable
    flush: Callable
    specs: Callable
    consensus: Callable
    axes: tuple
    per_worker: bool


def stacked(param_specs):
    """Specs of a buffer of parameter copies stacked on a new leading axis."""
    return jax.tree.map(lambda s: P(None, *s), param_specs)


def local_like(tree, like, what: str = "gradients"):
    """`tree`, asserted to hold this device's blocks in the shapes of `like`'s (a rule's
    step runs inside the step's shard_map: its gradients are local blocks shaped as the
    local parameters, whatever the layout)."""
    got, want = jax.tree.map(lambda x: tuple(x.shape), tree), jax.tree.map(lambda x: tuple(x.shape), like)
    assert got == want, f"{what}: local shapes {got}, not the parameters' {want}"
    return tree


def identity(params, state):
    return params, state
