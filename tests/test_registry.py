"""Adding a collective algorithm is one file and one registration.

A toy algorithm written here, a ring run backwards (every rank sends to rank - 1 with
the one point-to-point helper, `ranks.permute`), is registered with its cost formula
for the duration of each test, and is then found by the collectives' dispatch (against
`lax.psum` and `lax.pmean`), by the cost model (against the compiled program's own
collective-permutes), by `allreduce_gradients` and `DistributedOptimizer`, and by the
views `dpjax.collectives.ALGORITHMS`; unregistered, it is gone from all of them.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import collectives as C
from dpjax.collectives import cost, registry
from dpjax.collectives.ranks import as_chunks, axis_size, index, permute, row, shift_perm
from dpjax.collectives.ops import combine
from dpjax.data_parallel import DistributedOptimizer, allreduce_gradients

from conftest import read_losses

N = 8


# ---------------------------------------------------------------------------------------
# the toy algorithm: the whole of what a new algorithm needs


def backwards_allreduce(x, axis_name, *, op: str = "sum"):
    """Ring reduce-scatter then all-gather, each chunk travelling left (to rank - 1)."""
    n = axis_size(axis_name)
    if n == 1:
        return x
    rows, undo = as_chunks(x, n)
    r, add, left = index(axis_name), combine(op), shift_perm(n, -1)
    # rank r starts with chunk r + 1; at step s it receives chunk r + s + 2 from rank r + 1
    # and adds its own row of it, so after n - 1 steps it holds chunk r reduced
    acc = row(rows, (r + 1) % n)
    for s in range(n - 1):
        acc = add(permute(acc, axis_name, left), row(rows, (r + s + 2) % n))
    got = [acc]  # got[j] came j hops from the right: chunk r + j
    for _ in range(n - 1):
        got.append(permute(got[-1], axis_name, left))
    order = (jnp.arange(n) - r) % n  # chunk c sits at got[c - r]
    return undo(jnp.take(jnp.stack(got), order, axis=0))


def backwards_cost(primitive: str, n: int, nelems: int, itemsize: int) -> cost.Schedule:
    if primitive != "allreduce":
        raise cost.no_model(primitive, "toy")
    chunk = math.ceil(nelems / n) * itemsize
    return cost.Schedule(2 * (n - 1), 2 * (n - 1) * chunk)


TOY = registry.Algorithm("toy", backwards_cost, allreduce=backwards_allreduce)


@pytest.fixture
def toy():
    with registry.registered(TOY):
        yield "toy"


# ---------------------------------------------------------------------------------------


def _run(mesh, body, x_NxL):
    """body on each rank's (L,) row of x_NxL; returns the (N, L) rows every rank ended with."""
    L = x_NxL.shape[1]

    def local(x_1xL):
        assert x_1xL.shape == (1, L), x_1xL.shape
        return body(x_1xL[0])[None]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    return np.asarray(f(jax.device_put(x_NxL, NamedSharding(mesh, P("data")))))


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_toy_allreduce_is_psum(mesh_of, toy, op):
    mesh = mesh_of(f"data={N}", N)
    x = np.random.default_rng(0).integers(-50, 50, (N, 13)).astype(np.float32)  # exact sums, any order
    got = _run(mesh, lambda v: C.allreduce(v, "data", algorithm=toy, op=op), x)
    ref = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax}[op]
    want = _run(mesh, lambda v: ref(v, "data"), x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[3], {"sum": x.sum(0), "mean": x.mean(0), "max": x.max(0)}[op])


