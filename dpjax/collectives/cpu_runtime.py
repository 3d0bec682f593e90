"""Simulated CPU devices, and two guards that keep XLA:CPU's in-process collectives from
aborting the process.

Simulated CPU devices (`--xla_force_host_platform_device_count=N`) exchange data through
XLA:CPU's in-process communicator: each device's thread waits at a rendezvous until the
N participants of one collective have arrived. Two things break that, and both showed
as `rendezvous.h:314 Check failed: id < num_threads (8 vs. 8)`, a glibc malloc assertion
or a segfault in `python -m dpjax.train --mesh 2x2x2 --fsdp --compression bf16` (the FSDP
gather of one layer and the ring exchange of another run concurrently in the scanned
stack's loop):

1. **One channel id for every collective.** JAX lowers every collective with channel id 1
   (`mlir.COLLECTIVE_CHANNEL_ID`: "their identity does not matter"), and XLA:CPU keys
   its rendezvous by `(run, participants, op_id = channel id)`. Two collectives that the
   thunk executor runs concurrently then meet at one rendezvous: nine participants for
   eight places (the check above), or a buffer of one permute handed to the other (the
   heap corruption). `unique_channel_ids` gives each collective of a program its own id,
   from the program's own counter (`ModuleContext.new_channel`), so the ids are the same
   in every process that lowers the same program.
2. **Too few threads to wait in.** The waits block threads of the CPU client's pool,
   which has one thread per core (2 here). With several collectives or several programs
   in flight, every pool thread can be waiting for a device whose work has no thread to
   run on: `only 7 of them arrived`, then XLA's 40 s termination. `enough_threads` sizes
   the pool (XLA reads `NPROC` for it) for the waits of every simulated device.

`experiments/cpu_collectives_repro.py` shows both faults and each guard's effect, and
`DPJAX_CPU_GUARDS` switches them (`all`, the default; `channels`; `threads`; `none`) to
see a fault again. Neither touches GPUs: the lowering applies to the CPU platform only,
and NPROC only sizes host thread pools.

The guards change every JAX program of the process (a lowering rule, an environment
variable), so a plain `import dpjax` applies neither: `simulate_cpu_devices(n)` applies
them, as it sets up the simulated devices (`python -m dpjax.train` calls it), and
`cpu_guards()` is the call for code that simulates devices with XLA_FLAGS itself.
"""

from __future__ import annotations

import os
import re

import jax
from jax._src.interpreters import mlir
from jax._src.lax import parallel
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from dpjax import env

# Threads per simulated device that may wait at once: two collectives in flight in one
# program (the scanned stack's gather beside an exchange), or two steps in flight. NPROC
# also sizes the pool the matmuls run on; 2 a device cost nothing measurable on the quiet
# 2-core machine (the main job at 0.96x, 3 pairs, experiments/RESULTS.md), 8 a device
# looked slower under load, so no more than needed.
WAITS_PER_DEVICE = 2
GUARDS = ("all", "channels", "threads", "none")
COUNT_FLAG = "--xla_force_host_platform_device_count"
# The collectives whose CPU lowering gets a channel id of its own (every one JAX lowers with
# a channel handle); tests/test_jax_private.py checks each exists in the installed jax.
CHANNEL_PRIMITIVES = ("psum_p", "pmax_p", "pmin_p", "ppermute_p", "all_gather_p", "all_gather_invariant_p",
                      "reduce_scatter_p", "all_to_all_p", "psum_invariant_p")


def guards(environ=os.environ) -> str:
    """Which guards run: DPJAX_CPU_GUARDS, `all` by default (others are for showing a fault)."""
    chosen = env.value("DPJAX_CPU_GUARDS", environ) or "all"
    if chosen not in GUARDS:
        raise ValueError(f"DPJAX_CPU_GUARDS={chosen!r}: expected one of {', '.join(GUARDS)}")
    return chosen


