"""LoRA: a frozen base model and trained low-rank adapters (Hu et al., "LoRA: Low-Rank
Adaptation of Large Language Models", 2021), with PEFT's names and conventions.

Each targeted linear layer W (in x out) gets A (in x r, drawn as PEFT draws it: Kaiming-
uniform, bound 1/sqrt(in)) and B (r x out, zeros), and computes with W + (alpha / r) A B.

The design, chosen to keep every layer's code and every layout unchanged:

- The parameters are the base model's tree with the adapters added inside its layer
  stack, `params["blocks"]["lora"]` = {"q_A_LsxDxR", "q_B_LsxRxHmxK", ...}: one more
  entry of each layer, stacked on L like the rest, so the stack runner
  (`dpjax.compute.stack`) slices and (under FSDP) gathers a layer's adapters together
  with its base weights, and `layer` adds A B to the gathered weights just before the
  base's own layer runs (merged on the fly, one layer at a time).
- The adapters' specs follow their base matrix's: A takes the base's input dimensions'
  split, B its output dimensions' (a column-parallel base's B is split by columns, a
  row-parallel base's A by rows). The factor that is replicated over `model` beside a
  split one goes through Megatron's f, whose backward sums its gradient over the ranks.
- `ADAPTERS` says which part of the tree is trained: the plan builds the update rule
  (optimizer state, clipping norm, exchange) over the adapters only, and the step
  builder (`dpjax.step.builder`) differentiates with respect to them only, the base
  passed beside them as a constant. So the base gets no gradient, no optimizer state and
  no exchange; its FSDP gather has no backward (no reduce-scatter). What the backward
  does compute is the cotangent of each merged layer weight (transient, one layer at a
  time, as the full fine-tune's), from which A's and B's gradients come.
- Dropout (PEFT's lora_dropout) needs the factored form: in a training step with
  dropout > 0 each targeted projection computes y = x W + (alpha / r) (dropout(x) A) B
  (`Terms`, put beside the layer's weights: each family's layer code adds it to each
  projection's own product, `dpjax.models.base.adapted`), the base path untouched, the
  masks the same on every mesh (`dpjax.compute.dropout`: a hash of the step, the
  layer's global index, the target and the element's global row, position and feature).
  The tensor-parallel rules are the merged path's: the same factor goes through f, and a
  row-parallel target's term joins its base's partial sum before g. Without a draw
  (evaluation, generation, merge, export) the layer is the merged one; dropout=0 never
  computes the factored form, so its program is the merged path's.

The families: a base whose blocks hold a target's leaf (the Llama's, Mistral's, Qwen2's and
Qwen3's, Gemma2's and Gemma3's: the same leaf names) can adapt it; a mixture's experts
(Mixtral's MLP) hold other leaves, so there only q, k, v, o are adapted and the rest
refused in one line (`Lora.check`). Qwen2's q/k/v biases stay frozen base weights, as PEFT
leaves them (bias="none").

PEFT's module names (`TARGETS`: q_proj .. down_proj, or q .. down, or all-linear) and its
adapter files are `dpjax.hf.adapter`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax.compute import context
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.errors import UserError
from dpjax.models.base import ADAPTED, Decoder

ADAPTERS = "lora"  # the key of the adapters inside the layer stack


@dataclass(frozen=True)
class Target:
    """One linear layer LoRA can adapt: PEFT's module name (`hub`, its short form `name`),
    the base leaf that holds it, how many of that leaf's per-layer dimensions are the
    input (the rest are the output) and, for K and V stacked in one leaf, which of the pair."""

    name: str
    hub: str
    group: str
    leaf: str
    n_in: int
    part: int | None
    a: str  # the adapter leaves' shape letters
    b: str


TARGETS = (
    Target("q", "self_attn.q_proj", "attn", "wq_LsxDxHmxK", 1, None, "LsxDxR", "LsxRxHmxK"),
    Target("k", "self_attn.k_proj", "attn", "wkv_LsxDx2xYmxK", 1, 0, "LsxDxR", "LsxRxYmxK"),
    Target("v", "self_attn.v_proj", "attn", "wkv_LsxDx2xYmxK", 1, 1, "LsxDxR", "LsxRxYmxK"),
    Target("o", "self_attn.o_proj", "attn", "wo_LsxHmxKxD", 2, None, "LsxHmxKxR", "LsxRxD"),
    Target("gate", "mlp.gate_proj", "mlp", "wgate_LsxDxFm", 1, None, "LsxDxR", "LsxRxFm"),
    Target("up", "mlp.up_proj", "mlp", "wup_LsxDxFm", 1, None, "LsxDxR", "LsxRxFm"),
    Target("down", "mlp.down_proj", "mlp", "wdown_LsxFmxD", 1, None, "LsxFmxR", "LsxRxD"),
)
BY_NAME = {**{t.name: t for t in TARGETS}, **{t.hub.split(".")[-1]: t for t in TARGETS}}


def a_key(t: Target) -> str:
    return f"{t.name}_A_{t.a}"


def b_key(t: Target) -> str:
    return f"{t.name}_B_{t.b}"


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple = ("q", "k", "v", "o", "gate", "up", "down")

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def parse(cls, text: str) -> "LoraConfig":
        """`r=16,alpha=32,dropout=0.0,targets=q,k,v,o` (the names after targets= run to
        the next key=); targets as PEFT's target_modules name them, or all-linear."""
        fields, key = {}, None
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if "=" in part:
                key, value = (s.strip() for s in part.split("=", 1))
                if key in fields or key not in ("r", "alpha", "dropout", "targets"):
                    raise UserError(f"--lora {text}: {key!r} is not a LoRA setting, or given twice (r=, alpha=, "
                                    "dropout=, targets=)")
                fields[key] = [value]
            elif key == "targets":
                fields[key].append(part)
            else:
                raise UserError(f"--lora {text}: {part!r} is not key=value")
        try:
            r = int(fields.pop("r", ["16"])[0])
            alpha = float(fields.pop("alpha", [str(2 * r)])[0])
            dropout = float(fields.pop("dropout", ["0"])[0])
        except ValueError as e:
            raise UserError(f"--lora {text}: {e}") from None
        names = fields.pop("targets", ["all-linear"])
        return cls(r, alpha, dropout, targets_of(names, f"--lora {text}")).checked(text)

    def checked(self, text: str) -> "LoraConfig":
        if self.r < 1 or self.alpha <= 0:
            raise UserError(f"--lora {text}: r must be at least 1 and alpha positive")
        if not 0 <= self.dropout < 1:
            raise UserError(f"--lora {text}: dropout must be at least 0 and below 1, got {self.dropout}")
        return self


