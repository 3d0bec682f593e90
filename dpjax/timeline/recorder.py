"""Capturing a timeline: profile what runs inside `profile()`, then `write` the file.

A `Recorder` profiles only between `start()` and `stop()` (or inside `profile()`) with
`jax.profiler`, into a temporary folder (or `keep=DIR`, where the raw capture stays for
XProf / TensorBoard's profile plugin, with the registered programs' HLO text beside it,
so that `python -m dpjax.timeline build DIR` can build its timeline again:
`dpjax.timeline.capture`); `write` joins the raw trace to the registered
programs (`dpjax.timeline.build`) and saves the timeline. Host annotations (`step(i)`,
`phase(name)`) mark the loop's steps and phases and cost nothing outside a profile.

    with dpjax.timeline.record("step.trace.json", step, params, state, batch) as tl:
        for i in range(3):
            with tl.step(i):
                params, state, loss = step(params, state, batch)
                jax.block_until_ready(loss)
"""
from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import tempfile

import jax

from dpjax import scopes
from dpjax.timeline import capture
from dpjax.timeline.builder import build
from dpjax.timeline.program import Program, compiled_text

class Recorder:
    """Profiles what runs inside `profile()` (and nothing else), then `write`s the timeline.

    programs: register the jitted functions whose ops to name with `program(fn, *args)`;
    the first registered is the step the summary counts (one run of it = one step).
    Host annotations (`step(i)`, `phase(name)`) cost nothing outside `profile()`."""

    def __init__(self, keep: str | None = None):
        self.programs: dict[str, Program] = {}
        self.texts: dict[str, str] = {}  # module -> its HLO text (kept beside a kept capture)
        self.main: str | None = None
        self._dir: str | None = keep
        self._keep = keep  # a folder the raw capture stays in (for XProf / TensorBoard), else a temporary one
        self._active = False
        self._before: set | None = None  # captures the folder held before ours

    def program(self, fn, *args, **kwargs) -> Program:
        text = compiled_text(fn, *args, **kwargs)
        prog = Program.from_text(text)
        self.programs[prog.module], self.texts[prog.module] = prog, text
        self.main = self.main or prog.module
        return prog

    @property
    def active(self) -> bool:
        return self._active

    def start(self) -> None:
        """Starts profiling (`jax.profiler`, into a temporary folder)."""
        self._dir = self._dir or tempfile.mkdtemp(prefix="dpjax-timeline-")
        if self._before is None:  # a kept folder may hold earlier captures: not ours to read
            self._before = set(self._captures())
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python function events: many, and not ours to show
        jax.profiler.start_trace(self._dir, create_perfetto_trace=True, profiler_options=options)
        self._active = True

    def stop(self) -> None:
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

        return jax.profiler.TraceAnnotation(text)

    def raw_events(self) -> list[dict]:
        """The events of every profile() so far (one perfetto_trace.json.gz per session)."""
        return [e for session in self._ours() for e in capture.read_events(session)]

    def _captures(self) -> list[str]:
        return capture.sessions(self._dir) if self._dir else []

    def _ours(self) -> list[str]:
        return sorted(set(self._captures()) - (self._before or set()))

    def write(self, path: str) -> dict:
        """Builds the timeline of what was profiled, writes it to `path` (gzipped if it
        ends in .gz), deletes the raw trace (unless it was to be kept: then the programs'
        HLO text is kept beside it), and returns the timeline."""
        if not self.programs:
            raise ValueError("register the profiled step with Recorder.program(fn, *args) before write()")
        if self._keep:  # the step's text first (`build DIR` takes it for the step), kept even if building fails
            texts = [self.texts[self.main]] + [t for m, t in self.texts.items() if m != self.main]
            for session in self._ours():
                capture.keep_programs(session, texts)
        timeline = build(self.raw_events(), list(self.programs.values()), main=self.main)
        save(timeline, path)
        if not self._keep:
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

