"""Device meshes with named parallel axes.

A mesh spec is a short string a user types on the command line:

    "8"               -> data=8, model=1           axes ("data", "model")
    "2x4"             -> data=2, model=4           axes ("data", "model")
    "2x2x2"           -> node=2, data=2, model=2   axes ("node", "data", "model")
    "data=2,model=4"  -> the axes named explicitly (names from `AXES`, in that order)
    "-1x2"            -> one -1 is inferred from the device count

Devices are laid out process-major (sorted by process index, then id), so the
outermost axis (`node` for three-axis specs) varies slowest and crosses process
boundaries first: an inner axis stays inside one process or host where possible.
"""

from __future__ import annotations

import difflib
import math
import os
import re

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dpjax import env
from dpjax.errors import UserError

DATA = "data"
MODEL = "model"
NODE = "node"
STAGE = "stage"
CONTEXT = "context"  # splits each sequence (dpjax.compute.context): parameters replicated, the batch's rows not split
EXPERT = "expert"  # a data axis that also splits a mixture of experts' experts (dpjax.models.moe)
# axes that do not split the batch's rows (the model's, the sequence's); every other axis splits the batch
NOT_DATA = (MODEL, STAGE, CONTEXT)
# Every axis name a mesh may have: the one list, which a new axis joins. An unknown name
# is refused rather than taken for a data axis (`data_axes` counts every name but
# NOT_DATA as one, so `modle=4` trained as 4 more data ranks).
AXES = (NODE, DATA, MODEL, STAGE, CONTEXT, EXPERT)

_DEFAULT_NAMES = {1: (DATA, MODEL), 2: (DATA, MODEL), 3: (NODE, DATA, MODEL)}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class MeshError(UserError):
    """A mesh spec that does not fit the devices."""


