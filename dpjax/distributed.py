"""Processes: `jax.distributed` initialisation and the process index / count.

One process may drive several devices (JAX's model); these helpers answer for
processes. Horovod's size (data-parallel ranks, one per device) is
`dpjax.dp_size(mesh)`; inside `shard_map`, a device's rank along an axis is
`lax.axis_index`.
"""

from __future__ import annotations

import os

# Variables our launcher (`python -m dpjax.launch`) sets for each process.
COORDINATOR = "DPJAX_COORDINATOR"
NUM_PROCESSES = "DPJAX_NUM_PROCESSES"
PROCESS_ID = "DPJAX_PROCESS_ID"
LOCAL_RANK = "DPJAX_LOCAL_RANK"

_LOCAL_RANK_VARS = (LOCAL_RANK, "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")


def process_index() -> int:
    """This process's index among all processes (0 in a single-process run)."""
    import jax

    return jax.process_index()


def process_count() -> int:
    """Number of processes. Not Horovod's `size()`: a process may drive several devices,
    and the data-parallel rank count is `dpjax.dp_size(mesh)`."""
    import jax

    return jax.process_count()


def launched_processes() -> int:
    """The process count the launcher (ours, SLURM or Open MPI) announces in the
    environment, readable before JAX starts (1 when there is none)."""
    for var in (NUM_PROCESSES, "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def local_rank() -> int:
    """This process's index among the processes on its host."""
    for var in _LOCAL_RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def initialize(timeout_s: int | None = None, heartbeat_s: int | None = None) -> bool:
    """Starts `jax.distributed` when this process is one of several; True if it did.

    Our launcher's variables (DPJAX_COORDINATOR, DPJAX_NUM_PROCESSES, DPJAX_PROCESS_ID)
    come first; otherwise a cluster JAX recognises (SLURM, Open MPI) is auto-detected.
    A single process is left alone. On CPU, cross-process collectives use gloo.

    Bounded waits, so that a dead or stuck peer never hangs the job: `timeout_s`
    (DPJAX_INIT_TIMEOUT, default 300) for every process to join, and `heartbeat_s`
    (DPJAX_HEARTBEAT_TIMEOUT, default 60) after which the coordination service declares
    a silent process dead and stops the others with an error naming the task.
    """
    timeout_s = int(os.environ.get("DPJAX_INIT_TIMEOUT", 300)) if timeout_s is None else timeout_s
    heartbeat_s = int(os.environ.get("DPJAX_HEARTBEAT_TIMEOUT", 60)) if heartbeat_s is None else heartbeat_s
    import jax

    if os.environ.get(COORDINATOR):
        kwargs = dict(coordinator_address=os.environ[COORDINATOR],
                      num_processes=int(os.environ[NUM_PROCESSES]),
                      process_id=int(os.environ[PROCESS_ID]))
    elif launched_processes() > 1:
        kwargs = {}
    else:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_s, **kwargs)
    return True


def agree(what: str, fingerprint: str, timeout_s: float | None = None) -> None:
    """Checks that every process is about to make the same collective call.

    Called by every dpjax collective while it is traced (the first call of each
    compiled program), with a one-line description of what it will exchange (shape,
    dtype, axis, algorithm, op, root, groups, sizes). Processes that trace different
    calls would otherwise exchange garbage or wait on each other forever (a root one
    process does not know it is); here every process publishes its description in the
    `jax.distributed` key-value store under its next sequence number (a counter kept in
    that store, so the n-th call of each process pairs with the n-th of every other)
    and reads everyone else's: any difference is one ValueError on every process, and
    a process that never arrives is a TimeoutError naming the call after `timeout_s`
    (DPJAX_COLLECTIVE_TIMEOUT, default 300 s). One process: nothing to check.
    """
    import time

    import jax
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return
    timeout_s = float(os.environ.get("DPJAX_COLLECTIVE_TIMEOUT", 300)) if timeout_s is None else timeout_s
    me = jax.process_index()
    seq = client.key_value_increment(f"dpjax/agree/count/{me}", 1)
    client.key_value_set(f"dpjax/agree/{seq}/{me}", fingerprint)
    deadline = time.monotonic() + timeout_s
    for other in range(jax.process_count()):
        if other == me:
            continue
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            theirs = client.blocking_key_value_get(f"dpjax/agree/{seq}/{other}", wait_ms)
        except Exception:  # the client reports a deadline as an XlaRuntimeError
            raise TimeoutError(
                f"{what} (collective call #{seq} of process {me}): process {other} did not reach it within "
                f"{timeout_s:g} s; it is stuck, gone, or making other calls (DPJAX_COLLECTIVE_TIMEOUT)") from None
        if theirs != fingerprint:
            raise ValueError(
                f"processes disagree on collective call #{seq}: process {me} has {fingerprint} but process "
                f"{other} has {theirs}; every process must make the same calls with the same shapes, dtypes "
                f"and arguments")
