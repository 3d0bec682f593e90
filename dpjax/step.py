"""THE step builder: a plan (`dpjax.plan`) -> jitted steps.

Every training step dpjax runs is assembled here from one `Plan`, whatever the rule
(sync, delayed, sparse, async: `dpjax.updates`), the layout (replicated, tensor-parallel
over `model`, FSDP over the data axes, workers over some data axes, stages:
`dpjax.sharding.Layout`) and the exchange (allreduce algorithm, tensor fusion, wire
compression, gradient accumulation). A feature is added once and composes with the
rest. Nothing here checks settings: the plan did.

Inside one `shard_map` a device holds its rows of the batch and its shards of the
parameters; the step is, per device:

    for each of the A micro-batches:        loss, g = value_and_grad(loss)(params, micro)
    g = sum / A                             (accumulation: A backward passes, one exchange)
    g = mean over the worker's own devices  (FSDP: already done by the reduce-scatter in the
                                             backward; else dpjax's fused allreduce over the
                                             inner data axes)
    params, state = rule.step(...)          (the rule's exchanges run over the worker axes)

With a `stage` axis (`layout.pipeline`) each pass's value_and_grad is the pipeline's
schedule (`dpjax.pipeline.staged`): the replica's rows cut into micro-batches that flow
through the stages, explicit ppermutes between them.

The worker axes are `layout.workers`; the rest of the data axes are synchronous data
parallelism inside each worker. Rules whose workers diverge (`rule.per_worker`) keep
every worker's parameters and state on a leading worker axis, split over the worker
axes, so each device holds its own worker's copy (sharded like the parameters it
mirrors) and a checkpoint holds them all. Every gradient and parameter byte between
devices goes through an explicit dpjax collective; the two scalar means (the reported
loss and the evaluation loss) are XLA's `lax.pmean` of one float.

Shape suffixes: a dimension split over a mesh axis is marked with the axis's initial
(`Bd`: the batch split over the data axes; `Fm`: split over `model`). Outside a
shard_map the name is the global array, inside it this device's block.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import links as emulation
from dpjax import scopes
from dpjax.compression import sharded
from dpjax.data_parallel import broadcast_params
from dpjax.fusion import leaf_classes
from dpjax.mesh import EXPERT, NOT_DATA, as_axes, axis_arg, data_axes, dp_size, is_spec, local_shape, spec_axes
from dpjax.pipeline import staged as pipeline_staged
from dpjax.plan import Exchange, Plan, for_layout, for_rule
from dpjax.sharding import Layout
from dpjax.updates import UpdateRule


@dataclass(frozen=True)
class TrainStep:
    """A rule's jitted steps over a layout. Values of per-worker rules carry the leading
    worker axis (`params_W`); sync values are plain.

    init(params) -> (params, state): from parameters laid out by the layout (broadcast
        from rank 0 over the data axes that replicate them, Horovod's broadcast);
    train(params, state, batch_AxBxT1) -> (params, state, mean loss over the global batch)
        and, for a model with figures of its own (`stats` not None; but FSDP through
        random-k), those of the same forward, averaged like the loss: (params, state, loss,
        stats);
    evaluate(params, batch_BxT1) -> mean loss of the consensus parameters;
    flush(params, state) -> (params, state): what is in flight lands;
    consensus(params) -> the parameters the workers agree on, without the worker axis.
    """

    layout: Layout
    rule: UpdateRule
    passes: int
    param_specs: Any
    state_specs: Any
    init: Callable
    train: Callable
    evaluate: Callable
    flush: Callable
    consensus: Callable
    stats: Callable | None = None  # stats(params, batch_BxT1) -> the model's own figures (a MoE's drops), or None

    @property
    def workers(self) -> int:
        return self.layout.num_workers

    def shardings(self):
        """(parameter shardings, state shardings) of the values the steps take."""
        return self.layout.shardings(self.param_specs), self.layout.shardings(self.state_specs)


def build(loss_fn, plan: Plan, *, abstract_params, donate: bool = True, value_and_grad=None,
          clock=None, loss_and_stats=None) -> TrainStep:
    """The steps of `plan` (`dpjax.plan`: its layout, rule between the workers, exchange,
    passes and links) for `loss_fn(params, batch_BdxT1, par) -> scalar` (`par`: the
    `dpjax.compute.tensor_parallel.Parallel` the layout gives; a model's `loss`).

    abstract_params: the parameters' shapes (ShapeDtypeStructs). The train batch is A x B
    (A = plan.passes micro-batches: A backward passes, one exchange). Collectives that
    cross an axis of `plan.links` wait for their emulated wire (no callback is compiled
    in without links). value_and_grad(params, batch_BdxT1, par) -> (loss, gradient): how
    this device's gradient is computed (default: `jax.value_and_grad(loss_fn)`; a
    pipeline's schedule, `dpjax.pipeline.staged`, on a layout with a stage axis). clock:
    the emulated links' `dpjax.links.Clock` (default: one on real time; a test passes one
    on `VirtualTime`). loss_and_stats(params, batch_BdxT1, par) -> (loss, a dict of
    scalars): `loss_fn` with figures of the model's own forward (a mixture's dropped
    choices), averaged over the devices like the loss: the train step returns its own
    forward's (no second forward a step) and the `stats` program computes them on a batch
    (none without it).
    """
    layout, exchange = plan.layout, plan.exchange
    assert as_axes(plan.rule.axes) == tuple(layout.workers), (plan.rule.axes, layout.workers)  # one plan made both
    par = dataclasses.replace(layout.parallel(fsdp_wire=exchange.wire), policy=plan.policy)  # dpjax.compute.policy
    # the "loss" the rule passes through is then (loss, stats); FSDP through random-k takes
    # its own local gradient (`_local_grad`): its steps leave the figures to the `stats` program
    step_stats = loss_and_stats is not None and not sharded.applies(layout, exchange.compression)
    if step_stats:
        assert value_and_grad is None, "dpjax.plan refuses experts beside a stage axis"
        value_and_grad = jax.value_and_grad(loss_and_stats, has_aux=True)
    grad_fn = _grad_fn(plan, *_local_grad(loss_fn, plan, par, value_and_grad))
    held = _Held.of(plan, abstract_params)
    bodies = _Bodies(plan, held, par, grad_fn, loss_fn, loss_and_stats, step_stats)
    smap = _smapper(plan, held, clock)
    pw, sw, rows = held.pspecs_w, held.sspecs_w, data_axes(layout.mesh) or None
    return TrainStep(
        layout, plan.rule, plan.passes, pw, sw,
        init=jax.jit(smap(bodies.init_body, (held.pspecs,), (pw, sw))),
        train=jax.jit(smap(bodies.train_body, (pw, sw, P(None, rows)), (pw, sw, P()) + ((P(),) if step_stats else ())),
                      donate_argnums=(0, 1) if donate else ()),
        evaluate=jax.jit(smap(bodies.eval_body, (pw, P(rows)), P())),
        flush=jax.jit(smap(bodies.flush_body, (pw, sw), (pw, sw))),
        consensus=jax.jit(smap(bodies.consensus_body, (pw,), held.pspecs)),
        stats=None if loss_and_stats is None else jax.jit(smap(bodies.stats_body, (pw, P(rows)), P())))


def _local_grad(loss_fn, plan: Plan, par, value_and_grad):
    """(value_and_grad(params, batch_BdxT1) -> this device's loss and gradient, zeros(params)
    -> a zero gradient to accumulate into). FSDP through random-k differentiates with
    respect to the gathered parameters, unreduced: its rule (wrapped, `sharded.wrap`)
    reduces."""
    layout = plan.layout
    loss_and_grad = functools.partial(value_and_grad or jax.value_and_grad(loss_fn), par=par)
    zeros_grad = lambda p: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
    if sharded.applies(layout, plan.exchange.compression):
        assert value_and_grad is None, "dpjax.plan refuses a stage axis here"
        loss_and_grad = sharded.local_value_and_grad(loss_fn, par, sharded.dp(layout))
        zeros_grad = lambda p: sharded.full_zeros(p, layout.gather_dims, sharded.dp(layout))  # noqa: E731

    def named(p, b):
        with scopes.phase("forward_backward"):  # names only (dpjax.scopes): the program is the same
            return loss_and_grad(p, b)

    return named, zeros_grad


def _grad_fn(plan: Plan, value_and_grad, zeros_grad):
    """grad_fn(params, batch_AxBdxT1) -> the worker's loss and gradient: A micro-batches
    accumulated, then averaged over the worker's own devices (`_inner_mean`)."""
    passes, inner_mean = plan.passes, _inner_mean(plan.layout, plan.exchange)

    def grad_fn(params, batch_AxBdxT1):
        assert batch_AxBdxT1.shape[0] == passes, (batch_AxBdxT1.shape, passes)
        if passes == 1:
            loss, g = value_and_grad(params, batch_AxBdxT1[0])
        else:
            def micro(carry, batch_BdxT1):
                loss, g = value_and_grad(params, batch_BdxT1)
                return (jax.tree.map(jnp.add, carry[0], loss), jax.tree.map(jnp.add, carry[1], g)), None

            shapes = jax.eval_shape(value_and_grad, params, batch_AxBdxT1[0])[0]  # the loss, or (loss, stats)
            zero = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), zeros_grad(params))
            (loss, g), _ = lax.scan(micro, zero, batch_AxBdxT1)
            loss, g = jax.tree.map(lambda x: x / passes, (loss, g))
        return loss, inner_mean(g)

    return grad_fn


