"""--remat auto fits within the memory JAX really gets (dpjax.plan.usable): on a GPU the
allocator's fraction of the device (XLA_PYTHON_CLIENT_MEM_FRACTION / XLA_CLIENT_MEM_FRACTION,
0.75 by default; all of it with XLA_PYTHON_CLIENT_ALLOCATOR=platform), planned from here
with --dry-run --device-memory; the plan says the fraction and the usable bytes. The
reference: each remat's own estimate (resolve with that remat), set against fraction x X."""

import pytest

from dpjax.plan import UsageError, resolve
from dpjax.plan.usable import gpu_fraction
from dpjax.settings import Settings

ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
BASE = dict(mesh="1x1", data="synthetic", seq_len=256, batch_size=8, dry_run=True,
            model_options=dict(d_model=256, n_layers=4, n_heads=4, d_ff=1024))


@pytest.fixture
def env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_fraction_is_read_as_jax_reads_it(env):
    assert gpu_fraction() == (0.75, "JAX's default, XLA_PYTHON_CLIENT_MEM_FRACTION unset")
    env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    assert gpu_fraction()[0] == 0.5
    env.setenv("XLA_CLIENT_MEM_FRACTION", ".9")
    with pytest.raises(UsageError, match="both set"):  # jaxlib refuses both
        gpu_fraction()
    env.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert gpu_fraction() == (0.9, "XLA_CLIENT_MEM_FRACTION=.9")
    env.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert gpu_fraction()[0] == 1.0
    env.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
    for bad in ("lots", "0", "1.5"):
        env.setenv("XLA_CLIENT_MEM_FRACTION", bad)
        with pytest.raises(UsageError, match="expected a fraction"):
            gpu_fraction()


@pytest.fixture(scope="module")
def need(mesh_of):
    """Each remat's bytes per device on a GPU (planned from here), from its own plan."""
    mesh = mesh_of("1x1", 1)
    out = {}
    for remat in ("none", "dots", "full"):
        plan = resolve(Settings(**BASE, remat=remat, device_memory="1TiB"), mesh=mesh)
        assert plan.policy.dtype == "bfloat16"  # planned for a GPU
        out[remat] = plan.memory["total"]
    assert out["none"] > out["dots"] > out["full"]
    return out


def test_remat_auto_prefers_dots_on_a_gpu(env, mesh_of, need):
    """On a GPU auto takes dots where none fits too (`dpjax.compute.policy.remat_candidates`:
    on one H200 the yardstick's step was 7% faster with dots than without remat); on CPU
    the least recomputation, none (tests/test_memory.py)."""
    plan = resolve(Settings(**BASE, device_memory="1TiB"), mesh=mesh_of("1x1", 1))
    assert plan.memory["total"] == need["dots"] < need["none"] <= plan.memory["device"]
    assert plan.policy.remat == "dots"


def test_remat_auto_fits_the_fraction_jax_gets(env, mesh_of, need):
    mesh = mesh_of("1x1", 1)
    X = int(need["full"] / 0.75) + 2  # the whole device would hold remat dots; 0.75 of it only full (the sizes say)
    assert need["full"] <= 0.75 * X < need["dots"] <= X
    plan = resolve(Settings(**BASE, device_memory=f"{X}B"), mesh=mesh)
    assert plan.policy.remat == "full" and plan.memory["device"] == int(0.75 * X)
    assert (plan.memory["device_total"], plan.memory["fraction"]) == (X, 0.75)
    env.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")  # no pool: the whole device
    plan = resolve(Settings(**BASE, device_memory=f"{X}B"), mesh=mesh)
    assert plan.policy.remat == "dots" and plan.memory["device"] == X
    env.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
    fraction = need["full"] / X * 1.001  # only full fits
    env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{fraction:.6f}")
    plan = resolve(Settings(**BASE, device_memory=f"{X}B"), mesh=mesh)
    assert plan.policy.remat == "full" and plan.memory["device"] == int(float(f"{fraction:.6f}") * X)
    # without --dry-run the planned device is this CPU: --device-memory is all of it (no allocator pool)
    plan = resolve(Settings(**{**BASE, "dry_run": False}, device_memory="1GiB"), mesh=mesh)
    assert plan.memory["device"] == 2**30 and plan.memory["fraction"] == 1.0


def test_dry_run_says_the_fraction_and_the_usable_bytes(env, capsys, need):
    from dpjax.train import main

    args = ["--dry-run", "--mesh", "1x1", "--data", "synthetic", "--d-model", "256", "--n-layers", "4",
            "--n-heads", "4", "--d-ff", "1024", "--seq-len", "256", "--batch-size", "8"]
    env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    assert main([*args, "--device-memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert ("a device has 4.00 GiB usable of 8.00 GiB (0.5 of --device-memory: XLA_PYTHON_CLIENT_MEM_FRACTION=.5)"
            in out), out
    X = need["full"] + 1  # fits the whole device, not half of it: refused, saying why
    assert main([*args, "--device-memory", f"{X}B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(0.5 of --device-memory: XLA_PYTHON_CLIENT_MEM_FRACTION=.5)" in err[0], err
    env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "most")
    assert main([*args, "--device-memory", "8GiB"]) == 2
    assert capsys.readouterr().err.strip() == ("error: XLA_PYTHON_CLIENT_MEM_FRACTION='most': expected a fraction "
                                               "of the device's memory in (0, 1], e.g. .95")
