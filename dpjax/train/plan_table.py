"""`--dry-run`'s picture of a plan: what runs where, in what precision, and what a device
must hold, part by part (`dpjax.plan.memory.estimate`), before anything is compiled."""

from __future__ import annotations

from dpjax.compute import context
from dpjax.mesh import CONTEXT, MODEL, dp_size, EXPERT
from dpjax.plan import target_platform

FP8 = (" (the layers' projection matmuls in float8 with per-tensor current scaling: e4m3 operands forward, e5m2 "
       "gradients backward, float32 accumulation; bfloat16 elsewhere)")


def _gib(b) -> str:
    return "unknown" if b is None else f"{b / 2**30:,.2f} GiB"


def _usable(mem: dict) -> str:
    """What a device gives a run and why (`dpjax.plan.usable`): '60.00 GiB usable of 80.00
    GiB (0.75 of --device-memory: JAX's default ...)'."""
    if mem["device"] is None or "usable_from" not in mem:
        return _gib(mem["device"])
    total = mem.get("device_total")
    of = f" of {_gib(total)}" if total and mem.get("fraction") != 1.0 else ""
    return f"{_gib(mem['device'])} usable{of} ({mem['usable_from']})"


def plan_lines(plan) -> list[str]:
    """Lines describing `plan` (a `dpjax.plan.Plan`) for a person."""
    lay, pol, ex = plan.layout, plan.policy, plan.exchange
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
    devices = list(plan.mesh.devices.flat)
    layout = ["tensor-parallel" if plan.mesh.shape.get("model", 1) > 1 and plan.tensor_parallel else None,
              "FSDP" if lay.fsdp else None,
              f"pipeline ({lay.pipeline.schedule})" if lay.pipeline is not None else None,
              f"context-parallel ({pol.context_attention} attention)" if lay.context_axes else None,
              _experts(plan)]
    target = target_platform(plan.settings, plan.mesh) if plan.settings is not None else devices[0].platform
    lines = [f"mesh: {mesh} on {len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind})"
             + (f", planned for {target} devices" if target != devices[0].platform else ""),
             f"layout: {', '.join(x for x in layout if x) or 'data parallel (replicated)'}; workers: "
             f"{', '.join(lay.workers) or 'one synchronous group'}; update: {plan.update}",
             f"exchange: {ex.algorithm}, fusion {ex.fusion_mb:g} MiB, compression {ex.compression or 'none'}; "
             f"batch {plan.global_batch} x {plan.passes} pass(es)",
             f"compute: dtype {pol.dtype}{FP8 if pol.dtype == 'fp8' else ''}, parameters {pol.param_dtype}, "
             f"remat {pol.remat}, attention {pol.attention}, layers {'scanned' if pol.scan else 'a Python loop'}"]
    lines += list(plan.notes) + _context_lines(plan)
    mem = plan.memory
    if mem is not None:
        parts = [f"parameters {_gib(mem['params'])}", f"optimizer state {_gib(mem['state'])}",
                 f"gradients {_gib(mem['grads'])}"]
        if mem["error"]:
            parts.append(f"error buffers {_gib(mem['error'])}")
        if mem.get("reference"):  # --ref-logps online without LoRA: the reference's frozen copy
            parts.append(f"reference copy {_gib(mem['reference'])}")
        parts.append(f"activations {_gib(mem['activations'])}")
        lines.append(f"memory per device: about {_gib(mem['total'])} ({', '.join(parts)}); a device has "
                     + _usable(mem))
    return lines


def _context_lines(plan) -> list[str]:
    """With a context axis: how a sequence is split, and what its attention sends per
    layer and forward pass against the bound (`dpjax.compute.context.schedule`)."""
    C, model = plan.mesh.shape.get(CONTEXT, 1), plan.model
    if C == 1 or model is None or plan.global_batch is None:
        return []
    T, name = model.config.seq_len, plan.policy.context_attention
    # the K/V heads that travel: this rank's share of them (grouped-query attention: Y of them; one when replicated)
    Y, K = model.kv_heads, model.head_dim
    H = max(1, Y // plan.mesh.shape.get(MODEL, 1))
    rows, width = plan.global_batch // dp_size(plan.mesh), plan.policy.compute.itemsize
    sched = context.schedule(name, C, rows, T, H, K, width)
    bound = context.bound_bytes(C, 2 * rows * (T // C) * H * K * width)
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    return [f"context: each sequence of {T} split over {C} devices in {2 * C} chunks of {T // (2 * C)} (device i "
            f"holds i and {2 * C - 1}-i); {name} attention sends {mib(sched.bytes)} per device and layer in "
            f"{sched.steps} steps each way (forward, backward), the bound {mib(bound)}"]


def _experts(plan) -> str | None:
    """With an expert axis: how the experts are split and moved."""
    if not plan.layout.expert_split or plan.model is None:
        return None
    c = plan.model.config
    n = plan.mesh.shape[EXPERT]
    form = "dropless" if c.moe == "dropless" else f"capacity factor {c.capacity_factor:g}"
    return (f"expert-parallel ({c.experts} experts, {c.experts // n} a device, top {c.top_k}, {form}, "
            f"{plan.policy.expert_alltoall} all-to-all)")


def compiling_line(plan) -> str:
    """The line said before XLA compiles the run's programs, which takes minutes on a large
    model with nothing printed: what is compiled, and that Ctrl-C stops it."""
    d = plan.model.describe()
    size = ", ".join(f"{k} {d[k]}" for k in ("n_layers", "d_model") if k in d)
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
    return (f"compiling the initialisation and the training step ({d.get('model', 'model')}"
            + (f": {size}" if size else "") + f"; mesh {mesh}; update {plan.update}); Ctrl-C stops it")
