"""The program builder: a plan (`dpjax.plan`) -> the step's jitted programs (init, train,
evaluate, flush, consensus, stats), each one shard_map over the plan's mesh.

Every training step dpjax runs is assembled here from one `Plan`, whatever the rule
(sync, delayed, sparse, async: `dpjax.updates`), the layout (replicated, tensor-parallel
over `model`, FSDP over the data axes, workers over some data axes, stages:
`dpjax.sharding.Layout`) and the exchange (allreduce algorithm, tensor fusion, wire
compression, gradient accumulation). A feature is added once and composes with the
rest. Nothing here checks settings: the plan did.

Inside one `shard_map` a device holds its rows of the batch and its shards of the
parameters; the step is, per device, the worker's gradient (`dpjax.step.gradient`: A
micro-batches accumulated, averaged over the worker's own devices), then
`params, state = rule.step(...)` (the rule's exchanges run over the worker axes).

With a `stage` axis (`layout.pipeline`) each pass's value_and_grad is the pipeline's
schedule (`dpjax.pipeline.staged`): the replica's rows cut into micro-batches that flow
through the stages, explicit ppermutes between them.

The worker axes are `layout.workers`; the rest of the data axes are synchronous data
parallelism inside each worker. Rules whose workers diverge (`rule.per_worker`) keep
every worker's parameters and state on a leading worker axis, split over the worker
axes, so each device holds its own worker's copy (sharded like the parameters it
mirrors) and a checkpoint holds them all (`_Held`). Every gradient and parameter byte
between devices goes through an explicit dpjax collective; the two scalar means (the
reported loss and the evaluation loss) are XLA's `lax.pmean` of one float.

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
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax import links as emulation
from dpjax import scopes
from dpjax.compression import Form
from dpjax.compute import dropout
from dpjax.data_parallel import broadcast_params
from dpjax.fusion import leaf_classes
from dpjax.mesh import EXPERT, NOT_DATA, as_axes, axis_arg, data_axes, dp_size, is_spec, local_shape, spec_axes
from dpjax.plan import Plan
from dpjax.sharding import Layout
from dpjax.step.gradient import by_leaf, local_grad, worker_grad
from dpjax.tasks import tokens
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
    on `VirtualTime`). loss_and_stats(params, batch_BdxT1, par) -> (loss, a dict of scalars):
    `loss_fn` with figures of the model's own forward (a mixture's dropped choices), averaged
    over the devices like the loss: the train step returns its own forward's (no second forward
    a step) and the `stats` program computes them on a batch (none without it).
    """
    layout, exchange = plan.layout, plan.exchange
    assert as_axes(plan.rule.axes) == tuple(layout.workers), (plan.rule.axes, layout.workers)  # one plan made both
    par = dataclasses.replace(layout.parallel(fsdp_wire=exchange.wire), policy=plan.policy)  # dpjax.compute.policy
    # the "loss" the rule passes through is then (loss, stats); FSDP through random-k takes
    # its own local gradient (`local_grad`): its steps leave the figures to the `stats` program
    step_stats = loss_and_stats is not None and exchange.form is not Form.FSDP
    if step_stats:
        assert value_and_grad is None, "dpjax.plan refuses experts beside a stage axis"
        value_and_grad = jax.value_and_grad(loss_and_stats, has_aux=True)
    held = _Held.of(plan, abstract_params)

    def grad_fn(frozen, draw=None):
        """The worker's gradient, of the trained parameters only (LoRA's adapters, `plan.split`: the
        frozen base is a constant of the loss, never differentiated, exchanged or updated; a pipeline's
        value_and_grad, `dpjax.pipeline.staged`, gives that part's gradient from the whole tree). draw:
        (rate, the step's dropout key, whether the batch is a dict) when the model drops (`_Held.draws`)."""
        if plan.split is None:
            return worker_grad(plan, *local_grad(loss_fn, plan, par, value_and_grad))
        join = plan.split.join
        trained_loss = lambda t, b, par: loss_fn(join(t, frozen), b, par)  # noqa: E731
        stats_loss = lambda t, b, par: loss_and_stats(join(t, frozen), b, par)  # noqa: E731
        if draw is not None:
            trained_loss, stats_loss = _dropping(trained_loss, *draw), _dropping(stats_loss, *draw)
        trained_vag = None
        if step_stats:  # the figures beside the loss (a task's: dpo's rewards), the adapters' gradient
            trained_vag = jax.value_and_grad(stats_loss, has_aux=True)
        elif value_and_grad is not None:
            trained_vag = lambda t, b, par: value_and_grad(join(t, frozen), b, par)  # noqa: E731
        return worker_grad(plan, *local_grad(trained_loss, plan, par, trained_vag))

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
    split: Any = None  # LoRA's `dpjax.models.lora.Split`: the rule sees the trained part only; None: all
    # the model drops (LoRA's dropout): the state is {"rule": the rule's, "draws": the steps taken,
    # uint32}, the counter the step's dropout key comes from, saved and resumed with the rest
    draws: float = 0.0

    def trained(self, tree):
        return tree if self.split is None else self.split.trained(tree)

    def frozen(self, tree):
        return None if self.split is None else self.split.frozen(tree)

    def join(self, trained, frozen):
        return trained if self.split is None else self.split.join(trained, frozen)

    @classmethod
    def of(cls, plan: Plan, abstract_params) -> "_Held":
        layout, rule, mesh = plan.layout, plan.rule, plan.layout.mesh
        pspecs, split = layout.specs, plan.split
        trained = (lambda t: t) if split is None else split.trained  # noqa: E731
        sspecs = rule.specs(trained(pspecs), jax.eval_shape(rule.init, trained(abstract_params)))
        lead: tuple[int, ...] = ()
        stack = lambda tree: tree  # noqa: E731
        if rule.per_worker:
            lead = (layout.num_workers,)
            stack = lambda tree: jax.tree.map(lambda s: P(layout.workers or None, *s), tree,  # noqa: E731
                                              is_leaf=is_spec)
        pspecs_w = stack(pspecs)

        def local(specs, lead):
            return jax.tree.map(lambda a, sp: local_shape(lead + tuple(a.shape), sp, mesh), abstract_params, specs,
                                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))

        draws = plan.model.dropout_rate if plan.model is not None else 0.0
        if draws:
            sspecs = {"rule": sspecs, "draws": P()}
        return cls(pspecs, sspecs, pspecs_w, stack(sspecs), local(pspecs, ()), local(pspecs_w, lead), rule.per_worker,
                   split, draws)

    def rule_state(self, state):
        return state["rule"] if self.draws else state

    def with_rule_state(self, state, rule_state, taken: int = 0):
        """`state` with the rule's part replaced, and `taken` more steps counted (when it draws)."""
        return {"rule": rule_state, "draws": state["draws"] + jnp.uint32(taken)} if self.draws else rule_state

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
        self.rows_axes, self.seed = axes, plan.settings.seed if plan.settings is not None else 0

    def row_indices(self, AxBd):
        """A x Bd uint32: each of this device's rows' index in the step's global batch, the
        micro-batches counted (a's rows after a-1's): the same row has the same index on every mesh."""
        A, Bd = AxBd
        block = lax.axis_index(self.rows_axes) if self.rows_axes else 0  # the batch's P(None, rows) block
        rows = Bd * dp_size(self.plan.layout.mesh)
        return (jnp.arange(A, dtype=jnp.uint32)[:, None] * jnp.uint32(rows)
                + (block * Bd + jnp.arange(Bd)).astype(jnp.uint32)[None, :])

    def init_body(self, params):
        held, layout = self.held, self.plan.layout
        got = jax.tree.map(lambda x: tuple(x.shape), params)
        assert got == held.local, f"init: local parameter shapes {got} != {held.local}"

        def broadcast(leaves, over):
            return broadcast_params(leaves, axis_arg(over), root=0) if over and leaves else leaves

        if self.replicated_over or self.expert_over:
            params = by_leaf(params, layout.expert_leaves(), lambda ls: broadcast(ls, self.expert_over),
                              lambda ls: broadcast(ls, self.replicated_over))
        if held.split is not None:  # LoRA's frozen base is only ever computed with: kept in the compute dtype
            params = held.join(held.trained(params), self.plan.policy.cast(held.frozen(params)))
        state = held.with_rule_state({"draws": jnp.zeros((), jnp.uint32)}, self.plan.rule.init(held.trained(params)))
        return held.wrap(params), held.wrap(state)

    def train_body(self, params, state, batch_AxBdxT1):
        held, passes, rows = self.held, self.plan.passes, _rows(self.local_rows, batch_AxBdxT1)
        held.check(params)
        tokens_AxBdxT1 = tokens(batch_AxBdxT1)  # a task's batch may carry more leaves (dpjax.tasks)
        assert tokens_AxBdxT1.ndim == 3 and tokens_AxBdxT1.shape[:2] == (passes, rows or tokens_AxBdxT1.shape[1]), (
            tokens_AxBdxT1.shape, passes, rows)
        params, state = held.unwrap(params), held.unwrap(state)
        frozen = held.frozen(params)  # LoRA's base: passed through as it came, bit for bit
        draw = None
        if held.draws:  # each row's global index joins the batch (scanned with its micro-batch)
            draw = (held.draws, dropout.step_key(self.seed, state["draws"]), isinstance(batch_AxBdxT1, dict))
            batch_AxBdxT1 = {**(batch_AxBdxT1 if draw[2] else {"tokens": batch_AxBdxT1}),
                             dropout.ROWS: self.row_indices(tokens_AxBdxT1.shape[:2])}
        with scopes.phase("optimizer"):  # the rule's own work; grad_fn's phases name themselves inside
            trained, rule_state, loss = self.plan.rule.step(self.grad_fn(frozen, draw), held.trained(params),
                                                            held.rule_state(state), batch_AxBdxT1)
        params, state = held.join(trained, frozen), held.with_rule_state(state, rule_state, 1)
        with scopes.phase("loss"):
            loss = lax.pmean(loss, self.loss_axes)  # with stats, (loss, stats): the step returns both
        return held.wrap(params), held.wrap(state), *(loss if self.step_stats else (loss,))

    def eval_body(self, params, batch_BdxT1):
        rows, tokens_BdxT1 = _rows(self.local_rows, batch_BdxT1), tokens(batch_BdxT1)
        assert tokens_BdxT1.ndim == 2 and tokens_BdxT1.shape[0] == (rows or tokens_BdxT1.shape[0]), (
            tokens_BdxT1.shape, rows)
        return lax.pmean(self.loss_fn(self.consensus_body(params), batch_BdxT1, self.par), self.loss_axes)

    def stats_body(self, params, batch_BdxT1):
        figures = self.loss_and_stats(self.consensus_body(params), batch_BdxT1, self.par)[1]
        return jax.tree.map(lambda v: lax.pmean(v, self.loss_axes), figures)

    def flush_body(self, params, state):
        held = self.held
        held.check(params)
        params = held.unwrap(params)
        state = held.unwrap(state)
        trained, rule_state = self.plan.rule.flush(held.trained(params), held.rule_state(state))
        return held.wrap(held.join(trained, held.frozen(params))), held.wrap(held.with_rule_state(state, rule_state))

    def consensus_body(self, params):
        held = self.held
        held.check(params)
        params = held.unwrap(params)
        return held.join(self.plan.rule.consensus(held.trained(params)), held.frozen(params))


