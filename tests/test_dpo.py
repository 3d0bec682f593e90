"""DPO (`dpjax.tasks.dpo`, `dpjax.data.pref`): the variants' arithmetic against numpy; the
per-sequence answer log-prob sums and the losses against transformers' own models
(tests/fixtures/dpo_tiny, made by make_dpo_fixture.py); with the policy as its own reference the
loss is ln 2 for every beta (the reference precomputed on a 2x4 mesh, vocabulary split over 4
ranks, the policy dense); bad input is one line with nothing written. The runs of the command
line (first steps against the fixture, meshes agreeing, DPO learning) are in test_dpo_cli.py."""

import json
import math
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.compute.policy import Policy
from dpjax.data import DataError, chat, pref
from dpjax.hf.load import load_params, model_from_hf
from dpjax.sharding import make_layout
from dpjax.tasks import dpo
from dpjax.train import main
from dpjax.train.preference import reference_logps

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "dpo_tiny")
POLICY, REFERENCE = os.path.join(FIXTURE, "policy"), os.path.join(FIXTURE, "reference")
PAIRS = os.path.join(FIXTURE, "pairs.jsonl")
EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))
SEQ = 48


def numpy_losses(pi, ref, n, variant, beta, gamma):
    """The variants as their papers (and TRL) write them, in float64."""
    log_sig = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    h = (pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])
    if variant == "sigmoid":
        return -log_sig(beta * h)
    if variant == "hinge":
        return np.maximum(0.0, 1 - beta * h)
    if variant == "ipo":
        return ((pi[:, 0] - ref[:, 0]) / n[:, 0] - (pi[:, 1] - ref[:, 1]) / n[:, 1] - 1 / (2 * beta)) ** 2
    assert variant == "simpo"
    return -log_sig(beta * (pi[:, 0] / n[:, 0] - pi[:, 1] / n[:, 1]) - gamma)


