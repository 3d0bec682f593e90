"""Settings -> Plan: the ONE place a run's settings are checked and resolved.

    settings -> check(settings)         what needs no devices (checks)
             -> resolve(settings, devs) mesh, workers, layout, exchange, rule, links, batch,
                                        micro-batches, autotune knobs, memory (plan)
             -> Plan                    immutable; `dpjax.step` builds from it

Every check raises a one-line `UserError`, once; nothing below the plan checks settings
again. The rooms: plan (Plan, resolve, for_layout, for_rule), checks, axes (mesh, pipeline,
links, context, expert), workers, fit (device counts), compute (platform, policy, memory
refusal), memory, usable, task, lora, pipeline_cost.
"""

from dpjax.plan.axes import check_context, check_expert
from dpjax.plan.checks import UsageError, check, flag, model_choice, settled, warnings
from dpjax.plan.compute import (DEFAULT_ALGORITHM, DEFAULT_FUSION_MB, check_memory, compute_policy, default_allreduce,
                                memory_refusal, target_platform)
from dpjax.plan.fit import devices_per_process, fit_devices, fit_mesh
from dpjax.plan.lora import lora_model, trained_split
from dpjax.plan.plan import Plan, for_layout, for_rule, resolve
from dpjax.plan.task import check_task
from dpjax.plan.workers import default_workers, per_shard

__all__ = ["DEFAULT_ALGORITHM", "DEFAULT_FUSION_MB", "Plan", "UsageError", "check", "check_context",
           "check_expert", "check_memory", "check_task", "compute_policy", "default_allreduce", "default_workers",
           "devices_per_process", "fit_devices", "fit_mesh", "flag", "for_layout", "for_rule", "lora_model",
           "memory_refusal", "model_choice", "per_shard", "resolve", "settled", "target_platform", "trained_split",
           "warnings"]
