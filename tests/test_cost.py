"""The cost model against the compiled programs, and against the docstrings' formulas.

`cost.hlo_comm` reads what a compiled program sends; `cost.schedule` says what an
algorithm should send. The checks here: the two agree for every algorithm and
primitive (steps, and bytes from the busiest device); both agree with the formulas
the algorithm modules' docstrings derive, typed in again here by hand; the ring meets
the Patarasuk-Yuan lower bound exactly; the hierarchical allreduce splits its bytes
between the inner and the outer links as its docstring says (split here by reading
each collective-permute's source-target pairs, independently of `hlo_comm`).
Compiling only (nothing runs), so large N costs nothing.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from dpjax import collectives as C
from dpjax.collectives import cost, registry

from cost_harness import F32, adasum_comm, compiled_text, flat_comm, schedule_cases, split_inner_outer


# ---------------------------------------------------------------------------------------
# the ring meets the lower bound


@pytest.mark.parametrize("n", range(2, 9), ids=lambda n: f"n{n}")
def test_ring_allreduce_sends_exactly_the_lower_bound(cache, mesh_of, n):
    nelems = 840  # divisible by every n here, so no padding
    hlo = flat_comm(cache, mesh_of, n, "allreduce", "ring", nelems)
    N = nelems * F32
    bound = 2 * (n - 1) / n * N  # Patarasuk & Yuan
    assert cost.lower_bound_bytes(n, N) == bound
    assert hlo.max_bytes / bound == 1.0
    # symmetric: every device sends exactly the bound, in 2(n-1) steps
    assert dict(hlo.bytes_per_device) == {d: bound for d in range(n)}
    assert hlo.steps == 2 * (n - 1) and dict(hlo.ops) == {"collective-permute": 2 * (n - 1)}


# ---------------------------------------------------------------------------------------
# hierarchical: inner and outer links


HIER = [(2, 4), (4, 2), (1, 8), (8, 1)]


@pytest.mark.parametrize("nelems", [840, 1003], ids=["N840", "N1003-padded"])
@pytest.mark.parametrize("G, L", HIER, ids=[f"node{g}xdata{l}" for g, l in HIER])
def test_hierarchical_allreduce_inner_and_outer_bytes(cache, mesh_of, G, L, nelems):
    text = compiled_text(mesh_of, f"node={G},data={L}", 8, ("node", "data"),
                         lambda x: C.allreduce(x, ("node", "data"), algorithm="hierarchical"),
                         (nelems,))
    inner, outer, steps = split_inner_outer(text, L)
    sched = cost.schedule("hierarchical", L, nelems, F32, groups=G)
    if nelems % (G * L) == 0:  # the docstring's figures, exact when nothing is padded
        N = nelems * F32
        assert sched.bytes == 2 * (L - 1) / L * N
        assert sched.outer_bytes == 2 * (G - 1) / G * N / L
    assert sched.steps == 2 * (L - 1) and sched.outer_steps == 2 * (G - 1)
    # every device sends exactly that, inside and across
    assert inner == ({d: sched.bytes for d in range(8)} if L > 1 else {})
    assert outer == ({d: sched.outer_bytes for d in range(8)} if G > 1 else {})
    assert steps == {"inner": sched.steps, "outer": sched.outer_steps}
    hlo = cost.hlo_comm(text)
    assert (hlo.steps, hlo.max_bytes) == (sched.total_steps, sched.total_bytes)


@pytest.mark.parametrize("primitive", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("G, L", HIER[:2], ids=[f"node{g}xdata{l}" for g, l in HIER[:2]])
def test_hierarchical_scatter_gather_bytes(cache, mesh_of, G, L, primitive):
    m = 5  # elements per rank's piece, odd
    nelems = G * L * m  # the full vector (reduce_scatter input, all_gather output)
    fn = C.reduce_scatter if primitive == "reduce_scatter" else C.all_gather
    shape = (nelems,) if primitive == "reduce_scatter" else (m,)
    text = compiled_text(mesh_of, f"node={G},data={L}", 8, ("node", "data"),
                         lambda x: fn(x, ("node", "data"), algorithm="hierarchical"), shape)
    inner, outer, steps = split_inner_outer(text, L)
    sched = cost.schedule("hierarchical", L, nelems, F32, primitive=primitive, groups=G)
    # ring phases: (L-1) pieces of G*m inside, (G-1) pieces of m across
    assert (sched.steps, sched.bytes) == (L - 1, (L - 1) * G * m * F32)
    assert (sched.outer_steps, sched.outer_bytes) == (G - 1, (G - 1) * m * F32)
    assert inner == {d: sched.bytes for d in range(8)}
    assert outer == {d: sched.outer_bytes for d in range(8)}
    assert steps == {"inner": sched.steps, "outer": sched.outer_steps}


# ---------------------------------------------------------------------------------------
# every algorithm: the compiled program does what cost.schedule says



@pytest.mark.parametrize("primitive, algorithm, n, nelems, kw", schedule_cases())
def test_hlo_matches_schedule(cache, mesh_of, primitive, algorithm, n, nelems, kw):
    hlo = flat_comm(cache, mesh_of, n, primitive, algorithm, nelems, **kw)
    opts = {"num_servers": kw["num_servers"]} if "num_servers" in kw else {}
    sched = cost.schedule(algorithm, n, nelems, F32, primitive=primitive, **opts)
    assert (hlo.steps, hlo.max_bytes) == (sched.steps, sched.bytes)
    if algorithm != "psum":  # the explicit algorithms use nothing but collective-permutes
        assert set(hlo.ops) <= {"collective-permute"}


def test_itemsize_counts(mesh_of):
    """float16 halves the bytes, not the steps.

    (Not bfloat16: XLA's CPU backend widens bfloat16 collectives to float32, so its
    compiled programs really do send 4 bytes per bfloat16 element.)
    """
    text = compiled_text(mesh_of, "data=4", 4, "data",
                         lambda x: C.allreduce(x, "data", algorithm="ring"), (1003,), jnp.float16)
    hlo = cost.hlo_comm(text)
    assert (hlo.steps, hlo.max_bytes) == (6, 2 * 3 * 251 * 2)
    assert cost.schedule("ring", 4, 1003, 2) == cost.Schedule(6, 2 * 3 * 251 * 2)


# ---------------------------------------------------------------------------------------
# the docstrings' formulas, for concrete values


MiB = 1 << 20


def test_ring_docstring_values(cache, mesh_of):
    N = 4 * MiB  # bytes; float32, so N / 4 elements
    sched = cost.schedule("ring", 8, N // F32)
    assert (sched.steps, sched.bytes) == (14, 7 * N // 4)
    hlo = flat_comm(cache, mesh_of, 8, "allreduce", "ring", N // F32)
    assert (hlo.steps, hlo.max_bytes) == (14, 7 * N // 4)
    for primitive in ("reduce_scatter", "all_gather"):
        assert cost.schedule("ring", 8, N // F32, primitive=primitive) == cost.Schedule(7, 7 * N // 8)
    # van de Geijn broadcast: 2(n-1) steps, 2(n-1)/n * N from the root
    assert cost.schedule("ring", 8, N // F32, primitive="broadcast") == cost.Schedule(14, 7 * N // 4)


def test_butterfly_docstring_values():
    N = 3 * MiB  # elements: divisible by 8, 6 and 4
    B = N * F32
    # n = 8 = 2^3
    assert cost.schedule("butterfly", 8, N) == cost.Schedule(6, 7 * B // 4)
    assert cost.schedule("butterfly", 8, N, primitive="reduce_scatter") == cost.Schedule(3, 7 * B // 8)
    assert cost.schedule("butterfly", 8, N, primitive="all_gather") == cost.Schedule(3, 7 * B // 8)
    # n = 6: p = 4, e = 2, c = N/6 (bytes B/6)
    assert cost.schedule("butterfly", 6, N) == cost.Schedule(2 + 2 * 2, B + 2 * 3 * B // 4)
    assert cost.schedule("butterfly", 6, N, primitive="reduce_scatter") == cost.Schedule(
        2 + 2, 7 * B // 6)  # (2p - 1) * c
    assert cost.schedule("butterfly", 6, N, primitive="all_gather") == cost.Schedule(
        2 + 2, 2 * 3 * B // 6 + B)  # 2(p - 1) * c + N


def test_tree_docstring_values():
    N = 1000
    B = N * F32
    assert cost.schedule("tree", 8, N) == cost.Schedule(6, 3 * B)  # k = 3
    assert cost.schedule("tree", 8, N, primitive="broadcast") == cost.Schedule(3, 3 * B)
    assert cost.schedule("tree", 5, N) == cost.Schedule(6, 3 * B)  # k = ceil(log2 5) = 3
    assert cost.schedule("tree", 2, N) == cost.Schedule(2, B)


def test_ps_docstring_values():
    N = 800
    B = N * F32
    # a server sends (n + S - 2) / S * N; with one server that is (n - 1) * N
    assert cost.schedule("ps", 8, N, num_servers=1) == cost.Schedule(14, 7 * B)
    assert cost.schedule("ps", 8, N, num_servers=2) == cost.Schedule(14, 4 * B)
    assert cost.schedule("ps", 8, N, num_servers=4) == cost.Schedule(14, 10 * B // 4)
    # every rank a server: like the ring
    assert cost.schedule("ps", 8, N, num_servers=8) == cost.Schedule(14, 7 * B // 4)


def test_hierarchical_docstring_values():
    N = 4 * MiB
    s = cost.schedule("hierarchical", 4, N // F32, groups=2)
    assert (s.steps, s.bytes, s.outer_steps, s.outer_bytes) == (6, 3 * N // 2, 2, N // 4)
    s = cost.schedule("hierarchical", 2, N // F32, groups=4)
    assert (s.steps, s.bytes, s.outer_steps, s.outer_bytes) == (2, N, 6, 3 * N // 4)


def test_one_rank_sends_nothing():
    # psum too: XLA kept its one-rank all-reduce as an op (on a GPU a copy of the whole
    # buffer), and dpjax.collectives.xla now leaves it out (test_hlo_matches_schedule's n1)
    for alg in C.ALGORITHMS:
        assert cost.schedule(alg, 1, 1000) == cost.Schedule(0, 0), alg


@pytest.mark.parametrize(
    "args, kw, match",
    [(("ring", 0, 10), {}, "n >= 1"), (("ring", 4, -1), {}, "nelems"),
     (("nccl", 4, 10), {}, "nccl"), (("tree", 4, 8), {"primitive": "reduce_scatter"}, "tree"),
     (("ps", 4, 8), {"primitive": "broadcast"}, "ps")],
)
def test_schedule_rejects(args, kw, match):
    with pytest.raises(ValueError, match=match):
        cost.schedule(*args, **kw)


# ---------------------------------------------------------------------------------------
# the alpha-beta arithmetic


def test_link_from_ms_mbps():
    link = cost.Link.from_ms_mbps(2.0, 800.0)  # 2 ms, 800 Mbit/s
    assert link.latency == pytest.approx(0.002, rel=1e-15)
    assert link.bandwidth == pytest.approx(1e8, rel=1e-15)  # bytes per second


def test_schedule_time_by_hand():
    fast = cost.Link(latency=1e-6, bandwidth=1e9)
    slow = cost.Link(latency=1e-3, bandwidth=1e6)
    s = cost.Schedule(steps=6, bytes=1000, outer_steps=2, outer_bytes=500)
    assert s.total_steps == 8 and s.total_bytes == 1500
    # 6 * 1us + 1000 B / 1 GB/s + 2 * 1 ms + 500 B / 1 MB/s = 6e-6 + 1e-6 + 2e-3 + 5e-4
    assert s.time(fast, slow) == pytest.approx(0.002507, rel=1e-12)
    # no outer link: everything on the one link
    assert s.time(fast) == pytest.approx(8e-6 + 1.5e-6, rel=1e-12)
    # ring allreduce of 4 MiB on 8 ranks over 1 ms / 1 GB/s links
    ring = cost.schedule("ring", 8, MiB)
    assert ring.time(cost.Link(1e-3, 1e9)) == pytest.approx(14e-3 + 7 * 4 * MiB / 4 / 1e9,
                                                            rel=1e-12)


def test_hlo_comm_parses_by_hand():
    text = "\n".join([
        "  %a = f32[10]{0} collective-permute(%x), channel_id=1, "
        "source_target_pairs={{0,1},{1,2},{2,0}}, metadata={}",
        "  %b = (bf16[4]{0}, bf16[4]{0}, u32[], u32[]) collective-permute-start(%y), "
        "channel_id=2, source_target_pairs={{0,1}}",
        "  %c = bf16[4]{0} collective-permute-done(%b)",
        "  %d = f32[6]{0} all-reduce(%z), channel_id=3, replica_groups={{0,1,2}}, "
        "to_apply=%add",
        "  %e = f32[12]{0} all-gather(%w), replica_groups={{0,1},{2,3}}, dimensions={0}",
        "  %f = f32[3]{0} add(%a, %a)",
    ])
    hlo = cost.hlo_comm(text)
    assert dict(hlo.ops) == {"collective-permute": 2, "all-reduce": 1, "all-gather": 1}
    assert hlo.steps == 4
    # permutes: 40 B from 0, 1, 2 and 8 B more from 0; all-reduce of 24 B over 3 ranks
    # as a ring: 2 * 2 * 8 = 32 B each; all-gather of 48 B in pairs: 24 B each
    assert dict(hlo.bytes_per_device) == {0: 40 + 8 + 32 + 24, 1: 40 + 32 + 24,
                                          2: 40 + 32 + 24, 3: 24}
    assert hlo.max_bytes == 104
    assert cost.hlo_comm("").max_bytes == 0


# ---------------------------------------------------------------------------------------
# all-to-all, Adasum, process sets and uneven pieces


@pytest.mark.parametrize("algorithm", C.ALL_TO_ALL_ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 5, 8], ids=lambda n: f"n{n}")
def test_all_to_all_hlo_matches_schedule(cache, mesh_of, algorithm, n):
    hlo = flat_comm(cache, mesh_of, n, "all_to_all", algorithm, n * 35)
    sched = cost.schedule(algorithm, n, n * 35, F32, primitive="all_to_all")
    assert (hlo.steps, hlo.max_bytes) == (sched.steps, sched.bytes)
    assert set(hlo.ops) <= ({"all-to-all"} if algorithm == "xla" else {"collective-permute"})


def test_all_to_all_docstring_values():
    B = 1000 * F32  # one block
    # pairwise: n-1 steps of one block
    assert cost.schedule("pairwise", 8, 8 * 1000, primitive="all_to_all") == cost.Schedule(7, 7 * B)
    # Bruck, n = 8: 3 steps of n/2 blocks, log2(n)/2 * N
    assert cost.schedule("bruck", 8, 8 * 1000, primitive="all_to_all") == cost.Schedule(3, 12 * B)
    # Bruck, n = 5: bits 0, 1, 2 of positions 0..4 are set in 2, 2 and 1 of them
    assert cost.schedule("bruck", 5, 5 * 1000, primitive="all_to_all") == cost.Schedule(3, 5 * B)
    assert cost.schedule("bruck", 1, 1000, primitive="all_to_all") == cost.Schedule(0, 0)



@pytest.mark.parametrize("segments", [None, (400, 3, 600)], ids=["one-tensor", "three-tensors"])
@pytest.mark.parametrize("n", [2, 5, 8], ids=lambda n: f"n{n}")
def test_adasum_hlo_matches_schedule(mesh_of, n, segments):
    hlo = adasum_comm(mesh_of, n, 1003, segments)
    sched = cost.schedule("adasum", n, 1003, F32, tensors=len(segments or (1,)))
    assert (hlo.steps, hlo.max_bytes) == (sched.steps, sched.bytes)
    assert set(hlo.ops) == {"collective-permute"}


def test_adasum_docstring_values():
    N = 3 * MiB  # elements, divisible by 8 and 4
    B = N * F32
    # n = 8, k = 3: 2k + k(k+1)/2 = 12 steps; 2(p-1)/p * N + 3 T 4 k(k+1)/2 bytes
    assert cost.schedule("adasum", 8, N) == cost.Schedule(12, 7 * B // 4 + 6 * 12)
    assert cost.schedule("adasum", 8, N, tensors=5) == cost.Schedule(12, 7 * B // 4 + 6 * 60)
    # n = 6: p = 4, k = 2: the fold-in adds 2 steps and N; 3 dot steps
    assert cost.schedule("adasum", 6, N) == cost.Schedule(2 + 4 + 3, B + 3 * B // 2 + 3 * 12)
    # float64: the dot products travel in float64
    assert cost.schedule("adasum", 2, 1000, 8) == cost.Schedule(3, 1000 * 8 + 24)
    assert cost.schedule("adasum", 1, 1000) == cost.Schedule(0, 0)


SETS = [[0, 2, 4], [1, 3], [5, 6, 7]]


@pytest.mark.parametrize("algorithm", [a for a in C.ALGORITHMS if registry.get(a).groups])
def test_process_sets_hlo_matches_schedule_sets(mesh_of, algorithm):
    """One pass per set size: steps add up over the sizes 2 and 3, a device sends what
    its own set's pass sends; every pair stays inside a set."""
    text = compiled_text(mesh_of, "data=8", 8, "data",
                         lambda x: C.allreduce(x, "data", algorithm=algorithm, groups=SETS), (1003,))
    hlo = cost.hlo_comm(text)
    sched = cost.schedule_sets(algorithm, SETS, 1003, F32)
    assert (hlo.steps, hlo.max_bytes) == (sched.steps, sched.bytes)
    assert sched.steps == cost.schedule(algorithm, 2, 1003).steps + cost.schedule(algorithm, 3, 1003).steps
    member = {r: i for i, s in enumerate(SETS) for r in s}
    for pairs in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", text):
        assert all(member[int(a)] == member[int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs))


@pytest.mark.parametrize("primitive", ["reduce_scatter", "all_gather"])
def test_uneven_pieces_cost_the_padded_even_collective(mesh_of, primitive):
    sizes = [3, 0, 2, 1, 2, 1, 1, 2]
    if primitive == "reduce_scatter":
        body, shape = (lambda x: C.reduce_scatter(x.reshape(sum(sizes), 5), "data", sizes=sizes)), (60,)
    else:
        body, shape = (lambda x: C.all_gather(x.reshape(3, 5), "data", sizes=sizes)), (15,)
    hlo = cost.hlo_comm(compiled_text(mesh_of, "data=8", 8, "data", body, shape))
    sched = cost.schedule("ring", 8, 8 * max(sizes) * 5, F32, primitive=primitive)  # n blocks of max rows
    assert (hlo.steps, hlo.max_bytes) == (sched.steps, sched.bytes)
