"""A HuggingFace folder -> the dpjax model of its family and its parameters, placed on a layout.

Each device's block of each parameter is read from the memory-mapped safetensors and
put on its device (`jax.make_array_from_callback`): for a sharded layout no whole
weight is ever on the host, only the rows and columns one block needs (devices that
hold the same block read it once). The values are the file's, cast to the layout's
parameter dtype (float32 by default: exact for float32, bfloat16 and float16 files).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from dpjax.hf import layouts
from dpjax.hf.config import config_from_hub
from dpjax.hf.family import FAMILIES, of_hub
from dpjax.hf.files import HFError, Tensors
from dpjax.models import get_model

CONFIG = "config.json"
HF_PREFIX = "hf:"


def read_config(folder: str) -> dict:
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise HFError(f"{folder}: no {CONFIG} (a HuggingFace model folder has one)")
    with open(path) as f:
        return json.load(f)


def model_from_hf(folder: str, seq_len: int | None = None):
    """(the dpjax model of its family, the folder's config.json). seq_len: the longest
    sequence the run needs (default: the config's max_position_embeddings)."""
    hub = read_config(folder)
    fields = config_from_hub(hub, folder)
    seq_len = seq_len or hub.get("max_position_embeddings", 2048)
    return get_model(of_hub(hub, folder).name, seq_len=seq_len, **fields), hub


def _slices(idx: tuple, shape: tuple) -> tuple:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))


def load_params(folder: str, model, layout, dtype=np.float32):
    """The parameters of `model` (made by `model_from_hf(folder)`) read from `folder`'s
    safetensors, each a global array in `layout`'s sharding, in `dtype`."""
    tensors, c, family = Tensors(folder), model.config, FAMILIES[model.name]
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    V = layout.pipeline.virtual_stages if layout.pipeline is not None else 1
    shardings = layout.shardings()
    used = set()

    def hub_of(key, i):
        named = [family.outer[key]] if i is None else family.layer_names(key, i, model.experts)
        hub = [tensors[n] for n in named]
        for t, want, n in zip(hub, layouts.hub_shapes(key, c), named):
            if t.shape != want:
                raise HFError(f"{folder}: {n} has shape {t.shape}, config.json says {want}")
        return hub

    def place(path, leaf):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        stacked = key[0] == model.LAYERS
        key = key[1:] if stacked else key
        sharding = _at(shardings, path)
        if stacked:
            for i in range(c.n_layers):
                hub_of(key, i)
                used.update(family.layer_names(key, i, model.experts))
            stored = leaf.shape if V == 1 else (V, leaf.shape[0] // V, *leaf.shape[1:])

            def block(idx):
                idx = _slices(idx, stored)
                if V > 1:  # stored V x L/V: layer v * L/V + j
                    layers = [v * stored[1] + j for v in range(*idx[0].indices(V)[:2])
                              for j in range(*idx[1].indices(stored[1])[:2])]
                    rest = idx[2:]
                else:
                    layers, rest = range(idx[0].start, idx[0].stop), idx[1:]
                out = np.stack([layouts.read_layer_block(key, hub_of(key, i), rest, c.head_width)
                                for i in layers]).astype(dtype)
                return out.reshape(tuple(s.stop - s.start for s in idx))
            return place_blocks(stored, sharding, block)
        hub = hub_of(key, None)[0]
        used.add(family.outer[key])
        return place_blocks(leaf.shape, sharding, lambda idx: np.asarray(hub[_slices(idx, leaf.shape)]).astype(dtype))

    params = jax.tree_util.tree_map_with_path(place, abstract)
    ignored = {n for n in tensors.names() if n.endswith("rotary_emb.inv_freq") or
               (c.tie_embeddings and n == "lm_head.weight")}  # buffers, and a tied head written out
    left = sorted(set(tensors.names()) - used - ignored)
    if left:
        raise HFError(f"{folder}: tensors dpjax's {family.architecture} has no place for: {', '.join(left[:5])}"
                      + (f" and {len(left) - 5} more" if len(left) > 5 else ""))
    return params


def place_blocks(shape, sharding, read):
    """A global array of `shape` in `sharding` whose blocks `read(index)` gives: each
    distinct block read once, copied to each device that holds it, and let go as soon as
    it is there (`jax.make_array_from_callback` kept every host block alive beside its
    device copy on CPU: the embedding twice over)."""
    by_index = {}
    for device, idx in sharding.addressable_devices_indices_map(shape).items():
        by_index.setdefault(tuple((s.start, s.stop, s.step) for s in idx), (idx, []))[1].append(device)
    arrays = []
    for idx, devices in by_index.values():
        block = read(idx)
        arrays += jax.block_until_ready([jax.device_put(block, d) for d in devices])
        del block
    order = {d: i for i, d in enumerate(sharding.addressable_devices_indices_map(shape))}
    arrays.sort(key=lambda a: order[next(iter(a.devices()))])
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _at(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", k)]
    return tree
