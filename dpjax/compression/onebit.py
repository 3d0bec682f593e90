"""onebit: 1-bit Adam's compressed allreduce, scaled sign with worker AND server error.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang & He, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021, Algorithm 1's
"compressed allreduce" (DeepSpeed's NcclBackend.compressed_allreduce): the allreduce of
a parameter server whose n servers are the n ranks themselves, each owning 1/n of every
tensor (a chunk), and whose both directions travel as one bit a value:

    worker i   e_i = x_i + worker_err_i      (feedback.py adds the worker error)
               sends chunk r of C(e_i) to rank r        (all-to-all: (n-1) chunks of bits)
               worker_err_i <- e_i - C(e_i)
    server r   s_r = mean_i C(e_i)[chunk r] + server_err_r
               sends C(s_r) to every rank               (all-gather: (n-1) chunks of bits)
               server_err_r <- s_r - C(s_r)
    every rank the mean is the n servers' C(s_r), chunk by chunk

C is scaled sign (`sign.py`: one bit a value and one float32 scale, mean |x|, per tensor
piece). Each tensor is cut into n chunks of ceil(d/n) values (zero-padded), so a chunk
of a fused bucket is every tensor's r-th piece with its own scale; every block of the
all-to-all and all-gather is then the same size, ceil(C/8) + 4T bytes for T tensors of
C = sum ceil(d/n) chunk values. The busiest rank sends 2 (n-1) of them: about
2 (n-1) / n * d / 8 bytes, against the ring allreduce's 2 (n-1) / n * 4 d, 32x fewer
(`sign`, which all-gathers every rank's whole message, is 8x fewer at any n).

Nothing is lost, only delayed, through both buffers: after any number of exchanges,
sum(applied means) + mean_i(worker_err_i) + sum_r(server_err_r) == sum(true means).
The server error is this method's own state (`feedback.State.method`), kept shaped like
the parameters so that it is laid out and checkpointed like them: rank r's buffer holds
its chunk's error and zeros elsewhere, so the buffers of the ranks sum to the whole
server error (one full-size buffer a rank, as the worker error; DeepSpeed keeps 1/n of
it). The chunks are cut from each rank's local shard, so a resume across a change of
the model split is refused, as for PowerSGD's Q (`Exchange.split`).

It is meant for a quantity whose scale changes slowly, such as Adam's momentum after
its variance is frozen (`dpjax.updates.onebit_adam`); it also runs as a gradient
compression (`--compression onebit`), as `sign` does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpjax.collectives import all_gather, all_to_all
from dpjax.collectives import allreduce as one
from dpjax.collectives.ranks import axis_size, index
from dpjax.compression import sign
from dpjax.compression.feedback import floating, per_bucket_bytes
from dpjax.compression.registry import Method, register
from dpjax.fusion import classes_of, pack, plan_buckets, unpack


def chunks(segments, n: int) -> tuple:
    """Each tensor's chunk size: ceil(d / n) values (the piece each of the n servers owns)."""
    return tuple(-(-int(d) // n) for d in segments)


def to_rows(x, segments, n: int):
    """The flat bucket x (tensors of `segments` values) as n rows: row r is every
    tensor's r-th chunk, zero-padded (n, C)."""
    offsets = _offsets(segments)
    cs = chunks(segments, n)
    parts = [jnp.pad(x[a:b], (0, c * n - (b - a))).reshape(n, c) for a, b, c in zip(offsets[:-1], offsets[1:], cs)]
    return jnp.concatenate(parts, axis=1)


def from_rows(rows_IxN, segments, n: int):
    """Inverse of `to_rows`: the flat bucket (padding dropped)."""
    cs = chunks(segments, n)
    at, out = 0, []
    for d, c in zip(segments, cs):
        out.append(rows_IxN[:, at:at + c].reshape(-1)[:int(d)])
        at += c
    return jnp.concatenate(out)


def _offsets(segments):
    out = [0]
    for d in segments:
        out.append(out[-1] + int(d))
    return out


def _reduce(x, serr, axis_name, segments, algorithm):
    """(the mean over the axis of every rank's C(x) through the n servers, this rank's
    worker residual x - C(x), its new server-error buffer) for the flat bucket x."""
    n = axis_size(axis_name, "1-bit compressed allreduce")
    cs = chunks(segments, n)
    rows_IxN = to_rows(x, segments, n)
    msgs_IxN = jnp.stack([sign.encode(rows_IxN[r], cs) for r in range(n)])  # row r: for server r
    mine_IxN = jnp.stack([sign.decode(msgs_IxN[r], rows_IxN[r], cs) for r in range(n)])
    got_IxN = all_to_all(msgs_IxN, axis_name)  # row i: rank i's message for my chunk
    r = index(axis_name)
    like = rows_IxN[0]
    s_N = sum(sign.decode(got_IxN[i], like, cs) for i in range(n)) / n
    serr_rows = to_rows(serr, segments, n)
    s_N = s_N + jax.lax.dynamic_index_in_dim(serr_rows, r, 0, keepdims=False)
    back = sign.encode(s_N, cs)
    new_serr_N = s_N - sign.decode(back, like, cs)
    every_IxN = all_gather(back, axis_name, algorithm="ring").reshape(n, -1)  # row r: server r's chunk
    out_IxN = jnp.stack([sign.decode(every_IxN[i], like, cs) for i in range(n)])
    mine_rows = jnp.where((jnp.arange(n) == r)[:, None], new_serr_N[None], jnp.zeros_like(serr_rows))
    return from_rows(out_IxN, segments, n), x - from_rows(mine_IxN, segments, n), \
        from_rows(mine_rows, segments, n)


def exchange(tree, serr, axis_name, spec, t, allreduce):
    """`Method.exchange`: the tree fused into buckets as the allreduce packs it, each
    bucket through `_reduce`; integer buckets travel exactly (and keep no error)."""
    plan = plan_buckets(tree, allreduce.get("fusion_mb", 64) * 2**20, classes_of(tree))
    means, resids, serrs = [], [], []
    for bucket, buf, se in zip(plan.buckets, pack(plan, tree), pack(plan, serr)):
        if floating(buf.dtype):
            m, r, s = _reduce(buf, se, axis_name, bucket.sizes, allreduce.get("algorithm", "ring"))
        else:
            m = one(buf, axis_name, op="mean", algorithm=allreduce.get("algorithm", "ring"))
            r, s = jnp.zeros_like(buf), se
        means.append(m)
        resids.append(r)
        serrs.append(s)
    return unpack(plan, means), unpack(plan, resids), unpack(plan, serrs)


def init(params, spec):
    """The server-error buffers: zeros shaped like the parameters (rank r uses chunk r)."""
    return jax.tree.map(jnp.zeros_like, params)


def state_specs(param_specs, spec):
    """Laid out as the parameters they mirror."""
    return param_specs


def _bytes(d, n, spec, segments, allreduce):
    """An all-to-all (pairwise: n-1 blocks) and a ring all-gather (n-1 blocks) of one
    block of ceil(C/8) bits and a float32 scale per tensor."""
    block = math.ceil(sum(chunks(segments, n)) / 8) + 4 * len(segments)
    return 2 * (n - 1) * block


register(Method("onebit", sign.encode, sign.decode, lambda dt: jnp.issubdtype(dt, jnp.floating),
                jnp.dtype(jnp.uint8), linear=False, exchange=exchange, init=init, state_specs=state_specs,
                wire_bytes=per_bucket_bytes(_bytes), gather=True,
                under_adam="a biased compressor: Adam divides each coordinate by its own running scale and amplifies "
                           "what the error buffer releases (RESULTS.md: sign 3.69 with feedback, 2.59 uncompressed)",
                nonlinear="the servers re-compress the sum of scaled signs (1-bit Adam's compressed allreduce)"))
