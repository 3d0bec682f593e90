"""Which launcher started this process, read from the environment it set: one registry.

A launcher is a record: the variable that says it started us, where it keeps the process
count, this process's rank and its rank on the host, where rank 0's coordinator is (when
the environment says), and how a user gives a coordinator when it does not. `detect(env)`
resolves the first record whose marker is set into a `Found`: the agreed size, rank,
local rank and coordinator, or one line saying what is missing, so that a process that
was started as one of several never trains alone, side by side with its siblings.

Order matters: a launcher that starts its ranks through another (mpirun or mpiexec inside
a SLURM allocation start them through srun, Open MPI also sets PMIx's variables) comes
before it. A launcher that knows no coordinator borrows one from a later record that
agrees on rank and size (srun --mpi=pmi2 sets PMI_* and SLURM_*; SLURM knows the host).
A coordinator the user gives (DPJAX_COORDINATOR, or JAX's own JAX_COORDINATOR_ADDRESS)
always wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

# dpjax.launch's variables; a user may set them by hand under any other launcher.
COORDINATOR = "DPJAX_COORDINATOR"
NUM_PROCESSES = "DPJAX_NUM_PROCESSES"
PROCESS_ID = "DPJAX_PROCESS_ID"
LOCAL_RANK = "DPJAX_LOCAL_RANK"
GIVEN_COORDINATOR = (COORDINATOR, "JAX_COORDINATOR_ADDRESS")

# Seconds of silence after which the coordination service declares a process dead and
# stops the others: what bounds a survivor's wait when no launcher stops it (srun without
# --kill-on-bad-exit). Heartbeats come from a thread of their own, so a long compile or
# step does not miss them.
HEARTBEAT_S = 10
HEARTBEAT_ENV = "DPJAX_HEARTBEAT_TIMEOUT"  # seconds, overriding HEARTBEAT_S (dpjax.agent sets it past --hang-timeout)


def _port_from_job(job_id: int, env: Mapping[str, str]) -> str:
    """JAX's port choice for a job (its OmpiCluster / SlurmCluster): one of the top 4096
    ports, picked by the job id so that two jobs on a host rarely collide; a job keeps the
    port it had before dpjax read the environment itself. JAX_COORDINATOR_PORT overrides."""
    return env.get("JAX_COORDINATOR_PORT") or str(job_id % 2**12 + (65535 - 2**12 + 1))


def _ompi_coordinator(env: Mapping[str, str]) -> str | None:
    """Open MPI 4 (ORTE): the host mpirun runs on, from OMPI_MCA_orte_hnp_uri
    ('211353600.0;tcp://10.0.0.1,10.0.0.2:40583;...'), as JAX's OmpiCluster reads it.
    Open MPI 5 (PRRTE) publishes no such address: None."""
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    host = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri or "")
    if host is None:
        return None
    return f"{next(h for h in host.groups() if h)}:{_port_from_job(int(uri.split('.', 1)[0]) // 2**12, env)}"


def _slurm_coordinator(env: Mapping[str, str]) -> str | None:
    """The step's first host ('node[001-004],gpu7' -> 'node001'), as JAX's SlurmCluster."""
    nodes, job = env.get("SLURM_STEP_NODELIST"), env.get("SLURM_JOB_ID")
    if not nodes or not job:
        return None
    first = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodes)
    return f"{first.group(1)}{first.group(2) or ''}:{_port_from_job(int(job), env)}"


@dataclass(frozen=True)
class Launcher:
    name: str
    marker: str  # set in every process this launcher starts
    size: str | None  # the variable holding the process count (None: this launcher does not say)
    rank: str
    local_rank: str | None
    coordinator: Callable[[Mapping[str, str]], str | None]
    how: str  # how to hand this launcher's processes a coordinator (or what to do instead)
    mpi_world: bool = True  # its processes share one MPI world (what --collectives mpi needs)


def _none(env):
    return None


_BY_HAND = (f"set {NUM_PROCESSES}, {PROCESS_ID} and {COORDINATOR}=HOST:PORT (HOST where rank 0 runs, PORT a "
            "free port) for every process")

LAUNCHERS = (
    Launcher("dpjax.launch", PROCESS_ID, NUM_PROCESSES, PROCESS_ID, LOCAL_RANK, lambda env: env.get(COORDINATOR),
             f"dpjax.launch sets them all; by hand, {_BY_HAND}", mpi_world=False),
    Launcher("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
             "OMPI_COMM_WORLD_LOCAL_RANK", _ompi_coordinator,
             f"give one with mpirun -x {COORDINATOR}=HOST:PORT (HOST where rank 0 runs, PORT a free port)"),
    Launcher("MVAPICH", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
             "MV2_COMM_WORLD_LOCAL_RANK", _none,
             f"give one with mpirun_rsh ... {COORDINATOR}=HOST:PORT (HOST where rank 0 runs, PORT a free port)"),
    Launcher("MPICH / Hydra or another PMI launcher (Intel MPI)", "PMI_RANK", "PMI_SIZE", "PMI_RANK",
             "MPI_LOCALRANKID", _none,
             f"give one with mpiexec -genv {COORDINATOR} HOST:PORT (HOST where rank 0 runs, PORT a free port)"),
    Launcher("a PMIx launcher", "PMIX_RANK", None, "PMIX_RANK", None, _none,
             f"launch with Open MPI's mpirun or srun, which say it, or {_BY_HAND}"),
    Launcher("SLURM (srun)", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID",
             _slurm_coordinator, f"give one with {COORDINATOR}=HOST:PORT srun ... (HOST where rank 0 runs, PORT a "
                                 "free port)", mpi_world=False),  # srun --mpi=pmix / pmi2 sets PMIX_ / PMI_ too
)


@dataclass(frozen=True)
class Found:
    """A launcher's environment, resolved. `problem` is one line when this process was
    started as one of several but cannot join them; then it must not run."""
    launcher: str
    size: int | None
    rank: int | None
    local_rank: int
    coordinator: str | None
    problem: str | None = None
    mpi_world: bool = False

    @property
    def alone(self) -> bool:
        return self.problem is None and self.size == 1


def _int(env, var):
    try:
        return int(env[var]) if var and env.get(var, "").strip() else None
    except ValueError:
        return None


def _read(launcher: Launcher, env: Mapping[str, str]) -> Found:
    size, rank = _int(env, launcher.size), _int(env, launcher.rank)
    return Found(launcher.name, size, rank, _int(env, launcher.local_rank) or 0, launcher.coordinator(env))


def detect(env: Mapping[str, str]) -> Found | None:
    """The launcher that started this process, resolved; None when no known launcher did
    (then JAX's own cluster detection may still apply: see `dpjax.distributed`)."""
    found = [(launcher, _read(launcher, env)) for launcher in LAUNCHERS if env.get(launcher.marker, "").strip()]
    if not found:
        return None
    launcher, first = found[0]
    given = next((env[v] for v in GIVEN_COORDINATOR if env.get(v, "").strip()), None)
    coordinator = given or first.coordinator or next(
        (f.coordinator for _, f in found[1:] if f.coordinator and (f.size, f.rank) == (first.size, first.rank)), None)
    said = f"{launcher.name} started this process ({launcher.marker}={env[launcher.marker]})"
    problem = None
    if first.size is None:
        what = f"{launcher.size} is not a number" if launcher.size and launcher.size in env else "no process count"
        problem = f"{said} but says {what}; {launcher.how}"
    elif first.rank is None or not 0 <= first.rank < first.size:
        problem = (f"{said} but {launcher.rank}={env.get(launcher.rank)!r} is not a rank of "
                   f"{launcher.size}={first.size}; {launcher.how}")
    elif first.size > 1 and coordinator is None:
        problem = f"{said} as rank {first.rank} of {first.size} but says no coordinator address; {launcher.how}"
    elif first.size > 1 and not re.fullmatch(r".+:\d+", coordinator):
        problem = f"the coordinator address {coordinator!r} is not HOST:PORT"
    return Found(first.launcher, first.size, first.rank, first.local_rank, coordinator, problem, launcher.mpi_world)
