"""Emulated slow links (dpjax.links): what each collective sends over a linked axis, the
host clock, the time a training step takes under each rule, and that only time changes.

The timing tests use a 200 ms link between the two nodes of a node=2 x data=4 mesh and
the hierarchical allreduce, whose only steps across nodes are the outer ring's 2: one
exchange costs 2 x (200 ms + bytes / bandwidth). They run on the links' virtual clock
(`VirtualTime`: computing takes no time, waiting moves the clock to the wire's end), so
each step's time is exactly what the rule waits for: no wall-clock window, no machine
load in the figures, and no real sleeping.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import collectives as C
from dpjax import links
from dpjax import step as S
from dpjax.errors import UserError
from dpjax.models import get_model
from dpjax.plan import resolve
from dpjax.settings import Settings
from dpjax.train import main

from conftest import read_losses


@pytest.mark.parametrize("text,axis,latency,bandwidth", [
    ("node=183ms,23mbit", "node", 0.183, 23e6 / 8),
    ("data=50us,10gbit", "data", 50e-6, 10e9 / 8),
    ("node = 1s , 100MB/s", "node", 1.0, 100e6),
    ("node=0.01ms,10Gbps", "node", 1e-5, 10e9 / 8),
])
def test_parse_link(text, axis, latency, bandwidth):
    link = links.parse_link(text)
    assert link.axis == axis
    assert link.latency == pytest.approx(latency) and link.bandwidth == pytest.approx(bandwidth)


@pytest.mark.parametrize("text", ["node", "node=183ms", "node=183,23mbit", "node=183ms,23", "=1ms,1mbit",
                                  "node=1ms,0mbit", "node=1ms,2furlongs"])
def test_parse_link_refuses_in_one_line(text):
    with pytest.raises(UserError, match=r"bad --link .*write e.g. node=183ms,23mbit") as info:
        links.parse_link(text)
    assert "\n" not in str(info.value)


def test_clock_queues_bytes_and_overlaps_latencies():
    """On a virtual clock (time moves only when a transfer is waited for): a device's bytes
    queue on its wire, latencies overlap, another device's wire is its own."""
    now = links.VirtualTime(10.0)
    clock = links.Clock(source=now)
    a = clock.issue(0, latency=0.20, wire=0.10)  # 10.0 + 0.10 + 0.20
    b = clock.issue(0, latency=0.20, wire=0.10)  # its bytes wait behind a's: 10.1 + 0.1 + 0.2
    c = clock.issue(1, latency=0.20, wire=0.10)  # another device's wire: as a
    clock.wait(a)
    assert now.now() == pytest.approx(10.30, abs=1e-12)
    clock.wait(c)  # done already: no time passes
    assert now.now() == pytest.approx(10.30, abs=1e-12)
    clock.wait(b)
    assert now.now() == pytest.approx(10.40, abs=1e-12)
    d = clock.issue(0, latency=0.20, wire=0.10)  # the wire is free again: from now
    clock.wait(d)
    assert now.now() == pytest.approx(10.70, abs=1e-12)
    clock.wait(12345)  # unknown: at once
    clock.wait(a)  # waited for already: forgotten, at once
    assert now.now() == pytest.approx(10.70, abs=1e-12)


def test_a_call_starts_when_its_first_device_issues_it():
    """A device that issues a call late (its thread held up) finishes with the others;
    its next call of the same site is a call of its own."""
    now = links.VirtualTime()
    clock = links.Clock(devices=2, source=now)
    a = clock.issue(0, latency=0.20, wire=0.0, site=7)
    now.advance(0.15)
    b = clock.issue(1, latency=0.20, wire=0.0, site=7)  # late: done with a, at 0.20
    clock.wait(b)
    assert now.now() == pytest.approx(0.20, abs=1e-12)
    c = clock.issue(1, latency=0.20, wire=0.0, site=7)  # the site's next call: from now
    clock.wait(a)
    clock.wait(c)
    assert now.now() == pytest.approx(0.40, abs=1e-12)


