"""PEFT LoRA adapters in and out: `adapter_config.json` + `adapter_model.safetensors`.

PEFT keeps each adapted `nn.Linear` (W: out x in) as lora_A (r x in) and lora_B (out x r),
computing W + (lora_alpha / r) B A, named after the module they adapt:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`. dpjax's adapters
(`dpjax.models.lora`) keep A as in x r and B as r x out with the heads as their own
dimensions (q's B: r x H x K), stacked over the layers: the conversion is a transpose and
a reshape, exact in any dtype, as for the base weights (`dpjax.hf.llama`).

What dpjax does not compute is refused in one line (DoRA, rsLoRA, per-module ranks or
alphas, bias, modules trained whole beside the adapters, some layers only), and so is an
adapter whose shapes, or whose base model's name, disagree with the base it is put on.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from dpjax.hf.files import HFError, _entry, read_header, write_file
from dpjax.models.lora import LoraConfig, a_key, b_key, targets_of

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
# keys whose default is all dpjax computes; another value is refused, naming the key
_DEFAULTS = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
             "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False,
             "lora_bias": False, "target_parameters": None, "trainable_token_indices": None,
             "layer_replication": None, "exclude_modules": None}


def name(i: int, t, which: str) -> str:
    return f"{PREFIX}{i}.{t.hub}.lora_{which}.weight"


class AdapterConfig:
    """adapter_config.json as dpjax reads it: the LoRA settings and the base model's name."""

    def __init__(self, folder: str, raw: dict):
        self.folder, self.raw = folder, raw
        for key, default in _DEFAULTS.items():
            value = raw.get(key)
            if not (value is None or value is False or value == {} or value == [] or value == default):
                raise HFError(f"{folder}: {CONFIG} sets {key}={raw[key]!r}; dpjax's LoRA computes {key}="
                              f"{default!r} only")
        modules = raw.get("target_modules") or []
        modules = [modules] if isinstance(modules, str) else modules
        self.lora = LoraConfig(int(raw["r"]), float(raw.get("lora_alpha", 8)), float(raw.get("lora_dropout", 0.0)),
                               targets_of(modules, f"{folder}: {CONFIG}"))
        self.base = raw.get("base_model_name_or_path")

    def as_flag(self) -> str:
        c = self.lora
        return f"r={c.r},alpha={c.alpha},dropout={c.dropout},targets={','.join(c.targets)}"


def read_config(folder: str, source: str | None = None) -> AdapterConfig:
    """`folder`'s adapter_config.json; with `source` (the --init-from it is put on), checked
    to be that base's first (`check_base`), before its targets are put on a model."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise HFError(f"--adapter {folder}: no {CONFIG} (a PEFT adapter folder has one)")
    with open(path) as f:
        raw = json.load(f)
    if source is not None:
        check_base(folder, raw.get("base_model_name_or_path"), source)
    return AdapterConfig(folder, raw)


def read_weights(folder: str) -> dict:
    """Every tensor of the adapter's safetensors file, as numpy arrays (adapters are small)."""
    path = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(path):
        raise HFError(f"--adapter {folder}: no {WEIGHTS}")
    header, start = read_header(path)
    out = {}
    for key, info in header.items():
        if key != "__metadata__":
            dtype, shape, begin = _entry(path, key, info, start)
            out[key] = np.array(np.memmap(path, dtype=dtype, mode="r", offset=begin, shape=shape))
    return out


def check_base(folder: str, base: str | None, source: str | None) -> None:
    """The adapter's base model (`base`: PEFT's base_model_name_or_path) is the one it is put
    on: compared by the last part of each name (a Hub id and its downloaded folder agree)."""
    if not base or not source or not source.startswith("hf:"):  # a dpjax checkpoint has a name of its own
        return
    want = os.path.basename(os.path.normpath(base))
    got = os.path.basename(os.path.normpath(source.removeprefix("hf:")))
    if want != got:
        raise HFError(f"--adapter {folder} was made for {base}, not {source}: put it on its own base "
                      "model (or fix base_model_name_or_path in its adapter_config.json if that is the same model)")


