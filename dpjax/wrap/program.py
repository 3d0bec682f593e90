"""The program a `shard_step` call runs: `jax.jit(jax.shard_map(body))`, built once for each
`Key` (the arguments' structure and specs, the layout) and reused by the calls that share it.

`body` is the step's inside and its way out (stages 2 and 3 of `dpjax.wrap.wrapper`): each
device merges its blocks back into modules (every `nnx.Rngs` stream drawing per device), calls
the user's `fn` under the model's own sharding constraints, averages what out_specs says is a
"mean", and splits the modules' new state off again: an `nnx.metrics.Average`'s update summed
over the data axes, the stored RNG keys kept replicated, the per-rank slots in their places.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import data_axes
from dpjax.wrap import annotations, arguments, constraints, per_rank
from dpjax.wrap.rng import bound_data_axes, fold_rng_keys

OUT_WORDS = ("mean", "rows")  # out_specs' words beside PartitionSpecs


class Key(NamedTuple):
    """What a program depends on: a call whose Key equals an earlier one's reuses its program."""

    graphdef: Any  # the NNX arguments' graph (None: there are none)
    state_def: Any  # their state's treedef
    tree_defs: tuple  # (treedef, number of leaves) for each pytree argument
    nnx_idx: tuple  # the arguments holding NNX objects
    tree_idx: tuple  # the pytree arguments
    specs: tuple  # each leaf's PartitionSpec, over every mesh axis
    is_rng: tuple  # per NNX leaf: an nnx.RngKey
    summed: tuple  # per NNX leaf: an nnx.metrics.Average's total or count
    slots: tuple  # per leaf: a slot a rank (`dpjax.wrap.per_rank`)
    donate: tuple  # the leaves donated
    nargs: int
    layout: str  # "auto" or "explicit" (`dpjax.wrap.annotations`)

    @classmethod
    def of(cls, a: arguments.Arguments, donate_argnums: tuple, nargs: int, layout: str) -> Key:
        k, meta = a.k, a.meta
        return cls(a.graphdef, a.state_def, a.tree_defs, a.nnx_idx, a.tree_idx, a.specs,
                   tuple(m.kind == "RngKey" for m in meta[:k]), tuple(m.summed for m in meta[:k]),
                   tuple(m.per_rank for m in meta), tuple(j for j, m in enumerate(meta) if m.owner in donate_argnums),
                   nargs, layout)


def build(fn, name: str, axes: dict, out_specs, mesh, key: Key, leaves):
    """`fn` (the step `name`, its mesh axes renamed by `axes`) as one jit(shard_map) program over
    `mesh` for the arguments `key` describes; `leaves`, their arrays, trace it where the outputs'
    per-rank slots must be found first. Returns (fn's outputs, the NNX arguments' new state)."""
    k, nnx = len(key.is_rng), arguments.flax_nnx()
    out_slots = None  # which outputs are per-rank buffers, once known
    manual = set(data_axes(mesh)) if key.layout == "auto" else set(mesh.axis_names)
    # auto: shard_map's in/out specs name the data axes only; the model axes' layout is
    # the arrays' own (placed as annotated), kept on the new state by a constraint
    specs = tuple(annotations.only(s, manual) for s in key.specs)
    auto = annotations.automatic(mesh) - manual  # an Explicit axis's layout is in the arrays' types
    kept = [annotations.only(s, auto) for s in key.specs[:k]]

    def body(*local):
        mine = [per_rank.local(x) if s else x for x, s in zip(local, key.slots)]  # this device's slots
        args, nodes = _merged(key, mine, nnx)
        with constraints.reading(axes, auto):  # the model's own constraints
            out = _averaged(fn(*args), out_specs, data_axes(mesh))
        if out_slots is not None:  # a returned optimizer state: its buffers in their slots
            flat, out_def = jax.tree.flatten(out)
            out = out_def.unflatten([per_rank.slot(x) if s else x for x, s in zip(flat, out_slots)])
        if arguments.has_nnx(out, variables=False):
            raise UserError(f"{name} returns NNX objects; return arrays (the modules passed in are "
                            "updated in place)")
        if not k:
            return out, ()
        new = _new_state(name, key, nnx, nodes, mine, kept)
        return out, tuple(per_rank.slot(x) if s else x for x, s in zip(new, key.slots))

    words = _out_specs(out_specs, mesh, name)
    if words == P() and any(key.slots[k:]):  # a pytree state with buffers in: where are they in the output?
        found = _returned_slots(body, mesh, specs, k, manual, leaves)
        if found:  # the default is replicated, but a returned DistributedState's buffers go by rank
            out_slots, words = found
    smap = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(words, specs[:k]), check_vma=False,
                         axis_names=manual)
    return jax.jit(smap, donate_argnums=key.donate)


