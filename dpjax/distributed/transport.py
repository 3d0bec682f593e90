"""How CPU processes exchange collective data: gloo (JAX's default, over TCP) or MPI
(JAX's MPI collectives through MPITrampoline, which the issue measured 1.5-14x faster
between two processes on one host). On GPU, XLA uses NCCL and this choice does nothing.

A registry: each transport says what it needs (one line when this machine lacks it) and
what to do before `jax.distributed` starts and once the CPU backend exists.

MPI's two quirks in JAX 0.10: a first collective of 4 KiB or more fails with
"Communicator requested from a thread that is not the one MPI was initialized from"
unless a tiny one ran first, so `ready()` runs a one-element psum across every process;
and JAX registers MPI_Finalize at exit before the backend's communicators are freed
(the process then exits 1 with "MPI_Comm_free() ... after MPI_FINALIZE"), so `ready()`
registers, after it, a handler that frees the backend first (exit handlers run last in,
first out).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Callable

ENV = "DPJAX_COLLECTIVES"  # how dpjax.launch passes --collectives to its processes
MPI_LIB = "MPITRAMPOLINE_LIB"
MPIWRAPPER_HOW = ("build MPItrampoline's MPIwrapper against this machine's MPI (git clone "
                  "https://github.com/eschnett/MPIwrapper; cmake -S MPIwrapper -B build "
                  "-DCMAKE_INSTALL_PREFIX=$HOME/mpiwrapper; cmake --build build --target install) and "
                  "export MPITRAMPOLINE_LIB=$HOME/mpiwrapper/lib/libmpiwrapper.so")


def _mpi_missing() -> str | None:
    lib = os.environ.get(MPI_LIB, "")
    if not lib:
        return f"--collectives mpi needs MPITrampoline's library, and {MPI_LIB} is not set: {MPIWRAPPER_HOW}"
    if not os.path.isfile(lib):
        return f"--collectives mpi: {MPI_LIB}={lib} is not a file: {MPIWRAPPER_HOW}"
    from jax._src.lib import _jax

    if not hasattr(_jax, "make_mpi_collectives"):
        return "--collectives mpi: this jaxlib has no MPI collectives; use --collectives gloo"
    return None


def _mpi_ready() -> None:
    import numpy as np
    from jax.experimental import multihost_utils

    # one element across every process, before any large buffer (quirk 1)
    multihost_utils.process_allgather(np.zeros(1, np.float32))
    atexit.register(_free_backend_before_finalize)


def _free_backend_before_finalize() -> None:
    """Quirk 2: runs before JAX's own MPI_Finalize handler (registered earlier)."""
    from jax._src import api

    api.clean_up()


@dataclass(frozen=True)
class Transport:
    name: str
    missing: Callable[[], str | None]  # one line when this machine cannot use it
    ready: Callable[[], None]  # once the CPU backend exists


COLLECTIVES = {t.name: t for t in (
    Transport("gloo", lambda: None, lambda: None),
    Transport("mpi", _mpi_missing, _mpi_ready),
)}


def problem(name: str) -> str | None:
    """One line saying why `name` cannot carry this machine's CPU collectives; None if it can."""
    if name not in COLLECTIVES:
        return f"unknown --collectives {name!r}; choose one of {', '.join(COLLECTIVES)}"
    return COLLECTIVES[name].missing()


def chosen(name: str | None) -> str:
    """The transport asked for: the argument, else dpjax.launch's DPJAX_COLLECTIVES, else gloo."""
    return name or os.environ.get(ENV) or "gloo"