@dataclass(frozen=True)
class _Held:
    """What each device holds inside the step's shard_maps: the parameters' and the rule's
    state's specs (`_w`: with the leading worker axis of a per-worker rule), and the local
    parameter shapes every body asserts (`local_w`: with that axis; `local`: without)."""

    pspecs: Any
    sspecs: Any
    pspecs_w: Any
    sspecs_w: Any
    local: Any
    local_w: Any
    per_worker: bool

    @classmethod
    def of(cls, plan: Plan, abstract_params) -> "_Held":
        layout, rule, mesh = plan.layout, plan.rule, plan.layout.mesh
        pspecs = layout.specs
        sspecs = rule.specs(pspecs, jax.eval_shape(rule.init, abstract_params))
        lead, stack = (), lambda tree: tree  # noqa: E731
        if rule.per_worker:
            lead = (layout.num_workers,)
            stack = lambda tree: jax.tree.map(lambda s: P(layout.workers or None, *s), tree,  # noqa: E731
                                              is_leaf=is_spec)
        pspecs_w = stack(pspecs)

        def local(specs, lead):
            return jax.tree.map(lambda a, sp: local_shape(lead + tuple(a.shape), sp, mesh), abstract_params, specs,
                                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))

        return cls(pspecs, sspecs, pspecs_w, stack(sspecs), local(pspecs, ()), local(pspecs_w, lead), rule.per_worker)

    def wrap(self, tree):
        """The worker axis put on (a per-worker rule's values), or the tree as it is."""
        return jax.tree.map(lambda x: x[None], tree) if self.per_worker else tree

    def unwrap(self, tree):
        return jax.tree.map(_one_worker, tree) if self.per_worker else tree

    def check(self, params_w):
        got = jax.tree.map(lambda x: tuple(x.shape), params_w)
        assert got == self.local_w, f"local parameter shapes {got} != {self.local_w}"


