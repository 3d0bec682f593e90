"""A GPU capture's device work (`jax.profiler` on CUDA), for `dpjax.timeline.build`.

A GPU's perfetto trace is laid out unlike the CPU backend's (`build`):

    device     a trace process named `/device:GPU:N` (no `device_ordinal` argument); its
               kernels and memory copies sit on stream threads (`Stream #14(Compute)`,
               `Stream #15(MemcpyH2D)`, ...). A kernel carries `hlo_module` and `hlo_op`
               but no `run_id`.
    launch     the host process (`/host:CPU`) holds each launch (a kernel's own event,
               `cuGraphLaunch`, `MemcpyH2D`) with the `correlation_id` (and `device_id`)
               that the device's event repeats, inside the host's
               `CommonPjRtLoadedExecutable::Execute (<module>)`, which carries the run's
               `run_id`. So a kernel belongs to the run whose Execute holds its launch
               (without a launch: the last Execute of its module begun before it ran),
               and the run is numbered by when that Execute began, inside the host's
               `step(i)` annotation (a kernel itself may run after the annotation ends).
    waiting    there is no rendezvous event: a collective waits for its peers inside its
               NCCL kernel, so on a GPU that time is communication.

CUDA command buffers. XLA records runs of thunks into CUDA graphs and replays each with
one `cuGraphLaunch`; the profiler then gives every kernel in it the command buffer's op
(`hlo_op: command_buffer_1`), so the program text cannot name it, and its kernel name
cannot stand in: XLA reuses one compiled kernel for identical fusions (in the H200
capture without command buffers, 160 of 386 kernels ran under another fusion's name,
`input_reduce_fusion_32` for `input_reduce_fusion.33`). Turning command buffers off for
the profiled steps alone cannot be done cleanly: the flag is read when a program is
compiled, so those steps would run a second executable, compiled mid-run, not the one
whose time the other steps measure. So such kernels are attributed to their step (by
the graph launch's correlation), counted as compute (NCCL kernels, `nccl*`, as
communication) in a phase of their own, `command buffer`, and the timeline's notes say so
(`python -m dpjax.timeline` prints them) with the remedy: profile a run with
`XLA_FLAGS=--xla_gpu_enable_command_buffer=` to see every op, phase and collective.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

_DEVICE = re.compile(r"^/device:GPU:(\d+)$")
_SIZE = re.compile(r"\bsize:(\d+)")
COMMAND_BUFFER_PHASE = "command buffer"


@dataclass
class Kernel:
    """One kernel a device ran for an op of a compiled program."""

    device: int
    run: str  # the run_id of the host Execute that launched it ("" when none is found)
    module: str
    hlo: str  # the op the profiler names (a command buffer's op for all its kernels)
    start: float
    end: float
    tid: int
    name: str  # the kernel's own name
    stream: str


@dataclass
class Outside:
    """Device work outside every program: a memory copy (or a kernel with no hlo_op)."""

    device: int
    name: str
    start: float
    end: float
    launched: float | None  # when the host launched it (its step is the host's step then)
    nbytes: int | None
    stream: str


@dataclass
class Capture:
    kernels: list  # [Kernel]
    launched: dict  # run_id -> the time its host Execute began
    outside: list  # [Outside]


def is_command_buffer(hlo: str) -> bool:
    return hlo.startswith("command_buffer")


def is_nccl(kernel: str) -> bool:
    """A kernel of NCCL's (its collectives and sends): it moves data between devices."""
    return kernel.startswith("nccl") or "ncclDevKernel" in kernel or "ncclKernel" in kernel


def devices(events: list[dict]) -> dict:
    """pid -> device number, for the trace processes that are GPUs."""
    out = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            m = _DEVICE.match(str((e.get("args") or {}).get("name", "")))
            if m:
                out[e["pid"]] = int(m.group(1))
    return out


def read(events: list[dict]) -> Capture | None:
    """The device work of a GPU capture, or None when the trace has no GPU."""
    gpus = devices(events)
    if not gpus:
        return None
    streams = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpus}
    executes, launches, device_events = [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        if e.get("pid") in gpus:
            device_events.append(e)
        elif "run_id" in a and a.get("name"):  # CommonPjRtLoadedExecutable::Execute (<module>)
            executes.append((e["ts"], e["ts"] + e.get("dur", 0.0), a["name"], str(a["run_id"])))
        elif "correlation_id" in a:
            device = int(a["device_id"]) if "device_id" in a else None
            launches[(device, str(a["correlation_id"]))] = e["ts"]
    executes.sort()
    kernels, outside = [], []
    for e in device_events:
        a = e.get("args") or {}
        device, stream = gpus[e["pid"]], streams.get((e["pid"], e.get("tid")), "")
        corr = str(a.get("correlation_id"))
        launched = launches.get((device, corr), launches.get((None, corr)))
        start, end = e["ts"], e["ts"] + e.get("dur", 0.0)
        if "hlo_op" in a:
            module = a.get("hlo_module", "")
            kernels.append(Kernel(device, _run_of(executes, module, launched, start), module, a["hlo_op"],
                                  start, end, e.get("tid", 0), e["name"], stream))
        else:
            size = _SIZE.search(str(a.get("memcpy_details", "")))
            outside.append(Outside(device, e["name"], start, end, launched, int(size.group(1)) if size else None,
                                   stream))
    return Capture(kernels, {run: s for s, _, _, run in executes}, outside)


def _run_of(executes: list, module: str, launched: float | None, start: float) -> str:
    """The run_id of the Execute of `module` whose interval holds the launch; without a
    launch, the last Execute of `module` begun before the kernel started."""
    if launched is not None:
        for s, e, m, run in executes[:bisect.bisect_right(executes, (launched, float("inf")))][::-1]:
            if m == module and s <= launched <= e:
                return run
    before = [run for s, _, m, run in executes[:bisect.bisect_right(executes, (start, float("inf")))]
              if m == module]
    return before[-1] if before else ""
