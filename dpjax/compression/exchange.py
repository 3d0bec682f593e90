"""THE gradient exchange between devices: one typed object, built by the plan, that every rule calls.

An `Exchange` owns how a tree crosses the data axes: dpjax's allreduce `algorithm`, the
tensor-fusion cap, the compression on the wire and its error-feedback state, and the
per-shard forms. Everything that averages gradients or parameters over devices asks it:
the step's mean inside a worker (`dpjax.step`), each update rule's exchange between the
workers (`dpjax.updates`, 1-bit Adam's too), FSDP's compressed reduce-scatter
(`sharded.wrap`) and `DistributedOptimizer` / `allreduce_gradients`
(`dpjax.data_parallel`). Its forms, chosen here and nowhere else:

    plain       the fused allreduce of the mean, floating-point buckets through a cast on the
                wire (`casts.py`: summed on the wire, decoded, then divided; Horovod's recipe)
    feedback    a method with error feedback (`feedback.py`): e = g + err, the method's own
                exchange of e, err <- what was dropped; the first `start` exchanges are the
                plain exact allreduce, bit for bit (a `lax.cond`: one of the two is sent)
    per shard   `shards` given (`shards.py`, --compress-axes with several devices a worker):
                each device's 1/k shard crosses (plain or feedback), the site all-gathers
    FSDP        `reduce_scatter_mean` (`sharded.py`): each device's full local gradient,
                reduce-scattered onto its shards through a linear method with error feedback

`Exchange.form` is the one answer to which of these applies (`Form`: plain, feedback or
FSDP; the per-shard form is `shards` beside it), computed here when the exchange is made
and set for a layout once by the plan (`placed`): the plan, the step builder, the rules,
the memory estimate and the checkpoints read it and ask nothing else of the compression.

The state (`feedback.State`: the exchange count, each rank's error buffer, the method's
own such as PowerSGD's Q) differs between ranks; the rules keep it in theirs (`init`,
`specs`), per worker, so checkpoints hold it. An exchange keeps state only over some
axes and with a method that has it (`keeps_state`); otherwise its state is ().
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from jax import lax

from dpjax import scopes
from dpjax.collectives import grouped
from dpjax.collectives.ranks import axis_size
from dpjax.compression import feedback, sharded, shards
from dpjax.compression.grammar import Spec, check, parse, summable
from dpjax.compression.shards import Shards
from dpjax.mesh import NOT_DATA, as_axes, axis_arg

# The defaults of a run's exchange (and the autotune's baseline for a knob set to `auto`)
DEFAULT_ALGORITHM, DEFAULT_FUSION_MB = "ring", 64.0
_OWN = ("algorithm", "fusion_mb", "compression")


class Form(enum.Enum):
    """Which form a gradient's exchange takes (the module docstring): `Exchange.form`."""

    PLAIN = "plain"  # no compression, or a cast summed on the wire: stateless
    FEEDBACK = "feedback"  # a method with error feedback between the workers (per shard where `shards` is given)
    FSDP = "fsdp"  # FSDP's reduce-scatter through a linear method with error feedback (no worker axes)


