"""A run's settings fitted to the devices there are: how many each process contributes, the
mesh resized for an elastic restart on fewer or more hosts, the global batch kept in more
or fewer micro-batches."""

from __future__ import annotations

import dataclasses
import math

from dpjax.distributed import transport
from dpjax.mesh import NOT_DATA, STAGE, mesh_size, parse_mesh_spec
from dpjax.plan.checks import UsageError
from dpjax.settings import Settings


def devices_per_process(s: Settings, processes: int) -> int | None:
    """How many devices each of `processes` processes contributes to the mesh (None:
    every device it has); the mesh must share out equally."""
    want = mesh_size(s.mesh) if s.mesh else None
    if want is not None and want % processes:
        raise UsageError(f"--mesh {s.mesh} has {want} devices, which {processes} processes cannot share equally")
    if processes > 1 and transport.chosen(s.collectives) == "mpi":  # an MPI rank is one device (transport.py)
        if want not in (None, processes):
            raise UsageError(f"--collectives mpi takes one CPU device per process (JAX's MPI collectives), and "
                             f"--mesh {s.mesh} gives each of {processes} processes {want // processes}: start "
                             f"{want} processes (mpirun -np {want}), or use --collectives gloo")
        return 1
    return None if want is None else want // processes


def fit_mesh(s: Settings, devices: int) -> Settings:
    """`s` with its mesh resized to `devices` devices (an elastic restart on fewer or more
    hosts): the outermost data axis takes what the other axes leave; every other setting,
    the global batch included, is kept (resolve then checks that this size can hold it).
    A spec with a -1 already takes what there is."""
    size = mesh_size(s.mesh) if s.mesh else None
    if not s.mesh or size is None or size == devices:
        return s
    names, sizes = parse_mesh_spec(s.mesh, size)
    outer = next((i for i, n in enumerate(names) if n not in NOT_DATA), None)
    others = math.prod(n for i, n in enumerate(sizes) if i != outer)
    if outer is None or devices % others:
        raise UsageError(f"--mesh {s.mesh} cannot be resized to {devices} devices: its non-data axes need a "
                         f"multiple of {others}")
    new = ",".join(f"{n}={devices // others if i == outer else v}" for i, (n, v) in enumerate(zip(names, sizes)))
    return dataclasses.replace(s, mesh=new)


def _data_ranks(spec: str) -> tuple[int, int | None]:
    """(data-parallel ranks, pipeline stages or None) of an explicit mesh spec."""
    size = mesh_size(spec)
    assert size is not None, f"{spec}: only a mesh of a known size is resized (fit_mesh)"
    names, sizes = parse_mesh_spec(spec, size)
    return math.prod(v for n, v in zip(names, sizes) if n not in NOT_DATA), dict(zip(names, sizes)).get(STAGE)


def fit_devices(s: Settings, devices: int) -> Settings:
    """`s` for `devices` devices (an elastic restart at the size that is left): the mesh
    resized (`fit_mesh`), and the global batch (--batch-size x --backward-passes) kept,
    cut into the fewest micro-batches (backward passes, one exchange: gradient
    accumulation) that split evenly over the new data ranks and give no device more
    sequences per pass than the user's run did (its memory). The same samples make the
    same mean gradient, up to the sum's rounding; the lr (scaled for the whole batch)
    and the data position (the step) stay. `s` itself at the size it names, or without
    an explicit mesh. Raises UsageError (one line, why) for a size that cannot hold the
    run."""
    fitted = fit_mesh(s, devices)
    if fitted is s or not s.mesh or not fitted.mesh:  # fit_mesh resizes only an explicit mesh
        return s
    (was, _), (ranks, stages) = _data_ranks(s.mesh), _data_ranks(fitted.mesh)
    total, share = s.batch_size * s.backward_passes, s.batch_size / was
    cut = s.microbatches or stages  # a pipeline cuts each rank's batch into its micro-batches
    for passes in range(1, total + 1):
        batch = total // passes
        rows = batch // ranks
        if total % passes == 0 and batch % ranks == 0 and rows <= share and not (cut and rows % cut):
            return dataclasses.replace(fitted, batch_size=batch, backward_passes=passes)
    need = f"at most {share:g} sequences per device and pass"
    need += f", a multiple of {cut} (micro-batches)" if cut else ""
    raise UsageError(f"the global batch of {total} sequences (--batch-size {s.batch_size} x --backward-passes "
                     f"{s.backward_passes}) cannot be cut into equal micro-batches over the {ranks} data-parallel "
                     f"ranks of mesh {fitted.mesh} ({need})")