@pytest.mark.parametrize("variant", list(dpo.VARIANTS))
def test_variants_against_numpy(variant):
    rng = np.random.default_rng(0)
    pi, ref = -rng.uniform(5, 60, (16, 2)), -rng.uniform(5, 60, (16, 2))
    n = rng.integers(1, 30, (16, 2)).astype(np.float64)
    for beta, gamma in ((0.1, 0.5), (2.0, 1.0)):
        got, figures = dpo.pair_losses(jnp.asarray(pi, jnp.float32), jnp.asarray(ref, jnp.float32),
                                       jnp.asarray(n, jnp.float32), dpo.Options(variant, beta, gamma))
        np.testing.assert_allclose(got, numpy_losses(pi, ref, n, variant, beta, gamma), rtol=2e-5, atol=1e-6)
        reward = beta * pi / n if variant == "simpo" else beta * (pi - ref)
        np.testing.assert_allclose(figures["margin"], reward[:, 0] - reward[:, 1], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(figures["accuracy"], (reward[:, 0] > reward[:, 1]).astype(np.float32))


@pytest.fixture(scope="module")
def tiny():
    """The fixture's pairs as dpjax reads them, their batch, and the two models (dense)."""
    model, _ = model_from_hf(POLICY, seq_len=SEQ)
    pairs, counts = pref.load(PAIRS, chat.ChatFormat(POLICY), SEQ)
    stream = pref.PairStream(pairs, SEQ)
    layout = make_layout(model, jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")))
    params = {name: load_params(path, model, layout) for name, path in (("policy", POLICY), ("reference", REFERENCE))}
    logps = jax.jit(lambda p, b: dpo.pair_logps(model, p, b))
    return SimpleNamespace(model=model, pairs=pairs, stream=stream, params=params, logps=logps)


def test_rendering_is_transformers(tiny):
    """Each side's ids and answer mask as transformers' template and offsets give them."""
    assert len(tiny.pairs) == len(EXPECTED["pairs"])
    for got, want in zip(tiny.pairs, EXPECTED["pairs"]):
        for side, ex in (("chosen", got.chosen), ("rejected", got.rejected)):
            assert ex.tokens.tolist() == want[side]["ids"]
            assert ex.loss_mask.tolist() == want[side]["mask"]


def test_logps_and_losses_against_transformers(tiny):
    """The per-sequence answer log-prob sums of both models equal transformers' (float64) within
    1e-5 relative, and so do the variants' losses computed from dpjax's sums."""
    batch = tiny.stream.ordered(0, len(tiny.pairs))
    got = {k: tiny.logps(p, batch) for k, p in tiny.params.items()}
    for name in ("policy", "reference"):
        want = np.array([[p["chosen"][name], p["rejected"][name]] for p in EXPECTED["pairs"]])
        np.testing.assert_allclose(np.asarray(got[name][0]), want, rtol=1e-5)
    n = np.array([[p["chosen"]["answer_tokens"], p["rejected"]["answer_tokens"]] for p in EXPECTED["pairs"]])
    np.testing.assert_array_equal(np.asarray(got["policy"][1]), n)
    for beta, losses in EXPECTED["losses"].items():
        for variant, want in losses.items():
            options = dpo.Options(variant, float(beta), EXPECTED["gamma"])
            loss = dpo.pair_losses(got["policy"][0], got["reference"][0], got["policy"][1], options)[0].mean()
            assert float(loss) == pytest.approx(want, rel=1e-5), (variant, beta)


def test_policy_as_reference_is_ln2(tiny, mesh_of):
    """The reference precomputed on a 2x4 mesh (the vocabulary over 4 model ranks, as a run's
    --ref-logps precompute does), the policy's sums dense: the first loss is ln 2 within 1e-6 for
    every beta, and no pair counts as won."""
    layout = make_layout(tiny.model, mesh_of("2x4", 8))
    plan = SimpleNamespace(layout=layout, model=tiny.model, policy=Policy(), mesh=layout.mesh)
    sharded = load_params(POLICY, tiny.model, layout)
    ref = reference_logps(plan, sharded, tiny.stream, batch_size=2)
    batch = tiny.stream.ordered(0, len(tiny.pairs))
    pi, n = tiny.logps(tiny.params["policy"], batch)
    np.testing.assert_allclose(np.asarray(pi), ref, rtol=1e-6)
    for beta in (0.01, 0.1, 0.5, 1.0, 2.0):
        loss, figures = dpo.pair_losses(pi, jnp.asarray(ref), n, dpo.Options("sigmoid", beta))
        assert abs(float(loss.mean()) - math.log(2)) < 1e-6, beta
        assert abs(float(figures["margin"].mean())) < 1e-5


def test_bad_rows_are_named(tmp_path, tiny):
    fmt = chat.ChatFormat(POLICY)
    same = {"prompt": "Hi ", "chosen": "hello", "rejected": "hello"}
    with pytest.raises(DataError, match=r"x\.jsonl:2: chosen and rejected are the same answer"):
        path = tmp_path / "x.jsonl"
        path.write_text(json.dumps(json.loads(open(PAIRS).readline())) + "\n" + json.dumps(same) + "\n")
        pref.load(str(path), fmt, SEQ)
    with pytest.raises(DataError, match="'rejected' missing"):
        pref.encode({"prompt": "Hi ", "chosen": "hello"}, fmt)


def _refused(capsys, tmp_path, *args):
    metrics = tmp_path / "m.jsonl"
    code = main(["--init-from", f"hf:{POLICY}", "--mesh", "8x1", "--batch-size", "8", "--seq-len", str(SEQ),
                 "--steps", "2", "--metrics", str(metrics), "--ckpt-dir", str(tmp_path / "ck"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    assert not metrics.exists() and not (tmp_path / "ck").exists()
    return err[0]


def test_bad_input_is_one_line(capsys, tmp_path):
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"prompt": "Hi ", "chosen": "hello", "rejected": "hello"}) + "\n")
    keys = tmp_path / "keys.jsonl"
    keys.write_text(json.dumps({"prompt": "Hi ", "chosen": "hello", "answer": "bye"}) + "\n")
    assert "same answer" in _refused(capsys, tmp_path, "--data", f"pref:{same}")
    assert "'rejected' missing" in _refused(capsys, tmp_path, "--data", f"pref:{keys}")
    assert "--ref-from hf:/no/such: no such folder" in _refused(
        capsys, tmp_path, "--data", f"pref:{PAIRS}", "--ref-from", "hf:/no/such")
    assert "--dpo-loss" in _refused(capsys, tmp_path, "--data", f"pref:{PAIRS}", "--dpo-loss", "kto")
    assert "needs no reference" in _refused(capsys, tmp_path, "--data", f"pref:{PAIRS}", "--dpo-loss", "simpo",
                                            "--ref-from", f"hf:{REFERENCE}")
    assert "--task dpo trains on preference pairs" in _refused(capsys, tmp_path, "--task", "dpo")
