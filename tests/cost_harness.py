"""The harness of tests/test_cost.py: a collective's compiled program (its text, what
`cost.hlo_comm` reads from it), the hierarchical split of a program's sends into inner
and outer links (read from the source-target pairs, independently of `hlo_comm`), the
schedule cases, and Adasum's program.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import collectives as C
from dpjax.collectives import cost

from conftest import flat_algorithms


F32 = 4


def compiled_text(mesh_of, spec, count, axis, body, local_shape, dtype=jnp.float32):
    """HLO text of jit(shard_map(body)) with a (local_shape) block per rank."""
    mesh = mesh_of(spec, count)
    axes = (axis,) if isinstance(axis, str) else axis
    n = math.prod(mesh.shape[a] for a in axes)
    fn = jax.jit(jax.shard_map(lambda b: body(b[0])[None], mesh=mesh, in_specs=P(axis),
                               out_specs=P(axis)))
    x = jax.ShapeDtypeStruct((n, *local_shape), dtype, sharding=NamedSharding(mesh, P(axis)))
    return fn.lower(x).compile().as_text()


def flat_comm(cache, mesh_of, n, primitive, algorithm, nelems, **kw):
    """hlo_comm of one flat collective over data=n; nelems as cost.schedule counts them."""
    key = ("hlo", n, primitive, algorithm, nelems, tuple(sorted(kw.items())))

    def build():
        if primitive == "allreduce":
            body, shape = (lambda x: C.allreduce(x, "data", algorithm=algorithm, **kw)), (nelems,)
        elif primitive == "reduce_scatter":
            body, shape = (lambda x: C.reduce_scatter(x, "data", algorithm=algorithm)), (nelems,)
        elif primitive == "all_gather":  # nelems counts the gathered result
            body, shape = (lambda x: C.all_gather(x, "data", algorithm=algorithm)), (nelems // n,)
        elif primitive == "all_to_all":  # nelems: one rank's whole input
            body, shape = (lambda x: C.all_to_all(x, "data", algorithm=algorithm)), (nelems,)
        else:
            body, shape = (lambda x: C.broadcast(x, "data", algorithm=algorithm, **kw)), (nelems,)
        return cost.hlo_comm(compiled_text(mesh_of, f"data={n}", n, "data", body, shape))

    return cache.get(key, build)




_PERMUTE_RE = re.compile(r"=\s*\(?(\w+)\[([\d,]*)\].*?\scollective-permute(?:-start)?\(")
_PAIRS_RE = re.compile(r"source_target_pairs=\{(.*?)\}\}")


def split_inner_outer(hlo_text: str, L: int):
    """Per-device bytes sent over inner (same node) and outer (other node) pairs.

    Partition ids are positions in the (node, data) mesh, so device d is on node d // L.
    """
    inner, outer, steps = {}, {}, {"inner": 0, "outer": 0}
    for line in hlo_text.splitlines():
        m = _PERMUTE_RE.search(line)
        if not m or "-done" in line:
            continue
        dtype, dims = m.groups()
        nbytes = {"f32": 4, "bf16": 2, "f16": 2}[dtype] * math.prod(
            int(d) for d in dims.split(",") if d)
        pairs = [tuple(map(int, p)) for p in re.findall(r"(\d+),(\d+)",
                                                        _PAIRS_RE.search(line).group(1))]
        crossing = {s // L != t // L for s, t in pairs}
        assert len(crossing) == 1, f"a step mixes inner and outer links: {pairs}"
        side = outer if crossing.pop() else inner
        steps["outer" if side is outer else "inner"] += 1
        for s, _ in pairs:
            side[s] = side.get(s, 0) + nbytes
    return inner, outer, steps




def schedule_cases():
    out = []
    for n in (1, 2, 3, 5, 6, 8):
        for nelems in (840, 1003):  # 1003 is padded for every n > 1
            for alg in flat_algorithms(C.ALGORITHMS):
                servers = sorted({1, (n + 1) // 2, n}) if alg == "ps" else [None]
                for s in servers:
                    kw = {"num_servers": s} if s else {}
                    out.append(("allreduce", alg, n, nelems, kw))
            if n == 1:
                continue
            for alg in C.BROADCAST_ALGORITHMS:
                out.append(("broadcast", alg, n, nelems, {"root": n // 2}))
        for alg in flat_algorithms(C.REDUCE_SCATTER_ALGORITHMS) if n > 1 else ():
            out += [("reduce_scatter", alg, n, n * m, {}) for m in (105, 125)]
        for alg in flat_algorithms(C.ALL_GATHER_ALGORITHMS) if n > 1 else ():
            out += [("all_gather", alg, n, n * m, {}) for m in (105, 125)]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}-n{c[2]}-N{c[3]}" + "".join(
        f"-{k}{v}" for k, v in c[4].items())) for c in out]


def adasum_comm(mesh_of, n, nelems, segments):
    def body(x):
        return C.allreduce(x, "data", algorithm="butterfly", op="adasum", segments=segments)

    return cost.hlo_comm(compiled_text(mesh_of, f"data={n}", n, "data", body, (nelems,)))
