"""dpjax.horovod: Horovod's names, arguments and gradients, against numpy.

The mesh is node=2 x data=4 x model=1, so Horovod's 8 ranks are the devices along the
two data axes and every call finds its axes itself. Values: small integers, so every
sum is exact in float32 and the checks are bit for bit (Average divides by 8, exact).
Gradients: Horovod's rules (horovod/torch/mpi_ops.py, the `backward` of each autograd
function), written out in numpy per rank; the docstring of dpjax.horovod says where they
differ from JAX's own transposes.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dpjax.horovod as hvd
from collectives_harness import run_bundle

N, AXES = 8, ("node", "data")
EVEN = hvd.ProcessSet([0, 2, 4, 6])


@pytest.fixture(scope="module")
def mesh(mesh_of):
    return mesh_of("2x4x1", N)


# The XLA baseline (algorithm="psum") where the call has one, to keep the program small:
# the wrappers' arguments are under test here, the algorithms in test_collectives.
X = {"algorithm": "psum"}
BODIES = {
    "sum": lambda v: hvd.allreduce(v, op=hvd.Sum, **X),
    "average": lambda v: hvd.allreduce(v, **X),  # Horovod's default op
    "average-false": lambda v: hvd.allreduce(v, average=False, **X),
    "min": lambda v: hvd.allreduce(v, op=hvd.Min, **X),
    "max-int": lambda v: hvd.allreduce(v.astype(jnp.int32), op=hvd.Max, **X).astype(jnp.float32),
    "product": lambda v: hvd.allreduce(jnp.sign(v) + 2, op=hvd.Product),
    "scaled": lambda v: hvd.allreduce(v, op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0, **X),
    "fp16": lambda v: hvd.allreduce(v, compression=hvd.Compression.fp16, **X),
    "even-set": lambda v: hvd.allreduce(v, op=hvd.Sum, process_set=EVEN),
    "grouped": lambda v: jnp.concatenate(hvd.grouped_allreduce([v[:3], v[3:]], op=hvd.Sum, **X)),
    "allgather": lambda v: hvd.allgather(v[:2], **X),
    "allgather-sizes": lambda v: hvd.allgather(v[:2], sizes=[2, 1, 0, 2, 1, 1, 2, 1], **X),
    "broadcast": lambda v: hvd.broadcast(v, root_rank=5, **X),
    "broadcast-set": lambda v: hvd.broadcast(v, root_rank=4, process_set=EVEN),
    "alltoall": lambda v: hvd.alltoall(v),
    "reducescatter": lambda v: hvd.reducescatter(v, **X),  # Average
    "reducescatter-uneven": lambda v: hvd.reducescatter(v[:10], op=hvd.Sum, **X),
    "ranks": lambda v: jnp.stack([hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()]).astype(jnp.float32),
}


@pytest.fixture(scope="module")
def results(cache, mesh):
    def build():
        x = np.random.default_rng(3).integers(-9, 10, (N, 16)).astype(np.float32)
        return x, run_bundle(mesh, AXES, BODIES, {k: x for k in BODIES})

    return cache.get(("horovod", N), build)


def test_allreduce_ops(results):
    x, out = results
    for key, want in [("sum", x.sum(0)), ("average", x.mean(0)), ("average-false", x.sum(0)), ("min", x.min(0)),
                      ("max-int", x.max(0)), ("product", (np.sign(x) + 2).prod(0)),
                      ("scaled", (0.5 * x).mean(0) * 4), ("fp16", x.mean(0)),
                      ("grouped", x.sum(0))]:
        np.testing.assert_array_equal(out[key], np.broadcast_to(want, x.shape), err_msg=key)
    for r in range(N):  # the even ranks sum among themselves; the odd ones are outside the set
        np.testing.assert_array_equal(out["even-set"][r], x[::2].sum(0) if r % 2 == 0 else x[r])


def test_gather_broadcast_alltoall_reducescatter(results):
    x, out = results
    sizes = [2, 1, 0, 2, 1, 1, 2, 1]
    for r in range(N):
        np.testing.assert_array_equal(out["allgather"][r], x[:, :2].reshape(-1))
        np.testing.assert_array_equal(out["allgather-sizes"][r],
                                      np.concatenate([x[q, :s] for q, s in enumerate(sizes)]))
        np.testing.assert_array_equal(out["broadcast"][r], x[5])
        np.testing.assert_array_equal(out["broadcast-set"][r], x[4] if r % 2 == 0 else x[r])
        np.testing.assert_array_equal(out["alltoall"][r], x[:, 2 * r:2 * r + 2].reshape(-1))
        np.testing.assert_array_equal(out["reducescatter"][r], x.mean(0)[2 * r:2 * r + 2])
        # 10 rows over 8 ranks: Horovod gives the first two ranks 2, padded here to 2 rows each
        start = [0, 2, 4, 5, 6, 7, 8, 9][r]
        piece = x[:, :10].sum(0)[start:start + (2 if r < 2 else 1)]
        np.testing.assert_array_equal(out["reducescatter-uneven"][r], np.pad(piece, (0, 2 - len(piece))))
        np.testing.assert_array_equal(out["ranks"][r], [r, N, r % 4, 4])  # local: the data axis


def horovod_gradient(op: str, x, w):
    """Horovod's backward of `op` for loss = sum(w * op(x)), every rank's (numpy)."""
    n = x.shape[0]
    gathered = np.broadcast_to(w.reshape(-1), (n, w.size))  # every rank's gradient, on every rank
    return {
        "sum": lambda: np.broadcast_to(w.sum(0), x.shape),  # allreduce of the gradients: the same op
        "average": lambda: np.broadcast_to(w.mean(0), x.shape),
        "allgather": lambda: w.mean(0).reshape(n, -1),  # their mean, cut to each rank's piece
        "broadcast": lambda: np.stack([w.mean(0) if r == 5 else 0 * w[0] for r in range(n)]),  # on the root
        "reducescatter-sum": lambda: n * gathered,  # gathered, times n
        "reducescatter-average": lambda: gathered,
        "reducescatter-scaled": lambda: 0.5 * 4 * gathered,  # times prescale and postscale
        "alltoall": lambda: w.reshape(n, n, -1).swapaxes(0, 1).reshape(x.shape),  # all-to-all of them
    }[op]()


# The XLA baselines where the op has one: the rules, not the algorithms, are under test.
GRAD_OPS = {
    "sum": (lambda v: hvd.allreduce(v, op=hvd.Sum, algorithm="psum"), 2),
    "average": (lambda v: hvd.allreduce(v, algorithm="psum"), 2),
    "allgather": (lambda v: hvd.allgather(v, algorithm="psum"), 1),
    "broadcast": (lambda v: hvd.broadcast(v, 5, algorithm="psum"), 2),
    "reducescatter-sum": (lambda v: hvd.reducescatter(v, op=hvd.Sum, algorithm="psum"), N),
    "reducescatter-average": (lambda v: hvd.reducescatter(v, algorithm="psum"), N),
    "reducescatter-scaled": (lambda v: hvd.reducescatter(v, prescale_factor=0.5, postscale_factor=4.0,
                                                         algorithm="psum"), N),
    "alltoall": (lambda v: hvd.alltoall(v, algorithm="xla"), N),
}


def test_gradients_follow_horovod(mesh):
    rng = np.random.default_rng(4)
    xs = {k: rng.integers(-4, 5, (N, rows * 2)).astype(np.float32) for k, (_, rows) in GRAD_OPS.items()}
    ys = {k: jax.eval_shape(jax.shard_map(lambda v, f=f: f(v[0])[None], mesh=mesh, in_specs=P(AXES),
                                          out_specs=P(AXES)), xs[k]).shape for k, (f, _) in GRAD_OPS.items()}
    ws = {k: rng.integers(-4, 5, ys[k]).astype(np.float32) for k in GRAD_OPS}

    def loss(xs, check_vma=False):  # local gradients, as in dpjax.shard_step
        def body(blocks):
            return {k: GRAD_OPS[k][0](b[0])[None] for k, b in blocks.items()}

        ys = jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES), check_vma=check_vma)(xs)
        return sum(jnp.sum(ws[k] * ys[k]) for k in ys)

    with pytest.raises(ValueError, match=r"check_vma=False"):
        jax.eval_shape(jax.grad(lambda xs: loss(xs, check_vma=True)), xs)
    got = jax.jit(jax.grad(loss))(xs)
    for k in GRAD_OPS:
        np.testing.assert_array_equal(np.asarray(got[k]), horovod_gradient(k, xs[k], ws[k]), err_msg=k)


def test_distributed_optimizer_adasum_and_process_set(mesh, put):
    """op=Adasum picks the butterfly; a process set averages within the set only."""
    g = np.random.default_rng(5).integers(-4, 5, (N, 6)).astype(np.float32)
    params = {"w": np.zeros(6, np.float32)}
    outs = {}
    for name, opt in [("even", hvd.DistributedOptimizer(optax.sgd(1.0), process_set=EVEN)),
                      ("adasum", hvd.DistributedOptimizer(optax.sgd(1.0), op=hvd.Adasum))]:
        f = jax.jit(jax.shard_map(lambda g, s, opt=opt: opt.update({"w": g[0]}, s, params)[0]["w"][None], mesh=mesh,
                                  in_specs=(P(AXES), P()), out_specs=P(AXES), check_vma=False))
        outs[name] = np.asarray(f(jax.device_put(g, jax.sharding.NamedSharding(mesh, P(AXES))), opt.init(params)))
    for r in range(N):
        np.testing.assert_array_equal(outs["even"][r], -(g[::2].mean(0) if r % 2 == 0 else g[r]))
    assert np.allclose(outs["adasum"], outs["adasum"][0]) and not np.allclose(outs["adasum"][0], -g.mean(0))


def test_outside_a_step(mesh):
    assert hvd.rank() == jax.process_index() and hvd.size() == jax.process_count()
    assert hvd.size(mesh=mesh) == N
    with pytest.raises(ValueError, match=r"hvd.allreduce called outside a dpjax step .*dpjax.shard_step"):
        hvd.allreduce(jnp.ones(3))
    with pytest.raises(ValueError, match="root_rank 1 is not in the process set"):
        jax.eval_shape(jax.shard_map(lambda v: hvd.broadcast(v, 1, process_set=EVEN), mesh=mesh,
                                     in_specs=P(AXES), out_specs=P(AXES)), jnp.ones(8))
    with pytest.raises(ValueError, match="uneven splits"):
        jax.eval_shape(jax.shard_map(lambda v: hvd.alltoall(v, splits=[2, 0, 1, 1, 1, 1, 1, 1]), mesh=mesh,
                                     in_specs=P(AXES), out_specs=P(AXES)), jnp.ones(64))


def readme_port() -> str:
    """The ported Horovod script of docs/horovod.md's "Coming from Horovod" section."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "horovod.md").read_text()
    section = text.split("## Coming from Horovod", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_port_trains_like_one_device():
    """The docs' script (Horovod's lines changed to dpjax.horovod) against the same
    SGD on one device over the whole batch: the same losses up to the order of sums."""
    scope: dict = {}
    exec(compile(readme_port(), "docs/horovod.md", "exec"), scope)  # defines train(steps) -> losses
    got = scope["train"](steps=20)
    x, y = scope["make_data"]()
    params, tx = {"w": jnp.zeros(3), "b": jnp.zeros(())}, optax.sgd(scope["LR"])
    state, want = tx.init(params), []
    for i in range(20):
        loss, grads = jax.value_and_grad(scope["loss_fn"])(params, x[i], y[i])
        updates, state = tx.update(grads, state)
        params = optax.apply_updates(params, updates)
        want.append(float(loss))
    assert want[-1] < 0.1 * want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
