"""Settings -> Plan: the ONE place a run's settings are checked and resolved.

    settings (flags, a library call)
       -> check(settings)                  what needs no devices (before JAX starts)
       -> resolve(settings, devices)       mesh, workers, layout (TP / FSDP / stages),
                                           exchange, update rule, links, batch and
                                           micro-batches, autotune knobs, memory
       -> Plan                             immutable; `dpjax.step` builds from it

Every check of the settings is made here, once, and raises a one-line `UserError`;
nothing below the plan checks them again (the library functions keep their own
contracts: a `ValueError` for a call that makes no sense). A plan can be made again for
another device count (`Plan.for_devices`): an elastic restart on fewer processes is a new
plan plus a resharding restore. Research code that brings its own loss and `UpdateRule`
gets its plan from `for_rule` (what `dpjax.make_update_step` does).

The plan knows nothing of how a step is traced; `dpjax.step.build(loss, plan)` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dpjax.plan.task import check_task
from dpjax.plan.lora import lora_model, trained_split
from dpjax.compression.exchange import Exchange  # the plan builds it (resolve, per_shard); dpjax.step reads it
from dpjax.compute.policy import Policy
from dpjax.settings import Settings
from dpjax.plan.axes import check_context, check_expert
from dpjax.plan.checks import UsageError, check, flag, model_choice, settled, warnings  # noqa: F401
from dpjax.plan.fit import devices_per_process, fit_devices, fit_mesh  # noqa: F401
from dpjax.plan.compute import (DEFAULT_ALGORITHM, DEFAULT_FUSION_MB, check_memory, compute_policy,  # noqa: F401
                                default_allreduce, memory_refusal, target_platform)


@dataclass(frozen=True)
class Plan:
    """Everything a run is built from, resolved for one set of devices.

    layout: where every parameter lives (`dpjax.sharding.Layout`: tensor-parallel, FSDP,
    the workers, the pipeline); rule: the `dpjax.updates.UpdateRule` between the workers,
    wrapping the inner optimizer; passes: micro-batches per step (one exchange); links:
    emulated slow links (`dpjax.links.AxisLink`); model, opt, global_batch: for runs of a
    dpjax model (None for research code's own loss); autotune: the knobs set to `auto`.
    """

    mesh: Any
    layout: Any
    rule: Any
    exchange: Exchange = Exchange()
    passes: int = 1
    links: tuple = ()
    global_batch: int | None = None
    model: Any = None
    opt: Any = None
    update: Any = None  # the parsed --update (dpjax.updates.UpdateSpec)
    autotune: tuple = ()
    settings: Settings | None = None
    optimizer: Any = None  # an optax transformation given instead of `opt`
    tensor_parallel: bool = True
    policy: Policy = Policy()  # the compute policy: dtype, remat, attention kernel, scan (dpjax.compute.policy)
    notes: tuple = ()  # one-line remarks the run prints once (e.g. why not cuDNN attention)
    memory: dict | None = None  # the planner's estimate per device (dpjax.plan.memory.estimate) and what a device has
    split: Any = None  # LoRA (dpjax.models.lora.Split): the trained part of the parameters; None: all of them

    @property
    def task(self) -> str:
        """What the step optimises (`dpjax.tasks`): the settings' (settled), else pretraining's."""
        return (self.settings.task if self.settings is not None else None) or "lm"

    @property
    def workers(self) -> tuple:
        return self.layout.workers

    @property
    def period(self) -> int:
        """The steps between the rule's exchanges between workers (`Kind.period`): one a
        step but for sparse:P (`dpjax.compression.accounting` reads it from here: that
        package sits below the rules)."""
        from dpjax.updates.registry import get

        return get(self.update.kind).period(self.update) if self.update is not None else 1

    def with_exchange(self, algorithm: str, fusion_mb: float) -> "Plan":
        """The same run with another allreduce algorithm and fusion cap (the autotune's
        candidates): the FSDP gathers and the rule's exchanges follow the algorithm."""
        exchange = dataclasses.replace(self.exchange, algorithm=algorithm, fusion_mb=float(fusion_mb))
        return resolve(self.settings, mesh=self.mesh, model=self.model, optimizer=self.optimizer, exchange=exchange,
                       tensor_parallel=self.tensor_parallel)

    def for_devices(self, devices) -> "Plan":
        """The same settings planned again for another set of devices: an explicit mesh is
        resized and the global batch kept, in more or fewer micro-batches (`fit_devices`)."""
        settings = fit_devices(self.settings, len(devices))
        # the exchange keeps what was chosen (an autotune's algorithm and fusion), but its per-shard
        # form is cut by the new mesh: a site that lost devices holds fewer shards (and error buffers)
        mesh = _mesh(settings, devices)
        exchange = dataclasses.replace(self.exchange, shards=_shards(settings, mesh, self.exchange.compress_axes))
        return resolve(settings, mesh=mesh, model=self.model, optimizer=self.optimizer, exchange=exchange,
                       tensor_parallel=self.tensor_parallel)

    def describe(self) -> dict:
        """The resolved plan as plain values (the run record)."""
        lay = self.layout
        out = {"mesh": dict(self.mesh.shape), "workers": list(lay.workers), "num_workers": lay.num_workers,
               "fsdp": lay.fsdp, "tp_allreduce": lay.algorithm, "update": str(self.update),
               "exchange": dict(self.exchange.kwargs(), compress_axes=self.exchange.compress_axes,
                                **({"per_shard": list(self.exchange.shards.axes)} if self.exchange.shards else {})),
               "passes": self.passes,
               "global_batch": self.global_batch, "links": [str(x) for x in self.links],
               "autotune": list(self.autotune), "policy": self.policy.describe()}
        if self.memory is not None:
            out["memory_estimate"] = dict(self.memory)
        if lay.pipeline is not None:
            out["pipeline"] = dataclasses.asdict(lay.pipeline)
        if self.exchange.compression is not None and self.model is not None:
            from dpjax.compression.accounting import ratio

            out["compression_ratio"] = ratio(self)
            from dpjax.compression import sharded

            if sharded.applies(lay, self.exchange.compression) and sharded.parse(self.exchange.compression).ef:
                import jax

                abstract = jax.eval_shape(lambda k: lay.store(self.model.init(k)), jax.random.key(0))
                out["compression_error_buffer"] = {  # what FSDP saved on the parameters, spent again
                    "bytes_per_device": sharded.error_bytes(lay, abstract),
                    "mirrors": "each device's full local gradient, before FSDP's reduce-scatter"}
        return out


# ---------------------------------------------------------------------------------------
# Resolving for a set of devices


def _pipeline(s: Settings, model, mesh, workers, exchange: Exchange):
    """The pipeline a stage axis runs (its schedule, micro-batches and chunks), or None;
    the pipeline's flags without a stage axis are refused."""
    from dpjax.compression import stateful
    from dpjax.mesh import STAGE
    from dpjax.pipeline import SCHEDULES, Pipeline
    from dpjax.pipeline import check as check_pipeline

    given = [flag(n) for n in ("schedule", "microbatches", "virtual_stages") if getattr(s, n) is not None]
    if STAGE not in mesh.axis_names:
        if given:
            raise UsageError(f"{', '.join(given)} needs a stage axis: name one in --mesh, e.g. "
                             f"--mesh stage=2,data={max(1, mesh.size // 2)}")
        return None
    schedule = s.schedule or "1f1b"  # a chunked schedule (interleaved) defaults to 2 chunks a stage
    chunks = s.virtual_stages or (2 if SCHEDULES[schedule].virtual_stages else 1)
    pipeline = check_pipeline(model, mesh, Pipeline(schedule, s.microbatches, chunks))
    if s.fsdp and not workers and stateful(exchange.compression):
        raise UsageError(f"--fsdp with --compression {s.compression} and a stage axis: the pipeline gathers the "
                         "stage's parameters itself; compress only between sites (--workers node "
                         "--compress-axes node)")
    return pipeline


def _links(s: Settings, mesh) -> tuple:
    """The emulated slow links, each on an axis the mesh has."""
    from dpjax.links import parse_link

    links = tuple(parse_link(text) for text in s.link or ())
    for link in links:
        if link.axis not in mesh.axis_names:
            raise UsageError(f"--link {link}: mesh {dict(mesh.shape)} has no axis {link.axis!r}")
    return links


def resolve(s: Settings, devices=None, *, mesh=None, model=None, optimizer=None, exchange: Exchange | None = None,
            tensor_parallel: bool = True) -> Plan:
    """The plan of settings `s` on `devices` (default: every device; or an already built
    `mesh`). model: a model object instead of `s.model` and its options; optimizer: an
    optax transformation instead of the one `s.optimizer` names (tests' reference
    optimizers); exchange: the allreduce setting instead of the settings' (an autotune's
    candidate); tensor_parallel=False: every parameter replicated over `model` (the
    experiments' dense baselines). Raises UsageError (one line) for anything that does
    not fit."""
    from dpjax.collectives.registry import nested
    from dpjax.mesh import data_axes
    from dpjax.models import get_model
    from dpjax.optim import LR_SCHEDULES, OptimizerConfig
    from dpjax.sharding import make_layout
    from dpjax.updates import parse_update

    s = settled(s)  # e.g. 1-bit Adam's default compression: the plan (and its settings) carry it
    check(s)
    if mesh is None:
        mesh = _mesh(s, devices)
    update = parse_update(s.update)
    workers, compress_axes = _workers(s, mesh, update)
    if nested(s.allreduce) and len(data_axes(mesh)) < 2:
        raise UsageError(f"--allreduce {s.allreduce} needs a node axis: use a three-axis mesh such as 2x4x1")
    if model is None:
        name, options = model_choice(s)
        model = get_model(name, **options)
    model = lora_model(s, model)  # --lora / --adapter: the base frozen, adapters trained (dpjax.models.lora)
    check_context(s, model, mesh)
    check_expert(s, model, mesh, update, workers)
    check_task(s, model, mesh)
    platform = target_platform(s, mesh)
    policy, notes = compute_policy(s, model, platform)
    if exchange is None:
        exchange = Exchange(default_allreduce(platform) if s.allreduce in ("auto", None) else s.allreduce,
                            DEFAULT_FUSION_MB if s.fusion_mb == "auto" else float(s.fusion_mb),
                            None if s.compression == "none" else s.compression, compress_axes=compress_axes,
                            shards=_shards(s, mesh, compress_axes))
    pipeline = _pipeline(s, model, mesh, workers, exchange)
    layout = make_layout(model, mesh, algorithm=s.tp_allreduce, fsdp=s.fsdp, fsdp_algorithm=exchange.algorithm,
                         workers=workers, pipeline=pipeline, tensor_parallel=tensor_parallel)
    links = _links(s, mesh)
    decay_start, decay_steps = LR_SCHEDULES[s.lr_schedule].window(s.steps, s.warmup_steps, s.decay_steps)
    opt = OptimizerConfig(name=s.optimizer, lr=s.lr, lr_scaling=s.lr_scaling, warmup_steps=s.warmup_steps,
                          weight_decay=s.weight_decay, clip_norm=s.clip_norm, lr_schedule=s.lr_schedule,
                          min_lr=s.min_lr, decay_start=decay_start if decay_steps else None, decay_steps=decay_steps)
    knobs = tuple(k for k, v in (("allreduce", s.allreduce), ("fusion_mb", s.fusion_mb)) if v == "auto")
    plan = for_layout(model, layout, global_batch=s.batch_size, update=update, opt=opt, optimizer=optimizer,
                      passes=s.backward_passes, exchange=exchange, links=links, seed=s.seed)
    plan = dataclasses.replace(plan, autotune=knobs, settings=s, tensor_parallel=tensor_parallel, policy=policy,
                               notes=tuple(notes))
    return check_memory(plan)


def for_layout(model, layout, *, global_batch: int, update="sync", opt=None, optimizer=None, passes: int = 1,
               exchange: Exchange = Exchange(), links: tuple = (), seed: int = 0) -> Plan:
    """The plan of a dpjax model on a layout already made (`dpjax.sharding.make_layout`;
    what `resolve` does after making it, and what tests that build layouts by hand call):
    the rule `update` names (e.g. "sparse:4") between the layout's workers, wrapping the
    optimizer `opt` (a `dpjax.optim.OptimizerConfig`: its clipping norm over the layout's
    shards, its lr scaled for `passes` x `global_batch`) or an optax `optimizer` as is."""
    from dpjax.compression import sharded
    from dpjax.mesh import dp_size
    from dpjax.optim import OptimizerConfig
    from dpjax.pipeline import check_batch
    from dpjax.updates import make_rule, parse_update

    update = parse_update(update) if isinstance(update, str) else update
    opt = opt if opt is not None or optimizer is not None else OptimizerConfig()
    split = trained_split(model, layout, exchange)
    specs = layout.specs if split is None else split.trained(layout.specs)  # what the rule updates and exchanges
    inner = optimizer if optimizer is not None else opt.make(global_batch * passes, specs)
    dp = dp_size(layout.mesh)
    if global_batch % dp:
        raise UsageError(f"--batch-size {global_batch} is not divisible by the {dp} data-parallel ranks of "
                         f"mesh {dict(layout.mesh.shape)}; use a multiple of {dp}")
    if layout.pipeline is not None:
        check_batch(layout.pipeline, global_batch // dp, f"--batch-size {global_batch} over {dp} data-parallel ranks")
    # an optimizer may bring its own rule (1-bit Adam owns the exchange between workers; the
    # registry finds it by the optimizer's name; an opt made by hand need not have one)
    own = None
    if opt is not None and optimizer is None and getattr(opt, "name", None):
        from dpjax.optim import ADAM_B1, ADAM_B2, ADAM_EPS
        from dpjax.updates.registry import Optimizer

        own = Optimizer(opt, global_batch * passes, specs, ADAM_B1, ADAM_B2, ADAM_EPS)
    rule = make_rule(update, inner, layout.workers, seed=seed, optimizer=own, exchange=exchange)
    if sharded.applies(layout, exchange.compression):  # FSDP's reduce-scatter carries the error feedback
        rule = sharded.wrap(rule, layout, exchange)
    return Plan(layout.mesh, layout, rule, exchange, passes, tuple(links), global_batch, model,
                opt if optimizer is None else None, update, optimizer=optimizer, split=split)


def _workers(s: Settings, mesh, update) -> tuple[tuple, tuple | None]:
    """(the worker axes, the compressed axes or None). A compression with error feedback
    compresses the exchange between workers (each worker keeps its error buffer), so
    with no --workers every data rank is a worker; --compress-axes makes its axes the
    workers (synchronous and exact inside each)."""
    from dpjax.compression import stateful
    from dpjax.mesh import data_axes, parse_axes

    given = None if s.workers is None else parse_axes(s.workers, mesh)
    if s.compress_axes is None:
        if given is not None:
            return given, None
        # FSDP (plan.check let only a linear method through) reduce-scatters compressed instead
        return default_workers(mesh, not update.is_sync or (stateful(s.compression) and not s.fsdp)), None
    axes = parse_axes(s.compress_axes, mesh, "--compress-axes")
    if s.compression in (None, "none"):
        raise UsageError(f"--compress-axes {s.compress_axes} needs a --compression")
    if given is not None and given != axes:
        raise UsageError(f"--compress-axes {s.compress_axes} compresses the exchange between workers: name the same "
                         f"axes in --workers (got {s.workers}), or leave --workers out")
    if s.fsdp and axes == data_axes(mesh):
        raise UsageError(f"--fsdp with --compress-axes {s.compress_axes}: FSDP splits over the data axes inside a "
                         "worker, and these are all of them; compress fewer (e.g. node)")
    return axes, axes


def _mesh(s: Settings, devices=None):
    """The mesh settings `s` name on `devices` (default: every device; no --mesh: all data)."""
    import jax

    from dpjax.mesh import make_mesh

    devs = list(jax.devices() if devices is None else devices)
    return make_mesh(s.mesh or f"{len(devs)}x1", devs)


def _shards(s: Settings, mesh, compress_axes):
    """The per-shard form settings `s` give on `mesh` (None with --compress-whole, or under
    FSDP, whose exchange is per shard already)."""
    return None if s.compress_whole or s.fsdp else per_shard(mesh, compress_axes)


def per_shard(mesh, compress_axes):
    """The per-shard form of the compressed exchange between the workers `compress_axes`
    (`dpjax.compression.shards`): each device of a worker sends its 1/k shard across, k
    the worker's devices on the other data axes; None without --compress-axes or for k = 1."""
    import math

    from dpjax.compression.shards import Shards
    from dpjax.mesh import data_axes

    if not compress_axes:
        return None
    inner = tuple(a for a in data_axes(mesh) if a not in compress_axes)
    k = math.prod(mesh.shape[a] for a in inner)
    return Shards(inner, k, tuple(a for a in mesh.axis_names if a not in compress_axes)) if k > 1 else None


def default_workers(mesh, per_worker: bool) -> tuple:
    """The worker axes when none are named: every data axis for rules whose workers
    diverge (each data-parallel rank a worker), none for sync (one synchronous group:
    FSDP then splits over every data axis, ZeRO-3)."""
    from dpjax.mesh import data_axes

    return data_axes(mesh) if per_worker else ()


def for_rule(rule, mesh, abstract_params, *, param_specs=None, passes: int = 1,
             exchange: Exchange = Exchange()) -> Plan:
    """The plan of research code's own `rule` (a `dpjax.updates.UpdateRule`) for
    parameters shaped like `abstract_params`, each split over the non-data axes as
    `param_specs` says (default: replicated). The rule's axes are the worker axes; any
    other data axes average gradients synchronously inside each worker."""
    import jax
    from jax.sharding import PartitionSpec as P

    from dpjax.mesh import as_axes
    from dpjax.sharding import Layout

    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    specs = param_specs if param_specs is not None else jax.tree.map(lambda _: P(), abstract_params)
    return Plan(mesh, Layout(mesh, specs, workers=as_axes(rule.axes)), rule, exchange, passes)
