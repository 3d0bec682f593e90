"""examples/nnx_tp_plain.py (flax's NNX MNIST tutorial, smaller) with the README's
tensor-parallel recipe applied: on a 4x2 mesh (4 data-parallel ranks, each a pair of
devices splitting the two linear layers Megatron's way: `linear1` by columns, `linear2`
by rows), seven changed lines, each saying `dpjax`. `pred_step` stays `nnx.jit`: outside
shard_step the parallel layers are the dense ones, on the trained sharded parameters.

    python examples/nnx_tp_distributed.py      # 8 simulated CPU devices on a laptop
"""

import dpjax; dpjax.simulate_cpu_devices(8)  # noqa: E401,E702  dpjax: 8 CPU devices on a laptop
from functools import partial

import numpy as np
import optax
from flax import nnx

import shapes

DROPOUT = 0.025  # the tutorial's rate (tests set it to 0 to compare losses exactly)


def batches(steps, batch_size=32, seed=0):
    """MNIST-shaped batches, {'image': B x 28 x 28 x 1, 'label': B}: the shapes data, padded."""
    for b in shapes.train_batches(steps, batch_size, seed):
        yield {"image": np.pad(b["image"], ((0, 0), (6, 6), (6, 6), (0, 0))), "label": b["label"]}


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=DROPOUT)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = dpjax.nn.nnx.ColumnParallelLinear(784, 64, rngs=rngs)  # dpjax: split by columns over 'model'
    self.dropout2 = nnx.Dropout(rate=DROPOUT)
    self.linear2 = dpjax.nn.nnx.RowParallelLinear(64, 10, rngs=rngs)  # dpjax: by rows; its bias added once

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x


def loss_fn(model: CNN, rngs: nnx.Rngs, batch):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits


@dpjax.shard_step("4x2", batch_argnums=4, out_specs="mean")  # dpjax: data x model; the batch is argument 4
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
  optimizer.update(model, grads)  # In-place updates.
  return loss


@dpjax.shard_step("4x2", batch_argnums=2)  # dpjax: was @nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, None, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.


@nnx.jit
def pred_step(model: CNN, batch):
  logits = model(batch['image'])
  return logits.argmax(axis=1)


def train(train_steps=6, eval_every=3, learning_rate=0.005, momentum=0.9):
  model = dpjax.nn.nnx.sync_batchnorm(CNN(rngs=nnx.Rngs(0)))  # dpjax: BatchNorm statistics of the global batch
  optimizer = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.adamw(learning_rate, momentum)), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average('loss'))
  rngs = nnx.Rngs(0)
  metrics_history = {'step_loss': [], 'train_loss': [], 'train_accuracy': [], 'test_loss': [], 'test_accuracy': []}
  test_ds = list(batches(2, seed=99))
  for step, batch in enumerate(batches(train_steps)):
    model.train()  # Switch to training mode.
    metrics_history['step_loss'].append(float(train_step(model, optimizer, metrics, rngs, batch)))
    if step > 0 and (step % eval_every == 0 or step == train_steps - 1):
      for metric, value in metrics.compute().items():
        metrics_history[f'train_{metric}'].append(float(value))
      metrics.reset()
      model.eval()  # Switch to evaluation mode.
      for test_batch in test_ds:
        eval_step(model, metrics, test_batch)
      for metric, value in metrics.compute().items():
        metrics_history[f'test_{metric}'].append(float(value))
      metrics.reset()
  return model, metrics_history


if __name__ == "__main__":
  _, history = train()
  print({k: [round(v, 4) for v in vs] for k, vs in history.items()})
