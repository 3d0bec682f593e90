"""Joining the other processes: `jax.distributed` started from what the launcher says (or
JAX's own cluster detection), with bounded waits and heartbeats; the transport readied
once the devices exist; a failing joined process leaving at once."""

from __future__ import annotations

import os
import sys

import jax
from jax._src import clusters

from dpjax.distributed.launchers import HEARTBEAT_ENV, HEARTBEAT_S, NUM_PROCESSES, PROCESS_ID, detect
from dpjax.distributed.processes import joined_state
from dpjax.distributed.transport import COLLECTIVES, chosen, no_mpi_world, problem
from dpjax.errors import UserError


class LauncherError(UserError):
    """This process was started as one of several but cannot join them (or cannot use
    the transport asked for): one line saying which launcher and what is missing."""

    __module__ = "dpjax.distributed"  # its public address, as a traceback's last line names it


def _jax_cluster() -> str | None:
    """A cluster JAX's own detection recognises (Kubernetes, Cloud TPU, ...) beside the
    launchers dpjax reads itself; its name, or None."""
    ours = ("OmpiCluster", "SlurmCluster")  # read by dpjax's registry, with its checks
    for env in clusters.ClusterEnv._cluster_types:
        if env.__name__ in ours or env.opt_in_only_method:
            continue
        try:
            if env.is_env_present():
                return env.__name__
        except Exception as e:  # e.g. Kubernetes' API unreachable from this pod
            raise LauncherError(f"JAX's {env.__name__} detection failed ({_last_line(e)}); to run this process "
                                f"alone, set {NUM_PROCESSES}=1 {PROCESS_ID}=0") from None
    return None


def _last_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[-1]


def initialize(timeout_s: int | None = None, heartbeat_s: int | None = None, collectives: str | None = None) -> bool:
    """Starts `jax.distributed` when this process is one of several; True if it did (or
    had already).

    The launcher is read from the environment (`launchers.LAUNCHERS`: dpjax.launch, Open
    MPI, MVAPICH, MPICH / Hydra and other PMI launchers, PMIx, SLURM); where none of those
    is set, JAX's own cluster detection (Kubernetes and the rest) decides. A process that
    was started as one of several and cannot join (no coordinator, no process count)
    raises `LauncherError`, one line naming the launcher and what is missing, rather than
    train alone beside its siblings. A single process is left alone.

    `collectives` ("gloo" or "mpi"; default DPJAX_COLLECTIVES, else gloo) carries CPU
    collectives across processes; call `ready()` once the devices are set up (dpjax.train
    does). Bounded waits, so that a dead or stuck peer never hangs the job: `timeout_s`
    (DPJAX_INIT_TIMEOUT, default 300) for every process to join, and `heartbeat_s`
    (DPJAX_HEARTBEAT_TIMEOUT, default 10) after which the coordination service declares
    a silent process dead and stops the others with an error naming the task. A joined
    process that fails (an uncaught exception, or `leave_now`) exits at once rather than
    wait in JAX's shutdown barrier for peers that will never arrive.
    """
    if joined_state() is not None:
        return True
    timeout_s = int(os.environ.get("DPJAX_INIT_TIMEOUT", 300)) if timeout_s is None else timeout_s
    heartbeat_s = int(os.environ.get(HEARTBEAT_ENV, HEARTBEAT_S)) if heartbeat_s is None else heartbeat_s
    found, name = detect(os.environ), chosen(collectives)
    if found is not None and found.problem:
        raise LauncherError(found.problem)
    if found is not None and found.size == 1:
        return False
    cluster = _jax_cluster() if found is None else None
    if found is None and cluster is None:
        return False
    missing = problem(name)
    if missing:
        raise LauncherError(missing)
    if name == "mpi" and not (found is not None and found.mpi_world):
        raise LauncherError(no_mpi_world(found.launcher if found is not None else f"JAX's {cluster}"))
    jax.config.update("jax_cpu_collectives_implementation", name)
    COLLECTIVES[name].start()
    # SIGTERM keeps its default action (the process ends at once, even inside a stuck
    # collective): JAX's preemption service would otherwise catch it and keep running
    jax.config.update("jax_enable_preemption_service", False)
    kwargs = {} if found is None else dict(coordinator_address=found.coordinator, num_processes=found.size,
                                           process_id=found.rank)
    try:
        jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_s, **kwargs)
    except (RuntimeError, ValueError) as e:
        if found is not None:
            raise  # our launcher's values were complete: a failure to connect is not the user's input
        raise LauncherError(f"JAX's {cluster} detection recognised this cluster but could not join it "
                            f"({_last_line(e)}); "
                            f"to run this process alone, set {NUM_PROCESSES}=1 {PROCESS_ID}=0") from None
    sys.excepthook = _leave_at_once(sys.excepthook)
    return True


def _leave_at_once(hook):
    """An uncaught exception in a joined process: report it and exit now. JAX's exit
    handler would first wait in `jax.distributed`'s shutdown barrier for peers that are
    stuck in a collective with this process (until the shutdown timeout, 300 s)."""

    def leave(kind, value, tb):
        hook(kind, value, tb)
        leave_now(130 if issubclass(kind, KeyboardInterrupt) else 1)

    return leave


def leave_now(code: int) -> int:
    """Exits a joined process failing with `code` at once (see `_leave_at_once`); returns
    `code` when this process is alone or succeeding, to exit as usual."""
    if code == 0 or joined_state() is None:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ready(mesh=None) -> None:
    """What the transport needs once the CPU backend exists; nothing for gloo or one
    process. MPI: the communicators, created from this (the main) thread, of the world
    (no `mesh`) or of every way `mesh`'s axes group its devices; call it for each mesh
    a multi-process program uses, on every process in the same order (dpjax.train does)."""
    if joined_state() is not None:
        name = jax.config.jax_cpu_collectives_implementation or "gloo"
        cpus = len(jax.local_devices(backend="cpu"))
        if name == "mpi" and cpus != 1:  # e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8
            raise LauncherError(f"--collectives mpi takes one CPU device per process (JAX's MPI collectives), and "
                                f"this process has {cpus} (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
        COLLECTIVES[name].ready(mesh)
