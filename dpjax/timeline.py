"""Timelines: where each profiled step's time goes, per device, as a Chrome trace / Perfetto file.

Horovod found tensor fusion by reading timelines ("models with a large amount of tensors
... tended to have many tiny allreduce operations"; Sergeev & Del Balso 2018, and
`HOROVOD_TIMELINE`). A dpjax timeline is made from the runtime's own trace, not from
Python timers: `jax.profiler` records every HLO op each device executes (`hlo_module`,
`hlo_op`, `device_ordinal`, `run_id`) and, on the CPU backend, the rendezvous of every
collective ("Wait: pending_threads=k/n", "Wait for rendezvous callback": a device waiting
for the others). The compiled program's text gives each op its `op_name`, in which
dpjax's named scopes (`dpjax.scopes`) say which phase, fusion bucket, collective call and
point-to-point step it belongs to. Joined by `hlo_op`, they become, per device (one
Perfetto process each): the step and its phases; each collective call (algorithm, axis,
bucket, bytes) with each ring / butterfly step inside it; and every op, with the
rendezvous waits inside the collectives. The host (pid 0) shows the steps' data,
dispatch, host wait and checkpoint phases (`Recorder.phase`).

Nothing here runs unless asked: a `Recorder` profiles only between `start()` and
`stop()` (or inside `profile()`), and the named scopes change no op. This module
captures; `timeline_build` joins the trace to the programs, `timeline_spans` groups a
device's ops into spans, `timeline_summary` is `python -m dpjax.timeline FILE` (the
tables) and `timeline_plot` its `--png`. They read traces and import no step code.

    with dpjax.timeline.record("step.trace.json", step, params, state, batch) as tl:
        for i in range(3):
            with tl.step(i):
                params, state, loss = step(params, state, batch)
                jax.block_until_ready(loss)
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from dpjax import scopes
from dpjax.timeline_spans import is_collective

FORMAT = "dpjax-timeline/1"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*.*?\s(?P<opcode>[a-z][\w\-]*)\((?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_MODULE = re.compile(r"^HloModule\s+([^\s,]+)", re.M)


@dataclass(frozen=True)
class Program:
    """A compiled program's ops: hlo op name -> (opcode, op_name)."""

    module: str
    ops: dict

    @classmethod
    def from_text(cls, hlo_text: str) -> "Program":
        m = _MODULE.search(hlo_text)
        if m is None:
            raise ValueError("not compiled HLO text: no 'HloModule' line")
        ops = {}
        for line in hlo_text.splitlines():
            i = _INSTR.match(line)
            if i:
                name = _OP_NAME.search(i.group("rest"))
                ops[i.group("name")] = (i.group("opcode"), name.group(1) if name else "")
        return cls(m.group(1), ops)

    def collective_ops(self) -> list[str]:
        """The collective instructions (the ops that move data between devices)."""
        return [n for n, (opc, _) in self.ops.items() if is_collective(opc)]


def compiled_text(fn, *args, **kwargs) -> str:
    """The compiled HLO of jitted `fn` at these arguments (arrays or ShapeDtypeStructs).
    After a call with the same shapes and shardings this is JAX's cached executable:
    its op names are the ones a profile of those calls records."""
    import jax

    abstract = jax.tree.map(_abstract, (args, kwargs))
    return fn.lower(*abstract[0], **abstract[1]).compile().as_text()


def _abstract(x):
    import jax

    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x


class Recorder:
    """Profiles what runs inside `profile()` (and nothing else), then `write`s the timeline.

    programs: register the jitted functions whose ops to name with `program(fn, *args)`;
    the first registered is the step the summary counts (one run of it = one step).
    Host annotations (`step(i)`, `phase(name)`) cost nothing outside `profile()`."""

    def __init__(self):
        self.programs: dict[str, Program] = {}
        self.main: str | None = None
        self._dir: str | None = None
        self._active = False

    def program(self, fn, *args, **kwargs) -> Program:
        prog = Program.from_text(compiled_text(fn, *args, **kwargs))
        self.programs[prog.module] = prog
        self.main = self.main or prog.module
        return prog

    @property
    def active(self) -> bool:
        return self._active

    def start(self) -> None:
        """Starts profiling (`jax.profiler`, into a temporary folder)."""
        import jax

        self._dir = self._dir or tempfile.mkdtemp(prefix="dpjax-timeline-")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python function events: many, and not ours to show
        jax.profiler.start_trace(self._dir, create_perfetto_trace=True, profiler_options=options)
        self._active = True

    def stop(self) -> None:
        import jax

        self._active = False
        jax.profiler.stop_trace()

    @contextlib.contextmanager
    def profile(self):
        """Profiles what runs inside (and only that)."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def step(self, index: int):
        """Host annotation: what runs inside is step `index` (the k-th run of the main
        program inside the k-th annotated step takes its number)."""
        return self._annotate(scopes.name("step", str(int(index))))

    def phase(self, which: str):
        """Host annotation: a phase of the host's loop (scopes.HOST_PHASES)."""
        assert which in scopes.HOST_PHASES, which
        return self._annotate(scopes.name("phase", which))

    def _annotate(self, text: str):
        if not self._active:
            return contextlib.nullcontext()
        import jax

        return jax.profiler.TraceAnnotation(text)

    def raw_events(self) -> list[dict]:
        """The events of every profile() so far (one perfetto_trace.json.gz per session)."""
        events = []
        for path in sorted(glob.glob(os.path.join(self._dir or "", "plugins", "profile", "*",
                                                  "perfetto_trace.json.gz"))):
            with gzip.open(path) as fh:
                events += json.load(fh)["traceEvents"]
        return events

    def write(self, path: str) -> dict:
        """Builds the timeline of what was profiled, writes it to `path` (gzipped if it
        ends in .gz), deletes the raw trace, and returns the timeline."""
        if not self.programs:
            raise ValueError("register the profiled step with Recorder.program(fn, *args) before write()")
        from dpjax.timeline_build import build

        timeline = build(self.raw_events(), list(self.programs.values()), main=self.main)
        save(timeline, path)
        shutil.rmtree(self._dir or "", ignore_errors=True)
        self._dir = None
        return timeline


@contextlib.contextmanager
def record(path: str, fn, *args, **kwargs):
    """Profiles the block and writes its timeline to `path`; `fn` (jitted) at `args` is
    the step whose runs are the steps (pass its arguments before the call donates them)."""
    rec = Recorder()
    rec.program(fn, *args, **kwargs)
    with rec.profile():
        yield rec
    rec.write(path)


def save(timeline: dict, path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as fh:
        json.dump(timeline, fh, separators=(",", ":"))


def main(argv=None) -> int:
    from dpjax.timeline_summary import main as summary_main

    return summary_main(argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
