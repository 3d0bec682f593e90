"""The compute policy of a run: what the layers compute in, what they keep for the
backward pass, and which attention kernel they call.

    dtype         the compute dtype of the layers' matmuls, the residual stream and the
                  activations a pipeline stage sends (bfloat16 on GPU / TPU by default,
                  float32 on CPU: `resolve`); fp8: the layers' projection matmuls (the
                  ones a model computes through `einsum` / `matmul` below: attention's
                  Q K V and output, the MLP's, the experts') in float8 with per-tensor
                  scaling (`dpjax.compute.fp8`: e4m3 forward, e5m2 gradients), bfloat16 for
                  everything else the dtype covers
    param_dtype   the master weights and, following them, the optimizer state (float32,
                  as MaxText, Levanter and flax's `param_dtype` keep them)
    remat         what a layer keeps for the backward pass (`jax.checkpoint`):
                    none  everything (fastest, most memory)
                    dots  the matmul outputs and the attention output (named: a fused
                          attention call is not a dot); the rest is recomputed
                    full  only the layer's input; the whole layer is recomputed
    attention     the causal attention kernel (`dpjax.compute.attention`): naive (T x T scores
                  written out), xla (`jax.nn.dot_product_attention`'s XLA kernel), cudnn
                  (its cuDNN flash kernel, GPU only)
    scan          the stacked layers run as one `lax.scan` (compile time flat in depth)
                  rather than a Python loop (`dpjax.compute.stack`)
    context_attention  how attention crosses a `context` axis (`dpjax.compute.context`: ring or
                  allgather; the plan checks the name)
    expert_alltoall  the all-to-all a mixture of experts dispatches and combines by
                  (`dpjax.models.moe`: pairwise, bruck, or xla's)

Whatever the policy, the numerically sensitive parts compute in float32: the layer
norms' statistics, the softmax, the logits and the loss (the models and
`dpjax.compute.attention` upcast them); gradients are taken with respect to the float32 master
weights, so accumulation across micro-batches and the update rules' state stay float32.

`Policy()` is float32, no remat, naive attention, scanned: the dense reference the
tests compare with. `resolve` turns the user's choices (`auto`) into a policy for a
platform and refuses, in one line, what cannot run there.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dpjax.compute import fp8

DTYPES = ("float32", "bfloat16", "float16", "fp8")
PARAM_DTYPES = ("float32", "bfloat16", "float16")  # fp8 is a way to multiply, not a dtype to keep weights in
REMATS = ("none", "dots", "full")
ATTENTIONS = ("naive", "xla", "cudnn")
ATTENTION_NAME = "attention"  # the checkpoint name of the attention output (saved by remat=dots)


@dataclass(frozen=True)
class Policy:
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "naive"
    scan: bool = True
    context_attention: str = "ring"  # across a context axis: a name of dpjax.compute.context.CONTEXT_ATTENTIONS
    expert_alltoall: str = "pairwise"  # a mixture's dispatch and combine: a dpjax all-to-all algorithm

    def __post_init__(self):
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("param_dtype", self.param_dtype, PARAM_DTYPES),
                                     ("remat", self.remat, REMATS), ("attention", self.attention, ATTENTIONS)):
            if value not in allowed:
                raise ValueError(f"Policy {name}={value!r}: expected one of {', '.join(allowed)}")

    @property
    def compute(self):
        """The dtype the layers compute in (bfloat16 under fp8: what is not an fp8 matmul)."""
        return jnp.dtype("bfloat16" if self.dtype == "fp8" else self.dtype)

    def _fp8(self, x, w) -> bool:
        # only operands in the compute dtype: a float32 operand is one of the numerically
        # sensitive parts the model upcast on purpose (the tied head's logits, the router)
        return self.dtype == "fp8" and x.dtype == w.dtype == self.compute

    def einsum(self, spec: str, x, w):
        """A layer's projection `jnp.einsum(spec, x, w)` (two operands), in fp8 under dtype=fp8."""
        return fp8.einsum(spec, x, w) if self._fp8(x, w) else jnp.einsum(spec, x, w)

    def matmul(self, x, w_DxF):
        """A layer's projection `x @ w_DxF`, in fp8 under dtype=fp8."""
        return fp8.matmul(x, w_DxF) if self._fp8(x, w_DxF) else x @ w_DxF

    def cast(self, tree):
        """`tree`'s floating leaves in the compute dtype (integers, e.g. token ids, as they are)."""
        def one(x):
            return x.astype(self.compute) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != self.compute else x
        return jax.tree.map(one, tree)

    def store(self, tree):
        """`tree`'s floating leaves in the parameter dtype (what `init` makes the master weights)."""
        want = jnp.dtype(self.param_dtype)
        return jax.tree.map(lambda x: x.astype(want) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def checkpoint(self, fn):
        """`fn` rematerialised by the policy (`jax.checkpoint`), or as it is for remat=none."""
        if self.remat == "none":
            return fn
        if self.remat == "full":
            policy = jax.checkpoint_policies.nothing_saveable
        else:  # dots: matmuls without batch dimensions (the projections) and the named attention output
            policy = jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.save_only_these_names(ATTENTION_NAME))
        return jax.checkpoint(fn, policy=policy, prevent_cse=not self.scan)

    def describe(self) -> dict:
        return {"dtype": self.dtype, "param_dtype": self.param_dtype, "remat": self.remat,
                "attention": self.attention, "scan": self.scan, "context_attention": self.context_attention,
                "expert_alltoall": self.expert_alltoall}


