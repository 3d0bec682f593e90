"""The HLO reader (`dpjax.hlo`): hardware FLOPs counted from dots and cuBLAS / cuDNN custom
calls (against the model's count on the H200 fixture, and against 2 M N K by hand on
programs compiled here), loop bodies counted trip-count times, unknown custom calls and
loops reported as unknown; and the collective bytes of a scanned exchange (`hlo_comm`)."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import hlo
from dpjax.collectives.cost import hlo_comm

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "h200", "program1.hlo.txt")


def _compiled(fn, *args) -> hlo.Module:
    return hlo.Module(jax.jit(fn).lower(*args).compile().as_text())


def test_the_h200_step_counts_at_least_the_models_flops():
    """The main job's step on the H200 (GPT 256 / 128 / 128 x 2 layers / 8 heads / 512,
    batch 32, mesh 1x1): its 36 dots and 3 cuBLAS matmuls hold at least the model's
    `flops_per_token()` x 4096 tokens (equal here: no recomputation, full T x T scores)."""
    from dpjax.models.gpt import GPT, GPTConfig

    module = hlo.Module(open(FIXTURE).read())
    flops = module.flops()
    model = GPT(GPTConfig()).flops_per_token() * 32 * 128
    assert flops.unknown == () and flops.value == flops.total
    assert flops.value >= model
    assert flops.value == pytest.approx(model, rel=1e-9)
    # the cuBLAS calls carry part of it: without them the count falls short of the model
    gemms = [(c, i) for c in module.computations.values() for i in c.instructions
             if i.op == "custom-call" and "__cublas$lt$matmul" in i.attrs]
    assert len(gemms) == 3
    in_gemms = sum(hlo.instruction_flops(c, i) for c, i in gemms)
    assert in_gemms == 2 * (2 * 32 * 128 * 128 * 128) + 2 * 32 * 128 * 256 * 128  # dV-side bmm x 2, the head
    assert flops.value - in_gemms < model


@pytest.mark.parametrize("m,k,n", [(64, 32, 48), (1, 256, 8)])
def test_a_compiled_matmul_is_2mnk(m, k, n):
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    assert _compiled(jnp.dot, a, b).flops().value == 2 * m * n * k


def test_a_batched_einsum_counts_its_batch():
    q, kk = jnp.ones((4, 6, 16, 8)), jnp.ones((4, 6, 24, 8))  # B N T H, B N S H
    module = _compiled(lambda q, k: jnp.einsum("bnth,bnsh->bnts", q, k), q, kk)
    assert module.flops().value == 2 * 4 * 6 * 16 * 24 * 8


def test_a_scanned_matmul_counts_every_trip():
    """lax.scan over L weight matrices is a while loop of known trip count L: L x 2 M N K."""
    L, M, D = 7, 32, 64

    def layers(w_LxDxD, x_MxD):
        def body(x, w):
            return jnp.tanh(x @ w), None

        return jax.lax.scan(body, x_MxD, w_LxDxD)[0]

    module = _compiled(layers, jnp.ones((L, D, D)), jnp.ones((M, D)))
    assert any(i.op == "while" for c in module.computations.values() for i in c.instructions)
    assert module.flops().value == L * 2 * M * D * D
    # and its gradient: per layer the forward, dx = g w^T and dw = x^T g
    grad = _compiled(jax.grad(lambda w, x: layers(w, x).sum(), argnums=(0, 1)), jnp.ones((L, D, D)),
                     jnp.ones((M, D)))
    assert grad.flops().value == 3 * L * 2 * M * D * D


def test_a_convolution_is_2_x_output_x_kernel_per_feature():
    x, w = jnp.ones((2, 3, 16, 16)), jnp.ones((8, 3, 3, 3))  # N C H W, O I H W
    module = _compiled(lambda x, w: jax.lax.conv(x, w, (1, 1), "VALID"), x, w)
    assert module.flops().value == 2 * (2 * 8 * 14 * 14) * (3 * 3 * 3)


def _fmha(target: str, operands: str, extra: str = "") -> str:
    config = ('{"operation_queue_id":"0","cudnn_fmha_backend_config":{"fmha_scale":0.125,'
              '"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["2","4","128","256"]},'
              '"is_flash_attention":true,"mask_type":"CAUSAL"' + extra + '}}')
    return (f"  %fmha = (bf16[2,128,4,64]{{3,2,1,0}}, f32[2,4,128]{{2,1,0}}, u8[0]{{0}}) custom-call({operands}), "
            f'custom_call_target="{target}", backend_config={config}')


def test_cudnn_flash_attention_is_4_bnts_h_forward_and_10_backward():
    """Q: B T N H = 2 x 128 x 4 x 64, K / V: 2 x 256 x 4 x 64; scores B N T S = 2 x 4 x 128 x 256."""
    params = ("  %q = bf16[2,128,4,64]{3,2,1,0} parameter(0)\n  %k = bf16[2,256,4,64]{3,2,1,0} parameter(1)\n"
              "  %v = bf16[2,256,4,64]{3,2,1,0} parameter(2)\n")
    forward = hlo.Module(params + _fmha("__cudnn$fmhaSoftmax", "%q, %k, %v"))
    assert forward.flops().value == 4 * 2 * 4 * 128 * 256 * 64
    backward = hlo.Module(params + _fmha("__cudnn$fmhaSoftmaxBackward", "%q, %k, %v, %v, %q, %q"))
    assert backward.flops().value == 10 * 2 * 4 * 128 * 256 * 64
    # without its operands' shapes the call cannot be counted: unknown, not zero
    blind = hlo.Module(_fmha("__cudnn$fmhaSoftmax", "%q, %k, %v")).flops()
    assert blind.value is None and blind.unknown == ("custom-call __cudnn$fmhaSoftmax without its dimensions",)


def test_what_cannot_be_counted_is_unknown():
    text = """
