"""The registry of HuggingFace architectures (`dpjax.hf.family`): config.json names a
family, an unsupported one is one line naming it and the supported ones, and each entry
builds its registered dpjax model with a weight map that covers its parameters."""

import json
import os

import jax
import pytest

from dpjax.hf.config import config_from_hub, known_keys
from dpjax.hf.family import FAMILIES, of_hub
from dpjax.hf.files import HFError
from dpjax.models import MODELS, get_model

LLAMA = os.path.join(os.path.dirname(__file__), "fixtures", "llama_rope", "default", "config.json")


def test_unsupported_architecture_is_one_line_naming_it_and_the_supported_ones():
    hub = json.load(open(LLAMA))
    for change, named in (({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, "PhiForCausalLM"),
                          ({"architectures": None, "model_type": "phi"}, "model_type 'phi'")):
        with pytest.raises(HFError) as e:
            config_from_hub({**hub, **change}, "DIR")
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"DIR: {named} is not supported by dpjax; it imports ")
        assert all(f.architecture in line for f in FAMILIES.values())
    with pytest.raises(HFError, match="model_type 'qwen2' .LlamaForCausalLM is 'llama'"):
        config_from_hub({**hub, "model_type": "qwen2"}, "DIR")


def test_architecture_or_model_type_names_the_family():
    hub = json.load(open(LLAMA))
    assert of_hub(hub, "x").name == "llama"
    assert of_hub({**hub, "architectures": None}, "x").name == "llama"  # model_type alone


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_builds_its_model_and_maps_every_leaf(name):
    """The entry's model is registered, and its weight map names every stacked leaf of the
    model once (the outer leaves by the shared table): nothing is left without a Hub name."""
    family = FAMILIES[name]
    assert name in MODELS and known_keys(family) >= {k for k, _ in family.fields.values()}
    model = get_model(name)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    stacked = {tuple(str(k.key) for k in path) for path, _ in
               jax.tree_util.tree_flatten_with_path(abstract[model.LAYERS])[0]}
    outer = {tuple(str(k.key) for k in path) for path, _ in
             jax.tree_util.tree_flatten_with_path({k: v for k, v in abstract.items() if k != model.LAYERS})[0]}
    assert stacked == set(family.layer) and outer <= set(family.outer)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_has_a_verified_card_linked_from_readme_and_docs(name):
    """docs/models/<family>.md (tests/fixtures/make_model_cards.py) names the architecture,
    says Verified, and README.md, docs/hf.md and mkdocs.yml link it."""
    root = os.path.join(os.path.dirname(__file__), "..")
    text = open(os.path.join(root, "docs", "models", f"{name}.md")).read()
    assert text.startswith(f"# {FAMILIES[name].architecture}\n") and "**Verified**" in text
    assert f"docs/models/{name}.md" in open(os.path.join(root, "README.md")).read()
    assert f"(models/{name}.md)" in open(os.path.join(root, "docs", "hf.md")).read()
    assert f"models/{name}.md" in open(os.path.join(root, "mkdocs.yml")).read()
