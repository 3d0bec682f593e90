"""A model's own sharding annotations, read as flax writes them, and how `shard_step` lays
them out.

flax code written for `jax.jit` annotates each parameter in one of four ways: a tuple of
mesh axis names (`nnx.with_partitioning(init, (None, "model"))`), a `PartitionSpec`, a
`NamedSharding` (the JAX AI Stack's miniGPT: `NamedSharding(mesh, P(None, "model"))`), or
logical names mapped by rules (`nnx.logical_axis_rules`, Linen's `nn.Partitioned` boxes
under `nn.logical_axis_rules`). `spec_of` reads each as a PartitionSpec over mesh axes.

Two layouts for what a model annotates over its model axes (every axis but the data ones):

- "auto": the data axes are manual (dpjax's explicit world: exchange, fusion, compression,
  update rules) and the model axes automatic (`jax.shard_map(..., axis_names=<data axes>)`):
  inside the step every array is whole over the model axes, and GSPMD lays out each
  parameter as annotated and inserts the collectives, as `jax.jit` would. flax's own
  layers (MultiHeadAttention, LayerNorm, Embed, a row-split Linear with its bias) compute
  what they compute on one device; dpjax.nn's parallel layers are their dense selves.
- "explicit": every axis manual; each device sees its block of each parameter, and the
  layers must be written for that (dpjax.nn's parallel layers, `copy_to_model` /
  `reduce_from_model`). Faster where it matters (see the README's figures), and the only
  way for hand-written collectives over "model".

The default is "explicit" where the model holds dpjax.nn parallel layers or an `in_specs`
names a model axis (code written for shard_map), "auto" where only annotations do.
"""

from __future__ import annotations

import re
import sys
import warnings

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import data_axes, spec_axes
from dpjax.wrap.checks import SingleDeviceWarning

LAYOUTS = ("auto", "explicit")


class LayoutWarning(SingleDeviceWarning):
    """A layout that is not the one the model was written for (another mesh, no model axis)."""


def _annotation(var):
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    return meta.get("out_sharding") or meta.get("sharding")


def spec_of(var) -> P:
    """The PartitionSpec of an nnx.Variable's annotation, whatever its form (P() if none)."""
    from flax.nnx import spmd  # here: `import dpjax` does not import flax (an NNX Variable's caller has)

    found = _annotation(var)
    if isinstance(found, NamedSharding):
        return found.spec
    return spmd.get_var_pspec(var)  # tuples, PartitionSpecs, logical names with their rules


def annotated_mesh(var):
    """The mesh the Variable was made on: its NamedSharding annotation's, else that of the
    array flax placed when it made it under `jax.set_mesh` (None: neither)."""
    found = _annotation(var)
    if isinstance(found, NamedSharding):
        return found.mesh
    placed = getattr(getattr(var, "get_value", lambda: None)(), "sharding", None)
    return placed.mesh if isinstance(placed, NamedSharding) and _annotation(var) is not None else None


def _is_box(x) -> bool:
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


def box_specs(tree, mesh_axes, unmapped: list | None = None) -> list | None:
    """A PartitionSpec per leaf of a pytree holding Linen boxes (`nn.with_partitioning`,
    `nn.with_logical_partitioning`; logical names mapped by the `nn.logical_axis_rules` in
    force), or None if it holds none. unmapped: gets the logical names of each box that no
    rule in force maps (flax then leaves the parameter whole, silently: `warn_model_unsplit`)."""
    if not any(_is_box(x) for x in jax.tree.leaves(tree, is_leaf=_is_box)):
        return None
    from flax import linen as nn  # here: `import dpjax` does not import flax (only a tree of its boxes needs it)

    def one(x):
        if not _is_box(x):
            return [P()] * len(jax.tree.leaves(x))
        spec = x.get_partition_spec()
        if any(a not in mesh_axes for a in spec_axes(spec)):
            if unmapped is not None and not nn.get_logical_axis_rules():
                unmapped.append(tuple(a for a in spec_axes(spec) if a not in mesh_axes))
            spec = nn.logical_to_mesh_axes(tuple(spec))
        return [spec] * len(jax.tree.leaves(x))

    return [s for group in jax.tree.leaves(jax.tree.map(one, tree, is_leaf=_is_box), is_leaf=_is_specs)
            for s in group]


def _is_specs(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, P) for s in x)


def model_axes(mesh) -> tuple:
    """The mesh's axes that are not data axes (model, stage, or any the data axes exclude)."""
    data = data_axes(mesh)
    return tuple(a for a in mesh.axis_names if a not in data)


