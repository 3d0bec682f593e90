"""What a run writes about itself: efficiency figures (the model's FLOP count against the
compiled program's, TFLOP/s per device, MFU with a peak, peak memory), the run record
(first metrics row and run.json; fed back with --config it repeats the run bit for bit),
TensorBoard event files read back by hand, and --profile-dir's raw capture."""

import glob
import json
import os
import struct
import sys

import jax
import numpy as np
import pytest

from dpjax.train import main

from conftest import read_losses


def tiny(corpus, *extra):
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "8", "--seq-len", "16",
            "--batch-size", "8", "--data", corpus, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", *extra]


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_model_flops_match_the_compiled_program():
    """The default GPT's `flops_per_token()` x tokens against XLA's count of the
    compiled step on one device: within 10% (XLA also counts the optimizer, softmax,
    layer norms and the loss; the model counts matmuls and attention only)."""
    from dpjax import step as S
    from dpjax.data import SyntheticStream
    from dpjax.plan import resolve
    from dpjax.settings import Settings
    from dpjax.train.efficiency import compiled_figures

    s = Settings(mesh="1x1", data="synthetic", batch_size=8)
    plan = resolve(s, jax.devices()[:1])
    step = S.for_plan(plan)
    params, state = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    batch = S.put_batch(SyntheticStream(s.seq_len), 0, s.batch_size, plan.mesh, passes=1)
    hw = compiled_figures(step.train, params, state, batch)
    model = plan.model.flops_per_token() * s.batch_size * s.seq_len
    assert abs(hw["flops"] / model - 1) < 0.10, (hw["flops"], model)
    mem = step.train.lower(params, state, batch).compile().memory_analysis()
    assert hw["memory"] == (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                            - mem.alias_size_in_bytes) > 0


def test_metrics_and_summary_carry_efficiency(corpus, tmp_path, capsys):
    from dpjax.models import get_model

    path = tmp_path / "m.jsonl"
    peak = 0.002  # TFLOP/s: a made-up peak, so that the MFU is a readable fraction on CPU
    assert main(tiny(corpus, "--mesh", "2x2", "--steps", "3", "--metrics", str(path),
                     "--peak-tflops", str(peak))) == 0
    model = get_model("gpt", seq_len=16, d_model=32, n_layers=1, n_heads=8)
    train = [r for r in rows(path) if "loss" in r]
    for r in train:  # the model's FLOPs of the step's tokens, shared by the 4 devices, over its time
        want = model.flops_per_token() * 8 * 16 / 4 / r["step_time"] / 1e12
        np.testing.assert_allclose(r["tflops_per_device"], want, rtol=1e-3)
        np.testing.assert_allclose(r["mfu"], r["tflops_per_device"] / peak, rtol=1e-3)
        assert r["hw_tflops_per_device"] > 0 and r["hfu"] > 0
        assert r["peak_memory_bytes"] > 0  # on CPU: the compiled step's own need
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "TFLOP/s/device (MFU " in last and "peak memory" in last
    # on CPU no peak is known: no MFU unless one is given (the file replaced: a fresh run would be refused)
    assert main(tiny(corpus, "--mesh", "2x2", "--steps", "2", "--metrics", str(path), "--overwrite")) == 0
    train = [r for r in rows(path) if "loss" in r]
    assert all("tflops_per_device" in r and "mfu" not in r and "hfu" not in r for r in train)
    assert "MFU" not in capsys.readouterr().out


def test_mfu_is_against_the_peak_of_the_compute_dtype(corpus, tmp_path, monkeypatch):
    """A bf16 run's MFU divides by the table's bf16 peak, not its float32 (TF32) one: on the
    H200 the summary said MFU 91.6% at 453 TFLOP/s (494.7, TF32's peak) for 45.8% (989.4).
    The table gets an entry for this CPU's device kind with the two peaks apart."""
    from dpjax.train import efficiency as E

    monkeypatch.setitem(E.DEVICE_PEAKS, jax.devices()[0].device_kind, {"bfloat16": 0.004, "float32": 0.002})
    path = tmp_path / "m.jsonl"
    assert main(tiny(corpus, "--mesh", "1x1", "--steps", "2", "--dtype", "bfloat16", "--metrics", str(path))) == 0
    train = [r for r in rows(path) if "loss" in r]
    assert train and all(r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.004, rel=1e-3) for r in train)


def test_peak_table_reads_device_kinds():
    from dpjax.train.efficiency import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 156.0
    assert peak_tflops("cpu") is None


def test_the_record_comes_first_and_repeats_the_run(corpus, tmp_path):
    ckpt, path = tmp_path / "ckpt", tmp_path / "a.jsonl"
    first = tiny(corpus, "--mesh", "2x2", "--steps", "4", "--seed", "3", "--optimizer", "momentum",
                 "--lr", "0.05", "--metrics", str(path), "--ckpt-dir", str(ckpt), "--ckpt-every", "2")
    assert main(first) == 0
    recs = rows(path)
    record = recs[0]["record"]  # the first row
    assert record["settings"]["seed"] == 3 and record["settings"]["model_options"]["d_model"] == 32
    assert record["plan"]["mesh"] == {"data": 2, "model": 2} and record["devices"]["count"] == 4
    assert record["processes"] == 1 and record["versions"]["jax"] == jax.__version__
    assert record["git"] is None or len(record["git"]["commit"]) == 40
    assert json.load(open(ckpt / "run.json")) == record
    # fed back: the same losses, bit for bit (the outputs moved aside by flags)
    for i, config in enumerate((ckpt / "run.json", path)):
        again = tmp_path / f"b{i}.jsonl"
        assert main(["--config", str(config), "--metrics", str(again), "--ckpt-dir", str(tmp_path / f"c{i}")]) == 0
        assert read_losses(again) == read_losses(path)
        assert rows(again)[0]["record"]["settings"] == {**record["settings"], "metrics": str(again),
                                                        "ckpt_dir": str(tmp_path / f"c{i}")}


