"""The chaos soak's shorter schedule (experiments/chaos.py, issue 51): a job of 2 agents x 2
processes trains 64 steps while a fault of every kind strikes once (a rank killed, killed in a
commit's write, stopped, a host's agent killed, a corrupted commit, a truncated checkpoint, a
full commit folder, two at once); against the same job undisturbed: every step's loss once,
bit for bit, and the final parameters bit for bit."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import chaos  # noqa: E402


def test_the_schedule_deals_every_kind_before_any_twice():
    faults = chaos.schedule(3, 300, 12, chaos.KINDS)
    assert len(faults) == 24 and {k for _, k in faults[:8]} == set(chaos.KINDS)
    assert all(12 * (i + 1) <= s < 12 * (i + 1) + 6 for i, (s, _) in enumerate(faults))
    assert chaos.schedule(3, 300, 12, chaos.KINDS) == faults  # seeded


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
