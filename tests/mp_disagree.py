"""Run under `python -m dpjax.launch -n 2 --devices-per-process 4`: the two processes
make collective calls that disagree (process 1's argument differs), each case in turn.
Without the agreement check these return garbage or hang (Horovod raises an error on
every rank); here every process must print, for each case, the error it got:
`case NAME: ValueError: ...`. Then one call both make alike must still run and be
right, and a call process 1 never makes must time out on process 0 (TimeoutError)."""

import os
import time

import dpjax
from dpjax import distributed

dpjax.cpu_guards()  # the launcher's XLA_FLAGS simulate this process's devices: guard their collectives
distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dpjax import collectives as C  # noqa: E402
from dpjax.recovery.programs import Programs  # noqa: E402

me = jax.process_index()
n = jax.device_count()
mesh = dpjax.make_mesh(f"data={n}")


def trace(body, local_shape, dtype=jnp.float32):
    """Traces (lowers) one shard_map over every device; the collectives agree while traced."""
    fn = jax.jit(jax.shard_map(lambda b: body(b[0])[None], mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return fn.lower(jax.ShapeDtypeStruct((n, *local_shape), dtype, sharding=NamedSharding(mesh, P("data"))))


# First, before anything compiles (a kept program is one compiled here, not from JAX's cache): a compiled
# program kept by both processes, then lost by process 1 (its host's folder): process 0 could load it and
# process 1 must trace it, whose collectives agree; both trace (distributed.every) and it runs.
x_all = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
x = jax.make_array_from_callback(x_all.shape, NamedSharding(mesh, P("data")), lambda idx: x_all[idx])

folder = os.path.join(os.environ["MP_TMP"], f"programs-{me}")
for attempt in (1, 2):
    kept = Programs(folder, {"case": "kept"}).keep("allreduce", jax.jit(jax.shard_map(
        lambda b: C.allreduce(b[0], "data", algorithm="ring")[None], mesh=mesh, in_specs=P("data"),
        out_specs=P("data"))))
    local = np.asarray(kept(x).addressable_shards[0].data)
    if attempt == 1 and me == 1:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
right = np.array_equal(local[0], x_all.sum(0))
print(f"case kept: {'ok' if right else 'WRONG'}, loaded {kept.programs.loaded}, compiled {kept.programs.compiled}",
      flush=True)


mine = jnp.int32 if me == 0 else jnp.float32  # the dtype each process passes
CASES = {
    **{f"dtype-{name}": (lambda f=f: trace(lambda x: f(x.astype(mine)), (8,)))
       for name, f in [("allreduce", lambda x: C.allreduce(x, "data")),
                       ("all_gather", lambda x: C.all_gather(x, "data")),
                       ("reduce_scatter", lambda x: C.reduce_scatter(x, "data")),
                       ("broadcast", lambda x: C.broadcast(x, "data", root=1))]},
    "reshape": lambda: trace(lambda x: C.allreduce(x if me == 0 else x.reshape(2, 4), "data"), (8,)),
    "shorter-message": lambda: trace(lambda x: C.broadcast(x if me == 0 else x[:6], "data", algorithm="tree"), (8,)),
    **{f"roots-{alg}": (lambda alg=alg: trace(lambda x: C.broadcast(x, "data", root=me, algorithm=alg), (8,)))
       for alg in C.BROADCAST_ALGORITHMS},
}

for name, case in CASES.items():
    try:
        case()
        print(f"case {name}: no error", flush=True)
    except Exception as e:  # noqa: BLE001  (the test reads what each process got)
        print(f"case {name}: {type(e).__name__}: {e}", flush=True)

# Both alike: the check passes and the collective runs across the processes.
f = jax.jit(jax.shard_map(lambda b: C.allreduce(b[0], "data", algorithm="butterfly")[None], mesh=mesh,
                          in_specs=P("data"), out_specs=P("data")))
local = np.asarray(f(x).addressable_shards[0].data)
print(f"case agree: {'ok' if np.array_equal(local[0], x_all.sum(0)) else 'WRONG'}", flush=True)

# Process 1 never makes this call: process 0 waits DPJAX_COLLECTIVE_TIMEOUT seconds, then says so.
t0 = time.time()
if me == 0:
    try:
        trace(lambda v: C.allreduce(v, "data", algorithm="tree"), (8,))
        print("case absent: no error", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"case absent: {type(e).__name__} after {time.time() - t0:.0f} s: {e}", flush=True)
else:
    time.sleep(float(os.environ["DPJAX_COLLECTIVE_TIMEOUT"]) + 1)
print("done", flush=True)
