"""How well a run uses its devices: model TFLOP/s per device, MFU, the hardware's FLOP/s
(and utilisation) from the compiled step, and peak memory per device; what MaxText,
Levanter and torchtitan log beside the loss.

Model FLOPs are the model's own count, `flops_per_token()` (6 x the matmul parameters +
attention, Kaplan et al. 2020, "Scaling laws for neural language models"), times the
tokens a step trains on. MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM",
appendix B) divides their rate per device by the device's dense peak. Hardware FLOPs
are the matrix FLOPs the compiled step executes on one device, counted from its HLO by
`dpjax.hlo` (dots, convolutions, cuBLAS and cuDNN custom calls, loop bodies trip-count
times) on every backend: recomputation, the optimizer's and the collectives' matmuls on
top of the model's count. XLA's `cost_analysis()` is not used: on GPU it counts the
cuBLAS / cuDNN calls as no FLOPs. Where the program holds a call whose FLOPs cannot be
read (a Pallas kernel, say) there is no hardware figure rather than a short one. Their
rate over the peak is the hardware FLOPs utilisation (HFU).

The peak comes from `--peak-tflops` or from `DEVICE_PEAKS` by the device's `device_kind`;
on CPU there is no table entry, so MFU appears only when `--peak-tflops` is given.
"""

from __future__ import annotations

import jax

from dpjax.hlo import Module
from dpjax.timeline.program import abstract

# The one table of device peaks (experiments/gpu_check.py reads it too), from the vendors'
# data sheets, by a substring of `jax.Device.device_kind` (the first key found in it wins,
# so the more specific names come first): dense (no structured sparsity) TFLOP/s by compute
# dtype, and "link", the NVLink bandwidth of one GPU in one direction in GB/s (the ceiling of
# nccl-tests' bus bandwidth), where known. "float32" is what a float32 matmul runs at under
# JAX's default precision: TF32 tensor cores on NVIDIA since Ampere, one bf16 pass on TPU.
DEVICE_PEAKS = {
    "H100 PCIe": {"bfloat16": 756.0, "float32": 378.0},
    "H100": {"bfloat16": 989.4, "float32": 494.7, "link": 450.0},  # SXM5 ("NVIDIA H100 80GB HBM3"), NVLink 4
    "H200": {"bfloat16": 989.4, "float32": 494.7, "link": 450.0},
    "GH200": {"bfloat16": 989.4, "float32": 494.7},
    "B200": {"bfloat16": 2250.0, "float32": 1100.0},
    "A100-SXM4": {"bfloat16": 312.0, "float32": 156.0, "link": 300.0},  # NVLink 3
    "A100": {"bfloat16": 312.0, "float32": 156.0},
    "L40S": {"bfloat16": 362.0, "float32": 183.0},
    "L4": {"bfloat16": 121.0, "float32": 60.0},
    "A10G": {"bfloat16": 70.0, "float32": 35.0},
    "TPU v6 lite": {"bfloat16": 918.0, "float32": 918.0},
    "TPU v5 lite": {"bfloat16": 197.0, "float32": 197.0},
    "TPU v5p": {"bfloat16": 459.0, "float32": 459.0},
    "TPU v5": {"bfloat16": 459.0, "float32": 459.0},
    "TPU v4": {"bfloat16": 275.0, "float32": 275.0},
}


def device_peaks(device_kind: str) -> dict:
    """The table's entry for a device of this kind ({} if none, e.g. CPUs)."""
    return next((peaks for key, peaks in DEVICE_PEAKS.items() if key in device_kind), {})


def peak_tflops(device_kind: str, dtype: str = "float32") -> float | None:
    """The table's dense peak for a device of this kind computing in `dtype` (None if
    the kind is not in the table, e.g. CPUs). Under `jax_default_matmul_precision`
    'highest' a float32 matmul is not TF32: no peak is claimed for it then. `--dtype fp8`
    is measured against the bf16 peak: an fp8 run's MFU then reads as its speed-up over
    bf16 (only its projections are fp8; against fp8's own peak, twice bf16's on Hopper)."""
    dtype = "bfloat16" if dtype == "fp8" else dtype
    # jax's stubs do not list its config's options (read through jax.config's __getattr__)
    precision = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]
    if dtype == "float32" and precision in ("highest", "float32", "fp32"):
        return None
    return device_peaks(device_kind).get(dtype)


