"""XLA:CPU's in-process collectives: the guards of dpjax/collectives/cpu_runtime.py.

The README's `--mesh 2x2x2 --fsdp --compression bf16` aborted the process every time
(every collective had channel id 1, and XLA:CPU keys its rendezvous by it; with too few
threads to wait in, a device never arrived). Here: each collective gets its own id, the
same in every lowering, with results equal to numpy's; NPROC is sized for the devices;
and the combination runs as a real process to exit 0. The guards change every JAX program
of a process, so `import dpjax` applies neither: `simulate_cpu_devices` does, and this
suite's conftest.py (which simulates its 8 devices with XLA_FLAGS) calls `dpjax.cpu_guards()`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.collectives import cpu_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _program():
    mesh = jax.make_mesh((2, 4), ("a", "b"))

    def body(x_BdDm):
        assert x_BdDm.shape == (4, 8)
        return (lax.psum(x_BdDm, "b"), lax.pmax(x_BdDm, ("a", "b")), lax.all_gather(x_BdDm, "b", tiled=True),
                lax.psum_scatter(x_BdDm, "b", tiled=True), lax.all_to_all(x_BdDm, "b", 0, 0, tiled=True),
                lax.ppermute(x_BdDm, "a", [(0, 1), (1, 0)]))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=(P("a", "b"),) * 6))
    x = jax.device_put(jnp.arange(8 * 32, dtype=jnp.float32).reshape(8, 32), NamedSharding(mesh, P("a", "b")))
    return f, x


def test_every_collective_has_its_own_channel_and_the_same_results():
    f, x = _program()
    text = f.lower(x).compile().as_text()
    ops = [line for line in text.splitlines()
           if re.search(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(", line)]
    ids = [re.search(r"channel_id=(\d+)", line).group(1) for line in ops]
    assert len(ids) == 6 and len(set(ids)) == 6, ids
    assert f.lower(x).as_text() == f.lower(x).as_text()  # the same ids each lowering: processes agree

    xs = np.asarray(x)
    block = {(a, b): xs[4 * a:4 * a + 4, 8 * b:8 * b + 8] for a in range(2) for b in range(4)}  # device (a, b)'s

    def laid_out(local):  # the global array of out_specs P("a", "b") from each device's block
        return np.block([[local(a, b) for b in range(4)] for a in range(2)])

    row_sum = {a: sum(block[a, b] for b in range(4)) for a in range(2)}
    want = [laid_out(lambda a, b: row_sum[a]),
            laid_out(lambda a, b: np.maximum.reduce(list(block.values()))),
            laid_out(lambda a, b: np.concatenate([block[a, c] for c in range(4)])),
            laid_out(lambda a, b: row_sum[a][b:b + 1]),
            laid_out(lambda a, b: np.concatenate([block[a, c][b:b + 1] for c in range(4)])),
            laid_out(lambda a, b: block[1 - a, b])]
    for got, expected in zip(f(x), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_nproc_sized_for_the_devices_unless_the_user_set_it():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=16"}
    assert cpu_runtime.enough_threads(env) == str(max(os.cpu_count(), cpu_runtime.WAITS_PER_DEVICE * 16))
    assert env["NPROC"] == str(max(os.cpu_count(), cpu_runtime.WAITS_PER_DEVICE * 16))
    mine = {"XLA_FLAGS": "", "NPROC": "3"}
    assert cpu_runtime.enough_threads(mine) is None and mine["NPROC"] == "3"
    told = {}  # simulate_cpu_devices(12) passes its count
    assert cpu_runtime.enough_threads(told, devices=12) == str(max(os.cpu_count(), cpu_runtime.WAITS_PER_DEVICE * 12))
    off = {"DPJAX_CPU_GUARDS": "channels"}
    assert cpu_runtime.enough_threads(off) is None and "NPROC" not in off


def test_the_tools_guard_devices_that_xla_flags_simulates():
    """`python -m dpjax.generate` and `dpjax.hf` call guard_flagged: the guards where XLA_FLAGS
    simulates devices (here NPROC in a given environment), nothing where it does not."""
    plain = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert cpu_runtime.guard_flagged(plain) is False and "NPROC" not in plain
    flagged = {"XLA_FLAGS": "--xla_force_host_platform_device_count=12"}
    assert cpu_runtime.guard_flagged(flagged) is True
    assert flagged["NPROC"] == str(max(os.cpu_count(), cpu_runtime.WAITS_PER_DEVICE * 12))


def test_simulate_cpu_devices_refuses_no_devices():
    with pytest.raises(ValueError, match="0"):
        cpu_runtime.simulate_cpu_devices(0)


# In a fresh process: what the lowering of each guarded collective is, and NPROC, after each line.
FRESH = """
import os, sys
from jax._src.interpreters import mlir
from jax._src.lax import parallel
def state():
    cpu = mlir._platform_specific_lowerings["cpu"]
    wrapped = [n for n in CHANNEL_PRIMITIVES if hasattr(cpu.get(getattr(parallel, n), mlir._lowerings[getattr(
        parallel, n)]).rule, "__wrapped__")]
    print(os.environ.get("NPROC"), len(wrapped), flush=True)
CHANNEL_PRIMITIVES = sys.argv[1].split(",")
import dpjax
state()
dpjax.simulate_cpu_devices(3)
state()
import jax
print(len(jax.devices("cpu")))
try:
    dpjax.simulate_cpu_devices(5)
except RuntimeError as e:
    print("refused:", e)
"""


def test_import_dpjax_changes_nothing_and_simulate_cpu_devices_guards():
    """`import dpjax` leaves NPROC unset and JAX's lowerings JAX's own; simulating devices
    sets both guards (NPROC for at least 8 devices' waits), decides the device count, and
    a second count once JAX is up is refused with the reason."""
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS", "DPJAX_CPU_GUARDS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.run([sys.executable, "-c", FRESH, ",".join(cpu_runtime.CHANNEL_PRIMITIVES)], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    nproc = str(max(os.cpu_count(), cpu_runtime.WAITS_PER_DEVICE * 8))
    plain, guarded, count, refused = p.stdout.strip().splitlines()
    assert plain == "None 0"
    assert guarded == f"{nproc} {len(cpu_runtime.CHANNEL_PRIMITIVES)}"
    assert count == "3"
    assert refused.startswith("refused: JAX is already initialised with 3 CPU devices")


def test_the_readme_combination_that_aborted_exits_0_as_a_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "dpjax.train", "--steps", "3", "--batch-size", "16", "--seq-len", "64", "--seed", "4",
           "--mesh", "2x2x2", "--fsdp", "--compression", "bf16", "--progress", "none"]
    p = subprocess.run(cmd, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.strip().splitlines()[-1].startswith("done: 3 steps on mesh 2x2x2")
