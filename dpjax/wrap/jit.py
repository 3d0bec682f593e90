"""`dpjax.jit`: a drop-in for `jax.jit` that takes what the user passed to `jax.jit` and runs
the step as a `dpjax.shard_step`.

    train_step = dpjax.jit(train_step, in_shardings=(state_sharding, data_sharding, None),
                           out_shardings=(state_sharding, None), static_argnums=(2,), donate_argnums=0)

The shardings say what `shard_step` needs (see `dpjax.wrap.wrapper`):

- The batch: an argument whose sharding names a data axis (`NamedSharding(mesh, P('data'))`;
  every mesh axis but `model`, `stage` and `context` is one) becomes a batch argument, its rows
  split over the data axes. Over those axes the step is dpjax's explicit world: each device
  computes on its own rows, and the gradients cross devices where `DistributedOptimizer` (the
  optimizer's wrapper) averages them.
- The state: the other arguments' shardings (`NamedSharding`s or `PartitionSpec`s, in a tree
  of the state's structure, boxed or not, or one for the whole argument) lay out the model
  axes, as under `jax.jit` (GSPMD's: the layout "auto" of `dpjax.wrap.annotations`); `None`:
  shard_step's own rule (the model's own annotations, else replicated).
- The outputs: each output's sharding over the model axes is kept (a sharding constraint on
  it inside the step); over the data axes, an output whose sharding names one comes back
  split by rows, any other is replicated and checked to be (`dpjax.wrap.replicas`): a loss or
  a metric must be the global batch's (`dpjax.weighted_mean`, `dpjax.global_sum`), as it is
  under `jax.jit`.

The mesh is the shardings' (a `NamedSharding`'s), else the one set by `jax.set_mesh` (or
`with mesh:`), else every device on `data`. `static_argnums` / `static_argnames`,
`donate_argnums` / `donate_argnames` and keyword arguments are taken as `jax.jit` takes them
(`dpjax.wrap.call`); as there, `in_shardings` covers the positional arguments left once the
static ones are taken out.
"""

from __future__ import annotations

import functools

import jax
from jax._src import mesh as mesh_lib  # a legacy `with mesh:` is kept there alone (tests/test_jax_private.py)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import NOT_DATA, make_mesh, spec_axes
from dpjax.wrap import annotations, call, draws
from dpjax.wrap.wrapper import shard_step


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (P, jax.sharding.Sharding))


def _specs(tree, what: str, step: str):
    """`tree` of shardings with each NamedSharding as its PartitionSpec (None kept)."""
    def one(s):
        if s is None or isinstance(s, P):
            return s
        if isinstance(s, NamedSharding):
            return s.spec
        raise UserError(f"{step}: {what} holds a {type(s).__name__}; dpjax.jit takes NamedShardings, "
                        "PartitionSpecs or None")
    return jax.tree.map(one, tree, is_leaf=_is_leaf)


def _meshes(tree) -> list:
    return [s.mesh for s in jax.tree.leaves(tree, is_leaf=_is_leaf) if isinstance(s, NamedSharding)]


def _context_mesh():
    """The mesh `jax.set_mesh` (or a legacy `with mesh:`) set, or None."""
    mesh = jax.sharding.get_mesh()
    if isinstance(mesh, Mesh) and mesh.size:
        return mesh

    mesh = mesh_lib.thread_resources.env.physical_mesh
    return mesh if mesh.size else None


def jit(fn=None, *, in_shardings=None, out_shardings=None, static_argnums=(), static_argnames=(), donate_argnums=(),
        donate_argnames=(), mesh=None, model_axes="auto", axes=None, check=None):
    """`fn` as `jax.jit(fn, ...)` would compile it, run as a `dpjax.shard_step` (see the module
    docstring). Beside jax.jit's arguments: mesh (a Mesh or a `dpjax.make_mesh` spec; default:
    the shardings'), and shard_step's model_axes (default "auto", as under jax.jit), axes and
    check. Also a decorator: `@dpjax.jit` or `@functools.partial(dpjax.jit, static_argnums=1)`."""
    if fn is None:
        return functools.partial(jit, in_shardings=in_shardings, out_shardings=out_shardings,
                                 static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, donate_argnames=donate_argnames, mesh=mesh,
                                 model_axes=model_axes, axes=axes, check=check)
    return Jitted(fn, in_shardings, out_shardings, mesh,
                  dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                       donate_argnames=donate_argnames, model_axes=model_axes, axes=axes, check=check))


