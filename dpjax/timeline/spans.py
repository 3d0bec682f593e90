"""A device's executed ops, grouped into the spans a timeline shows (`dpjax.timeline`).

Ops come from one run of a program on one device, ordered by start time, each with the
dpjax names of its `op_name` (`dpjax.scopes.parse`). XLA interleaves independent work:
the ring steps of two fusion buckets alternate in the schedule, and the CPU runtime
runs independent ops on several threads at once. So a collective call is not "the ops
between two times"; it is the set of ops that carry its name:

    phase          consecutive ops of one phase (the innermost `dpjax:phase`; "other"
                   when none), each span ending where the next begins
    call           ops named by one collective call (the path down to its innermost
                   `dpjax:<collective>`, a point-to-point `dpjax:send` included, whose
                   `call=k` numbers the calls of a step built
                   by `dpjax.step`; its autodiff transpose, run in the backward pass, is
                   a call of its own; an XLA collective outside any is its own call).
                   Executions of one name (a call inside a scan, or unnumbered calls of
                   research code) are told apart by their point-to-point steps: a step
                   index the call has made already starts the next one; an op between
                   steps (an add, a slice) belongs to the call whose steps are nearest
    step           the ops of one `dpjax:step(index=k)` inside a call (a ring step: its
                   ppermute, with the rendezvous inside it)
"""

from __future__ import annotations

from collections import defaultdict

from dpjax import scopes

_EPS = 1e-3  # microseconds: events that touch share an end point up to rounding
_COLLECTIVE_OPS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                   "collective-broadcast", "ragged-all-to-all")


def is_collective(opcode: str) -> bool:
    """An HLO opcode that moves data between devices (async -start / -done halves too)."""
    return opcode.removesuffix("-start").removesuffix("-done") in _COLLECTIVE_OPS


def phase_of(op) -> str:
    names = [a.get("name") for k, a in op.path if k == "phase"]
    return names[-1] if names else "other"


def phase_spans(ops) -> list[tuple[str, float, float]]:
    """(phase, start, end) of each run of consecutive same-phase ops, not overlapping."""
    spans: list[list] = []
    for op in ops:
        name = phase_of(op)
        if spans and spans[-1][0] == name:
            spans[-1][2] = max(spans[-1][2], op.end)
        else:
            spans.append([name, op.start, op.end])
    for cur, nxt in zip(spans, spans[1:]):
        cur[2] = min(cur[2], nxt[1])
    return [tuple(s) for s in spans]


def call_key(op):
    """The name path that identifies the collective call an op belongs to, or None."""
    last = max((i for i, (k, _) in enumerate(op.path) if k in scopes.COLLECTIVES), default=None)
    if last is not None:
        key = tuple((k, tuple(sorted(a.items()))) for k, a in op.path[:last + 1])
        # autodiff's transpose of a call carries the call's name: it is the call's backward
        return key + ((("pass", (("name", "backward"),)),) if "transpose(" in op.op_name else ())
    if op.comm:  # an XLA collective that no dpjax call names (e.g. a psum in the model)
        return tuple((k, tuple(sorted(a.items()))) for k, a in op.path) + (
            ("xla", (("hlo", op.hlo), ("opcode", op.opcode))),)
    return None


def step_index(op):
    idx = [a.get("index") for k, a in op.path if k == "step"]
    return idx[-1] if idx else None


def split_calls(ops) -> list[list]:
    """The calls among ops that share one call key (see the module docstring)."""
    # anchors: the ops that move data (a step's ppermute; XLA's own collective); the
    # others (adds, slices, a transpose's accumulations) go to the nearest call
    anchors = [op for op in ops if is_collective(op.opcode)]
    if not anchors:
        return [list(ops)]
    calls: list[dict] = []
    for op in anchors:
        idx, cur = step_index(op), calls[-1] if calls else None
        if cur is None:
            new = True
        elif idx is not None:  # a step the call has made already: the next call (or execution)
            new = idx in cur["seen"]
        else:  # an unnumbered collective (XLA's): one per call unless numbered steps are around it
            new = cur["max"] is None and cur["bare"]
        if new:
            cur = {"ops": [], "max": None, "seen": set(), "bare": False, "start": op.start, "end": op.end}
            calls.append(cur)
        cur["ops"].append(op)
        cur["start"], cur["end"] = min(cur["start"], op.start), max(cur["end"], op.end)
        if idx is None:
            cur["bare"] = True
        else:
            cur["max"] = idx if cur["max"] is None else max(cur["max"], idx)
            cur["seen"].add(idx)
    anchor_ids = {id(op) for op in anchors}
    for op in ops:
        if id(op) not in anchor_ids:
            near = min(calls, key=lambda c: max(c["start"] - op.end, op.start - c["end"], 0.0))
            near["ops"].append(op)
    return [sorted(c["ops"], key=lambda o: o.start) for c in calls]


