"""All-to-all (pairwise, Bruck) against lax.all_to_all and numpy, values and gradients.

All-to-all only moves data, so every result must be bit-exact: rank r's block j ends on
rank j as its block r (Horovod's test_horovod_alltoall; lax.all_to_all tiled on
dimension 0 is the same exchange). One program per axis size holds both algorithms,
XLA's own, each algorithm with another dtype (cycling with n through float32,
bfloat16, int32 and bool) and another number of rows per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax import collectives as C
from collectives_harness import run_bundle

DTYPES = [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_]


def numpy_all_to_all(x: np.ndarray) -> np.ndarray:
    """x (n ranks, n*m, ...) -> what each rank holds after the exchange."""
    n = x.shape[0]
    blocks = x.reshape(n, n, x.shape[1] // n, *x.shape[2:])  # [sender, receiver, ...]
    return blocks.swapaxes(0, 1).reshape(x.shape)


@pytest.mark.parametrize("n", range(1, 9))
def test_all_to_all_is_the_transpose_of_blocks(cache, mesh_of, n):
    def build():
        rng = np.random.default_rng(n)
        bodies, inputs = {}, {}
        for i, alg in enumerate(C.ALL_TO_ALL_ALGORITHMS):
            dtype = DTYPES[(n + i) % len(DTYPES)]
            shape = (n, n * (i + 1), 3) if i % 2 else (n, n * (i + 1))  # 1 to 3 rows per block
            x = rng.standard_normal(shape) if dtype != np.bool_ else rng.random(shape) < 0.5
            x = x if dtype is np.bool_ else (x * 10).astype(dtype)
            key = f"{alg}/{np.dtype(dtype).name}"
            inputs[key] = x
            bodies[key] = lambda v, alg=alg: C.all_to_all(v, "data", algorithm=alg)
        return inputs, run_bundle(mesh_of(f"data={n}", n), "data", bodies, inputs)

    inputs, outputs = cache.get(("all_to_all", n), build)
    for key, x in inputs.items():
        assert outputs[key].dtype == x.dtype
        np.testing.assert_array_equal(outputs[key], numpy_all_to_all(x), err_msg=f"n={n} {key}")


@pytest.mark.parametrize("algorithm, n", [("pairwise", 8), ("bruck", 5)])
def test_all_to_all_gradient_equals_lax(mesh_of, algorithm, n):
    """d/dx sum(w * all_to_all(x)^2): the transpose routes each cotangent block back to
    its sender; integers below 2^24 keep every value exact, so bit for bit."""
    mesh = mesh_of(f"data={n}", n)
    rng = np.random.default_rng(n)
    x = rng.integers(-8, 9, (n, 2 * n)).astype(np.float32)
    w = rng.integers(-4, 5, (n, 2 * n)).astype(np.float32)

    def grad_with(fn):
        def loss(x, w):
            y = jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)
            return jnp.sum(w * y * y)

        return np.asarray(jax.jit(jax.grad(loss))(x, w))

    got = grad_with(lambda v: C.all_to_all(v, "data", algorithm=algorithm))
    want = grad_with(lambda v: lax.all_to_all(v, "data", 0, 0, tiled=True))
    np.testing.assert_array_equal(got, want)
    # by hand: y = A(x) with A the block transpose, dL/dx = A^T(2 w y) = A(2 w A(x))
    np.testing.assert_array_equal(got, numpy_all_to_all(2 * w * numpy_all_to_all(x)))


def test_all_to_all_refuses_rows_the_axis_does_not_divide(mesh_of):
    mesh = mesh_of("data=4", 4)
    fn = jax.shard_map(lambda b: C.all_to_all(b[0], "data")[None], mesh=mesh, in_specs=P("data"),
                       out_specs=P("data"))
    with pytest.raises(ValueError, match=r"all_to_all: dimension 0 of shape \(6,\) must be divisible by .* 4"):
        jax.eval_shape(fn, jax.ShapeDtypeStruct((4, 6), jnp.float32))
    with pytest.raises(ValueError, match="unknown all_to_all algorithm 'ring'; choose one of xla, pairwise, bruck"):
        jax.eval_shape(jax.shard_map(lambda b: C.all_to_all(b[0], "data", algorithm="ring")[None], mesh=mesh,
                                     in_specs=P("data"), out_specs=P("data")),
                       jax.ShapeDtypeStruct((4, 8), jnp.float32))
