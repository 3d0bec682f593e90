"""A model's own sharding constraints, read inside `shard_step` as it reads the model's
annotations.

Code written for `jax.jit` constrains its activations over every mesh axis:
`jax.lax.with_sharding_constraint(y, P('data', 'model'))` (flax's GSPMD guide), or
`nn.with_logical_constraint(y, ('batch', 'mlp'))` under logical axis rules. Inside
`shard_step` the data axes are dpjax's, manual (each device already holds its own rows),
and JAX accepts a constraint over automatic axes only. So, while `shard_step` traces a
step, and only inside that trace, a constraint is read as what it means there: the user's
axis names mapped to dpjax's, the step's manual axes dropped from it (the rows are already
split), what it says about the automatic (model) axes kept. Where every axis is manual
(the "explicit" layout) nothing is left to constrain and the array passes unchanged.

How: `jax.lax.with_sharding_constraint` is looked up by attribute at each call (by flax's
Linen and NNX too), so `reading` puts this module's `constraint` in its place for the
duration of the trace and puts JAX's own back after it. Outside a `shard_step` trace (any
other thread, any other code running meanwhile) `constraint` calls JAX's own unchanged.
Code that bound JAX's function to a name of its own before the trace
(`from jax.lax import with_sharding_constraint`) keeps it, and a constraint naming a data
axis there stops with the one line `annotations.explain` writes.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.wrap.annotations import only, renamed
from dpjax.wrap.patch import Patch


def constraint(x, shardings):
    """`jax.lax.with_sharding_constraint` as `shard_step` reads it (see the module's doc)."""
    reading = _PATCH.active.get()
    if reading is None:
        return _PATCH.original(x, shardings)
    names, auto = reading
    if not auto:
        return x

    def local(s):
        spec = s.spec if isinstance(s, NamedSharding) else s
        if not isinstance(spec, P) or spec.unreduced or spec.reduced:
            return s  # a sharding of another kind: JAX says what it makes of it
        read = only(renamed(spec, names), auto)
        return s if read == spec else read  # unchanged: as given (a NamedSharding's memory kind kept)

    return _PATCH.original(x, jax.tree.map(local, shardings, is_leaf=lambda s: isinstance(s, (P, NamedSharding))))


_PATCH = Patch(jax.lax, "with_sharding_constraint", constraint)


def reading(names: dict, auto: set):
    """While the block runs (a step's trace), constraints are read with the user's axis
    names mapped by `names` and only the automatic axes `auto` kept."""
    return _PATCH.on((names, frozenset(auto)))