def test_a_toml_config_and_flags_over_it(corpus, tmp_path, capsys):
    from dpjax.train.cli import parse_args

    toml = tmp_path / "run.toml"
    toml.write_text(f'mesh = "2x1"\nsteps = 2\nbatch_size = 4\nseq_len = 16\ndata = "{corpus}"\nd_model = 16\n'
                    '[model_options]\nn_layers = 1\n')
    s = parse_args(["--config", str(toml), "--steps", "5", "--d-model", "24"])
    assert (s.mesh, s.steps, s.batch_size, s.data) == ("2x1", 5, 4, corpus)  # the flag wins
    assert s.model_options == {"d_model": 24, "n_layers": 1}
    toml.write_text('mesh = "2x1"\nstepz = 2\n')
    assert main(["--config", str(toml)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --config {toml}: unknown setting 'stepz' (python -m dpjax.train --help lists them)"


def read_events(folder) -> list:
    """Every Event in the folder's event files, read as TFRecords by hand: 8-byte length,
    4-byte masked CRC, the Event proto, 4-byte masked CRC (tensorboardX has no reader)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for name in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
        data = open(name, "rb").read()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            out.append(Event.FromString(data[at + 12:at + 12 + n]))
            at += 12 + n + 4
    return out


def test_tensorboard_scalars_read_back(corpus, tmp_path):
    pytest.importorskip("tensorboardX",
                        reason="the dev extra installs tensorboardX; without it --tensorboard cannot write")
    tb, path = tmp_path / "tb", tmp_path / "m.jsonl"
    assert main(tiny(corpus, "--mesh", "2x1", "--steps", "3", "--metrics", str(path), "--tensorboard", str(tb))) == 0
    scalars = {}
    for ev in read_events(tb):
        for v in ev.summary.value:
            scalars.setdefault(v.tag, {})[ev.step] = (v.simple_value if v.HasField("simple_value")
                                                      else v.tensor.string_val[0].decode())
    want = {r["step"]: r for r in rows(path) if "loss" in r}
    assert scalars["train/loss"] == {i: np.float32(r["loss"]) for i, r in want.items()}
    assert scalars["efficiency/tflops_per_device"] == {i: np.float32(r["tflops_per_device"]) for i, r in want.items()}
    assert scalars["eval/eval_loss"] == {3: np.float32(rows(path)[-1]["eval_loss"])}
    text = scalars["run_record/text_summary"][0].strip("`\n")  # the record, as text
    assert json.loads(text) == rows(path)[0]["record"]


def test_tensorboard_without_tensorboardx_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    assert main(tiny(corpus, "--mesh", "2x1", "--steps", "2", "--tensorboard", str(tmp_path / "tb"))) == 2
    assert capsys.readouterr().err.strip() == ("error: --tensorboard needs tensorboardX: pip install tensorboardX "
                                               "(or pip install 'dpjax[tensorboard]')")


def test_profile_dir_keeps_the_raw_capture(corpus, tmp_path):
    keep = tmp_path / "prof"
    assert main(tiny(corpus, "--mesh", "2x1", "--steps", "3", "--timeline", str(tmp_path / "t.json"),
                     "--timeline-steps", "1", "--profile-dir", str(keep))) == 0
    assert glob.glob(str(keep / "plugins" / "profile" / "*" / "*.xplane.pb"))  # what XProf / TensorBoard open
    assert os.path.getsize(tmp_path / "t.json") > 0


def test_a_yaml_config_reads_as_its_toml_twin_and_a_bad_one_is_one_line(corpus, tmp_path, capsys):
    """YAML's own types come through as the flags' (3e-4, which YAML 1.1 reads as text, is
    the float; mesh 8, read as a number, is the text '8'); a file YAML cannot parse is one line."""
    from dpjax.train.cli import parse_args

    yml = tmp_path / "run.yaml"
    yml.write_text(f"mesh: 8\nsteps: 2\nlr: 3e-4\nlr-schedule: cosine\nfsdp: true\ndata: {corpus}\n"
                   "link: [node=1ms]\nmodel_options:\n  n_layers: 1\nd_model: 16\n")
    s = parse_args(["--config", str(yml), "--steps", "5"])
    assert (s.mesh, s.steps, s.lr, s.lr_schedule, s.fsdp, s.data, s.link) == \
        ("8", 5, 3e-4, "cosine", True, corpus, ["node=1ms"])
    assert s.model_options == {"d_model": 16, "n_layers": 1}
    yml.write_text("steps: [2\n")
    assert main(["--config", str(yml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {yml}: not valid YAML (") and err.count("\n") == 1
