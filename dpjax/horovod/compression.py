"""Horovod's `Compression`: `hvd.Compression.none`, `.fp16`, and every other method
registered in `dpjax.compression` (`.bf16`, `.sign`, `.int8`, ...), by its name.

A method that takes a number (PowerSGD's rank, top-k's fraction) is a function of it:
`hvd.Compression.powersgd(4, start=100)` is "powersgd:4,start=100". The methods with
error feedback keep state across steps, so they go to `hvd.DistributedOptimizer` (its
state holds each rank's error buffer); a one-off `hvd.allreduce` refuses them."""

from __future__ import annotations

from dpjax import compression


def _spec(name: str):
    def spec(number, ef: bool = True, start: int = 0) -> str:
        return compression.grammar.spell(name, number, ef=ef, start=start)

    spec.__name__ = name
    spec.__doc__ = f"The compression {name}:N ({compression.registry.get(name).number}) as a spec string."
    return spec


class _Compression:
    """Horovod's `Compression` namespace, read from the registry at every use: an
    attribute is the name a `compression=` argument takes (`none` is None), or for a
    method with a number, the function that makes its spec."""

    none = None

    def __getattr__(self, name: str):
        method = compression.registry.get(name)
        if method is None:
            raise AttributeError(f"hvd.Compression has no {name!r}; it has none, {', '.join(compression.names())}")
        return name if method.number is None else _spec(name)

    def __dir__(self):
        return ["none", *compression.names()]


Compression = _Compression()
