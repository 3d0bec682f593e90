"""The pipeline's sends between stages go through dpjax's point-to-point helper, so an
emulated `stage` link charges them and a timeline names them.

A tiny GPT on stage=2,data=4 with GPipe and M = 2 micro-batches of b = 2 rows: the forward
pass takes M + S - 1 = 3 ticks, each ending in one send of the activations (b x T x D
floats) to the next stage, and the backward pass 3 more, each sending a gradient of the
same shape back; after them the shared leaves' gradient is summed over `stage` by a ring
(2(S-1) = 2 steps of half the buffer). Under `--link stage=LAT,BW` every one of these
waits for its wire (Hockney: LAT + bytes / BW), one after another: the expected time a
step waits is written out below from the shapes alone.
"""

import math
import time
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import links
from dpjax import step as S
from dpjax import timeline
from dpjax.models import get_model
from dpjax.optim import OptimizerConfig
from dpjax.pipeline import Pipeline
from dpjax.sharding import make_layout

MESH, SCHEDULE, M, B = "stage=2,data=4", "gpipe", 2, 16
STAGES, DP = 2, 4
MODEL = get_model("gpt", seq_len=8, d_model=16, n_layers=4, n_heads=2, d_ff=32)
LINK = links.AxisLink("stage", latency=0.05, bandwidth=1e6)
TICKS = M + STAGES - 1  # each pass: GPipe's fill, work and drain


def modelled_wait() -> float:
    """Seconds one step waits for the stage link, from the shapes: the 2 x TICKS sends of
    one micro-batch's activations (or their gradient), b x T x D float32, and the ring
    over 2 stages of the shared leaves' gradient (2 steps of half of it, padded)."""
    b, T, D = B // DP // M, MODEL.config.seq_len, MODEL.config.d_model
    send = LINK.latency + b * T * D * 4 / LINK.bandwidth
    shapes = jax.eval_shape(MODEL.init, jax.random.key(0))
    shared = sum(x.size for k, v in shapes.items() if k != MODEL.LAYERS for x in jax.tree.leaves(v))
    ring_step = LINK.latency + math.ceil(shared / STAGES) * 4 / LINK.bandwidth
    return 2 * TICKS * send + 2 * (STAGES - 1) * ring_step


def build(mesh, link: bool, source=None):
    """(step, params, state, batches, the emulator's clock or None): the sync SGD step (no
    clipping: no other sum over `stage`), with the stage link or without; `source`: the
    time source of its emulated clock."""
    layout = make_layout(MODEL, mesh, pipeline=Pipeline(SCHEDULE, M))
    clock = links.Clock(mesh.size, source=source) if link else None
    step = S.for_model(MODEL, layout, global_batch=B, opt=OptimizerConfig("sgd", lr=0.1, clip_norm=0),
                       links=(LINK,) if link else (), donate=False, clock=clock)
    params, state = step.init(jax.device_put(layout.store(MODEL.init(jax.random.key(0))), layout.shardings()))
    batches = np.random.default_rng(0).integers(0, 256, (4, 1, B, MODEL.config.seq_len + 1)).astype(np.int32)
    placed = [jax.device_put(b, NamedSharding(mesh, P(None, "data"))) for b in batches]
    return step, params, state, placed, clock


def run(step, params, state, batch):
    params, state, loss = step.train(params, state, batch)
    jax.block_until_ready(loss)
    return params, state, float(loss)


@pytest.fixture(scope="module")
def steps(mesh_of):
    mesh = mesh_of(MESH, 8)
    clock = links.VirtualTime()
    return {"plain": build(mesh, False), "linked": build(mesh, True, clock), "clock": clock}


def test_a_stage_link_charges_every_stage_send(steps):
    """On a virtual clock (time moves only by waiting for the wire), each step moves it by
    exactly the modelled wait; and only time changes: the losses are the plain step's."""
    clock = steps["clock"]
    step, params, state, batches, _ = steps["linked"]
    plain, p_params, p_state, _, _ = steps["plain"]
    for batch in batches:
        t = clock.now()
        params, state, loss = run(step, params, state, batch)
        assert clock.now() - t == pytest.approx(modelled_wait(), rel=1e-9)
        p_params, p_state, want = run(plain, p_params, p_state, batch)
        assert loss == want


def test_a_real_time_link_sleeps_at_least_the_modelled_wait(steps):
    """The same compiled step on real time: each wait sleeps to its transfer's end, so a
    step takes at least the modelled wait. (How long exactly is the virtual clock's test
    above: a wall-clock upper bound would measure the machine's load, not the emulator.)"""
    step, params, state, batches, clock = steps["linked"]
    clock.source = links.RealTime()
    try:
        for batch in batches[:2]:
            t = time.perf_counter()
            params, state, _ = run(step, params, state, batch)
            assert time.perf_counter() - t >= modelled_wait(), (time.perf_counter() - t, modelled_wait())
    finally:
        clock.source = steps["clock"]


def test_the_timeline_names_the_stage_sends(steps, tmp_path):
    """Two profiled steps: on every device, each step holds TICKS calls named "send
    activations stage" and TICKS named "send gradients stage", each of one point-to-point
    step of b x T x D floats; the summary counts them per step."""
    step, params, state, batches, _ = steps["plain"]
    params, state, _ = run(step, params, state, batches[0])  # compiled before the profile
    rec = timeline.Recorder()
    rec.program(step.train, params, state, batches[0])
    with rec.profile():
        for i, batch in enumerate(batches[1:3]):
            with rec.step(i):
                params, state, _ = run(step, params, state, batch)
    data = rec.write(str(tmp_path / "pipeline.trace.json"))
    nbytes = (B // DP // M) * MODEL.config.seq_len * MODEL.config.d_model * 4
    sends = Counter()
    for e in data["traceEvents"]:
        a = e.get("args", {})
        if e.get("ph") == "X" and a.get("type") == "collective" and a.get("collective") == "send":
            sends[e["pid"] - 1, a["step"], e["name"], a["axis"], a["bytes"], a["p2p_steps"]] += 1
    want = Counter({(d, i, f"send {what} stage", "stage", nbytes, 1): TICKS
                    for d in range(8) for i in range(2) for what in ("activations", "gradients")})
    assert sends == want
    rows = {r["name"]: r for r in timeline.summarize(data).collectives if r["collective"] == "send"}
    assert sorted(rows) == ["send activations stage", "send gradients stage"]
    assert all(r["calls"] == TICKS and r["bytes"] == nbytes for r in rows.values()), rows
