"""DistributedOptimizer with error feedback in a flax NNX loop under dpjax.shard_step
(dpjax.wrap.per_rank): each rank's error buffer gets a slot of its own, and two steps equal a
numpy simulation of the int8 ring hop by hop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.compression import quantise
from dpjax.wrap.replicas import ReplicationError

from test_compression_feedback import _np_ring

N = 8  # shard_step's default mesh: every device on data
D = 2 * quantise.BLOCK + 5  # a ragged tail


class Vector(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(D))


def _loop(compression):
    model = Vector()
    optimizer = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.sgd(1.0), compression=compression),
                              wrt=nnx.Param)

    @dpjax.shard_step(batch_argnums=2)
    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: (x @ m.w).mean())(model)  # one row a device: its gradient is the row
        optimizer.update(model, grads)

    return model, optimizer, train_step


def test_an_nnx_loop_keeps_each_ranks_error_buffer():
    """int8 with feedback, SGD lr 1: after two steps the weights are minus the two ring
    means and the (ranks, D) buffer holds each rank's numpy error, where step 2's input
    is the row plus step 1's error (the feedback carried across calls)."""
    rng = np.random.default_rng(0)
    x1, x2 = (rng.standard_normal((N, D)).astype(np.float32) for _ in range(2))
    x2[3, :40] *= 1e3  # one rank's large values set their blocks' scales
    model, optimizer, train_step = _loop("int8")
    train_step(model, optimizer, x1)
    train_step(model, optimizer, x2)

    mean1, err1 = _np_ring(x1, 8)
    mean2, err2 = _np_ring((x2 + err1).astype(np.float32), 8)
    np.testing.assert_array_equal(np.asarray(model.w[...]), (-mean1) - mean2)
    error = np.asarray(optimizer.opt_state.compression.error["w"][...])
    assert error.shape == (N, D)
    np.testing.assert_array_equal(error, err2)


def test_the_slot_layout_survives_a_change_of_data():
    """The buffers that come back are taken as they are (not spread again) on the next
    call, with another batch size too."""
    model, optimizer, train_step = _loop("int8")
    rng = np.random.default_rng(1)
    for rows in (N, 2 * N, N):
        train_step(model, optimizer, rng.standard_normal((rows, D)).astype(np.float32))
    assert optimizer.opt_state.compression.error["w"][...].shape == (N, D)
    assert train_step.calls == 3


def test_a_state_declared_replicated_names_the_buffer():
    """A pytree state returned under out_specs the user declared replicated: the check's
    line says what the differing copies are and what to do."""
    tx = dpjax.DistributedOptimizer(optax.sgd(1.0), compression="int8")
    w = jnp.zeros(D)

    @dpjax.shard_step(batch_argnums=2, out_specs=(P(), P()))
    def step(w, state, x):
        updates, state = tx.update(x[0], state, w)
        return optax.apply_updates(w, updates), state

    x = np.random.default_rng(2).standard_normal((N, D)).astype(np.float32)
    with pytest.raises(ReplicationError, match="error-feedback buffer, which differs from rank to rank by design"):
        step(w, tx.init(w), x)


def test_a_returned_pytree_state_keeps_its_slots():
    """A Linen-style loop (a plain optax state passed in and returned, default out_specs)
    gives the same two steps as the NNX loop: numpy's ring means and errors."""
    rng = np.random.default_rng(0)
    x1, x2 = (rng.standard_normal((N, D)).astype(np.float32) for _ in range(2))
    tx = dpjax.DistributedOptimizer(optax.sgd(1.0), compression="int8")

    @dpjax.shard_step(batch_argnums=2)
    def step(w, state, x):
        updates, state = tx.update(x[0], state, w)
        return optax.apply_updates(w, updates), state

    w, state = jnp.zeros(D), tx.init(jnp.zeros(D))
    for x in (x1, x2):
        w, state = step(w, state, x)
    mean1, err1 = _np_ring(x1, 8)
    mean2, err2 = _np_ring((x2 + err1).astype(np.float32), 8)
    np.testing.assert_array_equal(np.asarray(w), (-mean1) - mean2)
    np.testing.assert_array_equal(np.asarray(state.compression.error), err2)
