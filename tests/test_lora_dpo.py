"""DPO with LoRA (`dpjax.tasks.dpo.reference_of`): the reference is the base with the adapters
off, read from the policy's own parameters (no second copy). Against transformers' sums of the
base model (tests/fixtures/dpo_tiny/expected.json, make_dpo_fixture.py): the reference with
trained-looking adapters on equals the base's, precomputed on 2x4 with FSDP and online in the
step; with PEFT's zero B the first loss is ln 2. The command line (online against precompute,
first steps, with LoRA and with a frozen copy) is slow."""

import json
import math
import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import read_losses

from dpjax.compute.policy import Policy
from dpjax.data import chat, pref
from dpjax.hf.load import load_params, model_from_hf
from dpjax.models.lora import Lora, LoraConfig, Split
from dpjax.sharding import make_layout
from dpjax.tasks import dpo
from dpjax.train import main
from dpjax.train.preference import reference_logps

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "dpo_tiny")
POLICY = os.path.join(FIXTURE, "policy")
PAIRS = os.path.join(FIXTURE, "pairs.jsonl")
EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))
SEQ = 48
BASE_SUMS = np.array([[p["chosen"]["policy"], p["rejected"]["policy"]] for p in EXPECTED["pairs"]])


def with_adapters(model, params, b_scale: float):
    """The base's parameters with fresh adapters, B drawn at `b_scale` (0: PEFT's zeros)."""
    split = Split(model.LAYERS)
    fresh = model.init_adapters(jax.random.key(1))
    fresh = {k: v + b_scale * jax.random.normal(jax.random.key(len(k)), v.shape) if "_B_" in k else v
             for k, v in fresh.items()}
    return split.join(fresh, params)


@pytest.fixture(scope="module")
def tiny():
    base, _ = model_from_hf(POLICY, seq_len=SEQ)
    model = Lora(base, LoraConfig(r=4, alpha=8.0))
    pairs, _ = pref.load(PAIRS, chat.ChatFormat(POLICY), SEQ)
    stream = pref.PairStream(pairs, SEQ)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    params = load_params(POLICY, base, make_layout(base, mesh))
    return SimpleNamespace(model=model, stream=stream, params=params, batch=stream.ordered(0, len(pairs)))


def test_reference_is_the_base_with_adapters_off(tiny, mesh_of):
    """Adapters with B far from zero move the policy's sums; the reference's (online, in the
    loss) are the base model's as transformers computes them."""
    params = with_adapters(tiny.model, tiny.params, 0.3)
    pi = np.asarray(jax.jit(lambda p, b: dpo.pair_logps(tiny.model, p, b)[0])(params, tiny.batch))
    assert np.abs(pi - BASE_SUMS).max() > 1e-2  # the adapters are on in the policy
    online = np.asarray(jax.jit(lambda p, b: dpo.reference_logps(tiny.model, p, b))(params, tiny.batch))
    np.testing.assert_allclose(online, BASE_SUMS, rtol=1e-5)


@pytest.mark.slow
def test_precomputed_reference_on_2x4_fsdp_is_the_base(tiny, mesh_of):
    """--ref-logps precompute with LoRA, sharded on 2x4 with FSDP (the base's leaves gathered
    alone, the vocabulary over 4 ranks): the base's sums, the adapters off."""
    params = with_adapters(tiny.model, tiny.params, 0.3)
    layout = make_layout(tiny.model, mesh_of("2x4", 8), fsdp=True)
    plan = SimpleNamespace(layout=layout, model=tiny.model, policy=Policy(), mesh=layout.mesh)
    precomputed = reference_logps(plan, jax.device_put(params, layout.shardings()), tiny.stream, batch_size=2)
    np.testing.assert_allclose(precomputed, BASE_SUMS, rtol=1e-5)


def settings(beta: float):
    return SimpleNamespace(dpo_loss="sigmoid", dpo_beta=beta, simpo_gamma=0.5, ref_logps="online")


