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