class _Bodies:
    """The per-device bodies of the step's programs (each inside its own shard_map; their
    names are the programs' module names, `jit_train_body`, which profiles and timelines show)."""

    def __init__(self, plan: Plan, held: _Held, par, grad_fn, loss_fn, loss_and_stats, step_stats: bool):
        self.plan, self.held, self.par, self.grad_fn = plan, held, par, grad_fn
        self.loss_fn, self.loss_and_stats, self.step_stats = loss_fn, loss_and_stats, step_stats
        layout = plan.layout
        axes = data_axes(layout.mesh)
        # a context axis's devices each hold a share of every sequence; an axis of one device averages nothing
        self.loss_axes = tuple(a for a in axes + layout.context_axes if layout.mesh.shape[a] > 1)
        self.local_rows = plan.global_batch // dp_size(layout.mesh) if plan.global_batch else None  # B / dp
        # Parameters are replicated over the data axes FSDP does not split: Horovod's
        # broadcast from rank 0 over those makes every replica start alike. A mixture's
        # experts differ along `expert` and FSDP never splits them: broadcast over every
        # other data axis (FSDP's or not), never over `expert`
        self.replicated_over = layout.workers if layout.fsdp else axes
        self.expert_over = tuple(a for a in axes if a != EXPERT)

    def init_body(self, params):
        held, layout = self.held, self.plan.layout
        got = jax.tree.map(lambda x: tuple(x.shape), params)
        assert got == held.local, f"init: local parameter shapes {got} != {held.local}"

        def broadcast(leaves, over):
            return broadcast_params(leaves, axis_arg(over), root=0) if over and leaves else leaves

        if self.replicated_over or self.expert_over:
            params = _by_leaf(params, layout.expert_leaves(), lambda ls: broadcast(ls, self.expert_over),
                              lambda ls: broadcast(ls, self.replicated_over))
        return held.wrap(params), held.wrap(self.plan.rule.init(params))

    def train_body(self, params, state, batch_AxBdxT1):
        held, passes, rows = self.held, self.plan.passes, self.local_rows
        held.check(params)
        assert batch_AxBdxT1.ndim == 3 and batch_AxBdxT1.shape[:2] == (passes, rows or batch_AxBdxT1.shape[1]), (
            batch_AxBdxT1.shape, passes, rows)
        with scopes.phase("optimizer"):  # the rule's own work; grad_fn's phases name themselves inside
            params, state, loss = self.plan.rule.step(self.grad_fn, held.unwrap(params), held.unwrap(state),
                                                      batch_AxBdxT1)
        with scopes.phase("loss"):
            loss = lax.pmean(loss, self.loss_axes)  # with stats, (loss, stats): the step returns both
        return held.wrap(params), held.wrap(state), *(loss if self.step_stats else (loss,))

    def eval_body(self, params, batch_BdxT1):
        rows = self.local_rows
        assert batch_BdxT1.ndim == 2 and batch_BdxT1.shape[0] == (rows or batch_BdxT1.shape[0]), (
            batch_BdxT1.shape, rows)
        return lax.pmean(self.loss_fn(self.consensus_body(params), batch_BdxT1, self.par), self.loss_axes)

    def stats_body(self, params, batch_BdxT1):
        figures = self.loss_and_stats(self.consensus_body(params), batch_BdxT1, self.par)[1]
        return jax.tree.map(lambda v: lax.pmean(v, self.loss_axes), figures)

    def flush_body(self, params, state):
        held = self.held
        held.check(params)
        return tuple(held.wrap(x) for x in self.plan.rule.flush(held.unwrap(params), held.unwrap(state)))

    def consensus_body(self, params):
        self.held.check(params)
        return self.plan.rule.consensus(self.held.unwrap(params))


