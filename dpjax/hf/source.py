"""Where a run's starting weights come from: `hf:DIR` (a HuggingFace folder) or CKPT (a
dpjax checkpoint folder: `python -m dpjax.hf import`'s, or a training run's --ckpt-dir),
read onto a layout. `--init-from` (train), `python -m dpjax.generate` and export call this.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from dpjax.hf.adapter import adapters_of
from dpjax.hf.files import HFError
from dpjax.hf.load import HF_PREFIX, load_params, model_from_hf
from dpjax.mesh import make_mesh
from dpjax.models import get_model
from dpjax.models.lora import Lora, LoraConfig, Split
from dpjax.recovery.checkpoint import CheckpointError, Checkpointer


def is_hf(source: str) -> bool:
    return source.startswith(HF_PREFIX)


def model_of(source: str, seq_len: int | None = None):
    """(the model, the Hub config or None, the dpjax record or None) that `source` holds."""
    if is_hf(source):
        model, hub = model_from_hf(source[len(HF_PREFIX):], seq_len)
        return model, hub, None
    record = read_record(source)
    fields = {k: v for k, v in record["model"].items() if k not in ("model", "virtual_stages")}
    if seq_len:
        fields["seq_len"] = seq_len
    lora = fields.pop("lora", None)  # a LoRA run's checkpoint: the base and its adapters
    model = get_model(record["model"]["model"], **fields)
    if lora is not None:
        model = Lora(model, LoraConfig(**{**lora, "targets": tuple(lora["targets"])}))
    return model, record.get("hf", {}).get("config"), record


def default_mesh(model, spec: str | None = None):
    """The mesh `spec` names, or every device here on `model` (as many as divide the
    heads, the MLP width and the vocabulary): each device reads and holds its block."""
    if spec is not None:
        return make_mesh(spec)
    n = len(jax.devices())
    while n > 1 and any(x % n for x in model.model_splits()):
        n -= 1
    return make_mesh(f"1x{n}", jax.devices()[:n])


def read_record(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise HFError(f"{folder}: no such checkpoint folder (a HuggingFace folder is given as hf:{folder})")
    return Checkpointer(folder).read_record()


def params_of(source: str, model, layout, record: dict | None = None, adapter: str | None = None, seed: int = 0):
    """`source`'s parameters in `layout`'s sharding (float32). A LoRA model's
    (`dpjax.models.lora`) from a source without adapters: the base's, with the PEFT adapter
    in folder `adapter` or fresh ones (drawn from `seed`)."""
    if isinstance(model, Lora) and (adapter or is_hf(source) or "lora" not in (
            record or read_record(source))["model"]):
        split = Split(model.LAYERS)
        base = params_of(source, model.base, dataclasses.replace(layout, specs=split.frozen(layout.specs)), record)
        fresh = adapters_of(adapter, model, source) if adapter else jax.jit(model.init_adapters)(
            jax.random.key(seed))
        return split.join(jax.device_put(fresh, split.trained(layout.shardings())), base)
    if is_hf(source):
        return load_params(source[len(HF_PREFIX):], model, layout)
    ckpt = Checkpointer(source)
    step = ckpt.newest_good()  # checked against its checksums: a corrupt newest one is named and passed over
    record = record or ckpt.read_record(step)
    V = record["model"].get("virtual_stages", 1)  # a pipeline's interleaved stack is stored V x L/V
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    saved = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct((V, x.shape[0] // V, *x.shape[1:]) if V > 1 and getattr(
            path[0], "key", None) == model.LAYERS else x.shape, x.dtype), abstract)
    stored_v = layout.pipeline.virtual_stages if layout.pipeline is not None else 1
    target = layout.shardings() if V == 1 and stored_v == 1 else None
    if target is not None:
        saved = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), saved, target)
    _check_shapes(source, model, ckpt.stored_metadata(step, "params"), saved)
    try:
        state = ckpt.restore_part(step, {"params": saved})
    except Exception as e:  # orbax raises many kinds; all mean the same to a user
        raise CheckpointError(f"{source}: its parameters cannot be read as {model.name} "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    params = state["params"]
    if V > 1 or stored_v > 1:  # back to L x ..., then as the layout stores them (its own V), onto it
        params = {**params, model.LAYERS: jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), params[model.LAYERS])}
        params = jax.device_put(layout.store(params), layout.shardings())
    return params


def _check_shapes(source: str, model, stored, want) -> None:
    """One line when the stored parameters' shapes are not those of the model the record
    describes (orbax would refuse too, but its reading threads then print their own
    tracebacks as the process exits): the first leaf that differs, both shapes."""
    if stored is None:  # no metadata to compare (an older layout): the restore says what is wrong
        return
    have = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(stored)}
    for path, x in jax.tree_util.tree_leaves_with_path(want):
        key = jax.tree_util.keystr(path)
        if key in have and have[key] != tuple(x.shape):
            raise CheckpointError(f"{source}: its parameter {key} is {have[key]} but the {model.name} its record "
                                  f"describes needs {tuple(x.shape)}: the weights and the record disagree")
