"""`check="reference"`: a step's first call run also as one device would run it, and compared.

The replica check (`dpjax.wrap.replicas`) sees copies that disagree. A sharded step can also
agree with itself and compute something else: a loss divided by each device's own count of
tokens (`sum(loss * w) / sum(w)` over this device's rows), then averaged; a mean taken over
this device's rows where the global batch's was meant. Every device does the same wrong thing,
the copies agree, the run trains, on another objective.

So, under `check="reference"` (or `DPJAX_CHECK=reference`), the step's first call runs twice:
first as the same step on a mesh of one device with the same axis names (every axis of size 1:
the collectives are identities, `DistributedOptimizer` averages one gradient, the whole global
batch and state on that device: the unsharded function), then as itself. The outputs and the
new state (the NNX objects' updated state, written back only by the sharded run) are compared
leaf by leaf; a leaf that differs by more than round-off stops the run with one line naming
it, how far apart, and the likely cause. Round-off is measured per leaf: the one-device run
is made twice, the second time on every float32 input nudged by NUDGE, and a leaf may differ
by SLACK times what the nudge moved it (Adam's first step on a gradient that is 0 but for
round-off moves a parameter by a full step of either sign: the nudge moves it as far).
Under `shard_step` dropout draws per device, so a step with dropout on differs from its
reference by design: check it with dropout off (under `dpjax.jit` the masks are one device's:
`dpjax.wrap.draws`).
"""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dpjax.errors import UserError
from dpjax.mesh import data_axes, spec_axes
from dpjax.wrap import arguments
from dpjax.wrap.replicas import ENV, ReplicationError

WORD = "reference"
RTOL = 1e-4  # of the leaf's largest |value|: float32 round-off over a step, with room to spare
# The nudge of every float input in a second one-device run: 64 float32 round-offs, so the
# rounding of every sum changes, and 13 times under RTOL, so a well-conditioned leaf moves
# less than RTOL. A leaf that moves further is ill-conditioned (Adam's first step on a gradient
# that is 0 but for round-off: a bias before a normalisation); its tolerance is SLACK times how
# far the nudge moved it.
NUDGE = 2.0 ** -17
SLACK = 2.0


class ReferenceError(UserError):
    """The sharded step's result is not the one-device run's."""


def wanted(check) -> bool:
    return check == WORD or os.environ.get(ENV, "").strip() == WORD


def one_device_mesh(mesh, axes: dict) -> Mesh:
    """A mesh of the first device of `mesh`, every axis of size 1, with the user's axis names."""
    user = {v: k for k, v in axes.items()}
    names = tuple(user.get(a, a) for a in mesh.axis_names)
    return Mesh(np.array(mesh.devices.flat[:1]).reshape((1,) * len(names)), names, axis_types=mesh.axis_types)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(tree) -> dict:
    return {name: np.asarray(x) for name, x in tree.items() if isinstance(x, jax.Array) and not _is_key(x)}


def outputs(out) -> dict:
    return {arguments.path_name("output", p): x for p, x in jax.tree_util.tree_flatten_with_path(out)[0]}


def _nudged(x):
    """x times 1 + NUDGE where it is a float32 / float64 array (lower precisions round the nudge
    away; anything else is left as it is)."""
    if isinstance(x, (np.ndarray, jax.Array)) and x.dtype in (np.float32, np.float64) and not _is_key(x):
        return x * np.asarray(1 + NUDGE, x.dtype)
    return x


def run(reference, args, kwargs, nodes) -> tuple[tuple, tuple]:
    """The one-device runs of the call (args, kwargs): as given and nudged (every float32 input
    times 1 + NUDGE), each (its outputs, the new state of its NNX objects `nodes`) on the host,
    the NNX objects put back as they were (the sharded run then starts from the same state).
    The nudged run says how far round-off moves each leaf (see `compare`)."""
    nnx = arguments.flax_nnx()
    saved = [jax.tree.flatten(nnx.state(n)) for n in nodes]  # the arrays: nnx.state holds the Variables themselves
    keep = lambda x: arguments.has_nnx(x)  # noqa: E731  an NNX object's arrays are nudged through `nodes`
    nudged_args = [x if keep(x) else jax.tree.map(_nudged, x) for x in args]
    nudged_kwargs = {k: x if keep(x) else jax.tree.map(_nudged, x) for k, x in kwargs.items()}
    runs = []
    for a, k, nudge in ((args, kwargs, False), (nudged_args, nudged_kwargs, True)):
        if nudge:
            for n, (leaves, treedef) in zip(nodes, saved):
                nnx.update(n, treedef.unflatten([_nudged(x) for x in leaves]))
        # its own mesh in context (a `jax.set_mesh` around the user's call names the step's);
        # one CPU device, nothing split: true of a reference, and meant, so not said
        with warnings.catch_warnings(), jax.set_mesh(reference.mesh):
            warnings.simplefilter("ignore")
            out = reference(*a, **k)
        new = [jax.tree.leaves(nnx.state(n)) for n in nodes]
        for n, (leaves, treedef) in zip(nodes, saved):
            nnx.update(n, treedef.unflatten(leaves))
        runs.append((_host(outputs(out)), [np.asarray(x) if isinstance(x, jax.Array) and not _is_key(x) else x
                                           for leaves in new for x in leaves]))
    return tuple(runs)


