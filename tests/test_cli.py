"""`python -m dpjax.train` never loses a file and always speaks in one line (issue 30):
non-finite flags refused, a NaN loss stops the run naming the last good checkpoint,
--resume with nothing to resume refused, a metrics file never overwritten, argparse's
errors in one line with the closest flag, Ctrl-C naming the checkpoint and the command
that resumes, a second Ctrl-C leaving at once, --help grouped with each default once.

Most cases run `main()` in this process (the same code as `python -m dpjax.train`, without
a JAX start per case); what needs a real process (exit status, signals) runs one."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from dpjax.train import main
from dpjax.train.cli import build_parser
from dpjax.settings import TOPICS

from conftest import read_losses, tiny_gpt


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def _train(*args, timeout=120):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "dpjax.train", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


# --- flags ---------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--lr", "nan"], ["--lr", "inf"], ["--weight-decay", "NaN"], ["--clip-norm=-inf"],
                                   ["--fusion-mb", "inf"], ["--peak-tflops", "nan"]])
def test_non_finite_flags_are_one_line(corpus, capsys, extra):
    # --dry-run: were the value let through, the plan would print and exit 0
    assert main(tiny_gpt(corpus, "--steps", "2", "--dry-run", *extra)) == 2
    name = extra[0].split("=")[0]
    assert f"{name} must be a finite number, got " in _one_error_line(capsys)


def test_lr_0_warns_in_one_line_and_trains(corpus, capsys):
    """--lr 0 is allowed (an evaluation-only run) but rarely meant: it trained 200 flat steps
    in silence. One warning line, whatever --progress says; other rates get none."""
    for lr, warned in (("0", True), ("0.1", False)):
        assert main(tiny_gpt(corpus, "--mesh", "1x1", "--steps", "1", "--lr", lr)) == 0
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
        assert err == (["warning: --lr 0: every update is zero, so the parameters and the loss stay where they "
                        "start (--lr takes the learning rate, e.g. 3e-3)"] if warned else []), err


def test_a_non_finite_value_in_a_config_file_is_one_line(corpus, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("lr = nan\n")  # TOML has nan and inf
    assert main(["--config", str(config), "--data", corpus, "--steps", "2", "--dry-run"]) == 2
    assert "--lr must be a finite number, got nan" in _one_error_line(capsys)


@pytest.mark.parametrize("extra,line", [
    (["--stpes", "5"], "error: unknown flag --stpes; did you mean --steps?"),
    (["--steps", "abc"], "error: --steps: invalid int value: 'abc'"),
    (["--dtype", "bfloat61"], "error: --dtype: unknown value 'bfloat61'; choose one of auto, float32, bfloat16, "
                              "float16, fp8; did you mean bfloat16?"),
    (["--d-modle=64"], "error: unknown flag --d-modle; did you mean --d-model?"),
    (["--steps", "5", "6"], "error: unexpected argument '6' (every setting is a --flag; see --help)"),
])
def test_argparse_errors_are_one_line_with_the_closest_flag(capsys, extra, line):
    assert main(extra) == 2
    assert _one_error_line(capsys) == line


def test_an_unknown_flag_from_the_shell(corpus):
    """The whole stderr of the process is the one line (argparse printed its usage, 36 lines)."""
    r = _train("--data", corpus, "--stpes", "5")
    assert r.returncode == 2 and r.stderr == "error: unknown flag --stpes; did you mean --steps?\n", r.stderr


def _help_entries(text: str) -> dict:
    """{first flag: its help text} of `--help`'s output."""
    entries, flag = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            flag = m.group(1)
            entries[flag] = line[len(m.group(0)):]
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_help_is_grouped_by_topic_and_says_each_default_once():
    from dpjax.models import model_options

    text = build_parser().format_help()
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings[:len(TOPICS) + 1] == ["options", *TOPICS]
    entries = _help_entries(text)
    assert "(default: None)" not in text
    for flag, help_ in entries.items():
        assert help_.lower().count("default") <= 1, (flag, help_)
    assert entries["--steps"].endswith("(default: 200)")
    assert "Default: every device on data" in entries["--mesh"] and "(default" not in entries["--mesh"]
    assert f"(default: {model_options()['gpt']['d_model']})" in entries["--d-model"]  # a model option: its model's


# --- a loss that turns NaN or Inf --------------------------------------------------------


def _diverging(corpus, ckpt, metrics, *extra):
    # warmup from 0: step 0 changes nothing, step 1 multiplies by ~1e27, step 2's loss overflows
    return tiny_gpt(corpus, "--mesh", "1x1", "--lr", "1e30", "--warmup-steps", "1000", "--steps", "8",
                    "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--metrics", str(metrics), *extra)


