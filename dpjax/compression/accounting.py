"""What a plan's compression saves, by the formulas the compiled program matches
(`compressed_bytes`): the ratio for the run record, and the one-line warning when
the alpha-beta model says the method cannot pay on the plan's emulated links.

Functions of a `dpjax.plan.Plan` (read, not imported: the plan is above this package).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.collectives import cost
from dpjax.collectives.cost import schedule
from dpjax.compression import sharded
from dpjax.compression.exchange import Form
from dpjax.compression.grammar import parse
from dpjax.compression.shards import shard_shape
from dpjax.fusion import plan_buckets
from dpjax.mesh import data_axes


def compressed_bytes(compression, shapes, n: int, *, algorithm: str = "ring", fusion_mb: float = 64,
                     **options) -> int:
    """What the busiest of n ranks sends to average float32 tensors of `shapes` through
    `compression` (a `dpjax.compression` spec, None for none): fused buckets as
    `allreduce_gradients` packs them, each the algorithm's schedule in the wire dtype for
    no compression or a cast, each method's own formula (`Method.wire_bytes`) for the
    methods with error feedback. The compiled program sends exactly this
    (tests/test_compression_feedback.py)."""
    spec = parse(compression)
    if spec is not None and spec.method.stateful:
        return spec.method.wire_bytes(list(shapes), n, spec, {"algorithm": algorithm, "fusion_mb": fusion_mb,
                                                              **options})
    itemsize = 4 if spec is None else np.dtype(spec.method.wire_dtype).itemsize
    plan = plan_buckets([jax.ShapeDtypeStruct(tuple(s), jnp.float32) for s in shapes], fusion_mb * 2**20)
    return sum(schedule(algorithm, n, sum(b.sizes), itemsize, **options).total_bytes for b in plan.buckets)


def _exchange(plan):
    """(ranks of the compressed exchange, the model's parameter shapes, the allreduce's arguments)."""
    ex = plan.exchange
    axes = tuple(plan.workers) if ex.between_workers_only else data_axes(plan.mesh)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(plan.model.init, jax.random.key(0)))]
    if ex.shards is not None:  # the per-shard form: each device exchanges its shards (compressed or not)
        shapes = [shard_shape(s, ex.shards.size) for s in shapes]
    return axes, math.prod(plan.mesh.shape[a] for a in axes), shapes, {"algorithm": ex.algorithm,
                                                                        "fusion_mb": ex.fusion_mb, **ex.options}


def exchange_bytes(plan, compression="plan") -> tuple[tuple, int]:
    """(the axes of the compressed exchange, what the busiest rank sends in one exchange of
    the model's gradient over them through `compression`, by default the plan's; None:
    uncompressed): `compressed_bytes`, or under FSDP through random-k the
    reduce-scatters' (`sharded.wire_bytes`). The compiled program matches both."""
    compression = plan.exchange.compression if compression == "plan" else compression
    axes, n, shapes, opts = _exchange(plan)
    if plan.exchange.form is Form.FSDP:
        abstract = jax.eval_shape(lambda k: plan.layout.store(plan.model.init(k)), jax.random.key(0))
        local, dims = sharded.local_shapes(plan.layout, abstract)
        return plan.layout.inner_axes, sharded.wire_bytes(local, dims, sharded.dp(plan.layout), compression,
                                                          algorithm=opts["algorithm"], fusion_mb=opts["fusion_mb"])
    if n < 2:
        return axes, 0
    return axes, compressed_bytes(compression, shapes, n, **opts)


def ratio(plan) -> float:
    """Bytes the busiest rank would send for one uncompressed exchange of the model's
    gradient over the compressed axes, over what it sends compressed (the formulas of
    `exchange_bytes`, which the compiled program matches); 1.0 when nothing is sent."""
    packed = exchange_bytes(plan)[1]
    return exchange_bytes(plan, None)[1] / packed if packed else 1.0


def warning(plan) -> str | None:
    """One line when the cost model says the compression cannot pay on the plan's links:
    the workers' exchange over the slowest emulated link they cross, uncompressed against
    compressed (alpha-beta, `compressed_bytes`, the same number of latencies for
    both: a lower bound for the methods that send more messages, so a method that loses
    even then cannot pay). Agarwal et al. (MLSys 2022) found compression beat a tuned
    synchronous baseline in only 6 of 200+ datacenter settings. None when it can pay,
    without links, or without compression."""
    ex = plan.exchange
    if ex.compression is None or not plan.links or plan.model is None:
        return None
    axes, packed = exchange_bytes(plan)
    links = [link for link in plan.links if link.axis in axes and plan.mesh.shape[link.axis] > 1]
    if not links:
        return None
    plain = exchange_bytes(plan, None)[1]
    n = sharded.dp(plan.layout) if ex.form is Form.FSDP else _exchange(plan)[1]
    steps = cost.schedule(ex.algorithm, n, 1, **ex.options).total_steps
    link = max(links, key=lambda x: x.latency + plain / x.bandwidth)
    exact_s, compressed_s = (steps * link.latency + b / link.bandwidth for b in (plain, packed))
    if compressed_s < 0.9 * exact_s:
        return None
    return (f"warning: --compression {ex.compression} cannot pay on --link {link}: the cost model gives "
            f"{exact_s * 1e3:.1f} ms an exchange uncompressed, at least {compressed_s * 1e3:.1f} ms compressed "
            f"({plain:,} -> {packed:,} bytes: "
            f"{'it barely shrinks them' if packed > 0.8 * plain else 'the link latency dominates'})")


def optimizer_warning(plan) -> str | None:
    """One line when the compression is known to misbehave with the inner optimizer: a
    biased compressor with error feedback (`Method.under_adam`) under AdamW, naming the
    alternatives. None otherwise (1-bit Adam compresses after the variance is frozen)."""
    spec = parse(plan.exchange.compression)
    opt = plan.opt
    if spec is None or not spec.ef or not spec.method.under_adam or getattr(opt, "name", None) != "adamw":
        return None
    return (f"warning: --compression {spec} with error feedback under --optimizer adamw: {spec.method.under_adam}; "
            f"use --optimizer onebit_adam without --compression (1-bit Adam's default: Adam's variance frozen after "
            f"exact steps, a fifth of the run and at most 100, refreshed after, the momentum compressed), a quantiser "
            f"(int8, int4), or {spec.name}"
            f"{'' if spec.number is None else f':{spec.number}'},ef=0")


# ---------------------------------------------------------------------------------------
# Per step: with start=S the program holds both the exact and the compressed exchange (a
# `lax.cond`); a step runs one of them.


def period(plan) -> int:
    """The steps between the rule's exchanges between workers (`Kind.period`): one a step
    but for sparse:P."""
    return plan.period  # the plan reads it from the rule (this package sits below dpjax.updates)


def compressed_at(plan, step: int) -> bool:
    """Whether step `step` (0-based) of the plan's run exchanges compressed: always without
    start=S, else from its S-th exchange on (one every `period(plan)` steps), but for
    the exact refreshes of refresh=R (1-bit Adam's variance updates)."""
    spec = parse(plan.exchange.compression)
    if spec is None or spec.start == 0:
        return spec is not None
    return not spec.exact_at(step // period(plan))


def ratio_at(plan, step: int, whole: float | None = None) -> float:
    """The compression ratio of step `step`: 1.0 before the start step, else `ratio(plan)`
    (`whole`, if already known)."""
    if not compressed_at(plan, step):
        return 1.0
    return ratio(plan) if whole is None else whole
