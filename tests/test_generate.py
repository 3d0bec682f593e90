"""Generation: the Llama's KV cache against its full forward, greedy decoding against
transformers' (the fixture tests/test_hf_llama.py describes), nucleus sampling against
its definition in numpy, EOS (a list, per row), the window path of a model without
layers, the CLI and the train job's sample."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.generate import Sampling, generate, pick
from dpjax.generate import cache as kv
from dpjax.hf.load import load_params, model_from_hf
from dpjax.models import get_model
from dpjax.sharding import make_layout

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama_tiny")
EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))


@pytest.fixture(scope="module")
def llama(mesh_of):
    model, hub = model_from_hf(FIXTURE, seq_len=32)
    return model, load_params(FIXTURE, model, make_layout(model, mesh_of("1x1", 1))), hub


def test_cache_gives_the_full_forward_logits(llama):
    """Prefill 5 tokens, then 3 more one at a time: every position's logits as the full
    forward's, to float32 round-off."""
    model, params, _ = llama
    ids = jnp.asarray([EXPECTED["prompt_ids"][:8]])
    want = np.asarray(model.apply(params, ids))
    forward = jax.jit(lambda p, t, start, c: kv.forward(model, p, t, start, c))
    got, cache = forward(params, ids[:, :5], 0, kv.empty(model, 1, 32))
    rows = [np.asarray(got)]
    for t in range(5, 8):
        logits, cache = forward(params, ids[:, t:t + 1], t, cache)
        rows.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(rows, axis=1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_greedy_with_the_cache_matches_transformers_on_a_mesh(mesh_of, llama):
    model, _, hub = llama
    params = load_params(FIXTURE, model, make_layout(model, mesh_of("2x4", 8)))  # heads over 4 model ranks
    got = generate(model, params, [EXPECTED["prompt_ids"]], len(EXPECTED["greedy"]), eos=[hub["eos_token_id"]])
    assert got[0].tolist() == EXPECTED["greedy"]


def test_stops_at_eos(llama):
    model, params, _ = llama
    first = EXPECTED["greedy"][0]
    assert generate(model, params, [EXPECTED["prompt_ids"]], 8, eos=[first]).tolist() == [[first]]


def test_each_row_stops_at_any_of_its_eos_ids(llama):
    """A batch of 2 rows and a list of EOS ids (Llama 3's and Qwen's form): each row stops
    at the first id of the list it makes (holding it after), the other goes on; when
    every row has stopped, generation stops."""
    model, params, _ = llama
    prompts = np.asarray([EXPECTED["prompt_ids"], EXPECTED["prompt_ids"][:1] + EXPECTED["prompt_ids"][2:] + [9]])
    free = generate(model, params, prompts, 6)
    assert free[0].tolist() == EXPECTED["greedy"][:6] and free[0].tolist() != free[1].tolist()
    a = next(i for i in range(1, 4) if free[0, i] not in free[0, :i] and free[0, i] not in free[1, :5])
    b = next(i for i in range(a + 1, 5) if free[1, i] not in free[1, :i] and free[1, i] not in free[0, :a + 1])
    got = generate(model, params, prompts, 6, eos=[int(free[0, a]), 300, int(free[1, b])])
    assert got.shape == (2, b + 1)  # both stopped: no token past the later stop
    assert got[0].tolist() == free[0, :a + 1].tolist() + [int(free[0, a])] * (b - a)
    assert got[1].tolist() == free[1, :b + 1].tolist()


def test_nucleus_sampling_keeps_the_smallest_set_reaching_top_p():
    """softmax(z / T) sorted: the tokens before the cumulative probability reaches
    top_p, and the one that reaches it, are drawn; never another; top_p tiny: greedy."""
    z = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    p = np.asarray(jax.nn.softmax(z[0] / 0.7))
    order = np.argsort(-p)
    nucleus = set(order[:np.searchsorted(np.cumsum(p[order]), 0.8) + 1].tolist())
    keys = jax.random.split(jax.random.key(0), 200)
    draws = jax.jit(jax.vmap(lambda k, s: pick(z, k, s)[0], in_axes=(0, None)), static_argnums=1)
    assert set(np.asarray(draws(keys, Sampling(0.7, 0.8))).tolist()) == nucleus and len(nucleus) < 6
    assert set(np.asarray(draws(keys, Sampling(0.7, 1e-6))).tolist()) == {5}


def test_other_models_decode_by_their_window():
    """A model without a stack of layers (the MLP: no cache): each token the argmax of the
    full forward over the sequence so far (the GPT's cache: tests/test_generate_checkpoint.py)."""
    model = get_model("mlp", seq_len=16, context=3, d_embed=8, d_hidden=16)
    params = model.init(jax.random.key(1))
    prompt = np.asarray([[5, 6, 7, 8]], np.int32)
    got = generate(model, params, prompt, 6)[0].tolist()
    seq = np.zeros((1, 10), np.int32)  # padded: causal, so the tail never reaches the logits read
    seq[0, :4] = prompt[0]
    apply = jax.jit(model.apply)
    for t in range(4, 10):
        seq[0, t] = int(np.argmax(np.asarray(apply(params, jnp.asarray(seq)))[0, t - 1]))
    assert got == seq[0, 4:].tolist()


def test_cli_json(capsys):
    from dpjax.generate.__main__ import main

    assert main(["--init-from", f"hf:{FIXTURE}", "--prompt", EXPECTED["prompt"], "--max-new-tokens", "12",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == EXPECTED["prompt_ids"] and out["new_ids"] == EXPECTED["greedy"]
    assert main(["--init-from", f"hf:{FIXTURE}", "--prompt-ids", "1,x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow  # a training run's compile (the fast set's train tests print their samples too)
def test_training_prints_a_sample(capsys):
    from dpjax.train.cli import main

    assert main(["--mesh", "1x1", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--d-model", "16",
                 "--n-heads", "2", "--n-layers", "1", "--d-ff", "32", "--eval-every", "0", "--progress", "log",
                 "--sample-tokens", "5"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sample: ")]
    assert len(line) == 1 and line[0].count("|") >= 1
