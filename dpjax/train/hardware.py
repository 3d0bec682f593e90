"""What a run says about the hardware it runs on, first thing: the platform, the devices
and the processes; and a warning when a GPU is visible to the machine but JAX runs on the
CPU (the README's plain install gives CPU JAX: the `cuda` extra gives JAX with CUDA)."""

from __future__ import annotations

import collections
import os
import shutil

CUDA_INSTALL = 'pip install -e ".[cuda]"'


def devices_line(devices, processes: int) -> str:
    """'devices: 8 x cpu (simulated) in 2 processes' / 'devices: 8 x NVIDIA H100 80GB HBM3 (gpu) in 1 process'."""
    kinds = collections.Counter(f"{d.device_kind} ({d.platform})" if d.device_kind != d.platform else d.platform
                                for d in devices)
    what = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
    simulated = " (simulated)" if all(d.platform == "cpu" for d in devices) and len(devices) > processes else ""
    return f"devices: {what}{simulated} in {processes} process{'es' if processes > 1 else ''}"


def gpu_visible() -> str | None:
    """How this machine shows a GPU to anyone who looks (None: it does not)."""
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    if os.path.exists("/dev/nvidia0"):
        return "/dev/nvidia0 exists"
    return None


def cpu_but_gpu_warning(devices) -> str | None:
    """One line when the machine has a GPU and JAX is running on its CPU."""
    seen = gpu_visible()
    cpu_only = os.environ.get("JAX_PLATFORMS", "").strip() == "cpu"
    if seen is None or cpu_only or any(d.platform != "cpu" for d in devices):
        return None
    return (f"warning: this machine has a GPU ({seen}) but JAX runs on the CPU: its JAX has no CUDA; install it "
            f"with {CUDA_INSTALL} (JAX with CUDA 12), or set JAX_PLATFORMS=cpu to silence this")