def flagged_devices(environ=os.environ) -> int | None:
    """The simulated CPU device count XLA_FLAGS asks for, or None."""
    found = re.search(rf"{COUNT_FLAG}=(\d+)", environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else None


def enough_threads(environ=os.environ, devices: int | None = None) -> str | None:
    """Sets NPROC (XLA's thread pools' size) for `devices` simulated CPU devices (default:
    XLA_FLAGS' count) unless the user set it. Must run before JAX creates its CPU client;
    returns the value set."""
    if "NPROC" in environ or guards(environ) not in ("all", "threads"):
        return None
    devices = max(devices or flagged_devices(environ) or 8, 8)  # 8: what dpjax.train simulates by default
    environ["NPROC"] = str(max(os.cpu_count() or 1, WAITS_PER_DEVICE * devices))
    return environ["NPROC"]


def _new_ops(outs, args):
    """The operations a lowering rule created: everything between its results and its
    arguments (the walk stops at the arguments, so no earlier op is visited)."""
    def values(x):  # a rule takes and returns values, sequences of them (OpResultList too), or nests
        if isinstance(x, ir.Value):
            yield x
        elif not isinstance(x, (str, bytes, ir.Operation, ir.OpView)) and hasattr(x, "__len__"):
            for y in (x[i] for i in range(len(x))):  # MLIR's result lists index, they do not iterate
                yield from values(y)

    stop = set(values(args))
    todo, seen = list(values(outs)), {}
    while todo:
        v = todo.pop()
        if v in stop or isinstance(v.owner, ir.Block):  # an argument, or a block's (a region's own)
            continue
        op = getattr(v.owner, "operation", v.owner)  # an OpView's operation
        if op in seen:
            continue
        seen[op] = True
        todo.extend(op.operands)
    return list(seen)


def _with_own_channel(default):
    def rule(ctx, *args, **params):
        outs = default(ctx, *args, **params)
        for op in _new_ops(outs, args):
            if "channel_handle" in op.attributes:
                kind = hlo.ChannelHandle(op.attributes["channel_handle"]).channel_type
                op.attributes["channel_handle"] = hlo.ChannelHandle.get(ctx.module_context.new_channel(), kind)
        return outs

    rule.__wrapped__ = default
    return rule


def unique_channel_ids() -> list:
    """Registers, for the CPU platform, each collective's lowering wrapped so that its ops
    get a channel id of their own. Idempotent; returns the primitives it covers."""
    if guards() not in ("all", "channels"):
        return []
    covered = []
    for name in CHANNEL_PRIMITIVES:
        prim = getattr(parallel, name)  # each checked to exist by tests/test_jax_private.py
        current = mlir._platform_specific_lowerings["cpu"].get(prim) or mlir._lowerings.get(prim)
        if current is None or hasattr(current.rule, "__wrapped__"):
            covered.append(prim)
            continue
        # not cacheable: a cached lowering would reuse one id for every call site
        mlir.register_lowering(prim, _with_own_channel(current.rule), platform="cpu", inline=current.inline,
                               cacheable=False)
        covered.append(prim)
    return covered


def cpu_guards(devices: int | None = None) -> None:
    """Applies both guards to this process: for code that simulates CPU devices itself
    (XLA_FLAGS=--xla_force_host_platform_device_count=N set before JAX starts) rather than
    through `simulate_cpu_devices`. Call it before JAX starts its CPU backend (NPROC is
    read then) and before any collective lowers; `devices` defaults to XLA_FLAGS' count.
    Idempotent; `import dpjax` alone applies neither guard."""
    enough_threads(devices=devices)
    unique_channel_ids()


def guard_flagged(environ=os.environ) -> bool:
    """Applies the guards when XLA_FLAGS simulates CPU devices: for dpjax's own tools
    (`python -m dpjax.generate`, `dpjax.hf`), where a user cannot add the call. Before JAX
    starts; whether it applied them."""
    if flagged_devices(environ) is None:
        return False
    enough_threads(environ)
    unique_channel_ids()
    return True


def simulate_cpu_devices(n: int) -> None:
    """Asks for `n` simulated CPU devices and applies the guards their collectives need
    (`cpu_guards`); must run before JAX initialises its backends.

    Harmless where a GPU is present (it only shapes the CPU backend). Raises
    RuntimeError if JAX has already initialised with a different CPU device count.
    """
    if n < 1:
        raise ValueError(f"cannot simulate {n} CPU devices")
    flagged = flagged_devices()
    if flagged is not None:  # the user (or conftest, or dpjax.launch) already decided
        cpu_guards(flagged)
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # backends already up
        have = len(jax.devices("cpu"))
        if have != n:
            raise RuntimeError(
                f"JAX is already initialised with {have} CPU devices; "
                f"call simulate_cpu_devices({n}) before using JAX"
            ) from e
    cpu_guards(n)
