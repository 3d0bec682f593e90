"""A Linen image classifier trained the way flax's Linen MNIST example trains one: a
TrainState, one jitted function for the gradients and another for the update.

    python examples/linen_plain.py

Compare with linen_distributed.py, the same loop data-parallel over every device:
`diff examples/linen_plain.py examples/linen_distributed.py`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

from shapes import CLASSES, SIZE, test_batches, train_batches


class CNN(nn.Module):
    """Two convolutions (the first with BatchNorm), dropout, two dense layers."""

    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(16, (3, 3), use_bias=False)(x)  # BatchNorm adds the bias
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(nn.Dense(64)(x)))
        return nn.Dense(CLASSES)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any


@jax.jit
def apply_model(state, images, labels, dropout_key):
    """Gradients, new batch statistics, loss and accuracy for one batch."""

    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, images, train=True,
                                         rngs={"dropout": dropout_key}, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, (logits, updates["batch_stats"])

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (logits, batch_stats)), grads = grad_fn(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, batch_stats, loss, accuracy


@jax.jit
def update_model(state, grads, batch_stats):
    return state.apply_gradients(grads=grads, batch_stats=batch_stats)


@jax.jit
def eval_model(state, images, labels):
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, images, train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def create_train_state(rng, learning_rate, momentum, dropout):
    cnn = CNN(dropout)
    variables = cnn.init(rng, jnp.ones([1, SIZE, SIZE, 1]), train=False)
    return TrainState.create(apply_fn=cnn.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                             tx=optax.sgd(learning_rate, momentum))


def train(steps=30, eval_every=10, dropout=0.1, seed=0, learning_rate=0.05, momentum=0.9):
    rng, init_rng = jax.random.split(jax.random.key(seed))
    state = create_train_state(init_rng, learning_rate, momentum, dropout)
    history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    for step, batch in enumerate(train_batches(steps, seed=seed)):
        rng, dropout_key = jax.random.split(rng)
        grads, batch_stats, loss, accuracy = apply_model(state, batch["image"], batch["label"], dropout_key)
        state = update_model(state, grads, batch_stats)
        history["train_loss"].append(float(loss))
        history["train_accuracy"].append(float(accuracy))
        if (step + 1) % eval_every == 0:
            results = [eval_model(state, b["image"], b["label"]) for b in test_batches(seed=seed)]
            history["test_loss"].append(float(jnp.mean(jnp.array([r[0] for r in results]))))
            history["test_accuracy"].append(float(jnp.mean(jnp.array([r[1] for r in results]))))
    return state, history


if __name__ == "__main__":
    _, history = train()
    for i, (loss, acc) in enumerate(zip(history["test_loss"], history["test_accuracy"])):
        print(f"eval {i}: test loss {loss:.4f}, test accuracy {acc:.3f}")
