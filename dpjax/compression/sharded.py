"""FSDP's reduce-scatter through a linear compression with error feedback (random-k).

Under FSDP (ZeRO-3, `dpjax.compute.tensor_parallel.gather_param`) a device all-gathers each
parameter just before use and reduce-scatters its gradient, exact, in the backward pass.
Error feedback (Seide et al. 2014; Karimireddy et al., ICML 2019) adds an error buffer to
what is compressed, and what is compressed here is each device's *local, full-size*
gradient before the reduction: so the buffer is full-size too, per device -- n times a
parameter shard over n data ranks, the memory FSDP saves on the parameters spent again
(`dpjax.plan.memory.estimate` counts it). The step therefore reduces nothing in the backward
pass: it differentiates with respect to zero "probes" shaped like the gathered
parameters (`local_value_and_grad`; the gather's backward hands each probe the full
cotangent), accumulates its micro-batches, and then, once per step:

    e = g + err                       (this device's full local gradient, corrected)
    a tensor split over the data axes on dimension d: e cut into its n destination shards,
        `Method.reduce_scatter` sums what every rank keeps of shard r onto rank r
    a tensor too small to split (replicated): the method's own allreduce exchange
    err <- e - what this device sent

so nothing is lost, only delayed: sum(applied) + mean(err) == sum(true means), as with
`feedback`'s exchange. `start=S`: the first S exchanges are FSDP's exact reduce-scatter (a
`lax.cond`). Only a method with `Method.reduce_scatter` can (a linear one: random-k,
whose shared seed lines the values up); `dpjax.plan` refuses the others with their
`Method.nonlinear`. The rule between workers (sync, no worker axes) is wrapped
(`wrap`): its state gains this exchange's `feedback.State`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax.collectives import allreduce, cost, reduce_scatter
from dpjax.collectives.ranks import axis_size
from dpjax.compression.feedback import State
from dpjax.compression.grammar import parse
from dpjax.mesh import as_axes, axis_arg, is_spec


def dp(layout) -> int:
    return math.prod(layout.mesh.shape[a] for a in layout.inner_axes)


def full_shape(shape, d: int, n: int) -> tuple:
    """A parameter shard's gathered shape (dimension d times n; d < 0: replicated)."""
    return tuple(s * n if i == d else s for i, s in enumerate(shape))


def local_value_and_grad(loss_fn, par, n: int):
    """(params, batch) -> (loss, this device's gradient with respect to the gathered
    parameters, unreduced): the probes of `tensor_parallel.Parallel` receive it."""
    def value_and_grad(params, batch):
        probes = full_zeros(params, par.gather_dims, n)
        return jax.value_and_grad(lambda pr: loss_fn(params, batch, dataclasses.replace(par, probes=pr)))(probes)

    return value_and_grad


def full_zeros(params, dims, n: int):
    return jax.tree.map(lambda x, d: jnp.zeros(full_shape(x.shape, d, n), x.dtype), params, dims)


def init(compression, params, dims, n: int) -> State:
    """A fresh state for this device's shards `params`: its error buffer (1 x the full
    local gradient, per leaf: the leading axis is this device's place on the data axes)."""
    spec = parse(compression)
    error = jax.tree.map(lambda x, d: jnp.zeros((1, *full_shape(x.shape, d, n)), x.dtype), params, dims) \
        if spec.ef else ()
    return State(jnp.zeros((), jnp.int32), error, ())


def specs(compression, param_specs, axes) -> State:
    """The state's PartitionSpecs: an error buffer per device, its leading axis over the
    data `axes`, the rest laid out as the parameter but whole over the data axes."""
    def one(spec):
        keep = [tuple(a for a in as_axes(e) if a not in axes) for e in spec]
        return P(axis_arg(axes), *[axis_arg(e) if e else None for e in keep])

    error = jax.tree.map(one, param_specs, is_leaf=is_spec) if parse(compression).ef else ()
    return State(P(), error, ())


def exact(g, dims, axis, algorithm: str):
    """FSDP's exact reduction of full local gradients `g`: the mean reduce-scattered onto
    each device's shard (a replicated tensor: allreduced), as `gather_param`'s backward."""
    def one(x, d):
        if d < 0:
            return allreduce(x, axis, algorithm=algorithm, op="mean")
        return jnp.moveaxis(reduce_scatter(jnp.moveaxis(x, d, 0), axis, algorithm=algorithm, op="mean"), 0, d)

    return jax.tree.map(one, g, dims)


