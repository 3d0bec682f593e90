"""The compute policy and the memory a plan needs: part of `dpjax.plan` (the platform a
plan is made for, the default exchange there, the policy's `auto`s resolved, and the
refusal of what cannot fit, with --remat auto's choice), before anything is compiled."""

from __future__ import annotations

import dataclasses

from dpjax.compression.exchange import DEFAULT_ALGORITHM, DEFAULT_FUSION_MB  # noqa: F401  (the autotune's baseline)
from dpjax.compute import policy as P
from dpjax.compute.policy import Policy, accelerated, remat_candidates
from dpjax.plan.checks import UsageError
from dpjax.plan.memory import Estimate, estimate, parse_size, preallocation_note
from dpjax.plan.usable import usable_memory
from dpjax.settings import Settings
from dpjax.tasks.dpo import VARIANTS


def target_platform(s: Settings, mesh) -> str:
    """The platform a plan is made for: the devices'; a GPU for --dry-run --device-memory
    on a machine without one (plan a GPU job from a laptop)."""
    platform = mesh.devices.flat[0].platform
    return "gpu" if s.dry_run and s.device_memory and not accelerated(platform) else platform


def default_allreduce(platform: str) -> str:
    """The gradient exchange when --allreduce is not given: XLA's own (psum: NCCL on GPUs,
    the ICI on TPUs) on accelerators, where it is the fastest; dpjax's explicit ring on
    CPU, where the collectives are what a run is there to show."""
    return "psum" if accelerated(platform) else DEFAULT_ALGORITHM


def compute_policy(s: Settings, model, platform: str) -> tuple[Policy, list]:
    """(the compute policy of `s` on `platform`, notes to print once). remat auto stays
    `none` here; `check_memory` chooses it."""
    head_dim = None if model is None else model.head_dim
    attention = s.attention
    if attention == "auto" and not P.accelerated(platform):
        attention = "naive"  # CPU: the reference kernel, as every CPU figure was measured with
    try:
        return P.resolve(s.dtype, s.param_dtype, s.remat, attention, platform=platform, head_dim=head_dim,
                         scan=not s.layer_loop, context_attention=s.context_attention,
                         expert_alltoall=s.expert_alltoall, packed=s.pack != "none",
                         softcap=0.0 if model is None else model.attention_softcap)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _reference_copy(s, split) -> bool:
    """Whether a preference run holds a frozen copy of the parameters (--ref-logps online
    without LoRA; with LoRA the reference is the base itself: `dpjax.tasks.dpo.reference_of`)."""
    return s.task == "dpo" and s.ref_logps == "online" and split is None and VARIANTS[s.dpo_loss].reference


def check_memory(plan):
    """Estimates the bytes each device needs (its shards of the parameters and of the
    optimizer / rule state, the activations one micro-batch keeps for the backward
    pass under the compute policy) and refuses, in one line, a run that cannot fit in
    what a device has (--device-memory, else the device's own). With --remat auto it
    chooses the first that fits of `remat_candidates` (none, dots, full; on a GPU dots,
    full: `dpjax.compute.policy` says why). Returns the
    plan with its policy's remat and its estimate (`plan.memory`)."""
    model, s = plan.model, plan.settings
    if model is None or s is None:
        return plan

    platform = target_platform(s, plan.mesh)
    given = None
    if s.device_memory:
        try:
            given = parse_size(s.device_memory)
        except ValueError as e:
            raise UsageError(f"--device-memory: {e}") from None
    device = usable_memory(platform, plan.mesh, given)  # what JAX really gets: on a GPU its fraction
    have = device["usable"]
    candidates = remat_candidates(platform) if s.remat == "auto" else (plan.policy.remat,)
    for remat in candidates:
        policy = dataclasses.replace(plan.policy, remat=remat)
        need = estimate(plan.model, plan.layout, plan.global_batch, plan.exchange, policy, platform,
                        reference=_reference_copy(s, plan.split))
        if have is None or need["total"] <= have:
            break
    memory: Estimate = {**need, "device": have, "device_total": device["total"], "fraction": device["fraction"],
                        "usable_from": device["source"]}
    plan = dataclasses.replace(plan, policy=policy, memory=memory)
    refusal = memory_refusal(plan)
    if refusal and not s.dry_run:  # --dry-run prints the plan first, then refuses (dpjax.train.trainer.dry_run)
        raise UsageError(refusal)
    return plan


def memory_refusal(plan) -> str | None:
    """The one line of a run that does not fit (what it needs by part, what a device has,
    what to change), or None when it fits or nothing is known of the device. On a GPU
    without --device-memory it says what JAX's preallocation leaves."""
    if plan.memory is None or plan.memory["device"] is None or plan.memory["total"] <= plan.memory["device"]:
        return None
    s = plan.settings
    platform = None if s.device_memory else target_platform(s, plan.mesh)
    need, have = plan.memory, plan.memory["device"]
    gib = lambda b: f"{b / 2**30:,.1f} GiB"  # noqa: E731
    remat = plan.policy.remat
    return (f"this run needs about {gib(need['total'])} per device (parameters {gib(need['params'])}, "
            f"optimizer state {gib(need['state'])}, gradients {gib(need['grads'])}, "
            + (f"compression error buffers {gib(need['error'])}, " if need["error"] else "")
            + f"activations {gib(need['activations'])} with --remat {remat}) and a device has {gib(have)}"
            + (f" ({need['usable_from']})" if need.get("usable_from") else "")
            + (preallocation_note(platform) if platform else "")
            + ": lower --batch-size, --seq-len or the model size, add --backward-passes"
            + (", --remat full" if remat != "full" else "") + ", or use more devices")
