"""Every launcher dpjax knows, read from the environment it sets: pure checks against
the values JAX's own cluster detection computes, then real processes on 127.0.0.1 under
each launcher's variables (set by hand: Open MPI's, MPICH's PMI, SLURM's) that join one
job, train as one, or refuse in one line; and the real mpirun / mpiexec / srun where
installed. A rank that dies or fails: tests/test_launchers_failures.py."""

import os
import subprocess
import sys

import pytest
from _launch_helpers import HERE, MPIRUN, ROOT, _real, free_port, launcher_env
from conftest import read_losses

from dpjax.distributed.launchers import detect
# What Open MPI 4.1.4's mpirun and MPICH 4.0.2's mpiexec set for rank 1 of 2 (read from
# `mpirun -np 2 env` / `mpiexec.mpich -n 2 env` on Debian 12), and what srun sets.
OMPI = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "211353600.0;tcp://192.0.2.2:40583;"
        "tcp6://[fd00::2]:44113", "PMIX_RANK": "1", "PMIX_NAMESPACE": "211353601"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "node[007-009],gpu1", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def _jax_says(cluster, env, monkeypatch):
    """JAX's own detector on the same variables: the independent reference."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return cluster.get_coordinator_address(None, None), cluster.get_process_count(), cluster.get_process_id()


def test_open_mpi_and_slurm_read_as_jax_reads_them(monkeypatch):
    from jax._src.clusters import OmpiCluster, SlurmCluster

    for env, cluster, name in ((OMPI, OmpiCluster, "Open MPI"), (SLURM, SlurmCluster, "SLURM (srun)")):
        found = detect(env)
        assert found.launcher == name and found.problem is None
        assert (found.coordinator, found.size, found.rank) == _jax_says(cluster, env, monkeypatch)
    assert detect(OMPI).local_rank == 1 and detect(SLURM).local_rank == 0
    assert detect({**SLURM, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "node007:1234"


def test_a_launcher_without_a_coordinator_is_one_line_saying_how():
    found = detect(MPICH)
    assert (found.size, found.rank, found.local_rank, found.coordinator) == (2, 1, 1, None)
    assert found.problem.startswith("MPICH / Hydra or another PMI launcher (Intel MPI) started this process "
                                    "(PMI_RANK=1) as rank 1 of 2 but says no coordinator address")
    assert "mpiexec -genv DPJAX_COORDINATOR HOST:PORT" in found.problem and "\n" not in found.problem
    given = detect({**MPICH, "DPJAX_COORDINATOR": "10.0.0.1:1234"})
    assert given.problem is None and given.coordinator == "10.0.0.1:1234"
    # srun --mpi=pmi2 sets both: PMI decides the rank, SLURM knows where rank 0 is
    assert detect({**MPICH, **SLURM}).coordinator == "node007:" + _slurm_port(SLURM)
    pmix = detect({"PMIX_RANK": "3", "PMIX_NAMESPACE": "x"})
    assert "no process count" in pmix.problem and "DPJAX_COORDINATOR" in pmix.problem
    assert "is not a rank of" in detect({**MPICH, "PMI_RANK": "2"}).problem
    assert "not HOST:PORT" in detect({**MPICH, "DPJAX_COORDINATOR": "host"}).problem


def _slurm_port(env):
    return str(int(env["SLURM_JOB_ID"]) % 4096 + 61440)


def test_who_comes_first():
    # mpirun inside a SLURM allocation: its ranks carry the srun step of its daemons too
    assert detect({**SLURM, **OMPI, "SLURM_PROCID": "0"}).launcher == "Open MPI"
    assert detect({**OMPI, "DPJAX_PROCESS_ID": "0", "DPJAX_NUM_PROCESSES": "1"}).alone  # set by hand: ours wins
    # a batch script's own environment (no srun step): not a job of several
    assert detect({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) is None
    assert detect({**MPICH, "PMI_SIZE": "1", "PMI_RANK": "0"}).alone


# ---------------------------------------------------------------------------------------
# real processes on 127.0.0.1


def run_under(kind: str, command: list, n: int = 2, timeout: float = 300):
    """Starts `command` as n processes under `kind`'s variables; their (code, stdout, stderr)."""
    port = free_port()
    procs = [subprocess.Popen(command, env=launcher_env(kind, r, n, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in range(n)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outs)]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("kind", ["openmpi", "mpich", "slurm"])
def test_processes_under_each_launcher_join_one_job(kind):
    results = run_under(kind, [sys.executable, os.path.join(HERE, "mp_join.py")])
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err[-2000:]
        # 1 + 2, summed across the two processes: they are one job, each in its place
        assert f"joined=True process {rank} of 2 local {rank} sum=3" in out, out + err[-2000:]


def test_a_launcher_that_cannot_join_fails_in_one_line(corpus):
    """MPICH with no coordinator: every process refuses in one line naming the launcher
    and the fix; none trains alone (no metrics file is written)."""
    metrics = os.path.join(os.path.dirname(corpus), "never.jsonl")
    results = run_under("mpich-no-coordinator", [sys.executable, "-m", "dpjax.train", "--data", corpus,
                                                 "--steps", "2", "--metrics", metrics], timeout=120)
    for rank, (code, out, err) in enumerate(results):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"error: MPICH / Hydra or another PMI launcher (Intel MPI) started this process "
                                   f"(PMI_RANK={rank}) as rank {rank} of 2 but says no coordinator address; give one "
                                   "with mpiexec -genv DPJAX_COORDINATOR HOST:PORT"), lines
    assert not os.path.exists(metrics)


