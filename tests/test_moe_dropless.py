"""The dropless mixture (`dpjax.models.moe_dropless`): every token through each of its
top-k experts, weighted as routed, against a numpy loop over the tokens, on one device
(both grouped matmuls) and over data=2,expert=4 (counts, then rows, by explicit
all-to-alls whose bytes the cost model predicts), also when the router sends every
token of every device to the experts of one device."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.collectives.cost import bus_factor, hlo_comm, schedule
from dpjax.models import moe, moe_dropless

N, D, F, E, K = 16, 8, 12, 8, 2  # tokens per device, width, expert width, experts, top-k
ROWS = ("data", "expert")  # a device's tokens: its block of the batch over both axes
SPECS = {"router_DxX": P(), "w1_XexDxF": P("expert"), "b1_XexF": P("expert"), "w2_XexFxD": P("expert"),
         "b2_XexD": P("expert")}


def params(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    return {"router_DxX": r(D, E), "w1_XexDxF": r(E, D, F), "b1_XexF": r(E, F), "w2_XexFxD": r(E, F, D),
            "b2_XexD": r(E, D)}


def reference(x, p, k=K, normalize=True):
    """Each token, one at a time, through its top-k experts (float64): the mixture as written."""
    logits = x.astype(np.float64) @ p["router_DxX"]
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    y = np.zeros(x.shape, np.float64)
    for i in range(len(x)):
        top = np.argsort(-prob[i], kind="stable")[:k]
        gates = prob[i, top] / (prob[i, top].sum() if normalize else 1.0)
        for e, g in zip(top, gates):
            h = x[i] @ p["w1_XexDxF"][e] + p["b1_XexF"][e]
            h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))  # GELU (tanh), as jax.nn.gelu
            y[i] += g * (h @ p["w2_XexFxD"][e] + p["b2_XexD"][e])
    return y


@pytest.mark.parametrize("form,normalize", [("segment", True), ("ragged", False)])
def test_one_device_equals_every_token_through_its_experts(form, normalize):
    """ragged_dot and the segment form give the numpy mixture; gates renormalised (Mixtral)
    or not (Qwen3-MoE's norm_topk_prob false); nothing dropped."""
    p, x = params(), np.random.default_rng(1).standard_normal((4 * N, D)).astype(np.float32)
    y, stats = jax.jit(lambda x, p: moe.moe_mlp(x, p, k=K, capacity_factor=1.0, form="dropless", grouped=form,
                                                normalize=normalize))(x, p)
    np.testing.assert_allclose(np.asarray(y), reference(x, p, normalize=normalize), rtol=1e-5, atol=1e-5)
    assert int(stats["dropped"]) == 0


def _over_axis_program(mesh, grads: bool):
    """The dropless mixture on data=2,expert=4: (y) or, with `grads`, (y, each device's dL/dp
    with a leading axis to sum outside (no all-reduce in the program), dL/dx)."""
    def f(p, x):
        return moe.moe_mlp(x, p, k=K, capacity_factor=1.0, axis="expert", form="dropless")[0]

    def local(p, x, cot):
        if not grads:
            return f(p, x)
        y, vjp = jax.vjp(f, p, x)
        gp, gx = vjp(cot)
        return y, jax.tree.map(lambda g: g[None], gp), gx

    each = {k: P(ROWS) if k == "router_DxX" else P("data", "expert") for k in SPECS}
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(SPECS, P(ROWS), P(ROWS)),
                                 out_specs=(P(ROWS), each, P(ROWS)) if grads else P(ROWS), check_vma=False))


@pytest.fixture(scope="module")
def forward(mesh_of, put):
    """(run(p, x) -> y, the compiled program's text): the forward on data=2,expert=4, compiled once."""
    mesh = mesh_of("data=2,expert=4", 8)
    fn = _over_axis_program(mesh, grads=False)

    def placed(p, x):
        return {k: put(mesh, v, SPECS[k]) for k, v in p.items()}, put(mesh, x, P(ROWS)), put(mesh, x, P(ROWS))

    x0 = np.zeros((8 * N, D), np.float32)
    return (lambda p, x: np.asarray(fn(*placed(p, x)))), fn.lower(*placed(params(), x0)).compile().as_text()


