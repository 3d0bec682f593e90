"""A layer too big for one device, trained on 8: tensor parallelism and FSDP at work.

The model is a one-block GPT whose MLP is very wide (default d_model 512, d_ff 16384):
its first MLP matrix alone, with Adam's two moments, needs more memory than the
per-device budget (default 64 MiB). Each layout is compiled and its per-device memory
read from XLA's memory analysis of the compiled train step (arguments: parameters,
optimizer state and the batch; temporaries: activations, gradients, gathered weights),
beside what a single device would need for the same step, which is compiled but never
run. The sharded layouts then train for a few steps on the stdlib corpus.

    python experiments/huge_layer.py              # the RESULTS.md table
    python experiments/huge_layer.py --quick      # a smaller model, 2 steps
    python experiments/huge_layer.py --smoke      # a tiny one, 1 step (seconds)

Simulated CPU devices share the host's memory, so "per device" is what XLA plans for
each device's program; on GPUs it is what each GPU would allocate.
"""

from __future__ import annotations

import argparse
import sys
import time

import _bench

_bench.simulate(8)  # before jax starts: the layouts span 8 devices

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dpjax import step as S  # noqa: E402
from dpjax.data import make_streams  # noqa: E402
from dpjax.mesh import make_mesh  # noqa: E402
from dpjax.models import get_model  # noqa: E402
from dpjax.optim import OptimizerConfig  # noqa: E402
from dpjax.mesh import is_spec, spec_axes  # noqa: E402
from dpjax.sharding import make_layout  # noqa: E402

MiB = 2**20
LAYOUTS = [("1x1", False), ("1x8", False), ("2x4", False), ("8x1", True), ("2x4", True)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=16384, help="width of the huge MLP layer")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="training steps per sharded layout")
    p.add_argument("--budget-mib", type=float, default=64.0, help="the per-device memory budget")
    p.add_argument("--quick", action="store_true", help="d_model 128, d_ff 4096, budget 4 MiB, 2 steps")
    _bench.add_smoke(p, "d_model 64, d_ff 1024, budget 0.5 MiB, 1 step, every layout")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.d_ff, args.budget_mib, args.steps = 128, 4096, 4.0, 2
    if args.smoke:
        args.d_model, args.d_ff, args.budget_mib, args.steps, args.seq_len = 64, 1024, 0.5, 1, 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = get_model("gpt", seq_len=args.seq_len, d_model=args.d_model, n_layers=1, n_heads=8, d_ff=args.d_ff)
    opt = OptimizerConfig(name="adamw", lr=1e-3)
    layer_bytes = 3 * args.d_model * args.d_ff * 4  # w1 and Adam's mu and nu, float32
    budget = args.budget_mib * MiB
    print(f"model: GPT d_model {args.d_model}, d_ff {args.d_ff}, 1 block, "
          f"{sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))) / 1e6:.1f} M params")
    print(f"largest layer (w1 {args.d_model} x {args.d_ff}) with Adam state: {layer_bytes / MiB:.1f} MiB; "
          f"budget per device: {args.budget_mib:g} MiB")
    if layer_bytes <= budget:
        print("error: the largest layer fits the budget; raise --d-ff or lower --budget-mib", file=sys.stderr)
        return 2
    train, _ = make_streams("stdlib", args.seq_len, 0)
    rows = []
    for spec, fsdp in LAYOUTS:
        n = int(np.prod([int(v) for v in spec.split("x")]))
        mesh = make_mesh(spec, jax.devices()[:n])
        layout = make_layout(model, mesh, fsdp=fsdp)
        step = S.for_model(model, layout, global_batch=args.batch_size, opt=opt)
        params, opt_state = step.init(S.init_params(model, layout, jax.random.key(0)))
        batch = S.put_batch(train, 0, args.batch_size, mesh, passes=1)
        mem = step.train.lower(params, opt_state, batch).compile().memory_analysis()
        # The split leaves' share: (argument bytes - replicated leaves - this device's rows of the
        # batch) over the split leaves' whole size. Tensor parallelism on 2x4 should give 1/4.
        leaves = jax.tree.leaves((params, opt_state))
        specs = jax.tree.leaves((step.param_specs, step.state_specs), is_leaf=is_spec)
        split = [any(mesh.shape[a] > 1 for a in spec_axes(sp)) for sp in specs]
        repl = sum(x.nbytes for x, s in zip(leaves, split) if not s)
        whole = sum(x.nbytes for x, s in zip(leaves, split) if s)
        local_batch = batch.addressable_shards[0].data.nbytes
        share = (mem.argument_size_in_bytes - repl - local_batch) / whole if whole else 1.0
        w1 = params["blocks"]["mlp"]["w1_LsxDxFm"]  # the layer stack: L x D x F, one layer here
        w1_shard = w1.addressable_shards[0].data.shape[1:]
        total = mem.argument_size_in_bytes + mem.temp_size_in_bytes
        row = {"layout": spec + (" --fsdp" if fsdp else ""), "w1 shard": "x".join(map(str, w1_shard)),
               "args": mem.argument_size_in_bytes / MiB, "temp": mem.temp_size_in_bytes / MiB,
               "total": total / MiB, "fits": total <= budget, "losses": "", "share": share}
        if n > 1:  # the one-device program is compiled for its memory figure, never run
            losses, t0 = [], time.perf_counter()
            for i in range(args.steps):
                params, opt_state, loss = step.train(params, opt_state, S.put_batch(
                    train, i * args.batch_size, args.batch_size, mesh, passes=1))
                losses.append(float(loss))
            row["losses"] = " -> ".join(f"{v:.3f}" for v in losses)
            row["s/step"] = (time.perf_counter() - t0) / args.steps
        rows.append(row)
        print(f"  {row['layout']:<12} per device: args {row['args']:.1f} MiB + temp {row['temp']:.1f} MiB"
              f" = {row['total']:.1f} MiB ({'fits' if row['fits'] else 'over'}) {row['losses']}", flush=True)
        del params, opt_state
    print()
    print("| layout | w1 shard per device | params + opt state + batch (MiB) | split leaves' share | "
          f"temporaries (MiB) | total (MiB) | within {args.budget_mib:g} MiB | losses ({args.steps} steps) |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        share = "-" if r["share"] == 1.0 else f"1/{1 / r['share']:.2f}"
        print(f"| {r['layout']} | {r['w1 shard']} | {r['args']:.1f} | {share} | {r['temp']:.1f} | {r['total']:.1f} | "
              f"{'yes' if r['fits'] else 'no'} | {r['losses'] or '(compiled only)'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
