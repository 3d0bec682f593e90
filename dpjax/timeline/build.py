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
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from dpjax import scopes
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


def build(raw_events: list[dict], programs: list[Program], main: str | None = None) -> dict:
    """The timeline (a Chrome trace JSON object) of a raw `jax.profiler` perfetto trace."""
    by_module = {p.module: p for p in programs}
    main = main or (programs[0].module if programs else None)
    ops, waits, host = [], [], []
    for e in raw_events:
        if e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        if "hlo_op" in a and "device_ordinal" in a:
            ops.append(_Op(int(a["device_ordinal"]), str(a.get("run_id", "")), a.get("hlo_module", ""),
                           a["hlo_op"], e["ts"], e["ts"] + e.get("dur", 0.0), e.get("tid", 0)))
        elif e["name"].startswith(_WAITS):
            waits.append((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("tid", 0)))
        elif e["name"].startswith("dpjax:"):
            host.append(e)
    for op in ops:
        prog = by_module.get(op.module)
        if prog is not None and op.hlo in prog.ops:
            op.opcode, op.op_name = prog.ops[op.hlo]
            op.path = scopes.parse(op.op_name)
            op.comm = is_collective(op.opcode) or any(k in scopes.COLLECTIVES for k, _ in op.path)
    _attach_waits(ops, waits)
    t0 = min([o.start for o in ops] + [h["ts"] for h in host], default=0.0)
    steps = _number_runs(ops, host, main)
    events = _metadata(sorted({o.device for o in ops}))
    events += _host_events(host, t0)
    runs = defaultdict(list)
    for op in ops:
        runs[(op.device, op.run)].append(op)
    for (device, run), run_ops in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[1][0].start)):
        run_ops.sort(key=lambda o: (o.start, -o.end))
        events += _device_run(device, run_ops, steps.get(run), t0)
    events += _thread_names(events)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": FORMAT, "main": main, "steps": sorted(set(steps.values())),
                          "programs": {p.module: {"collective_ops": len(p.collective_ops())} for p in programs}}}


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


def _number_runs(ops: list[_Op], host: list[dict], main: str | None) -> dict:
    """run_id -> step number for the runs of the main program: the number of the host
    `step(i)` annotation a run starts in (a run outside every annotation, such as the
    tail of an earlier step, is no step); without annotations, the runs in order."""
    first = {}
    for op in ops:
        if op.module == main:
            first[op.run] = min(first.get(op.run, op.start), op.start)
    marked = [(h["ts"], h["ts"] + h.get("dur", 0.0), int(scopes.parse(h["name"])[0][1]["name"])) for h in host
              if h["name"].startswith("dpjax:step(")]
    if not marked:
        return {r: k for k, r in enumerate(sorted(first, key=first.get))}
    out = {}
    for run, t in first.items():
        inside = [i for s, e, i in marked if s <= t <= e]
        if inside:
            out[run] = inside[-1]
    return out


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
             "args": {"name": f"ops {tid - 99}" if tid >= 100 else f"collectives {tid}"}} for pid, tid in used]


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
        tagged.append((op.start, op.end, _span(op.hlo, pid, 0, op.start, op.end, t0, type="op", kind=kind,
                                                step=step, module=module,
                                                scope=op.op_name.split("shard_map/", 1)[-1])))
        tagged += [(s, e, _span("rendezvous wait", pid, 0, s, e, t0, type="op", kind="wait", step=step))
                   for s, e in op.waits]
    for lane, (s, e, ev) in lanes(sorted(tagged, key=lambda t: (t[0], -t[1]))):
        ev["tid"] = 100 + lane
        out.append(ev)
    return out