def test_over_data2_expert4_equals_the_numpy_mixture_and_sends_the_bytes_of_the_bound(forward):
    """8 devices' tokens (2 data x 4 expert ranks), 2 experts a device: the outputs equal
    the numpy mixture, and the compiled program sends what the cost model says: the counts
    all-to-all (n x E/n int32) first, then the dispatch and combine all-to-alls of n x S x D
    float32 (S = N min(k, E/n) rows a destination), each (n-1)/n of its buffer, the
    all-to-all's bound (pairwise sends every block once)."""
    run, text = forward
    p, x = params(), np.random.default_rng(2).standard_normal((8 * N, D)).astype(np.float32)
    np.testing.assert_allclose(run(p, x), reference(x, p), rtol=1e-5, atol=1e-5)
    n, El = 4, E // 4
    rows = moe_dropless.row_bytes(N, K, El, n, D, 4)
    counts = schedule("pairwise", n, n * El, 4, primitive="all_to_all").bytes
    moved = 2 * schedule("pairwise", n, rows // 4, 4, primitive="all_to_all").bytes
    assert moved == 2 * bus_factor("all_to_all", n) * rows
    comm = hlo_comm(text)
    assert comm.max_bytes == counts + moved and comm.steps == 3 * (n - 1)
    print(f"dropless forward: {comm.max_bytes} B sent a device in {comm.steps} steps; the cost model's {counts} B "
          f"(counts) + {moved} B (rows), the bound's (n-1)/n of each {rows} B buffer")


def test_no_token_dropped_when_every_token_goes_to_one_device(forward):
    """A router that sends every token of all 8 devices to experts 0 and 1 (both on expert
    rank 0): that rank receives n S rows, the bound, and the outputs still equal the numpy
    mixture; the capacity form at factor 1.25 drops most choices of the same tokens."""
    run, _ = forward
    p, rng = params(3), np.random.default_rng(4)
    x = rng.standard_normal((8 * N, D)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) + 4.0  # a large positive feature ...
    p["router_DxX"][0] = 0.0
    p["router_DxX"][0, :2] = [12.0, 11.0]  # ... that experts 0 and 1 read: every token's top 2
    assert set(np.argsort(-(x @ p["router_DxX"]), axis=-1)[:, :K].reshape(-1)) == {0, 1}
    np.testing.assert_allclose(run(p, x), reference(x, p), rtol=1e-5, atol=1e-5)
    dropped = jax.jit(lambda x, p: moe.moe_mlp(x, p, k=K, capacity_factor=1.25)[1]["dropped"])(x[:N], p)
    assert int(dropped) > N  # the capacity form's ceil(1.25 N k / E) slots keep few of them


@pytest.mark.slow  # ~30 s of CPU: the gradient's program over the axis
def test_gradients_over_data2_expert4_equal_one_device(mesh_of, put):
    """Every gradient of the dropless mixture over data=2,expert=4 (the experts' summed over
    data, the router's over all devices) equals one device's on all the tokens: the
    transposed all-to-alls bring each row's cotangent home to its expert."""
    mesh = mesh_of("data=2,expert=4", 8)
    p, rng = params(), np.random.default_rng(2)
    x, cot = (rng.standard_normal((8 * N, D)).astype(np.float32) for _ in range(2))
    fn = _over_axis_program(mesh, grads=True)
    y, gp, gx = jax.tree.map(np.asarray, fn({k: put(mesh, v, SPECS[k]) for k, v in p.items()},
                                            put(mesh, x, P(ROWS)), put(mesh, cot, P(ROWS))))

    @jax.jit
    def one(p, x, cot):
        y, vjp = jax.vjp(lambda p, x: moe.moe_mlp(x, p, k=K, capacity_factor=1.0, form="dropless")[0], p, x)
        return (y, *vjp(cot))

    y1, gp1, gx1 = jax.tree.map(np.asarray, one(p, x, cot))
    np.testing.assert_allclose(y, y1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, gx1, rtol=1e-5, atol=1e-5)
    for name in p:
        np.testing.assert_allclose(gp[name].sum(0), gp1[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _train(mesh: str, metrics: str, *extra) -> list[float]:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "dpjax.train", "--mesh", mesh, "--experts", "8", "--top-k", "2", "--moe", "dropless",
           "--steps", "10", "--batch-size", "8", "--seq-len", "32", "--d-model", "32", "--n-heads", "4", "--d-ff",
           "32", "--eval-every", "0", "--progress", "none", "--lr", "3e-3", "--metrics", metrics, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, cwd=root,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return [row["loss"] for row in map(__import__("json").loads, open(metrics)) if "loss" in row and "step" in row]


@pytest.mark.slow  # two GPT training runs in processes (~3 min under load)
def test_ten_steps_on_data2_expert4_equal_8x1(tmp_path):
    """A GPT whose MLPs are 8 dropless experts (top 2), 10 AdamW steps on data=2,expert=4
    (the rows through the all-to-alls) and on 8x1 (every expert on every device): each
    device's tokens are a routing group on both, so the losses (the router's included)
    agree within 1e-5 at every step."""
    split = _train("data=2,expert=4", str(tmp_path / "ep.jsonl"))
    whole = _train("8x1", str(tmp_path / "dp.jsonl"))
    assert len(split) == len(whole) == 10 and np.isfinite(split).all() and split[-1] < split[0]
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-5)
