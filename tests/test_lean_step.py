"""What dpjax's step computes beyond a plain-JAX step (experiments/hlo_side_by_side.py found it):
none of it where nothing needs it.

On one device (mesh 1x1) the loss's mean over the data axes and the clipping norm's sum over
the axes that split the parameters reduce over axes of size 1: they average nothing, yet XLA
kept one all-reduce of one participant in the compiled step (a kernel and a sync on a GPU).
With `--allreduce psum`, the default on a GPU, the gradient exchange did the same to every
gradient: packed into one flat buffer, all-reduced over the one device, unpacked (at 405M
about six passes over 1.6 GB, ~2 ms at an H200's 4.8 TB/s). The step on 1x1 now holds no
all-reduce with either exchange, and its result is still the plain step's: the model's own
loss and optax's clip + AdamW on `jax.grad` of it, with no shard_map (the reference). On
a mesh with a data axis of 2 the reductions stay.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.optim import ADAM_B1, ADAM_B2, ADAM_EPS
from dpjax.plan import resolve
from dpjax.settings import Settings

TINY = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64)
B, T = 4, 16


def all_reduces(compiled_text: str) -> int:
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = [^%]*? all-reduce(?:-start)?\(", compiled_text, re.M))


def built(mesh_of, spec: str, count: int, allreduce: str):
    """(plan, the compiled train step, params, state, batch)."""
    # clip 1e-3: far below the gradient's norm, so the clipping norm decides every update
    plan = resolve(Settings(mesh=spec, data="synthetic", seq_len=T, batch_size=B, clip_norm=1e-3, allreduce=allreduce,
                            model_options=TINY), mesh=mesh_of(spec, count))
    step = S.for_plan(plan, donate=False)
    params = S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy)
    params, state = step.init(params)
    tokens = np.random.default_rng(0).integers(0, 256, (1, B, T + 1)).astype(np.int32)
    batch = jax.device_put(tokens, NamedSharding(plan.mesh, P(None, "data")))
    return plan, step.train.lower(params, state, batch).compile(), params, state, batch


@pytest.fixture(scope="module", params=["ring", "psum"])  # dpjax's default exchange on CPU; on a GPU
def one_device(mesh_of, request):
    return built(mesh_of, "1x1", 1, request.param)


def test_one_device_step_holds_no_all_reduce(one_device):
    plan, train, params, state, batch = one_device
    assert all_reduces(train.as_text()) == 0


def test_one_device_step_is_the_plain_step(one_device):
    plan, train, params, state, batch = one_device
    model = plan.model
    new_params, _, loss = train(params, state, batch)
    plain = jax.tree.map(np.asarray, params)
    want_loss, g = jax.value_and_grad(model.loss)(plain, jnp.asarray(batch[0]))
    assert optax.tree.norm(g) > 1e-2  # the clip acts
    opt = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(plan.settings.lr, b1=ADAM_B1, b2=ADAM_B2,
                                                                    eps=ADAM_EPS, weight_decay=0.0))
    updates, _ = opt.update(g, opt.init(plain), plain)
    want = optax.apply_updates(plain, updates)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for got, ref in zip(jax.tree.leaves(new_params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-7)


def test_two_replicas_still_reduce(mesh_of):
    _, train, *_ = built(mesh_of, "2x1", 2, "psum")  # the loss and the gradients (XLA may combine them)
    assert all_reduces(train.as_text()) >= 1
