"""`--allreduce auto` / `--fusion-mb auto` inside a run (the search is `dpjax.train.autotune`):
what to search, and what to do with its choice."""

from __future__ import annotations

import jax

from dpjax.collectives import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
from dpjax.mesh import data_axes
from dpjax.plan import UsageError
from dpjax.train import autotune


def plan_search(trainer):
    """The search the plan's autotune knobs ask for (None if none, or if the checkpoint
    resumed recorded a choice for them: that choice is kept)."""
    plan, cfg = trainer.plan, trainer.cfg
    knobs, kept = plan.autotune, trainer.resumed.get("autotune")
    if not knobs:
        return None
    if kept and set(knobs) <= set(kept["tuned"]):
        trainer.use(autotune.Setting(kept["allreduce"], kept["fusion_mb"]))
        trainer.record["autotune"] = kept
        trainer.say(f"autotune: keeping the checkpoint's choice --allreduce {trainer.setting.algorithm} "
                    f"--fusion-mb {trainer.setting.fusion_mb:g}")
        return None
    algorithms = None
    if "allreduce" in knobs:
        algorithms = [a for a in (REDUCE_SCATTER_ALGORITHMS if plan.layout.fsdp else ALGORITHMS)
                      if a != "hierarchical" or len(data_axes(plan.mesh)) >= 2]
    caps = None
    if "fusion_mb" in knobs:  # on the shapes each device's gradients have (its shards)
        local = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(sh.shard_shape(x.shape), x.dtype),
                             jax.eval_shape(plan.model.init, jax.random.key(0)), plan.layout.shardings())
        caps = autotune.fusion_caps(local, (trainer.setting.fusion_mb, *autotune.CAPS))
    tuner = autotune.Tuner(trainer.setting, algorithms, caps and (lambda alg: caps), per_round=cfg.autotune_samples)
    if trainer.start + tuner.budget > cfg.steps:
        raise UsageError(f"the autotune needs up to {tuner.budget} steps from step {trainer.start}, more than --steps "
                         f"{cfg.steps}; ask for more steps or fewer --autotune-samples")
    return tuner


def finish(trainer, tuner, write, step: int) -> None:
    """`tuner`'s search is over: its choice runs from now on, in the metrics (the row of
    step `step`, numbered from 1 as every row is) and the checkpoint."""
    rec = tuner.record()
    trainer.use(tuner.choice)
    trainer.record["autotune"] = rec
    write({"step": step, "autotune": rec})
    how = "; ".join(f"{st['knob']}: {st['winner']} won" + (
        "" if st["winner"] == st["from"] else f", {st['winner_vs_from']:.3f}x {st['from']}'s speed"
        + ("" if st["choice"] == st["winner"] else f", under {rec['min_gain']}x: kept {st['from']}"))
        for st in rec["stages"])
    trainer.say(f"autotune: --allreduce {trainer.setting.algorithm} --fusion-mb {trainer.setting.fusion_mb:g}, "
                f"{rec['gain']:.3f}x the speed of {rec['start']} ({how}; {rec['steps']} steps)")
