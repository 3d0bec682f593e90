"""The JAX AI Stack's miniGPT tutorial (examples/minigpt_*.py, small), its annotations
unchanged (`NamedSharding(mesh, P(...))` on a ('batch', 'model') mesh): data-parallel on
8x1 in four changed lines, data + tensor parallel on 4x2 in five (the attention split by
heads as annotated: shard_step's automatic model axes), each training as the one-device
run does to float32 round-off; and what shard_step says where it cannot.
"""

import types

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_flax_examples import changed_lines, load

import dpjax
from dpjax.wrap.annotations import LayoutWarning

TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the global batch's sums are added in another order
STEPS = 2


def run(name, sgd=False, **kw):
    mod = load(name)
    if sgd:  # the tutorial's Adam as SGD: parameters whose true gradient is ~0 then stay put
        mod.optax = types.SimpleNamespace(**{**vars(optax), "adam": lambda lr: optax.sgd(100 * lr)})
    return mod.train(STEPS, **kw)


@pytest.fixture(scope="module")
def plain():
    return {257: run("minigpt_plain", vocab=257), 256: run("minigpt_plain", sgd=True, vocab=256)}


def params(model):
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same(run, reference):
    (model, losses), (ref_model, ref_losses) = run, reference
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    got, want = params(model), params(ref_model)
    assert got.keys() == want.keys()
    for name in want:
        if name.endswith("key/bias"):  # softmax ignores it: its true gradient is 0, and Adam steps on round-off
            largest = max(np.abs(got[name]).max(), np.abs(want[name]).max())
            assert largest <= STEPS * 1e-3 * 1.01, name  # Adam moves a parameter at most lr a step
            continue
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)


@pytest.mark.parametrize("name, most", [("minigpt_distributed", 4), ("minigpt_tp_distributed", 5)])
def test_few_lines_change(name, most):
    lines = changed_lines("minigpt_plain", name)
    assert len(lines) <= most, lines
    assert all("dpjax" in line for line in lines), lines


def test_data_parallel_on_8x1_trains_as_one_device(plain):
    assert_same(run("minigpt_distributed"), plain[257])


def test_tensor_parallel_on_4x2_splits_attention_as_annotated_and_trains_as_one_device(plain):
    got = run("minigpt_tp_distributed", sgd=True)
    assert_same(got, plain[256])
    block = got[0].transformer_blocks[0]
    assert block.mha.query.kernel[...].sharding.spec == P(None, "model")  # the heads, split as annotated
    assert block.mha.query.kernel[...].sharding.shard_shape((32, 4, 8)) == (32, 2, 8)
    assert block.layer_norm1.scale[...].sharding.spec == P("model")


def test_an_odd_vocabulary_split_over_model_is_refused_naming_the_pad():
    """The model made on 8x1 (flax itself refuses to make 257 columns split in two), then
    stepped on 4x2: the other mesh said once, and the split that does not divide refused."""
    mod = load("minigpt_distributed")
    model = mod.create_model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.adam(1e-3)), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("batch", "model"))
    step = dpjax.shard_step(mod.train_step.fn, mesh, batch_argnums=3)
    with pytest.warns(LayoutWarning, match=r"made on the mesh \{'batch': 8, 'model': 1\}.* on \{'batch': 4, "):
        with pytest.raises(dpjax.UserError) as e:
            step(model, optimizer, metrics, next(mod.batches(1)))
    assert str(e.value) == ("train_step: model/output_layer/bias (257,) is split over 'model', but its dimension 0 "
                            "(257) does not divide into 2 parts; pad it to 258 (a vocabulary of 258 whose extra id is "
                            "never used), or annotate that dimension None to keep it whole")


def test_flax_gspmd_guide_in_three_lines_trains_as_the_guide():
    """flax's "Scale up on multiple devices" (examples/gspmd_*.py): three changed lines, the
    guide's constraint P('data', 'model') as it is (read inside the step without the data
    axis, dpjax's there); the guide's own GSPMD run on 2x4 is the reference."""
    lines = changed_lines("gspmd_plain", "gspmd_distributed")
    assert len(lines) <= 3 and all("dpjax" in line for line in lines), lines
    (plain, want), (ours, got) = load("gspmd_plain").train(), load("gspmd_distributed").train()
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(np.asarray(ours.w2[...]), np.asarray(plain.w2[...]), **TOL)
    assert ours.dot1.kernel[...].sharding.spec == P(None, "model")
