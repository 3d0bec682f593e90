"""Does JAX's own recovery let the survivors go on without a restart, on CPU?

Starts 3 processes of 2 CPU devices on 127.0.0.1 with `jax_enable_recoverability` on,
each summing over every device of the job (a jitted psum over a mesh of the live
devices, inside `multihost_utils.live_devices`), step after step; process 2 kills itself
(SIGKILL) after step 3. The survivors catch what the step raises, ask `live_devices`
again, rebuild the mesh on what is left and go on. Prints, per process, what each step
did (the sum it got, or the error) and what `live_devices` said.

    python experiments/jax_recoverability.py [--smoke]

What it found is in README.md ("Surviving failures") and RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402

WORKER = r'''
import os, signal, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np
jax.config.update("jax_enable_recoverability", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
me, n, port, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", n, me, heartbeat_timeout_seconds=5, initialization_timeout=60)
from jax.experimental import multihost_utils as mh
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
def say(*a): print(f"p{me} t={time.time() - t0:5.1f}s", *a, flush=True)
t0 = time.time()
for step in range(steps):
    if me == n - 1 and step == 3:
        say("killing myself"); os.kill(os.getpid(), signal.SIGKILL)
    try:
        with mh.live_devices(jax.devices()) as devs:
            if len(devs) < 6:
                say(f"step {step}: live_devices returned {len(devs)} devices; summing over them")
            mesh = Mesh(np.array(devs), ("d",))
            x = jax.make_array_from_callback((len(devs),), NamedSharding(mesh, P("d")),
                                             lambda idx: np.ones(1, np.float32))
            total = jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, P()))(x)
            say(f"step {step}: {len(devs)} live devices, sum {float(total)}")
    except Exception as e:
        say(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    time.sleep(0.5)
say("finished")
'''


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--lines", type=int, default=25, help="the last lines of each process's output shown")
    _bench.add_smoke(p, "6 steps, 20 s at most")
    args = p.parse_args()
    steps = 6 if args.smoke else args.steps
    if args.smoke:
        args.timeout = 20
    n = 3
    from dpjax.agent.rendezvous import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(n), str(port), str(steps)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    t0, outs = time.time(), []
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\n(p{i} still running after {args.timeout:g} s: killed)"
        outs.append((i, proc.returncode, out))
    print(f"# jax {__import__('jax').__version__}, {_bench.machine()}, load {_bench.load_avg():.1f}")
    for i, code, out in outs:
        keep = [line for line in out.splitlines() if line.strip() and not line.lstrip().startswith("@")][-args.lines:]
        print(f"## process {i}: exit {code}")
        print("\n".join(keep))


if __name__ == "__main__":
    main()
