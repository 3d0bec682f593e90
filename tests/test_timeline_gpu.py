"""Timelines of GPU captures (`dpjax.timeline.gpu`, `python -m dpjax.timeline build`), on
the H200 fixture (tests/fixtures/h200: two profiled steps of the main job, one capture
with CUDA command buffers, one without). Every expectation is read from the raw trace
here with plain json (the kernels, split at the host's `dpjax:step(2)` annotation) or
from the program's HLO text with a regular expression, not from the code under test."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from dpjax import timeline
from dpjax.timeline import build, main, summarize

FIXTURE = Path(__file__).parent / "fixtures" / "h200"
SESSIONS = FIXTURE / "raw" / "plugins" / "profile"
BUFFERED = SESSIONS / "2026_11_26_05_14_03"  # with CUDA command buffers
PLAIN = SESSIONS / "2026_11_26_05_14_35"  # XLA_FLAGS=--xla_gpu_enable_command_buffer=
HLO = FIXTURE / "program1.hlo.txt"  # the step of PLAIN's run
KERNELS_PER_STEP = 193  # counted by hand in both captures (command_buffer::execute says num_commands 193)
# ts and dur are written rounded to 1e-3 us: each end of an interval moves by at most 1.5e-3
ROUNDING_US = 1.5e-3


def _raw(session: Path) -> list[dict]:
    with gzip.open(session / "perfetto_trace.json.gz") as fh:
        return json.load(fh)["traceEvents"]


def _kernels_by_step(session: Path) -> dict:
    """step -> the kernels (events of the GPU process that carry hlo_op) the device ran for
    it: those that started before the host's step(2) annotation began are step 1's."""
    raw = _raw(session)
    gpu = {e["pid"] for e in raw if e.get("ph") == "M" and e["name"] == "process_name"
           and e["args"]["name"] == "/device:GPU:0"}
    step2 = next(e["ts"] for e in raw if e.get("name") == "dpjax:step(2)")
    out = {1: [], 2: []}
    for e in raw:
        if e.get("ph") == "X" and e["pid"] in gpu and "hlo_op" in e.get("args", {}):
            out[1 if e["ts"] < step2 else 2].append(e)
    return out


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _phase_of_hlo(hlo_text: str) -> dict:
    """hlo op name -> its innermost dpjax phase ("other" when none), read from the text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%(\S+) = (.*)$", hlo_text, re.M):
        op_name = re.search(r'op_name="([^"]*)"', m.group(2))
        phases = re.findall(r"dpjax:phase\((\w+)\)", op_name.group(1) if op_name else "")
        out[m.group(1)] = phases[-1] if phases else "other"
    return out


@pytest.fixture(scope="module")
def plain():
    data = build(_raw(PLAIN), [timeline.Program.from_text(HLO.read_text())])
    return data, [e for e in data["traceEvents"] if e["ph"] == "X"]


@pytest.fixture(scope="module")
def buffered():
    data = build(_raw(BUFFERED), [timeline.Program.from_text(HLO.read_text())])
    return data, [e for e in data["traceEvents"] if e["ph"] == "X"]


@pytest.mark.parametrize("which", ["plain", "buffered"])
def test_each_step_holds_its_kernels_on_the_gpu(which, request):
    data, ev = request.getfixturevalue(which)
    session = PLAIN if which == "plain" else BUFFERED
    kernels = _kernels_by_step(session)
    assert [len(kernels[s]) for s in (1, 2)] == [KERNELS_PER_STEP] * 2
    assert data["otherData"]["steps"] == [1, 2] and data["otherData"]["platform"] == "gpu"
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "host"), (1, "device 0")}
    ops = [e for e in ev if e["args"].get("type") == "op"]
    assert {e["pid"] for e in ops} == {1}  # every kernel on the GPU's track
    for step in (1, 2):
        mine = [e for e in ops if e["args"]["step"] == step]
        raw = kernels[step]
        # the same kernels: by op (without command buffers) or by kernel name (with them)
        key = (lambda e: e["args"]["hlo_op"]) if which == "plain" else (lambda e: e["name"])
        assert Counter(e["name"] for e in mine) == Counter(key(e) for e in raw)
        assert sum(e["dur"] for e in mine) == pytest.approx(sum(e["dur"] for e in raw), abs=ROUNDING_US * len(raw))
        (run,) = [e for e in ev if e["args"].get("type") == "run" and e["args"]["step"] == step]
        assert run["pid"] == 1
        assert run["dur"] == pytest.approx(max(e["ts"] + e["dur"] for e in raw) - min(e["ts"] for e in raw),
                                           abs=2 * ROUNDING_US)


