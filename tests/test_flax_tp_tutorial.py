"""The README's NNX tensor-parallel recipe on flax's MNIST tutorial (examples/nnx_tp_*.py):
at most eight lines change (seven), and on 4x2 (data x model) with dropout off the
distributed loop trains like the plain one on one device; its `pred_step`, left a plain
`nnx.jit`, predicts from the trained sharded parameters what the plain model predicts.

What agrees, and why to float32 round-off (TOL as in test_flax_tutorial.py): the global
batch's sums are added in another order (4 data ranks), and so are linear2's partial
products (2 model ranks); nothing else differs. With SGD everything agrees, parameters
and test metrics included. With flax's AdamW the losses and the training metrics do, the
parameters do not, for the reason test_flax_tutorial.py gives (the convolution biases
that feed BatchNorm have a true gradient of 0; Adam turns the round-off into steps).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from test_flax_examples import changed_lines, load
from test_flax_tutorial import TOL, assert_everything_agrees, run

PAIR = ("nnx_tp_plain", "nnx_tp_distributed")


def test_at_most_eight_lines_change():
    lines = changed_lines(*PAIR)
    assert len(lines) <= 8, lines
    assert all("dpjax" in line for line in lines), lines


def predictions(model, name):
    """The example's own pred_step (a plain nnx.jit) on two test batches, and the logits
    under a plain nnx.jit (SGD's few steps predict one class for most images: the
    logits are the sharper comparison)."""
    mod = load(name)
    model.eval()
    test = list(mod.batches(2, seed=7))
    logits = nnx.jit(lambda model, image: model(image))
    return (np.concatenate([np.asarray(mod.pred_step(model, b)) for b in test]),
            np.concatenate([np.asarray(logits(model, b["image"])) for b in test]))


@pytest.fixture(scope="module")
def sgd():
    return [run(name, sgd=True) for name in PAIR]


def test_with_sgd_everything_agrees(sgd):
    (p_model, plain), (d_model, dist) = sgd
    assert_everything_agrees(*sgd, "linear2/bias")
    assert d_model.linear1.kernel[...].sharding.spec == jax.P(None, "model")  # it trained split
    assert tuple(d_model.linear2.kernel[...].sharding.spec) in (("model",), ("model", None))
    assert plain["step_loss"][-1] < plain["step_loss"][0]


def test_pred_step_under_nnx_jit_predicts_as_the_plain_model(sgd):
    (p_model, _), (d_model, _) = sgd
    (got, got_logits), (want, want_logits) = predictions(d_model, PAIR[1]), predictions(p_model, PAIR[0])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_logits, want_logits, **TOL)


def test_with_adamw_the_losses_and_training_metrics_agree():
    (_, plain), (_, dist) = [run(name) for name in PAIR]
    for key in ("step_loss", "train_loss", "train_accuracy"):
        np.testing.assert_allclose(dist[key], plain[key], **TOL, err_msg=key)
