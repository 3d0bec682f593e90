"""`--dry-run`'s picture of a plan: what runs where, in what precision, and what a device
must hold, part by part (`dpjax.memory.estimate`), before anything is compiled."""

from __future__ import annotations


def _gib(b) -> str:
    return "unknown" if b is None else f"{b / 2**30:,.2f} GiB"


def plan_lines(plan) -> list[str]:
    """Lines describing `plan` (a `dpjax.plan.Plan`) for a person."""
    lay, pol, ex = plan.layout, plan.policy, plan.exchange
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
    devices = list(plan.mesh.devices.flat)
    layout = ["tensor-parallel" if plan.mesh.shape.get("model", 1) > 1 and plan.tensor_parallel else None,
              "FSDP" if lay.fsdp else None,
              f"pipeline ({lay.pipeline.schedule})" if lay.pipeline is not None else None]
    from dpjax.plan import target_platform

    target = target_platform(plan.settings, plan.mesh) if plan.settings is not None else devices[0].platform
    lines = [f"mesh: {mesh} on {len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind})"
             + (f", planned for {target} devices" if target != devices[0].platform else ""),
             f"layout: {', '.join(x for x in layout if x) or 'data parallel (replicated)'}; workers: "
             f"{', '.join(lay.workers) or 'one synchronous group'}; update: {plan.update}",
             f"exchange: {ex.algorithm}, fusion {ex.fusion_mb:g} MiB, compression {ex.compression or 'none'}; "
             f"batch {plan.global_batch} x {plan.passes} pass(es)",
             f"compute: dtype {pol.dtype}, parameters {pol.param_dtype}, remat {pol.remat}, attention "
             f"{pol.attention}, layers {'scanned' if pol.scan else 'a Python loop'}"]
    lines += list(plan.notes)
    mem = plan.memory
    if mem is not None:
        parts = [f"parameters {_gib(mem['params'])}", f"optimizer state {_gib(mem['state'])}",
                 f"gradients {_gib(mem['grads'])}"]
        if mem["error"]:
            parts.append(f"error buffers {_gib(mem['error'])}")
        parts.append(f"activations {_gib(mem['activations'])}")
        lines.append(f"memory per device: about {_gib(mem['total'])} ({', '.join(parts)}); a device has "
                     f"{_gib(mem['device'])}")
    return lines


def compiling_line(plan) -> str:
    """The line said before XLA compiles the run's programs, which takes minutes on a large
    model with nothing printed: what is compiled, and that Ctrl-C stops it."""
    d = plan.model.describe()
    size = ", ".join(f"{k} {d[k]}" for k in ("n_layers", "d_model") if k in d)
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
    return (f"compiling the initialisation and the training step ({d.get('model', 'model')}"
            + (f": {size}" if size else "") + f"; mesh {mesh}; update {plan.update}); Ctrl-C stops it")