@dataclass(frozen=True)
class Exchange:
    """How gradients and parameters cross the data axes.

    algorithm: dpjax's allreduce (`dpjax.collectives`); fusion_mb: the bucket cap;
    compression: a `dpjax.compression` spec ("powersgd:4,start=10", a parsed `Spec`) or
    None; options: the allreduce's extra arguments (`num_servers` for ps,
    `outer_algorithm` for hierarchical, `groups`); compress_axes: the axes whose exchange
    alone is compressed (--compress-axes), None: every exchange for a cast, the workers'
    for a method with error feedback; shards: the per-shard form across the workers
    (`shards.Shards`), or None; fsdp: the gradient's exchange is FSDP's reduce-scatter over
    every data axis (FSDP without worker axes: `placed`). form: which form it takes
    (`Form`), made from these when the exchange is (a bad compression is a one-line
    ValueError then)."""

    algorithm: str = DEFAULT_ALGORITHM
    fusion_mb: float = DEFAULT_FUSION_MB
    compression: str | Spec | None = None
    options: dict[str, object] = field(default_factory=dict)
    compress_axes: tuple[str, ...] | None = None
    shards: Shards | None = None
    fsdp: bool = False
    form: Form = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        spec = parse(self.compression)
        stateless = spec is None or not spec.method.stateful  # a cast is summed on the wire as it is
        object.__setattr__(self, "form", Form.PLAIN if stateless else Form.FSDP if self.fsdp else Form.FEEDBACK)

    def placed(self, fsdp: bool, workers) -> "Exchange":
        """This exchange on a layout with (or without) FSDP and these worker axes: what sets
        its form for a plan (a method with error feedback rides FSDP's reduce-scatter
        when FSDP spans every data axis, no worker axes taking the compressed exchange)."""
        return dataclasses.replace(self, fsdp=bool(fsdp) and not as_axes(workers))

    def per_worker(self, fsdp: bool) -> bool:
        """Whether this exchange makes every data rank a worker when none are named: its
        form between workers keeps each worker's error buffer (under FSDP, with no workers,
        the reduce-scatter carries it instead)."""
        return self.placed(fsdp, ()).form is Form.FEEDBACK

    @classmethod
    def of(cls, exchange: "Exchange | None" = None, **allreduce) -> "Exchange":
        """`exchange`, or research code's keywords (`algorithm=`, `fusion_mb=`,
        `compression=` and the allreduce's options, as `allreduce_gradients` takes them)
        made into one: how the rules take either."""
        if exchange is not None:
            assert not allreduce, f"an Exchange and allreduce keywords {sorted(allreduce)}: give one"
            return exchange
        return cls(**{k: allreduce[k] for k in _OWN if k in allreduce},
                   options={k: v for k, v in allreduce.items() if k not in _OWN})

    # --- what it is ----------------------------------------------------------------------

    @property
    def spec(self) -> Spec | None:
        """The parsed compression (`grammar.parse`), None for none."""
        return parse(self.compression)

    def kwargs(self) -> dict:
        """algorithm, fusion_mb, compression and the options as plain values (the run record)."""
        return {"algorithm": self.algorithm, "fusion_mb": self.fusion_mb, "compression": self.compression,
                **self.options}

    def _allreduce(self) -> dict:
        """What a method's own exchange and the exact steps run the allreduce with."""
        return {"algorithm": self.algorithm, "fusion_mb": self.fusion_mb, **self.options}

    @property
    def between_workers_only(self) -> bool:
        """Whether only the exchange between workers is compressed (a method with error
        feedback, or --compress-axes): the mean inside a worker is then exact."""
        return self.compress_axes is not None or self.form is not Form.PLAIN

    @property
    def wire(self):
        """The cast FSDP's reduce-scatter sends gradients in (`tensor_parallel.Parallel`), None for none."""
        return None if self.between_workers_only else check(self.compression)

    def keeps_state(self, axes) -> bool:
        """Whether the mean over `axes` carries state (error feedback: some axes and a method with it)."""
        return bool(as_axes(axes)) and self.form is not Form.PLAIN

    @property
    def unfit(self) -> str | None:
        """Why this exchange cannot run in its form, None when it can: FSDP's reduce-scatter
        sums what crosses, so only a linear method (`Method.reduce_scatter`) rides it; the
        others say why they are not (`Method.nonlinear`)."""
        spec = self.spec
        if self.form is Form.FSDP and spec is not None and spec.method.reduce_scatter is None:
            return spec.method.nonlinear
        return None

    @property
    def error_buffers(self) -> bool:
        """Whether its state holds error buffers (a form with state, error feedback on)."""
        spec = self.spec  # None only in the plain form
        return self.form is not Form.PLAIN and spec is not None and spec.ef

    @property
    def summed(self):
        """The method a one-off reduction (an allreduce, a reduce-scatter) sums on the wire
        (a cast), None for none; a method with state is a one-line ValueError."""
        return summable(self.compression)

    def split(self, mesh, fsdp: bool = False) -> dict:
        """The mesh axis sizes the shapes of its state depend on, {} for none (what a
        checkpoint must match to resume): the model and stage sizes for a method with
        state of its own (PowerSGD's Q, one per shard); with --fsdp and error feedback,
        every axis (one full-size buffer a device); in the per-shard form, the axes of its
        slots (a device's own shard)."""
        spec = self.spec
        if spec is None:
            return {}
        if fsdp and self.error_buffers:
            return dict(mesh.shape)
        if self.shards is not None and self.form is not Form.PLAIN:
            return {a: mesh.shape[a] for a in self.shards.slot}
        if spec.method.init is None:
            return {}
        return {a: n for a, n in mesh.shape.items() if a in NOT_DATA and n > 1}

    # --- related exchanges ---------------------------------------------------------------

    def inside(self) -> "Exchange":
        """The exchange inside a worker (over the data axes that are not the workers'):
        this one, exact where only the exchange between workers is compressed."""
        return dataclasses.replace(self, compression=None if self.between_workers_only else self.compression,
                                   shards=None)

    def exact(self, per_shard: bool = False) -> "Exchange":
        """The same exchange without compression: for what must stay exact (the workers'
        consensus; 1-bit Adam's exact steps, `per_shard=True`: in the per-shard form
        where there is one, as its compressed steps are)."""
        return dataclasses.replace(self, compression=None, shards=self.shards if per_shard else None)

    # --- the state -----------------------------------------------------------------------

    def init(self, params, axes):
        """The state of a fresh mean over `axes` of trees shaped like `params` (zero error), () if none."""
        if not self.keeps_state(axes):
            return ()
        if self.shards is not None:  # per device, on its slot
            return shards.init(self.compression, params, self.shards)
        return feedback.init(self.compression, params)

    def specs(self, param_specs, axes):
        """PartitionSpecs of the state for parameters laid out by `param_specs` (no worker axis)."""
        if not self.keeps_state(axes):
            return ()
        if self.shards is not None:
            return shards.specs(self.compression, param_specs, self.shards)
        return feedback.specs(self.compression, param_specs)

    # --- the means -----------------------------------------------------------------------

    def mean(self, tree, axes, state=()):
        """(the mean of `tree` over `axes` through this exchange, the new state), inside
        `shard_map`. axes: a data axis or a tuple of them; over none, `tree` as it is."""
        axes = as_axes(axes)
        if not axes:
            return tree, state
        axis = axis_arg(axes)
        if self.shards is None:
            return self._whole(tree, axis, state)
        sh = self.shards
        pieces = shards.split_tree(tree, sh)
        out, state = self._whole(pieces, axis, shards.unslot(state, pieces))
        return shards.join(out, tree, sh), shards.slot(state)

    def _whole(self, tree, axis, state):
        if not self.keeps_state(axis):
            return self.allreduce(tree, axis), state
        spec, allreduce = self.spec, self._allreduce()
        assert spec is not None  # keeps_state: a method with error feedback

        def compressed():
            return feedback.compressed(tree, state, axis, spec, allreduce)

        def exact():
            return grouped.mean(tree, axis, **allreduce), state.error, state.method

        with scopes.phase("exchange"):
            out, error, own = _from_start(spec, state.t, exact, compressed)
        return out, feedback.State(state.t + 1, error, own)

    def allreduce(self, tree, axis, *, op: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
        """The plain form: `tree` reduced with `op` over `axis`, one allreduce per fusion
        bucket, floating-point buckets through the cast (a linear, stateless method). `op`
        defaults to the exchange's own (`options["op"]`, e.g. "adasum"), else the mean."""
        axis_size(axis, "the gradient exchange")
        options = dict(self.options)
        op = op or str(options.pop("op", "mean"))  # the options are the --compression grammar's values
        options.pop("op", None)
        with scopes.phase("exchange"):  # every exchange passes here (dpjax.scopes, dpjax.timeline)
            return grouped.allreduce(tree, axis, op=op, fusion_mb=self.fusion_mb,
                                     compression=self.summed, algorithm=self.algorithm,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                     **options)

    def reduce_scatter_mean(self, g, dims, axes, state):
        """FSDP's form: (the mean of the devices' full local gradients `g`, on this
        device's shards (dims: the dimension the data axes split, -1: replicated), through
        the compression; the new state). The first `start` exchanges are FSDP's exact
        reduce-scatter."""
        spec, axis = self.spec, axis_arg(as_axes(axes))
        assert spec is not None, "FSDP's compressed form is for an exchange with a compression"

        def compressed():
            return sharded.compressed(g, state, dims, axis, spec, self.algorithm, self.fusion_mb)

        def exact():
            return sharded.exact(g, dims, axis, self.algorithm), state.error

        with scopes.phase("exchange"):
            out, error = _from_start(spec, state.t, exact, compressed)
        return out, feedback.State(state.t + 1, error, ())


def _from_start(spec: Spec, t, exact, compressed):
    """compressed(), or for the first `spec.start` exchanges exact() (a `lax.cond` named
    `compression(start=S)`, so comm_bytes charges each step the branch it runs)."""
    if spec.start > 0:
        with scopes.scope("compression", start=spec.start):
            return lax.cond(t < spec.start, exact, compressed)
    return compressed()
