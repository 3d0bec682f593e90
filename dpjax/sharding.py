"""Where every parameter lives on the mesh: the layout of a model's state.

A model declares one table, `leaf name -> PartitionSpec` over the `model` axis
(`models/gpt.py`'s SPECS); everything else is derived here:

- `Layout` resolves the table against a mesh, checks that each split dimension
  divides, and under `fsdp` (ZeRO-3) also splits each parameter over the data axes
  inside a worker (all of them unless `workers` names some; over `node` x `data` with
  `workers=("node",)` that is hybrid sharding: split inside a node, replicated across),
  on its largest dimension that is free and divides;
- `state_specs` gives the optimizer state the specs of the parameters it mirrors
  (Adam's moments, accumulated gradients; found by `optax.tree_map_params`) and
  replicates the rest (step counters);
- `sq_norm` is the global squared norm of a sharded tree, for gradient clipping:
  each leaf's local sum of squares is summed over exactly the axes that split it;
- with a `stage` axis the layer stack (`model.LAYERS`, `Ls` in the table) is split over
  it, so each stage holds its layers and their optimizer state only; the layout then
  carries the `dpjax.pipeline.Pipeline` that runs the stages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax import pipeline as pp
from dpjax.mesh import CONTEXT, EXPERT, MODEL, STAGE, as_axes, data_axes, is_spec, spanning, spec_axes
from dpjax.compute.tensor_parallel import NOT_FSDP, Parallel


def leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def specs_from_table(tree, table: dict):
    """Each leaf's spec from `table`, looked up by the leaf's own key (the last path element)."""
    def spec(path, x):
        key = getattr(path[-1], "key", None)
        if key not in table:
            raise KeyError(f"parameter {leaf_name(path)} has no entry in the sharding table")
        return table[key]
    return jax.tree_util.tree_map_with_path(spec, tree)


def _resolve(spec: P, ndim: int, names) -> P:
    """The spec padded to `ndim` entries, without axes the mesh does not have."""
    entries = [tuple(a for a in as_axes(e) if a in names) for e in list(spec) + [None] * (ndim - len(spec))]
    return P(*[None if not e else (e[0] if len(e) == 1 else e) for e in entries])


@dataclass(frozen=True)
class Layout:
    """The sharding of a model's parameters on a mesh (see the module docstring).

    workers: the data axes that number an update rule's workers; the other data axes
    (`inner_axes`) are synchronous data parallelism inside each worker, and FSDP splits
    over those."""

    mesh: Any
    specs: Any  # pytree of PartitionSpec, like the parameters
    gather_dims: Any = None  # FSDP: per leaf, the dimension split over the inner axes (-1: none)
    algorithm: str = "ring"  # tensor-parallel allreduce
    fsdp_algorithm: str = "ring"  # FSDP all-gather / reduce-scatter
    workers: tuple = ()
    pipeline: Any = None  # a dpjax.pipeline.Pipeline when the mesh has a stage axis
    layers: str | None = None  # the key of the model's layer stack (pipelines store it per `pipeline`)

    @property
    def fsdp(self) -> bool:
        return self.gather_dims is not None

    @property
    def inner_axes(self) -> tuple:
        """The data axes inside one worker, outermost first."""
        return tuple(a for a in data_axes(self.mesh) if a not in self.workers)

    @property
    def num_workers(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.workers)

    def parallel(self, fsdp_wire=None) -> Parallel:
        """The model's view: tensor-parallel layers over `model` if any parameter is split
        over it, else the dense computation; FSDP gathers over the inner axes, their
        gradients reduce-scattered in `fsdp_wire` (a `dpjax.compression` method, or None for full precision);
        sequences split over the context axis if the mesh has one of more than one device."""
        inner = self.inner_axes
        split = any(MODEL in spec_axes(s) for s in jax.tree.leaves(self.specs, is_leaf=is_spec))
        return Parallel(model_axis=MODEL if split else None, algorithm=self.algorithm,
                        data_axis=(inner[0] if len(inner) == 1 else inner) if inner else None,
                        gather_dims=self.gather_dims, fsdp_algorithm=self.fsdp_algorithm, fsdp_wire=fsdp_wire,
                        context_axis=CONTEXT if self.context_axes else None,
                        expert_axis=EXPERT if self.expert_split else None)

    @property
    def expert_split(self) -> bool:
        """Whether some parameter is split over an expert axis of more than one device."""
        return self.mesh.shape.get(EXPERT, 1) > 1 and any(
            EXPERT in spec_axes(s) for s in jax.tree.leaves(self.specs, is_leaf=is_spec))

    def expert_leaves(self):
        """A tree of bools like the parameters: which leaves are split over the expert axis
        (each device holds its own experts: never broadcast nor averaged over that axis).
        Under FSDP every other leaf is split over the data axes, `expert` among them: the
        experts are then the leaves FSDP leaves alone."""
        if self.gather_dims is not None:
            return jax.tree.map(lambda d: self.expert_split and d == NOT_FSDP, self.gather_dims)
        return jax.tree.map(lambda s: self.expert_split and EXPERT in spec_axes(s), self.specs, is_leaf=is_spec)

    @property
    def context_axes(self) -> tuple:
        """(CONTEXT,) when the mesh splits sequences over more than one device, else ()."""
        return (CONTEXT,) if self.mesh.shape.get(CONTEXT, 1) > 1 else ()

    def shardings(self, specs=None):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs if specs is None else specs,
                            is_leaf=is_spec)

    def gather(self, params):
        """Inside the step: the parameters whole, ready for an unchanged model's apply
        (FSDP's all-gather, whose backward reduce-scatters and averages the gradient
        over the data axes); the parameters as they are when nothing is split over them."""
        return self.parallel().use(params)

    def store(self, params):
        """A model's parameters as this layout keeps them (the same but for interleaved
        pipelines, whose layer stack is kept as V x L/V: `dpjax.pipeline.store`)."""
        if self.pipeline is None:
            return params
        return pp.store(params, self.layers, self.pipeline.virtual_stages)

    def unstore(self, params):
        """`store`'s inverse: the parameters as the model's own `apply` takes them."""
        if self.pipeline is None:
            return params
        return pp.unstore(params, self.layers, self.pipeline.virtual_stages)


def model_table(model, mesh) -> dict:
    """The model's sharding table on `mesh`: its SPECS, or another where a model's table
    depends on the mesh (the Llama's K/V heads, split or replicated by the model axis's
    size): `model.sharding_table(mesh)`."""
    return model.sharding_table(mesh)


def make_layout(model, mesh, *, algorithm: str = "ring", fsdp: bool = False, fsdp_algorithm: str = "ring",
                tensor_parallel: bool = True, workers: tuple = (), pipeline: pp.Pipeline | None = None) -> Layout:
    """Resolves `model.SPECS` on `mesh` (tensor_parallel=False: every parameter replicated
    over `model`); `workers`: the data axes an update rule's workers span (FSDP splits over
    the others). On a mesh with a `stage` axis the layer stack is split over it and run by
    `pipeline` (default `Pipeline()`: 1F1B, one micro-batch per stage; `dpjax.plan` checks
    that it fits the model). Raises UserError (one line) when a split dimension does not
    divide by its axis."""
    layers = model.LAYERS
    if STAGE in mesh.axis_names:  # checked by dpjax.plan; here only its micro-batches resolved
        pipeline = (pipeline or pp.Pipeline()).resolved(mesh.shape[STAGE])
    elif pipeline is not None:
        raise ValueError(f"a pipeline needs a stage axis; mesh {dict(mesh.shape)} has none")
    V = pipeline.virtual_stages if pipeline else 1
    abstract = jax.eval_shape(lambda k: pp.store(model.init(k), layers, V), jax.random.key(0))
    table = model_table(model, mesh)
    if tensor_parallel:
        table_specs = specs_from_table(abstract, table)
    elif pipeline is not None:  # replicated over `model`, the layers still split over `stage`
        table_specs = jax.tree.map(lambda s: P(*[STAGE if STAGE in as_axes(e) else None for e in s]),
                                   specs_from_table(abstract, table), is_leaf=is_spec)
    else:
        table_specs = jax.tree.map(lambda _: P(), abstract)
    if V > 1:  # the stored stack is V x L/V: the stage split moves to the second dimension
        table_specs = {**table_specs, layers: jax.tree.map(lambda s: P(None, *s), table_specs[layers],
                                                           is_leaf=is_spec)}
    # FSDP never splits the leading dimensions that number a stack's layers: a layer is
    # gathered on its own, just before use (Parallel.use_layer)
    layer_dims = jax.tree_util.tree_map_with_path(
        lambda path, _: pp.layer_dims(pipeline) if getattr(path[0], "key", None) == layers else 0, abstract)
    layout = layout_from_specs(abstract, table_specs, mesh, what=f"{model.name} parameter", algorithm=algorithm,
                               fsdp=fsdp, fsdp_algorithm=fsdp_algorithm, workers=workers, skip_dims=layer_dims)
    return dataclasses.replace(layout, pipeline=pipeline, layers=layers)


def layout_from_specs(abstract, specs, mesh, *, what: str = "parameter", algorithm: str = "ring", fsdp: bool = False,
                      fsdp_algorithm: str = "ring", workers: tuple = (), skip_dims=None) -> Layout:
    """The layout of parameters shaped like `abstract` with the given specs (a tree of
    PartitionSpec, from a model's table or `dpjax.sharding_rules`). A spec that names the data
    axes itself (a rule splitting a parameter over `data`) is FSDP on that dimension;
    `fsdp` splits every other parameter too, on its largest free dimension that divides
    (past the first `skip_dims` dimensions of each leaf, a tree of ints: a layer stack's
    layer axes, which a pipeline gathers one layer at a time).
    Raises UserError (one line) when a split dimension does not divide by its axis."""
    names = mesh.axis_names
    workers = tuple(a for a in data_axes(mesh) if a in workers)
    dp = tuple(a for a in data_axes(mesh) if a not in workers)
    ndp = math.prod(mesh.shape[a] for a in dp)

    def resolve(path, x, spec):
        spec = _resolve(spec, x.ndim, names)
        for d, e in enumerate(spec):
            n = math.prod(mesh.shape[a] for a in as_axes(e))
            if x.shape[d] % n:
                raise UserError(f"{what} {leaf_name(path)} {x.shape}: dimension {d} of size "
                                f"{x.shape[d]} does not split over the {n} devices of mesh axis {e!r}; "
                                f"change the model size or the mesh")
        return spec

    def split_over_data(path, x, spec, skip):
        if EXPERT in spec_axes(spec):  # a mixture's experts: split over `expert`, never FSDP-split, gathered
            return spec, NOT_FSDP      # nor averaged (dpjax.step averages their gradient over the other axes)
        named = [d for d, e in enumerate(spec) if set(as_axes(e)) & set(data_axes(mesh))]
        if named:  # the spec chose: FSDP on that dimension, over exactly the inner data axes, last
            e = as_axes(spec[named[0]])
            if len(named) > 1 or e[len(e) - len(dp):] != dp or set(e[:len(e) - len(dp)]) & set(data_axes(mesh)):
                raise UserError(f"{what} {leaf_name(path)}: spec {spec} splits it over data axes other than "
                                f"{dp} on one dimension (after any model axis); FSDP splits one dimension over "
                                f"all of them")
            return spec, named[0] if ndp > 1 else -1
        # A dimension already split over `model` can take the data axes too (inside
        # each model shard); a free one is preferred, then the largest local size.
        local = [x.shape[d] // math.prod(mesh.shape[a] for a in as_axes(e)) for d, e in enumerate(spec)]
        fits = [d for d in range(skip, x.ndim) if local[d] % ndp == 0]
        if not fsdp or ndp == 1 or not fits:
            return spec, -1
        d = max(fits, key=lambda i: (spec[i] is None, local[i], -i))
        joint = as_axes(spec[d]) + dp
        entries = [(joint[0] if len(joint) == 1 else joint) if i == d else e for i, e in enumerate(spec)]
        return P(*entries), d

    specs = jax.tree_util.tree_map_with_path(resolve, abstract, specs)
    skip_dims = jax.tree.map(lambda _: 0, abstract) if skip_dims is None else skip_dims
    pairs = jax.tree_util.tree_map_with_path(split_over_data, abstract, specs, skip_dims)
    is_pair = lambda t: isinstance(t, tuple) and len(t) == 2 and is_spec(t[0])  # noqa: E731
    specs = jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair)
    dims = jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair)
    if not fsdp and all(d < 0 for d in jax.tree.leaves(dims)):
        dims = None  # no parameter split over the data axes: not FSDP
    return Layout(mesh, specs, dims, algorithm, fsdp_algorithm, workers)


def state_specs(tx, state, specs):
    """Specs for the state of optax transformation `tx`: wherever it holds a tree shaped
    like the parameters (Adam's moments, accumulated gradients) the parameters' specs;
    any other leaf (a step count, a scalar) is replicated."""
    return optax.tree_map_params(tx, lambda _, spec: spec, state, specs, transform_non_params=lambda _: P(),
                                 is_leaf=is_spec)


def sq_norm(tree, specs):
    """The global sum of squares of a sharded tree, inside shard_map: each leaf's local
    sum is summed over the axes that split it (replicas are counted once)."""
    groups: dict[tuple, Any] = {}
    for x, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=is_spec)):
        axes = spanning(spec_axes(spec))  # an axis of one device sums nothing
        groups[axes] = groups.get(axes, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return sum(lax.psum(s, axes) if axes else s for axes, s in groups.items())