def _dropping(loss_fn, rate: float, key, as_dict: bool):
    """loss_fn on a batch that carries its rows' global indices (`dropout.ROWS`): they leave
    the batch (which goes back to the task's own form) for `par`'s draw."""
    def loss(params, batch, par):
        rows = batch[dropout.ROWS]
        batch = {k: v for k, v in batch.items() if k != dropout.ROWS}
        draw = dropout.Draw(rate, key, rows)
        return loss_fn(params, batch if as_dict else batch["tokens"], dataclasses.replace(par, dropout=draw))
    return loss


def _smapper(plan: Plan, held: _Held, clock):
    """smap(fn, in_specs, out_specs): fn in a shard_map over the plan's mesh, traced with
    its collective calls numbered, timed on the emulated links (if any), and with the
    compression's fusion buckets never mixing parameters split differently."""
    mesh = plan.layout.mesh
    classes = jax.tree.map(lambda s: ",".join(a for a in spec_axes(s) if a in NOT_DATA and mesh.shape[a] > 1),
                           held.trained(held.pspecs), is_leaf=is_spec)  # the exchanged tree's
    emulator = emulation.Emulator(mesh, tuple(plan.links), clock) if plan.links else None

    def smap(fn, in_specs, out_specs):
        if emulator is not None:  # collectives traced inside time themselves on the links
            fn = _traced_within(emulator.active, fn)
        fn = _traced_within(scopes.numbered_calls, fn)
        fn = _traced_within(lambda: leaf_classes(classes), fn)  # compression buckets never mix shards
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    return smap


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


def _rows(local_rows, batch):
    """The rows a device's batch must have: B / dp, or any number for packed rows (--pack:
    `dpjax.data.sft.PackedStream` fixes them from the data, after the plan)."""
    return None if isinstance(batch, dict) and "segment_ids" in batch else local_rows