def test_the_agent_removes_the_folder_it_chose_at_exit(tmp_path):
    """The agent's default commit folder is in /dev/shm (memory): it was left there after
    the job; what the agent kept in it goes at its exit, its rank logs stay in the temporary
    folder. A --commit-dir the user gave is the user's, kept."""
    import tempfile

    port = free_port()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    chosen, given = os.path.join(shm, f"dpjax-{port}"), tmp_path / "given"
    for extra in ((), ("--commit-dir", str(given))):
        r = subprocess.run([sys.executable, "-m", "dpjax.agent", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv",
                            f"127.0.0.1:{port}", "--host-id", "h0", *extra, "--", sys.executable, "-c",
                            "print('hi')"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0 and "[0] hi" in r.stdout, r.stderr
        assert r.stderr.strip().splitlines()[-1] == "dpjax.agent[h0]: done: the job finished in round 1", r.stderr
    assert not os.path.exists(chosen) and (given / "heartbeat" / "h0").is_dir()
    log = os.path.join(tempfile.gettempdir(), f"dpjax-agent-{port}-logs", "h0", "rank0.log")
    assert open(log).read().count("hi\n") == 2  # both runs' lines


def test_an_unknown_launcher_option_is_one_usage_line(capsys):
    """The refusals of the arguments, in this process (parsing is all they do); the last
    case as a process: its exit status and its one line."""
    from dpjax.launch import main

    def refused(argv):
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = capsys.readouterr()
        assert e.value.code == 2 and out.out == ""
        return out.err.splitlines()

    assert refused(["-n", "4", "--max-restart", "2", "--", "true"]) == [
        "python -m dpjax.launch: unrecognized arguments: --max-restart (see python -m dpjax.launch --help)"]
    # --max-restarts is the supervising agent's (dpjax.agent): with -n it is one line saying what to give
    assert refused(["-n", "4", "--max-restarts", "2", "--", "true"]) == [
        "python -m dpjax.launch: -n is for processes without an agent; under the agent (--max-restarts) give "
        "--nproc-per-node K and --nnodes MIN:MAX --rdzv HOST:PORT instead (see python -m dpjax.launch --help)"]
    r = subprocess.run([sys.executable, "-m", "dpjax.launch", "-n", "2", "--", "no-such-command-dpjax"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "dpjax.launch: cannot run 'no-such-command-dpjax': No such file or directory"]


# ---------------------------------------------------------------------------------------
# training under each launcher, and under the real ones where they are installed


STEPS = 6


def _train(corpus, metrics, *extra):
    return [sys.executable, "-m", "dpjax.train", "--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads",
            "2", "--seq-len", "16", "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", "--mesh", "2x2x2", "--steps", str(STEPS), "--metrics", str(metrics), *extra]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The same run in one process on 8 devices: the reference."""
    from dpjax.train import main

    path = tmp_path_factory.mktemp("single") / "m.jsonl"
    assert main(_train(corpus, path)[3:]) == 0
    return read_losses(path)


def _one_job(results, path, single):
    import numpy as np

    for code, out, err in results:
        assert code == 0, err[-2000:]
    outs = [out for _, out, _ in results]
    assert outs[0].count("done: 6 steps on mesh 2x2x2") == 1 and "done:" not in "".join(outs[1:])  # one summary
    # float32 round-off only: the same global batch, summed across processes in another order
    np.testing.assert_allclose(read_losses(path), single, rtol=2e-5, atol=0)


# Each launcher's variables making one job: test_processes_under_each_launcher_join_one_job
# (fast, all three); training across the processes so made: Open MPI's in the fast set.
@pytest.mark.parametrize("kind", ["openmpi", pytest.param("mpich", marks=pytest.mark.slow),
                                  pytest.param("slurm", marks=pytest.mark.slow)])
def test_two_processes_under_each_launcher_train_as_one(corpus, single, tmp_path, kind):
    path = tmp_path / "m.jsonl"
    _one_job(run_under(kind, _train(corpus, path)), path, single)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["openmpi", "mpich", "slurm"])
def test_a_real_mpirun_trains_as_one(corpus, single, tmp_path, kind):
    """mpirun / mpiexec / srun itself, 2 processes on this host: one job (the output of
    both ranks is merged, so the single summary is the check that rank 1 said nothing)."""
    env, path = _real(kind), tmp_path / "m.jsonl"
    given = ["-genv", "DPJAX_COORDINATOR", f"127.0.0.1:{free_port()}"] if kind == "mpich" else []
    r = subprocess.run([*MPIRUN[kind], *given, *_train(corpus, path)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("done: 6 steps on mesh 2x2x2") == 1, r.stdout
    import numpy as np

    np.testing.assert_allclose(read_losses(path), single, rtol=2e-5, atol=0)


@pytest.mark.slow
def test_a_real_mpiexec_without_a_coordinator_fails_in_one_line_per_rank(corpus, tmp_path):
    env = _real("mpich")
    r = subprocess.run([*MPIRUN["mpich"], *_train(corpus, tmp_path / "never.jsonl")], capture_output=True, text=True,
                       env=env, timeout=300, cwd=ROOT)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert sorted(errors) == [f"error: MPICH / Hydra or another PMI launcher (Intel MPI) started this process "
                              f"(PMI_RANK={k}) as rank {k} of 2 but says no coordinator address; give one with "
                              "mpiexec -genv DPJAX_COORDINATOR HOST:PORT (HOST where rank 0 runs, PORT a free port)"
                              for k in (0, 1)], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "never.jsonl").exists()


# ---------------------------------------------------------------------------------------
# --collectives gloo | mpi, and a cluster only JAX's detection knows


def test_mpi_without_mpitrampoline_is_one_line_everywhere(monkeypatch, tmp_path):
    from dpjax import distributed
    from dpjax.plan import UsageError, check
    from dpjax.settings import Settings

    monkeypatch.delenv("MPITRAMPOLINE_LIB", raising=False)
    monkeypatch.delenv("DPJAX_COLLECTIVES", raising=False)
    check(Settings(collectives="gloo"))
    with pytest.raises(UsageError, match="--collectives mpi needs MPITrampoline's library, and MPITRAMPOLINE_LIB "
                                         "is not set: build MPItrampoline's MPIwrapper"):
        check(Settings(collectives="mpi"))
    monkeypatch.setenv("DPJAX_COLLECTIVES", "mpi")  # what dpjax.launch --collectives mpi passes on
    with pytest.raises(UsageError, match="MPITRAMPOLINE_LIB is not set"):
        check(Settings())
    monkeypatch.setenv("MPITRAMPOLINE_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(UsageError, match=r"MPITRAMPOLINE_LIB=.*missing.so is not a file"):
        check(Settings())
    (tmp_path / "libmpiwrapper.so").write_bytes(b"")
    monkeypatch.setenv("MPITRAMPOLINE_LIB", str(tmp_path / "libmpiwrapper.so"))
    check(Settings())  # present: accepted (this jaxlib has MPI collectives)
    # the library's initialize refuses before joining anything
    monkeypatch.delenv("MPITRAMPOLINE_LIB")
    for k, v in {"DPJAX_COORDINATOR": "127.0.0.1:1", "DPJAX_NUM_PROCESSES": "2", "DPJAX_PROCESS_ID": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(distributed.LauncherError, match="MPITRAMPOLINE_LIB is not set"):
        distributed.initialize(collectives="mpi")
    r = subprocess.run([sys.executable, "-m", "dpjax.launch", "-n", "1", "--collectives", "mpi", "--", "true"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "MPITRAMPOLINE_LIB is not set" in r.stderr


@pytest.mark.parametrize("port", ["free", "broken"])
def test_where_no_launcher_is_set_jax_detection_decides(port):
    """A cluster only JAX's detection knows (a registered ClusterEnv, as Kubernetes is):
    the processes join through `jax.distributed.initialize()`; where JAX recognises the
    cluster but cannot join it, one line."""
    port = str(free_port()) if port == "free" else port
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_join.py"), "fake-cluster"],
                              env={**launcher_env("none", r, 2, 0), "FAKE_CLUSTER_RANK": str(r),
                                   "FAKE_CLUSTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in range(2)]
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            if port == "broken":
                assert p.returncode == 1 and err.strip().splitlines()[-1] == (
                    "dpjax.distributed.LauncherError: JAX's FakeCluster detection recognised this cluster but could "
                    "not join it (the cluster's API says no); to run this process alone, set DPJAX_NUM_PROCESSES=1 "
                    "DPJAX_PROCESS_ID=0"), err
            else:
                assert p.returncode == 0 and f"joined=True process {rank} of 2 local 0 sum=3" in out, err[-2000:]
    finally:
        for p in procs:
            p.kill()
