"""shard_step's two layouts of a model's model axes, measured: "explicit" (every axis
manual: each device its block, dpjax.nn's Megatron collectives) against "auto" (the data
axes manual, the model axes GSPMD's: `jax.shard_map(..., axis_names=<data axes>)`), on
the same GPT of dpjax.nn layers (under "auto" they are their dense selves, split by their
annotations), and flax's own layers (the miniGPT tutorial's: MultiHeadAttention, Linear,
LayerNorm), which only "auto" can split. Per layout: the median step (interleaved rounds,
the paired ratio to "explicit"), and what the busiest device sends in one step, read from
the compiled program (`dpjax.collectives.cost.hlo_comm`).

    python experiments/model_axes.py            # the RESULTS.md table (4x2, 8 CPU devices)
    python experiments/model_axes.py --smoke    # a tiny model, 2 rounds (seconds)
"""

from __future__ import annotations

import argparse

import _bench

_bench.simulate(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import dpjax  # noqa: E402
from dpjax.collectives.cost import hlo_comm  # noqa: E402


class Block(nnx.Module):
    def __init__(self, d, heads, ff, flax_layers, rngs):
        ann = lambda *a: nnx.with_partitioning(nnx.initializers.lecun_normal(), a)  # noqa: E731
        zeros = lambda *a: nnx.with_partitioning(nnx.initializers.zeros_init(), a)  # noqa: E731
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        if flax_layers:  # the tutorial's annotations: heads and MLP columns over 'model', the second MLP by rows
            self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs,
                                               kernel_init=ann(None, "model"), bias_init=zeros("model"))
            self.up = nnx.Linear(d, ff, kernel_init=ann(None, "model"), bias_init=zeros("model"), rngs=rngs)
            self.down = nnx.Linear(ff, d, kernel_init=ann("model", None), rngs=rngs)
        else:
            self.attn = dpjax.nn.nnx.ParallelSelfAttention(d, heads, rngs=rngs)
            self.up = dpjax.nn.nnx.ColumnParallelLinear(d, ff, rngs=rngs)
            self.down = dpjax.nn.nnx.RowParallelLinear(ff, d, rngs=rngs)
        self.causal = flax_layers

    def __call__(self, x):
        h = self.ln1(x)
        x = x + (self.attn(h, mask=nnx.make_causal_mask(h[..., 0])) if self.causal else self.attn(h))
        return x + self.down(nnx.relu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, vocab, d, heads, ff, layers, flax_layers, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, ff, flax_layers, rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def train_step(model, optimizer, tokens):
    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def variant(args, flax_layers, layout):
    with jax.set_mesh(dpjax.make_mesh(args.mesh)):
        model = GPT(args.vocab, args.d_model, args.heads, args.d_ff, args.layers, flax_layers, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.adam(1e-3)), wrt=nnx.Param)
    step = dpjax.shard_step(train_step, args.mesh, batch_argnums=2, out_specs="mean", model_axes=layout)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32) for _ in range(4)]
    losses = []

    def run(i):
        losses.append(float(step(model, optimizer, batches[i % len(batches)])))

    run(0)
    return run, step, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    _bench.add_smoke(parser, "a tiny model, 2 rounds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.vocab, args.d_model, args.heads, args.d_ff, args.layers, args.seq, args.batch, args.rounds = (
            64, 16, 2, 32, 1, 8, 8, 2)
    variants = {"dpjax.nn, explicit": (False, "explicit"), "dpjax.nn, auto": (False, "auto"),
                "flax layers, auto": (True, "auto")}
    built = {name: variant(args, *v) for name, v in variants.items()}
    load = _bench.load_avg()
    times = _bench.interleave({name: b[0] for name, b in built.items()}, args.rounds, warmup=1)
    base = times["dpjax.nn, explicit"]
    rows = []
    for name, (_, step, losses) in built.items():
        s = _bench.summary_ms(times[name], base)
        sent = hlo_comm(step.compiled_text()).max_bytes
        rows.append([name, f"{s['median_ms']:.1f}", f"{s['paired_ratio']:.2f}", f"{sent / 2**20:.2f}",
                     f"{losses[0]:.4f}"])
    print(f"mesh {args.mesh}, d_model {args.d_model}, {args.heads} heads, d_ff {args.d_ff}, {args.layers} layers, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}; load {load:.1f} -> {_bench.load_avg():.1f}")
    print(_bench.markdown_table(["layout", "median step (ms)", "paired ratio", "MiB sent a step (busiest device)",
                                 "first loss"], rows, right=[1, 2, 3, 4]))


if __name__ == "__main__":
    main()
