"""The train-step variants bench_train.py times: how each is built, and its figures.

`make_steps` is the one place a dpjax step is built from the benchmark's settings (the
plan's work: layout, rule, exchange); `xla_auto` the plain `jax.jit` baseline whose
collectives XLA's SPMD partitioner inserts. `build` (the default mode: one data-parallel
mesh, each allreduce algorithm) and `build_layouts` (`--layouts`: each mesh, dpjax's
explicit step against XLA's partitioning of the same shardings) return the variants as
dicts that bench_train.py checks and times alike.
"""

from __future__ import annotations

import math
import time

import numpy as np

from _bench import git_state, pick_devices

ALGORITHMS = ("ring", "psum", "butterfly", "tree", "ps")  # hierarchical needs a node axis


def make_steps(model, mesh, *, global_batch: int, opt, algorithm: str = "ring", fusion_mb: float = 64.0,
               tp_algorithm: str = "ring", fsdp: bool = False, pipeline=None, comm: bool = True,
               donate: bool = True):
    """(layout, dpjax.step.TrainStep) of the sync rule on `mesh`: the gradient averaged
    over the data axes by `algorithm` in `fusion_mb` buckets (FSDP: reduce-scattered by
    it), tensor-parallel layers allreducing with `tp_algorithm`, a stage axis run by
    `pipeline`. comm=False: each data-parallel rank steps on its own gradient, with no
    exchange (not a correct step: the floor that shows what communication costs)."""
    import dataclasses

    from dpjax import step as S
    from dpjax.mesh import data_axes
    from dpjax.compression import Exchange
    from dpjax.plan import for_layout
    from dpjax.sharding import make_layout
    from dpjax.updates import make_rule

    exchange = Exchange(algorithm, fusion_mb)
    if comm:
        layout = make_layout(model, mesh, algorithm=tp_algorithm, fsdp=fsdp, fsdp_algorithm=algorithm,
                             pipeline=pipeline)
        plan = for_layout(model, layout, global_batch=global_batch, opt=opt, exchange=exchange)
        return layout, S.for_plan(plan, donate=donate)
    # Every data rank its own worker (so no average inside a worker), under a sync rule
    # over no axes that claims those workers: nothing crosses the data axes. A plan no
    # setting makes (the floor is not a correct step), so its rule is put in by hand.
    layout = make_layout(model, mesh, algorithm=tp_algorithm, workers=data_axes(mesh))
    plan = for_layout(model, layout, global_batch=global_batch, opt=opt, exchange=exchange)
    rule = make_rule("sync", opt.make(global_batch, layout.specs), ())._replace(axes=layout.workers)
    return layout, S.for_plan(dataclasses.replace(plan, rule=rule), donate=donate)


