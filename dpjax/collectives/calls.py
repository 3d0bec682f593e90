"""The public collective calls (`dpjax.collectives` re-exports them): the checks every
call starts with (`_prepare`), the named scope, and the dispatch through the registry to
the algorithm that registered itself. Its own module, not the package face, so that the
algorithms that call a collective themselves (`grouped`, `hierarchical`) import it without
an import circle through the package."""

from __future__ import annotations

import functools
import inspect
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import distributed, links, scopes
from dpjax.collectives import adasum, ops, registry, uneven
from dpjax.collectives import groups as process_sets
from dpjax.collectives.ranks import axis_size, split_dim0

ALGORITHMS = registry.Names("allreduce")
REDUCE_SCATTER_ALGORITHMS = registry.Names("reduce_scatter")
ALL_GATHER_ALGORITHMS = registry.Names("all_gather")
BROADCAST_ALGORITHMS = registry.Names("broadcast")
ALL_TO_ALL_ALGORITHMS = registry.Names("all_to_all")

def check_algorithm(algorithm: str, known=ALGORITHMS, what: str = "allreduce") -> str:
    """`algorithm` if it is one of `known` (a registry view), else a one-line ValueError."""
    if algorithm not in known:
        raise ValueError(f"unknown {what} algorithm {algorithm!r}; choose one of {', '.join(known)}")
    return algorithm


def _mesh_ordered(axis_name, what: str, reorder: bool):
    """A tuple of axes in the mesh's order. ppermute numbers the ranks of a tuple of
    axes in mesh order while lax.axis_index follows the tuple's order, so a schedule
    over an out-of-order tuple would send to the wrong ranks. A sum does not care
    about the order (`reorder`); a scatter, gather, root or group does, so it must be
    given in mesh order."""
    if not isinstance(axis_name, (tuple, list)):
        return axis_name
    names = jax.sharding.get_abstract_mesh().axis_names
    if any(a not in names for a in axis_name):
        return tuple(axis_name)  # an unbound axis: axis_size has said so already
    ordered = tuple(sorted(axis_name, key=names.index))
    if ordered != tuple(axis_name) and not reorder:
        raise ValueError(f"{what} over axes {tuple(axis_name)}: give them in the mesh's order {ordered}")
    return ordered


def _shown(value) -> str:
    return "<traced>" if isinstance(value, jax.core.Tracer) else repr(value)


def _prepare(what, x, axis_name, algorithm, *, groups=None, reorder=False, **args):
    """The steps every public call starts with: the axis must be bound; every process
    must be making this same call (`distributed.agree`, before any other check, so that
    a call one process gets wrong fails on every process); the algorithm must implement
    `what` and the groups must exist. Returns (the registered algorithm, axis in mesh
    order, n, validated groups or None)."""
    n = axis_size(axis_name, what)
    shown = ", ".join(f"{k}={_shown(v)}" for k, v in dict(algorithm=algorithm, groups=groups, **args).items()
                      if v is not None)
    distributed.agree(what, f"{what}({x.dtype}{list(x.shape)} over {axis_name!r}, {shown})")
    check_algorithm(algorithm, registry.Names(what), what)
    alg = registry.get(algorithm)
    if groups is not None:
        if not alg.groups:
            explicit = ", ".join(a for a in registry.names(what) if registry.get(a).groups)
            raise ValueError(f"{what}: algorithm {algorithm!r} takes no groups (process sets); choose one of "
                             f"{explicit}")
        groups = process_sets.check_groups(groups, n, what, partition=what not in ("allreduce", "broadcast"))
    if not alg.nested_axes:
        axis_name = _mesh_ordered(axis_name, what, reorder=reorder and groups is None)
    return alg, axis_name, n, groups


def _local(out, shape, what: str, algorithm: str):
    """`out`, asserted to be the block of the result its algorithm owes this device, whose
    shape follows from the block the device gave (`shape`): every algorithm's result
    passes here, where the blocks are local (DESIGN.md: the scaling book's habit)."""
    assert out.shape == tuple(shape), f"{what} {algorithm!r} returned a {out.shape} block, not {tuple(shape)}"
    return out


