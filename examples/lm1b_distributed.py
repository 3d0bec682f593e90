"""flax's lm1b example (examples/lm1b_plain.py) data-parallel on 8 devices: dpjax's lines are
marked `dpjax` (the import, the sums over the global batch, the optimizer wrapped, `jax.jit`
-> `dpjax.jit` with the same arguments) beside the config line that sets the mesh's size.

    python examples/lm1b_distributed.py
"""


import dpjax; dpjax.simulate_cpu_devices(8)  # noqa: E401,E702  dpjax: 8 CPU devices on a laptop
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import common_utils, train_state
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lm1b_models as models

config = types.SimpleNamespace(
    vocab_size=64, batch_size=16, per_device_batch_size=2, max_target_length=16, num_layers=2, qkv_dim=32, emb_dim=32,
    mlp_dim=64, num_heads=8, dropout_rate=0.1, attention_dropout_rate=0.1, learning_rate=0.01, warmup_steps=5,
    weight_decay=0.1, label_smoothing=0.0, seed=0, logits_via_embedding=False,
    mesh_axes=['data', 'fsdp', 'tensor'], data_sharding=['data'],
    logical_axis_rules=[['mlp', 'tensor'], ['vocab', 'tensor'], ['embed', 'fsdp'], ['heads', 'tensor']])
config.ici_data_parallelism = 8  # 8 data-parallel devices
config.ici_fsdp_parallelism = 1
config.ici_tensor_parallelism = 1


def create_device_mesh(config):
  sizes = [config.ici_data_parallelism, config.ici_fsdp_parallelism, config.ici_tensor_parallelism]
  devices = jax.devices()
  if -1 in sizes:  # one axis takes the devices the others leave
    sizes[sizes.index(-1)] = len(devices) // -int(np.prod(sizes))
  return mesh_utils.create_device_mesh(sizes, devices[:int(np.prod(sizes))])


def rsqrt_schedule(init_value: float, shift: int = 0):
  def schedule(count):
    return init_value * (count + shift) ** -0.5 * shift**0.5
  return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
  return optax.join_schedules(
      [optax.linear_schedule(init_value=0, end_value=learning_rate, transition_steps=warmup_steps),
       rsqrt_schedule(init_value=learning_rate, shift=warmup_steps)], boundaries=[warmup_steps])


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(confidence * jnp.log(confidence)
                           + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
  soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
  loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
  loss = loss - normalizing_constant
  normalizing_factor = np.prod(targets.shape)
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()
  return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
  loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
  normalizing_factor = np.prod(logits.shape[:-1])
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()
  return loss.sum(), normalizing_factor


compute_weighted_cross_entropy, compute_weighted_accuracy = map(dpjax.global_sum, (compute_weighted_cross_entropy, compute_weighted_accuracy))  # dpjax: their sums the global batch's  # noqa: E501


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
  loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
  acc, _ = compute_weighted_accuracy(logits, labels, weights)
  metrics = {"loss": loss, "accuracy": acc, "denominator": weight_sum}
  return metrics


def train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
  inputs = batch["inputs"]
  weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = models.TransformerLM(config).apply({"params": params}, inputs, rngs={"dropout": dropout_rng})
    loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
    mean_loss = loss / weight_sum
    return mean_loss, logits

  lr = learning_rate_fn(state.step)
  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  metrics = compute_metrics(logits, inputs, weights)
  metrics["learning_rate"] = lr
  return new_state, metrics


def init_train_state(model, tx, config, key):
  variables = jax.jit(model.init)(key, jnp.ones((config.per_device_batch_size, config.max_target_length), jnp.float32))
  return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)


def setup_initial_state(model, tx, config, rng, mesh):
  init = lambda key: init_train_state(model, tx, config, key)  # noqa: E731
  logical = nn.get_partition_spec(jax.eval_shape(init, rng))
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    state_mesh_annotations = nn.logical_to_mesh_sharding(logical, mesh, config.logical_axis_rules)
    state = jax.jit(init, in_shardings=None, out_shardings=state_mesh_annotations)(rng)
  return nn.meta.unbox(state), state_mesh_annotations


def batches(config, seed=1):
  """Random token rows, each of a random length, padded with 0 (lm1b's padding id)."""
  rng = np.random.default_rng(seed)
  while True:
    inputs = rng.integers(1, config.vocab_size, (config.batch_size, config.max_target_length))
    lengths = rng.integers(2, config.max_target_length + 1, config.batch_size)
    yield {"inputs": np.where(np.arange(config.max_target_length) < lengths[:, None], inputs, 0).astype(np.int32)}


def train(steps=20):
  """Returns the final state and each step's metrics (loss and accuracy per real token)."""
  train_config = models.TransformerConfig(
      vocab_size=config.vocab_size, output_vocab_size=config.vocab_size,
      logits_via_embedding=config.logits_via_embedding, dtype=jnp.float32, emb_dim=config.emb_dim,
      num_heads=config.num_heads, num_layers=config.num_layers, qkv_dim=config.qkv_dim, mlp_dim=config.mlp_dim,
      max_len=config.max_target_length, dropout_rate=config.dropout_rate,
      attention_dropout_rate=config.attention_dropout_rate, deterministic=False, decode=False,
      kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))
  eval_config = train_config.replace(deterministic=True)
  mesh = Mesh(create_device_mesh(config), config.mesh_axes)
  rng = jax.random.PRNGKey(config.seed)
  rng, init_rng = jax.random.split(rng)
  m = models.TransformerLM(eval_config)
  learning_rate_fn = create_learning_rate_schedule(learning_rate=config.learning_rate,
                                                   warmup_steps=config.warmup_steps)
  optimizer = dpjax.DistributedOptimizer(optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=config.weight_decay))  # dpjax  # noqa: E501
  state, state_mesh_annotations = setup_initial_state(m, optimizer, config, init_rng, mesh)
  data_sharding = NamedSharding(mesh, P(config.data_sharding))
  jit_train_step = dpjax.jit(train_step, in_shardings=(state_mesh_annotations, data_sharding, None), out_shardings=(state_mesh_annotations, None), static_argnums=(2, 3, 4), donate_argnums=0)  # noqa: E501
  dropout_rngs = rng
  history, data = [], batches(config)
  for _ in range(steps):
    batch = jax.tree_util.tree_map(lambda x: jnp.array(x), next(data))
    state, metrics = jit_train_step(state, batch, train_config, learning_rate_fn, 0.0, dropout_rngs)
    history.append({k: float(metrics[k] / metrics["denominator"]) for k in ("loss", "accuracy")})
  return state, history


if __name__ == "__main__":
  for step, summary in enumerate(train()[1], 1):
    print(step, summary)
