"""Run under `python -m dpjax.launch -n 2 --devices-per-process 4`: every collective across
the two processes equals lax.psum (or its tiled relatives). Prints 'collectives ok'."""

import dpjax
from dpjax import distributed

dpjax.cpu_guards()  # the launcher's XLA_FLAGS simulate this process's devices: guard their collectives
distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dpjax import collectives as C  # noqa: E402

mesh = dpjax.make_mesh("node=2,data=4")
axes = ("node", "data")
n = 8
x_global = np.random.default_rng(0).standard_normal((n * 24, 3)).astype(np.float32)
x = jax.make_array_from_callback(x_global.shape, NamedSharding(mesh, P(axes)), lambda idx: x_global[idx])


def gathered(fn):
    """Every rank's output, gathered to every process as numpy."""
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    out = f(x)
    return np.asarray(jax.experimental.multihost_utils.process_allgather(out, tiled=True))


import jax.experimental.multihost_utils  # noqa: E402

want = gathered(lambda v: lax.psum(v, axes))
for algo in C.ALGORITHMS:
    for ax in ([axes] if algo == "hierarchical" else [axes, "node"]):
        got = gathered(lambda v: C.allreduce(v, ax, algorithm=algo))
        ref = want if ax == axes else gathered(lambda v: lax.psum(v, "node"))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=f"allreduce {algo} over {ax}")
rs_ref = gathered(lambda v: lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True))
for algo in C.REDUCE_SCATTER_ALGORITHMS:
    got = gathered(lambda v: C.reduce_scatter(v, axes, algorithm=algo))
    np.testing.assert_allclose(got, rs_ref, rtol=1e-5, atol=1e-5, err_msg=f"reduce_scatter {algo}")
ag_ref = gathered(lambda v: lax.all_gather(v, axes, axis=0, tiled=True)[::7])
for algo in C.ALL_GATHER_ALGORITHMS:
    got = gathered(lambda v: C.all_gather(v, axes, algorithm=algo)[::7])
    np.testing.assert_array_equal(got, ag_ref, err_msg=f"all_gather {algo}")
for algo in C.BROADCAST_ALGORITHMS:
    got = gathered(lambda v: C.broadcast(v, axes, root=5, algorithm=algo))
    np.testing.assert_array_equal(got, np.tile(x_global[5 * 24:6 * 24], (n, 1)), err_msg=f"broadcast {algo}")
# The other ops and primitives, across the processes too: exact ones, against numpy.
rows = x_global.reshape(n, 24, 3)  # rank r's block
for algo in ("ring", "butterfly", "tree"):
    got = gathered(lambda v: C.allreduce(v, axes, algorithm=algo, op="max"))
    np.testing.assert_array_equal(got, np.tile(rows.max(0), (n, 1)), err_msg=f"allreduce max {algo}")
got = gathered(lambda v: C.allreduce(v, axes, algorithm="ring", groups=[[0, 5, 6], [1, 2, 3, 4, 7]]))
for r in range(n):
    members = [0, 5, 6] if r in (0, 5, 6) else [1, 2, 3, 4, 7]
    np.testing.assert_allclose(got[r * 24:(r + 1) * 24], rows[members].sum(0), rtol=1e-5, atol=1e-5,
                               err_msg="allreduce within groups")
a2a_ref = gathered(lambda v: lax.all_to_all(v, axes, 0, 0, tiled=True))
for algo in ("pairwise", "bruck"):
    np.testing.assert_array_equal(gathered(lambda v: C.all_to_all(v, axes, algorithm=algo)), a2a_ref,
                                  err_msg=f"all_to_all {algo}")
print("collectives ok", flush=True)