def _within(groups, fn, x, axis_name, n):
    return fn(x, axis_name) if groups is None else process_sets.run(fn, x, axis_name, groups, n)


def _group_size(groups, n: int, axis_name):
    """This rank's group size: an int if every rank's is the same, else traced (a rank
    in no group is a group of one)."""
    if groups is None:
        return n
    size = [1] * n
    for g in groups:
        for r in g:
            size[r] = len(g)
    return size[0] if len(set(size)) == 1 else jnp.asarray(size)[lax.axis_index(axis_name)]


def _named(what: str):
    """The call traces under `dpjax:<what>(algorithm=,axis=,n=,bytes=)` (`dpjax.scopes`), so
    that `dpjax.timeline` finds its ops and numbers its point-to-point steps. Trace-time
    only: a named scope changes the ops' metadata, not the program."""
    def decorate(collective):
        default = inspect.signature(collective).parameters["algorithm"].default

        @functools.wraps(collective)
        def wrapper(x, axis_name, *args, **kwargs):
            try:
                label = _label(what, x, axis_name, kwargs.get("algorithm", default), kwargs.get("groups"))
            except (ValueError, TypeError):  # not a collective that can run: let it say why
                return collective(x, axis_name, *args, **kwargs)
            with scopes.collective(what, **label):
                return collective(x, axis_name, *args, **kwargs)

        return wrapper

    return decorate


def _label(what, x, axis_name, algorithm, groups) -> dict:
    n = len(groups[0]) if groups else axis_size(axis_name, what)
    nbytes = math.prod(jnp.shape(x)) * jnp.dtype(jnp.result_type(x)).itemsize
    # nccl-tests' size S: the gathered result for all_gather, else the whole input
    return {"algorithm": algorithm, "axis": axis_name, "n": n, "bytes": nbytes * (n if what == "all_gather" else 1)}


@_named("allreduce")
@links.timed
def allreduce(x, axis_name, *, algorithm: str = "ring", op: str = "sum", prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, groups=None, **options):
    """`x` reduced with `op` over `axis_name` (within each group of `groups`), on every rank.

    op: sum, mean, min, max, product, or adasum (with algorithm="butterfly": Adasum has
    its own butterfly). options: `num_servers` for "ps"; `outer_algorithm` for
    "hierarchical"; `segments` for adasum (sizes of the tensors in a fused buffer).
    """
    x = jnp.asarray(x)
    alg, axis_name, n, groups = _prepare("allreduce", x, axis_name, algorithm, groups=groups, reorder=True,
                                         op=op, prescale=prescale_factor, postscale=postscale_factor, **options)
    ops.check(op, x.dtype, "allreduce", prescale_factor, postscale_factor)
    if op == "adasum" and algorithm != "butterfly":
        raise ValueError(f"allreduce op='adasum' runs Adasum's own butterfly (Maleki et al.): pass "
                         f"algorithm='butterfly', not {algorithm!r}")
    fn = adasum.allreduce if op == "adasum" else alg.allreduce
    out = _within(groups, lambda v, ax: fn(v, ax, op=op, **options), ops.scale(x, prescale_factor), axis_name, n)
    _local(out, x.shape, "allreduce", algorithm)
    size = _group_size(groups, n, axis_name)
    if isinstance(size, int):
        return ops.finish(out, op, size, postscale_factor)
    result = out  # groups of several sizes: each rank finishes with its own
    for k in sorted({len(g) for g in groups} | {1}):
        result = jnp.where(size == k, ops.finish(out, op, k, postscale_factor), result)
    return result