def _split_over_data(x) -> bool:
    """Whether the array `x` is split over a data axis of more than one device: no two devices
    hold a copy of the same block there, so the replica check has nothing to compare."""
    if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
        return False
    sharding = x.sharding
    data = set(data_axes(sharding.mesh))
    return any(a in data and sharding.mesh.shape[a] > 1 for a in spec_axes(sharding.spec))


def compare(step: str, want: tuple[dict, list], out, nodes, names, replicas, unsplit_model=None) -> None:
    """Raises ReferenceError naming the leaf that differs most from the one-device run (see the
    module docstring). names: the NNX leaves' names, None for one not compared. replicas(names):
    the replica check of those leaves, run to tell a missing average (copies that differ across
    devices) from a value that is wrong alike everywhere. unsplit_model: a model axis of more
    than one device that splits no argument of the step (its annotations lost), else None."""
    (want_out, want_state), (nudged_out, nudged_state) = want
    arrays = outputs(out)
    got = _host(arrays)
    pairs = [(name, got[name], w, nudged_out[name]) for name, w in want_out.items() if name in got]
    split = {name for name, x in arrays.items() if _split_over_data(x)}
    if nodes:
        nnx = arguments.flax_nnx()
        now = jax.tree.leaves(nnx.state(tuple(nodes)))
        kept = [(name, x, w, v) for name, x, w, v in zip(names, now, want_state, nudged_state)
                if name is not None and isinstance(x, jax.Array) and not _is_key(x)]
        pairs += [(name, np.asarray(x), w, v) for name, x, w, v in kept]
        split |= {name for name, x, _, _ in kept if _split_over_data(x)}
    bad = []
    for name, g, w, v in pairs:
        if g.shape != w.shape or not np.issubdtype(w.dtype, np.inexact):
            if g.shape != w.shape or not np.array_equal(g, w):
                bad.append((np.inf, name, g, w))
            continue
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        gap = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
        moved = float(np.max(np.abs(v.astype(np.float64) - w))) if w.size else 0.0  # by the nudge
        if gap > max(RTOL * max(scale, 1e-3), SLACK * moved):
            bad.append((gap / max(scale, 1e-3), name, g, w))
    if not bad:
        return

    def copies_differ(name):
        try:
            replicas({name})
        except ReplicationError as e:
            return str(e)
        return None

    # a leaf wrong alike on every device first: the silent kind, which no other check sees
    ranked = sorted(((copies_differ(b[1]) is not None, -b[0], i) for i, b in enumerate(bad)))
    _, name, g, w = bad[ranked[0][2]]
    differ = copies_differ(name)
    gap = float(np.max(np.abs(g.astype(np.float64) - w))) if g.shape == w.shape else float("nan")
    others = [bad[r[2]][1] for r in ranked[1:]]
    more = f"; {len(others)} more differ ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" \
        if others else ""
    cause = _likely_cause(name, differ, unsplit_model, name in split)
    raise ReferenceError(f"{step}: check=\"reference\": {name} {tuple(w.shape)} differs from the one-device run of "
                         f"the same batch and state: max |difference| {gap:.3g} (largest |value| "
                         f"{float(np.max(np.abs(w))) if w.size else 0.0:.3g}){more}; likely cause: {cause}")


def _likely_cause(name: str, differ: str | None, unsplit_model: str | None, split: bool) -> str:
    """Why leaf `name` differs from the one-device run: copies that differ across devices (differ:
    the replica check's words), a model axis that splits no parameter, a leaf split over the data
    axes (no copies to compare), else the same wrong value on every device."""
    rows = ("a value of this device's rows was used as the global batch's: a loss normalised by this device's count "
            "(sum(loss * w) / sum(w): use dpjax.weighted_mean(loss, w), or divide by dpjax.global_sum(...)), or a mean "
            "over this device's rows where the batch's was meant")
    if differ:
        return f"the devices' copies differ: {differ}"
    elif unsplit_model is not None:  # every rank of the axis holds the whole weight its layers treat as a block
        return (f"the parameters are not split as annotated: the mesh's {unsplit_model!r} axis splits none of them "
                f"(boxes unboxed with nn.meta.unbox, or no in_specs), so each of its devices holds whole weights, "
                f"and a sum of partial products over {unsplit_model!r} (dpjax.compute.tensor_parallel."
                f"reduce_from_model, a row-parallel layer) adds the whole product once per device; keep the boxes, "
                f"or pass in_specs")
    elif split:  # no copies to agree or differ: each device its own block
        return (f"{name} is split over the data axes, so each device computed its own block, and no copies compare: "
                "a gradient not averaged over the data axes before this device's block was taken (jax.lax.pmean, "
                f"dpjax.allreduce_gradients), or {rows}")
    return f"the devices agree with one another and all differ from one device, so {rows}"
