"""`python -m dpjax.generate` from a dpjax checkpoint of the GPT (a learned table of
positions, seq_len rows) at prompt lengths 1, seq_len/2 and seq_len - new: each new token
the argmax of the unsharded full forward over the sequence so far, --logprobs the
log_softmax of that forward's last prompt position; the GPT's KV cache against that
forward; past the context, one line. The EOS ids of config.json and generation_config.json
(a list) together."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.generate import cache as kv
from dpjax.generate.__main__ import main
from dpjax.generate.source import Source, eos_ids
from dpjax.models import get_model
from dpjax.recovery.checkpoint import Checkpointer
from test_generate_cache import random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, NEW = 16, 4


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory):
    """A checkpoint as a training run writes one (its params under state, the model in its
    record), of a GPT trained at seq_len 16; and the reference: the full forward at 16,
    whose logit at position t reads tokens up to t only (causal), so one compile serves
    every prompt length."""
    folder = str(tmp_path_factory.mktemp("gpt_ckpt"))
    model = get_model("gpt", seq_len=SEQ, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    params = random_params(model, 3)
    ckpt = Checkpointer(folder)
    ckpt.save(1, {"params": params}, {"model": model.describe(), "step": 1})
    ckpt.close()
    full = jax.jit(model.apply)

    def reference(prompt):
        """(the greedy continuation of NEW tokens, the log-probs after the prompt)."""
        seq = np.zeros((1, SEQ), np.int32)
        seq[0, :len(prompt)] = prompt
        logp = None
        for t in range(len(prompt), len(prompt) + NEW):
            logits = np.asarray(full(params, jnp.asarray(seq)))[0, t - 1]
            logp = np.asarray(jax.nn.log_softmax(logits)) if logp is None else logp
            seq[0, t] = int(np.argmax(logits))
        return seq[0, len(prompt):len(prompt) + NEW].tolist(), logp

    return folder, reference, model, params, full


def _prompt(n):
    return [(7 * i + 3) % 256 for i in range(n)]


def test_the_longest_prompt_as_a_process(gpt_ckpt, tmp_path):
    """seq_len - new tokens of prompt: the case a checkpoint's position table refused."""
    folder, reference = gpt_ckpt[:2]
    prompt, out = _prompt(SEQ - NEW), str(tmp_path / "lp.npy")
    # this checkout's dpjax, not an installed one; one CPU device (a user's laptop), which compiles least
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-m", "dpjax.generate", "--init-from", folder, "--prompt-ids",
                           ",".join(map(str, prompt)), "--max-new-tokens", str(NEW), "--logprobs", "3",
                           "--logprobs-out", out, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want_new, want_logp = reference(prompt)
    assert got["new_ids"] == want_new
    saved = np.load(out)
    assert saved.shape == (256,) and saved.dtype == np.float32
    np.testing.assert_allclose(saved, want_logp, rtol=0, atol=1e-5)
    top = np.argsort(-want_logp, kind="stable")[:3]
    assert got["logprobs"]["ids"] == top.tolist() and got["logprobs"]["position"] == len(prompt) - 1
    np.testing.assert_allclose(got["logprobs"]["values"], want_logp[top], rtol=0, atol=1e-5)