def targets_of(names, what: str) -> tuple:
    """PEFT's target_modules (q_proj or q; all-linear) -> the short names, in TARGETS' order."""
    names = [n.split(".")[-1] for n in names]
    if "all-linear" in names:
        return tuple(t.name for t in TARGETS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        hub = ", ".join(t.hub.split(".")[-1] for t in TARGETS)
        raise UserError(f"{what}: targets {', '.join(unknown) or '(none)'} name no layer of the Llama; its linear "
                        f"layers are {', '.join(t.name for t in TARGETS)} (or {hub}, or all-linear)")
    return tuple(t.name for t in TARGETS if t.name in {BY_NAME[n].name for n in names})


class Lora(Decoder):
    """`base` (a Llama) with LoRA adapters on `config.targets`; the loss, the stack runner
    and every layout are the Decoder's, the layer the base's on merged weights."""

    def __init__(self, base, config: LoraConfig):
        super().__init__(base.config)
        self.base, self.lora = base, config
        self.name, self.SPECS, self.LAYERS, self.CONTEXT = base.name, base.SPECS, base.LAYERS, base.CONTEXT
        self.dropout_rate = config.dropout
        # the masks read each layer's global index (stack.run's index_L), as Gemma's layers do
        self.INDEXED_LAYERS = base.INDEXED_LAYERS or config.dropout > 0
        self.shapes = jax.eval_shape(base.init, jax.random.key(0))[self.LAYERS]  # traced once: a preset's is slow
        held = [t.name for t in TARGETS if base.LORA_LAYERS and t.leaf in self.shapes.get(t.group, {})]
        self.check(base, config, held)
        self.targets = tuple(t for t in TARGETS if t.name in config.targets)
        for t in self.targets:
            i, o = self.dims(t)
            if config.r > min(math.prod(i), math.prod(o)):
                raise UserError(f"--lora r={config.r} is larger than layer {t.name} ({math.prod(i)} x "
                                f"{math.prod(o)}): a rank above the layer's smaller side adds nothing; use r <= "
                                f"{min(math.prod(i), math.prod(o))}")

    @staticmethod
    def check(base, config: LoraConfig, held: list) -> None:
        """The targets are linear layers `base`'s blocks hold (by its parameters' leaves: a
        mixture's experts hold others) under PEFT's names (`LORA_LAYERS`: not the GPT's), and
        dropout's layers can carry what `base`'s report."""
        if not held:
            raise UserError(f"--lora adapts the linear layers {', '.join(t.name for t in TARGETS)} of the Llama-like "
                            f"families (Llama, Mistral, Qwen2/3, Gemma2/3, Mixtral's attention); --model {base.name} "
                            "has none of them")
        missing = [n for n in config.targets if n not in held]
        if missing:
            raise UserError(f"--lora targets {', '.join(missing)}: --model {base.name}'s blocks hold no such linear "
                            f"layer (a mixture's experts get no adapters here); LoRA adapts its {', '.join(held)}: "
                            f"give targets={','.join(held)}")
        if config.dropout and base.has_stats:
            raise UserError(f"--lora dropout={config.dropout} on --model {base.name} is not built (its layers report "
                            "router statistics, which the layers dropout indexes do not carry yet); use dropout=0")

    @property
    def stat_names(self) -> tuple:
        return self.base.stat_names

    @property
    def experts(self) -> int:
        return self.base.experts

    @property
    def attention_softcap(self) -> float:
        return self.base.attention_softcap

    @property
    def kv_heads(self) -> int:
        return self.base.kv_heads

    @property
    def head_dim(self) -> int:  # Gemma's, Qwen3's: their own width, not d_model / n_heads
        return self.base.head_dim

    @property
    def cache_window(self) -> int | None:  # Mistral's window: the KV cache a ring of W positions
        return self.base.cache_window

    def add_stats_loss(self, loss, stat_means):  # a mixture's balance loss (Mixtral's router, frozen)
        return self.base.add_stats_loss(loss, stat_means)

    def dims(self, t: Target) -> tuple[tuple, tuple]:
        """(input dims, output dims) of target `t`'s matrix, one layer's, whole."""
        shape = self.shapes[t.group][t.leaf].shape[1:]
        if t.part is not None:
            shape = shape[:1] + shape[2:]
        return shape[:t.n_in], shape[t.n_in:]

    def describe(self) -> dict:
        # as JSON writes it (a list): the record a resume compares is read back from JSON
        return {**self.base.describe(), "lora": {**dataclasses.asdict(self.lora), "targets": list(self.lora.targets)}}

    def init(self, key):
        params = self.base.init(key)
        return {**params, self.LAYERS: {**params[self.LAYERS], ADAPTERS: self.init_adapters(key)}}

    def init_adapters(self, key):
        """A drawn as PEFT's kaiming_uniform_(a=sqrt(5)) draws it (bound 1/sqrt(fan_in)), B zeros."""
        L, r, out = self.config.n_layers, self.lora.r, {}
        key = jax.random.fold_in(key, 0x10A)
        for j, t in enumerate(self.targets):
            i, o = self.dims(t)
            bound = 1 / math.sqrt(math.prod(i))
            out[a_key(t)] = jax.random.uniform(jax.random.fold_in(key, j), (L, *i, r), minval=-bound, maxval=bound)
            out[b_key(t)] = jnp.zeros((L, r, *o))
        return out

    def sharding_table(self, mesh) -> dict:
        """The base's table and each adapter's spec, from its base matrix's (module docstring)."""
        table = self.base.sharding_table(mesh)
        out = dict(table)
        for t in self.targets:
            spec = table[t.leaf]
            entries = list(spec) + [None] * (self.shapes[t.group][t.leaf].ndim - len(spec))
            stage, rest = entries[0], entries[1:]
            if t.part is not None:
                rest = rest[:1] + rest[2:]
            out[a_key(t)] = P(stage, *rest[:t.n_in], None)
            out[b_key(t)] = P(stage, None, *rest[t.n_in:])
        return out

    def merged_layer(self, blk, par: Parallel = DENSE):
        """One layer's base weights with (alpha / r) A B added (its leaves without L, gathered)."""
        adapters = blk[ADAPTERS]
        blk = {k: (dict(v) if isinstance(v, dict) else v) for k, v in blk.items() if k != ADAPTERS}
        for t in self.targets:
            a, b = adapters[a_key(t)], adapters[b_key(t)]
            i, o = self.dims(t)
            a, b = self.factors(t, adapters, par)
            delta = self.lora.scale * jnp.tensordot(a, b, axes=1)
            w = blk[t.group][t.leaf]
            blk[t.group][t.leaf] = w + delta.astype(w.dtype) if t.part is None else w.at[:, t.part].add(
                delta.astype(w.dtype))
        return blk

    def factors(self, t: Target, adapters, par: Parallel = DENSE):
        """Target `t`'s A and B, the factor replicated over `model` beside a split one through
        f: its gradient is the sum of the ranks' (module docstring)."""
        a, b = adapters[a_key(t)], adapters[b_key(t)]
        i, o = self.dims(t)
        a_split, b_split = a.shape[:-1] != i, b.shape[1:] != o  # split over `model` (after FSDP's gather)
        if b_split and not a_split:  # A replicated, B split: A's gradient is the sum of the ranks'
            a = par.f(a)
        elif a_split and not b_split:
            b = par.f(b)
        return a, b

    def term(self, name: str, adapters, x, par: Parallel):
        """(alpha / r) (dropout(x) A) B of target `name` on its input x (this device's block:
        Bd x T x the input dims, split over `model` where A is), or None when not targeted."""
        t = BY_NAME[name]
        if t not in self.targets:
            return None
        a, b = adapters[t.name]
        i = self.dims(t)[0]
        n_local, n_in = math.prod(a.shape[:-1]), math.prod(i)
        features = jnp.arange(n_local) + (par.rank() * n_local if n_local != n_in else 0)  # global indices
        assert par.dropout is not None, "the factored path runs in a training step with dropout (Lora.layer)"
        x = par.dropout.at(TARGETS.index(t)).drop(x, context.positions(x.shape[1], par), features, n_in)
        xa = jnp.tensordot(x, a, axes=t.n_in)
        return self.lora.scale * jnp.tensordot(xa, b, axes=1)

    def merge(self, params):
        """The base's parameters with every layer's adapters added (export --merge, generate)."""
        stack = params[self.LAYERS]
        merged = jax.vmap(self.merged_layer)(stack)
        return {**{k: v for k, v in params.items() if k != self.LAYERS}, self.LAYERS: merged}

    # the Decoder's pieces: the base's, on merged weights
    def embed(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        return self.base.embed(params, tokens_BdxT, par, segments)  # segments: the KV cache's positions, packing's

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE, *args, index=None, **kwargs):
        if self.base.INDEXED_LAYERS:  # Gemma's local and global layers read it too
            kwargs["index"] = index
        if par.dropout is None:  # evaluation, generation: merged (as with dropout=0)
            return self.base.layer(self.merged_layer(blk, par), x_BdxTxD, par, *args, **kwargs)
        assert index is not None, "LoRA's dropout reads each layer's index (stack.run's index_L)"
        par = dataclasses.replace(par, dropout=par.dropout.at(index))
        terms = Terms(self, {t.name: self.factors(t, blk[ADAPTERS], par) for t in self.targets}, par)
        blk = {k: v for k, v in blk.items() if k != ADAPTERS}
        blk["attn"], blk["mlp"] = {**blk["attn"], ADAPTED: terms}, {**blk["mlp"], ADAPTED: terms}
        return self.base.layer(blk, x_BdxTxD, par, *args, **kwargs)

    def layer_stats(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """A mixture's block (Mixtral's: attention targets only) on merged weights, with its router's statistics."""
        assert par.dropout is None, "refused in Lora.check: dropout on a base with statistics"
        return self.base.layer_stats(self.merged_layer(blk, par), x_BdxTxD, par, segments)

    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        return self.base.head(params, x_BdxTxD, par)

    def flops_per_token(self) -> float:
        return self.base.flops_per_token()

    def model_splits(self) -> tuple[int, ...]:
        return self.base.model_splits()

    def mlp_values(self, tokens: int, split: int) -> dict:
        return self.base.mlp_values(tokens, split)


@dataclass(frozen=True)
class Terms:
    """A layer's LoRA terms in a training step with dropout: the base's layer code adds
    `terms(name, x, y)` to each projection's own product y = x W (`dpjax.models.base.adapted`),
    before whatever its family adds (Qwen2's biases, the q/k norms), on this rank's block."""

    lora: Lora
    factors: dict  # target name -> (A, B), the replicated one through f (`Lora.factors`)
    par: Parallel  # the layer's: its dropout drawn at the layer's index

    def __call__(self, name: str, x, y):
        if name != "kv":
            term = self.lora.term(name, self.factors, x, self.par)
            return y if term is None else y + term.astype(y.dtype)
        for j, part in enumerate(("k", "v")):  # K and V stacked in one leaf: Bd x 2 x T x Y' x K
            term = self.lora.term(part, self.factors, x, self.par)
            y = y if term is None else y.at[:, j].add(term.astype(y.dtype))
        return y


@dataclass(frozen=True)
class Split:
    """The trained part of a LoRA model's trees (the adapters) and the frozen rest: any tree
    shaped like its parameters (values, specs, shapes) splits and joins the same way."""

    layers: str

    def trained(self, tree):
        return tree[self.layers][ADAPTERS]

    def frozen(self, tree):
        return {**tree, self.layers: {k: v for k, v in tree[self.layers].items() if k != ADAPTERS}}

    def join(self, trained, frozen):
        return {**frozen, self.layers: {**frozen[self.layers], ADAPTERS: trained}}


def wrap(model, text: str | None):
    """`model` with the adapters `--lora text` asks for (itself when none, or already adapted)."""
    if not text or isinstance(model, Lora):
        return model
    return Lora(model, LoraConfig.parse(text))
