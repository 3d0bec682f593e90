"""The context axis (`dpjax.compute.context`): ring and all-gather attention against the plain
causal attention (outputs and gradients, every block layout, grouped-query K/V heads), a
GPT and a Llama step on meshes with a context axis against plain JAX on one device (with
data, tensor-parallel, FSDP and pipeline stage axes),
the plan's one-line refusals, and the bytes the compiled ring sends against the cost model
and its bound."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.compute import context
from dpjax import step as S
from dpjax.compute.attention import naive
from dpjax.collectives.cost import hlo_comm
from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.plan import UsageError, resolve
from dpjax.settings import Settings

B, T, H, K = 2, 16, 2, 4


def rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("name,C,Y", [("ring", 8, H), ("allgather", 4, H), ("ring", 4, 1),
                                      pytest.param("ring", 2, H, marks=pytest.mark.slow),
                                      pytest.param("allgather", 8, H, marks=pytest.mark.slow),
                                      pytest.param("allgather", 2, 1, marks=pytest.mark.slow)])
def test_context_attention_equals_plain_attention_and_its_gradients(mesh_of, put, name, C, Y):
    """Each device's queries (chunks i and 2C-1-i) attended across the axis give the rows
    of plain causal attention over the whole sequence, and the gradients (by autodiff
    through the ring's ppermutes / the all-gather) give plain attention's, to float32
    round-off: a wrong mask, a block skipped or counted twice, or a gradient not sent home
    is off by O(1). With Y < H K/V heads (grouped-query attention) the reference is plain
    attention with each K/V head repeated to its H/Y query heads, and dK, dV sum them."""
    mesh = mesh_of(f"context={C}", C)
    q, cot = rand(0, B, T, H, K), rand(3, B, T, H, K)
    k, v = rand(1, B, T, Y, K), rand(2, B, T, Y, K)
    order = context.layout_order(T, C)  # the positions in the order the devices hold them
    assert sorted(order) == list(range(T)) and list(order[:T // (2 * C)]) == list(range(T // (2 * C)))

    def body(q, k, v, cot):
        out, vjp = jax.vjp(lambda *a: context.CONTEXT_ATTENTIONS[name].attend(*a, "context"), q, k, v)
        return (out, *vjp(cot))

    spec = P(None, "context")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=False))
    got = fn(*(put(mesh, x[:, order], spec) for x in (q, k, v, cot)))
    out, vjp = jax.vjp(lambda q, k, v: naive(q, jnp.repeat(k, H // Y, axis=2), jnp.repeat(v, H // Y, axis=2)),
                       q, k, v)
    for g, w in zip(got, (out, *vjp(jnp.asarray(cot)))):
        # float32 sums in another order: measured at most 5e-7 apart, where a wrong block is O(1)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w)[:, order], rtol=1e-5, atol=2e-6)


SEQ = 16
MODEL = get_model("gpt", seq_len=SEQ, d_model=16, n_heads=4, d_ff=32)
# grouped-query attention: 2 K/V heads for 4 query heads (split over a model axis of 2), or 1 (replicated there)
LLAMAS = {Y: get_model("llama", seq_len=SEQ, d_model=16, n_layers=1, n_heads=4, n_kv_heads=Y, d_ff=32)
          for Y in (2, 1)}


def unsplit(model):
    """(tokens, loss, gradient) of plain JAX on one device."""
    tokens = np.random.default_rng(0).integers(0, 256, (1, 4, SEQ + 1)).astype(np.int32)
    whole = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    loss, grad = jax.jit(jax.value_and_grad(model.loss))(whole, tokens[0])
    return tokens, float(loss), grad


@pytest.fixture(scope="module")
def plain():
    return unsplit(MODEL)


@pytest.fixture(scope="module")
def plain_llama():
    """unsplit(LLAMAS[Y]) by Y, each computed once."""
    cache = {}

    def get(Y):
        if Y not in cache:
            cache[Y] = unsplit(LLAMAS[Y])
        return cache[Y]
    return get


def check_step(mesh_of, put, model, plain, mesh, attention, fsdp):
    """One SGD step (rate 1) of `model` on `mesh`: the loss is `plain`'s and the update minus its gradient."""
    tokens, loss0, grad = plain
    s = Settings(mesh=mesh, data="synthetic", batch_size=4, seq_len=SEQ, fsdp=fsdp, context_attention=attention)
    plan = resolve(s, mesh=mesh_of(mesh, 8), model=model, optimizer=optax.sgd(1.0))
    assert plan.layout.parallel().context_axis == "context" and plan.policy.context_attention == attention
    step = S.for_plan(plan, donate=False)
    p0 = S.init_params(model, plan.layout, jax.random.key(0))
    params, state = step.init(p0)
    p1, _, loss = step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh))))
    assert float(loss) == pytest.approx(loss0, rel=1e-6)
    got = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(p0), jax.device_get(p1))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(grad)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-7)


@pytest.mark.parametrize("mesh,attention,fsdp", [
    ("data=2,context=4", "ring", False),
    ("data=2,context=2,model=2", "allgather", True),  # tensor-parallel and FSDP beside the context axis
    pytest.param("data=2,context=4", "allgather", False, marks=pytest.mark.slow),  # (the fast two cover these)
    pytest.param("data=2,context=2,model=2", "ring", False, marks=pytest.mark.slow),
    pytest.param("data=2,context=4", "ring", True, marks=pytest.mark.slow),
    ("stage=2,data=2,context=2", "ring", False),  # a pipeline (1f1b, 2 micro-batches): stages send the chunks
    pytest.param("stage=2,context=4", "allgather", False, marks=pytest.mark.slow),
    pytest.param("stage=2,data=2,context=2", "ring", True, marks=pytest.mark.slow),  # FSDP inside each stage
])
def test_one_sgd_step_with_a_context_axis_moves_by_the_unsplit_gradient(mesh_of, put, plain, mesh, attention, fsdp):
    """A GPT step with sequences split over `context` (and data, tensor-parallel or FSDP
    axes beside it): the loss is the plain model's on the whole batch and the update is
    minus its gradient, to float32 round-off. Wrong positions, a wrong chunk, a missing
    mean over the context axis (a factor C) or a gradient not sent home through the ring
    each move it by far more. In a pipeline each stage embeds, runs and scores only its
    device's chunks, and sends those to the next stage."""
    check_step(mesh_of, put, MODEL, plain, mesh, attention, fsdp)


