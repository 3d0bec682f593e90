"""hlo_comm on XLA's own collectives: combined (tuple) all-reduces and mesh-form replica groups."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dpjax.collectives.cost import _replica_groups, hlo_comm


def test_auto_sharded_gradient_allreduce_is_charged_in_full(mesh_of):
    mesh = mesh_of("8x1", 8)
    rep, bat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def grads(w1, w2, x):
        return jax.grad(lambda a, b: jnp.sum((x @ a) @ b), argnums=(0, 1))(w1, w2)

    text = jax.jit(grads, in_shardings=(rep, rep, bat), out_shardings=rep).lower(
        jnp.ones((256, 256)), jnp.ones((256, 128)), jnp.ones((64, 256))).compile().as_text()
    comm = hlo_comm(text)
    nbytes = (256 * 256 + 256 * 128) * 4  # both gradients, whether XLA combines them or not
    assert set(comm.ops) == {"all-reduce"}
    assert comm.max_bytes == 2 * 7 * nbytes // 8  # ring-equivalent charge over 8 devices
    assert sorted(comm.bytes_per_device) == list(range(8))


def test_replica_group_forms():
    assert _replica_groups("replica_groups={{0,4},{1,5}}, x") == [[0, 4], [1, 5]]
    assert _replica_groups("replica_groups=mesh['a'=2,'b'=4] {'b'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a','b'}") == [list(range(8))]