class Jitted:
    """What `dpjax.jit` returns: the shard_step it builds at the first call (when the mesh is
    known), called as jax.jit's function is."""

    def __init__(self, fn, in_shardings, out_shardings, mesh, options: dict):
        functools.update_wrapper(self, fn)
        self.fn, self.in_shardings, self.out_shardings, self._mesh = fn, in_shardings, out_shardings, mesh
        self.options = options
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.step = None
        self.user_mesh = None  # the mesh in the user's names where the step's were read from the shardings

    def __call__(self, *args, **kwargs):
        if self.step is None:
            self.step = self._build(args, kwargs)
        out = self.step(*args, **kwargs)
        return _on(self.user_mesh, out) if self.user_mesh is not None else out

    def _mesh_of(self, args):
        if self._mesh is not None:
            return self._mesh
        found = _meshes(self.in_shardings) + _meshes(self.out_shardings)
        if found:
            return found[0]
        context = _context_mesh()
        if context is not None:
            return context
        placed = [x.sharding.mesh for x in jax.tree.leaves(args) if isinstance(x, jax.Array)
                  and isinstance(x.sharding, NamedSharding) and x.sharding.mesh.size > 1]
        return placed[0] if placed else None  # None: shard_step's default, every device on `data`

    def _build(self, args, kwargs):
        mesh = self._mesh_of(args)
        if isinstance(mesh, str) or mesh is None:
            mesh = make_mesh(mesh or f"{jax.device_count()}x1")
        sig = call.Signature(self.fn, self.options["static_argnums"], self.options["static_argnames"])
        if sig.sig is not None:  # a keyword argument for a positional parameter is covered too (unlike jax.jit)
            args = sig.sig.bind_partial(*args, **kwargs).args
        positions = [i for i in range(len(args)) if i not in sig.static_nums]  # what in_shardings covers
        ins = _specs(self.in_shardings, "in_shardings", self.name)
        if _is_leaf(ins):  # one for every argument, as jax.jit reads it
            ins = (ins,) * len(positions)
        if not isinstance(ins, (tuple, list)) or len(ins) != len(positions):
            raise UserError(f"{self.name}: in_shardings has {len(ins) if isinstance(ins, (tuple, list)) else 1} "
                            f"entries for {len(positions)} positional arguments (the static ones left out); give "
                            "one for each, as jax.jit asks")
        axes = self.options["axes"]
        if axes is None:  # the roles of the user's axis names, read from the shardings
            axes = _model_axis(self.name, mesh, [(sig.argname(p), e) for p, e in zip(positions, ins)])
            self.options = {**self.options, "axes": axes}
            self.user_mesh = mesh if axes else None
        data = {a for a in mesh.axis_names if axes.get(a, a) not in NOT_DATA}  # in the user's names
        in_specs, batch = [None] * (max(positions, default=-1) + 1), []
        splits = {a for a in data if mesh.shape[a] > 1}  # a data axis of one device splits nothing
        for pos, entry in zip(positions, ins):
            over = sorted(_split_beyond_rows(entry) & splits)
            if over:
                raise UserError(f"{self.name}: in_shardings for argument {sig.argname(pos)} splits a dimension "
                                f"other than the first over {over[0]!r}, which a batch is split over too; dpjax.jit "
                                "splits a batch by rows over the data axes and keeps the state whole over them: "
                                "shard parameters over the data axes (FSDP) with dpjax.shard_step's in_specs")
            if any(a in splits for s in jax.tree.leaves(entry, is_leaf=_is_leaf) if s is not None
                   for a in spec_axes(s)):
                batch.append(pos)
            in_specs[pos] = entry if _is_leaf(entry) else jax.tree.map(  # None inside a tree: as shard_step's P()
                lambda s: P() if s is None else s, entry, is_leaf=_is_leaf)
        outs = _specs(self.out_shardings, "out_shardings", self.name)
        out_data = jax.tree.map(lambda s: P() if s is None else annotations.renamed(annotations.only(s, data), axes),
                                outs, is_leaf=_is_leaf)
        fn = _drawn(_constrained(self.fn, outs))
        return shard_step(fn, mesh, tuple(batch), in_specs=tuple(in_specs), out_specs=out_data,
                          **self.options)


