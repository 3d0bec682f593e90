"""What a plan's compression saves, by the formulas the compiled program matches
(`cost.compressed_bytes`): the ratio for the run record, and the one-line warning when
the alpha-beta model says the method cannot pay on the plan's emulated links.

Functions of a `dpjax.plan.Plan` (read, not imported: the plan is above this package).
"""

from __future__ import annotations


def _exchange(plan):
    """(ranks of the compressed exchange, the model's parameter shapes, the allreduce's arguments)."""
    import math

    import jax

    from dpjax.mesh import data_axes

    ex = plan.exchange
    axes = tuple(plan.workers) if ex.between_workers_only else data_axes(plan.mesh)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(plan.model.init, jax.random.key(0)))]
    if ex.shards is not None:  # the per-shard form: each device exchanges its shards (compressed or not)
        from dpjax.compression.shards import shard_shape

        shapes = [shard_shape(s, ex.shards.size) for s in shapes]
    return axes, math.prod(plan.mesh.shape[a] for a in axes), shapes, {"algorithm": ex.algorithm,
                                                                        "fusion_mb": ex.fusion_mb, **ex.options}


def ratio(plan) -> float:
    """Bytes the busiest rank would send for one uncompressed exchange of the model's
    gradient over the compressed axes, over what it sends compressed (the formulas of
    `cost.compressed_bytes`, which the compiled program matches)."""
    from dpjax.collectives import cost

    _, n, shapes, opts = _exchange(plan)
    if n < 2:
        return 1.0
    return cost.compressed_bytes(None, shapes, n, **opts) / cost.compressed_bytes(plan.exchange.compression, shapes,
                                                                                 n, **opts)


def warning(plan) -> str | None:
    """One line when the cost model says the compression cannot pay on the plan's links:
    the workers' exchange over the slowest emulated link they cross, uncompressed against
    compressed (alpha-beta, `cost.compressed_bytes`, the same number of latencies for
    both: a lower bound for the methods that send more messages, so a method that loses
    even then cannot pay). Agarwal et al. (MLSys 2022) found compression beat a tuned
    synchronous baseline in only 6 of 200+ datacenter settings. None when it can pay,
    without links, or without compression."""
    from dpjax.collectives import cost

    ex = plan.exchange
    if ex.compression is None or not plan.links or plan.model is None:
        return None
    axes, n, shapes, opts = _exchange(plan)
    links = [link for link in plan.links if link.axis in axes and plan.mesh.shape[link.axis] > 1]
    if not links:
        return None
    plain, packed = (cost.compressed_bytes(c, shapes, n, **opts) for c in (None, ex.compression))
    steps = cost.schedule(ex.algorithm, n, 1, **ex.options).total_steps
    link = max(links, key=lambda x: x.latency + plain / x.bandwidth)
    exact_s, compressed_s = (steps * link.latency + b / link.bandwidth for b in (plain, packed))
    if compressed_s < 0.9 * exact_s:
        return None
    return (f"warning: --compression {ex.compression} cannot pay on --link {link}: the cost model gives "
            f"{exact_s * 1e3:.1f} ms an exchange uncompressed, at least {compressed_s * 1e3:.1f} ms compressed "
            f"({plain:,} -> {packed:,} bytes: "
            f"{'it barely shrinks them' if packed > 0.8 * plain else 'the link latency dominates'})")
