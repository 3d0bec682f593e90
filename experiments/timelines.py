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
import statistics
import subprocess
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


def run_timelines(args) -> dict:
    out = {}
    for mesh in args.meshes.split(","):
        trace = os.path.join(args.out, f"timeline_{mesh}.trace.json.gz")
        cmd = [sys.executable, "-m", "dpjax.train", "--mesh", mesh, "--steps", str(args.steps), "--timeline",
               trace, "--timeline-steps", "3", "--eval-every", "0", "--progress", "log"]
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
    from dpjax.mesh import make_mesh
    from dpjax.models import get_model
    from dpjax.sharding import make_layout

    mesh = make_mesh("8x1", jax.devices()[:8])
    model = get_model("gpt", seq_len=128)
    layout = make_layout(model, mesh)
    stream = make_streams("synthetic", 128, 0)[0]
    batch = S.put_batch(stream, 0, 32, mesh, passes=1)
    variants = {}
    for name, ctx in (("named", contextlib.nullcontext), ("bare", without_names)):
        st = S.for_model(model, layout, global_batch=32)
        params, state = st.init(S.init_params(model, layout, jax.random.key(0)))
        with ctx():
            params, state, loss = st.train(params, state, batch)  # traces and compiles here
        jax.block_until_ready(loss)
        text = timeline.compiled_text(st.train, params, state, batch)
        variants[name] = {"step": st, "values": [params, state], "text": text, "ms": []}
    ops = {k: Counter(op for op, _ in timeline.Program.from_text(v["text"]).ops.values()) for k, v in variants.items()}
    profiled_ms = []
    rec = timeline.Recorder()
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = ["named", "bare"] if r % 2 == 0 else ["bare", "named"]
        for name in order:
            v = variants[name]
            t = time.perf_counter()
            *v["values"], loss = v["step"].train(*v["values"], batch)
            jax.block_until_ready(v["values"])
            v["ms"].append((time.perf_counter() - t) * 1e3)
        if r % 5 == 4:  # now and then the named step inside a profile
            v = variants["named"]
            with rec.profile():
                t = time.perf_counter()
                *v["values"], loss = v["step"].train(*v["values"], batch)
                jax.block_until_ready(v["values"])
                profiled_ms.append((time.perf_counter() - t) * 1e3)
    load.append(os.getloadavg()[0])
    named, bare = variants["named"]["ms"], variants["bare"]["ms"]
    return {"same_ops": ops["named"] == ops["bare"], "ops": sum(ops["named"].values()),
            "named_median_ms": statistics.median(named), "bare_median_ms": statistics.median(bare),
            "paired_ratio": statistics.median(a / b for a, b in zip(named, bare)),
            "profiled_median_ms": statistics.median(profiled_ms), "rounds": args.rounds,
            "load_1min": load, "named_ms": named, "bare_ms": bare, "profiled_ms": profiled_ms}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="2x4,8x1")
    p.add_argument("--steps", type=int, default=8, help="training steps per mesh (3 of them profiled)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the overhead measurement")
    p.add_argument("--out", default="/tmp/dpjax-timelines", help="traces, summaries and the JSON record")
    p.add_argument("--plots", default=os.path.join(HERE, "plots"))
    p.add_argument("--skip-overhead", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(),
              "timelines": run_timelines(args)}
    if not args.skip_overhead:
        from dpjax.mesh import simulate_cpu_devices

        simulate_cpu_devices(8)
        result["overhead"] = ov = overhead(args)
        print(f"== overhead on unprofiled steps (8x1, {ov['rounds']} interleaved rounds): same HLO ops: "
              f"{ov['same_ops']} ({ov['ops']} ops); median step with names {ov['named_median_ms']:.1f} ms, "
              f"without {ov['bare_median_ms']:.1f} ms, paired ratio {ov['paired_ratio']:.3f}; a profiled step "
              f"{ov['profiled_median_ms']:.1f} ms; load {ov['load_1min']}")
    result["load_after"] = os.getloadavg()
    with open(os.path.join(args.out, "timelines.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
