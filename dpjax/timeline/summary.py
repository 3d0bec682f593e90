"""Where the profiled steps' time went: the tables of `python -m dpjax.timeline FILE`.

Read from a timeline file alone (`dpjax.timeline` writes it). Per device and step, each
instant of the step (its program's first op to its last) is counted once, in this order:

    compute        some op outside every collective runs
    communication  else, a collective runs (dpjax's calls, their adds and copies included,
                   and XLA's own collectives) and is not waiting
    wait           else, a collective waits at its rendezvous for the other devices (idle)
    gap            else, nothing runs (the runtime between ops, or a thread not scheduled)

so the four add up to the step (on a GPU, wait is 0: a collective waits for its peers
inside its NCCL kernel, which is communication). comm_fraction = (communication + wait) / step. Per
collective: calls per step, nccl-tests' size S, time per call (the time its own ops ran
on a device, mean over devices and steps), and the effective bandwidths of nccl-tests
(doc/PERFORMANCE.md): algbw = S / t, busbw = algbw x 2(n-1)/n for allreduce, (n-1)/n for
reduce-scatter, all-gather and all-to-all, 1 for broadcast: comparable to a link's
bandwidth whatever n is. The slowest device is the one with the most compute: the one
the others wait for.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from dpjax.collectives.cost import bus_factor
from dpjax.errors import UserError
from dpjax.timeline.format import FORMAT
from dpjax.timeline.spans import intersect, length, subtract, union

BUS_KINDS = ("allreduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def load(path: str) -> dict:
    """A timeline file; a missing or malformed one raises UserError (one line)."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise UserError(f"no timeline file {path!r}: write one with python -m dpjax.train --timeline FILE") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path!r} is not a timeline (not JSON: {str(e).splitlines()[0][:80]})") from None
    if not isinstance(data, dict) or (data.get("otherData") or {}).get("format") != FORMAT:
        raise UserError(f"{path!r} is not a dpjax timeline (no otherData.format {FORMAT!r}); "
                        "write one with --timeline or dpjax.timeline.record")
    events = data.get("traceEvents")
    if not isinstance(events, list) or not all(
            isinstance(e, dict) and isinstance(e.get("args", {}), dict)
            and (e.get("ph") != "X" or all(k in e for k in ("name", "pid", "tid", "ts", "dur"))) for e in events):
        raise UserError(f"{path!r} is a damaged timeline (traceEvents without name, pid, tid, ts, dur); "
                        "write it again")
    return data


@dataclass
class Summary:
    steps: list  # one dict per step: step, time, compute, comm, wait, gap, comm_fraction, slowest
    devices: list  # one dict per device (means over steps)
    phases: list  # one dict per phase (device phases and host phases)
    collectives: list  # one dict per collective label
    notes: list = field(default_factory=list)  # what the timeline could not tell (e.g. GPU command buffers)

    def step_fraction(self) -> dict:
        return {row["step"]: row["comm_fraction"] for row in self.steps}


def summarize(data: dict) -> Summary:
    ev = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    runs = {(e["pid"] - 1, e["args"]["step"]): (e["ts"], e["ts"] + e["dur"]) for e in ev
            if e["args"].get("type") == "run" and e["args"].get("step") is not None}
    if not runs:
        raise UserError("the timeline holds no step of the main program (was a step profiled?)")
    parts = defaultdict(lambda: defaultdict(list))
    for e in ev:
        a = e["args"]
        if a.get("type") in ("op", "phase") and a.get("step") is not None:
            tag = a["kind"] if a["type"] == "op" else ("phase", a["phase"])
            parts[(e["pid"] - 1, a["step"])][tag].append((e["ts"], e["ts"] + e["dur"]))
    acct = {}
    for key, (s, e) in runs.items():
        p = parts[key]
        C, M, W = union(p["compute"]), union(p["comm"]), union(p["wait"])
        comm = subtract(subtract(M, W), C)
        wait = subtract(subtract(W, C), comm)
        row = {"time": e - s, "compute": length(C), "comm": length(comm), "wait": length(wait)}
        row["gap"] = row["time"] - length(C + M)
        row["phases"] = {tag[1]: (length(iv), length(intersect(iv, M)))
                         for tag, iv in p.items() if isinstance(tag, tuple)}
        acct[key] = row
    steps_, devices = sorted({s for _, s in acct}), sorted({d for d, _ in acct})
    step_rows = []
    for s in steps_:
        rows = {d: acct[(d, s)] for d in devices if (d, s) in acct}
        mean = {k: statistics.fmean(r[k] for r in rows.values()) for k in ("compute", "comm", "wait", "gap")}
        slow = max(rows, key=lambda d: rows[d]["compute"])
        step_rows.append({"step": s, "time": max(r["time"] for r in rows.values()), **mean,
                          "comm_fraction": statistics.fmean((r["comm"] + r["wait"]) / r["time"]
                                                            for r in rows.values() if r["time"] > 0),
                          "slowest": slow})
    dev_rows = [{"device": d, **{k: statistics.fmean(acct[(d, s)][k] for s in steps_ if (d, s) in acct)
                                 for k in ("time", "compute", "comm", "wait", "gap")}} for d in devices]
    return Summary(step_rows, dev_rows, _phases(ev, acct, len(steps_)), _collectives(ev, len(acct)),
                   list((data.get("otherData") or {}).get("notes") or []))


