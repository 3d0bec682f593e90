"""The efficiency figures a run reports: hardware FLOPs from `dpjax.hlo`'s count of the
compiled step (left out where it cannot be counted), and one table of device peaks, which
experiments/gpu_check.py reads too and writes into its markdown once."""

import importlib.util
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from dpjax.mesh import make_mesh
from dpjax.train import efficiency as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _figures(fn, args, peak=2.0, step_time=1e-3):
    mesh = make_mesh("data=1", jax.devices()[:1])
    model = SimpleNamespace(flops_per_token=lambda: 1e6)
    eff = E.Efficiency(model, mesh, tokens_per_step=100, peak=peak)
    return eff.row(step_time, SimpleNamespace(train=fn), args)


def test_hardware_flops_are_the_programs_matmuls():
    """Five scanned 50 x 40 by 40 x 40 matmuls in 1 ms: 5 x 2 x 50 x 40 x 40 = 8e5 FLOPs,
    8e-4 TFLOP/s (XLA's cost_analysis() counts the loop's body once: 1.6e5)."""

    def layers(w_LxDxD, x_BxD):
        return jax.lax.scan(lambda x, w: (x @ w, None), x_BxD, w_LxDxD)[0]

    fig = _figures(jax.jit(layers), (jnp.ones((5, 40, 40)), jnp.ones((50, 40))))
    assert fig["hw_tflops_per_device"] == 8e-4
    assert fig["hfu"] == fig["hw_tflops_per_device"] / 2.0
    assert fig["tflops_per_device"] == 1e6 * 100 / 1e-3 / 1e12 and fig["mfu"] == 0.05


def test_no_hardware_figure_where_the_program_cannot_be_counted(monkeypatch):
    unknown = {"flops": None, "flops_unknown": ("custom-call __gpu$xla.gpu.triton",), "memory": 1 << 20}
    monkeypatch.setattr(E, "compiled_figures", lambda fn, *args: unknown)
    fig = _figures(jax.jit(jnp.dot), (jnp.ones((4, 4)), jnp.ones((4, 4))))
    assert "hw_tflops_per_device" not in fig and "hfu" not in fig
    assert fig["tflops_per_device"] == 0.1 and fig["mfu"] == 0.05
    assert "hardware" not in E.describe(fig) and E.describe(fig).startswith("0.1 TFLOP/s/device (MFU 5.0%)")


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "experiments", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_reads_dpjaxs_peaks(monkeypatch):
    gc = _load_gpu_check()
    assert gc.peak("NVIDIA H200") == (494.7e12, 450e9)
    assert gc.peak("NVIDIA A100-PCIE-40GB") == (156e12, None)  # no NVLink figure for the PCIe card
    monkeypatch.setitem(E.DEVICE_PEAKS, "H200", {"bfloat16": 2.0, "float32": 1.0, "link": 3.0})
    assert gc.peak("NVIDIA H200") == (1e12, 3e9)  # the same table, not a copy


def test_gpu_check_writes_its_markdown_once(monkeypatch, tmp_path, capsys):
    """One H200, a 1e9-parameter model at 10,000 tokens/s: 6e13 / 494.7e12 = 12.1% MFU."""
    gc = _load_gpu_check()
    monkeypatch.setattr(gc, "devices", lambda smoke: {"n": 1, "platform": "gpu", "kind": "NVIDIA H200",
                                                      "jax": "0.11.2", "params": 10**9})
    monkeypatch.setattr(gc, "train", lambda mesh, args, tmp: {"mesh": mesh, "devices": 1, "tokens_per_s": 1e4})
    out = tmp_path / "gpu.md"
    assert gc.main(["--markdown", str(out)]) == 0
    md = out.read_text()
    assert md.count("### dpjax on 1 x NVIDIA H200") == 1 and md.count("| run | mesh |") == 1
    assert "| one device | 1x1 | 1 | 10,000 | 12.1% |" in md
    printed = capsys.readouterr().out
    assert "| run |" not in printed and str(out) in printed  # stdout says where, the table is in the file
    assert gc.main([]) == 0  # without --markdown the table is printed, once
    assert capsys.readouterr().out.count("| run | mesh |") == 1
