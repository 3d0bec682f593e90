"""Compression methods (dpjax.compression): each registered method against numpy's own
cast, what the grouped allreduce puts on the wire, and the registry's views.
(The numbers of a compressed gradient average: tests/test_data_parallel.py.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax.horovod as hvd
from dpjax import collectives as C
from dpjax import compression
from dpjax.compression import COMPRESSIONS
from dpjax.data_parallel import allreduce_gradients

# What each method must do to a float32 array, independently of dpjax: numpy's cast.
# A method registered without a reference here fails test_every_method_has_a_reference.
NUMPY_CAST = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
MLIR = {np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.float16): "f16", np.dtype(np.float32): "f32",
        np.dtype(np.int32): "i32"}
N = 4
# The methods with error feedback run their own exchange; their references (numpy's ring,
# the byte formulas, nothing lost) are in tests/test_compression_feedback.py.
CASTS = [n for n in compression.names() if not compression.registry.get(n).stateful]


def test_every_method_has_a_reference():
    assert set(CASTS) == set(NUMPY_CAST)


@pytest.mark.parametrize("name", CASTS)
def test_round_trip_is_numpys_cast(name):
    method = compression.check(name)
    rng = np.random.default_rng(0)
    # normal numbers, ties, tiny and huge values (fp16 overflows to inf past 65504, as numpy's does)
    x = np.concatenate([rng.standard_normal(500), [1 + 2**-8, 1 + 3 * 2**-8, 1e-30, 7e4, -0.0]]).astype(np.float32)
    wire = method.encode(jnp.asarray(x))
    assert wire.dtype == method.wire_dtype == np.dtype(NUMPY_CAST[name])
    with np.errstate(over="ignore"):
        want = x.astype(NUMPY_CAST[name])
    np.testing.assert_array_equal(np.asarray(wire), want)
    back = method.decode(wire, jnp.asarray(x))
    assert back.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(back), want.astype(np.float32))
    assert not np.array_equal(np.asarray(back), x)  # it really rounds
    # integers travel as they are
    i = jnp.arange(-5, 5, dtype=jnp.int32)
    assert not method.compresses(i.dtype) and method.encode(i) is i


def _lowered(mesh, name):
    """StableHLO of a grouped allreduce of a float32 and an int32 tensor with `name` on
    the wire: the program dpjax emits, before XLA's CPU backend widens a bfloat16
    collective to float32 (its compiled programs send 4 bytes per bfloat16 element)."""

    def body(w, s):
        assert w.shape == (10,) and s.shape == (3,), (w.shape, s.shape)
        wire = compression.summable(name)  # the collectives take a resolved method, never a name
        return tuple(C.grouped_allreduce([w, s], "data", op="mean", compression=wire, algorithm="ring"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    specs = [jax.ShapeDtypeStruct((N * k,), d, sharding=NamedSharding(mesh, P("data")))
             for k, d in ((10, jnp.float32), (3, jnp.int32))]
    return f.lower(*specs)


@pytest.mark.parametrize("name", CASTS)
def test_grouped_allreduce_sends_the_wire_dtype(mesh_of, name):
    mesh = mesh_of(f"data={N}", N)
    lowered = _lowered(mesh, name)
    sent = re.findall(r'"stablehlo.collective_permute".*: \(tensor<\d+x(\w+)>\)', lowered.as_text())
    wire = MLIR[np.dtype(compression.check(name).wire_dtype)]
    # one float bucket and one int32 bucket, each 2(N-1) ring steps
    assert sorted(sent) == sorted([wire] * 2 * (N - 1) + ["i32"] * 2 * (N - 1)), sent
    if np.dtype(compression.check(name).wire_dtype) == np.float16:  # a dtype the CPU backend keeps
        compiled = re.findall(r"= (\w+)\[\d+\]\{0\} collective-permute\(", lowered.compile().as_text())
        assert sorted(compiled) == sorted(["f16"] * 2 * (N - 1) + ["s32"] * 2 * (N - 1)), compiled


def _sign(name="toy-sign"):
    """A toy method that is not linear: the sum of signs is not the sign of the sum."""
    return compression.Method(name, encode=lambda x: jnp.sign(x).astype(jnp.int8),
                              decode=lambda w, like: w.astype(like.dtype),
                              compresses=lambda d: jnp.issubdtype(d, jnp.floating), wire_dtype=jnp.dtype(jnp.int8),
                              linear=False)


def test_registered_methods_are_seen_everywhere_and_a_nonlinear_one_is_refused(mesh_of):
    mesh = mesh_of(f"data={N}", N)
    with compression.registered(_sign()) as sign:
        assert COMPRESSIONS["toy-sign"] is sign and "toy-sign" in compression.COMPRESSIONS
        assert getattr(hvd.Compression, "toy-sign") == "toy-sign"

        def body(g):
            assert g.shape == (2,), g.shape
            return allreduce_gradients({"w": g}, "data", compression="toy-sign")["w"]

        f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        with pytest.raises(ValueError, match="compression 'toy-sign' is not linear"):
            jax.jit(f).lower(jax.ShapeDtypeStruct((N * 2,), jnp.float32, sharding=NamedSharding(mesh, P("data"))))
    assert "toy-sign" not in COMPRESSIONS and list(COMPRESSIONS) == [None, "none", *compression.names()]
    *known, last = compression.names()
    with pytest.raises(ValueError, match=f"unknown compression 'toy-sign'; choose none, {', '.join(known)} or {last}"):
        compression.check("toy-sign")
    with pytest.raises(AttributeError):
        getattr(hvd.Compression, "toy-sign")
