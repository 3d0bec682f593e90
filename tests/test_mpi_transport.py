"""`--collectives mpi`: JAX's MPI collectives through MPItrampoline's MPIwrapper. What it
needs (an MPI launcher, one CPU device per process) is refused in one line where it is
missing; a real `mpirun` job (slow; where MPIwrapper is built, MPITRAMPOLINE_LIB) trains
as one process does and exits 0, which needs transport.py's clique warm-up and its exit
handler."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import read_losses

from dpjax.distributed import launchers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKERS = tuple(launcher.marker for launcher in launchers.LAUNCHERS)


@pytest.fixture
def wrapper(monkeypatch, tmp_path):
    """MPITRAMPOLINE_LIB naming a file, as far as the device-free checks look."""
    lib = tmp_path / "libmpiwrapper.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("MPITRAMPOLINE_LIB", str(lib))
    monkeypatch.delenv("DPJAX_COLLECTIVES", raising=False)
    return str(lib)


def test_mpi_takes_one_cpu_device_per_process(wrapper):
    from dpjax.plan import UsageError, devices_per_process
    from dpjax.settings import Settings

    assert devices_per_process(Settings(mesh="2x4", collectives="gloo"), 2) == 4
    assert devices_per_process(Settings(collectives="gloo"), 2) is None  # every device it has
    assert devices_per_process(Settings(mesh="2x4", collectives="mpi"), 8) == 1
    assert devices_per_process(Settings(collectives="mpi"), 2) == 1  # not every simulated device
    assert devices_per_process(Settings(mesh="2x4", collectives="mpi"), 1) == 8  # alone: no MPI at all
    with pytest.raises(UsageError, match=r"^--collectives mpi takes one CPU device per process \(JAX's MPI "
                                         r"collectives\), and --mesh 2x4 gives each of 2 processes 4: start 8 "
                                         r"processes \(mpirun -np 8\), or use --collectives gloo$"):
        devices_per_process(Settings(mesh="2x4", collectives="mpi"), 2)


def test_only_launchers_that_make_one_mpi_world_can_carry_mpi(monkeypatch, wrapper):
    from dpjax import distributed

    worlds = {launcher.name: launcher.mpi_world for launcher in launchers.LAUNCHERS}
    assert not worlds["dpjax.launch"] and not worlds["SLURM (srun)"]
    assert worlds["Open MPI"] and worlds["MPICH / Hydra or another PMI launcher (Intel MPI)"]
    for k in MARKERS:
        monkeypatch.delenv(k, raising=False)
    for k, v in {"DPJAX_COORDINATOR": "127.0.0.1:1", "DPJAX_NUM_PROCESSES": "2", "DPJAX_PROCESS_ID": "1"}.items():
        monkeypatch.setenv(k, v)  # what dpjax.launch sets: processes that are each an MPI world of their own
    with pytest.raises(distributed.LauncherError, match="^--collectives mpi needs the processes started by an MPI "
                                                        "launcher .* dpjax.launch does not: use one"):
        distributed.initialize(collectives="mpi")
    # said first, library or not (a file that is no library would stop any process that loads jaxlib)
    env = {k: v for k, v in os.environ.items() if k != "MPITRAMPOLINE_LIB"} | {"PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "dpjax.launch", "-n", "2", "--collectives", "mpi", "--", "true"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "dpjax.launch does not: use one (e.g. mpirun -np 2 python -m dpjax.train" in r.stderr


def _mpirun_env():
    lib = os.environ.get("MPITRAMPOLINE_LIB", "")
    if not lib or not os.path.isfile(lib):
        pytest.skip("MPITRAMPOLINE_LIB names no MPIwrapper library (build it as README 'Running on a cluster' says)")
    if shutil.which("mpirun.openmpi") is None:
        pytest.skip("Open MPI's mpirun is not installed (Debian: apt-get install openmpi-bin)")
    env = {k: v for k, v in os.environ.items() if k not in MARKERS and not k.startswith("DPJAX_")}
    # conftest's 8 devices per process would be refused: dpjax.train gives each one
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    return env | {"PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}


def _train(corpus, metrics, mesh, *extra):
    return [sys.executable, "-m", "dpjax.train", "--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads",
            "2", "--seq-len", "16", "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", "--mesh", mesh, "--steps", "4", "--metrics", str(metrics), *extra]


@pytest.mark.slow
def test_a_real_mpirun_with_mpi_collectives_trains_as_one_process_and_exits_0(corpus, tmp_path):
    """4 processes, mesh 2x2: psums over data, model and both (three groupings of the
    devices, each a communicator that must be made from the main thread before the
    step runs its collectives on XLA's worker threads); exit code 0 although JAX frees
    those communicators after MPI_Finalize."""
    import numpy as np

    from dpjax.train import main

    env = _mpirun_env()
    assert main(_train(corpus, tmp_path / "one.jsonl", "2x2")[3:]) == 0
    r = subprocess.run(["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", "4",
                        *_train(corpus, tmp_path / "mpi.jsonl", "2x2", "--collectives", "mpi")],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-2500:]
    assert r.stdout.count("done: 4 steps on mesh 2x2") == 1, r.stdout
    assert "MPI_FINALIZE" not in r.stderr and "thread" not in r.stderr, r.stderr[-2000:]
    np.testing.assert_allclose(read_losses(tmp_path / "mpi.jsonl"), read_losses(tmp_path / "one.jsonl"),
                               rtol=2e-5, atol=0)
