"""Timelines (`dpjax.timeline`) on 8 simulated CPU devices, checked against independent
references: the compiled step's collective ops (its HLO text), the ring's schedule
(`cost.schedule`), the fusion plan, and the host's wall time around each step."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import Counter, defaultdict
from types import SimpleNamespace

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.compression import Exchange
from dpjax import timeline
from dpjax.collectives.cost import hlo_comm, schedule
from dpjax.data import make_streams
from dpjax.fusion import plan_buckets
from dpjax.models import get_model
from dpjax.sharding import make_layout
from dpjax.timeline import main as summary_main
from dpjax.timeline import summarize

FUSION_MB = 0.01  # the MLP's 5 gradients in 4 buckets
PROFILED = (5, 6)


def _mlp_step(mesh):
    model = get_model("mlp", seq_len=16)
    layout = make_layout(model, mesh)
    return model, layout, S.for_model(model, layout, global_batch=16, exchange=Exchange("ring", FUSION_MB))


@pytest.fixture(scope="module")
def profiled(mesh_of, tmp_path_factory):
    """Two profiled steps of a ring-allreduced MLP on 8x1, between unprofiled ones."""
    mesh = mesh_of("8x1", 8)
    model, layout, st = _mlp_step(mesh)
    params, state = st.init(S.init_params(model, layout, jax.random.key(0)))
    batch = S.put_batch(make_streams("synthetic", 16, 0)[0], 0, 16, mesh, passes=1)
    args = (params, state, batch)

    def run():
        nonlocal params, state
        params, state, _ = st.train(params, state, batch)
        jax.block_until_ready((params, state))

    run()  # compiles
    text = timeline.compiled_text(st.train, *args)
    rec = timeline.Recorder()
    rec.program(st.train, *args)
    run()  # before the profile: not traced
    wall = {}
    with rec.profile():
        for i in PROFILED:
            t = time.perf_counter()
            with rec.step(i):
                run()
            wall[i] = (time.perf_counter() - t) * 1e6
    run()  # after it: not traced
    path = str(tmp_path_factory.mktemp("timeline") / "mlp.trace.json")
    data = rec.write(path)
    grads = jax.eval_shape(model.init, jax.random.key(0))
    return SimpleNamespace(data=data, path=path, text=text, wall=wall, mesh=mesh,
                           plan=plan_buckets(grads, FUSION_MB * 2**20), events=[e for e in data["traceEvents"]
                                                                             if e["ph"] == "X"])


def _collective_instructions(text: str) -> set:
    """Names of the collective ops of a compiled program, read straight from its text."""
    return set(re.findall(r"^\s*(?:ROOT\s+)?%(\S+)\s*=.*?\s(?:collective-permute|all-reduce|all-gather|"
                          r"reduce-scatter|all-to-all)(?:-start)?\(", text, re.M))


def test_every_collective_of_the_step_has_its_spans_on_every_device(profiled):
    ev, plan = profiled.events, profiled.plan
    collectives = _collective_instructions(profiled.text)
    # 4 rings and the loss's psum (the clipping norm's sum over `model`, of one device, is left out)
    assert len(collectives) == hlo_comm(profiled.text).steps == 4 * 14 + 1
    runs = {(e["pid"] - 1, e["args"]["step"]) for e in ev if e["args"].get("type") == "run"}
    assert runs == {(d, s) for d in range(8) for s in PROFILED}
    executed = defaultdict(Counter)
    for e in ev:
        if e["args"].get("type") == "op" and e["name"] in collectives:
            executed[(e["pid"] - 1, e["args"]["step"])][e["name"]] += 1
    for key in runs:  # each collective op once per step on every device, and tagged communication
        assert executed[key] == Counter({name: 1 for name in collectives}), key
    assert all(e["args"]["kind"] == "comm" for e in ev if e["args"].get("type") == "op" and e["name"] in collectives)

    calls = defaultdict(list)
    p2p = defaultdict(list)
    for e in ev:
        a = e["args"]
        if a.get("type") == "collective" and a["bucket"] is not None:
            calls[(e["pid"] - 1, a["step"])].append(a)
        if a.get("type") == "p2p":
            p2p[(e["pid"] - 1, a["step"], a["call"])].append(a)
    for key in runs:
        got = sorted(calls[key], key=lambda a: a["bucket"])
        assert [a["bucket"] for a in got] == list(range(len(plan.buckets))) and len(plan.buckets) == 4
        for a, bucket in zip(got, plan.buckets):
            ring = schedule("ring", 8, sum(bucket.sizes))
            assert (a["collective"], a["algorithm"], a["axis"], a["n"]) == ("allreduce", "ring", "data", 8)
            assert a["bytes"] == bucket.nbytes and a["phase"] == "exchange"
            assert a["p2p_steps"] == ring.steps == 14
            steps = p2p[(*key, f"allreduce ring data, bucket {a['bucket'] + 1}/4")]
            assert sorted(s["index"] for s in steps) == list(range(1, 15))
            assert {s["bytes"] for s in steps} == {ring.bytes // ring.steps}


def test_each_ring_step_span_holds_its_permute(profiled):
    """The join is right: every point-to-point span contains the collective-permute
    executed in it, on the same device."""
    ev = profiled.events
    permutes = defaultdict(list)
    for e in ev:
        if e["args"].get("type") == "op" and e["name"].startswith("ppermute"):
            permutes[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    spans = [e for e in ev if e["args"].get("type") == "p2p"]
    assert len(spans) == 8 * len(PROFILED) * 4 * 14
    for s in spans:
        inside = [p for p in permutes[s["pid"]] if s["ts"] - 1e-3 <= p[0] and p[1] <= s["ts"] + s["dur"] + 1e-3]
        assert len(inside) == 1, s


def test_rendezvous_waits_lie_inside_collectives(profiled):
    """Waits (XLA's CPU rendezvous) carry no device: each is placed in the collective op
    that contains it on the same thread, and counted as waiting."""
    ev = profiled.events
    comm = defaultdict(list)
    for e in ev:
        if e["args"].get("type") == "op" and e["args"]["kind"] == "comm":
            comm[(e["pid"], e["args"]["step"])].append((e["ts"], e["ts"] + e["dur"]))
    waits = [e for e in ev if e["args"].get("kind") == "wait"]
    assert waits and sum(w["dur"] for w in waits) > 0  # 8 devices on a few cores: somebody waits
    for w in waits:
        inside = comm[(w["pid"], w["args"]["step"])]
        assert any(s - 1e-3 <= w["ts"] and w["ts"] + w["dur"] <= t + 1e-3 for s, t in inside)
    assert sum(r["wait"] for r in summarize(profiled.data).steps) > 0


def test_summary_splits_each_step_and_stays_within_its_wall_time(profiled):
    summary = summarize(profiled.data)
    assert [r["step"] for r in summary.steps] == list(PROFILED)
    for r in summary.steps:
        assert r["comm"] > 0 and r["compute"] > 0
        assert r["comm"] + r["wait"] < r["time"]
        assert 0 < r["comm_fraction"] < 1
        assert r["time"] <= profiled.wall[r["step"]]  # the devices ran inside the host's step
    for r in summary.devices:  # the four parts are the step, on every device
        assert r["compute"] + r["comm"] + r["wait"] + r["gap"] == pytest.approx(r["time"], rel=1e-9)
    rings = [r for r in summary.collectives if r["collective"] == "allreduce"]
    assert sorted(r["bytes"] for r in rings) == sorted(b.nbytes for b in profiled.plan.buckets)
    assert all(r["calls"] == 1 and r["p2p_steps"] == 14 and r["busbw"] == pytest.approx(
        r["algbw"] * 2 * 7 / 8) for r in rings)


def test_only_the_steps_asked_for_are_profiled(profiled):
    runs = Counter(e["args"]["module"] for e in profiled.events if e["args"].get("type") == "run")
    assert runs == Counter({profiled.data["otherData"]["main"]: 8 * len(PROFILED)})


def test_named_scopes_change_no_op(profiled, monkeypatch):
    """The names cost nothing: the step compiled without them (no named scope, and the
    public collectives without the wrapper that names them) has the same ops."""
    import dpjax.collectives as C

    monkeypatch.setattr(jax, "named_scope", lambda name: contextlib.nullcontext())
    for name in ("allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"):
        monkeypatch.setattr(C, name, getattr(C, name).__wrapped__)
    model, layout, st = _mlp_step(profiled.mesh)
    params, state = jax.eval_shape(st.init, jax.eval_shape(model.init, jax.random.key(0)))
    pshard, sshard = st.shardings()
    place = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    batch = jax.ShapeDtypeStruct((1, 16, 17), jax.numpy.int32, sharding=NamedSharding(profiled.mesh, P(None, "data")))
    bare = timeline.compiled_text(st.train, place(params, pshard), place(state, sshard), batch)
    assert "dpjax:" not in bare and "dpjax:" in profiled.text
    opcodes = lambda text: Counter(op for op, _ in timeline.Program.from_text(text).ops.values())  # noqa: E731
    assert opcodes(bare) == opcodes(profiled.text)


def test_calls_with_the_same_arguments_stay_apart(mesh_of):
    """Two allreduces of one shape, independent (XLA may interleave their steps), and
    their transposes in the backward pass: four calls of a full ring each, per device."""
    import jax.numpy as jnp
    import optax

    from dpjax import collectives as C
    from dpjax.updates import make_rule

    def loss_fn(params, batch):
        x = batch.astype(jnp.float32)
        a = C.allreduce(x[:, :8] * params["w"], "data")
        b = C.allreduce(x[:, 8:16] * params["w"], "data")
        return jnp.mean(a * b)

    mesh = mesh_of("8x1", 8)
    params = {"w": jnp.ones(8)}
    st = S.make_update_step(loss_fn, make_rule("sync", optax.sgd(0.1), "data"), mesh, params)
    params, state = st.init(jax.device_put(params, NamedSharding(mesh, P())))
    batch = S.put_batch(make_streams("synthetic", 16, 0)[0], 0, 16, mesh, passes=1)
    # the warm-up step must end before the profile starts, or its last ops are in it
    params, state, _ = jax.block_until_ready(st.train(params, state, batch))
    rec = timeline.Recorder()
    rec.program(st.train, params, state, batch)
    with rec.profile():
        with rec.step(0):
            params, state, _ = st.train(params, state, batch)
            jax.block_until_ready((params, state))
    calls = Counter()
    for e in build_events(rec):
        a = e["args"]
        if a.get("type") == "collective" and a["bucket"] is None and a["collective"] == "allreduce":
            assert a["p2p_steps"] == schedule("ring", 8, 16).steps == 14, e
            calls[(e["pid"], e["name"])] += 1
    assert calls == Counter({(d + 1, name): 2 for d in range(8)
                             for name in ("allreduce ring data", "allreduce ring data (backward)")})


def build_events(rec):
    from dpjax.timeline import build

    data = build(rec.raw_events(), list(rec.programs.values()), main=rec.main)
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


def test_cli_prints_the_summary_and_draws_it(profiled, capsys, tmp_path):
    assert summary_main([profiled.path]) == 0
    out = capsys.readouterr().out
    assert "per step" in out and "per collective" in out and "slowest device" in out
    assert re.search(r"^5\s", out, re.M) and re.search(r"^6\s", out, re.M)
    assert "allreduce ring data, bucket 4/4" in out
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert summary_main([profiled.path, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content, says", [
    (None, "no timeline file"),
    ("{not json", "not JSON"),
    ('{"traceEvents": []}', "not a dpjax timeline"),
    ('{"traceEvents": [{"ph": "X", "name": "a"}], "otherData": {"format": "%s"}}' % timeline.FORMAT,
     "damaged"),
])
def test_cli_bad_file_is_one_line_and_exit_2(tmp_path, capsys, content, says):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    assert summary_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_written_file_is_a_chrome_trace(profiled):
    with open(profiled.path) as fh:
        data = json.load(fh)
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "host")} | {(d + 1, f"device {d}") for d in range(8)}
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in data["traceEvents"] if e["ph"] == "X")
