"""A `shard_step` call's arguments as flat leaves, each with what the step needs to know of it
(a `Leaf`: its name for messages, its kind, its PartitionSpec, its argument).

This is the step's first stage (see `dpjax.wrap.wrapper`): NNX objects are split into a graph
and a state the way flax's own transforms do it, each array of the state taking the spec of its
Variable's sharding metadata; any other argument is a pytree, its leaves taking the spec in_specs
gives them, else the batch rule (rows split over the data axes) or their own annotations. What
the mesh cannot hold is refused here, one line each, before anything is traced: an axis the mesh
lacks, a dimension that does not divide into its split.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import NOT_DATA, data_axes, spec_axes
from dpjax.wrap import annotations, per_rank


def is_spec(x) -> bool:
    return isinstance(x, P)


def argnums(x) -> tuple:
    return (x,) if isinstance(x, int) else tuple(x)


def flax_nnx():
    """flax.nnx if the program imported it (else it holds no NNX objects: dpjax does not
    import flax for code that does not use it)."""
    return sys.modules.get("flax.nnx")


def has_nnx(tree, variables: bool = True) -> bool:
    """Whether tree holds NNX objects (modules, optimizers, metrics) or, if `variables`, Variables."""
    nnx = flax_nnx()
    if nnx is None:
        return False
    kinds = (nnx.Pytree, nnx.Variable) if variables else (nnx.Pytree,)
    return any(isinstance(x, kinds) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kinds)))


def path_name(prefix: str, path) -> str:
    """'model/conv1/kernel' for the path (DictKey('conv1'), DictKey('kernel')) under `prefix`."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path
            if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]  # a Variable's own value
    return "/".join([prefix] + [str(k) for k in keys])


@dataclass(frozen=True)
class Leaf:
    name: str  # "model/conv1/kernel": the argument's name, then the path
    kind: str  # the Variable type ("Param", "BatchStat", "RngKey", ...), or "array" for a pytree leaf
    spec: P
    owner: int  # the argument it belongs to
    summed: bool = False  # an nnx.metrics.Average's total or count: its update is summed over the data axes
    per_rank: bool = False  # a slot a rank (`dpjax.wrap.per_rank`: DistributedOptimizer's error buffers)


@dataclass
class Arguments:
    """One call's arguments read: the NNX state's leaves first, then each pytree argument's,
    with a Leaf each, and what puts them back together inside the step."""

    nnx_idx: tuple  # the arguments holding NNX objects
    nodes: tuple  # those arguments
    graphdef: Any  # nnx.split(nodes)'s graph, or None
    state_def: Any  # the treedef of nnx.split(nodes)'s state
    tree_idx: tuple  # the pytree arguments
    tree_defs: tuple  # (treedef, number of leaves) for each pytree argument
    leaves: list  # the arrays, per-rank slots spread over the ranks
    meta: list  # a Leaf for each
    graph: list  # nnx.iter_graph(nodes)
    whole: list  # (name, axis): parameters annotated over a model axis the mesh lacks
    unmapped: list  # the logical names of Linen boxes that no rule in force maps
    meshes: list  # the meshes of the annotations' NamedShardings
    explicit_hint: bool  # dpjax.nn layers, or in_specs naming a model axis

    @property
    def specs(self) -> tuple:
        return tuple(m.spec for m in self.meta)

    @property
    def k(self) -> int:
        """How many of the leaves are the NNX state's."""
        return len(self.leaves) - sum(n for _, n in self.tree_defs)


