"""An elastic restart's plan (`Plan.for_devices`) on fewer devices rebuilds the exchange
for the new mesh: the per-shard form of a compressed exchange between sites cuts each
tensor into as many shards as a site has devices, and its error buffers are shaped so,
so a site that lost devices must cut into fewer. The restarted plan steps as a plan made
fresh for that device count does, loss for loss."""

from __future__ import annotations

import jax
import numpy as np

from dpjax import step as S
from dpjax.data import make_streams
from dpjax.plan import fit_devices, resolve
from dpjax.settings import Settings

# two sites of two devices (data outermost: a restart on 4 devices keeps one data rank a site)
SITES = Settings(mesh="data=2,node=2,model=2", batch_size=8, compression="int8", compress_axes="node",
                 data="synthetic", model="gpt", model_options={"d_model": 32, "n_layers": 1, "n_heads": 2},
                 seq_len=16, optimizer="sgd", lr=0.5)


def _losses(plan, steps=3):
    train, _ = make_streams("synthetic", plan.settings.seq_len, 0)
    step = S.for_plan(plan)
    params, opt_state = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    losses, cursor = [], 0
    for _ in range(steps):
        batch = S.put_batch(train, cursor, plan.global_batch, plan.mesh, passes=plan.passes)
        cursor += plan.global_batch * plan.passes
        params, opt_state, loss = step.train(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses)


def test_a_restart_on_fewer_devices_cuts_the_per_shard_exchange_for_its_sites():
    eight = resolve(SITES, jax.devices())
    assert eight.exchange.shards is not None and eight.exchange.shards.size == 2  # 2 devices a site
    four = eight.for_devices(jax.devices()[:4])
    fresh = resolve(fit_devices(SITES, 4), jax.devices()[:4])
    assert dict(four.mesh.shape) == {"data": 1, "node": 2, "model": 2}
    assert four.exchange == fresh.exchange  # one device a site: nothing to cut (no per-shard form)
    np.testing.assert_array_equal(_losses(four), _losses(fresh))
