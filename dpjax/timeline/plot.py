"""The picture of a timeline (`python -m dpjax.timeline FILE --png OUT`; needs matplotlib).

Top: one profiled step, a row per device (and the host): compute coloured by phase,
communication dark, waiting at a rendezvous red, nothing running white. Bottom: the
split of the average step per device (the summary's per-device table), so the slowest
device and the waiting it causes stand out.
"""

from __future__ import annotations

from collections import defaultdict

from dpjax.errors import UserError
from dpjax.timeline.spans import union

PHASE_COLOURS = {"forward_backward": "#4c72b0", "optimizer": "#55a868", "exchange": "#8172b2", "loss": "#ccb974",
                 "other": "#b0b0b0"}
SPLIT_COLOURS = {"compute": "#4c72b0", "comm": "#333333", "wait": "#d62728", "gap": "#eeeeee"}


def plot(data: dict, summary, out: str, step=None) -> None:
    """Draws the picture of `data` (the timeline's trace) and `summary` into the file `out`:
    step `step` (default: a middle one, warm) on top, the per-device split below."""
    try:  # an optional dependency (the [plot] extra), imported when a picture is asked for
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib: pip install -e '.[plot]'") from None
    steps = [r["step"] for r in summary.steps]
    step = steps[len(steps) // 2] if step is None else step  # a middle step: warm, not the first
    events = _step_events(data, step)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7), gridspec_kw={"height_ratios": [3, 2]})
    _draw_step(top, plt.Rectangle, step, *events)
    _draw_split(bottom, summary)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _step_events(data: dict, step):
    """What the top picture draws of `step`, from the trace's complete events: (run: each
    device's run of the step, pid -> (start, duration); bars: pid -> op kind -> intervals;
    phases: (pid, start, end, phase); host: the host's phase events within the step)."""
    ev = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["args"].get("step") == step]
    bars = defaultdict(lambda: defaultdict(list))
    run = {e["pid"]: (e["ts"], e["dur"]) for e in ev if e["args"].get("type") == "run"}
    phases = []
    for e in ev:
        a = e["args"]
        if a.get("type") == "phase":
            phases.append((e["pid"], e["ts"], e["ts"] + e["dur"], a["phase"]))
        elif a.get("type") == "op":
            bars[e["pid"]][a["kind"]].append((e["ts"], e["ts"] + e["dur"]))
    host = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0
            and e["args"].get("type") == "host_phase"
            and any(h["args"].get("step") == step and h["ts"] <= e["ts"] <= h["ts"] + h["dur"]
                    for h in data["traceEvents"] if h.get("ph") == "X" and h["args"].get("type") == "host_step")]
    return run, bars, phases, host


def _draw_step(top, rectangle, step, run, bars, phases, host) -> None:
    """One step, a row per device (and the host): compute coloured by phase, communication
    and rendezvous waits over it, in ms since the step began on its first device."""
    t0 = min(s for s, _ in run.values())
    pids = sorted(run)
    for row, pid in enumerate(pids):
        for p, s, e, name in phases:
            if p == pid:
                compute = [(max(a, s), min(b, e)) for a, b in union(bars[pid]["compute"]) if b > s and a < e]
                top.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in compute], (row - 0.4, 0.8),
                                color=PHASE_COLOURS.get(name, "#b0b0b0"))
        for kind, colour in (("comm", SPLIT_COLOURS["comm"]), ("wait", SPLIT_COLOURS["wait"])):
            top.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in union(bars[pid][kind])],
                            (row - 0.4, 0.8), color=colour)
    if host:
        top.broken_barh([((h["ts"] - t0) / 1e3, h["dur"] / 1e3) for h in host], (len(pids) - 0.4, 0.8),
                        color="#dd8452")
        for h in host:
            if h["dur"] < 0.04 * max(d for _, d in run.values()):
                continue  # too short to label
            top.text((h["ts"] - t0 + h["dur"] / 2) / 1e3, len(pids), h["args"]["phase"], ha="center",
                     va="center", fontsize=7)
    top.set_yticks(range(len(pids) + (1 if host else 0)),
                   [f"device {p - 1}" for p in pids] + (["host"] if host else []))
    top.invert_yaxis()
    top.set_xlabel(f"ms since step {step} began on its first device")
    handles = [rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    handles += [rectangle((0, 0), 1, 1, color=SPLIT_COLOURS[k]) for k in ("comm", "wait")]
    top.legend(handles, [f"compute: {p}" for p in PHASE_COLOURS] + ["communication", "waiting at rendezvous"],
               fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    top.set_title(f"step {step}: compute by phase, communication, rendezvous waits")


def _draw_split(bottom, summary) -> None:
    """The average step's split per device (compute, communication, waiting, nothing), stacked."""
    left = [0.0] * len(summary.devices)
    for kind in ("compute", "comm", "wait", "gap"):
        widths = [r[kind] / 1e3 for r in summary.devices]
        bottom.barh([f"device {r['device']}" for r in summary.devices], widths, left=left,
                    color=SPLIT_COLOURS[kind], edgecolor="#999999", label=kind)
        left = [a + b for a, b in zip(left, widths)]
    bottom.invert_yaxis()
    bottom.set_xlabel("ms per step (mean over profiled steps)")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
