"""What `dpjax.shard_step` checks before a step first runs, beside the replica check
(`dpjax.wrap.replicas`, which compares what comes back): the mistakes whose result looks
right.

- flax's own `nnx.Linear` / `nnx.Conv` with a kernel split over a mesh axis. Split by
  rows (a contracting dimension: Megatron's row-parallel layer) each rank's output is a
  partial sum, and the layer adds its whole bias to it: after the sum over the axis the
  bias counts once per rank. The copies agree, so the replica check cannot see it; the
  run trains, a little wrong. Split by columns, a whole bias does not broadcast against
  the split output (JAX's shape error, without the reason). Both are refused here, one
  line naming the layer and the fix.
- Nothing split over a data axis larger than 1 (no `batch_argnums`, no `in_specs` naming
  it): every device computes the whole batch. The losses are right, there is no
  parallelism; one warning line.
- A CPU run with a single device: `shard_step` works and splits nothing; one warning
  line saying how to simulate more.

Warnings go through `warnings.warn` (category `SingleDeviceWarning`), so a user's warning
filters apply; a step warns on its first call only, and the one-device line is issued
from one place, so Python prints it once a process.
"""

from __future__ import annotations

import math
import warnings

from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import spec_axes


class SingleDeviceWarning(UserWarning):
    """A step that runs, but not in parallel: every device (or the only one) sees the whole batch."""


def _split(spec, dims, mesh) -> list:
    """The mesh axes larger than 1 that split any of `dims` of a parameter annotated `spec`."""
    spec = tuple(spec)
    # an axis the mesh does not have counts as 1 here: shard_step names it in its own error
    return [a for d in dims if d < len(spec) for a in spec_axes(P(spec[d])) if mesh.shape.get(a, 1) > 1]


def check_flax_biases(step: str, graph, mesh, name, pspec) -> None:
    """Raises UserError for an nnx.Linear / nnx.Conv whose bias is wrong for its kernel's split.

    graph: (path, node) pairs of the step's NNX arguments (`nnx.iter_graph`); name(path):
    the layer's name in messages; pspec(variable): the PartitionSpec its annotation gives."""
    from flax import nnx  # here: `import dpjax` does not import flax (an NNX graph's caller has)

    for path, node in graph:
        if not isinstance(node, (nnx.Linear, nnx.Conv)) or getattr(node, "bias", None) is None:
            continue
        kernel, bias = pspec(node.kernel), pspec(node.bias)
        ndim = len(node.kernel.shape)
        rows = _split(kernel, range(ndim - 1), mesh)
        kind, what = type(node).__name__, name(path)
        if rows:
            raise UserError(f"{step}: {what} is an nnx.{kind} whose kernel is split by rows over {rows[0]!r} "
                            f"(row-parallel): each {rows[0]!r} rank's output is a partial sum, and adding its bias "
                            f"there counts the bias once per rank; use dpjax.nn.nnx.RowParallelLinear("
                            f"{_features(node)}, rngs=rngs) (it adds the bias once, after the sum), or create it "
                            "with use_bias=False and add a bias after dpjax.compute.tensor_parallel.reduce_from_model")
        cols = [a for a in _split(kernel, [ndim - 1], mesh) if a not in spec_axes(bias)]
        if cols:
            raise UserError(f"{step}: {what} is an nnx.{kind} whose kernel is split by columns over {cols[0]!r} "
                            f"but whose bias is whole, so it cannot be added to the split output; create it with "
                            f"bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ({cols[0]!r},)), or "
                            f"use dpjax.nn.nnx.ColumnParallelLinear({_features(node)}, rngs=rngs)")


def _features(node) -> str:
    return f"{node.in_features}, {node.out_features}"


def splits_nothing(fn):
    """Marks `fn` as a step that splits nothing on purpose (dpjax's broadcasts of the
    parameters): shard_step(fn) then does not warn that it splits nothing."""
    fn.dpjax_splits_nothing = True
    return fn


def warn_unsplit(step: str, mesh, data_axes, specs) -> None:
    """A warning when the data axes (> 1 device) split no argument of the step."""
    n = math.prod(mesh.shape[a] for a in data_axes)
    if n > 1 and not any(a in data_axes for s in specs for a in spec_axes(s)):
        warnings.warn(f"dpjax: {step} splits nothing over the data axes ({n} devices), so every device computes the "
                      "whole batch; pass batch_argnums=<position of the batch argument> to shard_step",
                      SingleDeviceWarning, stacklevel=3)


ONE_CPU = ("dpjax: one CPU device, so shard_step runs unsplit; call dpjax.simulate_cpu_devices(8) before JAX "
           "starts (or set XLA_FLAGS=--xla_force_host_platform_device_count=8) to simulate 8 devices")


def warn_single_cpu(mesh) -> None:
    """A warning when the whole mesh is one CPU device (the default on a laptop)."""
    devices = mesh.devices.flat
    if mesh.size == 1 and all(d.platform == "cpu" for d in devices):
        # issued from this line, not the caller's: Python prints it once a process
        warnings.warn(ONE_CPU, SingleDeviceWarning)