def choose(layout, mesh, specs, explicit_hint: bool) -> str:
    """'auto' or 'explicit' (see the module docstring) for a step whose leaves have `specs`."""
    if layout is not None:
        return layout
    names = model_axes(mesh)
    annotated = any(a in names for s in specs for a in spec_axes(s))
    return "auto" if annotated and not explicit_hint and data_axes(mesh) else "explicit"


def automatic(mesh) -> set:
    """The mesh's axes of type Auto (GSPMD's; `jax.make_mesh`'s default type is Explicit:
    sharding in the arrays' types, which a sharding constraint may not name)."""
    return {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Auto}


def only(spec: P, axes) -> P:
    """`spec` with every mesh axis not in `axes` dropped (a dimension left with none: None;
    P.UNCONSTRAINED stays)."""
    def keep(e):
        if e is P.UNCONSTRAINED:
            return e
        kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a is not None and a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*[keep(e) for e in spec])


def renamed(spec: P, axes: dict) -> P:
    """`spec` with the mesh axis names of `axes` (the user's -> dpjax's) replaced."""
    if not axes:
        return spec
    name = lambda e: tuple(axes.get(a, a) for a in e) if isinstance(e, tuple) else axes.get(e, e)  # noqa: E731
    return P(*[None if e is None else name(e) for e in spec])


def renamed_mesh(mesh, axes: dict, step: str):
    """The same devices with the user's axis names mapped to dpjax's ({"tp": "model"})."""
    unknown = [a for a in axes if a not in mesh.axis_names]
    names = tuple(axes.get(a, a) for a in mesh.axis_names)
    if unknown or len(set(names)) < len(names):
        why = (f"names {unknown[0]!r}, not an axis of the mesh" if unknown else
               f"gives two axes one name ({', '.join(names)})")
        raise UserError(f"{step}: axes={axes} {why} {dict(mesh.shape)}; map each of your axis names to one of "
                        "dpjax's ('data', 'model', 'node', 'stage')")
    return Mesh(mesh.devices, names, axis_types=mesh.axis_types)


def warn_other_mesh(step: str, meshes, mesh, axes: dict | None = None) -> None:
    """Said once a step: the annotations' NamedShardings name a mesh other than the step's."""
    shape = lambda m: {(axes or {}).get(a, a): n for a, n in m.shape.items()}  # noqa: E731
    other = next((m for m in meshes if m is not None and shape(m) != dict(mesh.shape)), None)
    if other is not None:
        warnings.warn(f"dpjax: {step}: the model was made on the mesh {dict(other.shape)}, and shard_step lays it "
                      f"out on {dict(mesh.shape)} instead (its annotations' axes, this mesh's sizes)", LayoutWarning,
                      stacklevel=4)


def warn_no_model_axis(step: str, mesh, whole) -> None:
    """Said once a step: annotations over a model axis the mesh lacks leave those layers
    whole. whole: (parameter name, the axis it names) pairs."""
    if whole:
        name, axis = whole[0]
        warnings.warn(f"dpjax: {step}: the mesh {dict(mesh.shape)} has no {axis!r} axis, so the {len(whole)} "
                      f"parameters annotated over it ({name} first) stay whole on every device; add the axis to the "
                      "mesh to split them", LayoutWarning, stacklevel=4)


def warn_model_unsplit(step: str, mesh, specs, unmapped) -> None:
    """Said once a step: the mesh has a model axis of more than one device and no argument is
    split over it, so each of its devices computes the whole model (the state's annotations were
    lost: unboxed with `nn.meta.unbox`, or logical names without the rules that map them)."""
    names = [a for a in model_axes(mesh) if mesh.shape[a] > 1]
    if not names or any(a in names for s in specs for a in spec_axes(s)):
        return
    where = f"the mesh's {names[0]!r} axis of {mesh.shape[names[0]]} devices splits no parameter"
    if unmapped:
        logical = sorted({a for names_ in unmapped for a in names_})
        why = (f"the parameters carry logical axis names ({', '.join(map(repr, logical))}) but no "
               "nn.logical_axis_rules are in force to map them; call the step inside `with "
               "nn.logical_axis_rules(RULES):` (or nnx.logical_axis_rules)")
    else:
        why = ("no sharding annotation reached the step (parameters unboxed with nn.meta.unbox, or made without "
               "nn.with_partitioning / nnx.with_partitioning?); keep the boxes, or pass in_specs, or use a mesh "
               "without the axis")
    warnings.warn(f"dpjax: {step}: {where}, so every device on it computes the whole model: {why}", LayoutWarning,
                  stacklevel=4)