def _phases(ev, acct, nsteps) -> list:
    out = defaultdict(lambda: [0.0, 0.0])
    for row in acct.values():
        for name, (t, comm) in row["phases"].items():
            out[("device", name)][0] += t / len(acct)
            out[("device", name)][1] += comm / len(acct)
    for e in ev:
        if e["pid"] == 0 and e["args"].get("type") == "host_phase":
            out[("host", e["args"]["phase"])][0] += e["dur"] / max(1, nsteps)
    return [{"where": w, "phase": p, "time": t, "comm": c} for (w, p), (t, c) in out.items()]


def _collectives(ev, device_steps: int) -> list:
    groups = defaultdict(list)
    for e in ev:
        a = e["args"]
        if a.get("type") == "collective" and a.get("step") is not None:
            label = (a["phase"], a["collective"], a["algorithm"], a["axis"], a["n"], a["bytes"], a["bucket"],
                     e["name"])
            groups[label].append(a)
    rows = []
    for (phase, kind, alg, axis, n, nbytes, bucket, name), calls in groups.items():
        t = statistics.fmean(c["own_us"] for c in calls) * 1e-6
        algbw = nbytes / t if nbytes and t > 0 else None
        factor = bus_factor(kind, n) if n and kind in BUS_KINDS else None
        rows.append({"name": name, "phase": phase, "collective": kind, "algorithm": alg, "axis": axis, "n": n,
                     "bytes": nbytes, "calls": len(calls) / device_steps, "time": t,
                     "p2p_steps": statistics.fmean(c["p2p_steps"] for c in calls),
                     "algbw": algbw, "busbw": algbw * factor if algbw is not None and factor is not None else None})
    return sorted(rows, key=lambda r: -r["time"] * r["calls"])


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _table(head: list, rows: list) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(head))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, width)))  # noqa
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in width)] + [line(r) for r in cells[1:]])


def render(s: Summary) -> str:
    out = ["per step (device means, ms; comm = communicating, wait = waiting at a rendezvous, "
           "gap = nothing running):",
           _table(["step", "time", "compute", "comm", "wait", "gap", "comm %", "slowest device"],
                  [[r["step"], _ms(r["time"]), _ms(r["compute"]), _ms(r["comm"]), _ms(r["wait"]), _ms(r["gap"]),
                    f"{100 * r['comm_fraction']:.1f}", r["slowest"]] for r in s.steps]), "",
           "per device (means over steps, ms):",
           _table(["device", "time", "compute", "comm", "wait", "gap"],
                  [[r["device"], *(_ms(r[k]) for k in ("time", "compute", "comm", "wait", "gap"))]
                   for r in s.devices]), "",
           "per phase (ms per step; device phases are means over devices):",
           _table(["where", "phase", "time", "of which in collectives"],
                  [[r["where"], r["phase"], _ms(r["time"]), _ms(r["comm"]) if r["where"] == "device" else "-"]
                   for r in s.phases]), "",
           "per collective (time per call on one device; busbw as nccl-tests):",
           _table(["collective", "phase", "calls/step", "bytes", "p2p steps", "ms/call", "algbw GB/s", "busbw GB/s"],
                  [[r["name"], r["phase"], f"{r['calls']:g}", r["bytes"] if r["bytes"] is not None else "-",
                    f"{r['p2p_steps']:g}", f"{r['time'] * 1e3:.3f}",
                    f"{r['algbw'] / 1e9:.3f}" if r["algbw"] else "-",
                    f"{r['busbw'] / 1e9:.3f}" if r["busbw"] else "-"] for r in s.collectives])]
    slow = max(s.devices, key=lambda r: r["compute"])
    out += ["", f"slowest device: {slow['device']} (compute {_ms(slow['compute'])} ms per step, waits "
                f"{_ms(slow['wait'])} ms; the others wait for it)"]
    out += [f"note: {n}" for n in s.notes]
    return "\n".join(out)
