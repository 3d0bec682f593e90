"""examples/minigpt_plain.py (the JAX AI Stack's miniGPT tutorial, small) data-parallel on
8x1 with dpjax: four changed lines, the model and its annotations unchanged.

    python examples/minigpt_distributed.py      # 8 simulated CPU devices on a laptop
"""

import dpjax; dpjax.simulate_cpu_devices(8)  # noqa: E401,E702  dpjax: 8 CPU devices on a laptop
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_SHAPE = (8, 1)  # dpjax: 8 data-parallel devices
mesh = Mesh(mesh_utils.create_device_mesh(MESH_SHAPE, jax.devices()[:np.prod(MESH_SHAPE)]), ('batch', 'model'))
vocab_size, maxlen, embed_dim, num_heads, feed_forward_dim, num_blocks = 257, 16, 32, 4, 32, 1


def split(*axes):
  return NamedSharding(mesh, P(*axes))


def causal_attention_mask(seq_len):
  return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
  def __init__(self, embed_dim, num_heads, ff_dim, *, rngs: nnx.Rngs, rate: float = 0.1):
    xavier, zeros, ones = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init(), nnx.initializers.ones_init()
    self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                      kernel_init=nnx.with_partitioning(xavier, split(None, 'model')),
                                      bias_init=nnx.with_partitioning(zeros, split('model')), rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=rate)
    self.layer_norm1 = nnx.LayerNorm(embed_dim, epsilon=1e-6, scale_init=nnx.with_partitioning(ones, split('model')),
                                     bias_init=nnx.with_partitioning(zeros, split('model')), rngs=rngs)
    self.linear1 = nnx.Linear(embed_dim, ff_dim, kernel_init=nnx.with_partitioning(xavier, split(None, 'model')),
                              bias_init=nnx.with_partitioning(zeros, split('model')), rngs=rngs)
    self.linear2 = nnx.Linear(ff_dim, embed_dim, kernel_init=nnx.with_partitioning(xavier, split(None, 'model')),
                              bias_init=nnx.with_partitioning(zeros, split('model')), rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=rate)
    self.layer_norm2 = nnx.LayerNorm(embed_dim, epsilon=1e-6, scale_init=nnx.with_partitioning(ones, split('model')),
                                     bias_init=nnx.with_partitioning(zeros, split('model')), rngs=rngs)

  def __call__(self, inputs, training: bool = False):
    mask = causal_attention_mask(inputs.shape[1])
    attention_output = self.dropout1(self.mha(inputs_q=inputs, mask=mask, decode=False), deterministic=not training)
    out1 = self.layer_norm1(inputs + attention_output)
    ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
    return self.layer_norm2(out1 + self.dropout2(ffn_output, deterministic=not training))


class TokenAndPositionEmbedding(nnx.Module):
  def __init__(self, maxlen, vocab_size, embed_dim, *, rngs: nnx.Rngs):
    self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
    self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

  def __call__(self, x):
    return self.token_emb(x) + self.pos_emb(jnp.arange(x.shape[1])[None, :])


class MiniGPT(nnx.Module):
  def __init__(self, maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_blocks, rngs: nnx.Rngs):
    self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
    self.transformer_blocks = nnx.List([TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                                        for _ in range(num_blocks)])
    xavier, zeros = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init()
    self.output_layer = nnx.Linear(embed_dim, vocab_size,
                                   kernel_init=nnx.with_partitioning(xavier, split(None, 'model')),
                                   bias_init=nnx.with_partitioning(zeros, split('model')), rngs=rngs)

  def __call__(self, inputs, training: bool = False):
    x = self.embedding_layer(inputs)
    for block in self.transformer_blocks:
      x = block(x, training=training)
    return self.output_layer(x)


def create_model(rngs, vocab=vocab_size):
  return MiniGPT(maxlen, vocab, embed_dim, num_heads, feed_forward_dim, num_blocks, rngs=rngs)


def loss_fn(model, batch):
  logits = model(batch[0])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
  return loss, logits


@dpjax.shard_step(mesh, batch_argnums=3)  # dpjax: was @nnx.jit
def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch)
  metrics.update(loss=loss, logits=logits, lables=batch[1])
  optimizer.update(model, grads)


def batches(steps, batch_size=16, seed=0, vocab=vocab_size):
  """Random token rows, the tutorial's (inputs, targets): targets are the inputs shifted by one, 0-padded."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    tokens = jnp.asarray(rng.integers(0, vocab, (batch_size, maxlen)), jnp.int32)
    yield tokens, jnp.concatenate([tokens[:, 1:], jnp.zeros((batch_size, 1), jnp.int32)], axis=1)


def train(steps=3, vocab=vocab_size):
  model = create_model(nnx.Rngs(0), vocab)
  optimizer = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.adam(1e-3)), wrt=nnx.Param)  # dpjax
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average('loss'))
  history = []
  for input_batch, target_batch in batches(steps, vocab=vocab):
    train_step(model, optimizer, metrics, jax.device_put((input_batch, target_batch), split('batch', None)))
    history.append(float(metrics.compute()['loss']))
    metrics.reset()
  return model, history


if __name__ == "__main__":
  print(train()[1])
