"""Which layouts and models a task (`dpjax.tasks`) runs on: the pairs not built yet are
refused in one line before anything compiles."""

from __future__ import annotations

from dpjax.errors import UserError
from dpjax.mesh import STAGE
from dpjax.models import MODELS
from dpjax.models.base import Decoder


def check_task(s, model, mesh) -> None:
    if s.task == "lm":
        return
    if not isinstance(model, Decoder):
        decoders = ", ".join(n for n, e in MODELS.items() if issubclass(e.build, Decoder))
        raise UserError(f"--task {s.task} needs a decoder (--model {decoders}); --model {model.name} is not one")
    if mesh.shape.get(STAGE, 1) > 1:
        raise UserError(f"--task {s.task} on a stage axis is not built yet (the pipeline's micro-batches carry "
                        "tokens only); use the data, model, context or FSDP axes")
    if model.experts:
        raise UserError(f"--task {s.task} with --experts is not built yet (the router's losses are not weighted "
                        "per answer token)")