def test_deferred_transfers_are_waited_for_under_their_key():
    """`deferred`'s host side: transfers filed under (device, key) run one after another
    (the second starts when the first has arrived), and a wait for that key waits for the
    last; another key's transfer is independent of them."""
    now = links.VirtualTime()
    clock = links.Clock(source=now)
    clock.issue(0, latency=0.5, wire=0.0, key=3)  # arrives at 0.5
    clock.issue(0, latency=0.1, wire=0.3, key=3)  # starts at 0.5: arrives at 0.9
    clock.issue(0, latency=0.2, wire=0.1, key=4)  # its bytes queue behind the last's (0.8): arrives at 1.1
    clock.wait((0, 2))  # another key: nothing filed
    assert now.now() == 0.0
    clock.wait((0, 3))
    assert now.now() == pytest.approx(0.9, abs=1e-12)
    clock.wait((0, 4))
    assert now.now() == pytest.approx(1.1, abs=1e-12)


def test_real_time_sleeps_until_the_deadline():
    """The default source sleeps: a wait returns no earlier than the transfer's end."""
    clock = links.Clock()
    t0 = time.perf_counter()
    clock.wait(clock.issue(0, latency=0.05, wire=0.02))
    assert time.perf_counter() - t0 >= 0.07


LINK = links.AxisLink("node", latency=0.2, bandwidth=1e9)


def _traced_cost(mesh, fn, x):
    """(collective, latency, wire) of every timed collective `fn` calls, as traced."""
    em = links.Emulator(mesh, (LINK,))

    def body(v):
        assert v.shape == (x.shape[0] // mesh.size,), (v.shape, x.shape)
        with em.active():
            return fn(v)

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("node", "data")), out_specs=P(("node", "data")),
                          check_vma=False)).lower(x)
    return em.traced


@pytest.mark.parametrize("algorithm,crossing_steps", [
    # 8 ranks numbered node-major: the ring's (3, 4) and (7, 0) pairs cross at every one of
    # its 2(n-1) steps; the butterfly's partners at distance 4 cross, once in the halving
    # and once in the doubling; hierarchical crosses only in its outer ring over 2 nodes.
    ("ring", 14), ("butterfly", 2), ("hierarchical", 2), ("tree", 2),
])
def test_which_steps_cross_the_link(mesh_of, algorithm, crossing_steps):
    mesh = mesh_of("node=2,data=4", 8)
    x = jax.ShapeDtypeStruct((8 * 32,), np.float32)
    axis = ("node", "data")
    (name, latency, wire), = _traced_cost(mesh, lambda v: C.allreduce(v, axis, algorithm=algorithm), x)
    assert name == "allreduce" and latency == pytest.approx(crossing_steps * LINK.latency)
    assert wire > 0


def test_collectives_off_the_linked_axis_cost_nothing(mesh_of):
    mesh = mesh_of("node=2,data=4", 8)
    x = jax.ShapeDtypeStruct((8 * 32,), np.float32)
    assert _traced_cost(mesh, lambda v: C.allreduce(v, "data"), x) == []
    (_, latency, _), = _traced_cost(mesh, lambda v: C.allreduce(v, "node"), x)  # a ring over 2 nodes
    assert latency == pytest.approx(2 * LINK.latency)


def _deferred_pair(mesh, chained: bool, after: bool = False):
    """Virtual seconds a program waits for two allreduces over `node` (a ring over the 2
    nodes), issued inside `deferred` by one program and awaited by the next (as delayed:T
    does, steps apart): the second computed from the first's result in one block
    (chained), or each in a block of its own (independent). Returns (the time,
    [(latency, wire)] of each as traced)."""
    now = links.VirtualTime()
    em = links.Emulator(mesh, (links.AxisLink("node", latency=0.2, bandwidth=1e5),), links.Clock(mesh.size, now))

    def issue(v):
        assert v.shape == (64,), v.shape
        with em.active():
            if chained:
                with links.deferred(jnp.int32(1)):
                    a = C.allreduce(v, "node")
                    return C.allreduce(a * 2.0, "node")  # its input is computed from a's result
            with links.deferred(jnp.int32(1)):
                a = C.allreduce(v, "node")
            with links.deferred(jnp.int32(2), after=jnp.int32(1) if after else None):
                b = C.allreduce(v * 2.0, "node")
            return a + b

    def wait(v):
        assert v.shape == (64,), v.shape
        with em.active():
            return links.wait_deferred(links.wait_deferred(v, jnp.int32(1)), jnp.int32(2))

    spec = P(("node", "data"))
    f, g = (jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
            for fn in (issue, wait))
    jax.block_until_ready(g(jax.block_until_ready(f(jnp.arange(8 * 64, dtype=jnp.float32)))))
    return now.now(), [(lat, wire) for _, lat, wire in em.traced]


