"""A dpjax model's parameters -> a HuggingFace folder of its family (safetensors shards, index, config.json),
and the dpjax checkpoints `python -m dpjax.hf` reads and writes.

Export fetches one layer of one leaf at a time to the host (a training run's arrays are
sharded over any mesh; a layer is the unit the Hub's files hold) and writes each Hub
tensor as it comes, so the host holds one layer's tensors, never the model. An
untouched import exports every tensor bit for bit: the conversion is transposes and
reshapes, and the dtype is the imported file's (`torch_dtype`) unless another is asked.
config.json is the imported one changed only where the model differs, and the tokenizer,
chat template and generation config come along (`dpjax.hf.identity`). An existing export
is not replaced unless asked (`check_out`); asked, the shards of the earlier one go.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from dpjax.hf import identity
from dpjax.hf import layouts
from dpjax.hf.family import of_model
from dpjax.hf.files import DTYPES, INDEX, SINGLE, HFError, write_folder
from dpjax.hf.load import CONFIG
from dpjax.recovery.checkpoint import Checkpointer

TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default, 5 GB


def hub_names(model) -> list[tuple[str, tuple, int | None]]:
    """(Hub name, dpjax leaf key, layer or None) in the order the Hub writes them."""
    c, family = model.config, of_model(model.name)
    out = [("model.embed_tokens.weight", ("embed_VmxD",), None)]
    for i in range(c.n_layers):
        for key in family.layer:
            out += [(n, key, i) for n in family.layer_names(key, i, model.experts)]
    out.append(("model.norm.weight", ("norm", "scale_D"), None))
    if not c.tie_embeddings:
        out.append(("lm_head.weight", ("unembed_VmxD",), None))
    return out


def check_out(folder: str, overwrite: bool) -> bool:
    """Before anything is read: `folder` is new, empty, or --overwrite says its files may go.
    Returns whether it made the folder (its caller removes it again if the export fails)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise HFError(f"{folder} is a file; pass a folder to export to")
    there = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if there and not overwrite:
        named = [f for f in there if f in (CONFIG, *identity.FILES)] or there
        raise HFError(f"{folder} is not empty (it holds {', '.join(named[:3])}{', ...' if len(named) > 3 else ''}); "
                      "pass a new folder, or --overwrite to replace its files (nothing was written)")
    made = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)  # a read-only place fails here, before the checkpoint is read
    return made


def _is_weights(name: str) -> bool:
    return name in (SINGLE, INDEX) or (name.startswith("model-") and name.endswith(".safetensors"))


def export(params, model, folder: str, *, dtype: str = "float32", base_config: dict | None = None,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Writes `params` (a dpjax model's tree, any sharding, the layer stack L x ...) to
    `folder` in the Hub's layout, config.json from `base_config` (the imported one)
    changed only where the model differs; returns the files written. Weight files of an
    earlier export there that this one does not write are removed (a loader would read a
    stale model.safetensors beside a new index)."""
    if dtype not in TORCH_DTYPES:
        raise HFError(f"export dtype {dtype!r}: choose one of {', '.join(TORCH_DTYPES)}")
    np_dtype = DTYPES[TORCH_DTYPES[dtype]]
    os.makedirs(folder, exist_ok=True)
    table, family = {hub: (key, i) for hub, key, i in hub_names(model)}, of_model(model.name)
    cache = {}  # the last (leaf, layer) fetched: k_proj and v_proj come from one wkv layer

    def leaf(key):
        tree = params[model.LAYERS] if key in family.layer else params
        for k in key:
            tree = tree[k]
        return tree

    def fetch(hub):
        key, i = table[hub]
        if (key, i) not in cache:
            cache.clear()
            value = leaf(key) if i is None else leaf(key)[i]
            named = [family.outer[key]] if i is None else family.layer_names(key, i, model.experts)
            cache[(key, i)] = layouts.hub_tensors(key, np.asarray(jax.device_get(value)), named)
        return cache[(key, i)][hub]

    def spec(hub):
        key, i = table[hub]
        named = [family.outer[key]] if i is None else family.layer_names(key, i, model.experts)
        return np_dtype, layouts.hub_shapes(key, model.config)[named.index(hub)]

    files = write_folder(folder, list(table), spec, fetch, max_shard_bytes)
    for stale in sorted(set(filter(_is_weights, os.listdir(folder))) - set(files)):
        os.remove(os.path.join(folder, stale))
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(identity.hub_config(model, dtype, base_config), f, indent=2)
    return [*files, CONFIG]


def save_checkpoint(folder: str, params, model, hub_config: dict | None, dtype: str,
                    source: str | None = None) -> None:
    """A dpjax checkpoint of imported parameters (step 0, parameters only), its record
    naming the model (what --init-from and export rebuild it from), the Hub config and
    the Hub folder `source` (whose tokenizer export copies)."""
    ckpt = Checkpointer(folder)
    hf = {"config": hub_config or {}, "dtype": dtype, "folder": os.path.abspath(source) if source else None}
    ckpt.save(0, {"params": params}, {"model": model.describe(), "step": 0, "hf": hf})
    ckpt.close()
