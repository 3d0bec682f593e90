"""examples/gspmd_plain.py (flax's guide "Scale up on multiple devices", small) with dpjax:
the data axis dpjax's (each device its rows, the gradients averaged by
DistributedOptimizer), the model axis GSPMD's as the guide annotates it and constrains it
(the guide's P('data', 'model') read inside the step as P(None, 'model')); three changed lines.

    python examples/gspmd_distributed.py
"""

import os
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')  # 8 CPU devices, as the guide

import dpjax; dpjax.cpu_guards()  # noqa: E702  dpjax: guards XLA:CPU's collectives for the 8 simulated devices
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

auto_mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto))


class DotReluDot(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(depth, depth, kernel_init=nnx.with_partitioning(init_fn, (None, 'model')),
                           use_bias=False, rngs=rngs)
    self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=('model', None))

  def __call__(self, x: jax.Array):
    y = self.dot1(x)
    y = jax.nn.relu(y)
    y = jax.lax.with_sharding_constraint(y, P('data', 'model'))
    z = jnp.dot(y, self.w2[...])
    return z


@dpjax.shard_step(auto_mesh, batch_argnums=(2, 3), out_specs="mean")  # dpjax: was @nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(model: DotReluDot):
    y_pred = model(x)
    return jnp.mean((y_pred - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def train(steps=3, depth=64):
  with jax.set_mesh(auto_mesh):
    sharded_model = DotReluDot(depth, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(sharded_model, dpjax.DistributedOptimizer(optax.adam(1e-3)), wrt=nnx.Param)  # dpjax
  data_sharding = NamedSharding(auto_mesh, P('data', None))
  input = jax.device_put(np.asarray(jax.random.normal(jax.random.key(1), (8, depth))), data_sharding)
  label = jax.device_put(np.asarray(jax.random.normal(jax.random.key(2), (8, depth))), data_sharding)
  losses = []
  with jax.set_mesh(auto_mesh):
    for _ in range(steps):
      losses.append(float(train_step(sharded_model, optimizer, input, label)))
  return sharded_model, losses


if __name__ == "__main__":
  print(train()[1])
