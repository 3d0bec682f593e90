"""Where a training step's time goes on this machine, and what the timeline itself costs.

    python experiments/timelines.py --out /tmp/timelines --plots experiments/plots

1. For each mesh (default: the main job `2x4` and `8x1`), the default GPT trains as a
   user runs it, `python -m dpjax.train --mesh M --steps S --timeline FILE
   --timeline-steps 3`, and `python -m dpjax.timeline FILE --png PLOT` summarises the
   profiled steps (the summaries go to OUT/summary_<mesh>.txt, the traces to OUT).
2. The timeline's own cost on steps it does not profile: the default GPT step on 8x1
   as built now (named scopes on every phase, bucket, collective and ring step) and as
   built without them (named scopes off and the public collectives unwrapped: the
   program dpjax compiled before timelines existed) are compiled, their HLO op counts
   compared, and their unprofiled step times measured side by side (interleaved rounds,
   the starting variant alternating, every step awaited; medians and the paired ratio).
   The same step inside a profile is timed too: what profiling costs the steps asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter

import _bench
from _bench import median

HERE = os.path.dirname(os.path.abspath(__file__))
# --smoke: a small GPT on 2 devices, for the runs (dpjax.train flags) and the overhead step
SMOKE_MODEL = ["--seq-len", "16", "--batch-size", "4", "--d-model", "32", "--n-heads", "4", "--d-ff", "64",
               "--n-layers", "1"]


def run_timelines(args) -> dict:
    out = {}
    for mesh in args.meshes.split(","):
        trace = os.path.join(args.out, f"timeline_{mesh}.trace.json.gz")
        cmd = [sys.executable, "-m", "dpjax.train", "--mesh", mesh, "--steps", str(args.steps), "--timeline",
               trace, "--timeline-steps", "3", "--eval-every", "0", "--progress", "log", *args.train_flags]
        t = time.time()
        train = subprocess.run(cmd, capture_output=True, text=True, check=True)
        png = os.path.join(args.plots, f"timeline_{mesh}.png")
        summary = subprocess.run([sys.executable, "-m", "dpjax.timeline", trace, "--png", png],
                                 capture_output=True, text=True, check=True).stdout
        with open(os.path.join(args.out, f"summary_{mesh}.txt"), "w") as fh:
            fh.write(summary)
        out[mesh] = {"command": " ".join(cmd[1:]), "seconds": time.time() - t,
                     "train_tail": train.stdout.strip().splitlines()[-3:], "summary": summary, "png": png}
        print(f"== {mesh}: {' '.join(cmd[1:])}\n{train.stdout.strip().splitlines()[-2]}\n{summary}", flush=True)
    return out


@contextlib.contextmanager
def without_names():
    """Traces as dpjax did before timelines: no named scopes, public collectives unwrapped."""
    import jax

    import dpjax.collectives as C

    saved = {n: getattr(C, n) for n in ("allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")}
    named_scope = jax.named_scope
    jax.named_scope = lambda name: contextlib.nullcontext()
    for n, f in saved.items():
        setattr(C, n, f.__wrapped__)
    try:
        yield
    finally:
        jax.named_scope = named_scope
        for n, f in saved.items():
            setattr(C, n, f)


def overhead(args) -> dict:
    import jax

    from dpjax import step as S
    from dpjax import timeline
    from dpjax.data import make_streams
    from dpjax.mesh import make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.sharding import make_layout

    mesh = make_mesh(args.overhead_mesh, jax.devices()[:mesh_size(args.overhead_mesh)])
    model = get_model("gpt", seq_len=args.seq_len, **args.model_options)
    layout = make_layout(model, mesh)
    stream = make_streams("synthetic", args.seq_len, 0)[0]
    batch = S.put_batch(stream, 0, args.batch_size, mesh, passes=1)
    variants = {}
    for name, ctx in (("named", contextlib.nullcontext), ("bare", without_names)):
        st = S.for_model(model, layout, global_batch=args.batch_size)
        params, state = st.init(S.init_params(model, layout, jax.random.key(0)))
        with ctx():
            params, state, loss = st.train(params, state, batch)  # traces and compiles here
        jax.block_until_ready(loss)
        text = timeline.compiled_text(st.train, params, state, batch)
        variants[name] = {"step": st, "values": [params, state], "text": text}
    ops = {k: Counter(op for op, _ in timeline.Program.from_text(v["text"]).ops.values()) for k, v in variants.items()}
    profiled_ms = []
    rec = timeline.Recorder()
    every = min(5, args.rounds)

    def run(name):
        v = variants[name]
        *v["values"], loss = v["step"].train(*v["values"], batch)
        jax.block_until_ready(v["values"])

    def now_and_then(r):  # the named step inside a profile, outside the interleaved timing
        if r % every == every - 1:
            with rec.profile():
                t = time.perf_counter()
                run("named")
                profiled_ms.append((time.perf_counter() - t) * 1e3)

    load = [_bench.load_avg()]
    secs = _bench.interleave({name: (lambda i, name=name: run(name)) for name in variants}, args.rounds,
                             after_round=now_and_then)
    load.append(_bench.load_avg())
    named, bare = ([t * 1e3 for t in secs[k]] for k in ("named", "bare"))
    return {"same_ops": ops["named"] == ops["bare"], "ops": sum(ops["named"].values()),
            "named_median_ms": median(named), "bare_median_ms": median(bare),
            "paired_ratio": median(a / b for a, b in zip(named, bare)),
            "profiled_median_ms": median(profiled_ms), "rounds": args.rounds,
            "load_1min": load, "named_ms": named, "bare_ms": bare, "profiled_ms": profiled_ms}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="2x4,8x1")
    p.add_argument("--steps", type=int, default=8, help="training steps per mesh (3 of them profiled)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the overhead measurement")
    p.add_argument("--out", default="/tmp/dpjax-timelines", help="traces, summaries and the JSON record")
    p.add_argument("--plots", default=os.path.join(HERE, "plots"))
    p.add_argument("--skip-overhead", action="store_true")
    _bench.add_smoke(p, "one mesh 2x1, a small GPT, 4 steps, 2 rounds")
    args = p.parse_args(argv)
    args.overhead_mesh, args.seq_len, args.batch_size, args.model_options, args.train_flags = "8x1", 128, 32, {}, []
    if args.smoke:
        args.meshes, args.steps, args.rounds, args.overhead_mesh = "2x1", 4, 2, "2x1"
        args.seq_len, args.batch_size, args.train_flags = 16, 4, SMOKE_MODEL
        args.model_options = {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_layers": 1}
        _bench.smoke_outputs(args, "out", "plots")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.plots, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(),
              "timelines": run_timelines(args)}
    if not args.skip_overhead:
        _bench.simulate(8)
        result["overhead"] = ov = overhead(args)
        print(f"== overhead on unprofiled steps ({args.overhead_mesh}, {ov['rounds']} interleaved rounds): "
              f"same HLO ops: {ov['same_ops']} ({ov['ops']} ops); "
              f"median step with names {ov['named_median_ms']:.1f} ms, without {ov['bare_median_ms']:.1f} ms, "
              f"paired ratio {ov['paired_ratio']:.3f}; a profiled step "
              f"{ov['profiled_median_ms']:.1f} ms; load {ov['load_1min']}")
    result["load_after"] = os.getloadavg()
    with open(os.path.join(args.out, "timelines.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
