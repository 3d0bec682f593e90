"""`dpjax.shard_step`: research code's own step on a mesh, for NNX modules, Linen
TrainStates and plain pytrees alike.

    @dpjax.shard_step(batch_argnums=3)                   # where flax's tutorial says @nnx.jit
    def train_step(model, optimizer, metrics, batch): ...

Each call is one `jax.jit(jax.shard_map(...))` (compiled once per structure):

1. Arguments. NNX objects (modules, `nnx.Optimizer`, metrics) are split into a graph
   and a state, the way flax's own transforms do it (`nnx.jit`, `nnx.shard_map`); the
   state travels as arrays, each with the spec of its Variable's sharding metadata
   (`nnx.with_partitioning`, dpjax's parallel layers; none: replicated). Any other
   argument is a pytree (a Linen `TrainState`, a dict of arrays), replicated unless it is
   in `batch_argnums` (rows split over the data axes) or `in_specs` says otherwise.
   Host arrays are placed by the wrapper; a batch whose rows do not split is one error line.
2. Inside, each device merges its blocks back into modules and calls `fn`. Every
   `nnx.Rngs` stream draws per device (`dpjax.wrap.rng`: dropout differs across devices).
   Gradients stay local (check_vma=False, see `dpjax.data_parallel`): the averaging is
   explicit, by `DistributedOptimizer` as the optimizer's tx, or
   `dpjax.allreduce_gradients` / `lax.pmean` where the user wants it.
3. In-place updates come back: the modules' new state is split off again and written
   into the caller's objects (`nnx.update`). The update of an `nnx.metrics.Average`
   (`Accuracy` is one: a total and a count) is summed over the data axes, so a metric
   counts the global batch; another metric must synchronise itself.
   DistributedOptimizer's error-feedback buffers differ per rank by design: outside the
   step they hold a slot a rank (`dpjax.wrap.per_rank`), in an nnx.Optimizer or in an
   optimizer state passed in and returned under the default out_specs.
4. Whatever comes back declared replicated (the outputs under `out_specs`, default P();
   the new state) is checked to be equal on the devices that share it
   (`dpjax.wrap.replicas`) on the first calls and on every call under DPJAX_CHECK=1; a
   divergence is one error line naming the value, how far apart the copies are, and
   the usual cause. An output under out_specs "mean" is averaged over the data axes
   first; one under "rows" comes back split over them (one value per batch row).

Before the first call runs, `dpjax.wrap.checks` refuses what would look right and be
wrong (an nnx.Linear whose bias does not fit its kernel's split) and warns once about
what would not be parallel (nothing split over the data axes; one CPU device).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import sys

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.wrap import annotations, constraints, per_rank
from dpjax.wrap import checks
from dpjax.errors import UserError
from dpjax.mesh import NOT_DATA, data_axes, make_mesh, spec_axes
from dpjax.wrap.replicas import FIRST_CALLS, ReplicaCheck, check_always
from dpjax.wrap.rng import bound_data_axes, fold_rng_keys

HINTS = {
    "Param": "were its gradients averaged over {axes}? give the optimizer dpjax.DistributedOptimizer(...) "
             "as its tx, or average them with dpjax.allreduce_gradients",
    "Opt": "were the gradients averaged over {axes}? give the optimizer dpjax.DistributedOptimizer(...) "
           "as its tx, or average them with dpjax.allreduce_gradients",
    "BatchStat": "give the BatchNorm axis_name='data' (the mesh's data axes), or every BatchNorm at once with "
                 "model = dpjax.nn.nnx.sync_batchnorm(model), so that its batch statistics are averaged across "
                 "devices",
    "MetricState": "dpjax sums the updates of nnx.metrics.Average and Accuracy over the data axes; another metric "
                   "must synchronise itself (lax.psum) inside the step",
    "per_rank": "it is DistributedOptimizer's error-feedback buffer, which differs from rank to rank by design: "
                "keep the optimizer in an nnx.Optimizer (shard_step gives that state a slot a rank), or run the "
                "step in your own jax.shard_map and return the buffer with a leading axis split over {axis}",
    "output": "average it inside the step (jax.lax.pmean(x, {axis}), dpjax.allreduce_gradients, or "
              "out_specs=\"mean\"), or, for one value per batch row, declare it split with out_specs=\"rows\"",
}
# Copies that differ along `model` are not a missing average: each model rank computed from
# its own shard of a split weight, and the partial results were never summed.
MODEL_HINT = ("the copies differ along 'model': a value computed from a weight split over 'model' was used as if "
              "whole (usually a plain matmul, x @ w, against a split w); sum the partial results with "
              "dpjax.compute.tensor_parallel.reduce_from_model(x) (a psum whose gradient is right here) and pass the "
              "layer's input through dpjax.compute.tensor_parallel.copy_to_model, or use dpjax.nn's parallel layers, "
              "which do both")


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _argnums(x) -> tuple:
    return (x,) if isinstance(x, int) else tuple(x)


def _flax_nnx():
    """flax.nnx if the program imported it (else it holds no NNX objects: dpjax does not
    import flax for code that does not use it)."""
    return sys.modules.get("flax.nnx")


def _has_nnx(tree, variables: bool = True) -> bool:
    """Whether tree holds NNX objects (modules, optimizers, metrics) or, if `variables`, Variables."""
    nnx = _flax_nnx()
    if nnx is None:
        return False
    kinds = (nnx.Pytree, nnx.Variable) if variables else (nnx.Pytree,)
    return any(isinstance(x, kinds) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kinds)))


def shard_step(fn=None, mesh=None, batch_argnums=None, *, donate_argnums=(), in_specs=None, out_specs=P(),
               check=None, model_axes=None, axes=None):
    """`fn` as one jit(shard_map) step over `mesh` (default: every device on a `data` axis).

    mesh: a Mesh or a spec for `dpjax.make_mesh` ("4x2": data x model), made at the first call.
    batch_argnums: arguments whose leaves are split by rows over the data axes (left out,
    with nothing else split over a data axis larger than 1: a warning, once; `()` says
    that nothing is to be split, as in a step that broadcasts parameters).
    in_specs: per argument, None (the rule above) or a PartitionSpec / tree of them
    for a pytree argument (sharded state: FSDP, tensor parallelism). out_specs, for fn's
    outputs, a PartitionSpec or one of these words, or a tree of them: P() (the default)
    replicated, checked; "mean" averaged over the data axes (a loss or metric of this
    device's rows; then replicated, checked); "rows" one row per batch row (a prediction:
    each device's rows joined in batch order, P(data axes)).
    check: None checks the first calls (dpjax.wrap.replicas.FIRST_CALLS), True every call,
    False none; DPJAX_CHECK=1 checks every call whatever this says.
    model_axes: how what the model annotates over its model axes is laid out (see
    `dpjax.wrap.annotations`): "auto" (GSPMD inside the step, for flax code written for jax.jit)
    or "explicit" (each device its block, for dpjax.nn layers and code written for
    shard_map); None chooses: "explicit" where the model holds dpjax.nn layers or in_specs
    names a model axis, else "auto" where annotations name one.
    axes: your mesh's axis names mapped to dpjax's, {"tp": "model"}: the step runs on the
    same devices with dpjax's names (inside it, collectives name dpjax's axes), and the
    annotations' names are read through the mapping. Without it every axis but `model`
    and `stage` is a data axis, whatever its name.
    Also a decorator: `@shard_step(batch_argnums=3)`, `@shard_step("4x2", batch_argnums=3)`.
    See the module docstring for what it does with NNX objects, RNGs and metrics.
    """
    if fn is None or isinstance(fn, (Mesh, str)):
        return functools.partial(shard_step, mesh=mesh if fn is None else fn, batch_argnums=batch_argnums,
                                 donate_argnums=donate_argnums, in_specs=in_specs, out_specs=out_specs, check=check,
                                 model_axes=model_axes, axes=axes)
    if model_axes not in (None,) + annotations.LAYOUTS:
        raise UserError(f"shard_step: model_axes={model_axes!r} is not one of "
                        f"{', '.join(map(repr, annotations.LAYOUTS))} or None")
    batch = _argnums(() if batch_argnums is None else batch_argnums)  # 0 is an argument, None none said
    step = ShardedStep(fn, mesh, batch, _argnums(donate_argnums), in_specs, out_specs, check)
    step.model_axes, step.axes = model_axes, dict(axes or {})
    step.warn_unsplit = batch_argnums is None and not getattr(fn, "dpjax_splits_nothing", False)
    return step


@dataclass(frozen=True)
class _Leaf:
    name: str  # "model/conv1/kernel": the argument's name, then the path
    kind: str  # the Variable type ("Param", "BatchStat", "RngKey", ...), or "array" for a pytree leaf
    spec: P
    owner: int  # the argument it belongs to
    summed: bool = False  # an nnx.metrics.Average's total or count: its update is summed over the data axes
    per_rank: bool = False  # a slot a rank (`dpjax.wrap.per_rank`: DistributedOptimizer's error buffers)


class ShardedStep:
    """The callable `shard_step` returns; `calls` counts its calls."""

    def __init__(self, fn, mesh, batch_argnums, donate_argnums, in_specs, out_specs, check):
        functools.update_wrapper(self, fn)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)  # a functools.partial has none
        self.fn, self._mesh, self.batch_argnums, self.donate_argnums = fn, mesh, batch_argnums, donate_argnums
        self.in_specs, self.out_specs, self.check = in_specs, out_specs, check
        self.calls = 0
        self.warn_unsplit = False  # shard_step sets it when batch_argnums was left out
        self.model_axes = None  # shard_step sets it: "auto", "explicit" or None (chosen at the first call)
        self.axes: dict = {}  # shard_step sets it: the user's axis names -> dpjax's
        self._renamed = False
        self._whole: list = []  # parameters annotated over a model axis the mesh lacks
        self._meshes: list = []  # the meshes of the annotations' NamedShardings
        self._explicit_hint = False  # dpjax.nn layers, or in_specs naming a model axis
        self._programs: dict = {}
        self._replicas = ReplicaCheck()
        try:
            self._argnames = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self._argnames = []

    @property
    def mesh(self):
        if self._mesh is None or isinstance(self._mesh, str):  # made at the first call: the devices are known then
            self._mesh = make_mesh(self._mesh or f"{jax.device_count()}x1")
        if self.axes and not self._renamed:  # once: the mesh kept is the renamed one
            self._mesh, self._renamed = annotations.renamed_mesh(self._mesh, self.axes, self.__name__), True
        return self._mesh

    def _argname(self, i: int) -> str:
        return self._argnames[i] if i < len(self._argnames) else f"arg{i}"

    def __call__(self, *args):
        mesh = self.mesh
        self.calls += 1
        nnx_idx = tuple(i for i, a in enumerate(args) if _has_nnx(a))
        clash = sorted(set(nnx_idx) & set(self.batch_argnums))
        if clash:
            raise UserError(f"{self.__name__}: argument {self._argname(clash[0])} holds NNX objects and cannot be a "
                            "batch argument; pass the batch as arrays")
        nodes, nnx = tuple(args[i] for i in nnx_idx), _flax_nnx()
        graphdef, state = nnx.split(nodes) if nodes else (None, None)
        leaves, state_def = jax.tree.flatten(state)
        self._whole, self._meshes, self._explicit_hint = [], [], False
        meta, graph = self._nnx_leaves(nodes, nnx_idx, state, mesh)
        tree_idx = tuple(i for i in range(len(args)) if i not in nnx_idx)
        tree_defs = []
        for i in tree_idx:
            arg_leaves, treedef = jax.tree.flatten(args[i])
            tree_defs.append((treedef, len(arg_leaves)))
            leaves += arg_leaves
            meta += self._tree_leaves(i, args[i], mesh)
        leaves = [per_rank.spread(x, mesh, m.spec) if m.per_rank else x for x, m in zip(leaves, meta)]
        specs = tuple(m.spec for m in meta)
        if self.calls == 1:
            checks.warn_single_cpu(mesh)
            if self.warn_unsplit:
                checks.warn_unsplit(self.__name__, mesh, data_axes(mesh), specs)
            annotations.warn_other_mesh(self.__name__, self._meshes, mesh, self.axes)
            annotations.warn_no_model_axis(self.__name__, mesh, self._whole)
        self._check_splits(leaves, meta, mesh)
        layout = annotations.choose(self.model_axes, mesh, specs, self._explicit_hint)
        if layout == "explicit" and graph:
            checks.check_flax_biases(self.__name__, graph, mesh,
                                     lambda p: _path_name(self._argname(nnx_idx[p[0]]), p[1:]), annotations.spec_of)
        k = len(leaves) - sum(n for _, n in tree_defs)
        key = (graphdef, state_def, tuple(tree_defs), nnx_idx, tree_idx, specs,
               tuple(m.kind == "RngKey" for m in meta[:k]), tuple(m.summed for m in meta[:k]),
               tuple(m.per_rank for m in meta),
               tuple(j for j, m in enumerate(meta) if m.owner in self.donate_argnums), len(args), layout)
        new = key not in self._programs
        if new:
            self._programs[key] = self._build(mesh, *key, leaves)
        self._last = (self._programs[key], [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x),
                                                                 sharding=NamedSharding(mesh, s))
                                            for x, s in zip(leaves, specs)])
        try:
            out, new_state = self._programs[key](*jax.device_put(leaves, [NamedSharding(mesh, s) for s in specs]))
        except UserError:
            raise
        except (TypeError, ValueError, NameError) as e:  # JAX's error while tracing: which parameter, laid how
            if new:
                self._programs.pop(key)
            line = annotations.explain(self.__name__, e, leaves, meta, mesh, layout, traced=new)
            if line is None:
                raise
            raise UserError(line) from None
        if nodes:
            nnx.update(nodes, state_def.unflatten(list(new_state)))
        if self.check is True or check_always() or (self.check is None and self.calls <= FIRST_CALLS):
            named = {_path_name("output", path): x for path, x in jax.tree_util.tree_flatten_with_path(out)[0]}
            named.update({m.name: x for m, x in zip(meta, new_state)})
            kinds = {m.name: m.kind for m in meta[:k]}
            self._replicas(named, where=f"{self.__name__}: ",
                           hint=lambda name, along: _hint(kinds.get(name, "output"), along, name))
        return out

    def compiled_text(self) -> str:
        """The compiled program of the last call, as XLA's HLO text (for `dpjax.hlo`: its
        collectives' bytes, its FLOPs)."""
        program, args = self._last
        return program.lower(*args).compile().as_text()

    def _nnx_leaves(self, nodes, nnx_idx, state, mesh) -> list:
        """A _Leaf for each array of the NNX state, in the order of jax.tree.flatten(state)."""
        if not nodes:
            return [], []
        from flax import nnx

        graph = list(nnx.iter_graph(nodes))  # walked once for all three
        self._explicit_hint |= any(type(node).__module__.startswith("dpjax.nn") for _, node in graph)
        averages = {path for path, node in graph if isinstance(node, nnx.metrics.Average)}
        slots = per_rank.nnx_prefixes(graph)
        out = []
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]:
            keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
            name = _path_name(self._argname(nnx_idx[keys[0]]), path[1:])
            kind = type(var).__name__ if is_var(var) else "array"
            spec = self._resolve(annotations.spec_of(var) if is_var(var) else P(), mesh, name)
            self._meshes.append(annotations.annotated_mesh(var) if is_var(var) else None)
            summed = kind == "MetricState" and keys[:-1] in averages
            mine = per_rank.under(keys, slots)
            spec = per_rank.spec(spec, mesh) if mine else spec
            out += [_Leaf(name, kind, spec, nnx_idx[keys[0]], summed, mine) for _ in jax.tree.leaves(var)]
        return out, graph

    def _tree_leaves(self, i, arg, mesh) -> list:
        """A _Leaf for each leaf of pytree argument i: its spec from in_specs, else the batch rule."""
        entry = None if self.in_specs is None or i >= len(self.in_specs) else self.in_specs[i]
        boxed = annotations.box_specs(arg, mesh.axis_names) if entry is None and i not in self.batch_argnums else None
        if entry is None:
            entry = P(data_axes(mesh)) if i in self.batch_argnums else P()
        try:
            specs = boxed or jax.tree.leaves(jax.tree.broadcast(entry, arg, is_leaf=_is_spec), is_leaf=_is_spec)
        except ValueError as e:
            raise UserError(f"{self.__name__}: in_specs for argument {self._argname(i)} does not match its "
                            f"structure ({e})") from None
        if boxed is None:  # in_specs naming a model axis: code written for shard_map
            self._explicit_hint |= any(a in annotations.model_axes(mesh) for s in specs for a in spec_axes(s))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]
        slots = per_rank.tree_prefixes(arg) if self.in_specs is None or i >= len(self.in_specs) else []
        mine = [per_rank.under(per_rank.keys_of(p), slots) and i not in self.batch_argnums for p in paths]
        return [_Leaf(_path_name(self._argname(i), p), "array",
                      per_rank.spec(s, mesh) if m else self._resolve(s, mesh, self._argname(i)), i, per_rank=m)
                for p, s, m in zip(paths, specs, mine)]

    def _resolve(self, spec, mesh, name) -> P:
        spec = annotations.renamed(spec, self.axes)
        absent = [a for a in spec_axes(spec) if a in NOT_DATA and a not in mesh.axis_names]
        if absent:  # a model axis the mesh lacks: the layer stays whole, said once
            self._whole.append((name, absent[0]))
            spec = annotations.only(spec, mesh.axis_names)
        unknown = [a for a in spec_axes(spec) if a not in mesh.axis_names]
        if unknown:
            raise UserError(f"{self.__name__}: {name} is annotated with sharding {tuple(spec)}, naming "
                            f"{', '.join(map(repr, unknown))}, not an axis of the mesh {dict(mesh.shape)}; map "
                            "logical names to mesh axes around the call: with nnx.logical_axis_rules([(name, "
                            "axis or None), ...]): ...")
        return spec

    def _check_splits(self, leaves, meta, mesh) -> None:
        for x, m in zip(leaves, meta):
            shape = tuple(getattr(x, "shape", ()))
            if len(m.spec) > len(shape):
                raise UserError(f"{self.__name__}: {m.name} {shape} has fewer dimensions than its spec {m.spec}")
            for d, e in enumerate(m.spec):
                n = math.prod(mesh.shape[a] for a in spec_axes(P(e)))
                if shape[d] % n and m.owner in self.batch_argnums:
                    raise UserError(f"{self.__name__}: {m.name} {shape} is split over {e!r}, but its "
                                    f"rows do not divide into {n} parts; use a multiple of {n}")
                if shape[d] % n:  # JAX places no uneven blocks: the user pads (a vocabulary: its extra logits unused)
                    pad = -(-shape[d] // n) * n
                    raise UserError(f"{self.__name__}: {m.name} {shape} is split over {e!r}, but its dimension {d} "
                                    f"({shape[d]}) does not divide into {n} parts; pad it to {pad} (a vocabulary "
                                    f"of {pad} whose {_extra(pad - shape[d])} never used), or annotate that "
                                    "dimension None to keep it whole")

    def _build(self, mesh, graphdef, state_def, tree_defs, nnx_idx, tree_idx, full_specs, is_rng, summed, slots,
               donate, nargs, layout, leaves):
        fn, k, nnx = self.fn, len(is_rng), _flax_nnx()
        out_slots = None  # which outputs are per-rank buffers, once known
        manual = set(data_axes(mesh)) if layout == "auto" else set(mesh.axis_names)
        # auto: shard_map's in/out specs name the data axes only; the model axes' layout is
        # the arrays' own (placed as annotated), kept on the new state by a constraint
        specs = tuple(annotations.only(s, manual) for s in full_specs)
        auto = annotations.automatic(mesh) - manual  # an Explicit axis's layout is in the arrays' types
        kept = [annotations.only(s, auto) for s in full_specs[:k]]

        def body(*local):
            args = [None] * nargs
            mine = [per_rank.local(x) if s else x for x, s in zip(local, slots)]  # this device's slots
            if k:  # each device's blocks merged back into modules; nnx.Rngs draw per device
                nodes = nnx.merge(graphdef, state_def.unflatten(fold_rng_keys(mine, is_rng)))
                for pos, node in zip(nnx_idx, nodes):
                    args[pos] = node
            start = k
            for i, (treedef, n) in zip(tree_idx, tree_defs):
                args[i] = treedef.unflatten(mine[start:start + n])
                start += n
            with constraints.reading(self.axes, auto):  # the model's own constraints
                out = _averaged(fn(*args), self.out_specs, data_axes(mesh))
            if out_slots is not None:  # a returned optimizer state: its buffers in their slots
                flat, out_def = jax.tree.flatten(out)
                out = out_def.unflatten([per_rank.slot(x) if s else x for x, s in zip(flat, out_slots)])
            if _has_nnx(out, variables=False):
                raise UserError(f"{self.__name__} returns NNX objects; return arrays (the modules passed in are "
                                "updated in place)")
            if not k:
                return out, ()
            new, new_def = jax.tree.flatten(nnx.split(nodes)[1])
            if new_def != state_def:
                raise UserError(f"{self.__name__} changed the structure of its NNX arguments (added or removed a "
                                "Variable); dpjax.shard_step keeps in-place updates of existing Variables only")
            axes = bound_data_axes()
            # the stored keys stay the replicated ones (the streams' counters advanced alike);
            # a metric's update on this device's rows is summed with the other devices'
            new = [old if rng else (old + lax.psum(x - old, axes) if add and axes else x)
                   for x, old, rng, add in zip(new, mine, is_rng, summed)]
            if layout == "auto":
                new = [lax.with_sharding_constraint(x, s) if len(s) else x for x, s in zip(new, kept)]
            return out, tuple(per_rank.slot(x) if s else x for x, s in zip(new, slots))

        out_specs = _out_specs(self.out_specs, mesh, self.__name__)
        if out_specs == P() and any(slots[k:]):  # a pytree state with buffers in: where are they in the output?
            shapes = jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:k]),
                                                  check_vma=False, axis_names=manual), *leaves)[0]
            paths, out_def = jax.tree_util.tree_flatten_with_path(shapes)
            found = per_rank.tree_prefixes(shapes)
            mask = [per_rank.under(per_rank.keys_of(p), found) for p, _ in paths]
            if any(mask):  # the default is replicated, but a returned DistributedState's buffers go by rank
                out_slots, out_specs = mask, out_def.unflatten([per_rank.spec(P(), mesh) if s else P() for s in mask])
        smap = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(out_specs, specs[:k]), check_vma=False,
                             axis_names=manual)
        return jax.jit(smap, donate_argnums=donate)


def _extra(k: int) -> str:
    return "extra id is" if k == 1 else f"{k} extra ids are"


def _path_name(prefix: str, path) -> str:
    """'model/conv1/kernel' for the path (DictKey('conv1'), DictKey('kernel')) under `prefix`."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path
            if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]  # a Variable's own value
    return "/".join([prefix] + [str(k) for k in keys])


OUT_WORDS = ("mean", "rows")  # out_specs' words beside PartitionSpecs


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


def _hint(kind: str, along: tuple = ("data",), name: str = "") -> str:
    """The advice for a leaf of this kind whose copies differ along the mesh axes `along`."""
    if "model" in along and kind != "BatchStat":
        return MODEL_HINT
    axes = [a for a in along if a != "model"] or ["data"]
    text = HINTS["Opt"] if kind.startswith("Opt") else HINTS.get(kind, "")
    text = HINTS["per_rank"] if "/".join(per_rank.FIELDS) in name else text
    axis = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
    return text.format(axes=" and ".join(repr(a) for a in axes), axis=axis)
