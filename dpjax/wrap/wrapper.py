"""`dpjax.shard_step`: research code's own step on a mesh, for NNX modules, Linen
TrainStates and plain pytrees alike.

    @dpjax.shard_step(batch_argnums=3)                   # where flax's tutorial says @nnx.jit
    def train_step(model, optimizer, metrics, batch): ...

Each call is one `jax.jit(jax.shard_map(...))` (compiled once per structure, `dpjax.wrap.program`);
`ShardedStep.__call__` reads as these stages in order:

1. Arguments, bound as jax.jit binds them (static, keyword, donated: `dpjax.wrap.call`) and read
   (`dpjax.wrap.arguments`). NNX objects (modules, `nnx.Optimizer`, metrics) are split into a graph
   and a state, the way flax's own transforms do it (`nnx.jit`, `nnx.shard_map`); the
   state travels as arrays, each with the spec of its Variable's sharding metadata
   (`nnx.with_partitioning`, dpjax's parallel layers; none: replicated). Any other
   argument is a pytree (a Linen `TrainState`, a dict of arrays), replicated unless it is
   in `batch_argnums` (rows split over the data axes) or `in_specs` says otherwise.
   Host arrays are placed by the wrapper; a batch whose rows do not split is one error line.
2. Inside (`dpjax.wrap.program`'s body), each device merges its blocks back into modules and calls `fn`. Every
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

import contextlib
import functools

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import data_axes, make_mesh, spec_axes
from dpjax.wrap import annotations, arguments, call, checks, per_rank, program, reference
from dpjax.wrap.replicas import FIRST_CALLS, ReplicaCheck, check_always

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
              "out_specs=\"mean\"), sum it if it is a sum over this device's rows (dpjax.global_sum(x): a count, "
              "a metric's total), or, for one value per batch row, declare it split with out_specs=\"rows\"",
}
# Copies that differ along `model` are not a missing average: each model rank computed from
# its own shard of a split weight, and the partial results were never summed.
MODEL_HINT = ("the copies differ along 'model': a value computed from a weight split over 'model' was used as if "
              "whole (usually a plain matmul, x @ w, against a split w); sum the partial results with "
              "dpjax.compute.tensor_parallel.reduce_from_model(x) (a psum whose gradient is right here) and pass the "
              "layer's input through dpjax.compute.tensor_parallel.copy_to_model, or use dpjax.nn's parallel layers, "
              "which do both")


# Copies that agree along `data` and differ along another data axis (lm1b's `fsdp`): the
# average was taken over `data` alone, DistributedOptimizer's default where the mesh has one.
PARTIAL_HINT = ("its copies agree along 'data' and differ along {along}, which splits the batch too (every axis but "
                "'model', 'stage' and 'context' does): it was averaged over 'data' alone (DistributedOptimizer's "
                "default axis_name); average it inside the step (jax.lax.pmean(x, {missing})), or give the optimizer "
                "every data axis: dpjax.DistributedOptimizer(tx, axis_name={all})")


def shard_step(fn=None, mesh=None, batch_argnums=None, *, donate_argnums=(), in_specs=None, out_specs=P(),
               check=None, model_axes=None, axes=None, static_argnums=(), static_argnames=(), donate_argnames=()):
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
    False none; DPJAX_CHECK=1 checks every call whatever this says. "reference" (or
    DPJAX_CHECK=reference) runs the first call also on one device and compares
    (`dpjax.wrap.reference`), and checks the first calls' replicas.
    model_axes: how what the model annotates over its model axes is laid out (see
    `dpjax.wrap.annotations`): "auto" (GSPMD inside the step, for flax code written for jax.jit)
    or "explicit" (each device its block, for dpjax.nn layers and code written for
    shard_map); None chooses: "explicit" where the model holds dpjax.nn layers or in_specs
    names a model axis, else "auto" where annotations name one.
    axes: your mesh's axis names mapped to dpjax's, {"tp": "model"}: the step runs on the
    same devices with dpjax's names (inside it, collectives name dpjax's axes), and the
    annotations' names are read through the mapping. Without it every axis but `model`
    and `stage` is a data axis, whatever its name.
    static_argnums / static_argnames, donate_argnums / donate_argnames: as in jax.jit
    (`dpjax.wrap.call`): a static argument keys the program (hashable, not traced), a donated
    one's buffers may be reused for the outputs; keyword arguments are taken as jax.jit takes
    them, and argnums name a parameter however it is passed.
    Also a decorator: `@shard_step(batch_argnums=3)`, `@shard_step("4x2", batch_argnums=3)`.
    See the module docstring for what it does with NNX objects, RNGs and metrics.
    """
    if fn is None or isinstance(fn, (Mesh, str)):
        return functools.partial(shard_step, mesh=mesh if fn is None else fn, batch_argnums=batch_argnums,
                                 donate_argnums=donate_argnums, in_specs=in_specs, out_specs=out_specs, check=check,
                                 model_axes=model_axes, axes=axes, static_argnums=static_argnums,
                                 static_argnames=static_argnames, donate_argnames=donate_argnames)
    if model_axes not in (None,) + annotations.LAYOUTS:
        raise UserError(f"shard_step: model_axes={model_axes!r} is not one of "
                        f"{', '.join(map(repr, annotations.LAYOUTS))} or None")
    batch = arguments.argnums(() if batch_argnums is None else batch_argnums)  # 0 is an argument, None none said
    step = ShardedStep(fn, mesh, batch, arguments.argnums(donate_argnums), in_specs, out_specs, check)
    step.signature = call.Signature(fn, static_argnums, static_argnames, donate_argnums, donate_argnames)
    step.model_axes, step.axes = model_axes, dict(axes or {})
    step.warn_unsplit = batch_argnums is None and not getattr(fn, "dpjax_splits_nothing", False)
    return step


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
        self._programs: dict = {}
        self._replicas = ReplicaCheck()
        self.signature = call.Signature(fn, donate_argnums=donate_argnums)  # shard_step sets the static ones

    @property
    def mesh(self):
        if self._mesh is None or isinstance(self._mesh, str):  # made at the first call: the devices are known then
            self._mesh = make_mesh(self._mesh or f"{jax.device_count()}x1")
        if self.axes and not self._renamed:  # once: the mesh kept is the renamed one
            self._mesh, self._renamed = annotations.renamed_mesh(self._mesh, self.axes, self.__name__), True
        return self._mesh

    def __call__(self, *args, **kwargs):
        mesh = self.mesh
        self.calls += 1
        b = self.signature.bind(self.__name__, args, kwargs)  # statics out, keywords in their places
        nodes = [x for x in b.args if arguments.has_nnx(x)]
        want = reference.run(self._reference(), args, kwargs, nodes) if self._check_reference() else None
        batch = b.dynamic(self.batch_argnums)
        in_specs = None if self.in_specs is None else tuple(
            self.in_specs[pos] if by_pos and pos < len(self.in_specs) else None for pos, _, by_pos in b.where)
        a = arguments.Reader(self.__name__, b.name, self.axes, in_specs, batch).read(b.args, mesh)
        if self.calls == 1:
            self._warn_once(mesh, a)
        arguments.check_splits(self.__name__, a.leaves, a.meta, mesh, batch)
        layout = self._layout(mesh, a, b.name)
        key = (b.key, program.Key.of(a, b.donated, len(b.args), layout))
        new = key not in self._programs
        if new:
            self._programs[key] = program.build(b.fn(self.fn), self.__name__, self.axes, self.out_specs, mesh,
                                                key[1], a.leaves)
        out, new_state = self._run(key, new, a, mesh, layout)
        if a.nodes:  # the in-place updates, written into the caller's objects
            arguments.flax_nnx().update(a.nodes, a.state_def.unflatten(list(new_state)))
        if want is not None:  # the first call against one device's (`dpjax.wrap.reference`)
            # a metric's total and count add the devices' updates, one per device: its own ways, not compared
            unsplit = [x for x in annotations.model_axes(mesh) if mesh.shape[x] > 1
                       and not any(x in spec_axes(s) for s in a.specs)]
            reference.compare(self.__name__, want, out, a.nodes, [None if m.summed else m.name for m in a.meta[:a.k]],
                              lambda names: self._check_replicas(out, new_state, a, names),
                              unsplit[0] if unsplit else None)
        if self.check is True or check_always() or (self.check in (None, "reference") and self.calls <= FIRST_CALLS):
            self._check_replicas(out, new_state, a)
        return out

    def _check_reference(self) -> bool:
        return self.calls == 1 and self.check is not False and reference.wanted(self.check)

    def _reference(self):
        """This step on one device of the mesh (`dpjax.wrap.reference`): same arguments, no donation."""
        sig = self.signature
        return shard_step(self.fn, reference.one_device_mesh(self.mesh, self.axes), self.batch_argnums,
                          in_specs=self.in_specs, out_specs=self.out_specs, check=False, model_axes=self.model_axes,
                          axes=self.axes, static_argnums=tuple(sig.static_nums),
                          static_argnames=tuple(sig.static_names))

    def compiled_text(self) -> str:
        """The compiled program of the last call, as XLA's HLO text (for `dpjax.hlo`: its
        collectives' bytes, its FLOPs)."""
        built, args = self._last
        return built.lower(*args).compile().as_text()

    def _warn_once(self, mesh, a: arguments.Arguments) -> None:
        """The first call's warnings: one CPU device, nothing split, annotations on another mesh or
        over a model axis this mesh lacks."""
        checks.warn_single_cpu(mesh)
        if self.warn_unsplit:
            checks.warn_unsplit(self.__name__, mesh, data_axes(mesh), a.specs)
        annotations.warn_other_mesh(self.__name__, a.meshes, mesh, self.axes)
        annotations.warn_no_model_axis(self.__name__, mesh, a.whole)
        if a.unmapped or (self.batch_argnums and not a.explicit_hint):  # a training step, not hand-split code
            annotations.warn_model_unsplit(self.__name__, mesh, a.specs, a.unmapped)

    def _layout(self, mesh, a: arguments.Arguments, argname) -> str:
        """How the model axes are laid out ("auto" or "explicit", `dpjax.wrap.annotations`); under
        "explicit", an nnx.Linear whose bias does not fit its kernel's split is refused."""
        layout = annotations.choose(self.model_axes, mesh, a.specs, a.explicit_hint)
        if layout == "explicit" and a.graph:
            checks.check_flax_biases(self.__name__, a.graph, mesh,
                                     lambda p: arguments.path_name(argname(a.nnx_idx[p[0]]), p[1:]),
                                     annotations.spec_of)
        return layout

    def _run(self, key, new: bool, a: arguments.Arguments, mesh, layout: str):
        """The program of `key` on the arguments' leaves, placed by their specs: (outputs, new
        state). JAX's error while tracing becomes one line where `annotations.explain` can say
        which parameter, laid out how; a program that failed to trace is not kept."""
        self._last = (self._programs[key], [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x),
                                                                 sharding=NamedSharding(mesh, s))
                                            for x, s in zip(a.leaves, a.specs)])
        try:
            # a mesh renamed by `axes` is the context mesh while the step runs: the user's own
            # (`jax.set_mesh` around the call) names other axes, which shard_map refuses
            with jax.set_mesh(mesh) if self._renamed else contextlib.nullcontext():
                return self._programs[key](*jax.device_put(a.leaves, [NamedSharding(mesh, s) for s in a.specs]))
        except UserError:
            raise
        except (TypeError, ValueError, NameError) as e:  # JAX's error while tracing: which parameter, laid how
            if new:
                self._programs.pop(key)
            line = annotations.explain(self.__name__, e, a.leaves, a.meta, mesh, layout, traced=new)
            if line is None:
                raise
            raise UserError(line) from None
        except Exception as e:
            if type(e).__name__ != "ShardingTypeError" or not new:  # matched by name: jax's class is private
                raise
            self._programs.pop(key)
            raise UserError(annotations.explicit_axes(self.__name__, e, mesh)) from None

    def _check_replicas(self, out, new_state, a: arguments.Arguments, only=None) -> None:
        """What came back declared replicated (outputs, new state) equal on the devices sharing it
        (`dpjax.wrap.replicas`), a divergence one line with the usual cause for its kind; only:
        the names of the leaves to check (None: all)."""
        named = {arguments.path_name("output", path): x for path, x in jax.tree_util.tree_flatten_with_path(out)[0]}
        named.update({m.name: x for m, x in zip(a.meta, new_state)})
        named = {k: v for k, v in named.items() if only is None or k in only}
        kinds = {m.name: m.kind for m in a.meta[:a.k]}
        mesh = self.mesh
        data = ("data",) * ("data" in mesh.axis_names) + tuple(a for a in data_axes(mesh) if mesh.shape[a] > 1)
        self._replicas(named, where=f"{self.__name__}: ",
                       hint=lambda name, along: _hint(kinds.get(name, "output"), along, name, data))


def _hint(kind: str, along: tuple = ("data",), name: str = "", data: tuple = ("data",)) -> str:
    """The advice for a leaf of this kind whose copies differ along the mesh axes `along` (data:
    the mesh's data axes)."""
    if "model" in along and kind != "BatchStat":
        return MODEL_HINT
    if along and data[:1] == ("data",) and "data" not in along and (kind in ("Param", "output")
                                                                     or kind.startswith("Opt")):
        every = tuple(dict.fromkeys(a for a in data[1:]))  # the data axes that split the batch
        return PARTIAL_HINT.format(along=" and ".join(map(repr, along)),
                                   all=repr(every[0]) if len(every) == 1 else every,
                                   missing=repr(along[0]) if len(along) == 1 else repr(tuple(along)))
    axes = [a for a in along if a != "model"] or ["data"]
    text = HINTS["Opt"] if kind.startswith("Opt") else HINTS.get(kind, "")
    text = HINTS["per_rank"] if "/".join(per_rank.FIELDS) in name else text
    axis = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
    return text.format(axes=" and ".join(repr(a) for a in axes), axis=axis)
