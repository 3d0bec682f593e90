"""`python -m dpjax.hf verify DIR`: dpjax against HuggingFace transformers on one folder,
printed as a verification card (markdown).

Three comparisons, each against an independent reference: the greedy continuations of a
few prompts (transformers' `generate(do_sample=False)`), the last prompt position's
log-probs (transformers' forward, float64 log-softmax), and the round trip (import, then
export: every tensor of the folder back with the same bytes, config.json unchanged).
With `--train MESH,...` it also trains a few steps from the folder on each layout and
prints the losses side by side (they must agree across layouts). transformers is the
reference only: it is imported here when asked, never by dpjax elsewhere; without it,
`--expected FILE` (a fixture's saved outputs, `tests/fixtures/*/expected.json`) stands in
for it, which is how docs/models/ is made from the repository's fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

from dpjax.errors import UserError
from dpjax.hf.config import config_from_hub
from dpjax.hf.family import of_hub
from dpjax.hf.files import Tensors
from dpjax.hf.identity import Origin
from dpjax.hf.load import load_params, model_from_hf, read_config
from dpjax.hf.writer import export
from dpjax.mesh import make_mesh
from dpjax.sharding import make_layout

NEW_TOKENS = 10
PROMPT_LENGTHS = (6, 11, 20)


def default_prompts(vocab: int, bos: int | None) -> list[list[int]]:
    """Three prompts of random ids (fixed seed), each after the bos id when there is one."""
    rng = np.random.default_rng(1)
    lo = 2 if vocab > 4 else 0
    return [([] if bos is None else [bos]) + [int(t) for t in rng.integers(lo, vocab, n - (bos is not None))]
            for n in PROMPT_LENGTHS]


def eos_ids(hub: dict) -> set[int]:
    eos = hub.get("eos_token_id")
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _one_device_layout(model):
    return make_layout(model, make_mesh("1x1", jax.devices()[:1]))


def dpjax_outputs(folder: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> dict:
    """dpjax's greedy continuations (stopping after an eos id, as transformers does) and
    last-position log-probs: the full forward of the padded batch at each step (causal:
    the padding never reaches a real position), no cache, one compile."""
    T = max(len(p) for p in prompts) + new_tokens
    model, hub = model_from_hf(folder, seq_len=T)
    params = load_params(folder, model, _one_device_layout(model))
    logprobs = jax.jit(lambda p, x: jax.nn.log_softmax(model.apply(p, x), -1))
    tokens = np.zeros((len(prompts), T), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    first = np.asarray(logprobs(params, tokens))
    last = [first[r, len(p) - 1].tolist() for r, p in enumerate(prompts)]
    greedy, eos = [[] for _ in prompts], eos_ids(hub)
    for step in range(new_tokens):
        out = first if step == 0 else np.asarray(logprobs(params, tokens))
        for r, p in enumerate(prompts):
            if greedy[r] and greedy[r][-1] in eos:
                continue
            tokens[r, len(p) + step] = int(np.argmax(out[r, len(p) + step - 1]))
            greedy[r].append(int(tokens[r, len(p) + step]))
    return {"greedy": greedy, "logprobs": last, "model": model.name}


def transformers_outputs(folder: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> dict:
    """transformers' own: generate(do_sample=False) and the forward's last-position log-probs."""
    try:  # the reference, never a dependency of dpjax: imported only when asked to compare against it
        import transformers  # first: without it, torch's slow import is not needed
        import torch
    except ImportError:
        raise UserError("verify compares against HuggingFace transformers, which is not installed here "
                        "(pip install transformers torch), or pass --expected FILE") from None
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = sorted(eos_ids(json.load(open(os.path.join(folder, "config.json")))))
    greedy, logprobs = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            logprobs.append(torch.log_softmax(model(x).logits[0, -1].double(), -1).float().tolist())
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=eos[0] if eos else 0)
        new = [int(t) for t in out[0, len(ids):]]
        stop = [i for i, t in enumerate(new) if t in eos]
        greedy.append(new[:stop[0] + 1] if stop else new)
    return {"greedy": greedy, "logprobs": logprobs, "by": f"transformers {transformers.__version__}"}


def round_trip(folder: str) -> dict:
    """Import then export (in the folder's dtype): the tensors that came back with the
    same bytes, of how many, and whether config.json came back unchanged."""
    model, hub = model_from_hf(folder)
    params = load_params(folder, model, _one_device_layout(model))
    with tempfile.TemporaryDirectory() as out:
        export(params, model, out, dtype=Origin(hub).dtype or "float32", base_config=hub)
        want, got = Tensors(folder), Tensors(out)
        names = sorted(want.names())
        same = [n for n in names if n in got.names() and np.asarray(got[n]).tobytes() == np.asarray(want[n]).tobytes()]
        return {"tensors": len(names), "equal": len(same), "extra": sorted(set(got.names()) - set(names)),
                "config_equal": read_config(out) == hub}


def train_losses(folder: str, mesh: str, steps: int = 5, lr: float = 0.1) -> list[float]:
    """The losses of `steps` steps of Nesterov momentum (0.9) from the folder's weights on
    `mesh`, by `python -m dpjax.train` as a process (nothing here imports the trainer, a
    layer above), on a token file that repeats one random 16-token phrase (8 rows of 16
    tokens a step): a model learns it within a few steps, so the losses fall.

    Momentum, not AdamW: its update is linear in the gradient, so two layouts' round-off
    (their gradients differ by ~1e-8, each within ~7e-8 of the float64 gradient) stays that
    small in the losses, while a layout's wrong gradient shows in full. AdamW's first
    update is lr g / (|g| + eps) per element: where |g| is ~10 eps (after clipping) a
    round-off of 2e-8 moves it by lr * 0.007, so its losses part by ~1e-5 on an element
    drawn by chance (the Llama fixture: 1.8e-5 after 5 steps, from one K/V weight whose
    gradient is 1.6e-7), and they compare the gradients less (its update is nearly sign(g))."""
    vocab = read_config(folder)["vocab_size"]
    phrase = np.random.default_rng(0).integers(0, vocab, 16)
    wide = vocab > 2**16  # uint32 ids, which the file's name says
    with tempfile.TemporaryDirectory() as scratch:
        metrics = os.path.join(scratch, "metrics.jsonl")
        data = os.path.join(scratch, "tokens.u32.bin" if wide else "tokens.bin")
        np.tile(phrase, 256).astype(np.uint32 if wide else np.uint16).tofile(data)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this dpjax's root
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))}
        done = subprocess.run([sys.executable, "-m", "dpjax.train", "--init-from", f"hf:{os.path.abspath(folder)}",
                               "--mesh", mesh, "--steps", str(steps), "--optimizer", "momentum", "--lr", str(lr),
                               "--batch-size", "8", "--seq-len", "16", "--data", data, "--eval-every", "0",
                               "--sample-tokens", "0", "--metrics", metrics, "--progress", "none"],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise UserError(f"training from {folder} on {mesh} failed (exit {done.returncode}): {last}")
        return [r["loss"] for r in map(json.loads, open(metrics)) if "step" in r and "loss" in r]


def card(folder: str, ours: dict, theirs: dict, trip: dict, new_tokens: int, trained: dict | None = None,
         name: str | None = None) -> tuple[str, bool]:
    """(the verification card, markdown: what was compared, against what, and the figures;
    whether every comparison is within its bound)."""
    hub = read_config(folder)
    family = of_hub(hub, folder)
    equal = sum(a == b for a, b in zip(ours["greedy"], theirs["greedy"]))
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(ours["logprobs"],
                                                                                  theirs["logprobs"]))
    n = len(theirs["greedy"])
    shape = ", ".join(f"{k} {hub[k]}" for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "intermediate_size",
                                               "vocab_size", "tie_word_embeddings") if k in hub)
    lines = [f"# {family.architecture}", "",
             f"dpjax model `{family.name}` (`--model {family.name}`), read from `{name or folder}` ({shape}).", "",
             "| check | reference | result |", "|---|---|---|",
             f"| greedy continuations of {n} prompts ({new_tokens} new tokens at most) | {theirs['by']} "
             f"`generate(do_sample=False)` | {equal} of {n} equal |",
             f"| last-position log-probs of the {n} prompts | {theirs['by']} forward, log-softmax | "
             f"largest difference {diff:.1e} (bound 1e-4) |",
             f"| import, then export ({trip['tensors']} tensors) | the folder's safetensors and config.json | "
             f"{trip['equal']} of {trip['tensors']} bit for bit, config.json "
             f"{'unchanged' if trip['config_equal'] else 'changed'} |"]
    older = os.path.join(folder, "config.4x.json")  # a fixture's: the same model saved by transformers 4.x
    same_4x = None
    if os.path.isfile(older):
        same_4x = config_from_hub(json.load(open(older)), older) == config_from_hub(hub, folder)
        lines.append(f"| config.json as transformers 4.x writes it (`config.4x.json`) | the 5.x config.json | "
                     f"{'the same dpjax config' if same_4x else 'another dpjax config'} |")
    spread = 0.0
    if trained:
        first = next(iter(trained.values()))
        spread = max(abs(a - b) for losses in trained.values() for a, b in zip(losses, first))
        meshes = ", ".join(f"`{m}`" for m in trained)
        lines.append(f"| {len(first)} training steps from it (Nesterov momentum 0.9, lr 0.1, a repeated phrase) "
                     f"on {meshes} | the losses on each other layout | largest difference {spread:.1e} (bound 1e-5) |")
        lines += ["", "Losses by layout (`data x model`):", "", "| mesh | " + " | ".join(
            f"step {i + 1}" for i in range(len(first))) + " |", "|---|" + "---|" * len(first)]
        lines += [f"| {m} | " + " | ".join(f"{x:.6f}" for x in losses) + " |" for m, losses in trained.items()]
    finite = all(np.isfinite(x) for v in (trained or {}).values() for x in v)
    verdict = equal == n and diff <= 1e-4 and trip["equal"] == trip["tensors"] and not trip["extra"] and \
        trip["config_equal"] and same_4x is not False and spread <= 1e-5 and finite
    lines += ["", f"**{'Verified' if verdict else 'NOT verified'}**: "
              f"{'every' if verdict else 'not every'} comparison within its bound."]
    return "\n".join(lines) + "\n", verdict


EXPECTED = ("prompts", "greedy", "logprobs")  # what `--expected` must hold (make_model_cards.py writes it)


def read_expected(path: str) -> dict:
    """A fixture's saved reference outputs; a file that is not one is a one-line UserError."""
    try:
        with open(path) as fh:
            saved = json.load(fh)
    except OSError as e:
        raise UserError(f"--expected {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UserError(f"--expected {path} is not JSON ({e})") from None
    missing = [k for k in EXPECTED if not isinstance(saved, dict) or k not in saved]
    if missing:
        raise UserError(f"--expected {path} holds no {', '.join(missing)}: it is not a file of saved reference "
                        f"outputs (tests/fixtures/make_model_cards.py writes them: {', '.join(EXPECTED)})")
    return saved


def verify(folder: str, expected: str | None = None, train: tuple = (), new_tokens: int = NEW_TOKENS,
           name: str | None = None) -> tuple[str, bool]:
    """(the card, whether every comparison passed). `expected`: saved reference outputs
    (prompts, greedy, logprobs, made_by) in place of running transformers."""
    hub = read_config(folder)
    if expected is not None:
        saved = read_expected(expected)
        prompts, new_tokens = saved["prompts"], saved.get("new_tokens", new_tokens)
        theirs = {"greedy": saved["greedy"], "logprobs": saved["logprobs"],
                  "by": saved.get("made_by", expected).split(", ", 1)[-1].split(", torch")[0]}
    else:
        bos = hub.get("bos_token_id")
        prompts = default_prompts(hub["vocab_size"], bos if isinstance(bos, int) else None)
        theirs = transformers_outputs(folder, prompts, new_tokens)
    ours = dpjax_outputs(folder, prompts, new_tokens)
    trip = round_trip(folder)
    trained = {m: train_losses(folder, m) for m in train} or None
    return card(folder, ours, theirs, trip, new_tokens, trained, name)