def test_a_chained_pair_in_one_deferred_block_is_charged_the_sum(mesh_of):
    """Q's allreduce cannot start before P's has arrived: two chained allreduces in one
    `deferred` block cost the sum of both, where two independent ones (a block each)
    overlap their latencies and queue only their bytes (the emulator's promise)."""
    mesh = mesh_of("node=2,data=4", 8)
    chained, ((l1, w1), (l2, w2)) = _deferred_pair(mesh, True)
    assert l1 == pytest.approx(0.4) and w1 > 0.001  # 2 ring steps over the 2 nodes
    assert chained == pytest.approx(l1 + w1 + l2 + w2, abs=1e-9)
    independent, _ = _deferred_pair(mesh, False)
    assert independent == pytest.approx(max(w1 + l1, w1 + w2 + l2), abs=1e-9)
    assert independent < chained - 0.3
    # a block whose input is computed from an earlier block's result (error feedback
    # across steps) names it: it starts once that one has arrived
    assert _deferred_pair(mesh, False, after=True)[0] == pytest.approx(chained, abs=1e-9)


# ---------------------------------------------------------------------------------------
# training steps under a 200 ms link

MODEL = get_model("mlp", seq_len=8, context=2, d_embed=8, d_hidden=16)
SLOW = links.AxisLink("node", latency=0.2, bandwidth=100e6)
B = 16


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (1, B, MODEL.config.seq_len + 1)).astype(np.int32) for _ in range(12)]


def _run(mesh_of, put, batches, update, with_link, workers=None):
    """(losses, each step's time after the first on the virtual clock, the step)."""
    mesh = mesh_of("node=2,data=4", 8)
    settings = Settings(mesh="node=2,data=4", model="mlp", update=update, batch_size=B, optimizer="sgd", lr=0.1,
                        clip_norm=0, allreduce="hierarchical", link=[str(SLOW)] if with_link else None,
                        workers=None if workers is None else ",".join(workers))
    plan = resolve(settings, mesh=mesh, model=MODEL)
    clock = links.Clock(8, links.VirtualTime())
    layout, step = plan.layout, S.for_plan(plan, donate=False, clock=clock)
    params, state = step.init(S.init_params(MODEL, layout, jax.random.key(0)))
    placed = [put(mesh, b, P(None, ("node", "data"))) for b in batches]
    params, state, loss = step.train(params, state, placed[0])  # with the initial broadcast's wait
    jax.block_until_ready(loss)
    losses, times = [float(loss)], []
    for b in placed[1:]:
        t = clock.source.now()
        params, state, loss = step.train(params, state, b)
        losses.append(float(loss))  # waits for the step
        times.append(clock.source.now() - t)
    return losses, times, step


