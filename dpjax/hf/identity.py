"""What makes an exported model the model it was, beside its weights: the imported
config.json (token ids, context length, rope, dtype), the tokenizer, the chat template and
the generation config.

A checkpoint remembers where it came from: `python -m dpjax.hf import` records the Hub
config and folder in the checkpoint; a training run's `run.json` (beside its checkpoints)
records its `--init-from`, `hf:DIR` or a dpjax checkpoint, followed in turn. Export then
writes the imported config changed only where the model differs (`hub_config`) and copies
the files below from the imported folder.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from dpjax.hf.config import config_to_hub
from dpjax.hf.family import of_model
from dpjax.hf.load import CONFIG, HF_PREFIX, read_config
from dpjax.hf.source import read_record
from dpjax.recovery.checkpoint import RUN_FILE

# The files of a Hub folder that say how to talk to the model (transformers' and vLLM's)
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
         "chat_template.jinja", "generation_config.json")
DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers 4 writes torch_dtype, 5 writes dtype


@dataclass(frozen=True)
class Origin:
    """The Hub model a checkpoint descends from: its config.json (None when it can no
    longer be read), and its folder (None when the record does not name one or it is no
    longer there: `missing` names it)."""

    config: dict | None
    folder: str | None = None
    missing: str | None = None

    @property
    def dtype(self) -> str | None:
        config = self.config or {}
        return next((config[k] for k in DTYPE_KEYS if isinstance(config.get(k), str)), None)


def _run_file(folder: str) -> dict:
    try:
        with open(os.path.join(folder, RUN_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def origin(ckpt: str, record: dict | None, depth: int = 4) -> Origin | None:
    """Where the checkpoint `ckpt` (whose record is `record`) came from, or None (a model
    trained from scratch, or a chain longer than `depth`)."""
    hf = (record or {}).get("hf") or {}
    if hf.get("config"):
        folder = hf.get("folder")
        there = folder if folder and os.path.isfile(os.path.join(folder, CONFIG)) else None
        return Origin(hf["config"], there, folder if folder and not there else None)
    run = _run_file(ckpt)
    source = run.get("init_from") or (run.get("settings") or {}).get("init_from")
    if not source or depth <= 0:
        return None
    if source.startswith(HF_PREFIX):
        folder = source[len(HF_PREFIX):]
        if not os.path.isfile(os.path.join(folder, CONFIG)):
            return Origin(None, None, folder)
        return Origin(read_config(folder), folder)
    if not os.path.isdir(source):
        return Origin(None, None, source)
    return origin(source, read_record(source), depth - 1)


def hub_config(model, dtype: str, base: dict | None) -> dict:
    """config.json for `model` in `dtype`: the imported `base` with only what differs
    changed (the model's own fields where they differ, the dtype where it does), every
    other key (token ids, max_position_embeddings, rope) as it was; without a base, the
    config the dpjax model describes."""
    made = config_to_hub(model.config, dtype, base)  # base's layout; its rope keys as written when unchanged
    if base is None:
        return made
    out = dict(base)  # max_position_embeddings stays: a run's --seq-len is its window, not the model's reach
    family = of_model(model.name)
    model_keys = {family.key_in(key, base) for key, _ in family.fields.values()} | {"head_dim"}
    # a null head_dim (Mixtral's config) reads as hidden_size / num_attention_heads: kept null when it is that
    default_head = base.get("head_dim") is None and made.get("head_dim") == (
        base.get("hidden_size", 0) // max(1, base.get("num_attention_heads", 1)))
    out.update({k: made[k] for k in model_keys if k in base and base[k] != made[k]
                and not (k == "head_dim" and default_head)})
    for k in ("rope_parameters", "rope_scaling", "rope_theta"):  # one layout, the model's rope
        if k in made:
            out[k] = made[k]
        else:
            out.pop(k, None)
    if (Origin(base).dtype or "float32") != dtype:  # no key: transformers reads float32
        for k in [k for k in DTYPE_KEYS if k in base] or ["torch_dtype"]:
            out[k] = dtype
    return out


def copy_files(origin_: Origin | None, out: str) -> list[str]:
    """The origin folder's tokenizer, chat template and generation config, copied to `out`."""
    if origin_ is None or origin_.folder is None:
        return []
    copied = []
    for name in FILES:
        src = os.path.join(origin_.folder, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, name))
            copied.append(name)
    return copied
