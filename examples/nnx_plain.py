"""An NNX image classifier trained the way flax's MNIST tutorial trains one, on one device.

    python examples/nnx_plain.py

Compare with nnx_distributed.py, the same loop data-parallel over every device:
`diff examples/nnx_plain.py examples/nnx_distributed.py`.
"""

from functools import partial

import optax
from flax import nnx

from shapes import CLASSES, test_batches, train_batches


class CNN(nnx.Module):
    """Two convolutions (the first with BatchNorm), dropout, two dense layers."""

    def __init__(self, *, rngs: nnx.Rngs, dropout: float = 0.1):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)  # BatchNorm adds the bias
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.dropout = nnx.Dropout(rate=dropout, rngs=rngs)
        self.linear1 = nnx.Linear(32 * 4 * 4, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.bn1(self.conv1(x))))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.linear1(x)))
        return self.linear2(x)


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def train(steps=30, eval_every=10, dropout=0.1, seed=0, learning_rate=0.005, momentum=0.9):
    model = CNN(rngs=nnx.Rngs(seed), dropout=dropout)
    optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, momentum), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    for step, batch in enumerate(train_batches(steps, seed=seed)):
        model.train()  # dropout on, BatchNorm on batch statistics
        train_step(model, optimizer, metrics, batch)
        if (step + 1) % eval_every == 0:
            for metric, value in metrics.compute().items():
                history[f"train_{metric}"].append(float(value))
            metrics.reset()
            model.eval()
            for test_batch in test_batches(seed=seed):
                eval_step(model, metrics, test_batch)
            for metric, value in metrics.compute().items():
                history[f"test_{metric}"].append(float(value))
            metrics.reset()
    return model, history


if __name__ == "__main__":
    _, history = train()
    for i, (loss, acc) in enumerate(zip(history["test_loss"], history["test_accuracy"])):
        print(f"eval {i}: test loss {loss:.4f}, test accuracy {acc:.3f}")
