"""Mistral (`models/mistral.py`: the Llama with a sliding window) against transformers' own
MistralForCausalLM, and the checks tests/test_gemma.py shares (`matches_transformers`,
`round_trip`, `train_losses`).

tests/fixtures/mistral_tiny was made by tests/fixtures/make_mistral_gemma_fixtures.py: a
tiny random model (a window of 5 positions, shorter than every prompt) saved by
transformers 5 with its greedy continuations of three prompts and last-position log-probs;
config.4x.json is the same model saved by transformers 4.57, whose outputs the script found
equal.
"""

import json
import os

import jax
import numpy as np
import pytest

from dpjax.hf.config import config_from_hub, known_keys
from dpjax.hf.family import of_hub
from dpjax.hf.load import load_params, model_from_hf
from dpjax.sharding import make_layout

ROOT = os.path.join(os.path.dirname(__file__), "fixtures")


def folder(name: str) -> str:
    return os.path.join(ROOT, f"{name}_tiny")


def one_device():
    from dpjax import make_mesh

    return make_mesh("1x1", jax.devices()[:1])


def expected(name: str) -> dict:
    return json.load(open(os.path.join(folder(name), "expected.json")))


def dpjax_outputs(name: str, n_new: int, **change) -> tuple[np.ndarray, list]:
    """(last-position log-probs of each of the fixture's prompts, greedy continuations of
    `n_new` tokens), at the fixture's sequence length: one
    compile, the full forward of the padded batch each step (causal: the padding never
    reaches a real position), each row stopping after eos. `change`: config fields
    replaced (a check that the fixture exercises them)."""
    import dataclasses

    want, path = expected(name), folder(name)
    prompts = want["prompts"]
    T = max(map(len, prompts)) + want["new_tokens"]
    model, hub = model_from_hf(path, seq_len=T)
    params = load_params(path, model, make_layout(model, one_device()))
    if change:
        model = type(model)(dataclasses.replace(model.config, **change))
    logprobs = jax.jit(lambda p, x: jax.nn.log_softmax(model.apply(p, x), -1))
    tokens = np.zeros((len(prompts), T), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    first = np.asarray(logprobs(params, tokens))
    got = [[] for _ in prompts]
    for step in range(n_new):
        out = first if step == 0 else np.asarray(logprobs(params, tokens))
        for r, p in enumerate(prompts):
            if got[r] and got[r][-1] == hub["eos_token_id"]:
                continue
            tokens[r, len(p) + step] = int(np.argmax(out[r, len(p) + step - 1]))
            got[r].append(int(tokens[r, len(p) + step]))
    return np.stack([first[r, len(p) - 1] for r, p in enumerate(prompts)]), got


def matches_transformers(name: str, window: int, **unwindowed) -> None:
    """The three prompts' greedy continuations equal transformers' generate(do_sample=False)
    and their last-position log-probs are within 1e-4; every prompt is longer than the
    window, and with `unwindowed` (the config without its window) the log-probs are far
    off: the fixture exercises the window."""
    want = expected(name)
    prompts, n_new = want["prompts"], want["new_tokens"]
    assert min(map(len, prompts)) > window
    logprobs, greedy = dpjax_outputs(name, n_new)
    np.testing.assert_allclose(logprobs, np.asarray(want["logprobs"]), rtol=0, atol=1e-4)
    assert greedy == want["greedy"]
    full, _ = dpjax_outputs(name, 0, **unwindowed)
    assert np.abs(full - np.asarray(want["logprobs"])).max(axis=1).min() > 1e-2  # each long prompt's


def cached_matches_transformers(name: str) -> None:
    """`dpjax.generate.generate` (the KV cache: the prompt in one pass, then a token a step,
    each layer's window in the cache's mask) continues each of the fixture's prompts, all
    longer than the window, as transformers' generate(do_sample=False) did, and its first
    new token's log-probs are the saved ones within 1e-4. Every prompt decodes to the same
    length, so the step compiles once."""
    from dpjax.generate import generate

    want, path = expected(name), folder(name)
    model, hub = model_from_hf(path)
    params = load_params(path, model, make_layout(model, one_device()))
    length = max(map(len, want["prompts"])) + want["new_tokens"]
    for prompt, greedy, logprobs in zip(want["prompts"], want["greedy"], want["logprobs"]):
        new, first = generate(model, params, np.asarray([prompt]), length - len(prompt), eos=[hub["eos_token_id"]],
                              logprobs=True)
        assert new[0, :len(greedy)].tolist() == greedy
        np.testing.assert_allclose(first[0], logprobs, rtol=0, atol=1e-4)


def round_trip(name: str, tmp_path) -> None:
    """Import then export (from the parameters placed on a 2x4 layout, through dpjax's
    export): every tensor back with the same bytes, config.json as it was."""
    from safetensors.numpy import load_file

    from dpjax import make_mesh
    from dpjax.hf.writer import export

    path, out = folder(name), str(tmp_path / "out")
    model, hub = model_from_hf(path)
    params = load_params(path, model, make_layout(model, make_mesh("2x4", jax.devices()[:8])))
    export(params, model, out, base_config=hub)
    want, got = (load_file(os.path.join(d, "model.safetensors")) for d in (path, out))
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
    back = json.load(open(os.path.join(out, "config.json")))
    assert {k: v for k, v in back.items() if k != "transformers_version"} == \
        {k: v for k, v in hub.items() if k != "transformers_version"}


def train_losses(name: str, spec: str, steps: int = 5) -> list[float]:
    """The losses of `steps` steps of Nesterov momentum (0.9, lr 0.1, as the cards train)
    from the fixture's weights on mesh `spec` (a fixed stream of random batches of 8 rows
    of 16 tokens). Momentum, not AdamW: AdamW's first update, lr g / (|g| + eps), turns
    two layouts' float round-off in a gradient near eps into ~1e-5 in the losses
    (`dpjax.hf.verify.train_losses` says how), while momentum's is linear in the gradient."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dpjax import make_mesh
    from dpjax import step as S
    from dpjax.optim import OptimizerConfig

    mesh = make_mesh(spec, jax.devices()[:8])
    model, _ = model_from_hf(folder(name), seq_len=16)
    layout = make_layout(model, mesh)
    step = S.for_model(model, layout, global_batch=8, opt=OptimizerConfig(name="momentum", lr=0.1), donate=False)
    params, state = step.init(load_params(folder(name), model, layout))
    rng, losses = np.random.default_rng(0), []
    for _ in range(steps):
        batch = rng.integers(0, model.config.vocab_size, (1, 8, 17)).astype(np.int32)
        params, state, loss = step.train(params, state, jax.device_put(batch, NamedSharding(mesh, P(None, "data"))))
        losses.append(float(loss))
    return losses


def test_greedy_and_log_probs_match_transformers():
    matches_transformers("mistral", window=5, sliding_window=0)


def test_config_both_layouts_read_as_one_and_every_key_is_known():
    """transformers 5's and 4.57's config.json give one config, with the window; a null
    window is full attention (0) and is written back as null."""
    from dpjax.hf.config import config_to_hub
    from dpjax.models import get_model

    new, old = (json.load(open(os.path.join(folder("mistral"), f))) for f in ("config.json", "config.4x.json"))
    for hub in (new, old):
        assert sorted(set(hub) - known_keys(of_hub(hub, "x"))) == []
    fields = config_from_hub(new, "new")
    assert fields == config_from_hub(old, "old") and fields["sliding_window"] == 5
    model = get_model("mistral", seq_len=64, **fields)
    assert config_to_hub(model.config, "float32", new) == new and config_to_hub(model.config, "float32", old) == old
    full = config_from_hub({**new, "sliding_window": None}, "null")
    assert full["sliding_window"] == 0 and get_model("mistral", seq_len=64, **full).window is None
    assert config_to_hub(get_model("mistral", seq_len=64, **full).config, "float32", new)["sliding_window"] is None


@pytest.mark.slow  # a prefill's compile for each of 3 prompt lengths and a step's
def test_greedy_through_the_kv_cache_matches_transformers():
    cached_matches_transformers("mistral")


@pytest.mark.slow  # a 2x4 layout's placement and an export (~5 s)
def test_import_export_gives_every_tensor_back(tmp_path):
    round_trip("mistral", tmp_path)


@pytest.mark.slow  # two train-step compiles
def test_five_steps_on_2x4_equal_8x1():
    a, b = train_losses("mistral", "2x4"), train_losses("mistral", "8x1")
    assert all(np.isfinite(a)) and a[-1] < a[0]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
