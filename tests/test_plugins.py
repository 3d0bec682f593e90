"""A new algorithm, compression method, update rule, pipeline schedule or model is one
file's worth of code and one registration: each toy below is written here, registered
for the test's duration, and then found by the CLI (its flags and choices), the plan
(`plan.resolve`) and the cost model (collectives' schedules, the compression's bytes,
the bubble formula, a model's FLOPs and memory) with no other edit. Unregistered, each is
gone again. (The generic tests read the same registries: tests/test_registry.py runs a
toy algorithm through training, tests/test_compression.py a toy method,
tests/test_updates.py a toy rule, tests/test_pipeline.py a toy schedule.)
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dpjax.errors import UserError
from dpjax import collectives, compression, pipeline
from dpjax.updates.sync import sync
from dpjax.collectives import cost, ring
from dpjax.compression.accounting import compressed_bytes
from dpjax.models import MLP, MLPConfig, registry as models
from dpjax.pipeline import gpipe
from dpjax.plan import resolve
from dpjax.compute.tensor_parallel import DENSE
from dpjax.train.cli import ArgumentError, build_parser, parse_args
from dpjax.updates import registry as rules

# --- the five toys: each is what its own file would hold, its last line the registration

TOY_ALGORITHM = collectives.registry.Algorithm(  # the ring under another name
    "toy-ring", ring.cost, allreduce=ring.allreduce, reduce_scatter=ring.reduce_scatter, all_gather=ring.all_gather)

TOY_METHOD = compression.Method(  # bfloat16 on the wire, another name
    "toy-bf16", encode=lambda x: x.astype(jnp.bfloat16), decode=lambda w, like: w.astype(like.dtype),
    compresses=lambda d: jnp.issubdtype(d, jnp.floating), wire_dtype=jnp.dtype(jnp.bfloat16), linear=True)

TOY_RULE = rules.Kind("toy-sync", "a toy: sync, named", is_sync=lambda spec: True, number="the toy number N",
                      build=lambda spec, inner, axis_name, *, seed, **allreduce:
                      sync(inner, axis_name, **allreduce)._replace(name=f"toy-sync:{spec.n}"))

TOY_SCHEDULE = pipeline.Schedule("toy-gpipe", gpipe.timetable, bubble=lambda S, M, V: (S - 1) / (M + S - 1))


@dataclasses.dataclass(frozen=True)
class ToyConfig(MLPConfig):
    softness: float = 1.0  # a float option: the command line must parse it as one


class Toy(MLP):
    """The byte MLP with its logits divided by a softness."""

    def apply(self, params, tokens_BxT, par=DENSE):
        return super().apply(params, tokens_BxT, par) / self.config.softness


TOY_MODEL = models.Entry("toy-mlp", Toy, ToyConfig)


@contextlib.contextmanager
def toys():
    with collectives.registry.registered(TOY_ALGORITHM), compression.registered(TOY_METHOD), \
            rules.registered(TOY_RULE), pipeline.SCHEDULES.registered(TOY_SCHEDULE), models.registered(TOY_MODEL):
        yield


BASE = ["--model", "gpt", "--seq-len", "8", "--d-model", "16", "--n-heads", "2", "--d-ff", "16", "--batch-size", "16"]


def _plan(*flags):
    return resolve(parse_args(BASE + list(flags)), jax.devices()[:8])


def test_the_cli_offers_every_toy():
    with toys():
        text = build_parser().format_help()
        for name in ("toy-ring", "toy-bf16", "toy-gpipe", "toy-mlp", "--softness"):
            assert name in text, name
    text = build_parser().format_help()
    for name in ("toy-ring", "toy-bf16", "toy-gpipe", "toy-mlp", "--softness"):
        assert name not in text, name


def test_a_toy_algorithm_is_planned_and_costed():
    with toys():
        plan = _plan("--allreduce", "toy-ring", "--mesh", "8x1")
        assert plan.exchange.algorithm == "toy-ring"
        assert cost.schedule("toy-ring", 8, 1000) == cost.schedule("ring", 8, 1000)
        assert compressed_bytes(None, [(10, 10)], 8, algorithm="toy-ring") == compressed_bytes(None, [(10, 10)], 8)


def test_a_toy_method_is_planned_and_costed():
    with toys():
        plan = _plan("--compression", "toy-bf16", "--mesh", "8x1")
        assert plan.exchange.compression == "toy-bf16"
        assert compressed_bytes("toy-bf16", [(10, 10)], 8) == compressed_bytes("bf16", [(10, 10)], 8)


def test_a_toy_rule_is_planned():
    with toys():
        plan = _plan("--update", "toy-sync:3", "--mesh", "8x1")
        assert plan.rule.name == "toy-sync:3" and plan.period == 1


def test_a_toy_schedule_is_planned_and_costed():
    with toys():
        plan = _plan("--schedule", "toy-gpipe", "--mesh", "stage=2,data=4", "--n-layers", "2")
        assert plan.layout.pipeline.schedule == "toy-gpipe"
        assert pipeline.bubble_formula("toy-gpipe", 2, 4) == pipeline.bubble_formula("gpipe", 2, 4)
        assert TOY_SCHEDULE.stash(2, 4, 1) == pipeline.SCHEDULES["gpipe"].stash(2, 4, 1)


def test_a_toy_model_is_parsed_with_its_own_types_planned_and_costed():
    with toys():
        s = parse_args(["--model", "toy-mlp", "--seq-len", "8", "--batch-size", "16", "--softness", "2.5"])
        assert s.model_options == {"softness": 2.5} and isinstance(s.model_options["softness"], float)
        plan = resolve(s, jax.devices()[:8])
        assert isinstance(plan.model, Toy) and plan.model.config.softness == 2.5
        assert plan.model.flops_per_token() == MLP(MLPConfig(seq_len=8)).flops_per_token()
        params = plan.model.init(jax.random.key(0))
        batch = jnp.zeros((2, 9), jnp.int32)
        hot = Toy(ToyConfig(seq_len=8, softness=2.5)).loss(params, batch)
        assert hot != MLP(MLPConfig(seq_len=8)).loss(params, batch)  # the softness is used
    with pytest.raises(ArgumentError, match="unknown flag --softness"):  # gone with its model
        parse_args(["--model", "toy-mlp", "--softness", "2.5"])
    assert "toy-mlp" not in models.MODELS



@dataclasses.dataclass(frozen=True)
class ClashConfig(MLPConfig):
    temperature: float = 1.0  # also the run's --temperature (GRPO's sampling)


def test_a_model_option_named_like_a_run_setting_is_one_line():
    with models.registered(models.Entry("toy-clash", Toy, ClashConfig)):
        with pytest.raises(UserError, match="toy-clash: its config field 'temperature' has the name of the run's "
                                            "setting --temperature; rename the field"):
            build_parser()
    build_parser()  # gone with its model
