"""How CPU processes exchange collective data: gloo (JAX's default, over TCP) or MPI
(JAX's MPI collectives through MPITrampoline, which the issue measured 1.5-14x faster
between two processes on one host). On GPU, XLA uses NCCL and this choice does nothing.

A registry: each transport says what it needs (one line when this machine lacks it) and
what to do before `jax.distributed` starts and once the CPU backend exists.

MPI's quirks in JAX 0.10 (measured here against MPIwrapper over Open MPI 4.1.4):
- one CPU device per process: XLA's MPI communicator is one MPI rank, so a process
  driving several devices fails ("Multiple threads/devices per process are not yet
  supported"); `dpjax.plan` refuses such a run in one line.
- a communicator is created once per set of devices that meet in a collective (a
  "clique"), and only from the thread that initialised MPI; a compiled program that is
  not tiny runs its collectives on XLA's worker threads, so the first collective over a
  new clique inside a real step fails with "Communicator requested from a thread that
  is not the one MPI was initialized from". `ready(mesh)` therefore runs, from the main
  thread, a one-element psum over every set of the mesh's axes, which creates every
  clique a program on that mesh can use (XLA keeps them for the process's life).
- at exit, JAX frees the backend's communicators after its own MPI_Finalize handler
  has run (the process then exits 1 with "MPI_Comm_free() ... after MPI_FINALIZE", and
  the job fails). `ready()` registers an exit handler that runs first (exit handlers
  run last in, first out): it leaves `jax.distributed` (the shutdown barrier), calls
  MPI_Finalize and ends the process with 0 at once, before the communicators' C++
  destructors run. Handlers registered before the CPU backend started are skipped: a
  dpjax process that fails leaves earlier, with its code (`distributed.leave_now`).
- the processes must share one MPI world: an MPI launcher (mpirun, mpiexec, srun
  --mpi=pmix) must start them (`launchers.Launcher.mpi_world`).
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from jax import lax
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ENV = "DPJAX_COLLECTIVES"  # how dpjax.launch passes --collectives to its processes
MPI_LIB = "MPITRAMPOLINE_LIB"
MPIWRAPPER_HOW = ("build MPItrampoline's MPIwrapper against this machine's MPI (git clone "
                  "https://github.com/eschnett/MPIwrapper; cmake -S MPIwrapper -B build "
                  "-DCMAKE_INSTALL_PREFIX=$HOME/mpiwrapper; cmake --build build --target install; "
                  "it needs the MPI compiler "
                  "wrappers and gfortran) and "
                  "export MPITRAMPOLINE_LIB=$HOME/mpiwrapper/lib/libmpiwrapper.so (lib64 on some systems)")


def no_mpi_world(who: str) -> str:
    """One line: `who` started processes that share no MPI world, so MPI's collectives
    cannot join them (each would be rank 0 of a world of its own; Open MPI then fails
    with MPI_ERR_RANK in the first collective)."""
    return (f"--collectives mpi needs the processes started by an MPI launcher (mpirun -np N, mpiexec, srun "
            f"--mpi=pmix), which makes them one MPI world, one CPU device each; {who} does not: use one "
            f"(e.g. mpirun -np 2 python -m dpjax.train --mesh 2x1 --collectives mpi), or --collectives gloo")


def _mpi_missing() -> str | None:
    lib = os.environ.get(MPI_LIB, "")
    if not lib:
        return f"--collectives mpi needs MPITrampoline's library, and {MPI_LIB} is not set: {MPIWRAPPER_HOW}"
    if not os.path.isfile(lib):
        return f"--collectives mpi: {MPI_LIB}={lib} is not a file: {MPIWRAPPER_HOW}"
    from jax._src.lib import _jax  # only for MPI: jaxlib's native module, whose name may move between releases

    if not hasattr(_jax, "make_mpi_collectives"):
        return "--collectives mpi: this jaxlib has no MPI collectives; use --collectives gloo"
    return None


_MADE: list = []  # the MPI collectives JAX made for this process's CPU backend


def _mpi_start() -> None:
    """Before `jax.distributed` starts: keep the MPI collectives object JAX makes for the
    CPU backend, so that the exit handler can finalize MPI itself (quirk 3)."""
    from jax._src.lib import _jax  # only for MPI (see _mpi_missing)

    make = _jax.make_mpi_collectives
    if getattr(make, "dpjax_keeps", False):
        return

    def keep():
        made = make()
        _MADE.append(made)
        return made

    keep.dpjax_keeps = True
    _jax.make_mpi_collectives = keep


def _mpi_ready(mesh) -> None:
    if mesh is None:  # the world's clique, before any large buffer
        multihost_utils.process_allgather(np.zeros(1, np.float32))
    else:
        _warm_cliques(mesh)
    if not _EXIT:
        assert _MADE, "JAX made its MPI collectives without _jax.make_mpi_collectives: see _mpi_start"
        _EXIT.append(_finalize_and_leave)
        atexit.register(_finalize_and_leave)


def _warm_cliques(mesh) -> None:
    """A one-element psum over every non-empty set of `mesh`'s axes, from this (the main)
    thread: each creates the communicators of one way of grouping the devices (ppermute
    and the other collectives over those axes use the same ones). Tiny programs run
    their collectives on the calling thread; every process runs the same sequence, as
    MPI_Comm_split needs."""
    names = tuple(mesh.axis_names)
    spec = P(names)
    x = jax.make_array_from_callback((mesh.size,), NamedSharding(mesh, spec), lambda idx: np.zeros(1, np.float32))
    for k in range(1, len(names) + 1):
        for axes in itertools.combinations(names, k):
            def one(v, axes=axes):
                assert v.shape == (1,), v.shape  # one element per device
                return lax.psum(v, axes)

            jax.block_until_ready(jax.jit(jax.shard_map(one, mesh=mesh, in_specs=spec, out_specs=spec))(x))


_EXIT: list = []


def _finalize_and_leave() -> None:
    """Quirk 3: runs before JAX's MPI_Finalize handler (registered earlier) and ends the
    process before the communicators are freed after MPI_Finalize."""
    sys.stdout.flush()
    sys.stderr.flush()
    jax_distributed.shutdown()  # every process reaches its exit before any finalizes
    for made in _MADE:
        made.Finalize()
    os._exit(0)


@dataclass(frozen=True)
class Transport:
    name: str
    missing: Callable[[], str | None]  # one line when this machine cannot use it
    start: Callable[[], None]  # before jax.distributed starts
    ready: Callable[[object], None]  # once the CPU backend exists; its argument: a mesh, or None


COLLECTIVES = {t.name: t for t in (
    Transport("gloo", lambda: None, lambda: None, lambda mesh: None),
    Transport("mpi", _mpi_missing, _mpi_start, _mpi_ready),
)}


def problem(name: str) -> str | None:
    """One line saying why `name` cannot carry this machine's CPU collectives; None if it can."""
    if name not in COLLECTIVES:
        return f"unknown --collectives {name!r}; choose one of {', '.join(COLLECTIVES)}"
    return COLLECTIVES[name].missing()


def chosen(name: str | None) -> str:
    """The transport asked for: the argument, else dpjax.launch's DPJAX_COLLECTIVES, else gloo."""
    return name or os.environ.get(ENV) or "gloo"