def _comm(step_batch_bytes=None):
    """The modelled time of one hierarchical exchange of the MLP's gradient across nodes:
    the outer ring over 2 nodes, 2 steps of latency, each rank's 1/4 of the gradient."""
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(MODEL.init, jax.random.key(0))))
    chunk = -(-n_params // 4)  # the inner reduce-scatter's piece, padded
    return 2 * SLOW.latency + 2 * (-(-chunk // 2)) * 4 / SLOW.bandwidth


@pytest.fixture(scope="module")
def unlinked(mesh_of, put, batches):
    """Each rule's losses without a link: a link must change only time."""
    return {update: _run(mesh_of, put, batches, update, False)[0] for update in ("sync", "delayed:4", "sparse:4")}


def test_sync_waits_for_the_link_every_step(mesh_of, put, batches, unlinked):
    losses, times, _ = _run(mesh_of, put, batches[:4], "sync", True)
    assert losses == unlinked["sync"][:4]  # only time changes
    assert times == pytest.approx([_comm()] * 3, rel=1e-9)  # every step pays the whole exchange


def test_delayed_hides_the_link_behind_T_steps(mesh_of, put, batches, unlinked):
    losses, times, _ = _run(mesh_of, put, batches, "delayed:4", True)
    assert losses == unlinked["delayed:4"]
    # steps 1-3 find nothing to wait for; from step 4 on each waits for the exchange issued
    # 4 steps earlier, which was issued when the one before it had just arrived: the link
    # carries one exchange per 4 steps, comm / 4 a step (nothing computes on this clock)
    assert times[:3] == [0.0, 0.0, 0.0]
    assert sum(times[3:11]) == pytest.approx(2 * _comm(), rel=1e-3)  # two whole periods
    assert max(times[3:11]) == pytest.approx(_comm(), rel=1e-3)  # one step of each period waits


def test_sparse_pays_the_link_once_a_period(mesh_of, put, batches, unlinked):
    losses, times, _ = _run(mesh_of, put, batches[:9], "sparse:4", True)
    assert losses == unlinked["sparse:4"][:9]
    # steps 1..8: the averages after steps 3 and 7 wait for the whole exchange, the rest nothing
    assert times == pytest.approx([0, 0, _comm(), 0, 0, 0, _comm(), 0], rel=1e-9, abs=1e-12)


def test_a_deferred_exchange_with_start_steps_only_changes_time(mesh_of, put, batches):
    """delayed:2 with int8 after 2 exact exchanges (a lax.cond inside the deferred block):
    each collective in the cond files its own transfer (the block once handed tickets out
    of the cond's trace, an UnexpectedTracerError); the losses are those without links."""
    got = {}
    for with_link in (False, True):
        mesh = mesh_of("node=2,data=4", 8)
        plan = resolve(Settings(mesh="node=2,data=4", model="mlp", update="delayed:2", batch_size=B, optimizer="sgd",
                                lr=0.1, clip_norm=0, compression="int8,start=2", compress_axes="node",
                                link=["node=1ms,1gbit"] if with_link else None), mesh=mesh, model=MODEL)
        step = S.for_plan(plan, donate=False)
        params, state = step.init(S.init_params(MODEL, plan.layout, jax.random.key(0)))
        losses = []
        for b in batches[:4]:
            params, state, loss = step.train(params, state, put(mesh, b, P(None, ("node", "data"))))
            losses.append(float(loss))
        got[with_link] = losses
    assert got[True] == got[False]


def test_without_links_no_callback_is_compiled_in(mesh_of, put, batches):
    texts = {}
    for with_link in (False, True):
        mesh = mesh_of("node=2,data=4", 8)
        plan = resolve(Settings(mesh="node=2,data=4", model="mlp", update="delayed:4", batch_size=B,
                                link=[str(SLOW)] if with_link else None), mesh=mesh, model=MODEL)
        layout, step = plan.layout, S.for_plan(plan, donate=False)
        params, state = jax.eval_shape(step.init, jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(MODEL.init, jax.random.key(0)), layout.shardings()))
        batch = jax.ShapeDtypeStruct((1, B, 9), np.int32,
                                     sharding=jax.sharding.NamedSharding(mesh, P(None, ("node", "data"))))
        texts[with_link] = step.train.lower(params, state, batch).as_text()
    assert "callback" not in texts[False] and "callback" in texts[True]


def test_train_link_flag(corpus, tmp_path, capsys):
    plain, linked = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = ["--model", "mlp", "--seq-len", "8", "--batch-size", "16", "--data", corpus, "--eval-every", "0",
            "--eval-batches", "1", "--progress", "none", "--mesh", "2x4x1", "--steps", "3", "--allreduce",
            "hierarchical"]
    assert main(args + ["--metrics", str(plain)]) == 0
    assert main(args + ["--link", "node=100ms,1gbit", "--metrics", str(linked)]) == 0
    assert read_losses(linked) == read_losses(plain)
    capsys.readouterr()
    assert main(args + ["--link", "stage=1ms,1gbit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no axis 'stage'" in err[0], err
