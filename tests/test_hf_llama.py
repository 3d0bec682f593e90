"""dpjax's Llama against HuggingFace's own implementation, and the Hub format both ways.

tests/fixtures/llama_tiny was made by tests/fixtures/make_llama_fixture.py with
transformers 4.57's FlaxLlamaForCausalLM (a random 2-layer Llama with grouped-query
attention, untied head, a byte-level BPE tokenizer.json) and holds transformers' logits
for a prompt and its greedy generate(do_sample=False): the suite needs no transformers.
The safetensors package (the hf extra) reads dpjax's exports as an independent reader.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.hf import layouts as names
from dpjax.hf.load import load_params, model_from_hf
from dpjax.sharding import make_layout

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama_tiny")
EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))


def within(got, want, rel=1e-5):
    """Every logit within `rel` of the largest logit's magnitude (relative error of the
    logits as a whole: a logit near 0 has no relative error of its own)."""
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * np.abs(want).max())


@pytest.fixture(scope="module")
def dense():
    model, _ = model_from_hf(FIXTURE)
    return model, jax.tree.map(np.asarray, load_params(FIXTURE, model, make_layout(model, _one_device())))


def _one_device():
    from dpjax import make_mesh

    return make_mesh("1x1", jax.devices()[:1])


def test_fixture_is_small():
    assert sum(os.path.getsize(os.path.join(FIXTURE, f)) for f in os.listdir(FIXTURE)) < 2**20


def test_logits_match_transformers(dense):
    model, params = dense
    logits = np.asarray(model.apply(params, jnp.asarray([EXPECTED["prompt_ids"]])))[0]
    within(logits, np.asarray(EXPECTED["logits"], np.float32))


def test_greedy_generation_matches_transformers(dense):
    """Greedy decoding by the full forward at each length (no cache: the reference the
    KV-cache generator is held to), stopping at EOS as transformers does."""
    model, params = dense
    eos = json.load(open(os.path.join(FIXTURE, "config.json")))["eos_token_id"]
    prompt, want = EXPECTED["prompt_ids"], EXPECTED["greedy"]
    tokens = np.zeros((1, len(prompt) + len(want)), np.int32)  # padded: causal, so the tail never matters
    tokens[0, :len(prompt)] = prompt
    apply = jax.jit(model.apply)
    got = []
    for t in range(len(prompt), tokens.shape[1]):
        tokens[0, t] = int(np.argmax(np.asarray(apply(params, jnp.asarray(tokens)))[0, t - 1]))
        got.append(int(tokens[0, t]))
        if got[-1] == eos:
            break
    assert got == want


def test_sharded_load_reads_blocks_and_matches(mesh_of, dense, monkeypatch):
    """On a model axis of 4 every device's block equals the dense load's slice, and no
    read of a split leaf returns more than one block (never a whole layer's weight)."""
    model, want = dense
    sizes = {}
    read = names.read_layer_block

    def recording(key, hub, idx, K):
        out = read(key, hub, idx, K)
        sizes[key[-1]] = max(sizes.get(key[-1], 0), out.size)
        return out

    monkeypatch.setattr(names, "read_layer_block", recording)
    mesh = mesh_of("2x4", 8)
    params = load_params(FIXTURE, model, make_layout(model, mesh))
    for got, w in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
    c = model.config
    assert sizes["wq_LsxDxHmxK"] == c.d_model * c.d_model // 4  # a quarter of the heads
    assert sizes["wgate_LsxDxFm"] == c.d_model * c.d_ff // 4


IDENTITY = {"tokenizer_config.json": '{"bos_token": "<s>", "eos_token": "</s>"}',
            "special_tokens_map.json": '{"bos_token": "<s>"}', "chat_template.jinja": "{{ messages }}",
            "generation_config.json": '{"bos_token_id": 0, "eos_token_id": 1}'}


def test_import_export_round_trip_is_bit_for_bit(tmp_path, capsys):
    """import, then export in shards of 50 KB: every tensor of the Hub file comes back
    with the same bytes, the index names every tensor, config.json is the imported one
    (token ids and context length included) and the tokenizer, chat template and
    generation config come along. A second export onto it is refused, as a process, in
    one line with nothing replaced; with --overwrite the earlier shards go; an --out that
    cannot be written is one line."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    from dpjax.hf.__main__ import main

    hub_dir = tmp_path / "hub"  # the fixture with the files a Hub folder has beside the weights
    hub_dir.mkdir()
    for f in os.listdir(FIXTURE):
        os.symlink(os.path.join(FIXTURE, f), hub_dir / f)
    for f, text in IDENTITY.items():
        (hub_dir / f).write_text(text)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert main(["import", str(hub_dir), "--out", ckpt]) == 0
    assert main(["export", ckpt, "--out", out, "--shard-mb", "0.05"]) == 0
    want = load_file(os.path.join(FIXTURE, "model.safetensors"))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(want) and len(set(index["weight_map"].values())) > 2
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(os.path.join(out, f)))
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and got[k].tobytes() == \
            want[k].tobytes(), k
    hub, back = (json.load(open(os.path.join(d, "config.json"))) for d in (FIXTURE, out))
    assert back == hub
    for f in ("tokenizer.json", *IDENTITY):
        assert open(os.path.join(out, f), "rb").read() == open(hub_dir / f, "rb").read(), f
    before = sorted(os.listdir(out))
    r = subprocess.run([sys.executable, "-m", "dpjax.hf", "export", ckpt, "--out", out], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {out} is not empty (it holds chat_template.jinja, config.json, ")
    assert sorted(os.listdir(out)) == before and json.load(open(os.path.join(out, "config.json"))) == hub
    os.rename(hub_dir, tmp_path / "moved")  # the import's record keeps the config, the tokenizer went with it
    capsys.readouterr()
    assert main(["export", ckpt, "--out", out, "--overwrite"]) == 0  # one file now: the shards and index go
    assert capsys.readouterr().out.strip().endswith(f"; {hub_dir}, where the model was imported from, is not "
                                                    "there: no tokenizer")
    assert not [f for f in os.listdir(out) if f.startswith("model-") or f.endswith(".index.json")]
    assert load_file(os.path.join(out, "model.safetensors")).keys() == want.keys()
    assert json.load(open(os.path.join(out, "config.json"))) == hub
    (tmp_path / "afile").write_text("")
    capsys.readouterr()
    assert main(["export", ckpt, "--out", str(tmp_path / "afile" / "out")]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'afile' / 'out'}: Not a directory\n"


def test_what_llama_does_not_compute_is_one_line(tmp_path, capsys):
    from dpjax.hf.__main__ import main

    for f in ("model.safetensors", "tokenizer.json"):
        os.symlink(os.path.join(FIXTURE, f), tmp_path / f)
    hub = json.load(open(os.path.join(FIXTURE, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps({**hub, "rope_scaling": {"rope_type": "longrope", "factor": 8.0}}))
    assert main(["import", str(tmp_path), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope_type 'longrope' is not computed by dpjax" in err


@pytest.mark.slow  # a training step's compile; the fast set keeps the import/export round trip
def test_init_from_hf_trains_and_its_checkpoint_exports(tmp_path, monkeypatch):
    """--init-from hf:DIR on a 2x4 mesh with FSDP, one step at lr 0 with --ckpt-dir: the
    run's checkpoint (sharded over that mesh, with optimizer state) exports the Hub's
    tensors bit for bit, and, from another folder, the Hub's config.json (not the run's
    --seq-len) and its tokenizer."""
    from safetensors.numpy import load_file

    from dpjax.hf.__main__ import main as hf_main
    from dpjax.train.cli import main as train_main

    ckpt, out = str(tmp_path / "run"), str(tmp_path / "out")
    assert train_main(["--init-from", f"hf:{os.path.relpath(FIXTURE)}", "--mesh", "2x4", "--fsdp", "--steps", "1",
                       "--lr", "0", "--batch-size", "8", "--seq-len", "8", "--data", "synthetic", "--eval-every", "0",
                       "--ckpt-dir", ckpt, "--ckpt-every", "1", "--progress", "none"]) == 0
    monkeypatch.chdir(tmp_path)  # export follows run.json's --init-from from any folder
    assert hf_main(["export", ckpt, "--out", out]) == 0
    want, got = load_file(os.path.join(FIXTURE, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
    # the model keeps its identity: token ids, its context (not the run's --seq-len 8), its tokenizer
    assert json.load(open(os.path.join(out, "config.json"))) == json.load(open(os.path.join(FIXTURE, "config.json")))
    assert open(os.path.join(out, "tokenizer.json"), "rb").read() == \
        open(os.path.join(FIXTURE, "tokenizer.json"), "rb").read()
