"""A raw `jax.profiler` trace and the compiled programs -> a dpjax timeline (`dpjax.timeline`).

The raw trace (the CPU backend's perfetto_trace.json) has one event per HLO op a device
executed (args `device_ordinal`, `hlo_module`, `hlo_op`, `run_id`: one run_id per
execution of a program, shared by its devices), and inside each collective the
rendezvous in which its thread waited for the others ("Wait: pending_threads=k/n",
"Wait for rendezvous callback"; these carry no device, so each is given to the
collective op that contains it on its thread). A device's ops of one run may run on
several threads at once. Here every op is named from the program's metadata
(`Program.ops`: `hlo_op` -> op_name), runs of the main program become numbered steps
(by the host's `step(i)` annotations), and each device-run becomes its spans
(`dpjax.timeline.spans`): pid = device + 1, tid 0 the step and its phases, tids 1.. the
collective calls with their point-to-point steps, tids 100.. the ops (lanes, so that no
two overlap; a rendezvous wait is drawn inside its op). pid 0 is the host.

A GPU capture (a process named `/device:GPU:N`) is read by `dpjax.timeline.gpu`: the
same spans, the kernels' runs found through their host launches; work outside every
program (memory copies) is drawn on tid 99 of its device, and kernels inside CUDA command
buffers, which no program names, are given to their step in a phase of their own, with
a note in the timeline (`otherData.notes`) that the summary prints.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from dpjax import scopes
from dpjax.timeline import gpu
from dpjax.timeline.format import FORMAT
from dpjax.timeline.program import Program
from dpjax.timeline.spans import collective_spans, is_collective, lanes, phase_spans

_WAITS = ("Wait: pending_threads", "Wait for rendezvous callback")  # XLA CPU's rendezvous, waiting


@dataclass
class _Op:
    device: int
    run: str
    module: str
    hlo: str
    start: float
    end: float
    tid: int
    opcode: str = ""
    op_name: str = ""
    comm: bool = False
    path: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    kernel: str = ""  # on a GPU: the kernel's own name, and the stream it ran on
    stream: str = ""


def build(raw_events: list[dict], programs: list[Program], main: str | None = None) -> dict:
    """The timeline (a Chrome trace JSON object) of a raw `jax.profiler` perfetto trace."""
    by_module = {p.module: p for p in programs}
    main = main or (programs[0].module if programs else None)
    host = [e for e in raw_events if e.get("ph") == "X" and e["name"].startswith("dpjax:")]
    capture = gpu.read(raw_events)
    if capture is None:
        ops, waits, launched, outside = *_cpu_ops(raw_events), {}, []
    else:
        ops = [_Op(k.device, k.run, k.module, k.hlo, k.start, k.end, k.tid, kernel=k.name, stream=k.stream)
               for k in capture.kernels]
        waits, launched, outside = [], capture.launched, capture.outside
    for op in ops:
        prog = by_module.get(op.module)
        if gpu.is_command_buffer(op.hlo):  # its op is unknown: a phase of its own (gpu.py)
            op.path = [("phase", {"name": gpu.COMMAND_BUFFER_PHASE})]
        elif prog is not None and op.hlo in prog.ops:
            op.opcode, op.op_name = prog.ops[op.hlo]
            op.path = scopes.parse(op.op_name)
        op.comm = (is_collective(op.opcode) or any(k in scopes.COLLECTIVES for k, _ in op.path)
                   or gpu.is_nccl(op.kernel))
    _attach_waits(ops, waits)
    t0 = min([o.start for o in ops] + [h["ts"] for h in host], default=0.0)
    marked = _marked_steps(host)
    steps = _number_runs(ops, marked, main, launched)
    events = _metadata(sorted({o.device for o in ops} | {o.device for o in outside}))
    events += _host_events(host, t0)
    runs = defaultdict(list)
    for op in ops:
        runs[(op.device, op.run)].append(op)
    for (device, run), run_ops in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[1][0].start)):
        run_ops.sort(key=lambda o: (o.start, -o.end))
        events += _device_run(device, run_ops, steps.get(run), t0)
    events += [_span(o.name, o.device + 1, 99, o.start, o.end, t0, type="outside", bytes=o.nbytes, stream=o.stream,
                     step=_step_at(o.launched, marked) if o.launched is not None else None) for o in outside]
    events += _thread_names(events)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": FORMAT, "main": main, "steps": sorted(set(steps.values())),
                          "platform": "cpu" if capture is None else "gpu", "notes": _notes(ops, steps),
                          "programs": {p.module: {"collective_ops": len(p.collective_ops())} for p in programs}}}


def _cpu_ops(raw_events: list[dict]) -> tuple[list, list]:
    """The CPU backend's op events (with `device_ordinal`) and rendezvous waits."""
    ops, waits = [], []
    for e in raw_events:
        if e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        if "hlo_op" in a and "device_ordinal" in a:
            ops.append(_Op(int(a["device_ordinal"]), str(a.get("run_id", "")), a.get("hlo_module", ""),
                           a["hlo_op"], e["ts"], e["ts"] + e.get("dur", 0.0), e.get("tid", 0)))
        elif e["name"].startswith(_WAITS):
            waits.append((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("tid", 0)))
    return ops, waits


def _notes(ops: list[_Op], steps: dict) -> list[str]:
    """What the reader of a GPU timeline must know: ops the program could not name."""
    buffered = [o for o in ops if gpu.is_command_buffer(o.hlo) and o.run in steps]
    if not buffered:
        return []
    per_step = len(buffered) / len({(o.device, steps[o.run]) for o in buffered})
    return [f"{per_step:g} kernels per device and step ran inside CUDA command buffers "
            f"({', '.join(sorted({o.hlo for o in buffered}))}): the profile does not say which op each ran, so they "
            f"are given to their step as compute (NCCL kernels as communication) in phase "
            f"'{gpu.COMMAND_BUFFER_PHASE}'; profile with XLA_FLAGS=--xla_gpu_enable_command_buffer= to see "
            "their ops, phases and collectives"]