def test_first_loss_with_zero_b_is_ln2(tiny):
    """PEFT's B = 0: the policy is its base, so with ρ computed online from the base the
    loss is ln 2 within 1e-6 (beta 2: the loss moves by beta h / 2) and no pair is won."""
    params = with_adapters(tiny.model, tiny.params, 0.0)
    loss, figures = jax.jit(dpo.loss_and_stats(tiny.model, settings(2.0)))(params, tiny.batch)
    assert abs(float(loss) - math.log(2)) < 1e-6
    assert float(figures["accuracy"]) == 0 and float(figures["margin"]) == 0


@pytest.mark.slow
def test_reference_is_a_constant_of_the_loss(tiny):
    """ρ online is never differentiated: the base's gradient is the policy's alone (were ρ
    differentiated too it would be zero here, π and ρ being the same function of the base)."""
    params = with_adapters(tiny.model, tiny.params, 0.0)
    split = Split(tiny.model.LAYERS)

    def loss_of(frozen):
        return dpo.loss_and_stats(tiny.model, settings(0.5))(split.join(split.trained(params), frozen), tiny.batch)[0]

    def policy_only(frozen):  # ρ as a constant, by hand
        pi, n = dpo.pair_logps(tiny.model, split.join(split.trained(params), frozen), tiny.batch)
        ref = jax.lax.stop_gradient(dpo.pair_logps(tiny.model.base, frozen, tiny.batch)[0])
        return dpo.pair_losses(pi, ref, n, dpo.Options("sigmoid", 0.5))[0].mean()

    got, want = jax.jit(lambda f: (jax.grad(loss_of)(f), jax.grad(policy_only)(f)))(split.frozen(params))
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(got)) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 got, want)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "copy"])
def test_online_equals_precompute_on_the_command_line(tmp_path, lora):
    """--ref-logps online (with --lora: ρ from the base inside each step; without: a frozen
    copy split like the policy, ρ computed each step) against precompute (once, before
    training) on 2x4 with FSDP: the first loss is ln 2 within 1e-6 (the policy starts as its
    reference), and the train and held-out losses of the first steps agree within 1e-6."""
    args = ["--init-from", f"hf:{POLICY}", "--data", f"pref:{PAIRS}", "--eval-data", f"pref:{PAIRS}", "--mesh",
            "2x4", "--fsdp", "--batch-size", "4", "--seq-len", str(SEQ), "--steps", "3", "--eval-every", "3",
            "--eval-batches", "1", "--lr", "1e-2", "--progress", "none", "--sample-tokens", "0",
            *(["--lora", "r=4,alpha=8"] if lora else [])]
    rows = {}
    for how in ("online", "precompute"):
        metrics = tmp_path / f"{how}.jsonl"
        assert main([*args, "--ref-logps", how, "--metrics", str(metrics)]) == 0
        rows[how] = [json.loads(line) for line in open(metrics)][1:]
        assert read_losses(metrics)[-1] < read_losses(metrics)[0]  # it learns the preferences
    first = [r["loss"] for r in rows["online"] if "loss" in r][0]
    assert abs(first - math.log(2)) < 1e-6
    for key in ("loss", "eval_loss", "margin"):
        got, want = ([r[key] for r in rows[how] if key in r] for how in ("online", "precompute"))
        assert len(got) == len(want) > 0, key
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=key)


def test_plan_counts_the_reference_copy_only_without_lora():
    """The planner's memory (what --dry-run prints): --ref-logps online without LoRA holds a
    frozen copy as large as the parameters; with LoRA the reference is the base itself (no
    second copy), and precompute holds none."""
    from dpjax.plan import resolve
    from dpjax.train.cli import parse_args

    def memory(*args):
        s = parse_args(["--init-from", f"hf:{POLICY}", "--data", f"pref:{PAIRS}", "--mesh", "2x4", "--fsdp",
                        "--batch-size", "8", "--seq-len", str(SEQ), *args])
        return resolve(s, jax.devices()[:8]).memory

    copy, lora, precompute = (memory("--ref-logps", "online"), memory("--ref-logps", "online", "--lora", "r=4"),
                              memory("--ref-logps", "precompute"))
    assert copy["reference"] == copy["params"] > 0
    assert copy["total"] == precompute["total"] + copy["params"]
    assert lora["reference"] == precompute["reference"] == 0