def adapters_of(folder: str, model, source: str | None = None) -> dict:
    """The PEFT adapter in `folder` as `model`'s adapter tree (`dpjax.models.lora.Lora`: its
    targets, r and alpha must be the file's), float32 numpy arrays stacked over the layers."""
    adapter = read_config(folder, source)
    made_for = f"{folder} (made for {adapter.base or 'a base it does not name'})"
    put_on = f"--model {model.name}" + (f" from {source}" if source else "")
    if (adapter.lora.r, adapter.lora.alpha, adapter.lora.targets) != (model.lora.r, model.lora.alpha,
                                                                        model.lora.targets):
        raise HFError(f"--adapter {folder} is r={adapter.lora.r}, alpha={adapter.lora.alpha:g}, targets="
                      f"{','.join(adapter.lora.targets)}; --lora asks r={model.lora.r}, alpha={model.lora.alpha:g}, "
                      f"targets={','.join(model.lora.targets)}: leave --lora out to take the adapter's")
    tensors, used, out, r = read_weights(folder), set(), {}, model.lora.r
    for t in model.targets:
        i_dims, o_dims = model.dims(t)
        a_layers, b_layers = [], []
        for i in range(model.config.n_layers):
            a, b = name(i, t, "A"), name(i, t, "B")
            for n, want in ((a, (r, int(np.prod(i_dims)))), (b, (int(np.prod(o_dims)), r))):
                if n not in tensors:
                    raise HFError(f"--adapter {made_for}: no tensor {n}, which {put_on} needs (an adapter for "
                                  "another base model?)")
                if tuple(tensors[n].shape) != want:
                    raise HFError(f"--adapter {made_for}: {n} has shape {list(tensors[n].shape)}, {put_on} "
                                  f"needs {list(want)}: an adapter for another base model")
            used.update((a, b))
            a_layers.append(tensors[a].astype(np.float32).T.reshape(*i_dims, r))
            b_layers.append(tensors[b].astype(np.float32).T.reshape(r, *o_dims))
        out[a_key(t)], out[b_key(t)] = np.stack(a_layers), np.stack(b_layers)
    left = sorted(set(tensors) - used)
    if left:
        raise HFError(f"--adapter {folder}: tensors dpjax's LoRA has no place for: {', '.join(left[:3])}"
                      + (f" and {len(left) - 3} more" if len(left) > 3 else ""))
    return out


def export(params, model, folder: str, *, dtype=np.float32, base: str | None = None) -> list[str]:
    """`model`'s adapters in `params` (any sharding) -> a PEFT adapter folder, the tensors in
    numpy `dtype`; `base`: the base model's name or folder (PEFT's base_model_name_or_path).
    Returns the files written."""
    np_dtype, c = np.dtype(dtype), model.lora
    adapters = jax.device_get(params[model.LAYERS]["lora"])
    tensors = {}
    for i in range(model.config.n_layers):
        for t in model.targets:
            tensors[name(i, t, "A")] = np.asarray(adapters[a_key(t)][i]).reshape(-1, c.r).T
            tensors[name(i, t, "B")] = np.asarray(adapters[b_key(t)][i]).reshape(c.r, -1).T
    write_file(os.path.join(folder, WEIGHTS), list(tensors), lambda n: (np_dtype, tensors[n].shape),
               tensors.__getitem__, {"format": "pt"})
    hub = {t.name: t.hub.split(".")[-1] for t in model.targets}
    config = {**_DEFAULTS, "task_type": "CAUSAL_LM", "r": c.r, "lora_alpha": c.alpha, "lora_dropout": c.dropout,
              "target_modules": [hub[n] for n in c.targets], "base_model_name_or_path": base,
              "inference_mode": True, "init_lora_weights": True, "revision": None}
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return [CONFIG, WEIGHTS]
