"""Which process this is: its index and the count (JAX's), the count a launcher announces
before JAX starts, the local rank on its host, and JAX's distributed state once joined."""

from __future__ import annotations

import os

import jax
from jax._src import distributed as jax_distributed

from dpjax.distributed.launchers import detect


def process_index() -> int:
    """This process's index among all processes (0 in a single-process run)."""
    return jax.process_index()


def process_count() -> int:
    """Number of processes. Not Horovod's `size()`: a process may drive several devices,
    and the data-parallel rank count is `dpjax.dp_size(mesh)`."""
    return jax.process_count()


def joined_state():
    """JAX's distributed state once this process has joined the others, else None."""
    return jax_distributed.global_state if jax_distributed.global_state.client is not None else None


def launched_processes() -> int:
    """The process count, readable before JAX's backends start: `jax.distributed`'s once
    it is joined, else what the launcher announces (1 when there is none)."""
    joined = joined_state()
    if joined is not None:
        return joined.num_processes
    found = detect(os.environ)
    return found.size if found is not None and found.problem is None else 1


def local_rank() -> int:
    """This process's index among the processes on its host."""
    found = detect(os.environ)
    return found.local_rank if found is not None else 0
