"""The memory JAX really gets on a device, which is what `--remat auto` must fit within.

On a GPU JAX's allocator takes a fraction of the device's memory, 0.75 unless
`XLA_CLIENT_MEM_FRACTION` (or the older `XLA_PYTHON_CLIENT_MEM_FRACTION`) says
otherwise, and reports that as the device's `bytes_limit` (jaxlib's
`generate_pjrt_gpu_plugin_options` reads those variables; JAX's "GPU memory allocation"
page). An 80 GiB H100 gives a run 60 GiB by default: a plan that chose its remat against
80 GiB would compile and then run out of memory. With `XLA_PYTHON_CLIENT_ALLOCATOR=platform`
there is no pool: an allocation may take the whole device.

    --device-memory X on a GPU     usable = fraction x X (the fraction as JAX would take it)
    a GPU here                     usable = the allocator's bytes_limit (device.memory_stats())
    CPU                            usable = the host's memory less the runtime's, shared
                                   by this process's devices (`dpjax.plan.memory.device_memory`)
    --device-memory X on CPU       usable = X (no allocator pool)

Each answer carries where it came from, which the plan prints (`dpjax.train.plan_table`)."""

from __future__ import annotations

import os

import jax

from dpjax.plan.checks import UsageError
from dpjax.plan.memory import device_memory

DEFAULT_FRACTION = 0.75  # JAX's GPU default
NAMES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # the new name first, as jaxlib reads them
GPUS = ("gpu", "cuda", "rocm")


def gpu_fraction(environ=None) -> tuple[float, str]:
    """(the fraction of a GPU's memory JAX's allocator takes, where that comes from)."""
    env = os.environ if environ is None else environ
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool"
    given = [(name, env[name]) for name in NAMES if env.get(name)]
    if len(given) == 2:  # JAX refuses to start with both
        raise UsageError(f"{NAMES[0]} and {NAMES[1]} are both set: JAX takes only one (remove the second)")
    if not given:
        return DEFAULT_FRACTION, f"JAX's default, {NAMES[1]} unset"
    name, text = given[0]
    try:
        fraction = float(text)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise UsageError(f"{name}={text!r}: expected a fraction of the device's memory in (0, 1], e.g. .95")
    return fraction, f"{name}={text}"


def usable_memory(platform: str, mesh, given: int | None, environ=None) -> dict:
    """{"usable": bytes a device gives a run (None: unknown), "total": the device's bytes
    where known, "fraction": usable / total where known, "source": in words}."""
    if given is not None:
        if platform in GPUS:
            fraction, why = gpu_fraction(environ)
            return {"usable": int(fraction * given), "total": given, "fraction": fraction,
                    "source": f"{fraction:g} of --device-memory: {why}"}
        return {"usable": given, "total": given, "fraction": 1.0, "source": "--device-memory"}


    dev = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return {"usable": int(stats["bytes_limit"]), "total": None, "fraction": None,
                "source": "the allocator's bytes_limit (device.memory_stats())"}
    have = device_memory(mesh)
    return {"usable": have, "total": None, "fraction": None,
            "source": "the host's memory less the runtime's, shared by this process's devices"}