def _smapper(plan: Plan, held: _Held, clock):
    """smap(fn, in_specs, out_specs): fn in a shard_map over the plan's mesh, traced with
    its collective calls numbered, timed on the emulated links (if any), and with the
    compression's fusion buckets never mixing parameters split differently."""
    mesh = plan.layout.mesh
    classes = jax.tree.map(lambda s: ",".join(a for a in spec_axes(s) if a in NOT_DATA and mesh.shape[a] > 1),
                           held.pspecs, is_leaf=is_spec)
    emulator = emulation.Emulator(mesh, tuple(plan.links), clock) if plan.links else None

    def smap(fn, in_specs, out_specs):
        if emulator is not None:  # collectives traced inside time themselves on the links
            fn = _traced_within(emulator.active, fn)
        fn = _traced_within(scopes.numbered_calls, fn)
        fn = _traced_within(lambda: leaf_classes(classes), fn)  # compression buckets never mix shards
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    return smap


def _inner_mean(layout: Layout, exchange: Exchange):
    """The mean of a worker's gradient over its own devices: dpjax's fused allreduce over
    the inner data axes (none under FSDP: its reduce-scatter in the backward pass already
    averaged over them) and the context axis (each of its devices took the gradient of
    its own tokens' loss; the mean over them is the gradient of the sequences' mean)."""
    axes = (layout.inner_axes if not layout.fsdp else ()) + layout.context_axes  # (dpjax.plan refuses a
    # nested algorithm, which reads two axes as levels, with a context axis)
    inside = exchange.inside()  # exact where only the exchange between workers is compressed

    def mean_over(over):
        return lambda g: inside.mean(g, over)[0]

    if not layout.expert_split:
        return mean_over(axes)
    # A device's experts got, through the all-to-all's transpose, the gradient of every
    # token routed to them from the whole expert axis: of the loss summed over its n
    # devices. The mean over the other axes and a division by n make it the mean's. FSDP
    # never gathers the experts, so no reduce-scatter averaged them: their axes are the
    # inner data axes even under FSDP.
    inner = tuple(a for a in layout.inner_axes if a != EXPERT) + layout.context_axes
    n, mean, experts_mean = layout.mesh.shape[EXPERT], mean_over(axes), mean_over(inner)
    return lambda g: _by_leaf(g, layout.expert_leaves(), lambda ls: [x / n for x in experts_mean(ls)], mean)


