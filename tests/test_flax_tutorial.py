"""The README's NNX recipe on flax's own MNIST tutorial as flax writes it
(examples/nnx_tutorial_*.py: BatchNorm after biased convolutions, Dropout, `rngs` passed
to the train step, the loss returned): five lines change (the two BatchNorms by one
`dpjax.nn.nnx.sync_batchnorm`, the returned loss by `out_specs="mean"`), and with
dropout off the distributed loop trains like the plain one.

When the equality holds (what the README says): with flax's AdamW, the losses and the
training metrics agree to float32 round-off, the parameters do not: a parameter whose
true gradient is 0 (the convolutions' biases feed BatchNorm, which subtracts their
mean) gets round-off noise as its gradient, and Adam, which divides by the gradient's
own scale, turns that noise into full-size steps, different on 1 and 8 devices (in
eval mode BatchNorm's running mean lags behind those biases, so the test metrics move
too). With an optimizer whose step is proportional to the gradient (SGD with momentum)
everything agrees to round-off: losses, metrics, parameters, test metrics."""

import types

import optax
import jax
import numpy as np
import pytest
from flax import nnx

from test_flax_examples import changed_lines, load

TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the global batch's sums are added in another order


def run(name, sgd=False):
    mod = load(name)
    mod.DROPOUT = 0.0  # the masks of 1 and 8 devices differ by design; compare without them
    if sgd:  # the tutorial's `optax.adamw(learning_rate, momentum)`, read as SGD with that momentum
        mod.optax = types.SimpleNamespace(**{**vars(optax), "adamw": lambda lr, b1: optax.sgd(lr, momentum=b1)})
    return mod.train()


@pytest.fixture(scope="module")
def adamw():
    return [run(name) for name in ("nnx_tutorial_plain", "nnx_tutorial_distributed")]


def flat(model) -> dict:
    return {"/".join(map(str, k)): np.asarray(jax.device_get(v.get_value())) for k, v in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_five_lines_change():
    lines = changed_lines("nnx_tutorial_plain", "nnx_tutorial_distributed")
    assert len(lines) <= 5, lines
    assert all("dpjax" in line for line in lines), lines


def test_with_adamw_the_losses_and_training_metrics_agree(adamw):
    (_, plain), (_, dist) = adamw
    for key in ("step_loss", "train_loss", "train_accuracy"):
        np.testing.assert_allclose(dist[key], plain[key], **TOL, err_msg=key)
    assert plain["test_loss"][-1] < plain["test_loss"][0]  # it learns


def assert_everything_agrees(plain_run, dist_run, a_parameter: str):
    """Two runs' (model, history): every metric of the history and every parameter, the
    named one among them, equal within TOL."""
    (p_model, plain), (d_model, dist) = plain_run, dist_run
    assert plain.keys() == dist.keys() and all(plain.values())
    for key in plain:
        np.testing.assert_allclose(dist[key], plain[key], **TOL, err_msg=key)
    p, d = flat(p_model), flat(d_model)
    assert p.keys() == d.keys() and a_parameter in p
    for name in p:
        np.testing.assert_allclose(d[name], p[name], **TOL, err_msg=name)


def test_with_sgd_everything_agrees():
    assert_everything_agrees(*[run(name, sgd=True) for name in ("nnx_tutorial_plain", "nnx_tutorial_distributed")],
                             "conv1/bias")


def test_with_dropout_it_trains():
    _, hist = load("nnx_tutorial_distributed").train()  # the tutorial's dropout (0.025), one mask per device
    assert np.isfinite(hist["step_loss"]).all() and hist["test_loss"][-1] < hist["test_loss"][0]