def xla_auto(model, layout, tx, donate: bool = True):
    """(init, train) of plain `jax.jit` over `layout`'s shardings (parameters and optimizer
    state as dpjax keeps them, the batch split over the data axes): loss, gradient and
    update written for the global batch, every collective XLA's choice."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dpjax.mesh import data_axes
    from dpjax.sharding import state_specs

    mesh = layout.mesh
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    shard_p = layout.shardings()
    shard_o = layout.shardings(state_specs(tx, jax.eval_shape(tx.init, abstract), layout.specs))
    rows, rep = NamedSharding(mesh, P(data_axes(mesh) or None)), NamedSharding(mesh, P())

    def step(params, opt_state, batch_BxT1):
        loss, grads = jax.value_and_grad(model.loss)(params, batch_BxT1)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train = jax.jit(step, in_shardings=(shard_p, shard_o, rows), out_shardings=(shard_p, shard_o, rep),
                    donate_argnums=(0, 1) if donate else ())
    return jax.jit(tx.init, out_shardings=shard_o), train


def variant(model, mesh, host, batch_size, opt, auto: bool, **opts):
    """(fn, (params, state)) of one variant with optimizer config `opt`, from the host
    parameters `host` (one init for every variant and mesh)."""
    import jax

    layout, step = make_steps(model, mesh, global_batch=batch_size, opt=opt, **opts)
    params = jax.device_put(layout.store(host), layout.shardings())
    if auto:
        init, fn = xla_auto(model, layout, opt.make(batch_size), donate=opts.get("donate", True))
        return fn, (params, init(params))
    return step.train, step.init(params)


def sgd_update(model, mesh, host, batch_size, batch, auto: bool, **opts):
    """-(averaged gradient) of `batch`, as one flat host vector: one plain SGD step with
    lr 1 and no clipping. AdamW (what is timed) is invariant to the gradient's scale, so
    a loss check alone would not notice a sum where a mean belongs; this does."""
    from jax.flatten_util import ravel_pytree

    from dpjax.optim import OptimizerConfig

    sgd = OptimizerConfig(name="sgd", lr=1.0, clip_norm=0.0)
    fn, (p0, o0) = variant(model, mesh, host, batch_size, sgd, auto, donate=False, **opts)
    p1 = fn(p0, o0, batch)[0]
    return np.asarray(ravel_pytree(p1)[0]) - np.asarray(ravel_pytree(p0)[0])


def compiled_figures(fn, state, batch) -> dict:
    """Compile time and the collective ops of the compiled step."""
    from dpjax.collectives.cost import hlo_comm

    t0 = time.perf_counter()
    compiled = fn.lower(*state, batch).compile()
    comm = hlo_comm(compiled.as_text())
    return {"compile_s": time.perf_counter() - t0, "ops": dict(comm.ops), "hlo_bytes": comm.max_bytes}


def batches_for(stream, batch_size, mesh, auto: bool):
    """Four batches placed once and cycled (data loading is not what is measured): B x T+1
    for xla-auto, 1 x B x T+1 (one micro-batch) for dpjax's steps."""
    from dpjax import step as S

    return [S.put_batch(stream, i * batch_size, batch_size, mesh, passes=None if auto else 1) for i in range(4)]


def host_params(model, seed: int):
    """The model's initial parameters on the host: every variant starts from these."""
    import jax

    return jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(seed)))


def info_of(args, host, **extra) -> dict:
    import jax

    return {"params": int(sum(x.size for x in jax.tree.leaves(host))),
            "param_bytes": int(sum(x.nbytes for x in jax.tree.leaves(host))),
            "tokens_per_step": args.batch_size * args.seq_len, "jax": jax.__version__, "git": git_state(), **extra}