def test_ops_carry_the_phases_of_the_program(plain):
    _, ev = plain
    phase_of = _phase_of_hlo(HLO.read_text())
    kernels = _kernels_by_step(PLAIN)
    for step in (1, 2):
        want = Counter(phase_of[e["args"]["hlo_op"]] for e in kernels[step])
        assert set(want) == {"forward_backward", "optimizer", "other"}
        spans = sorted((e["ts"], e["args"]["phase"]) for e in ev
                       if e["args"].get("type") == "phase" and e["args"]["step"] == step)
        got = Counter()
        for e in ev:
            if e["args"].get("type") == "op" and e["args"]["step"] == step:
                got[[p for ts, p in spans if ts <= e["ts"]][-1]] += 1  # the phase span it starts in
        assert got == want


def test_summary_of_the_plain_capture(plain):
    data, _ = plain
    s = summarize(data)
    kernels = _kernels_by_step(PLAIN)
    assert [r["step"] for r in s.steps] == [1, 2] and s.notes == []
    for row in s.steps:
        raw = kernels[row["step"]]
        span = max(e["ts"] + e["dur"] for e in raw) - min(e["ts"] for e in raw)
        busy = _union_length((e["ts"], e["ts"] + e["dur"]) for e in raw)
        assert row["time"] == pytest.approx(span, abs=2 * ROUNDING_US)
        assert row["compute"] == pytest.approx(busy, abs=2 * ROUNDING_US * len(raw))
        assert row["comm"] == 0 and row["wait"] == 0 and row["comm_fraction"] == 0  # one GPU: no collective
        assert row["gap"] == pytest.approx(span - busy, abs=2 * ROUNDING_US * len(raw))
    assert {r["phase"] for r in s.phases if r["where"] == "device"} == {"forward_backward", "optimizer", "other"}
    assert {r["phase"] for r in s.phases if r["where"] == "host"} == {"data", "dispatch", "host_wait"}


def test_command_buffer_kernels_go_to_their_step_with_a_note(buffered):
    data, ev = buffered
    kernels = _kernels_by_step(BUFFERED)
    assert {e["args"]["hlo_op"] for s in (1, 2) for e in kernels[s]} == {"command_buffer_1"}
    phases = [e for e in ev if e["args"].get("type") == "phase"]
    assert sorted((e["args"]["step"], e["args"]["phase"]) for e in phases) == [(1, "command buffer"),
                                                                              (2, "command buffer")]
    assert all(e["args"]["hlo_op"] == "command_buffer_1" and e["args"]["kind"] == "compute"
               for e in ev if e["args"].get("type") == "op")
    s = summarize(data)
    for row in s.steps:
        raw = kernels[row["step"]]
        busy = _union_length((e["ts"], e["ts"] + e["dur"]) for e in raw)
        assert row["compute"] == pytest.approx(busy, abs=2 * ROUNDING_US * len(raw))
    (note,) = s.notes
    assert f"{KERNELS_PER_STEP} kernels per device and step" in note and "--xla_gpu_enable_command_buffer=" in note
    assert f"note: {note}" in timeline.render(s)


def test_kernels_without_their_launch_go_to_the_run_begun_before_them():
    """Without the host's launch events (no correlation), each kernel belongs to the last
    Execute of its program begun before it ran: the same steps, the same kernels."""
    raw = [e for e in _raw(BUFFERED) if not (e.get("pid") != 1 and "correlation_id" in e.get("args", {}))]
    data = build(raw, [timeline.Program.from_text(HLO.read_text())])
    ops = Counter(e["args"]["step"] for e in data["traceEvents"] if e["ph"] == "X" and e["args"].get("type") == "op")
    assert ops == {1: KERNELS_PER_STEP, 2: KERNELS_PER_STEP}