class Reader:
    """Reads the arguments of the step `name` (`argname(i)` names its argument i) under its
    axis mapping `axes`, `in_specs` and `batch_argnums`."""

    def __init__(self, name: str, argname: Callable[[int], str], axes: dict, in_specs, batch_argnums: tuple):
        self.name, self.argname, self.axes = name, argname, axes
        self.in_specs, self.batch_argnums = in_specs, batch_argnums
        self.whole: list = []
        self.unmapped: list = []
        self.meshes: list = []
        self.explicit_hint = False

    def read(self, args, mesh) -> Arguments:
        nnx_idx = tuple(i for i, a in enumerate(args) if has_nnx(a))
        clash = sorted(set(nnx_idx) & set(self.batch_argnums))
        if clash:
            raise UserError(f"{self.name}: argument {self.argname(clash[0])} holds NNX objects and cannot be a "
                            "batch argument; pass the batch as arrays")
        nodes, nnx = tuple(args[i] for i in nnx_idx), flax_nnx()
        graphdef, state = nnx.split(nodes) if nodes else (None, None)
        leaves, state_def = jax.tree.flatten(state)
        meta, graph = self._nnx_leaves(nodes, nnx_idx, state, mesh)
        tree_idx = tuple(i for i in range(len(args)) if i not in nnx_idx)
        tree_defs = []
        for i in tree_idx:
            arg_leaves, treedef = jax.tree.flatten(args[i])
            tree_defs.append((treedef, len(arg_leaves)))
            leaves += arg_leaves
            meta += self._tree_leaves(i, args[i], mesh)
        leaves = [per_rank.spread(x, mesh, m.spec) if m.per_rank else x for x, m in zip(leaves, meta)]
        return Arguments(nnx_idx, nodes, graphdef, state_def, tree_idx, tuple(tree_defs), leaves, meta, graph,
                         self.whole, self.unmapped, self.meshes, self.explicit_hint)

    def _nnx_leaves(self, nodes, nnx_idx, state, mesh) -> tuple[list, list]:
        """A Leaf for each array of the NNX state, in the order of jax.tree.flatten(state), and the graph."""
        if not nodes:
            return [], []
        nnx = flax_nnx()  # loaded: the nodes are its objects
        graph = list(nnx.iter_graph(nodes))  # walked once for all three
        self.explicit_hint |= any(type(node).__module__.startswith("dpjax.nn") for _, node in graph)
        averages = {path for path, node in graph if isinstance(node, nnx.metrics.Average)}
        slots = per_rank.nnx_prefixes(graph)
        out = []
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]:
            keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
            name = path_name(self.argname(nnx_idx[keys[0]]), path[1:])
            kind = type(var).__name__ if is_var(var) else "array"
            spec = self._resolve(annotations.spec_of(var) if is_var(var) else P(), mesh, name)
            self.meshes.append(annotations.annotated_mesh(var) if is_var(var) else None)
            summed = kind == "MetricState" and keys[:-1] in averages
            mine = per_rank.under(keys, slots)
            spec = per_rank.spec(spec, mesh) if mine else spec
            out += [Leaf(name, kind, spec, nnx_idx[keys[0]], summed, mine) for _ in jax.tree.leaves(var)]
        return out, graph

    def _tree_leaves(self, i, arg, mesh) -> list:
        """A Leaf for each leaf of pytree argument i: its spec from in_specs, else the batch rule."""
        entry = None if self.in_specs is None or i >= len(self.in_specs) else self.in_specs[i]
        boxed = (annotations.box_specs(arg, mesh.axis_names, self.unmapped)
                 if entry is None and i not in self.batch_argnums else None)
        if entry is None:
            entry = P(data_axes(mesh)) if i in self.batch_argnums else P()
        try:
            specs = boxed or jax.tree.leaves(jax.tree.broadcast(entry, arg, is_leaf=is_spec), is_leaf=is_spec)
        except ValueError as e:
            raise UserError(f"{self.name}: in_specs for argument {self.argname(i)} does not match its "
                            f"structure ({e})") from None
        if boxed is None:  # in_specs naming a model axis: code written for shard_map
            self.explicit_hint |= any(a in annotations.model_axes(mesh) for s in specs for a in spec_axes(s))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]
        slots = per_rank.tree_prefixes(arg) if self.in_specs is None or i >= len(self.in_specs) else []
        mine = [per_rank.under(per_rank.keys_of(p), slots) and i not in self.batch_argnums for p in paths]
        return [Leaf(path_name(self.argname(i), p), "array",
                     per_rank.spec(s, mesh) if m else self._resolve(s, mesh, self.argname(i)), i, per_rank=m)
                for p, s, m in zip(paths, specs, mine)]

    def _resolve(self, spec, mesh, name) -> P:
        """The annotation `spec` in dpjax's axis names, without a model axis the mesh lacks."""
        spec = annotations.renamed(spec, self.axes)
        absent = [a for a in spec_axes(spec) if a in NOT_DATA and a not in mesh.axis_names]
        if absent:  # a model axis the mesh lacks: the layer stays whole, said once
            self.whole.append((name, absent[0]))
            spec = annotations.only(spec, mesh.axis_names)
        unknown = [a for a in spec_axes(spec) if a not in mesh.axis_names]
        if unknown:
            raise UserError(f"{self.name}: {name} is annotated with sharding {tuple(spec)}, naming "
                            f"{', '.join(map(repr, unknown))}, not an axis of the mesh {dict(mesh.shape)}; map "
                            "logical names to mesh axes around the call: with nnx.logical_axis_rules([(name, "
                            "axis or None), ...]): ...")
        return spec


def check_splits(name: str, leaves, meta, mesh, batch_argnums) -> None:
    """Refuses, one line, a leaf whose spec does not fit its shape: JAX places no uneven blocks."""
    for x, m in zip(leaves, meta):
        shape = tuple(getattr(x, "shape", ()))
        if len(m.spec) > len(shape):
            raise UserError(f"{name}: {m.name} {shape} has fewer dimensions than its spec {m.spec}")
        for d, e in enumerate(m.spec):
            n = math.prod(mesh.shape[a] for a in spec_axes(P(e)))
            if shape[d] % n and m.owner in batch_argnums:
                raise UserError(f"{name}: {m.name} {shape} is split over {e!r}, but its "
                                f"rows do not divide into {n} parts; use a multiple of {n}")
            if shape[d] % n:  # JAX places no uneven blocks: the user pads (a vocabulary: its extra logits unused)
                pad = -(-shape[d] // n) * n
                how = (f"pad it to {pad} (a vocabulary of {pad} whose {_extra(pad - shape[d])} never used)"
                       if _VOCABULARY.search(m.name) else f"use a mesh axis whose size divides {shape[d]}")
                raise UserError(f"{name}: {m.name} {shape} is split over {e!r}, but its dimension {d} "
                                f"({shape[d]}) does not divide into {n} parts; {how}, or annotate that "
                                "dimension None to keep it whole")


# a leaf whose name says it spans the vocabulary (an embedding, the output layer): padding it is the usual fix;
# for anything else (attention heads, an MLP's width) it is a smaller or another model axis
_VOCABULARY = re.compile(r"embed|vocab|output|logit|lm_head|unembed|wte", re.IGNORECASE)


def _extra(k: int) -> str:
    return "extra id is" if k == 1 else f"{k} extra ids are"
