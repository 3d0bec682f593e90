"""`python -m dpjax.timeline FILE [--png OUT]`: a timeline's tables (`summary`) and picture
(`plot`); `python -m dpjax.timeline build CAPTURE_DIR [--hlo PROGRAM.txt] -o OUT.json`: the
timeline of a kept profiler capture (`capture`, `build`)."""

from __future__ import annotations

import argparse
import sys

from dpjax.errors import UserError
from dpjax.timeline import capture
from dpjax.timeline.builder import build
from dpjax.timeline.plot import plot  # (it imports matplotlib when a picture is asked for)
from dpjax.timeline.recorder import save
from dpjax.timeline.summary import load, render, summarize

_BUILD_HELP = """\
Build a dpjax timeline from a kept jax.profiler capture (CPU or GPU) and print its summary.

CAPTURE_DIR is the --profile-dir of a `python -m dpjax.train --timeline` run (or any folder
holding one capture: plugins/profile/<time>/perfetto_trace.json.gz, or that session folder
itself). The trace names ops only by their HLO names; the compiled program's text names
them (phases, collectives). A dpjax run keeps it beside the capture (program0.hlo.txt);
for another program's capture pass --hlo: the text of
jax.jit(f).lower(*args).compile().as_text(), the step's first (its runs are the steps).
On a GPU, kernels inside CUDA command buffers (hlo_op command_buffer_N) cannot be named:
they are given to their step and the summary says so; profile with
XLA_FLAGS=--xla_gpu_enable_command_buffer= to see every op."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["build"]:
        return _build(argv[1:])
    p = argparse.ArgumentParser(prog="python -m dpjax.timeline",
                                description="Summarise a dpjax timeline: per step compute / communication / "
                                            "waiting at rendezvous, per device, per phase, per collective "
                                            "(time, bytes, nccl-tests bus bandwidth). To build a timeline "
                                            "from a kept profiler capture: python -m dpjax.timeline build "
                                            "--help.")
    p.add_argument("file", help="a timeline written by python -m dpjax.train --timeline FILE (or by "
                                "python -m dpjax.timeline build)")
    p.add_argument("--png", metavar="OUT", help="also draw one step per device and the split per device")
    args = p.parse_args(argv)
    try:
        data = load(args.file)
        summary = summarize(data)
    except UserError as e:
        return _refuse(e)
    print(render(summary))
    if args.png:
        plot(data, summary, args.png)
        print(f"wrote {args.png}")
    return 0


def _build(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.timeline build", description=_BUILD_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture_dir", metavar="CAPTURE_DIR", help="a kept capture (--profile-dir of a run)")
    p.add_argument("--hlo", metavar="PROGRAM.txt", action="append",
                   help="a compiled program's HLO text; repeat for more programs, the step's first "
                        "(default: the program*.hlo.txt kept beside the capture)")
    p.add_argument("-o", "--out", metavar="OUT.json", required=True,
                   help="the timeline to write (.json or .json.gz); summarise it again with "
                        "python -m dpjax.timeline OUT.json")
    args = p.parse_args(argv)
    try:
        events, programs = capture.load(args.capture_dir, args.hlo)
        timeline = build(events, programs)
        summary = summarize(timeline)
    except UserError as e:
        return _refuse(e)
    save(timeline, args.out)
    print(render(summary))
    print(f"wrote {args.out}")
    return 0


def _refuse(e: UserError) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2