def _x(pid, title, ts, dur, tid=7, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": title, "ts": ts, "dur": dur, "args": args}


def _two_runs(kernels: list[tuple]) -> list[dict]:
    """A trace in the fixture's layout: host steps 0 and 1, each launching a run of jit_f
    (run a at 1-9, run b at 21-29); kernels (name, hlo_op, launched at, runs at, dur)."""
    host, gpu = 701, 1
    events = [{"ph": "M", "pid": gpu, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": host, "name": "process_name", "args": {"name": "/host:CPU"}},
              _x(host, "dpjax:step(0)", 0, 12), _x(host, "dpjax:step(1)", 20, 12),
              _x(host, "CommonPjRtLoadedExecutable::Execute (jit_f)", 1, 8, name="jit_f", run_id="a"),
              _x(host, "CommonPjRtLoadedExecutable::Execute (jit_f)", 21, 8, name="jit_f", run_id="b")]
    for corr, (name, hlo, launched, ts, dur) in enumerate(kernels):
        events += [_x(host, name, launched, 0.5, correlation_id=str(corr), device_id="0"),
                   _x(gpu, name, ts, dur, tid=14, hlo_module="jit_f", hlo_op=hlo, correlation_id=str(corr))]
    return events


def test_a_kernel_belongs_to_the_run_that_launched_it_even_when_it_runs_later():
    """Asynchronous dispatch: run a is launched in step 0 and its kernel runs during step 1
    (after run b's Execute began); correlation ids, not times, say whose it is, and its
    step is the one its launch lay in."""
    events = _two_runs([("fusion_1", "fusion.1", 5, 25, 3), ("fusion_1", "fusion.1", 22, 40, 3)])
    data = build(events, [timeline.Program("jit_f", {"fusion.1": ("fusion", "")})])
    ops = sorted((e["ts"], e["args"]["step"]) for e in data["traceEvents"]
                 if e["ph"] == "X" and e["args"].get("type") == "op")
    assert ops == [(25, 0), (40, 1)]  # ts relative to the first event (0)


def test_nccl_kernels_in_a_command_buffer_are_communication():
    """Inside a command buffer no op is named, but an NCCL kernel is still communication:
    per step 2 us of compute, then 3 us of an allreduce kernel."""
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    events = _two_runs([("loop_add_fusion", "command_buffer_1", 2, 10, 2), (nccl, "command_buffer_1", 2, 12, 3),
                        ("loop_add_fusion", "command_buffer_1", 22, 30, 2), (nccl, "command_buffer_1", 22, 32, 3)])
    s = summarize(build(events, [timeline.Program("jit_f", {})]))
    assert [(r["step"], r["time"], r["compute"], r["comm"]) for r in s.steps] == [(0, 5, 2, 3), (1, 5, 2, 3)]
    assert s.steps[0]["comm_fraction"] == pytest.approx(3 / 5)


def test_copies_outside_the_program_are_shown_apart(plain):
    _, ev = plain
    raw = [e for e in _raw(PLAIN) if e.get("ph") == "X" and e["pid"] == 1 and "hlo_op" not in e.get("args", {})]
    sizes = Counter((e["name"], int(re.search(r"size:(\d+)", e["args"]["memcpy_details"]).group(1))) for e in raw)
    assert sizes == {("MemcpyH2D", 16512): 2, ("MemcpyD2H", 4): 2}  # the batch in, the loss out
    outside = [e for e in ev if e["args"].get("type") == "outside"]
    assert Counter((e["name"], e["args"]["bytes"]) for e in outside) == sizes
    assert {(e["pid"], e["tid"]) for e in outside} == {(1, 99)}


def test_cli_builds_from_a_capture_and_summarises_it(tmp_path, capsys):
    out = tmp_path / "gpu.trace.json"
    assert main(["build", str(PLAIN), "--hlo", str(HLO), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per step" in printed and f"wrote {out}" in printed
    assert timeline.load(str(out))["otherData"]["steps"] == [1, 2]
    assert main([str(out)]) == 0
    assert re.search(r"^1\s", capsys.readouterr().out, re.M)
    assert main(["build", str(BUFFERED), "--hlo", str(HLO), "-o", str(tmp_path / "b.json.gz")]) == 0
    assert "note: 193 kernels per device and step ran inside CUDA command buffers" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    png = tmp_path / "gpu.png"
    assert main([str(out), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_finds_the_program_kept_beside_the_capture(tmp_path, capsys):
    session = tmp_path / "plugins" / "profile" / PLAIN.name
    shutil.copytree(PLAIN, session)
    shutil.copy(HLO, session / "program0.hlo.txt")  # as a Recorder with keep= leaves it
    assert main(["build", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 0
    assert timeline.load(str(tmp_path / "t.json"))["otherData"]["steps"] == [1, 2]


def test_a_kept_recorder_capture_builds_again_without_hlo(tmp_path, capsys):
    """`--profile-dir`: the Recorder keeps the step's HLO text beside its capture."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((64, 64))
    step(x).block_until_ready()
    keep = tmp_path / "profile"
    rec = timeline.Recorder(keep=str(keep))
    rec.program(step, x)
    with rec.profile():
        for i in (3, 4):
            with rec.step(i):
                step(x).block_until_ready()
    rec.write(str(tmp_path / "first.json"))
    (session,) = (keep / "plugins" / "profile").iterdir()
    assert (session / "program0.hlo.txt").read_text() == timeline.compiled_text(step, x)
    assert main(["build", str(keep), "-o", str(tmp_path / "again.json")]) == 0
    assert timeline.load(str(tmp_path / "again.json"))["otherData"]["steps"] == [3, 4]


def test_a_train_run_with_profile_dir_builds_again_without_hlo(corpus, tmp_path, capsys):
    """`python -m dpjax.train --timeline T --profile-dir DIR`, then `build DIR`: the same
    timeline as the run wrote, from the kept capture and its kept HLO alone."""
    from conftest import tiny_gpt

    from dpjax.train import main as train

    keep, first, again = tmp_path / "prof", tmp_path / "t.json", tmp_path / "again.json"
    assert train(tiny_gpt(corpus, "--mesh", "2x1", "--steps", "3", "--timeline", str(first), "--timeline-steps",
                          "1", "--profile-dir", str(keep))) == 0
    assert main(["build", str(keep), "-o", str(again)]) == 0
    built, ran = timeline.load(str(again)), timeline.load(str(first))
    # the second step (steps count from 1, as the console does)
    assert built["otherData"]["steps"] == ran["otherData"]["steps"] == [2]
    assert built["traceEvents"] == ran["traceEvents"]


@pytest.mark.parametrize("case, says", [
    ("missing dir", "no capture folder"),
    ("no trace", "holds no perfetto_trace.json.gz"),
    ("two captures", "holds 2 captures; name one"),
    ("no hlo", "no program text beside the capture"),
    ("missing hlo", "no HLO file"),
    ("not hlo", "is not compiled HLO text"),
    ("other program", "the capture ran no program 'jit_other'"),
    ("bad trace", "is not a readable trace"),
])
def test_cli_build_refuses_bad_input_in_one_line(case, says, tmp_path, capsys):
    capture, hlo = str(PLAIN), [str(HLO)]
    if case == "missing dir":
        capture = str(tmp_path / "nowhere")
    elif case == "no trace":
        capture = str(FIXTURE)
    elif case == "two captures":
        capture = str(FIXTURE / "raw")
    elif case == "no hlo":
        hlo = []
    elif case == "missing hlo":
        hlo = [str(tmp_path / "none.txt")]
    elif case == "not hlo":
        hlo = [str(FIXTURE / "README.md")]
    elif case == "other program":
        text = HLO.read_text().replace("HloModule jit_train_body", "HloModule jit_other", 1)
        (tmp_path / "other.txt").write_text(text)
        hlo = [str(tmp_path / "other.txt")]
    elif case == "bad trace":
        (tmp_path / "perfetto_trace.json.gz").write_bytes(b"not gzip")
        capture = str(tmp_path)
    argv = ["build", capture, *[a for h in hlo for a in ("--hlo", h)], "-o", str(tmp_path / "out.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out.json").exists()
