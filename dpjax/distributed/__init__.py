"""Processes: which launcher started this one, `jax.distributed` initialisation, the CPU
transport, and the process index / count.

One process may drive several devices (JAX's model); these helpers answer for
processes. Horovod's size (data-parallel ranks, one per device) is
`dpjax.dp_size(mesh)`; inside `shard_map`, a device's rank along an axis is
`lax.axis_index`.

    launchers.py   the registry of launchers (dpjax.launch, Open MPI, MVAPICH, MPICH /
                   PMI, PMIx, SLURM): rank, size, local rank, coordinator, or one line
    transport.py   gloo | mpi for CPU collectives across processes
    agreement.py   every process about to make the same collective call (or the same choice)
    processes.py   this process's index, the count, its local rank, JAX's state once joined
    join.py        initialize (jax.distributed, bounded waits), ready, leave_now
"""

import importlib

from dpjax import interrupt
from dpjax.distributed.launchers import (COORDINATOR, HEARTBEAT_ENV, HEARTBEAT_S, LOCAL_RANK, NUM_PROCESSES,
                                         PROCESS_ID, detect)

if interrupt.computes():  # the rooms below import JAX, which `python -m dpjax.agent` does not (the launchers' names do)
    from dpjax.distributed.agreement import agree, every
    from dpjax.distributed.join import LauncherError, initialize, leave_now, ready
    from dpjax.distributed.processes import launched_processes, local_rank, process_count, process_index
    from dpjax.distributed.transport import COLLECTIVES, chosen, no_mpi_world, problem
else:
    def __getattr__(name: str):
        """The agent's process: a room's name once asked for (reading a command's settings); others import nothing."""
        for room in ("agreement", "join", "processes", "transport") if name in __all__ else ():
            value = getattr(importlib.import_module(f"dpjax.distributed.{room}"), name, None)
            if value is not None:
                globals()[name] = value
                return value
        raise AttributeError(f"module 'dpjax.distributed' has no attribute {name!r}")

__all__ = ["COLLECTIVES", "COORDINATOR", "HEARTBEAT_ENV", "HEARTBEAT_S", "LOCAL_RANK", "LauncherError", "NUM_PROCESSES",
           "PROCESS_ID", "agree", "chosen", "detect", "every", "initialize", "launched_processes", "leave_now",
           "local_rank", "no_mpi_world", "problem", "process_count", "process_index", "ready"]