def compressed(g, state: State, dims, axis, spec, algorithm: str, fusion_mb: float):
    """(the mean of the devices' full local gradients `g`, on this device's shards, through
    the method of `spec`; the new error buffer): one compressed reduce-scatter, error fed
    back. `exchange.Exchange.reduce_scatter_mean` runs it, counting the exchanges and
    choosing the exact start steps (`exact`)."""
    n = axis_size(axis, "FSDP's compressed reduce-scatter")
    leaves, tree = jax.tree.flatten(g)
    ds = tree.flatten_up_to(dims)
    if spec.ef:  # each device's buffer mirrors its full local gradient, leaf by leaf
        got = [tuple(err.shape) for err in jax.tree.leaves(state.error)]
        assert got == [(1, *x.shape) for x in leaves], (got, [x.shape for x in leaves])
    assert all(d < 0 or x.shape[d] % n == 0 for x, d in zip(leaves, ds)), ([x.shape for x in leaves], ds, n)
    es = leaves if not spec.ef else [x + err[0] for x, err in zip(leaves, jax.tree.leaves(state.error))]
    key = jax.random.fold_in(jax.random.key(1), state.t)  # shared by every rank; not the allreduce's key(0)
    out, resid = [None] * len(es), [None] * len(es)
    small = [i for i, d in enumerate(ds) if d < 0]
    for i, (e, d) in enumerate(zip(es, ds)):
        if d < 0:
            continue
        e0 = jnp.moveaxis(e, d, 0)
        rows = e0.reshape(n, -1)
        m, r = spec.method.reduce_scatter(rows, axis, spec, jax.random.fold_in(key, i), algorithm)
        out[i] = jnp.moveaxis(m.reshape((e0.shape[0] // n, *e0.shape[1:])), 0, d)
        resid[i] = jnp.moveaxis(r.reshape(e0.shape), 0, d)
    if small:  # the replicated tensors: the method's own allreduce exchange, fused
        m, r, _ = spec.method.exchange([es[i] for i in small], (), axis, spec, state.t,
                                       {"algorithm": algorithm, "fusion_mb": fusion_mb})
        for i, mi, ri in zip(small, m, r):
            out[i], resid[i] = mi, ri
    error = tree.unflatten([x[None] for x in resid]) if spec.ef else ()
    return tree.unflatten(out), error


def wire_bytes(shapes, dims, n: int, compression, *, algorithm: str = "ring", fusion_mb: float = 64) -> int:
    """What the busiest device sends for one exchange of tensors of the gathered `shapes`
    (dims: the dimension split over the n data ranks, -1: replicated), compressed
    (compression None: FSDP's exact reduce-scatters). The compiled program sends this."""
    spec = parse(compression)
    total, small = 0, []
    for s, d in zip(shapes, dims):
        if d < 0:
            small.append(s)
        elif spec is None:
            total += cost.schedule(algorithm, n, math.prod(s), 4, primitive="reduce_scatter").total_bytes
        else:
            total += spec.method.reduce_scatter_bytes(math.prod(s) // n, n, spec, algorithm)
    if spec is None:
        return total + sum(cost.schedule(algorithm, n, math.prod(s), 4).total_bytes for s in small)
    return total + (spec.method.wire_bytes(small, n, spec, {"algorithm": algorithm, "fusion_mb": fusion_mb})
                    if small else 0)


def local_shapes(layout, abstract) -> tuple[list, list]:
    """([each leaf's full local shape: split over the model axis, whole over the data
    axes], [the dimension the data axes split, -1: none]) for parameters like `abstract`."""
    n = dp(layout)
    dims = jax.tree.leaves(layout.gather_dims)
    shapes = [full_shape(sh.shard_shape(x.shape), d, n)
              for x, sh, d in zip(jax.tree.leaves(abstract), jax.tree.leaves(layout.shardings()), dims)]
    return shapes, dims


def error_bytes(layout, abstract) -> int:
    """Bytes of one device's error buffer (its full local gradient, every leaf) for
    parameters shaped like `abstract` laid out by `layout`."""
    shapes, _ = local_shapes(layout, abstract)
    return sum(math.prod(s) * x.dtype.itemsize for s, x in zip(shapes, jax.tree.leaves(abstract)))


class SharedState(NamedTuple):
    rule: Any  # the wrapped rule's own state
    exchange: State  # FSDP's compressed reduce-scatter: each device's error buffer, t


def wrap(rule, layout, exchange):
    """`rule` (sync, no worker axes) with its gradient reduced here: its grad_fn gives the
    full local gradient (`local_value_and_grad`), which the exchange's
    `reduce_scatter_mean` reduce-scatters through the compression before the rule sees it."""
    dims, axes, n = layout.gather_dims, layout.inner_axes, dp(layout)

    def init_both(params):
        return SharedState(rule.init(params), init(exchange.compression, params, dims, n))

    def step(grad_fn, params, state, batch):
        out = []

        def reduced(p, b):
            loss, g = grad_fn(p, b)
            g, ex = exchange.reduce_scatter_mean(g, dims, axes, state.exchange)
            out.append(ex)
            return loss, g

        params, inner, loss = rule.step(reduced, params, state.rule, batch)
        assert len(out) == 1, "the rule asked for its gradient more than once a step"
        return params, SharedState(inner, out[0]), loss

    def flush(params, state):
        params, inner = rule.flush(params, state.rule)
        return params, SharedState(inner, state.exchange)

    def state_specs(ps, shapes):
        return SharedState(rule.specs(ps, shapes.rule), specs(exchange.compression, ps, axes))

    return rule._replace(init=init_both, step=step, flush=flush, specs=state_specs)  # a dpjax.updates.UpdateRule