%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %d = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%i, %d)
}

%cond (p.1: (s32[], f32[8,8])) -> pred[] {
  %p.1 = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[8,8]{1,0}) tuple(%z, %a)
  %w = (s32[], f32[8,8]{1,0}) while(%t0), condition=%cond, body=%body{trips}
  %k = f32[8,8]{1,0} custom-call(%a), custom_call_target="{target}"
  ROOT %r = f32[8,8]{1,0} get-tuple-element(%w), index=1
}
"""
    known = ', backend_config={"known_trip_count":{"n":"3"}}'
    counted = hlo.Module(text.replace("{trips}", known).replace("{target}", "Sharding")).flops()
    assert counted.value == 3 * 2 * 8 * 8 * 8
    loop = hlo.Module(text.replace("{trips}", "").replace("{target}", "Sharding")).flops()
    assert loop.value is None and loop.unknown == ("while loop w without a known trip count",)
    kernel = hlo.Module(text.replace("{trips}", known).replace("{target}", "__gpu$xla.gpu.triton")).flops()
    assert kernel.value is None and kernel.unknown == ("custom-call __gpu$xla.gpu.triton",)
    assert kernel.total == counted.value  # what could be counted still is


def test_a_conditional_costs_its_dearest_branch():
    def f(p, a):
        return jax.lax.cond(p, lambda a: a @ a @ a, lambda a: a @ a, a)

    module = _compiled(f, True, jnp.ones((16, 16)))
    assert module.flops().value == 2 * (2 * 16 * 16 * 16)


def test_a_scanned_exchange_sends_trip_count_times_one_iteration(mesh_of):
    """A shard_map'd lax.scan of 5 trips, each a ppermute around 8 devices and a psum, of
    f32[16] per device: a ppermute sends 64 B, the psum a ring's 2 x 7 x 64/8 = 112 B."""
    mesh, trips = mesh_of("data=8", 8), 5

    def body(x_X):
        assert x_X.shape == (16,)

        def one(c, _):
            c = jax.lax.ppermute(c, "data", [(i, (i + 1) % 8) for i in range(8)])
            return c + jax.lax.psum(c, "data"), None

        return jax.lax.scan(one, x_X, None, length=trips)[0]

    x = jax.device_put(jnp.ones((8 * 16,)), NamedSharding(mesh, P("data")))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    comm = hlo_comm(fn.lower(x).compile().as_text())
    assert dict(comm.ops) == {"collective-permute": trips, "all-reduce": trips} and comm.unknown_trips == 0
    assert comm.steps == 2 * trips
    assert dict(comm.bytes_per_device) == {d: trips * (64 + 2 * 7 * 64 // 8) for d in range(8)}
