"""The chaos soak's shorter schedule (experiments/chaos.py, issue 51): a job of 2 agents x 2
processes trains 64 steps while a fault of every kind strikes once (a rank killed, killed in a
commit's write, stopped, a host's agent killed, a corrupted commit, a truncated checkpoint, a
full commit folder, two at once); against the same job undisturbed: every step's loss once,
bit for bit, and the final parameters bit for bit."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import chaos  # noqa: E402


def test_the_schedule_deals_every_kind_before_any_twice():
    faults = chaos.schedule(3, 300, 12, chaos.KINDS)
    assert len(faults) == 24 and {k for _, k in faults[:8]} == set(chaos.KINDS)
    assert all(12 * (i + 1) <= s < 12 * (i + 1) + 6 for i, (s, _) in enumerate(faults))
    assert chaos.schedule(3, 300, 12, chaos.KINDS) == faults  # seeded


class _Job:
    """A job as the soak sees it: its metrics rows and whether its agents run."""

    def __init__(self, rows, running=True):
        self.rows_, self.alive = rows, running

    def step(self):
        return max((r["step"] for r in self.rows_ if "loss" in r), default=0)

    def restarts(self):
        return [r for r in self.rows_ if r.get("event") == "restart"]

    def running(self):
        return self.alive


def test_the_soak_waits_for_a_stuck_job_a_bounded_time():
    """A job that trains no new step (stuck before a fault's step, or a restart that never
    trains again) is said after --recover-s of silence, not waited for forever; an ended job at once."""
    import threading

    job, said = _Job([{"step": 5, "loss": 1.0}]), []
    t = threading.Thread(target=lambda: said.append(chaos.wait(job, lambda: job.step() >= 9, 0.3)), daemon=True)
    t0 = time.time()
    t.start()
    t.join(10)
    assert not t.is_alive() and said == ["no new step for 0.3 s (the job at step 5)"]
    assert 0.3 <= time.time() - t0 < 5
    assert chaos.wait(_Job([], running=False), lambda: False, 60) == "ended"
    # before its first step (imports, compiles) the start's limit: 5 minutes at load 40-50
    assert chaos.wait(_Job([]), lambda: False, 0.1, first=0.5) == "no new step for 0.5 s (the job at step 0)"
    rows = [{"step": 5, "loss": 1.0}]
    job = _Job(rows)
    threading.Timer(0.2, lambda: rows.append({"step": 6, "loss": 1.0})).start()  # a new step: the clock restarts
    threading.Timer(0.4, lambda: rows.append({"step": 9, "loss": 1.0})).start()
    assert chaos.wait(job, lambda: job.step() >= 9, 0.3) == "ok"


def test_a_restart_without_its_row_is_recovered_once_it_trains_past_the_fault():
    """After a fault at step 20 (its restart row lost, as a restart whose first step was the job's
    last lost it): training again past the steps the lost job had in flight is enough, rather
    than waiting --recover-s for the row while the job trains on (run 2 of RESULTS lost 13
    faults so); with the row, a step after the restart's first."""
    rows = [{"step": s, "loss": 1.0} for s in range(1, 21)]
    job = _Job(rows)
    assert not chaos.recovered(job, 0, 20)
    rows.append({"step": 21, "loss": 1.0})  # the step in flight when it struck
    assert not chaos.recovered(job, 0, 20)
    rows.append({"step": 22, "loss": 1.0})
    assert not chaos.recovered(job, 0, 20)
    rows.append({"step": 23, "loss": 1.0})  # the restarted job's, whether or not its row came
    assert chaos.recovered(job, 0, 20)
    job = _Job([*[{"step": s, "loss": 1.0} for s in range(1, 21)], {"event": "restart", "restored_step": 19}])
    assert not chaos.recovered(job, 0, 20) and not chaos.recovered(job, 1, 20)
    job.rows_.append({"step": 21, "loss": 1.0})
    assert chaos.recovered(job, 0, 20) and not chaos.recovered(job, 1, 20)


def test_the_table_lists_a_restart_no_fault_caused_as_such():
    """A host that joined after the first round had formed regrows the job: its restart is no
    fault's, listed in a row of its own (the last soak's 73 s restart was in no row)."""
    rows = [{"event": "restart", "steps_lost": 0, "seconds_lost": 73.1},  # h1 late: before any fault
            {"event": "restart", "steps_lost": 1, "seconds_lost": 9.0},
            {"event": "restart", "steps_lost": 0, "seconds_lost": 12.0}]
    log = [{"kind": "kill", "restarts_before": 1}, {"kind": "host", "restarts_before": 2}]
    head, table = chaos.table({"rows": rows, "log": log})
    by = {r[0]: r for r in table}
    assert by["kill"][2:] == [1, "1", 1, "9", 9.0] and by["host"][2:] == [1, "0", 0, "12", 12.0]
    assert by["(no fault: before the first)"] == ["(no fault: before the first)", "-", 1, "0", 0, "73.1", 73.1]
    assert by["all"][:4] == ["all", 2, 3, "0.50 per fault"]


@pytest.mark.slow
def test_every_kind_of_fault_once_and_nothing_lost(capsys):
    assert chaos.main(["--steps", "64", "--every", "7", "--seed", "1", "--ckpt-every", "10"]) == 0
    out = capsys.readouterr().out
    assert "truncate: ckpt/" in out and "cut in half" in out  # a sealed checkpoint was there to cut
    assert "every step once, the losses and the final parameters bit for bit the undisturbed run's" in out
    table = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for kind in ("kill", "in-commit", "hang", "host", "corrupt", "truncate", "double"):
        assert kind in table, out
        assert int(table[kind].split("|")[3]) >= 1, table[kind]  # it was a failure the agents restarted from


def test_an_armed_rank_dies_in_its_commit_write_leaving_it_torn(tmp_path, monkeypatch):
    """The soak's in-commit fault (dpjax.recovery.fault.in_write): armed through a file, the
    writer cuts its temporary file to half and SIGKILLs itself before the rename."""
    import signal

    from dpjax.recovery import fault
    from dpjax.recovery.file_format import write_file

    class Killed(BaseException):
        pass

    seen = {}

    def kill(pid, sig):  # what a real SIGKILL would find at that moment
        folder = tmp_path / "c"
        seen.update(pid=pid, sig=sig, files={f: os.path.getsize(folder / f) for f in os.listdir(folder)})
        raise Killed

    monkeypatch.setattr(fault.os, "kill", kill)
    monkeypatch.setenv(fault.ARM, str(tmp_path))
    assert write_file(str(tmp_path / "c"), "s000000001_w4.bin", 2, lambda fh: fh.write(b"x" * 1000))[1] == 1000
    (tmp_path / f"kill-in-write-{os.getpid()}").touch()
    with pytest.raises(Killed):
        write_file(str(tmp_path / "c"), "s000000002_w4.bin", 2, lambda fh: fh.write(b"y" * 1000))
    assert seen["pid"] == os.getpid() and seen["sig"] == signal.SIGKILL
    (torn,) = [f for f in seen["files"] if f.startswith(".s000000002_w4.bin.tmp")]
    assert seen["files"] == {"s000000001_w4.bin": 1000, torn: 500}  # half written, never renamed into place
    assert (tmp_path / f"kill-in-write-{os.getpid()}").read_text().endswith(torn)
