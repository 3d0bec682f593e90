"""Parameter-server allreduce: workers push to server ranks, servers push back.

The pattern of DistBelief's parameter servers (Dean et al., "Large scale distributed
deep networks", NIPS 2012) and of Li et al.'s parameter server (OSDI 2014), written
as a synchronous allreduce. With S server ranks (ranks 0..S-1) the tensor is cut into
S shards and server k owns shard k. A ppermute is a permutation (one sender per
receiver), so the n-1 pushes to a server take n-1 steps: at step j, rank (k+j) mod n
sends shard k to server k (all servers receive at once). The pull runs the same way
back.

Per device, N the bytes of the vector, n ranks, S servers:

    steps          2(n-1)
    a server       (S-1)/S * N pushed + (n-1)/S * N pulled = (n+S-2)/S * N bytes sent
    a non-server   N bytes sent (each shard once)

With one server that is (n-1) * N on the server: the bottleneck that motivated
sharded servers and then allreduce. With S = n it sends 2(n-1)/n * N, like the ring.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from dpjax.collectives.ranks import as_chunks, axis_size, index, permute, row
from dpjax.collectives.cost import Schedule, no_model
from dpjax.collectives.ops import combine
from dpjax.collectives.registry import Algorithm, register
from dpjax.collectives.ring import rows_in_rank_order


def allreduce(x, axis_name, *, op: str = "sum", num_servers: int = 1):
    n = axis_size(axis_name)
    if not 1 <= num_servers <= n:
        raise ValueError(f"num_servers={num_servers} must be between 1 and the axis size {n}")
    if n == 1:
        return x
    S, add = num_servers, combine(op)
    r = index(axis_name)
    shards, undo = as_chunks(x, S)
    acc = row(shards, jnp.minimum(r, S - 1))  # a server starts from its own shard
    for j in range(1, n):
        send = row(shards, jnp.minimum((r - j) % n, S - 1))  # shard (r-j) mod n, if a server owns it
        acc = add(acc, permute(send, axis_name, [((k + j) % n, k) for k in range(S)]))
    got = [acc]
    for j in range(1, n):
        got.append(permute(acc, axis_name, [(k, (k + j) % n) for k in range(S)]))
    # got[j] holds shard (r - j) mod n, sent by its server j steps round.
    order = [[(i - k) % n for k in range(S)] for i in range(n)]
    return undo(rows_in_rank_order([g[None] for g in got], order, r))


def cost(primitive: str, n: int, nelems: int, itemsize: int, num_servers: int = 1) -> Schedule:
    """The busiest device: a server, or a non-server (every shard once, padded) if it sends more."""
    if primitive != "allreduce":
        raise no_model(primitive, "ps")
    if n == 1:
        return Schedule(0, 0)
    S = num_servers
    shard = math.ceil(nelems / S) * itemsize
    server = (S - 1) * shard + (n - 1) * shard
    return Schedule(2 * (n - 1), max(server, S * shard if S < n else 0))


register(Algorithm("ps", cost, allreduce=allreduce))
