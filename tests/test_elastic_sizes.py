"""Same data, same batch, on any size (issue 19): a plan made again for fewer devices keeps
the user's global batch in more micro-batches per device (gradient accumulation) and
steps as the no-failure run does, within float32 round-off; a size that cannot hold the
run is skipped with its reason, and when none can, one line. The restarted plan's exchange
is the new mesh's: a compressed exchange between sites cuts each tensor into as many
shards as a site has devices, so a site that lost devices cuts into fewer, loss for loss
as a plan made fresh for that count."""

import jax
import numpy as np
import pytest

from dpjax import step as S
from dpjax.agent import sizes
from dpjax.data import make_streams
from dpjax.mesh import dp_size
from dpjax.plan import UsageError, fit_devices, resolve
from dpjax.settings import Settings

TINY = dict(data="synthetic", model="gpt", model_options={"d_model": 32, "n_layers": 1, "n_heads": 2}, seq_len=16,
            optimizer="sgd", lr=0.5)


def cut(plan):
    return plan.global_batch * plan.passes, plan.passes, plan.global_batch // dp_size(plan.mesh)


def test_fewer_devices_keep_the_global_batch_in_more_micro_batches():
    eight = resolve(Settings(mesh="4x2", batch_size=16, **TINY), jax.devices())
    four = eight.for_devices(jax.devices()[:4])
    two = four.for_devices(jax.devices()[:2])
    assert [dict(p.mesh.shape) for p in (eight, four, two)] == [
        {"data": 4, "model": 2}, {"data": 2, "model": 2}, {"data": 1, "model": 2}]
    # (global batch, micro-batches, sequences per device and pass): the batch and each device's share stay
    assert [cut(p) for p in (eight, four, two)] == [(16, 1, 4), (16, 2, 4), (16, 4, 4)]
    assert cut(two.for_devices(jax.devices())) == (16, 1, 4)  # back at full size: the user's own cut
    assert fit_devices(eight.settings, 8) is eight.settings  # the size the user named is never changed


def test_each_devices_share_of_a_pass_is_what_the_users_cut_gives():
    """2 ranks x 2 passes of 8: 4 sequences per device and pass, on 1 device as on 4."""
    s = Settings(mesh="2x1", batch_size=8, backward_passes=2, **TINY)
    assert [(t.batch_size, t.backward_passes) for t in (fit_devices(s, 1), fit_devices(s, 4))] == [(4, 4), (16, 1)]


def _losses(plan, steps=3):
    """The losses and final parameters of `steps` steps from the same start on the same data."""
    train, _ = make_streams("synthetic", plan.settings.seq_len, 0)
    step = S.for_plan(plan)
    params, opt_state = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    losses, cursor = [], 0
    for _ in range(steps):
        batch = S.put_batch(train, cursor, plan.global_batch, plan.mesh, passes=plan.passes)
        cursor += plan.global_batch * plan.passes
        params, opt_state, loss = step.train(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), jax.tree.map(np.asarray, params)


def test_the_steps_on_fewer_devices_are_the_no_failure_steps_up_to_round_off():
    eight = resolve(Settings(mesh="4x2", batch_size=8, **TINY), jax.devices())
    want, want_params = _losses(eight)  # the no-failure run: 4 data ranks, one pass
    for devices in (4, 2):
        got, params = _losses(eight.for_devices(jax.devices()[:devices]))
        # the same samples in the same mean; only the sum's order (2 passes of 2 ranks, 4 of 1) differs
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_size_that_cannot_hold_the_run_is_skipped_with_its_reason():
    # three hosts of two processes lost one: 4 devices cannot split a batch of 6; 2 can, in 3 passes
    s = Settings(mesh="6x1", batch_size=6)
    k, skipped = sizes.choose(s, hosts=2, nproc=2, devices_per_process=1)
    assert k == 1 and len(skipped) == 1
    assert skipped[0].startswith("4 processes (4 devices): the global batch of 6 sequences (--batch-size 6 x "
                                 "--backward-passes 1) cannot be cut into equal micro-batches over the 4 data-parallel")
    assert (fit_devices(s, 2).batch_size, fit_devices(s, 2).backward_passes) == (2, 3)
    # a model axis of 2 does not divide 3 devices: the next size down, 2 processes, holds it
    k, skipped = sizes.choose(Settings(mesh="3x2", batch_size=6), hosts=1, nproc=3, devices_per_process=1)
    assert k == 2 and skipped == ["3 processes (3 devices): --mesh 3x2 cannot be resized to 3 devices: its non-data "
                                  "axes need a multiple of 2"]


def test_when_no_size_holds_the_run_it_is_one_line():
    with pytest.raises(sizes.NoSize) as e:
        sizes.choose(Settings(mesh="1x4", batch_size=4), hosts=1, nproc=2, devices_per_process=1)
    line = str(e.value)
    assert "\n" not in line and line.startswith("no size the agents can form holds the run: 2 processes (2 devices)")
    assert "; 1 processes (1 devices): --mesh 1x4 cannot be resized to 1 devices" in line


def test_the_size_asked_for_and_other_commands_run_as_given():
    s = sizes.train_settings(["python", "-m", "dpjax.train", "--mesh", "4x2", "--batch-size", "6"])
    assert (s.mesh, s.batch_size) == ("4x2", 6)
    # 8 devices, the user's own size, runs as given even though 6 does not split over 4 ranks: its
    # processes say so (one line, exit 2), rather than the agent running it smaller
    assert sizes.choose(s, hosts=2, nproc=2, devices_per_process=2) == (2, [])
    assert sizes.train_settings(["python", "my_script.py", "--mesh", "4x2"]) is None
    assert sizes.choose(None, hosts=1, nproc=2, devices_per_process=2) == (2, [])
    with pytest.raises(UsageError, match="over the 3 data-parallel ranks of mesh data=3,model=2"):
        fit_devices(Settings(mesh="4x2", batch_size=8), 6)


def test_a_restart_on_fewer_devices_cuts_the_per_shard_exchange_for_its_sites():
    # two sites of two devices (data outermost: a restart on 4 devices keeps one data rank a site)
    sites = Settings(mesh="data=2,node=2,model=2", batch_size=8, compression="int8", compress_axes="node", **TINY)
    eight = resolve(sites, jax.devices())
    assert eight.exchange.shards is not None and eight.exchange.shards.size == 2  # 2 devices a site
    four = eight.for_devices(jax.devices()[:4])
    fresh = resolve(fit_devices(sites, 4), jax.devices()[:4])
    assert dict(four.mesh.shape) == {"data": 1, "node": 2, "model": 2}
    assert four.exchange == fresh.exchange  # one device a site: nothing to cut (no per-shard form)
    np.testing.assert_array_equal(_losses(four)[0], _losses(fresh)[0])