def test_toy_is_listed_and_costed(mesh_of, toy):
    assert toy in C.ALGORITHMS and toy not in C.REDUCE_SCATTER_ALGORITHMS
    assert C.check_algorithm(toy) == toy
    for n, nelems in [(8, 1003), (5, 40), (1, 7)]:
        assert cost.schedule(toy, n, nelems, 2) == cost.Schedule(2 * (n - 1), 2 * (n - 1) * math.ceil(nelems / n) * 2)
    with pytest.raises(ValueError, match="no cost model for broadcast with algorithm 'toy'"):
        cost.schedule(toy, 8, 100, primitive="broadcast")
    # and the formula is what the compiled program sends, every step to rank - 1
    mesh = mesh_of(f"data={N}", N)
    f = jax.jit(jax.shard_map(lambda b: C.allreduce(b[0], "data", algorithm=toy)[None], mesh=mesh,
                              in_specs=P("data"), out_specs=P("data")))
    text = f.lower(jax.ShapeDtypeStruct((N, 1003), jnp.float32, sharding=NamedSharding(mesh, P("data")))) \
        .compile().as_text()
    hlo, sched = cost.hlo_comm(text), cost.schedule(toy, N, 1003, 4)
    assert (hlo.steps, hlo.max_bytes) == (sched.steps, sched.bytes) == (14, 14 * 126 * 4)
    pairs = re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", text)
    assert len(pairs) == 14
    for p in pairs:
        sent = sorted((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", p))
        assert sent == sorted((i, (i - 1) % N) for i in range(N)), sent


def test_toy_in_allreduce_gradients_and_distributed_optimizer(mesh_of, toy):
    mesh = mesh_of(f"data={N}", N)
    g = np.random.default_rng(1).integers(-8, 9, (N, 6)).astype(np.float32)  # means exact in float32
    want = _run(mesh, lambda v: lax.pmean(v, "data"), g)
    got = _run(mesh, lambda v: allreduce_gradients({"w": v}, "data", algorithm=toy, fusion_mb=0)["w"], g)
    np.testing.assert_array_equal(got, want)

    tx = DistributedOptimizer(optax.sgd(0.5), "data", algorithm=toy)

    def step(v):
        params = {"w": jnp.zeros_like(v)}
        updates, _ = tx.update({"w": v}, tx.init(params), params)
        return updates["w"]

    np.testing.assert_array_equal(_run(mesh, step, g), -0.5 * want)


def test_toy_is_a_choice_of_the_cli_and_trains(corpus, toy, tmp_path, capsys):
    """The CLI's help and the plan's checks read the registry: the toy is a choice of
    --allreduce (and --tp-allreduce) with no other edit, and a run with it trains to the
    ring's losses (the same sums, in another order: float32 round-off)."""
    from dpjax.plan import UsageError, check
    from dpjax.settings import Settings
    from dpjax.train import build_parser, main

    text = build_parser().format_help()
    assert re.search(r"--allreduce ALLREDUCE\s+gradient allreduce algorithm: [^;]*\btoy\b", text), text
    check(Settings(allreduce="toy", tp_allreduce="toy"))
    with pytest.raises(UsageError, match="unknown --allreduce algorithm 'toyx'; choose one of .*toy"):
        check(Settings(allreduce="toyx"))
    args = ["--model", "mlp", "--seq-len", "8", "--batch-size", "16", "--data", corpus, "--eval-every", "0",
            "--eval-batches", "1", "--progress", "none", "--mesh", "8x1", "--steps", "3", "--optimizer", "sgd",
            "--clip-norm", "0"]
    losses = {}
    for alg in ("ring", toy):
        path = tmp_path / f"{alg}.jsonl"
        assert main(args + ["--allreduce", alg, "--metrics", str(path)]) == 0
        losses[alg] = read_losses(path)
    np.testing.assert_allclose(losses[toy], losses["ring"], rtol=2e-6)


def test_unregistered_is_gone(mesh_of):
    with registry.registered(TOY):
        assert "toy" in C.ALGORITHMS
    assert "toy" not in C.ALGORITHMS and "toy" not in registry.names()
    mesh = mesh_of(f"data={N}", N)
    x = np.zeros((N, 4), np.float32)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'toy'"):
        _run(mesh, lambda v: C.allreduce(v, "data", algorithm="toy"), x)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'toy'"):
        DistributedOptimizer(optax.sgd(0.1), "data", algorithm="toy")
    with pytest.raises(ValueError, match="no cost model for allreduce with algorithm 'toy'"):
        cost.schedule("toy", 8, 100)


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'ring' is registered already"):
        registry.register(registry.Algorithm("ring", backwards_cost, allreduce=backwards_allreduce))
    assert registry.get("ring").allreduce is not backwards_allreduce


def test_one_registry_class_serves_every_list():
    """Collective algorithms, compression methods, update rules and pipeline schedules
    are each a dpjax.registry.Registry: a name is taken once, reserved names never, and
    a toy registered for a block is gone after it."""
    from dataclasses import dataclass

    from dpjax import pipeline
    from dpjax.collectives import registry as collectives
    from dpjax.compression import registry as compression
    from dpjax.registry import Registry
    from dpjax.updates import registry as updates

    lists = {"collective algorithm": collectives._ALGORITHMS, "compression method": compression._METHODS,
             "update rule": updates._KINDS, "pipeline schedule": pipeline.SCHEDULES}
    for kind, reg in lists.items():
        assert isinstance(reg, Registry) and reg.kind == kind and len(reg) == len(list(reg)) > 0
        first = next(iter(reg))
        with pytest.raises(ValueError, match=f"{kind} '{first}' is registered already"):
            reg.register(reg[first])

    @dataclass(frozen=True)
    class Toy:
        name: str

    toys = Registry("toy", reserved=("none",))
    with toys.registered(Toy("a")) as a:
        assert list(toys) == ["a"] and toys["a"] is a and toys.get("b") is None
    assert "a" not in toys and len(toys) == 0
    with pytest.raises(ValueError, match="toy 'none' is registered already"):
        toys.register(Toy("none"))
    with pytest.raises(ValueError, match="compression method 'none' is registered already"):
        compression.register(compression.get("bf16").__class__(**{**compression.get("bf16").__dict__, "name": "none"}))