def _latest(ckpt):
    from dpjax.recovery.checkpoint import Checkpointer

    c = Checkpointer(str(ckpt))
    try:
        return c.latest_step()
    finally:
        c.close()


def test_a_nan_loss_stops_the_run_naming_the_last_good_checkpoint(corpus, tmp_path, capsys):
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    assert main(_diverging(corpus, ckpt, path)) == 2
    assert _one_error_line(capsys).startswith(
        f"error: the loss is nan at step 3: stopped; the last good checkpoint is step 1 in {ckpt} (the one of step 2 "
        "is set aside as nonfinite-2). A learning rate too high")
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # no step after it ran
    assert rows[-1] == {"event": "non_finite_loss", "step": 3, "value": "nan"}
    # the checkpoint of step 2 (its state gave the nan) is kept, but not where --resume looks
    assert _latest(ckpt) == 1 and (ckpt / "nonfinite-2").is_dir()


def test_a_state_that_is_not_finite_is_never_saved(corpus, tmp_path, capsys):
    """lr x weight decay overflows float32: step 2's update makes the parameters inf/nan
    while its loss (computed before the update) is still finite."""
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    assert main(tiny_gpt(corpus, "--mesh", "1x1", "--optimizer", "adamw", "--lr", "1e38", "--weight-decay", "100",
                         "--warmup-steps", "1", "--steps", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "1",
                         "--metrics", str(path))) == 2
    assert _one_error_line(capsys).startswith(
        "error: the update of step 2 turned the parameters or optimizer state NaN or Inf (not saved): stopped; the "
        f"last good checkpoint is step 1 in {ckpt}.")
    assert _latest(ckpt) == 1 and not (ckpt / "2").exists()


# --- resuming, starting fresh, the metrics file ----------------------------------------


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_resume_with_nothing_to_resume_is_one_line(corpus, tmp_path, capsys, folder):
    ckpt, path = tmp_path / folder, tmp_path / "m.jsonl"
    if folder == "empty":
        ckpt.mkdir()
    path.write_text('{"step": 0, "loss": 1.0}\n')  # the run --resume meant to continue
    assert main(tiny_gpt(corpus, "--mesh", "1x1", "--steps", "2", "--ckpt-dir", str(ckpt), "--metrics", str(path),
                         "--resume")) == 2
    state = "does not exist" if folder == "missing" else "holds no checkpoint"
    assert _one_error_line(capsys) == (f"error: --resume: nothing to resume, --ckpt-dir {ckpt} {state}; check the "
                                       "path, or leave out --resume to start a fresh run")
    assert path.read_text() == '{"step": 0, "loss": 1.0}\n'  # untouched
    assert ckpt.exists() == (folder == "empty")  # a misspelled folder is not made


