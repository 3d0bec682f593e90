"""What a run needs of a device's memory, estimated before anything is compiled (so
that `dpjax.plan` can refuse, in one line, what cannot fit), and what a device has."""

from __future__ import annotations

import math
import os

import jax

from dpjax.mesh import MODEL, dp_size


def estimate(model, layout, global_batch: int, compression=None) -> dict:
    """Bytes per device of a run of `model` laid out by `layout` with `global_batch`
    sequences per backward pass: {'params', 'state', 'error', 'activations', 'total'}.
    The parameters are exact (each device's shards); the state is taken as three times
    them (Adam's two moments and the gradient, sharded like the parameters: an upper
    bound for sgd and momentum); error: the error buffer of a `compression` with error
    feedback, exact: as the parameters (it mirrors the worker's gradient), or under FSDP
    through random-k (`dpjax.compression.sharded`) each device's full local gradient,
    n times its shards; the activations are the model's own estimate for its rows, split
    by the model axis."""
    stored = jax.eval_shape(lambda k: layout.store(model.init(k)), jax.random.key(0))
    local = jax.tree.map(lambda x, sh: math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize,
                         stored, layout.shardings())
    params = sum(jax.tree.leaves(local))
    state = 3 * params
    error = _error_bytes(layout, stored, params, compression)
    rows = max(1, global_batch // dp_size(layout.mesh))
    activations = model.activation_bytes(rows) // layout.mesh.shape.get(MODEL, 1)
    return {"params": params, "state": state, "error": error, "activations": activations,
            "total": params + state + error + activations}


def _error_bytes(layout, stored, params: int, compression) -> int:
    from dpjax.compression import parse, sharded

    spec = parse(compression)
    if spec is None or not spec.method.stateful or not spec.ef:
        return 0
    return sharded.error_bytes(layout, stored) if sharded.applies(layout, spec) else params


def device_memory(mesh) -> int | None:
    """What one device of `mesh` can hold: the accelerator's limit, or on CPU the host's
    physical memory shared by this process's devices (None if unknown)."""
    import jax

    dev = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())  # stats are local only
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    local = sum(1 for d in mesh.devices.flat if d.process_index == dev.process_index)
    return host // max(1, local)
