"""What a run needs of a device's memory, estimated before anything is compiled (so
that `dpjax.plan` can refuse, in one line, what cannot fit), and what a device has."""

from __future__ import annotations

import math
import os
import re
from typing import NotRequired, TypedDict

import jax

from dpjax.compression import Exchange, Form, sharded
from dpjax.compute.policy import Policy, accelerated
from dpjax.mesh import CONTEXT, MODEL, dp_size
from dpjax.models.lora import Lora, Split


class Estimate(TypedDict):
    """A device's bytes by part (`estimate`), and what a device has once the plan knows it
    (`dpjax.plan.compute.check_memory`: `Plan.memory`)."""

    params: int
    state: int
    grads: int
    error: int
    activations: int
    reference: int  # the reference model's frozen copy (DPO's --ref-logps online without LoRA), else 0
    total: int
    device: NotRequired[int | None]  # what a device gives the run (None: unknown)
    device_total: NotRequired[int | None]
    fraction: NotRequired[float | None]
    usable_from: NotRequired[str]  # where `device` comes from, in words


def estimate(model, layout, global_batch: int, exchange: Exchange | None = None, policy=None,
             platform: str | None = None, reference: bool = False) -> Estimate:
    """Bytes per device of a run of `model` laid out by `layout` with `global_batch`
    sequences per backward pass: {'params', 'state', 'grads', 'error', 'activations', 'total'}.
    The parameters are exact (each device's shards); the optimizer state is taken as two
    times them (Adam's moments, sharded like the parameters: an upper bound for sgd and
    momentum) and so are the gradients (the gradient and the update made from it: what
    XLA's buffer assignment holds beside them in the step); error: the error buffers of an
    `exchange` (`dpjax.compression.Exchange`, its form set for `layout`) with error
    feedback, exact: as the parameters (it mirrors the worker's gradient), or under FSDP
    through random-k (`dpjax.compression.sharded`) each device's full local gradient,
    n times its shards; the activations are the model's own estimate for its rows under
    the compute `policy` (`dpjax.compute.policy.Policy`: dtype, remat, attention; default the
    float32 reference), split by the model axis and the context axis. `platform`: where it runs (default
    JAX's backend): XLA:CPU computes bfloat16 in float32, so on CPU a value is 4 bytes.
    A LoRA model (`dpjax.models.lora`): state and gradients of the adapters only, the
    frozen base counted once, in the compute dtype it is kept in. reference: a preference
    run's frozen copy of the parameters (--ref-logps online without LoRA,
    `dpjax.train.preference.Online`), split like them: 'reference', as many bytes again."""
    policy = policy or Policy()
    platform = platform or jax.default_backend()
    stored = jax.eval_shape(lambda k: policy.store(layout.store(model.init(k))), jax.random.key(0))
    local = jax.tree.map(lambda x, sh: math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize,
                         stored, layout.shardings())
    params = sum(jax.tree.leaves(local))
    trained = params
    if isinstance(model, Lora):  # the frozen base in the compute dtype (dpjax.step.builder's init), the adapters not
        trained = sum(jax.tree.leaves(Split(model.LAYERS).trained(local)))
        frozen = Split(model.LAYERS).frozen(jax.tree.map(lambda x, n: n // x.dtype.itemsize, stored, local))
        params = trained + sum(jax.tree.leaves(frozen)) * policy.compute.itemsize
    state = 2 * trained  # Adam's two moments (an upper bound for sgd and momentum); LoRA: of the adapters only
    grads = 2 * trained  # the gradient and the update formed from it, live together in the step
    error = _error_bytes(layout, stored, params, exchange)
    rows = max(1, global_batch // dp_size(layout.mesh))
    split = layout.mesh.shape.get(MODEL, 1)
    width = policy.compute.itemsize if accelerated(platform) else 4
    context = layout.mesh.shape.get(CONTEXT, 1)  # a device holds 1/context of each sequence's tokens
    activations = model.activation_bytes(rows, remat=policy.remat, attention=policy.attention, width=width,
                                         split=split, **({"context": context} if context > 1 else {}))
    copy = params if reference else 0
    return {"params": params, "state": state, "grads": grads, "error": error, "activations": activations,
            "reference": copy, "total": params + state + grads + error + activations + copy}


def _error_bytes(layout, stored, params: int, exchange: Exchange | None) -> int:
    if exchange is None or not exchange.error_buffers:
        return 0
    return sharded.error_bytes(layout, stored) if exchange.form is Form.FSDP else params


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as '80GiB', '141GB', '24000MB' or '1.5TiB' (SI units are powers
    of 10, binary ones of 2). Raises ValueError (one line)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 80GiB, 141GB or 24000MB, got {text!r}")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"expected a positive size, got {text!r}")
    return int(size)


def preallocation_note(platform: str) -> str:
    """On a GPU JAX preallocates 75% of the memory and reports that as the limit: say so,
    and how to give it more (empty where it does not apply)."""
    if platform not in ("gpu", "cuda", "rocm"):
        return ""
    if os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return ""
    return (" (JAX takes 75% of a GPU's memory by default: XLA_PYTHON_CLIENT_MEM_FRACTION=.95 gives it more)")


def _host_memory() -> int | None:
    """The host's physical memory (not what is free now: a plan must not depend on what
    else happens to run at the moment it is made)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# What a CPU process holds beyond its programs' buffers (JAX's runtime, compiled code, the
# data, Python): a 43M-parameter run on 8 simulated devices peaked at 8.1 GB resident, its
# step's buffers 8 x 0.8 GiB (XLA's memory_analysis), 1.25 GB apart.
CPU_RUNTIME_BYTES = 1 << 30


def device_memory(mesh) -> int | None:
    """What one device of `mesh` can hold: the accelerator's limit, or on CPU the host's
    physical memory less the runtime's own, shared by this process's devices (None if
    unknown)."""
    dev = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())  # stats are local only
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = _host_memory()
    if host is None:
        return None
    local = sum(1 for d in mesh.devices.flat if d.process_index == dev.process_index)
    return max(0, host - CPU_RUNTIME_BYTES) // max(1, local)