def lanes(items, nest: bool = True):
    """Assigns (start, end, payload) items, sorted by start, to the fewest lanes in
    which no two overlap; with `nest`, an item inside another may share its lane (it is
    drawn as its child). Yields (lane, item)."""
    stacks: list[list[float]] = []
    for item in items:
        s, e = item[0], item[1]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= s + _EPS:
                stack.pop()
            if not stack or (nest and e <= stack[-1] + _EPS):
                stack.append(e)
                yield lane, item
                break
        else:
            stacks.append([e])
            yield len(stacks) - 1, item


def union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def subtract(a, b) -> list[tuple[float, float]]:
    """union(a) minus union(b)."""
    out, b = [], union(b)
    for s, e in union(a):
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def intersect(a, b) -> list[tuple[float, float]]:
    return subtract(a, subtract(a, b))


def collective_spans(ops, pid: int, step, t0: float, span) -> list[dict]:
    """The call spans of a run (lanes tid 1, 2, ...) with their point-to-point steps inside."""
    keyed = defaultdict(list)
    for op in ops:
        key = call_key(op)
        if key is not None:
            keyed[key].append(op)
    calls = [(min(o.start for o in c), max(o.end for o in c), (key, c))
             for key, kops in keyed.items() for c in split_calls(kops)]
    out = []
    for lane, (s, e, (key, cops)) in lanes(sorted(calls, key=lambda t: (t[0], -t[1])), nest=False):
        tid = 1 + lane
        names = dict((k, dict(a)) for k, a in key)
        backward = "pass" in names
        kind, args = key[-1 - backward][0], dict(key[-1 - backward][1])
        bucket = names.get("bucket", {})
        phase = [dict(a).get("name") for k, a in key if k == "phase"]
        # "allreduce ring data"; a send says what it carries: "send activations stage"
        title = (" ".join(str(a) for a in (kind, args.get("algorithm", args.get("name")), args.get("axis")) if a)
                 if kind != "xla" else f"{args['opcode']} {args['hlo']} (XLA)")
        if bucket:
            title += f", bucket {bucket['index'] + 1}/{bucket['of']}"
        if backward:
            title += " (backward)"
        steps = defaultdict(list)
        for op in cops:
            if step_index(op) is not None and is_collective(op.opcode):
                steps[step_index(op)].append(op)
        out.append(span(title, pid, tid, s, e, t0, type="collective", step=step, collective=kind,
                        algorithm=args.get("algorithm", "xla" if kind == "xla" else kind),
                        axis=str(args.get("axis", "")),
                        n=args.get("n"), bytes=args.get("bytes"), bucket=bucket.get("index"),
                        buckets=bucket.get("of"), phase=phase[-1] if phase else "other", p2p_steps=len(steps),
                        own_us=round(length((o.start, o.end) for o in cops), 3)))
        order = sorted(steps.items(), key=lambda kv: min(o.start for o in kv[1]))
        for j, (idx, sops) in enumerate(order):
            ps, pe = min(o.start for o in sops), max(o.end for o in sops)
            if j + 1 < len(order):
                pe = min(pe, min(o.start for o in order[j + 1][1]))
            nbytes = [dict(a).get("bytes") for k, a in sops[0].path if k == "step"][-1]
            out.append(span(f"step {idx}/{len(steps)}", pid, tid, ps, pe, t0, type="p2p", step=step, index=idx,
                            bytes=nbytes, call=title))
    return out
