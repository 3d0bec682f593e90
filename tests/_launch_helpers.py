"""What tests/test_launchers.py and tests/test_launchers_failures.py share: a free port
on 127.0.0.1, each launcher's variables set by hand for a rank, and the real launchers
(mpirun, mpiexec, srun) with the skip that says how to install one."""

import os
import socket
import subprocess

import pytest

from dpjax.distributed import launchers
from dpjax.distributed.launchers import LAUNCHERS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARKERS = {v for launcher in LAUNCHERS for v in (launcher.marker, launcher.size, launcher.rank)} | {
    "OMPI_MCA_orte_hnp_uri", "SLURM_STEP_NODELIST", "SLURM_JOB_ID", *launchers.GIVEN_COORDINATOR,
    "JAX_COORDINATOR_PORT", "XLA_FLAGS"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(kind: str, rank: int, n: int, port: int) -> dict:
    """This machine's environment, scrubbed of every launcher's variables, plus what
    `kind`'s launcher would set for `rank` of `n` processes on 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if k not in MARKERS}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", JAX_COORDINATOR_PORT=str(port))
    env.update({
        "openmpi": {"OMPI_COMM_WORLD_SIZE": str(n), "OMPI_COMM_WORLD_RANK": str(rank),
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_MCA_orte_hnp_uri": "4096.0;tcp://127.0.0.1:1"},
        "mpich": {"PMI_SIZE": str(n), "PMI_RANK": str(rank), "MPI_LOCALRANKID": str(rank),
                  "DPJAX_COORDINATOR": f"127.0.0.1:{port}"},
        "mpich-no-coordinator": {"PMI_SIZE": str(n), "PMI_RANK": str(rank), "MPI_LOCALRANKID": str(rank)},
        "none": {},
        "slurm": {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_NUM_TASKS": str(n),
                  "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
    }[kind])
    return env


MPIRUN = {"openmpi": ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", "2"],
          "mpich": ["mpiexec.mpich", "-n", "2"],
          "slurm": ["srun", "-n", "2", "--overcommit", "--kill-on-bad-exit=1"]}
PACKAGE = {"openmpi": "openmpi-bin", "mpich": "mpich", "slurm": "slurmd slurmctld slurm-client munge, and a running "
                                                                 "controller and node"}


def _real(kind):
    import shutil

    if shutil.which(MPIRUN[kind][0]) is None:
        pytest.skip(f"{MPIRUN[kind][0]} is not installed (Debian: apt-get install {PACKAGE[kind]})")
    if kind == "slurm" and subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("srun is installed but no SLURM controller answers (sinfo fails)")
    env = {k: v for k, v in os.environ.items() if k not in MARKERS}
    return env | {"PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
