"""LoRA in the plan: the model --lora or --adapter asks for (the base wrapped with its
adapters, `dpjax.models.lora`), and the part of its parameters the update rule is built over
(the adapters: `Split`), refused in one line on the layouts it does not run on."""

from __future__ import annotations

from dpjax.compression import Exchange, Form
from dpjax.hf.adapter import adapters_of, read_config
from dpjax.models import lora
from dpjax.models.lora import Lora, Split
from dpjax.plan.checks import UsageError
from dpjax.settings import Settings


def lora_model(s: Settings, model):
    """`model` with the adapters --lora asks for, or --adapter's folder holds (its settings
    when --lora is not given)."""
    text = s.lora
    if s.adapter is None:
        return lora.wrap(model, text)

    if s.init_from is None:
        raise UsageError(f"--adapter {s.adapter} is put on a base model: give that with --init-from hf:DIR")
    # another base's adapter is refused naming both bases before its targets meet this model's layers
    model = lora.wrap(model, text or read_config(s.adapter, s.init_from).as_flag())
    adapters_of(s.adapter, model, s.init_from)  # another base's adapter is refused now, before anything is written
    return model


def trained_split(model, layout, exchange: Exchange):
    """The trained part of a LoRA model's parameters and the frozen rest (`dpjax.models.lora.Split`),
    or None: every parameter trained."""
    if not isinstance(model, Lora):
        return None
    if exchange.form is Form.FSDP:
        raise UsageError(f"--lora with --fsdp and --compression {exchange.compression}: FSDP's error feedback "
                         "mirrors every parameter; compress without --fsdp, or FSDP without error feedback")
    if model.lora.dropout and (layout.pipeline is not None or layout.context_axes):
        raise UsageError(f"--lora dropout={model.lora.dropout} with a {'stage' if layout.pipeline else 'context'} "
                         "axis is not built yet (the masks read each row's index in the step's batch, which a "
                         "pipeline's schedule does not carry; on a context axis untested); use dropout=0, or a mesh "
                         "without it")
    return Split(model.LAYERS)

