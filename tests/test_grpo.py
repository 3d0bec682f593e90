"""GRPO's training loop (`dpjax.train.rollout`, `dpjax.tasks.grpo`'s task), the fast parts: the
rows a generation batch becomes, the task's loss against the objective and a log_softmax of the
model's own logits, the same completions on 8x1, 2x4 and 4x2 for one seed, and the settings
refused in one line before anything is written (tests/test_grpo_train.py runs the rest as a user
does, slow)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.data.prompts import Prompt
from dpjax.hf.load import load_params, model_from_hf
from dpjax.settings import Settings
from dpjax.sharding import make_layout
from dpjax.tasks import grpo
from dpjax.train import main
from dpjax.train.rollout import rows, sample

HERE = os.path.dirname(__file__)
LLAMA = os.path.join(HERE, "fixtures", "llama_tiny")
SUMS = os.path.join(HERE, "fixtures", "grpo_sum")


def prompt(ids):
    return Prompt(np.asarray(ids, np.int32), {"prompt": "x"}, "f:1")


def test_rows_of_a_generation_batch():
    """Prompt, completion, padding; a completion target's weight T / |completion| from the prompt's last token."""
    prompts = [prompt([5, 6]), prompt([7, 8, 9])]
    got = rows(prompts, [np.asarray([1]), np.asarray([2, 3, 4]), np.asarray([4, 1]), np.asarray([3, 3])], 2,
               seq_len=6)
    np.testing.assert_array_equal(got["tokens"], [[5, 6, 1, 0, 0, 0, 0], [5, 6, 2, 3, 4, 0, 0],
                                                  [7, 8, 9, 4, 1, 0, 0], [7, 8, 9, 3, 3, 0, 0]])
    np.testing.assert_array_equal(got["weights"], [[0, 6, 0, 0, 0, 0], [0, 2, 2, 2, 0, 0],
                                                   [0, 0, 3, 3, 0, 0], [0, 0, 3, 3, 0, 0]])


@pytest.fixture(scope="module")
def llama(mesh_of):
    model, _ = model_from_hf(LLAMA, seq_len=16)[:2]
    return model, load_params(LLAMA, model, make_layout(model, mesh_of("1x1", 1)))


def test_loss_is_the_objective_of_the_models_log_probs(llama):
    """The task's loss on a batch: grpo.objective (tests/test_grpo_math.py's numpy) of the log-probs
    a log_softmax of the model's logits gives, each completion's tokens averaged, then the completions."""
    model, params = llama
    rng = np.random.default_rng(0)
    prompts = [prompt(rng.integers(2, 300, 3)), prompt(rng.integers(2, 300, 5))]
    completions = [rng.integers(2, 300, n) for n in (1, 4, 6, 2)]
    batch = rows(prompts, completions, 2, seq_len=12)
    tokens = jnp.asarray(batch["tokens"])
    want_logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(model.apply(params, tokens[:, :-1]), -1)),
                                   batch["tokens"][:, 1:, None], -1)[..., 0]
    got_logp = np.asarray(grpo.token_logps(model, params, tokens))
    np.testing.assert_allclose(got_logp, want_logp, rtol=1e-5, atol=1e-5)
    old = want_logp + rng.normal(0, 0.3, want_logp.shape)  # ratios on both sides of the clip
    ref = want_logp + rng.normal(0, 0.2, want_logp.shape)
    adv = np.asarray([1.0, -1.0, 0.5, -0.5], np.float32)
    settings = Settings(clip_eps=0.2, kl_coef=0.1)
    loss, stats = grpo.loss_and_stats(model, settings)(params, {**batch, "adv": adv, "old": old, "ref": ref})
    want, figures = grpo.objective(want_logp, old, ref, adv, batch["weights"] > 0, 0.2, None, 0.1, "sequence")
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert float(stats["clip_fraction"]) > 0
    # one update a batch: the sampling policy is the current one (ratio 1), the loss -mean(A) + 0
    one, _ = grpo.loss_and_stats(model, Settings(kl_coef=0.0))(params, {**batch, "adv": adv})
    assert float(one) == pytest.approx(-adv.mean(), abs=1e-6)


@pytest.mark.slow  # three layouts' generation programs compile: about 15 s of CPU
def test_the_same_seed_samples_the_same_completions_on_every_mesh(llama, mesh_of):
    """The first step's generation (rollout.sample: prompts of two lengths, 3 completions each, at
    temperature 1) on the parameters laid out on 8x1, 2x4 (heads over 4 model ranks) and 4x2."""
    model, _ = llama
    rng = np.random.default_rng(1)
    prompts = [prompt(rng.integers(2, 300, n)) for n in (3, 5, 3)]
    got = {}
    for spec in ("8x1", "2x4", "4x2"):
        params = load_params(LLAMA, model, make_layout(model, mesh_of(spec, 8)))
        got[spec] = sample(model, params, prompts, 3, 6, 1.0, (0, 0), np.asarray([1], np.int32))
    first = got["8x1"]
    assert len(first) == 9 and len({tuple(c) for c in first}) > 5  # sampled, not one greedy answer
    for spec, completions in got.items():
        assert [c.tolist() for c in completions] == [c.tolist() for c in first], spec
    again = sample(model, params, prompts, 3, 6, 1.0, (0, 1), np.asarray([1], np.int32))  # the next batch
    assert [c.tolist() for c in again] != [c.tolist() for c in first]


BASE = ["--task", "grpo", "--tokenizer", SUMS, "--vocab-size", "16", "--model", "llama", "--d-model", "16",
        "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2", "--seq-len", "8", "--max-completion", "2",
        "--batch-size", "8", "--steps", "1", "--progress", "none"]


@pytest.mark.parametrize("args, says", [
    (["--reward", "x:y"], "give --prompts FILE.jsonl"),
    (["--prompts", "{prompts}", "--reward", f"{SUMS}/reward.py:reward", "--group-size", "1"],
     "a group of one"),
    (["--prompts", "{prompts}", "--reward", "no_such_module_here:reward"], "cannot import no_such_module_here"),
    (["--prompts", "{prompts}", "--reward", f"{SUMS}/reward.py:nothing"], "has no function 'nothing'"),
])
def test_refused_in_one_line(tmp_path, capsys, args, says):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n')
    metrics = tmp_path / "m.jsonl"
    argv = [*BASE, *[a.format(prompts=prompts) for a in args], "--metrics", str(metrics)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not metrics.exists()
