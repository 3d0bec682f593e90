"""XLA:CPU's in-process collectives killing the process, and dpjax's two guards against it
(`dpjax/collectives/cpu_runtime.py`): each case runs as its own process, several times, and
the table gives the exits (a negative one is the signal that killed it).

- `threads`: plain JAX, no dpjax. One `ppermute` over 8 simulated devices, called 200 times
  without waiting: the rendezvous waits take every thread of the CPU client's pool (one a
  core) and a device's work finds none to run on ("only 7 of them arrived", then XLA's 40 s
  termination, SIGABRT). The guard: NPROC sized for the devices' waits.
- `channels`: the README's `python -m dpjax.train --mesh 2x2x2 --fsdp --compression bf16`
  with the thread guard on and the channel guard off (`DPJAX_CPU_GUARDS=threads`): every
  collective has channel id 1, two of them meet at one rendezvous (`Check failed: id <
  num_threads (8 vs. 8)`, heap corruption, SIGABRT or SIGSEGV). The guard: a channel id
  per collective.

    python experiments/cpu_collectives_repro.py --runs 3
    python experiments/cpu_collectives_repro.py --smoke      # the guarded cases, once
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import _bench


PLAIN_JAX = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
if sys.argv[1] == "guarded":
    import dpjax
    dpjax.cpu_guards()  # the explicit call for code that sets XLA_FLAGS itself (importing dpjax applies none)
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("i",))
f = jax.jit(jax.shard_map(lambda x: lax.ppermute(x, "i", [(j, (j + 1) % 8) for j in range(8)]),
                          mesh=mesh, in_specs=P("i"), out_specs=P("i")))
x = jax.device_put(jnp.arange(8 * 4096, dtype=jnp.float32), NamedSharding(mesh, P("i")))
outs = [f(x) for _ in range(int(sys.argv[2]))]  # dispatched without waiting, as a loop does
assert np.array_equal(np.asarray(outs[-1]), np.roll(np.asarray(x).reshape(8, -1), 1, axis=0).ravel())
"""

TRAIN = ["-m", "dpjax.train", "--batch-size", "16", "--seq-len", "64", "--seed", "4", "--mesh", "2x2x2", "--fsdp",
         "--compression", "bf16", "--progress", "none"]


def case(fault: str, guarded: bool, smoke: bool) -> tuple[list[str], dict]:
    env = _bench.checkout_env({k: v for k, v in os.environ.items() if k != "NPROC"})
    if fault == "threads":
        return [sys.executable, "-c", PLAIN_JAX, "guarded" if guarded else "plain", "20" if smoke else "200"], env
    env["DPJAX_CPU_GUARDS"] = "all" if guarded else "threads"
    return [sys.executable, *TRAIN, "--steps", "2" if smoke else "10"], env


def run(cmd, env, timeout: float) -> tuple[int, float, str]:
    began = time.perf_counter()
    try:
        p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stderr
    except subprocess.TimeoutExpired:
        rc, text = "timeout", ""
    said = next((line.strip()[:90] for line in text.splitlines()
                 if any(w in line for w in ("Check failed", "Termination timeout", "Fatal"))), "")
    return rc, time.perf_counter() - began, said


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="processes per case (default 3)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a process may take (default 240)")
    ap.add_argument("--smoke", action="store_true", help="only the guarded cases, once, small: each must exit 0")
    args = ap.parse_args(argv)
    cases = [(f, g) for f in ("threads", "channels") for g in ((True,) if args.smoke else (False, True))]
    runs = 1 if args.smoke else args.runs
    print("| fault | guard | exits | seconds (median) | what XLA said |")
    print("|---|---|---|---:|---|")
    bad = 0
    for fault, guarded in cases:
        results = [run(*case(fault, guarded, args.smoke), args.timeout) for _ in range(runs)]
        exits = [r[0] for r in results]
        bad += guarded and any(rc != 0 for rc in exits)
        seconds = sorted(r[1] for r in results)[len(results) // 2]
        said = next((r[2] for r in results if r[2]), "")
        print(f"| {fault} | {'on' if guarded else 'off'} | {', '.join(map(str, exits))} | {seconds:.1f} | {said} |",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
