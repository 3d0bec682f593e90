"""The loop of plain.py, data-parallel over every device with dpjax.

    python examples/distributed.py      # 8 simulated CPU devices on a laptop

The diff against plain.py is the point: `diff examples/plain.py examples/distributed.py`.
"""

import dpjax  # distributed: simulate devices before JAX starts
dpjax.simulate_cpu_devices(8)  # distributed: a no-op for GPUs

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(64)(x)))


def batches(steps, batch_size=64, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 1)).astype(np.float32)
    for _ in range(steps):
        x = rng.standard_normal((batch_size, 8)).astype(np.float32)
        yield x, np.sin(x @ w)


def train(steps=100, seed=0):
    mesh = dpjax.make_mesh(f"{jax.device_count()}x1")  # distributed: the mesh
    model = Net()
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8)))
    tx = dpjax.DistributedOptimizer(optax.adam(1e-2))  # distributed: wrap the optimizer
    opt_state = tx.init(params)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")  # distributed: mean loss

    step = dpjax.shard_step(step, mesh, batch_argnums=(2, 3))  # distributed: shard the step
    params = dpjax.shard_step(dpjax.broadcast_params, mesh)(params)  # distributed: broadcast
    losses = []
    for x, y in batches(steps, seed=seed):
        params, opt_state, loss = step(params, opt_state, *dpjax.shard_batch(mesh, x, y))  # dpjax: shard the batch
        losses.append(float(loss))
    return losses


if __name__ == "__main__":
    losses = train()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