def parse_mesh_spec(spec: str, num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Parses a mesh spec into (axis names, axis sizes) for `num_devices` devices.

    Raises MeshError (a ValueError) naming the spec and the device count when it does not fit.
    """
    text = str(spec).strip()

    def bad(why: str) -> MeshError:
        return MeshError(f"mesh spec {spec!r} {why} ({num_devices} devices available)")

    if not text:
        raise bad("is empty; use e.g. '2x4' or 'data=2,model=4'")
    if "=" in text:
        names, raw = [], []
        for part in text.split(","):
            name, eq, size = part.partition("=")
            name, size = name.strip(), size.strip()
            if not eq or not _NAME_RE.match(name) or not size:
                raise bad("is not of the form 'name=size,name=size'")
            names.append(name)
            raw.append(size)
        if len(set(names)) != len(names):
            raise bad("names an axis twice")
        unknown = next((n for n in names if n not in AXES), None)
        if unknown is not None:
            close = difflib.get_close_matches(unknown, AXES, n=1)
            raise bad(f"names an unknown axis {unknown!r}" + (f" (did you mean {close[0]}?)" if close else "")
                      + f"; the axes are {', '.join(AXES)}")
    else:
        raw = [s.strip() for s in text.lower().split("x")]
        if len(raw) not in _DEFAULT_NAMES:
            raise bad("must have 1 to 3 sizes separated by 'x' (e.g. '8', '2x4', '2x2x2')")
        names = list(_DEFAULT_NAMES[len(raw)])
    try:
        sizes = [int(s) for s in raw]
    except ValueError:
        raise bad("has a size that is not an integer") from None
    if sizes.count(-1) > 1:
        raise bad("has more than one -1; only one axis size can be inferred")
    if any(s == 0 or s < -1 for s in sizes):
        raise bad("has an axis size below 1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise bad(f"cannot infer -1: {num_devices} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = num_devices // known
    if len(sizes) == 1 and "=" not in text:
        sizes.append(1)  # "8" means pure data parallelism with a model axis of 1
    total = math.prod(sizes)
    if total != num_devices:
        raise bad(f"needs {total} devices")
    return tuple(names), tuple(sizes)


def mesh_size(spec: str) -> int | None:
    """Devices a spec needs, or None when it has a -1 (it then takes what there is)."""
    text = str(spec)
    raw = [p.partition("=")[2] for p in text.split(",")] if "=" in text else text.lower().split("x")
    try:
        sizes = [int(s) for s in raw]
    except ValueError:
        return None
    if -1 in sizes or any(s < 1 for s in sizes):
        return None
    return math.prod(sizes)


def make_mesh(spec: str, devices=None):
    """Builds a `jax.sharding.Mesh` from a spec such as "2x4" (see the module docstring).

    `devices` defaults to every device of every process; the spec must use exactly
    that many (pass `jax.devices()[:k]` for a mesh over a subset).
    """
    devs = list(jax.devices() if devices is None else devices)
    names, sizes = parse_mesh_spec(spec, len(devs))
    devs.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devs, dtype=object).reshape(sizes), names)


def data_axes(mesh) -> tuple[str, ...]:
    """The axes the batch is split over: every axis but `model`, `stage` and `context`, outermost first."""
    return tuple(a for a in mesh.axis_names if a not in NOT_DATA)


def dp_size(mesh) -> int:
    """Data-parallel ranks: the product of the data axes' sizes. Horovod's `hvd.size()`
    (one rank per GPU), so `lr * dp_size(mesh)` is Horovod's scaling idiom. Not the
    number of processes (`dpjax.process_count()`), which is smaller when a process
    drives several devices."""
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def parse_axes(text, mesh, what: str = "--workers") -> tuple[str, ...]:
    """'node' or 'node,data' -> those data axes of `mesh`, in the mesh's order; '' -> ().
    Raises MeshError (one line) for a name that is not a data axis of the mesh."""
    names = [a.strip() for a in str(text).split(",") if a.strip()] if isinstance(text, str) else list(text)
    axes = data_axes(mesh)
    for a in names:
        if a not in axes:
            raise MeshError(f"{what} {text!r}: {a!r} is not a data axis of mesh {dict(mesh.shape)}; "
                            f"choose from {', '.join(axes) or '(none)'}")
    if len(set(names)) != len(names):
        raise MeshError(f"{what} {text!r} names an axis twice")
    return tuple(a for a in axes if a in names)


def as_axes(axis_name) -> tuple[str, ...]:
    """An axis argument or a PartitionSpec entry as a tuple of axis names: None or () ->
    (), 'data' -> ('data',), ('node', 'data') as is."""
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def is_spec(x) -> bool:
    """Whether `x` is a PartitionSpec (the leaf of a tree of specs)."""
    return isinstance(x, PartitionSpec)


def spec_axes(spec) -> tuple:
    """Every mesh axis a PartitionSpec splits a dimension over, in the spec's order."""
    return tuple(a for e in spec for a in as_axes(e))


def bound(axis) -> bool:
    """Whether every name of `axis` (one name or a tuple; None: no axis) is bound where the
    code runs: inside a shard_map over it (or a vmap naming it). Elsewhere (one device,
    `jax.jit` under `jax.set_mesh`) arrays are whole, and a collective over the axis would
    fail deep inside JAX with `NameError: unbound axis name`."""
    names = as_axes(axis)
    try:
        for name in names:
            lax.axis_size(name)
    except NameError:
        return False
    return bool(names)


def spanning(axes) -> tuple[str, ...]:
    """The names among `axes` whose size is more than 1 where the code runs (inside a
    shard_map over them): a collective over the others moves nothing, yet XLA keeps an
    all-reduce of one participant in the program (a kernel and a sync on a GPU)."""
    return tuple(a for a in as_axes(axes) if lax.axis_size(a) > 1)


def axis_arg(axes: tuple):
    """The axis argument collectives take: one name, or a tuple for several."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def local_shape(shape, spec, mesh) -> tuple[int, ...]:
    """The shape of one device's block of a global array of `shape` laid out by `spec`
    on `mesh` (what a shard_map body sees, and asserts)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(n // math.prod(mesh.shape[a] for a in as_axes(e)) for n, e in zip(shape, entries))


# XLA flags a run on GPUs gets unless the user's XLA_FLAGS already names them (JAX's GPU
# performance guide and NVIDIA's JAX-Toolbox set the same): the latency-hiding scheduler
# moves collectives to overlap the compute around them. They shape only the GPU backend.
GPU_XLA_FLAGS = {"--xla_gpu_enable_latency_hiding_scheduler": "true"}


def recommended_xla_flags() -> list[str]:
    """Adds `GPU_XLA_FLAGS` to XLA_FLAGS where the user did not set them (theirs win:
    `--xla_gpu_enable_latency_hiding_scheduler=false` turns it off; DPJAX_XLA_FLAGS=0 adds
    none). Must run before JAX initialises its backends. Returns the flags it added."""
    if env.value("DPJAX_XLA_FLAGS") == "0":
        return []
    flags = os.environ.get("XLA_FLAGS", "")
    added = [f"{k}={v}" for k, v in GPU_XLA_FLAGS.items() if k not in flags]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added