def test_an_existing_metrics_file_is_refused_replaced_only_when_asked_and_appended_on_resume(corpus, tmp_path,
                                                                                            capsys):
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n')
    base = tiny_gpt(corpus, "--mesh", "1x1", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--metrics", str(path))
    assert main(base + ["--steps", "2"]) == 2
    assert _one_error_line(capsys) == (f"error: --metrics {path} already exists (1 rows); pass --resume to continue "
                                       "that run (its rows are appended to), --overwrite to replace it, or another "
                                       "--metrics file")
    assert path.read_text() == '{"step": 0, "loss": 1.0}\n' and not ckpt.exists()
    assert main(base + ["--steps", "2", "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"starting fresh at step 0: no checkpoint in --ckpt-dir {ckpt}" in out  # a fresh run says so
    rows = [json.loads(line) for line in open(path)]
    assert "record" in rows[0] and [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert main(base + ["--steps", "4", "--resume"]) == 0
    rows = [json.loads(line) for line in open(path)]
    assert sum("record" in r for r in rows) == 2 and [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_an_agent_restart_resumes_and_appends_its_first_start_is_fresh(corpus, tmp_path, capsys, monkeypatch):
    """Under dpjax.agent the command is the same at every attempt: its first start with
    --resume and nothing saved is a fresh start, and a restart (DPJAX_RESTART > 0) resumes
    from the checkpoints and appends to the metrics without --resume."""
    from dpjax.recovery.env import ENV

    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    base = tiny_gpt(corpus, "--mesh", "1x1", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--metrics", str(path))
    monkeypatch.setenv(ENV["restart"], "0")
    assert main(base + ["--steps", "2", "--resume"]) == 0
    assert "starting fresh at step 0: nothing saved or committed yet" in capsys.readouterr().out
    monkeypatch.setenv(ENV["restart"], "1")
    assert main(base + ["--steps", "4"]) == 0
    assert [json.loads(line)["step"] for line in open(path) if '"loss"' in line] == [1, 2, 3, 4]


# --- Ctrl-C ------------------------------------------------------------------------------


# `python -m dpjax.train` as a terminal starts it, SIGINT at its default: a test run as a shell's
# background job hands its children SIGINT ignored, and dpjax leaves an ignored SIGINT ignored
# while it imports (a background job's Ctrl-C is not its own). exec keeps SIG_DFL.
_AS_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.executable, [sys.executable, '-m', 'dpjax.train', *sys.argv[1:]])")


def _start(args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", _AS_A_TERMINAL, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_a_step(path, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path) and read_losses(path):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("no step in time")


def _jax_loading(pid) -> bool:
    """Whether process `pid` has jaxlib's library mapped: `import dpjax` is importing JAX."""
    with open(f"/proc/{pid}/maps") as fh:
        return "jaxlib" in fh.read()


@pytest.mark.parametrize("moment", ["importing", "compiling the initialisation", "compiling the first step"])
def test_ctrl_c_at_any_moment_before_the_first_step_exits_130_in_one_line(corpus, tmp_path, moment):
    """Ctrl-C while the package imports (it printed a traceback and died by SIGINT, or was
    lost), while XLA compiles (the process segfaulted, 139, after the right line: the compile
    went on in XLA's threads under the interpreter's teardown; on 8 devices, not on 1) and
    while the first step compiles (the first Ctrl-C waited for the compile and the step):
    status 130, one line, no step run."""
    path = tmp_path / "m.jsonl"
    # 12 layers as a Python loop: seconds of compiling (stopped at once, so they cost nothing), so
    # that the Ctrl-C lands in the compile even when this test's process runs late on a loaded
    # machine (it also lands in jax's gc callback there, which drops a KeyboardInterrupt:
    # dpjax.interrupt.check raises it again)
    proc = _start(tiny_gpt(corpus, "--mesh", "8x1", "--steps", "100", "--n-layers", "12", "--layer-loop",
                           "--metrics", str(path), "--progress", "log"))
    seen = []
    if moment == "importing":
        while not _jax_loading(proc.pid):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
    elif moment == "compiling the initialisation":
        while not seen or not seen[-1].startswith("compiling the initialisation and the training step (gpt: "):
            seen.append(proc.stdout.readline())
            assert seen[-1], proc.communicate()
        time.sleep(0.5)  # tracing done, XLA compiling (the moment it crashed)
    else:  # the loop began (its first row, the run record, is written): the first step compiles
        while not (path.exists() and path.read_text().strip()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    out = "".join(seen) + out
    assert proc.returncode == 130, (out, err)
    assert err.splitlines() == ["interrupted before training began: nothing was saved"], err
    assert ("devices:" in out) == (moment != "importing"), out
    assert not (path.exists() and read_losses(path))


def test_ctrl_c_names_the_checkpoint_and_the_command_that_resumes(corpus, tmp_path):
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = tiny_gpt(corpus, "--mesh", "1x1", "--steps", "300", "--ckpt-dir", str(ckpt), "--ckpt-every", "1000",
                    "--metrics", str(path))
    proc = _start(args)
    _wait_for_a_step(path, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    last = out.strip().splitlines()[-1]
    m = re.match(r"interrupted: (\d+) steps .*; saved step (\d+) in (\S+); resume with: (.*)$", last)
    assert m and m.group(1) == m.group(2) and m.group(3) == str(ckpt), last
    command = shlex.split(m.group(4))
    assert command[0] in ("python", sys.executable) and command[1:] == ["-m", "dpjax.train", *args, "--resume"]
    assert _latest(ckpt) == int(m.group(2))


def test_a_second_ctrl_c_leaves_at_once_without_a_traceback(corpus, tmp_path):
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = _start(tiny_gpt(corpus, "--mesh", "1x1", "--steps", "100000", "--ckpt-dir", str(ckpt), "--ckpt-every",
                           "100000", "--metrics", str(path)))
    _wait_for_a_step(path, proc)
    proc.send_signal(signal.SIGINT)
    first = []
    while not first or not first[-1].startswith("Ctrl-C: "):  # the first one is taken: finishing and saving
        first.append(proc.stderr.readline())
        assert first[-1], first
    assert first[-1] == "Ctrl-C: finishing the step and saving; Ctrl-C again stops at once\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == [
        "interrupted again: stopped at once, without waiting for the save"], err
