"""The plan's workers: which data axes the update rule's workers span, which axes a
compressed exchange crosses, and the exchange's per-shard form on a mesh. Part of
`dpjax.plan` (`resolve` asks here); each refusal is one line saying what to change."""

from __future__ import annotations

import math

from dpjax.compression import Exchange
from dpjax.compression.shards import Shards
from dpjax.mesh import data_axes, parse_axes
from dpjax.plan.checks import UsageError
from dpjax.settings import Settings


def workers_of(s: Settings, mesh, update, exchange: Exchange) -> tuple[tuple, tuple | None]:
    """(the worker axes, the compressed axes or None). A compression with error feedback
    compresses the exchange between workers (each worker keeps its error buffer), so
    with no --workers every data rank is a worker; --compress-axes makes its axes the
    workers (synchronous and exact inside each)."""
    given = None if s.workers is None else parse_axes(s.workers, mesh)
    if s.compress_axes is None:
        if given is not None:
            return given, None
        # FSDP (plan.check let only a linear method through) reduce-scatters compressed instead
        return default_workers(mesh, not update.is_sync or exchange.per_worker(s.fsdp)), None
    axes = parse_axes(s.compress_axes, mesh, "--compress-axes")
    if exchange.compression is None:
        raise UsageError(f"--compress-axes {s.compress_axes} needs a --compression")
    if given is not None and given != axes:
        raise UsageError(f"--compress-axes {s.compress_axes} compresses the exchange between workers: name the same "
                         f"axes in --workers (got {s.workers}), or leave --workers out")
    if s.fsdp and axes == data_axes(mesh):
        raise UsageError(f"--fsdp with --compress-axes {s.compress_axes}: FSDP splits over the data axes inside a "
                         "worker, and these are all of them; compress fewer (e.g. node)")
    return axes, axes


def shards_of(s: Settings, mesh, compress_axes):
    """The per-shard form settings `s` give on `mesh` (None with --compress-whole, or under
    FSDP, whose exchange is per shard already)."""
    return None if s.compress_whole or s.fsdp else per_shard(mesh, compress_axes)


def per_shard(mesh, compress_axes):
    """The per-shard form of the compressed exchange between the workers `compress_axes`
    (`dpjax.compression.shards`): each device of a worker sends its 1/k shard across, k
    the worker's devices on the other data axes; None without --compress-axes or for k = 1."""
    if not compress_axes:
        return None
    inner = tuple(a for a in data_axes(mesh) if a not in compress_axes)
    k = math.prod(mesh.shape[a] for a in inner)
    return Shards(inner, k, tuple(a for a in mesh.axis_names if a not in compress_axes)) if k > 1 else None


def default_workers(mesh, per_worker: bool) -> tuple:
    """The worker axes when none are named: every data axis for rules whose workers
    diverge (each data-parallel rank a worker), none for sync (one synchronous group:
    FSDP then splits over every data axis, ZeRO-3)."""
    return data_axes(mesh) if per_worker else ()