def _by_leaf(tree, mask, if_true, if_false):
    """`tree` with the list of its leaves where `mask` (a tree of bools like it) is true
    replaced by if_true(that list), and the others by if_false(theirs)."""
    leaves, treedef = jax.tree.flatten(tree)
    flags = jax.tree.leaves(mask)
    assert len(flags) == len(leaves), (len(flags), len(leaves))
    picked = {True: [x for x, f in zip(leaves, flags) if f], False: [x for x, f in zip(leaves, flags) if not f]}
    done = {True: iter(if_true(picked[True]) if picked[True] else []),
            False: iter(if_false(picked[False]) if picked[False] else [])}
    return jax.tree.unflatten(treedef, [next(done[bool(f)]) for f in flags])


def _traced_within(context, fn):
    """fn, traced inside `context()`: `scopes.numbered_calls` numbers its collective calls
    in their names (so that a timeline tells apart calls XLA interleaves; names only, the
    program is the same); an emulator's `active` makes them time themselves on its links."""
    @functools.wraps(fn)
    def traced(*args):
        with context():
            return fn(*args)
    return traced


def _one_worker(x):
    assert x.shape[0] == 1, f"a device should hold one worker's copy, got leading dim {x.shape[0]}"
    return x[0]


def for_plan(plan: Plan, donate: bool = True, clock=None) -> TrainStep:
    """The steps of a plan made for a dpjax model (`plan.model`: `loss(params, batch,
    par)`, `init`): its own loss, or on a layout with a stage axis the pipeline's schedule
    in place of value_and_grad(model.loss)."""
    model, layout = plan.model, plan.layout
    abstract = jax.eval_shape(lambda k: plan.policy.store(layout.store(model.init(k))), jax.random.key(0))
    if layout.pipeline is None:
        stats = model.loss_and_stats if getattr(getattr(model, "config", None), "experts", 0) else None
        return build(model.loss, plan, abstract_params=abstract, donate=donate, clock=clock, loss_and_stats=stats)
    staged = pipeline_staged.for_model(model, layout, plan.exchange.algorithm)
    return build(staged.loss, plan, abstract_params=abstract, donate=donate, value_and_grad=staged.value_and_grad,
                 clock=clock)


