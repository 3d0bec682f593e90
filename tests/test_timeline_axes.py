"""The timeline (`dpjax.timeline`) of a step on the axes that move activations (issue #40):
ring attention's K/V sends over `context` and a mixture's all-to-alls over `expert` get
their own named spans on every device, forward and backward, with the bytes their
shapes give and one span per point-to-point step, each holding the permute it ran."""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax import timeline
from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.plan import resolve
from dpjax.settings import Settings

SEQ, B, D, HEADS = 16, 8, 16, 2


def captured(mesh_of, path, mesh, **options):
    """The trace events ("X") of one profiled train step of a one-layer GPT on `mesh`."""
    model = get_model("gpt", seq_len=SEQ, d_model=D, n_layers=1, n_heads=HEADS, d_ff=16, **options)
    plan = resolve(Settings(mesh=mesh, data="synthetic", batch_size=B, seq_len=SEQ), mesh=mesh_of(mesh, 8),
                   model=model, optimizer=optax.sgd(0.1))
    st = S.for_plan(plan, donate=False)
    params, state = st.init(S.init_params(model, plan.layout, jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, 256, (1, B, SEQ + 1)).astype(np.int32)
    batch = jax.device_put(tokens, NamedSharding(plan.mesh, P(None, data_axes(plan.mesh))))
    jax.block_until_ready(st.train(params, state, batch))  # compiles
    rec = timeline.Recorder()
    rec.program(st.train, params, state, batch)
    with rec.profile():
        with rec.step(1):
            jax.block_until_ready(st.train(params, state, batch))
    return [e for e in rec.write(str(path / "step.trace.json"))["traceEvents"] if e["ph"] == "X"]


def calls_of(events, prefix):
    """{(device, name): [args of each collective span whose name starts with `prefix`]} and
    {(device, call): [p2p spans]} of those calls."""
    calls, steps = defaultdict(list), defaultdict(list)
    for e in events:
        a = e["args"]
        if a.get("type") == "collective" and e["name"].startswith(prefix):
            calls[(e["pid"] - 1, e["name"])].append(a)
        if a.get("type") == "p2p" and a["call"].startswith(prefix):
            steps[(e["pid"] - 1, a["call"])].append(e)
    return calls, steps


def holds_one_permute(events, span):
    inside = [e for e in events if e["pid"] == span["pid"] and e["args"].get("type") == "op"
              and e["name"].startswith("ppermute") and span["ts"] - 1e-3 <= e["ts"]
              and e["ts"] + e["dur"] <= span["ts"] + span["dur"] + 1e-3]
    return len(inside) == 1


def test_ring_attention_sends_are_named_spans_forward_and_backward(mesh_of, tmp_path):
    """data=2,context=4: each device sends its K and V block C-1 = 3 times forward (the
    ring) and 3 times backward (dK, dV home), each a span of one step holding its permute,
    of B/2 x T/C x H x K x 2 float32 values."""
    C = 4
    ev = captured(mesh_of, tmp_path, "data=2,context=4")
    calls, steps = calls_of(ev, "send kv context")
    block = (B // 2) * (SEQ // C) * HEADS * (D // HEADS) * 2 * 4
    for d in range(8):
        for name in ("send kv context", "send kv context (backward)"):
            got = calls[(d, name)]
            assert len(got) == C - 1, (d, name, len(got))
            assert {(a["axis"], a["n"], a["bytes"], a["p2p_steps"]) for a in got} == {("context", C, block, 1)}
            assert len(steps[(d, name)]) == C - 1 and all(holds_one_permute(ev, s) for s in steps[(d, name)])


def test_the_experts_all_to_alls_are_named_spans_forward_and_backward(mesh_of, tmp_path):
    """data=2,expert=4, 8 experts, top 2: each device's dispatch and combine all-to-alls
    (pairwise: n-1 = 3 steps, each a span holding its permute) and their two transposes in
    the backward pass, each moving the E x C x D float32 buffer (C = 4 x 16 x 2 / 8)."""
    n, E, k, cf = 4, 8, 2, 4.0
    ev = captured(mesh_of, tmp_path, "data=2,expert=4", experts=E, top_k=k, capacity_factor=cf)
    calls, steps = calls_of(ev, "all_to_all pairwise expert")
    C = int(np.ceil(cf * (B // 8) * SEQ * k / E))
    for d in range(8):
        for name in ("all_to_all pairwise expert", "all_to_all pairwise expert (backward)"):
            got = [a for a in calls[(d, name)] if a["p2p_steps"]]
            assert len(got) == 2, (d, name, calls[(d, name)])
            assert {(a["axis"], a["n"], a["bytes"], a["p2p_steps"]) for a in got} == {("expert", n, E * C * D * 4,
                                                                                        n - 1)}
            assert len(steps[(d, name)]) == 2 * (n - 1) and all(holds_one_permute(ev, s) for s in steps[(d, name)])