def accelerated(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm", "tpu")


def remat_candidates(platform: str) -> tuple[str, ...]:
    """--remat auto's candidates in the order tried (the first whose estimate fits a device is
    chosen). Off a GPU: the least recomputation first, none, dots, full (on CPU the step is
    bound by its FLOPs, and every CPU figure was measured so). On a GPU dots comes first and
    none never: without remat a layer keeps every elementwise result for the backward pass
    (at 405M, 23 GB besides the T x T scores of XLA's attention, against 5 GB with dots:
    experiments/hlo_side_by_side.py), which the GPU writes and reads back at its memory's
    speed, where dots recomputes them inside the backward's fused kernels; and dots needs less
    memory than none. One H200 measured it (../shared/gpu/README.md, experiments/RESULTS.md):
    the plain-JAX yardstick's bf16 + flash step at 405M took 0.0889 s with dots against
    0.0954 s without remat, and dpjax's without remat (what auto chose then) 0.0943 s."""
    return ("dots", "full") if platform in ("gpu", "cuda") else REMATS


def cudnn_refusal(dtype: str, head_dim: int | None, platform: str, packed: bool = False,
                  softcap: float = 0.0) -> str | None:
    """Why cuDNN's flash attention cannot run here (None: it can): a GPU, bf16 / fp16
    compute, a head width that is a multiple of 8 and at most 256, rows not packed, scores
    not soft-capped (`softcap`: Gemma 2's; the fused kernel has no tanh between its matmuls)."""
    if softcap:
        return f"cuDNN flash attention cannot soft-cap the attention scores (this model caps them at {softcap:g})"
    if platform not in ("gpu", "cuda"):
        return f"cuDNN attention needs an NVIDIA GPU (this run is on {platform})"
    if dtype not in ("bfloat16", "float16", "fp8"):  # fp8 leaves attention in bfloat16
        return f"cuDNN flash attention computes in bfloat16 or float16 (--dtype is {dtype})"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"cuDNN flash attention needs a head width that is a multiple of 8 and at most 256 (it is {head_dim})"
    if packed:  # dpjax.compute.attention: what JAX's public API gives cuDNN for a segment mask
        return ("packed rows (--pack) need a document mask, which jax.nn.dot_product_attention hands cuDNN only "
                "as a dense T x T bias (its packed-segment form is not public API) and dpjax has not run on a GPU")
    return None


def fp8_refusal(platform: str, devices=None) -> str | None:
    """Why fp8 matmuls cannot run here (None: they can): an NVIDIA GPU needs fp8 tensor
    cores (compute capability 8.9: Ada, Hopper and later); CPU emulates them (for tests)."""
    if platform == "tpu":
        return "XLA has no fp8 matmuls on TPU that dpjax has checked"
    if platform in ("gpu", "cuda"):
        device = (devices or jax.devices())[0]
        cc = getattr(device, "compute_capability", None)
        if cc is not None and tuple(int(v) for v in str(cc).split(".")[:2]) < (8, 9):
            return f"{device.device_kind} (compute capability {cc}) has no fp8 tensor cores (8.9 and later have)"
    elif platform == "rocm":
        return "dpjax's fp8 is written for NVIDIA's float8_e4m3fn / e5m2, not AMD's fnuz formats"
    return None


def resolve(dtype: str = "auto", param_dtype: str = "float32", remat: str = "none", attention: str = "auto",
            *, platform: str | None = None, head_dim: int | None = None, scan: bool = True,
            context_attention: str = "ring", expert_alltoall: str = "pairwise",
            packed: bool = False, softcap: float = 0.0) -> tuple[Policy, list]:
    """(the policy, notes): `auto` resolved for `platform` (default: JAX's backend);
    dtype auto: bfloat16 on GPU / TPU, float32 on CPU; attention auto: cudnn where it
    can run, else xla, with a note saying why not on a GPU. remat `auto` is the
    planner's (`dpjax.plan`): resolved here as none. Raises ValueError (one line) for
    an attention that cannot run here."""
    platform = platform or jax.default_backend()
    if dtype == "auto":
        dtype = "bfloat16" if accelerated(platform) else "float32"
    notes = []
    if dtype == "fp8":
        why = fp8_refusal(platform)
        if why is not None:
            raise ValueError(f"--dtype fp8: {why}; use --dtype bfloat16")
        if not accelerated(platform):
            notes.append("dtype fp8: XLA:CPU emulates the float8 dots (a GPU's arithmetic, not its speed)")
    if attention == "auto":
        why = cudnn_refusal(dtype, head_dim, platform, packed, softcap)
        attention = "cudnn" if why is None else "xla"
        if why is not None and platform in ("gpu", "cuda"):
            notes.append(f"attention: XLA's kernel, not cuDNN flash: {why}")
    elif attention == "cudnn":
        why = cudnn_refusal(dtype, head_dim, platform, packed, softcap)
        if why is not None:
            raise ValueError(f"--attention cudnn: {why}; use --attention xla")
    return Policy(dtype, param_dtype, "none" if remat == "auto" else remat, attention, scan, context_attention,
                  expert_alltoall), notes
