"""The GPU install's checks that run anywhere: the line a run starts with, the warning
when a GPU is visible but JAX runs on the CPU, the GPU check script's arithmetic
(against hand-computed figures) and its smoke mode on CPU."""

import importlib.util
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest


from dpjax.train import hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "experiments", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dev(platform, kind):
    return SimpleNamespace(platform=platform, device_kind=kind)


def test_the_devices_line():
    assert hardware.devices_line([_dev("cpu", "cpu")] * 8, 2) == "devices: 8 x cpu (simulated) in 2 processes"
    assert hardware.devices_line([_dev("cpu", "cpu")], 1) == "devices: 1 x cpu in 1 process"
    h100 = _dev("gpu", "NVIDIA H100 80GB HBM3")
    assert hardware.devices_line([h100] * 8, 1) == "devices: 8 x NVIDIA H100 80GB HBM3 (gpu) in 1 process"


def test_a_visible_gpu_with_cpu_jax_is_a_warning_with_the_install_line(monkeypatch):
    cpu, gpu = [_dev("cpu", "cpu")], [_dev("gpu", "NVIDIA H100 80GB HBM3")]
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    warning = hardware.cpu_but_gpu_warning(cpu)
    assert warning.startswith("warning: this machine has a GPU (nvidia-smi is on PATH) but JAX runs on the CPU")
    assert 'pip install -e ".[cuda]"' in warning and "\n" not in warning
    assert hardware.cpu_but_gpu_warning(gpu) is None  # JAX has the GPU: nothing to say
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the CPU on purpose
    assert hardware.cpu_but_gpu_warning(cpu) is None
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    monkeypatch.setattr(hardware.os.path, "exists", lambda path: False)
    assert hardware.cpu_but_gpu_warning(cpu) is None  # no GPU anywhere


def test_the_check_scripts_arithmetic():
    """1e9 parameters at 10,000 tokens/s on 8 H100s: 6e13 / (8 x 494.7e12) = 1.516% MFU;
    225 GB/s of bus bandwidth is half of NVLink 4's 450 GB/s per direction."""
    gc = _load_gpu_check()
    dev = {"n": 8, "platform": "gpu", "kind": "NVIDIA H100 80GB HBM3", "jax": "0.10.2"}
    runs = [{"name": "main job", "mesh": "8x1", "devices": 8, "tokens_per_s": 10_000.0}]
    coll = [{"size_bytes": 4 << 20, "algorithm": "psum", "label": "psum", "busbw_GBps": 225.0},
            {"size_bytes": 4 << 20, "algorithm": "ring", "label": "ring", "busbw_GBps": 180.0},
            {"size_bytes": 4 << 20, "algorithm": "tree", "label": "tree", "busbw_GBps": 90.0}]
    md = gc.markdown(dev, 10**9, runs, coll, SimpleNamespace(smoke=False, steps=60, skip=10))
    assert "| main job | 8x1 | 8 | 10,000 | 1.5% |" in md
    assert "| 4,096 KiB | 225.00 | 50.0% | ring | 180.00 | 40.0% |" in md
    assert gc.peak("NVIDIA Tesla T4") == (None, None)


@pytest.mark.slow  # four processes that start JAX: about 25 s on two idle cores
def test_the_gpu_check_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_check.py"), "--smoke",
                        "--markdown", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    assert md.startswith("### dpjax on 2 x cpu (cpu)")
    for mesh, n in (("2x1", 2), ("1x1", 1)):
        row = re.search(rf"\| [^|]+ \| {mesh} \| {n} \| ([\d,]+) \| n/a \|", md)
        assert row and float(row.group(1).replace(",", "")) > 0, md
    assert re.search(r"\| 4 KiB \| [\d.]+ \| n/a \| ring \| [\d.]+ \| n/a \|", md), md