def _on(mesh, out):
    """The step's outputs on `mesh`, the same devices in the user's axis names (no copy: each
    array's blocks as they are), so that they pass back into jax.jit's shardings."""
    def one(x):
        if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding) or x.sharding.mesh == mesh:
            return x
        names = dict(zip(x.sharding.mesh.axis_names, mesh.axis_names))
        sharding = NamedSharding(mesh, annotations.renamed(x.sharding.spec, names))
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards])
    return jax.tree.map(one, out)


def _split_beyond_rows(entry) -> set:
    """The mesh axes `entry` (an argument's shardings) splits a dimension other than the first over."""
    return {a for s in jax.tree.leaves(entry, is_leaf=_is_leaf) if s is not None
            for e in tuple(s)[1:] for a in spec_axes(P(e))}


def _model_axis(step: str, mesh, entries) -> dict:
    """`axes` for shard_step, read from jax.jit's shardings where the mesh's names do not say it:
    an axis that splits the state (an argument with a parameter split beyond its first dimension:
    lm1b's `tensor` and `fsdp`) and no batch is a model axis (GSPMD lays the model out over it, as
    under jax.jit), so it is mapped to dpjax's `model`. entries: (argument name, its shardings)
    for each argument in_shardings covers."""
    named = lambda e: {a for s in jax.tree.leaves(e, is_leaf=_is_leaf) if s is not None for a in spec_axes(s)}  # noqa: E731
    state = set().union(*[named(e) for _, e in entries if _split_beyond_rows(e)])
    rows = set().union(*[named(e) for _, e in entries if not _split_beyond_rows(e)])
    found = [a for a in mesh.axis_names if a in state - rows and a not in NOT_DATA and mesh.shape[a] > 1]
    if not found:
        return {}
    if len(found) > 1 or mesh.shape.get("model", 1) > 1:
        names = found + (["model"] if mesh.shape.get("model", 1) > 1 else [])
        raise UserError(f"{step}: in_shardings split the state over {', '.join(map(repr, names))} of the mesh "
                        f"{dict(mesh.shape)}, and no batch over them; dpjax.jit lays the model out over one such "
                        "axis: make the others of size 1")
    if "model" in mesh.axis_names:  # a `model` axis of one device makes way: a data axis of size 1
        return {found[0]: "model", "model": found[0]}
    return {found[0]: "model"}


def _drawn(fn):
    """fn with its dropout masks drawn as jax.jit draws them, each device its rows of the global
    batch's mask (`dpjax.wrap.draws`)."""
    @functools.wraps(fn)
    def step(*args, **kwargs):
        with draws.drawing():
            return fn(*args, **kwargs)
    return step


def _constrained(fn, outs):
    """fn with each output's layout over the model axes constrained as `outs` says (the data
    axes are dpjax's: `dpjax.wrap.constraints` drops them inside the step), as jax.jit's
    out_shardings do: one that names no model axis is whole over them (GSPMD would otherwise
    choose); None leaves the output to GSPMD."""
    model = lambda s: s is not None  # noqa: E731
    if not any(model(s) for s in jax.tree.leaves(outs, is_leaf=_is_leaf)):
        return fn

    @functools.wraps(fn)
    def step(*args, **kwargs):
        out = fn(*args, **kwargs)
        return jax.tree.map(lambda s, sub: jax.lax.with_sharding_constraint(sub, s) if model(s) else sub,
                            outs, out, is_leaf=_is_leaf)
    return step