@pytest.mark.parametrize("mesh,attention,Y,fsdp", [
    ("data=2,context=4", "ring", 2, False),
    ("data=2,context=4", "allgather", 2, False),
    ("data=2,context=2,model=2", "ring", 2, False),  # the 2 K/V heads split over model, one a rank
    pytest.param("data=2,context=2,model=2", "allgather", 1, True, marks=pytest.mark.slow),  # 1 head, replicated
    pytest.param("data=2,context=2,model=2", "ring", 1, False, marks=pytest.mark.slow),
])
def test_a_llama_step_with_a_context_axis_moves_by_the_unsplit_gradient(mesh_of, put, plain_llama, mesh, attention,
                                                                         Y, fsdp):
    """The same for a one-layer Llama with grouped-query attention: rotary positions from
    each chunk's global positions (local ones would rotate chunk 2C-1-i as if it came
    early), the ring / all-gather carrying the Y K/V heads and each block repeating them
    to the query heads, dK and dV summed over each group before they travel home."""
    check_step(mesh_of, put, LLAMAS[Y], plain_llama(Y), mesh, attention, fsdp)


@pytest.mark.slow  # (the GPT's pipeline case is fast)
def test_a_llama_pipeline_with_a_context_axis_moves_by_the_unsplit_gradient(mesh_of, put):
    """A two-layer Llama in a pipeline of 2 stages beside a context axis of 2: each stage
    embeds and scores its device's chunks, rotary positions from the chunks' global ones."""
    model = get_model("llama", seq_len=SEQ, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    check_step(mesh_of, put, model, unsplit(model), "stage=2,data=2,context=2", "ring", False)


@pytest.mark.parametrize("settings,says", [
    (dict(mesh="data=2,context=4", seq_len=20), "--seq-len 20 does not split into 2C = 8 equal chunks"),
    (dict(mesh="data=2,context=4", model="mlp"), "--model mlp has no sequence to split over the context axis"),
    (dict(mesh="node=2,data=2,context=2", allreduce="hierarchical"), "--allreduce hierarchical reads two data axes"),
    (dict(mesh="data=2,context=4", context_attention="spiral"), "unknown --context-attention 'spiral'"),
])
def test_what_a_context_axis_cannot_run_is_refused_in_one_line(settings, says):
    with pytest.raises(UsageError) as e:
        resolve(Settings(data="synthetic", **settings))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_help_and_dry_run_tell_of_the_context_axis(capsys):
    from dpjax.train import main
    from dpjax.train.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--context-attention {ring,allgather}" in text and "device i holding chunks i and 2C-1-i" in text
    assert main(["--mesh", "data=2,context=4", "--data", "synthetic", "--seq-len", "64", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "layout: context-parallel (ring attention)" in out
    # B = 32 / 2 rows, T / C = 16 tokens, 8 heads of 16: K and V are 2 x 16 x 16 x 8 x 16 x 4 B = 0.25 MiB
    assert "in 8 chunks of 8 (device i holds i and 7-i); ring attention sends 0.75 MiB" in out
    # a Llama's 4 K/V heads travel, not its 8 query heads: half the GPT's bytes
    assert main(["--model", "llama", "--mesh", "data=2,context=4", "--data", "synthetic", "--seq-len", "64",
                 "--dry-run"]) == 0
    assert "ring attention sends 0.38 MiB" in capsys.readouterr().out


@pytest.mark.parametrize("name,Y", [(name, Y) for name in context.CONTEXT_ATTENTIONS for Y in (H, 1)])
def test_the_compiled_attention_sends_what_the_cost_model_says_which_is_the_bound(mesh_of, name, Y):
    """Bytes each device sends in the compiled program (collective-permutes read from the
    HLO), forward and forward + backward, against `context.schedule` and the bound (the
    other C-1 devices' K and V): a ring that sent a block too many, or a backward that
    gathered everything again, would show here. With Y < H K/V heads only the Y travel
    (a ring that repeated them to the H query heads first would send H/Y times as much)."""
    C = 4
    mesh = mesh_of(f"context={C}", C)
    attend = context.CONTEXT_ATTENTIONS[name].attend
    spec = P(None, "context")
    q, kv = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32), jax.ShapeDtypeStruct((B, T, Y, K), jnp.float32)

    def compiled(body):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
        return hlo_comm(fn.lower(q, kv, kv).compile().as_text())

    forward = compiled(lambda q, k, v: attend(q, k, v, "context"))
    both = compiled(lambda q, k, v: jax.grad(lambda *a: jnp.sum(attend(*a, "context")), argnums=(0, 1, 2))(q, k, v)[1])
    kv_bytes = 2 * B * (T // C) * Y * K * 4
    sched = context.schedule(name, C, B, T, Y, K)
    assert sched.bytes == context.bound_bytes(C, kv_bytes) == (C - 1) * kv_bytes
    assert set(forward.bytes_per_device.values()) == {sched.bytes}, forward.bytes_per_device
    assert set(both.bytes_per_device.values()) == {2 * sched.bytes}, both.bytes_per_device
