"""`--task sft`: the loss is the mean cross-entropy over the answer tokens of the whole
global batch, on every mesh and with micro-batches; checked against numpy's masked
cross-entropy of the unsharded model's logits."""

import jax
import numpy as np
import pytest

from dpjax import step as S
from dpjax.data.sft import ExampleStream
from dpjax.mesh import mesh_size
from dpjax.plan import resolve
from dpjax.train import parse_args

SEQ, B, V = 16, 8, 64
MODEL = ["--model", "llama", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
         "--d-ff", "64", "--vocab-size", str(V), "--seq-len", str(SEQ), "--data", "synthetic", "--optimizer",
         "sgd", "--lr", "0.5", "--clip-norm", "0", "--task", "sft", "--batch-size", str(B)]


def examples(n=40, seed=0):
    """Examples of different lengths, a prompt then an answer (the mask), some short."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(4, SEQ + 2))
        prompt = int(rng.integers(1, length - 1))
        ids = rng.integers(1, V, length)
        out.append((ids, np.arange(length) >= prompt))
    return out


def reference_loss(model, params, batch_rows):
    """numpy: sum of -log p(answer target) / number of answer targets, over all rows."""
    tokens = np.concatenate([r["tokens"] for r in batch_rows])
    counts = np.concatenate([r["weights"] for r in batch_rows]) > 0
    logits = np.asarray(model.apply(params, tokens[:, :-1]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return float(nll[counts].sum() / counts.sum())


def losses(mesh, *extra, steps=3):
    settings = parse_args([*MODEL, "--mesh", mesh, *extra])
    plan = resolve(settings, jax.devices()[:mesh_size(mesh)])
    step = S.for_plan(plan)
    passes = settings.backward_passes
    stream = ExampleStream(examples(), SEQ, seed=0, window=B * passes)
    params = S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy)
    params, opt = step.init(params)
    first_params = plan.layout.unstore(jax.device_get(params))
    out, cursor = [], 0
    for _ in range(steps):
        batch = S.put_batch(stream, cursor, B, plan.mesh, passes=passes)
        params, opt, loss = step.train(params, opt, batch)
        out.append(float(loss))
        cursor += B * passes
    rows = [stream.batch(k * B, B) for k in range(passes)]
    return out, reference_loss(plan.model, first_params, rows)


@pytest.fixture(scope="module")
def one_device():
    return losses("1x1")


@pytest.mark.parametrize("mesh,extra", [("8x1", ()), ("2x4", ()), ("data=4,model=2", ("--fsdp",)),
                                         ("4x2", ("--backward-passes", "2"))])
def test_sft_loss_is_the_answer_mean_on_every_mesh(one_device, mesh, extra):
    got, reference = losses(mesh, *extra)
    assert abs(got[0] - reference) <= 1e-5 * reference  # the first step's loss, at the initial parameters
    if not extra or extra == ("--fsdp",):  # the same batches: the same steps as on one device
        np.testing.assert_allclose(got, one_device[0], rtol=1e-5)


def test_the_weights_count_only_answers_and_normalise_over_the_step():
    stream = ExampleStream(examples(), SEQ, seed=0, window=B)
    full = stream.batch(0, B)
    halves = [stream.batch(0, B, rows=slice(0, B // 2)), stream.batch(0, B, rows=slice(B // 2, B))]
    np.testing.assert_array_equal(np.concatenate([h["weights"] for h in halves]), full["weights"])
    w = full["weights"]
    assert np.isclose(w.sum(), B * SEQ)  # mean over slots of w = 1: the loss is a mean over answers
    assert set(np.unique(w)) <= {0.0, np.float32(B * SEQ / (w > 0).sum())}


def test_sft_on_a_stage_axis_is_refused_in_one_line():
    from dpjax.errors import UserError

    with pytest.raises(UserError, match="--task sft on a stage axis"):
        resolve(parse_args([*MODEL, "--mesh", "stage=2,data=4", "--n-layers", "2"]), jax.devices()[:8])
