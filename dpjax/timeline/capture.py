"""A profiler capture on disk: its trace and the programs' HLO text kept beside it.

`jax.profiler` writes each profiling session to `DIR/plugins/profile/<time>/`, whose
`perfetto_trace.json.gz` is what a timeline is built from. The trace names ops only by
their HLO names, so a timeline also needs the compiled programs' text (`program`): a
`Recorder` with a kept folder (`--profile-dir`) writes it into each session it
captured, as `program0.hlo.txt` (the step: the program whose runs are the steps),
`program1.hlo.txt`, ... in the order they were registered. So

    python -m dpjax.timeline build DIR -o OUT.json

rebuilds the timeline of a kept capture alone; for another program's capture, name its
text with `--hlo` (`jax.jit(f).lower(*args).compile().as_text()`).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

from dpjax.errors import UserError
from dpjax.timeline.program import Program

TRACE = "perfetto_trace.json.gz"
_KEPT = re.compile(r"^program(\d+)\.hlo\.txt$")


def sessions(folder: str) -> list[str]:
    """The capture sessions in `folder`: itself if it holds a trace, else each
    `plugins/profile/<time>/` below it that does (oldest first)."""
    if os.path.isfile(os.path.join(folder, TRACE)):
        return [folder]
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(folder, "plugins", "profile", "*", TRACE)))


def read_events(session: str) -> list[dict]:
    """A session's raw trace events."""
    with gzip.open(os.path.join(session, TRACE)) as fh:
        return json.load(fh)["traceEvents"]


def keep_programs(session: str, texts: list[str]) -> None:
    """Writes the programs' HLO text beside a session's trace (the first: the step)."""
    for k, text in enumerate(texts):
        with open(os.path.join(session, f"program{k}.hlo.txt"), "w") as fh:
            fh.write(text)


def kept_programs(session: str) -> list[str]:
    """The HLO files a Recorder kept beside the trace, the step's first."""
    found = [(int(m.group(1)), name) for name in os.listdir(session) if (m := _KEPT.match(name))]
    return [os.path.join(session, name) for _, name in sorted(found)]


def load(folder: str, hlo: list[str] | None = None) -> tuple[list[dict], list[Program]]:
    """The raw events of the one capture in `folder` and its programs (`hlo` files, the
    step's first; by default the ones kept beside it). Bad input raises UserError (one line)."""
    if not os.path.isdir(folder):
        raise UserError(f"no capture folder {folder!r}: pass the --profile-dir of a run, or a folder "
                        f"holding {TRACE}")
    found = sessions(folder)
    if not found:
        raise UserError(f"{folder!r} holds no {TRACE} (nor plugins/profile/*/{TRACE}): profile with "
                        "jax.profiler.start_trace(..., create_perfetto_trace=True) or --timeline --profile-dir")
    if len(found) > 1:
        raise UserError(f"{folder!r} holds {len(found)} captures; name one: "
                        + ", ".join(found[:3]) + (", ..." if len(found) > 3 else ""))
    session = found[0]
    paths = list(hlo or []) or kept_programs(session)
    if not paths:
        raise UserError(f"no program text beside the capture in {session!r}: pass --hlo PROGRAM.txt (the step's "
                        "compiled HLO: jax.jit(f).lower(*args).compile().as_text())")
    programs = [_program(p) for p in paths]
    try:
        events = read_events(session)
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
        raise UserError(f"{os.path.join(session, TRACE)!r} is not a readable trace "
                        f"({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})") from None
    ran = {str((e.get("args") or {}).get("hlo_module")) for e in events if isinstance(e, dict)} - {"None"}
    if programs[0].module not in ran:
        raise UserError(f"the capture ran no program {programs[0].module!r} (from {paths[0]}); it ran: "
                        + (", ".join(sorted(ran)) or "none"))
    return events, programs


def _program(path: str) -> Program:
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        raise UserError(f"no HLO file {path!r}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path!r} is not compiled HLO text ({type(e).__name__})") from None
    try:
        return Program.from_text(text)
    except ValueError as e:
        raise UserError(f"{path!r} is {e}") from None
