"""The plan: `Plan`, everything a run is built from, and the three ways to make one.

`resolve(settings, devices)` checks and resolves a run's settings (every check here, once:
a one-line `UserError`); `for_layout` plans a dpjax model on a layout made by hand;
`for_rule` plans research code's own `UpdateRule`. A plan is immutable and made again
for another device count (`Plan.for_devices`), or another exchange (`Plan.with_exchange`,
the autotune's candidates): both resolve the settings again, which is why the class and
`resolve` share this room.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dpjax.collectives.registry import nested
from dpjax.compression import Exchange, Form, sharded  # the plan builds the exchange and sets its form (for_layout)
from dpjax.compression.accounting import ratio
from dpjax.compute.policy import Policy
from dpjax.links import AxisLink
from dpjax.mesh import as_axes, data_axes, dp_size
from dpjax.models import get_model
from dpjax.models.base import Decoder
from dpjax.models.lora import Split
from dpjax.optim import ADAM_B1, ADAM_B2, ADAM_EPS, LR_SCHEDULES, OptimizerConfig
from dpjax.pipeline import check_batch
from dpjax.plan.axes import check_context, check_expert, links_of, mesh_of, pipeline_of
from dpjax.plan.checks import UsageError, check, model_choice, settled
from dpjax.plan.compute import DEFAULT_FUSION_MB, check_memory, compute_policy, default_allreduce, target_platform
from dpjax.plan.fit import fit_devices
from dpjax.plan.lora import lora_model, trained_split
from dpjax.plan.memory import Estimate
from dpjax.plan.task import check_task, rate_notes
from dpjax.plan.workers import shards_of, workers_of
from dpjax.settings import DEFAULT_LR, Settings
from dpjax.sharding import Layout, make_layout
from dpjax.updates import UpdateRule, UpdateSpec, make_rule, parse_update
from dpjax.updates.registry import Optimizer, get


@dataclass(frozen=True)
class Plan:
    """Everything a run is built from, resolved for one set of devices.

    layout: where every parameter lives (`dpjax.sharding.Layout`: tensor-parallel, FSDP,
    the workers, the pipeline); rule: the `dpjax.updates.UpdateRule` between the workers,
    wrapping the inner optimizer; passes: micro-batches per step (one exchange); links:
    emulated slow links (`dpjax.links.AxisLink`); model, opt, global_batch: for runs of a
    dpjax model (None for research code's own loss); autotune: the knobs set to `auto`.
    """

    mesh: Mesh
    layout: Layout
    rule: UpdateRule
    exchange: Exchange = Exchange()
    passes: int = 1
    links: tuple[AxisLink, ...] = ()
    global_batch: int | None = None
    model: Decoder | None = None
    opt: OptimizerConfig | None = None
    update: UpdateSpec | None = None  # the parsed --update
    autotune: tuple[str, ...] = ()
    settings: Settings | None = None
    optimizer: optax.GradientTransformation | None = None  # an optax transformation given instead of `opt`
    tensor_parallel: bool = True
    policy: Policy = Policy()  # the compute policy: dtype, remat, attention kernel, scan (dpjax.compute.policy)
    notes: tuple[str, ...] = ()  # one-line remarks the run prints once (e.g. why not cuDNN attention)
    # the planner's estimate per device (dpjax.plan.memory.estimate: bytes by part) and what a device has
    memory: Estimate | None = None
    split: Split | None = None  # LoRA (dpjax.models.lora.Split): the trained part of the parameters; None: all of them

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
        return get(self.update.kind).period(self.update) if self.update is not None else 1

    def with_exchange(self, algorithm: str, fusion_mb: float) -> "Plan":
        """The same run with another allreduce algorithm and fusion cap (the autotune's
        candidates): the FSDP gathers and the rule's exchanges follow the algorithm."""
        exchange = dataclasses.replace(self.exchange, algorithm=algorithm, fusion_mb=float(fusion_mb))
        assert self.settings is not None, "the autotune plans again from the run's settings"
        return resolve(self.settings, mesh=self.mesh, model=self.model, optimizer=self.optimizer, exchange=exchange,
                       tensor_parallel=self.tensor_parallel)

    def for_devices(self, devices) -> "Plan":
        """The same settings planned again for another set of devices: an explicit mesh is
        resized and the global batch kept, in more or fewer micro-batches (`fit_devices`)."""
        assert self.settings is not None, "an elastic restart plans again from the run's settings"
        settings = fit_devices(self.settings, len(devices))
        # the exchange keeps what was chosen (an autotune's algorithm and fusion), but its per-shard
        # form is cut by the new mesh: a site that lost devices holds fewer shards (and error buffers)
        mesh = mesh_of(settings, devices)
        exchange = dataclasses.replace(self.exchange, shards=shards_of(settings, mesh, self.exchange.compress_axes))
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
        model = self.model
        if self.exchange.compression is not None and model is not None:
            out["compression_ratio"] = ratio(self)
            if self.exchange.form is Form.FSDP and self.exchange.error_buffers:
                abstract = jax.eval_shape(lambda k: lay.store(model.init(k)), jax.random.key(0))
                out["compression_error_buffer"] = {  # what FSDP saved on the parameters, spent again
                    "bytes_per_device": sharded.error_bytes(lay, abstract),
                    "mirrors": "each device's full local gradient, before FSDP's reduce-scatter"}
        return out


def resolve(s: Settings, devices=None, *, mesh=None, model=None, optimizer=None, exchange: Exchange | None = None,
            tensor_parallel: bool = True) -> Plan:
    """The plan of settings `s` on `devices` (default: every device; or an already built
    `mesh`). model: a model object instead of `s.model` and its options; optimizer: an
    optax transformation instead of the one `s.optimizer` names (tests' reference
    optimizers); exchange: the allreduce setting instead of the settings' (an autotune's
    candidate); tensor_parallel=False: every parameter replicated over `model` (the
    experiments' dense baselines). Raises UsageError (one line) for anything that does
    not fit."""
    s = settled(s)  # e.g. 1-bit Adam's default compression: the plan (and its settings) carry it
    check(s)
    if mesh is None:
        mesh = mesh_of(s, devices)
    update = parse_update(s.update)
    platform = target_platform(s, mesh)
    given = exchange
    if exchange is None:
        exchange = Exchange(default_allreduce(platform) if s.allreduce in ("auto", None) else s.allreduce,
                            DEFAULT_FUSION_MB if s.fusion_mb == "auto" else float(s.fusion_mb),
                            None if s.compression == "none" else s.compression)
    workers, compress_axes = workers_of(s, mesh, update, exchange)
    if given is None:
        exchange = dataclasses.replace(exchange, compress_axes=compress_axes, shards=shards_of(s, mesh, compress_axes))
    exchange = exchange.placed(s.fsdp, workers)  # its form, as for_layout sets it on the layout made below
    if nested(s.allreduce) and len(data_axes(mesh)) < 2:
        raise UsageError(f"--allreduce {s.allreduce} needs a node axis: use a three-axis mesh such as 2x4x1")
    if model is None:
        name, options = model_choice(s)
        model = get_model(name, **options)
    model = lora_model(s, model)  # --lora / --adapter: the base frozen, adapters trained (dpjax.models.lora)
    check_context(s, model, mesh)
    check_expert(s, model, mesh, update, exchange, workers)
    check_task(s, model, mesh)
    policy, notes = compute_policy(s, model, platform)
    notes = [*notes, *rate_notes(s, DEFAULT_LR)]
    pipeline = pipeline_of(s, model, mesh, exchange)
    layout = make_layout(model, mesh, algorithm=s.tp_allreduce, fsdp=s.fsdp, fsdp_algorithm=exchange.algorithm,
                         workers=workers, pipeline=pipeline, tensor_parallel=tensor_parallel)
    links = links_of(s, mesh)
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
    update = parse_update(update) if isinstance(update, str) else update
    exchange = exchange.placed(layout.fsdp, layout.workers)  # its form on this layout, set once (dpjax.compression)
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

        own = Optimizer(opt, global_batch * passes, specs, ADAM_B1, ADAM_B2, ADAM_EPS)
    rule = make_rule(update, inner, layout.workers, seed=seed, optimizer=own, exchange=exchange)
    if exchange.form is Form.FSDP:  # FSDP's reduce-scatter carries the error feedback
        rule = sharded.wrap(rule, layout, exchange)
    return Plan(layout.mesh, layout, rule, exchange, passes, tuple(links), global_batch, model,
                opt if optimizer is None else None, update, optimizer=optimizer, split=split)


def for_rule(rule, mesh, abstract_params, *, param_specs=None, passes: int = 1,
             exchange: Exchange = Exchange()) -> Plan:
    """The plan of research code's own `rule` (a `dpjax.updates.UpdateRule`) for
    parameters shaped like `abstract_params`, each split over the non-data axes as
    `param_specs` says (default: replicated). The rule's axes are the worker axes; any
    other data axes average gradients synchronously inside each worker."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    specs = param_specs if param_specs is not None else jax.tree.map(lambda _: P(), abstract_params)
    layout = Layout(mesh, specs, workers=as_axes(rule.axes))
    return Plan(mesh, layout, rule, exchange.placed(layout.fsdp, layout.workers), passes)