def for_model(model, layout: Layout, *, global_batch: int, update="sync", opt=None, passes: int = 1,
              exchange: Exchange = Exchange(), links: tuple = (), seed: int = 0, donate: bool = True,
              clock=None) -> TrainStep:
    """The steps of a dpjax model on a layout made by hand: `for_plan` of
    `dpjax.plan.for_layout(...)` (the same arguments)."""
    return for_plan(for_layout(model, layout, global_batch=global_batch, update=update, opt=opt, passes=passes,
                               exchange=exchange, links=links, seed=seed), donate=donate, clock=clock)


def make_update_step(loss_fn, rule: UpdateRule, mesh, params, *, param_specs=None, passes: int = 1,
                     exchange: Exchange = Exchange(), donate: bool = True) -> TrainStep:
    """The steps of `rule` for research code: `loss_fn(params, local_batch) -> scalar`.

    params: the parameters (or their shapes); param_specs: a PartitionSpec per parameter
    over the non-data axes (default P(): a replica on every `model` rank). The rule's
    axes (its `axis_name`) are the worker axes; any other data axes average gradients
    synchronously inside each worker (`dpjax.plan.for_rule`). The train batch is A x B
    (A = passes).
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
    plan = for_rule(rule, mesh, abstract, param_specs=param_specs, passes=passes, exchange=exchange)
    return build(lambda p, b, par: loss_fn(p, b), plan, abstract_params=abstract, donate=donate)


def init_params(model, layout: Layout, key, policy=None, keep=None):
    """The model's parameters, created by a jitted init directly in their sharding: no
    device ever holds a whole sharded weight, and the values do not depend on the mesh
    (jax's partitionable threefry). policy: a `dpjax.compute.policy.Policy` whose param_dtype the
    master weights take (default: as the model makes them, float32); keep: a
    `dpjax.recovery.programs.Programs.keep` (the compiled init kept across restarts)."""
    store = (lambda p: p) if policy is None else policy.store
    init = jax.jit(lambda k: store(layout.store(model.init(k))), out_shardings=layout.shardings())
    return (init if keep is None else keep("init_params", init))(key)


def kept(step: TrainStep, keep, tag: str = "") -> TrainStep:
    """`step` with each program kept by `keep` (`dpjax.recovery.programs.Programs.keep`): a
    restarted process loads their executables instead of tracing and compiling them.
    tag: what tells this step's programs from another step's of the same run (an
    autotune's settings)."""
    return dataclasses.replace(step, **{f: keep(f"{f}{tag}", getattr(step, f))
                                        for f in ("init", "train", "evaluate", "flush", "consensus")})


def replicated(mesh):
    return NamedSharding(mesh, P())


def put_batch(stream, cursor: int, global_batch: int, mesh, passes: int | None = None):
    """The global batch at `cursor` as one sharded array; each process reads only the rows
    its devices hold, each once (the devices along `model` that share a block get one
    read). passes=A: A consecutive batches stacked, A x B x T+1 (the train step's
    micro-batches)."""
    rows = data_axes(mesh) or None
    read = {}  # block index -> rows read: the callback runs once per device, not per block

    def once(key, fn):
        if key not in read:
            read[key] = fn()
        return read[key]

    if passes is None:
        return jax.make_array_from_callback(
            (global_batch, stream.seq_len + 1), NamedSharding(mesh, P(rows)),
            lambda idx: once(idx[0].indices(global_batch), lambda: stream.batch(cursor, global_batch, rows=idx[0])))

    def block(idx):
        return once((idx[0].indices(passes), idx[1].indices(global_batch)), lambda: np.stack(
            [stream.batch(cursor + k * global_batch, global_batch, rows=idx[1]) for k in range(passes)[idx[0]]]))

    return jax.make_array_from_callback((passes, global_batch, stream.seq_len + 1),
                                        NamedSharding(mesh, P(None, rows)), block)


def num_bytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
