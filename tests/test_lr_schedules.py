"""--lr-schedule constant|cosine|linear|wsd: the rate at chosen steps equals the textbook
formula written here in numpy, through the plan a command line resolves to; today's
default (warm-up, then constant) is optax's own schedule, unchanged; bad combinations are
one line."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from dpjax.optim import LR_SCHEDULES
from dpjax.plan import UsageError, check, resolve
from dpjax.settings import Settings

STEPS, WARMUP, PEAK, MIN = 100, 10, 2e-3, 1e-4
AT = np.array([0, 3, 9, 10, 11, 30, 55, 79, 80, 81, 90, 99, 100, 120])


def reference(name: str, t: np.ndarray, decay_steps: int | None = None, start: float = 0.0) -> np.ndarray:
    """The schedules as the papers write them (numpy, float64)."""
    warm = start + (PEAK - start) * t / WARMUP
    if name == "constant":
        after = np.full(t.shape, PEAK)
    elif name in ("cosine", "linear"):
        D = decay_steps or STEPS - WARMUP
        f = np.clip((t - WARMUP) / D, 0, 1)
        after = MIN + (PEAK - MIN) * (0.5 * (1 + np.cos(np.pi * f)) if name == "cosine" else 1 - f)
    else:  # wsd: stable at the peak, then 1 - sqrt over the last D steps (Hägele et al. 2024)
        D = decay_steps or STEPS // 5
        f = np.clip((t - (STEPS - D)) / D, 0, 1)
        after = MIN + (PEAK - MIN) * (1 - np.sqrt(f))
    return np.where(t < WARMUP, warm, after)


def rates(**flags) -> np.ndarray:
    s = Settings(model="mlp", mesh="8x1", steps=STEPS, warmup_steps=WARMUP, lr=PEAK, batch_size=32, **flags)
    plan = resolve(s)
    sched = plan.opt.schedule(s.batch_size)
    return np.array([float(sched(t)) for t in AT]), plan


def test_registry_is_what_the_cli_offers():
    from dpjax.train.cli import build_parser

    action = next(a for a in build_parser()._actions if "--lr-schedule" in a.option_strings)
    assert tuple(action.choices) == tuple(LR_SCHEDULES) == ("constant", "cosine", "linear", "wsd")


@pytest.mark.parametrize("name,decay", [("cosine", None), ("linear", None), ("wsd", None), ("cosine", 50),
                                        ("wsd", 30)])
def test_each_schedule_follows_its_formula(name, decay):
    got, _ = rates(lr_schedule=name, min_lr=MIN, decay_steps=decay)
    np.testing.assert_allclose(got, reference(name, AT, decay), rtol=1e-6, atol=1e-12)


def test_default_is_warmup_then_constant_as_before():
    got, plan = rates()
    assert plan.opt.lr_schedule == "constant" and plan.opt.decay_steps == 0
    np.testing.assert_allclose(got, reference("constant", AT), rtol=1e-6)
    want = optax.linear_schedule(0.0, PEAK, WARMUP)  # the schedule every earlier run trained with
    assert all(float(plan.opt.schedule(32)(t)) == float(want(t)) for t in AT)


def test_goyal_scaling_warms_up_from_the_unscaled_rate_and_decays_from_the_scaled_one():
    """--lr-scaling linear at batch 512: the peak is lr x 2, the warm-up starts at lr."""
    s = Settings(model="mlp", mesh="8x1", steps=STEPS, warmup_steps=WARMUP, lr=PEAK / 2, batch_size=512,
                 lr_scaling="linear", lr_schedule="cosine", min_lr=MIN)
    sched = resolve(s).opt.schedule(512)
    got = np.array([float(sched(t)) for t in AT])
    np.testing.assert_allclose(got, reference("cosine", AT, start=PEAK / 2), rtol=1e-6)


@pytest.mark.parametrize("flags,words", [
    (dict(lr_schedule="constant", min_lr=1e-5), "--min-lr shape a decay; --lr-schedule constant has none"),
    (dict(lr_schedule="wsd", warmup_steps=90, decay_steps=20), "do not fit in --steps 100"),
    (dict(lr_schedule="cosine", min_lr=1.0), "is above the peak rate 0.003"),
    (dict(lr_schedule="cosine", decay_steps=0), "--decay-steps must be at least 1"),
])
def test_bad_schedules_are_one_line(flags, words):
    with pytest.raises(UsageError, match=words) as e:
        check(Settings(model="mlp", steps=STEPS, **flags))
    assert "\n" not in str(e.value)


def test_a_checkpoint_from_before_the_schedules_resumes_with_the_default_and_not_another():
    """Records saved before --lr-schedule lack its keys: they ran warm-up then constant."""
    import dataclasses

    from dpjax.optim import OptimizerConfig
    from dpjax.recovery.checkpoint import CheckpointError, check_compatible

    old = {k: v for k, v in dataclasses.asdict(OptimizerConfig()).items()
           if k not in ("lr_schedule", "min_lr", "decay_start", "decay_steps")}
    check_compatible({"optimizer": old}, {"optimizer": dataclasses.asdict(OptimizerConfig())}, "ck/3")
    cosine = dataclasses.asdict(OptimizerConfig(lr_schedule="cosine", decay_start=0, decay_steps=100))
    with pytest.raises(CheckpointError, match="optimizer.lr_schedule: saved 'constant', now 'cosine'"):
        check_compatible({"optimizer": old}, {"optimizer": cosine}, "ck/3")