def explicit_axes(step: str, error: Exception, mesh) -> str:
    """One line for JAX's sharding-type error under a mesh with Explicit axes (`jax.make_mesh`'s
    default): there every matmul over a split dimension must name its output's sharding, which
    code written for jax.jit's GSPMD (flax's layers) does not."""
    explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit]
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not explicit:
        return f"{step}: {first}"
    n = len(mesh.axis_names)
    return (f"{step}: the mesh's {', '.join(map(repr, explicit))} axes are Explicit (jax.make_mesh's default), so JAX "
            f"asks each operation over a split dimension for its output's sharding ({first.split('. ')[0][:160]}); "
            f"make the mesh with axis_types=(jax.sharding.AxisType.Auto,) * {n}, as code written for jax.jit's "
            "sharding propagation expects, or give those operations out_sharding=")


_SHAPE = re.compile(r"\((\d+(?:, ?\d+)*),?\)|\[(\d+(?:, ?\d+)*)\]")


def _shapes_in(text: str) -> set:
    return {tuple(int(d) for d in (a or b).replace(" ", "").split(",")) for a, b in _SHAPE.findall(text)}


def explain(step: str, error: Exception, leaves, meta, mesh, layout: str, traced: bool) -> str | None:
    """One line for an error raised by a step's call (None: the error stays as it is): a
    sharding constraint that cannot apply here, or, while the step is first traced, the
    parameter the error most likely came from (`traced_error`)."""
    if "with_sharding_constraint" in str(error):  # JAX's own message suggests `reshard`, which does not apply
        # reached only by a constraint bound to a name of its own before the trace (`constraints`)
        early = ("shard_step reads a constraint called as jax.lax.with_sharding_constraint, but this one was "
                 "imported under a name of its own (from jax.lax import ...) before the step was traced")
        if layout == "auto":
            return (f"{step}: with_sharding_constraint inside shard_step names a data axis "
                    f"({', '.join(data_axes(mesh))}), which is manual here (each device holds its own rows); {early}: "
                    "call it as jax.lax.with_sharding_constraint, or write None for the data axes (P(None, 'model') "
                    "for P('data', 'model'))")
        return (f"{step}: with_sharding_constraint inside shard_step: every mesh axis is manual here (each device "
                f"holds its own block, as in_specs and the parameters' sharding say); {early}: call it as "
                "jax.lax.with_sharding_constraint (it is passed over here: a GSPMD hint has nothing to constrain), "
                "or remove it")
    if "should match the mesh of sharding" in str(error):  # a NamedSharding of the user's mesh, used inside
        at = re.search(r"passed to (\S+?)\.? This error occurs at source:\s*(.+)$", str(error), re.S)
        where = f" ({at.group(1)} at {at.group(2).strip()})" if at else ""
        return (f"{step}: a NamedSharding of the user's mesh reached an operation inside the step{where}, whose mesh "
                f"is the step's {dict(mesh.shape)} with its data axes manual: a sharding constraint bound before the "
                "trace (from jax.lax import with_sharding_constraint) is JAX's own; call it as "
                "jax.lax.with_sharding_constraint, which shard_step reads, or pass it a PartitionSpec with None for "
                "the data axes")
    return traced_error(step, error, leaves, meta, mesh, layout) if traced else None


def traced_error(step: str, error: Exception, leaves, meta, mesh, layout: str) -> str | None:
    """One line for an error raised while tracing `step`: the parameter it most likely came
    from (one whose local block's shape the message names, else the first split over a
    model axis), its annotation, its block and the mesh. None where no leaf is split over a
    model axis (the error is the user's own, and stays as it is)."""
    names = model_axes(mesh)
    split = [(x, m) for x, m in zip(leaves, meta)
             if any(a in names and mesh.shape[a] > 1 for a in spec_axes(m.spec))]
    if not split:
        return None
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    seen = _shapes_in(str(error))
    local = lambda x, m: tuple(NamedSharding(mesh, m.spec).shard_shape(x.shape))  # noqa: E731
    x, m = next(((x, m) for x, m in split if layout == "explicit" and local(x, m) in seen), split[0])
    why = ("each device sees its own block of every parameter split over a model axis, and flax's own layers need "
           "them whole: leave model_axes to shard_step (\"auto\", the default for a model without dpjax.nn layers) "
           "or use dpjax.nn's parallel layers" if layout == "explicit" else
           "the model axes are automatic here (GSPMD lays the model out), so the step cannot name them in "
           "collectives: pass model_axes=\"explicit\" to shard_step for code written for shard_map")
    return (f"{step}: {type(error).__name__} while tracing the step, at {m.name} annotated {tuple(m.spec)}: "
            f"{tuple(x.shape)} whole, {local(x, m)} on each device of the mesh {dict(mesh.shape)} "
            f"({layout} model axes); {why} (JAX said: {text})")