@pytest.mark.slow  # 2 compiles each, on the default mesh (1x2: the heads over `model`)
@pytest.mark.parametrize("length", [1, SEQ // 2])
def test_shorter_prompts(gpt_ckpt, length, capsys):
    folder, reference = gpt_ckpt[:2]
    prompt = _prompt(length)
    assert main(["--init-from", folder, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(NEW),
                 "--logprobs", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want_new, want_logp = reference(prompt)
    assert got["new_ids"] == want_new and got["prompt_ids"] == prompt
    np.testing.assert_allclose(got["logprobs"]["values"], np.sort(want_logp)[::-1][:2], rtol=0, atol=1e-5)


def test_the_cache_gives_the_full_forward_logits(gpt_ckpt):
    """The GPT's KV cache (its learned positions read at each step's position): 12 tokens
    in one pass, then 4 one at a time, every position's logits as the full forward's."""
    _, _, model, params, full = gpt_ckpt
    ids = jnp.asarray([_prompt(SEQ)])
    forward = jax.jit(lambda p, t, start, c: kv.forward(model, p, t, start, c))
    got, cache = forward(params, ids[:, :SEQ - NEW], 0, kv.empty(model, 1, SEQ))
    rows = [np.asarray(got)]
    for t in range(SEQ - NEW, SEQ):
        logits, cache = forward(params, ids[:, t:t + 1], t, cache)
        rows.append(np.asarray(logits))
    want = np.asarray(full(params, ids))
    np.testing.assert_allclose(np.concatenate(rows, axis=1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_past_the_context_is_one_line(gpt_ckpt, capsys):
    folder = gpt_ckpt[0]
    assert main(["--init-from", folder, "--prompt-ids", ",".join(map(str, _prompt(SEQ - NEW + 1))),
                 "--max-new-tokens", str(NEW)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "17 positions exceed the model's context of 16" in err


def test_weights_that_disagree_with_the_record_are_one_line(tmp_path, capsys):
    """A record describing d_model 32 over weights of 16: one line naming a leaf and both shapes."""
    model = get_model("gpt", seq_len=SEQ, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    ckpt = Checkpointer(str(tmp_path))
    params = random_params(model, 0)
    ckpt.save(1, {"params": params}, {"model": {**model.describe(), "d_model": 32}, "step": 1})
    ckpt.close()
    assert main(["--init-from", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(1, 2, 8, 16) but the gpt its record describes needs (1, 2, 16, 32)" in err


def test_eos_ids_of_both_configs(tmp_path):
    """config.json's id and generation_config.json's list (Llama 3 Instruct's form), each once."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 11]}))
    source = Source("hf:x", None, {"eos_token_id": 9}, None, str(tmp_path))
    assert eos_ids(source, None) == [9, 7, 11]
    assert eos_ids(Source("hf:x", None, {"eos_token_id": [3, 4]}, None, None), None) == [3, 4]


@pytest.mark.slow  # a training run as a process (its compile), then three generations
def test_from_a_training_runs_checkpoint(tmp_path, capsys):
    """The main job's default model (the GPT) trained with --ckpt-dir, then generation at
    prompt lengths 1, seq_len/2 and seq_len - new: each as long as asked (no EOS for bytes)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    ckpt = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "dpjax.train", "--steps", "2", "--batch-size", "8", "--seq-len", "32",
                           "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--eval-every", "0",
                           "--ckpt-dir", ckpt], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for length in (1, 16, 28):
        assert main(["--init-from", ckpt, "--prompt-ids", ",".join(map(str, _prompt(length))), "--max-new-tokens",
                     "4", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert len(got["new_ids"]) == 4 and got["prompt_ids"] == _prompt(length)


@pytest.mark.slow  # a Llama's compile
def test_logprobs_of_a_hub_llama_equal_transformers(tmp_path, capsys):
    """--logprobs-out of the Llama 3.1-style fixture (llama3 rope scaling, transformers 5):
    within 1e-4 of the log-probs transformers computed, and its greedy continuation."""
    folder = os.path.join(ROOT, "tests", "fixtures", "llama_rope", "llama3")
    expected = json.load(open(os.path.join(folder, "expected.json")))
    out = str(tmp_path / "lp.npy")
    assert main(["--init-from", f"hf:{folder}", "--prompt-ids", ",".join(map(str, expected["prompts"][2])),
                 "--max-new-tokens", str(expected["new_tokens"]), "--logprobs-out", out, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose(np.load(out), expected["logprobs"][2], rtol=0, atol=1e-4)
    n = len(got["new_ids"])  # up to the first EOS id
    assert got["new_ids"] == expected["greedy"][2][:n] and (n == expected["new_tokens"] or got["new_ids"][-1] == 1)
