"""The exchange of a compressed gradient with error feedback, and its state.

Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al., ICML 2019, "Error
Feedback Fixes SignSGD and other Gradient Compression Schemes"): each rank adds what its
last compressed exchange dropped to its next input,

    e_i = g_i + err_i;    mean, resid_i = method.exchange(e)  (the mean of what ranks sent);
    err_i <- resid_i      (e_i minus what rank i contributed)

so nothing is lost, only delayed: after any number of exchanges,
sum(applied means) + mean_i(err_i) == sum(true means of g). With `ef=0` err stays empty.
Before `start` exchanges the uncompressed allreduce runs instead, bit for bit (a
`lax.cond`, so only one of the two is sent): `dpjax.compression.exchange.Exchange`
chooses, this module holds the state and the compressed step.

`State` is per rank (error buffers differ): `dpjax.updates` keeps it in the rule's state,
which carries the worker axis, and `DistributedOptimizer` in its own state; `specs` lays
it out like the parameters it mirrors, so checkpoints save and restore it bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax.collectives import calls, cost
from dpjax.compression.grammar import parse
from dpjax.fusion import classes_of, pack, plan_buckets, unpack


class State(NamedTuple):
    t: jax.Array  # exchanges made so far (the start step and random-k's seed read it)
    error: Any  # this rank's error buffer, shaped like the parameters (() with ef=0)
    method: Any  # the method's own state (PowerSGD's Q), () if none


def init(compression, params) -> State:
    """The state of a fresh exchange of tensors shaped like `params` (zero error)."""
    spec = parse(compression)
    error = jax.tree.map(jnp.zeros_like, params) if spec.ef else ()
    own = spec.method.init(params, spec) if spec.method.init else ()
    return State(jnp.zeros((), jnp.int32), error, own)


def specs(compression, param_specs) -> State:
    """PartitionSpecs of `State` for parameters laid out by `param_specs`: the error as
    the parameter, the method's state as it says (`Method.state_specs`)."""
    spec = parse(compression)
    own = spec.method.state_specs(param_specs, spec) if spec.method.state_specs else ()
    return State(P(), param_specs if spec.ef else (), own)


def compressed(tree, state: State, axis_name, spec, allreduce: dict):
    """(the mean of `tree` over `axis_name` through the method of `spec`, the new error
    buffer, the method's new state): one compressed exchange, error fed back. allreduce:
    the exchange's `algorithm`, `fusion_mb` and options, for the methods that run an
    allreduce (PowerSGD's factors, random-k's values). `exchange.Exchange.mean` runs it,
    counting the exchanges and choosing the exact start steps."""
    e = jax.tree.map(jnp.add, tree, state.error) if spec.ef else tree
    out, resid, own = spec.method.exchange(e, state.method, axis_name, spec, state.t, allreduce)
    return out, (resid if spec.ef else ()), own


def floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def per_bucket(reduce_flat):
    """A method's `exchange` from `reduce_flat(x_d, axis_name, spec, key, segments,
    allreduce) -> (mean_d, resid_d)` on one flat fusion bucket of floats (segments: the
    sizes of the bucket's tensors): the tree is packed into buckets as the uncompressed
    allreduce packs it; integer buckets travel exactly."""
    def exchange(tree, own, axis_name, spec, t, allreduce):
        plan = plan_buckets(tree, allreduce.get("fusion_mb", 64) * 2**20, classes_of(tree))  # never mixing shards
        key = jax.random.fold_in(jax.random.key(0), t)  # the same on every rank: random-k's shared seed
        means, resids = [], []
        for i, (bucket, buf) in enumerate(zip(plan.buckets, pack(plan, tree))):
            if floating(buf.dtype):
                m, r = reduce_flat(buf, axis_name, spec, jax.random.fold_in(key, i), bucket.sizes, allreduce)
            else:
                m = calls.allreduce(buf, axis_name, op="mean", algorithm=allreduce.get("algorithm", "ring"))
                r = jnp.zeros_like(buf)
            means.append(m)
            resids.append(r)
        return unpack(plan, means), unpack(plan, resids), own

    return exchange


def per_bucket_bytes(flat_bytes):
    """A method's `wire_bytes` from `flat_bytes(d, n, spec, segments, allreduce)`, the
    bytes the busiest rank sends for one float bucket of d values (integer buckets
    travel as the allreduce sends them)."""
    def wire_bytes(shapes, n, spec, allreduce):
        tree = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
        plan = plan_buckets(tree, allreduce.get("fusion_mb", 64) * 2**20)
        return sum(flat_bytes(sum(b.sizes), n, spec, b.sizes, allreduce) for b in plan.buckets)

    return wire_bytes


def allreduce_bytes(d: int, n: int, allreduce, itemsize: int = 4) -> int:
    """What the busiest rank sends in the exchange's allreduce of d values."""
    opts = {k: v for k, v in allreduce.items() if k not in ("algorithm", "fusion_mb", "compression")}
    return cost.schedule(allreduce.get("algorithm", "ring"), n, d, itemsize, **opts).total_bytes
