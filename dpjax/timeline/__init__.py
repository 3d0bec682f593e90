"""Timelines: where each profiled step's time goes, per device, as a Chrome trace / Perfetto file.

Horovod found tensor fusion by reading timelines ("models with a large amount of tensors
... tended to have many tiny allreduce operations"; Sergeev & Del Balso 2018, and
`HOROVOD_TIMELINE`). A dpjax timeline is made from the runtime's own trace, not from
Python timers: `jax.profiler` records every HLO op each device executes (`hlo_module`,
`hlo_op`, `device_ordinal`, `run_id`) and, on the CPU backend, the rendezvous of every
collective ("Wait: pending_threads=k/n", "Wait for rendezvous callback": a device waiting
for the others); on a GPU, every kernel on its stream, and its launch by the host
(`dpjax.timeline.gpu`). The compiled program's text gives each op its `op_name`, in which
dpjax's named scopes (`dpjax.scopes`) say which phase, fusion bucket, collective call and
point-to-point step it belongs to. Joined by `hlo_op`, they become, per device (one
Perfetto process each): the step and its phases; each collective call (algorithm, axis,
bucket, bytes) with each ring / butterfly step inside it; and every op, with the
rendezvous waits inside the collectives. The host (pid 0) shows the steps' data,
dispatch, host wait and checkpoint phases (`Recorder.phase`).

Nothing here runs unless asked: a `Recorder` profiles only between `start()` and
`stop()` (or inside `profile()`), and the named scopes change no op. The modules, each
importing only those above it (no circle), and none importing step code:

    format     the file's format tag
    spans      a device's ops grouped into phase, call and point-to-point spans
    program    a compiled program's ops (`compiled_text`, `Program`)
    gpu        a GPU capture's kernels, their runs, CUDA command buffers
    builder    raw trace + programs -> the timeline (`build`)
    capture    a capture on disk: its trace, the HLO text kept beside it
    recorder   `Recorder`, `record`, `save`: capture and write
    summary    `load`, `summarize`, `render`: the tables
    plot       the picture (`--png`; matplotlib)
    cli        `python -m dpjax.timeline FILE [--png OUT]`, `... build CAPTURE_DIR`
               (`__main__`)

    with dpjax.timeline.record("step.trace.json", step, params, state, batch) as tl:
        for i in range(3):
            with tl.step(i):
                params, state, loss = step(params, state, batch)
                jax.block_until_ready(loss)
"""


from dpjax.timeline.builder import build
from dpjax.timeline.cli import main
from dpjax.timeline.format import FORMAT
from dpjax.timeline.program import Program, compiled_text
from dpjax.timeline.recorder import Recorder, record, save
from dpjax.timeline.summary import Summary, load, render, summarize

__all__ = ["FORMAT", "Program", "Recorder", "Summary", "build", "compiled_text", "load", "main", "record",
           "render", "save", "summarize"]