def compiled_figures(fn, *args) -> dict:
    """What the compiled program of jitted `fn` at these arguments says of one device:
    'flops', the matrix FLOPs it executes (`dpjax.hlo`; None where some cannot be read,
    'flops_unknown' saying which), and the 'memory' it needs at most (arguments + outputs +
    temporaries - donated aliases; None if unknown). After a call with the same shapes and
    shardings this reads JAX's cached executable (no compile)."""

    compiled = fn.lower(*abstract(args)).compile()
    flops = Module(compiled.as_text()).flops()
    memory = None
    mem = compiled.memory_analysis()
    if mem is not None:
        memory = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                     - mem.alias_size_in_bytes)
    return {"flops": flops.value, "flops_unknown": flops.unknown, "memory": memory}


def device_peak_memory(devices) -> int | None:
    """The most bytes any of these (this process's) devices has held so far, from the
    runtime's allocator (`memory_stats()['peak_bytes_in_use']`; None where the backend
    keeps no statistics, as on CPU)."""
    peaks = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class Efficiency:
    """The efficiency figures of a run of `model` on `mesh` at `tokens_per_step` tokens
    per optimizer step; `peak`: dense TFLOP/s of one device (None: from the table)."""

    def __init__(self, model, mesh, tokens_per_step: int, peak: float | None = None, dtype: str = "float32"):
        self.devices = mesh.size
        self.local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        self.model_flops = model.flops_per_token() * tokens_per_step / self.devices  # per device per step
        self.peak = peak if peak is not None else peak_tflops(self.local[0].device_kind, dtype)
        self._compiled: dict[int, dict] = {}  # id(step) -> its program's figures

    def _program(self, step, args) -> dict:
        if id(step) not in self._compiled:
            self._compiled[id(step)] = compiled_figures(step.train, *args)
        return self._compiled[id(step)]

    def peak_memory(self, step, args) -> int | None:
        """Peak bytes per device: the allocator's figure where the backend keeps one,
        else the compiled step's own need."""
        measured = device_peak_memory(self.local)
        return measured if measured is not None else self._program(step, args)["memory"]

    def row(self, step_time: float, step, args) -> dict:
        """The figures of one step that took `step_time` seconds (the metrics row's)."""
        out = self._rates(self.model_flops / step_time / 1e12, "")
        hw = self._program(step, args)["flops"]
        if hw is not None:
            out.update(self._rates(hw / step_time / 1e12, "hw_"))
        out["peak_memory_bytes"] = self.peak_memory(step, args)
        return out

    def _rates(self, tflops: float, prefix: str) -> dict:
        out = {f"{prefix}tflops_per_device": _digits(tflops)}
        if self.peak:
            out["hfu" if prefix else "mfu"] = _digits(tflops / self.peak)
        return out


def _digits(x: float) -> float:
    return float(f"{x:.4g}")  # 4 significant digits: a CPU's 1e-6 TFLOP/s keeps its figures too


def describe(fig: dict) -> str:
    """The summary line's part: 'T TFLOP/s/device (MFU m%), hardware H TFLOP/s, peak memory M MiB'."""
    if "tflops_per_device" not in fig:
        return ""
    text = f"{fig['tflops_per_device']:.3g} TFLOP/s/device"
    if "mfu" in fig:
        text += f" (MFU {100 * fig['mfu']:.1f}%)"
    hw = fig.get("hw_tflops_per_device")
    if hw is not None and abs(hw - fig["tflops_per_device"]) > 0.05 * fig["tflops_per_device"]:
        text += f", hardware {hw:.3g} TFLOP/s" + (f" (HFU {100 * fig['hfu']:.1f}%)" if "hfu" in fig else "")
    if fig.get("peak_memory_bytes") is not None:
        text += f", peak memory {fig['peak_memory_bytes'] / 2**20:,.0f} MiB/device"
    return text