def _attach_waits(ops: list[_Op], waits: list) -> None:
    """Each rendezvous wait to the collective op it happened in: the op on the same
    thread whose interval contains it (the waits carry no device of their own)."""
    by_tid = defaultdict(list)
    for op in ops:
        if op.comm:
            by_tid[op.tid].append(op)
    for lst in by_tid.values():
        lst.sort(key=lambda o: o.start)
    starts = {t: [o.start for o in lst] for t, lst in by_tid.items()}
    for s, e, tid in waits:
        lst = by_tid.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), s)
        for op in reversed(lst[max(0, i - 8):i]):  # the latest-starting op that contains it
            if e <= op.end:
                op.waits.append((s, e))
                break


def _marked_steps(host: list[dict]) -> list[tuple[float, float, int]]:
    """(start, end, index) of the host's `step(i)` annotations."""
    return [(h["ts"], h["ts"] + h.get("dur", 0.0), int(scopes.parse(h["name"])[0][1]["name"])) for h in host
            if h["name"].startswith("dpjax:step(")]


def _step_at(t: float, marked: list):
    inside = [i for s, e, i in marked if s <= t <= e]
    return inside[-1] if inside else None


def _number_runs(ops: list[_Op], marked: list, main: str | None, launched: dict) -> dict:
    """run_id -> step number for the runs of the main program: the number of the host
    `step(i)` annotation a run starts in (a run outside every annotation, such as the
    tail of an earlier step, is no step); without annotations, the runs in order. A run
    starts at its first op, or on a GPU when the host launched it (`launched`)."""
    first = {}
    for op in ops:
        if op.module == main:
            first[op.run] = min(first.get(op.run, op.start), op.start)
    first.update({run: t for run, t in launched.items() if run in first})
    if not marked:
        return {r: k for k, r in enumerate(sorted(first, key=first.get))}
    return {run: _step_at(t, marked) for run, t in first.items() if _step_at(t, marked) is not None}


def _metadata(devices: list[int]) -> list[dict]:
    out = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "host"}},
           {"ph": "M", "pid": 0, "name": "process_sort_index", "args": {"sort_index": 0}}]
    for d in devices:
        out += [{"ph": "M", "pid": d + 1, "name": "process_name", "args": {"name": f"device {d}"}},
                {"ph": "M", "pid": d + 1, "name": "process_sort_index", "args": {"sort_index": d + 1}},
                {"ph": "M", "pid": d + 1, "tid": 0, "name": "thread_name", "args": {"name": "step, phases"}}]
    return out


def _thread_names(events: list[dict]) -> list[dict]:
    used = sorted({(e["pid"], e["tid"]) for e in events if e["ph"] == "X" and e["pid"] > 0 and e["tid"] > 0})
    return [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
             "args": {"name": f"ops {tid - 99}" if tid >= 100 else "outside programs" if tid == 99
                      else f"collectives {tid}"}} for pid, tid in used]


def _span(name, pid, tid, start, end, t0, **args) -> dict:
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": round(start - t0, 3),
            "dur": round(max(0.0, end - start), 3), "args": args}


def _host_events(host: list[dict], t0: float) -> list[dict]:
    out = []
    for h in sorted(host, key=lambda h: (h["ts"], -h.get("dur", 0))):
        kind, args = scopes.parse(h["name"])[0]
        label = args.get("name", "")
        name = f"step {label}" if kind == "step" else label
        extra = {"step": int(label)} if kind == "step" else {"phase": label}
        out.append(_span(name, 0, 0, h["ts"], h["ts"] + h.get("dur", 0.0), t0, type=f"host_{kind}", **extra))
    return out


def _device_run(device: int, ops: list[_Op], step, t0: float) -> list[dict]:
    """The spans of one run of a program on one device: the run itself, its phases, its
    collective calls and their point-to-point steps, and its ops (lanes as needed)."""
    pid = device + 1
    start, end = ops[0].start, max(o.end for o in ops)
    module = ops[0].module
    title = f"step {step}" if step is not None else module
    out = [_span(title, pid, 0, start, end, t0, type="run", step=step, module=module)]
    if step is not None:
        for name, s, e in phase_spans(ops):
            out.append(_span(name, pid, 0, s, e, t0, type="phase", step=step, phase=name))
    out += collective_spans(ops, pid, step, t0, _span)
    tagged = []
    for op in ops:
        kind = "comm" if op.comm else "compute"
        gpu_args = {"hlo_op": op.hlo, "kernel": op.kernel, "stream": op.stream} if op.kernel else {}
        # a command buffer's kernels share its op: each is shown by its own kernel name
        name = op.kernel if gpu.is_command_buffer(op.hlo) else op.hlo
        tagged.append((op.start, op.end, _span(name, pid, 0, op.start, op.end, t0, type="op", kind=kind,
                                                step=step, module=module,
                                                scope=op.op_name.split("shard_map/", 1)[-1], **gpu_args)))
        tagged += [(s, e, _span("rendezvous wait", pid, 0, s, e, t0, type="op", kind="wait", step=step))
                   for s, e in op.waits]
    for lane, (s, e, ev) in lanes(sorted(tagged, key=lambda t: (t[0], -t[1]))):
        ev["tid"] = 100 + lane
        out.append(ev)
    return out