@_named("reduce_scatter")
@links.timed
def reduce_scatter(x, axis_name, *, algorithm: str = "ring", op: str = "sum", prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, sizes=None, groups=None):
    """Like `lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`, with `op`.

    sizes: rows per rank when they differ (see `uneven.py`); groups: process sets of one size."""
    x = jnp.asarray(x)
    alg, axis_name, n, groups = _prepare("reduce_scatter", x, axis_name, algorithm, groups=groups, op=op,
                                         sizes=sizes, prescale=prescale_factor, postscale=postscale_factor)
    ops.check(op, x.dtype, "reduce_scatter", prescale_factor, postscale_factor)
    if op == "adasum":
        raise ValueError("reduce_scatter has no op 'adasum' (Adasum combines whole vectors); use allreduce")
    k = _group_size(groups, n, axis_name)
    if sizes is not None:
        x = uneven.pad_blocks(x, uneven.check_sizes(sizes, k, "reduce_scatter"))
    split_dim0(x, k, "reduce_scatter", " (or give sizes=[rows of each rank])")
    x = ops.scale(x, prescale_factor)
    out = _within(groups, lambda v, ax: alg.reduce_scatter(v, ax, op=op), x, axis_name, n)
    _local(out, (x.shape[0] // k, *x.shape[1:]), "reduce_scatter", algorithm)
    return ops.finish(out, op, k, postscale_factor)


@_named("all_gather")
@links.timed
def all_gather(x, axis_name, *, algorithm: str = "ring", sizes=None, groups=None):
    """Like `lax.all_gather(x, axis_name, axis=0, tiled=True)`.

    sizes: rows of each rank (allgatherv; x holds max(sizes) rows, see `uneven.py`);
    groups: process sets of one size."""
    x = jnp.asarray(x)
    alg, axis_name, n, groups = _prepare("all_gather", x, axis_name, algorithm, groups=groups, sizes=sizes)
    if x.ndim == 0:
        raise ValueError("all_gather is tiled on dimension 0 and needs an array with one; got a scalar "
                         "(reshape it to (1,))")
    if sizes is not None:
        sizes = uneven.check_sizes(sizes, _group_size(groups, n, axis_name), "all_gather")
        uneven.check_gather_input(x, sizes)
    out = _within(groups, alg.all_gather, x, axis_name, n)
    k = _group_size(groups, n, axis_name)
    _local(out, (k * x.shape[0], *x.shape[1:]) if isinstance(k, int) else out.shape, "all_gather", algorithm)
    return out if sizes is None else uneven.cut_blocks(out, sizes)


@_named("broadcast")
@links.timed
def broadcast(x, axis_name, *, root: int = 0, algorithm: str = "tree", groups=None):
    """Every rank along `axis_name` ends with the value `root` holds (any dtype, kept).

    With groups, root is a position inside each group (0: each group's first member)."""
    x = jnp.asarray(x)
    alg, axis_name, n, groups = _prepare("broadcast", x, axis_name, algorithm, groups=groups, root=root)
    try:
        root = operator.index(root)
    except TypeError:
        raise ValueError(f"broadcast root must be a static Python int (the rank holding the value), got "
                         f"{_shown(root)} of type {type(root).__name__}: a root computed inside the step "
                         f"cannot choose the schedule") from None
    k = n if groups is None else min(map(len, groups))
    if not 0 <= root < k:
        raise ValueError(f"broadcast root {root} is outside the " + (
            f"axis of size {n}" if groups is None else f"smallest group, of size {k}"))
    return _local(_within(groups, lambda v, ax: alg.broadcast(v, ax, root=root), x, axis_name, n), x.shape,
                  "broadcast", algorithm)


@_named("all_to_all")
@links.timed
def all_to_all(x, axis_name, *, algorithm: str = "pairwise", groups=None):
    """Like `lax.all_to_all(x, axis_name, 0, 0, tiled=True)`: block j of dimension 0
    goes to rank j (within each group), and block i of the result came from rank i."""
    x = jnp.asarray(x)
    alg, axis_name, n, groups = _prepare("all_to_all", x, axis_name, algorithm, groups=groups)
    split_dim0(x, _group_size(groups, n, axis_name), "all_to_all")
    return _local(_within(groups, alg.all_to_all, x, axis_name, n), x.shape, "all_to_all", algorithm)
