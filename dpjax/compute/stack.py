"""THE runner of a model's stacked layers: every layout and `dpjax.nn` run them here.

A model keeps its L identical layers stacked: every leaf of the stack carries a leading
layer axis (`w1_LsxDxFm` is L x D x F). `run(layer, stack_L, x, par)` is, per device,

    for each layer i (one lax.scan over the leading axis; a Python loop with scan off):
        w = stack_L[i]                 this layer's leaves
        w = gathered(w)                FSDP: all-gathered over the data axes now, one layer
                                       at a time, in the compute dtype (the gather's VJP
                                       reduce-scatters the layer's gradient in the backward)
        x = layer(w, x, par)           under jax.checkpoint by the remat policy

so compile time stays flat in depth (the layer is traced and compiled once), the
backward pass keeps what the remat policy says (`dpjax.compute.policy`), and FSDP never holds
more than one layer whole. A pipeline stage runs its share of the stack (a chunk of
L/S layers, already gathered) through the same function.

The remat unit is the layer together with its FSDP gather: with remat the backward
gathers the layer again rather than keeping the whole weights (ZeRO-3's memory bound).
"""

from __future__ import annotations

import jax
from jax import lax

from dpjax.compute.tensor_parallel import DENSE, Parallel


def depth(stack_L) -> int:
    """L: the layers in `stack_L` (the leading axis every leaf shares)."""
    sizes = {x.shape[0] for x in jax.tree.leaves(stack_L)}
    assert len(sizes) == 1, f"the stacked layers disagree on their count: {sizes}"
    return sizes.pop()


def run(layer, stack_L, x, par: Parallel = DENSE, *, path: tuple = (), index_L=None):
    """x through every layer of `stack_L` in order: `layer(w, x, par) -> x` with `w` one
    layer's leaves (without the L axis). `path`: where the stack sits in the full
    parameter tree (the key of FSDP's gather dimensions and probes, e.g. ("blocks",)).
    `index_L`: each layer's index in the whole model (L ints; a pipeline stage's layers
    are not 0 .. L-1), for layers that differ by it (`Decoder.INDEXED_LAYERS`): then
    `layer(w, x, par, index=i)`, i traced inside the scan. Returns x after the last
    layer, in the dtype the layers keep it in."""
    L = depth(stack_L)
    probes_L = par.layer_probes(path)

    def one(x, w, probes, i):
        w = par.gather_layer(w, path, probes)
        return layer(w, x, par) if i is None else layer(w, x, par, index=i)

    one = par.policy.checkpoint(one)
    if par.policy.scan:
        def body(x, xs):
            w, probes, i = xs
            return one(x, w, probes, i), None
        x, _ = lax.scan(body, x, (stack_L, probes_L, index_L))
        return x
    for i in range(L):
        at = lambda t: None if t is None else jax.tree.map(lambda v: v[i], t)  # noqa: E731
        x = one(x, at(stack_L), at(probes_L), at(index_L))
    return x
