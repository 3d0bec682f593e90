"""Models for dpjax, imported as `dpjax.models`.

A model is a small object with `config`, `init(key) -> params`, `loss(params, batch,
par=DENSE)` (`batch`: int32 tokens of shape (B, T+1); the loss predicts tokens[:, 1:]
from tokens[:, :-1]; `par`, a `dpjax.tensor_parallel.Parallel`, names the model axis
inside a sharded step), `SPECS` (its one sharding table: leaf name -> PartitionSpec over
`model`) and `flops_per_token()`.
"""

from __future__ import annotations

from dpjax.models.gpt import GPT, GPTConfig
from dpjax.models.mlp import MLP, MLPConfig

MODELS = {"gpt": (GPT, GPTConfig), "mlp": (MLP, MLPConfig)}


def get_model(name: str, **overrides):
    """Builds a model by name; `overrides` set config fields (unknown ones are ignored)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    cls, cfg_cls = MODELS[name]
    fields = cfg_cls.__dataclass_fields__
    return cls(cfg_cls(**{k: v for k, v in overrides.items() if k in fields and v is not None}))


__all__ = ["GPT", "GPTConfig", "MLP", "MLPConfig", "MODELS", "get_model"]
