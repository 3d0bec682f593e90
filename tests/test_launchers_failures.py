"""A rank that dies or fails ends the job: `dpjax.launch` stops the others within
seconds of a killed rank and names it in its last line; under a launcher that stops
nobody (srun without --kill-on-bad-exit) the survivors end within the heartbeat; a
failing rank leaves at once. Processes on 127.0.0.1, under the real mpirun / mpiexec /
srun where installed."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from _launch_helpers import HERE, MPIRUN, ROOT, _real, free_port, launcher_env
from conftest import pids_running



LAST_WORDS = ("import os, sys; rank = os.environ['DPJAX_PROCESS_ID']; print('working', flush=True); "
              "rank == '1' and (print('ValueError: the real reason', file=sys.stderr), "
              "print('[Gloo] Rank 1 is connected to 1 peer ranks.', file=sys.stderr), "
              "print('I1123 21:45:10.902929   27495 client.cc:1] a status line', file=sys.stderr), sys.exit(3))")


def test_the_last_line_is_the_ranks_own_error_not_a_library_status_line():
    r = subprocess.run([sys.executable, "-m", "dpjax.launch", "-n", "2", "--", sys.executable, "-c", LAST_WORDS],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1] == "dpjax.launch: rank 1 failed (exit code 3): ValueError: the real reason"


CHATTY = ("import os, sys; rank = os.environ['DPJAX_PROCESS_ID']; "
          "print(f'[Gloo] Rank {rank} is connected to 1 peer ranks.', file=sys.stderr, flush=True); "
          "print('working', flush=True); "
          "exec('def deep():\\n    raise ValueError(\\'the real reason\\')') ; "
          "rank == '1' and deep()")


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_the_launch_is_quiet_and_the_failing_ranks_line_is_last(verbose):
    """gloo's 'Rank N is connected' lines (31 a launch of 8) and the tracebacks (about 90
    lines when a rank failed) only with --verbose: by default a traceback is its exception's
    line and where the whole of it is; every line in the rank's log; the diagnosis last."""
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "dpjax.launch", "-n", "2", "--port", str(port),
                        *(["--verbose"] if verbose else []), "--", sys.executable, "-c", CHATTY],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert err[-1] == "dpjax.launch: rank 1 failed (exit code 1): ValueError: the real reason", err
    log = os.path.join(tempfile.gettempdir(), f"dpjax-launch-{port}-logs", "rank1.log")
    assert ("[1] Traceback (most recent call last):" in err) == verbose, err
    assert any(line.startswith("[1] [Gloo] Rank 1 is connected") for line in err) == verbose, err
    assert ("[1] ValueError: the real reason" + ("" if verbose else f" (its traceback: {log})")) in err, err
    held = open(log).read()
    assert "Traceback (most recent call last):" in held and "[Gloo] Rank 1 is connected" in held
    assert "in deep" in held and "working" in held


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_ends_the_launch_within_seconds(tmp_path, victim):
    """SIGKILL of either rank mid-collective: the launcher stops the other at once and
    its last line names the rank and the signal (not a library's status line)."""
    marker = str(tmp_path / "victim")
    launcher = subprocess.Popen([sys.executable, "-m", "dpjax.launch", "-n", "2", "--devices-per-process", "1", "--",
                                 sys.executable, os.path.join(HERE, "mp_join.py"), "forever", marker],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.time() + 120
        out = ""
        while out.count("sum=3") < 2:  # both joined and summing
            assert time.time() < deadline and launcher.poll() is None, "the job never started"
            out += launcher.stdout.readline()
        rank = next(p for p in pids_running(marker) if p != launcher.pid and
                    f"DPJAX_PROCESS_ID={victim}".encode() in open(f"/proc/{p}/environ", "rb").read().split(b"\0"))
        os.kill(rank, signal.SIGKILL)
        t0 = time.time()
        _, err = launcher.communicate(timeout=60)
        took = time.time() - t0
        assert launcher.returncode == 1
        assert err.strip().splitlines()[-1] == (f"dpjax.launch: rank {victim} failed (signal 9): killed by SIGKILL, "
                                                "no error output"), err[-2000:]
        assert took < 5, took
        assert "sending SIGKILL" not in err  # SIGTERM was enough: JAX's preemption service did not swallow it
        assert pids_running(marker) == []  # nothing left behind
    finally:
        for pid in pids_running(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("kind,victim", [(k, v) for k in ("openmpi", "mpich", "slurm") for v in (0, 1)])
def test_a_killed_rank_ends_a_real_mpirun_within_seconds(tmp_path, kind, victim):
    env, marker = _real(kind), str(tmp_path / "victim")
    given = ["-genv", "DPJAX_COORDINATOR", f"127.0.0.1:{free_port()}"] if kind == "mpich" else []
    job = subprocess.Popen([*MPIRUN[kind], *given, sys.executable, os.path.join(HERE, "mp_join.py"), "forever",
                            marker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline, out = time.time() + 120, ""
        while out.count("sum=3") < 2:
            assert time.time() < deadline and job.poll() is None, "the job never started"
            out += job.stdout.readline()
        rank_var = {"openmpi": "OMPI_COMM_WORLD_RANK", "mpich": "PMI_RANK", "slurm": "SLURM_PROCID"}[kind]
        pid = next(p for p in pids_running(marker) if f"{rank_var}={victim}".encode() in open(
            f"/proc/{p}/environ", "rb").read().split(b"\0") and b"mp_join" in open(f"/proc/{p}/cmdline", "rb").read())
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        job.communicate(timeout=60)
        assert job.returncode != 0 and time.time() - t0 < 5, time.time() - t0
        assert [p for p in pids_running(marker) if b"mp_join" in open(f"/proc/{p}/cmdline", "rb").read()] == []
    finally:
        for pid in pids_running(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", [0, 1])
def test_without_a_launcher_to_stop_it_a_survivor_stops_within_the_heartbeat(victim):
    """srun without --kill-on-bad-exit stops nobody: the survivor of a killed rank, idle
    in the job, ends by itself within DPJAX_HEARTBEAT_TIMEOUT (4 s here, 10 by default):
    at once when rank 0 (the coordinator) died, once the dead rank misses its heartbeats
    otherwise."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_join.py"), "forever"],
                              env={**launcher_env("slurm", r, 2, port), "DPJAX_HEARTBEAT_TIMEOUT": "4"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in range(2)]
    try:
        deadline = time.time() + 120
        for p in procs:
            while "sum=3" not in p.stdout.readline():
                assert time.time() < deadline and p.poll() is None, "the job never started"
        procs[victim].kill()
        t0 = time.time()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=60)
        assert survivor.returncode != 0 and time.time() - t0 < 4 + 2, (time.time() - t0, err[-1000:])
        assert ("stopped sending heartbeats" if victim else "Failed to send RPC to coordination service") in err
    finally:
        for p in procs:
            p.kill()


def test_a_failing_process_leaves_at_once_not_through_the_shutdown_barrier():
    """Rank 1 raises while rank 0 is busy elsewhere: it prints its traceback and exits
    at once, rather than wait in JAX's shutdown barrier for rank 0 (300 s)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_join.py"), "forever", "fail"],
                              env=launcher_env("slurm", r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for r in range(2)]
    try:
        _, err = procs[1].communicate(timeout=60)  # joining takes seconds; the barrier would take 300
        t_exit = time.time()
        assert procs[1].returncode == 1 and err.strip().splitlines()[-1] == "ValueError: rank 1 gives up", err
        assert procs[0].poll() is None or time.time() - t_exit < 1  # rank 0 was still there to wait for
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_real_srun_without_kill_on_bad_exit_ends_within_the_heartbeat(tmp_path, victim):
    env, marker = _real("slurm"), str(tmp_path / "victim")
    job = subprocess.Popen(["srun", "-n", "2", "--overcommit", sys.executable, os.path.join(HERE, "mp_join.py"),
                            "forever", marker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**env, "DPJAX_HEARTBEAT_TIMEOUT": "4"}, cwd=ROOT)
    try:
        deadline, out = time.time() + 120, ""
        while out.count("sum=3") < 2:
            assert time.time() < deadline and job.poll() is None, "the job never started"
            out += job.stdout.readline()
        pid = next(p for p in pids_running(marker) if f"SLURM_PROCID={victim}".encode() in open(
            f"/proc/{p}/environ", "rb").read().split(b"\0"))
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        job.communicate(timeout=60)
        assert job.returncode != 0 and time.time() - t0 < 4 + 3, time.time() - t0
    finally:
        for pid in pids_running(marker):
            os.kill(pid, signal.SIGKILL)