def build(args, parse_variant):
    """Default mode: one data-parallel mesh; xla-auto, each algorithm and fusion cap, no-comm."""
    import jax

    from dpjax.collectives.cost import schedule
    from dpjax.data import make_streams
    from dpjax.fusion import plan_buckets
    from dpjax.mesh import MODEL, data_axes, make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.optim import OptimizerConfig

    n = mesh_size(args.mesh)
    if n is None:
        raise SystemExit(f"error: give the mesh sizes explicitly, not {args.mesh!r}")
    mesh = make_mesh(args.mesh, pick_devices(n))
    if mesh.shape.get(MODEL, 1) != 1:
        raise SystemExit("error: this benchmark is pure data parallelism; use a model axis of 1 (e.g. 8x1)")
    dp = math.prod(mesh.shape[a] for a in data_axes(mesh))
    if args.batch_size % dp:
        raise SystemExit(f"error: --batch-size {args.batch_size} is not divisible by {dp} data-parallel ranks")
    model = get_model("gpt", seq_len=args.seq_len, **args.model_options)
    host = host_params(model, args.seed)
    stream, _ = make_streams("synthetic", args.seq_len, args.seed)
    batches = {auto: batches_for(stream, args.batch_size, mesh, auto) for auto in (True, False)}
    variants = {}
    for name in args.variants:
        alg, fusion = parse_variant(name, args.fusion_mb)
        auto, comm = alg is None, alg != "no-comm"
        opts = {} if auto else {"algorithm": alg if comm else "ring", "fusion_mb": args.fusion_mb if fusion is None
                                else fusion, "comm": comm}
        fn, state = variant(model, mesh, host, args.batch_size, OptimizerConfig(), auto, **opts)
        plan = plan_buckets(host, fusion * 2**20) if comm and not auto else None
        # Bytes the busiest device sends, from dpjax's alpha-beta model (exact for the explicit
        # algorithms); XLA's own all-reduce (xla-auto, psum) is modelled as a ring.
        sizes = [sum(b.sizes) for b in plan.buckets] if plan else [x.size for x in jax.tree.leaves(host)]
        model_bytes = sum(schedule(alg or "psum", dp, m).bytes for m in sizes) if comm else 0
        label = ("xla-auto" if auto else "no-comm floor (not averaged)" if not comm else
                 f"dpjax {alg}" + (", no fusion" if fusion == 0 else f"+fusion {fusion:g} MiB"))
        variants[name] = {"label": label, "fn": fn, "state": state, "batches": batches[auto], "buckets":
                          None if plan is None else len(plan.buckets), "model_bytes": model_bytes, "base": "xla-auto",
                          **compiled_figures(fn, state, batches[auto][0]),
                          "sgd_update": (lambda auto=auto, opts=opts: sgd_update(
                              model, mesh, host, args.batch_size, batches[auto][0], auto, **opts))}
    return variants, info_of(args, host, mesh=dict(mesh.shape), platform=mesh.devices.flat[0].platform)


def build_layouts(args):
    """--layouts: per mesh (and /fsdp), XLA's automatic sharding vs dpjax's explicit step,
    same shardings; each tensor-parallel algorithm in --tp-algorithm."""
    from dpjax.data import make_streams
    from dpjax.mesh import make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.optim import OptimizerConfig

    model = get_model("gpt", seq_len=args.seq_len, **args.model_options)
    host = host_params(model, args.seed)
    stream, _ = make_streams("synthetic", args.seq_len, args.seed)
    devs = pick_devices(max(mesh_size(lay.split("/")[0]) for lay in args.layouts))
    variants = {}
    for lay in args.layouts:
        spec, _, flag = lay.partition("/")
        mesh = make_mesh(spec, devs[:mesh_size(spec)])
        batches = {auto: batches_for(stream, args.batch_size, mesh, auto) for auto in (True, False)}
        tp_algs = args.tp_algorithms if mesh.shape["model"] > 1 else args.tp_algorithms[:1]
        for auto, tp_alg in [(True, tp_algs[0])] + [(False, a) for a in tp_algs]:
            opts = {"algorithm": args.layout_algorithm, "tp_algorithm": tp_alg, "fsdp": flag == "fsdp"}
            fn, state = variant(model, mesh, host, args.batch_size, OptimizerConfig(), auto, **opts)
            name = f"{lay} " + ("xla-auto" if auto else f"{args.layout_algorithm} tp-{tp_alg}")
            label = f"{lay}: " + ("xla-auto" if auto else f"dpjax {args.layout_algorithm}"
                                  + (f", tp {tp_alg}" if mesh.shape["model"] > 1 else ""))
            figures = compiled_figures(fn, state, batches[auto][0])
            variants[name] = {"label": label, "fn": fn, "state": state, "batches": batches[auto], "buckets": None,
                              "model_bytes": figures["hlo_bytes"], "base": f"{lay} xla-auto", **figures,
                              "sgd_update": (lambda mesh=mesh, auto=auto, opts=opts, b=batches[auto][0]: sgd_update(
                                  model, mesh, host, args.batch_size, b, auto, **opts))}
    return variants, info_of(args, host, mesh={"layouts": len(args.layouts)}, platform=devs[0].platform)