def _merged(key: Key, mine: list, nnx) -> tuple[list, Any]:
    """fn's arguments from this device's leaves, and the NNX nodes among them: each device's
    blocks merged back into modules (nnx.Rngs draw per device), each pytree unflattened."""
    k = len(key.is_rng)
    args, nodes = [None] * key.nargs, None
    if k:
        nodes = nnx.merge(key.graphdef, key.state_def.unflatten(fold_rng_keys(mine, key.is_rng)))
        for pos, node in zip(key.nnx_idx, nodes):
            args[pos] = node
    start = k
    for i, (treedef, n) in zip(key.tree_idx, key.tree_defs):
        args[i] = treedef.unflatten(mine[start:start + n])
        start += n
    return args, nodes


def _new_state(name: str, key: Key, nnx, nodes, mine: list, kept: list) -> list:
    """The NNX nodes' state after fn, as leaves: the stored keys stay the replicated ones (the
    streams' counters advanced alike); a metric's update on this device's rows is summed with
    the other devices'; under the auto layout each keeps its model axes' layout (`kept`)."""
    new, new_def = jax.tree.flatten(nnx.split(nodes)[1])
    if new_def != key.state_def:
        raise UserError(f"{name} changed the structure of its NNX arguments (added or removed a "
                        "Variable); dpjax.shard_step keeps in-place updates of existing Variables only")
    axes = bound_data_axes()
    new = [old if rng else (old + lax.psum(x - old, axes) if add and axes else x)
           for x, old, rng, add in zip(new, mine, key.is_rng, key.summed)]
    if key.layout == "auto":
        new = [lax.with_sharding_constraint(x, s) if len(s) else x for x, s in zip(new, kept)]
    return new


def _returned_slots(body, mesh, specs, k: int, manual: set, leaves):
    """Under the default out_specs, where fn's outputs hold a DistributedState's per-rank buffers:
    (a mask over the outputs' leaves, out_specs giving those a slot a rank), or None for none."""
    shapes = jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:k]),
                                          check_vma=False, axis_names=manual), *leaves)[0]
    paths, out_def = jax.tree_util.tree_flatten_with_path(shapes)
    found = per_rank.tree_prefixes(shapes)
    mask = [per_rank.under(per_rank.keys_of(p), found) for p, _ in paths]
    if not any(mask):
        return None
    return mask, out_def.unflatten([per_rank.spec(P(), mesh) if s else P() for s in mask])


def _is_out_leaf(x) -> bool:
    return isinstance(x, (P, str))


def _out_specs(out_specs, mesh, step: str):
    """out_specs with its words as PartitionSpecs: "mean" replicated (after `_averaged`),
    "rows" split over the data axes."""
    def spec(x):
        if isinstance(x, str) and x not in OUT_WORDS:
            raise UserError(f"{step}: out_specs {x!r} is not one of {', '.join(map(repr, OUT_WORDS))} or a "
                            "PartitionSpec")
        return P(data_axes(mesh)) if x == "rows" else P() if x == "mean" else x
    return jax.tree.map(spec, out_specs, is_leaf=_is_out_leaf)


def _averaged(out, out_specs, axes):
    """fn's outputs with those under an out_specs "mean" averaged over the data `axes`."""
    if not any(x == "mean" for x in jax.tree.leaves(out_specs, is_leaf=_is_out_leaf)) or not axes:
        return out
    mean = lambda sub: jax.tree.map(lambda x: lax.pmean(x, axes), sub)  # noqa: E731
    return jax.tree.map(lambda s, sub: mean(sub) if s == "mean" else sub, out_specs, out, is_leaf=_is_out_leaf)
