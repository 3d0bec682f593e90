"""Horovod's `Compression`: `hvd.Compression.none`, `.fp16`, and every other method
registered in `dpjax.compression` (`.bf16`, ...), by its name."""

from __future__ import annotations

from dpjax import compression


class _Compression:
    """Horovod's `Compression` namespace, read from the registry at every use: an
    attribute is the name a `compression=` argument takes (`none` is None)."""

    none = None

    def __getattr__(self, name: str) -> str:
        if name in compression.names():
            return name
        raise AttributeError(f"hvd.Compression has no {name!r}; it has none, {', '.join(compression.names())}")

    def __dir__(self):
        return ["none", *compression.names()]


Compression = _Compression()
