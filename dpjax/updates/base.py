"""What every update rule is made of: the `UpdateRule` record and the helpers the rules share.

A rule is an `UpdateRule` of pure functions, called inside `shard_map` on ONE worker's
values: `step` receives `grad_fn`, which gives the worker's gradient (already averaged
over the worker's own devices and accumulated over its micro-batches by `dpjax.step`),
and the rule's exchanges between workers run over `axes`, the worker axes, with the
rule's allreduce. A worker may be one device or a whole group (`--workers node`: a site
of several devices, synchronous inside).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from dpjax.mesh import axis_arg
from dpjax.data_parallel import allreduce_gradients


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


def mean_over(axes: tuple, allreduce: dict):
    """The mean of a tree over `axes` with the rule's allreduce (the identity over no axes).
    A compressed exchange given `shard_over` (`dpjax.compression.shards.Shards`) runs in
    the per-shard form: each device's shard across `axes`, gathered inside the worker."""
    from dpjax.compression import shards

    sh, allreduce = _shards(allreduce)
    if not axes:
        return lambda tree: tree
    plain = lambda tree: allreduce_gradients(tree, axis_arg(axes), **allreduce)  # noqa: E731
    return shards.plain_mean(plain, sh) if sh is not None and allreduce.get("compression") else plain


def _shards(allreduce: dict):
    """(the per-shard form's `Shards` or None, the allreduce's own arguments)."""
    return allreduce.get("shard_over"), {k: v for k, v in allreduce.items() if k != "shard_over"}


class Exchanger(NamedTuple):
    """A rule's exchange between workers with its state: `mean(tree, state) -> (mean,
    state)`, `init(params) -> state`, `specs(param_specs) -> PartitionSpecs of state`.
    The state is `dpjax.compression.feedback.State` (each worker's error buffer,
    PowerSGD's Q) for a compression with error feedback, else ()."""

    stateful: bool
    init: Callable
    mean: Callable
    specs: Callable


def exchange_over(axes: tuple, allreduce: dict) -> Exchanger:
    """The mean over `axes` with the rule's allreduce, through its compression: a method
    with error feedback (`dpjax.compression.feedback`) keeps state, which the rule
    carries in its own (per worker, so checkpoints hold it); any other is stateless."""
    from dpjax.compression import feedback, shards, stateful

    comp = allreduce.get("compression")
    if not axes or not stateful(comp):
        plain = mean_over(axes, allreduce)
        return Exchanger(False, lambda params: (), lambda tree, state: (plain(tree), state), lambda specs: ())
    sh, allreduce = _shards(allreduce)
    if sh is not None:  # the per-shard form: state per device, on its slot
        return Exchanger(True, lambda params: shards.init(comp, params, sh),
                         lambda tree, state: shards.mean(tree, state, axis_arg(axes), sh, **allreduce),
                         lambda specs: shards.specs(comp, specs, sh))
    return Exchanger(True, lambda params: feedback.init(comp, params),
                     lambda tree, state: feedback.mean(tree, state, axis_arg(axes), **allreduce),
                     lambda specs: feedback.specs(comp, specs))


def exact(allreduce: dict) -> dict:
    """The same exchange without wire compression: for parameters that must stay exact."""
    return {**_shards(allreduce)[1], "compression": None}


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
