"""dpjax.recovery.stage: a commit's state staged into host memory right after its step.
The staged copy holds the state as of that step, bit for bit, although the next step
donates the state's buffers and runs before the copy is read; it lives in the backend's
host memory kind; a commit made that way, with steps run between it and its writing,
restores bit-equal to the state at its step (numpy copies taken before, the reference)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.recovery.commit import Committer
from dpjax.recovery.file_format import decode, read
from dpjax.recovery.stage import HOST_KINDS, Stager, host_kind

SPECS = {"w": P("data", "model"), "b": P("model"), "count": P()}


@pytest.fixture(scope="module")
def mesh():
    return dpjax.make_mesh("4x2", jax.devices()[:8])


@pytest.fixture(scope="module")
def step():
    """A step that donates its state (as the training step does): every buffer is new."""
    return jax.jit(lambda t: {"w": t["w"] * 1.5 + 1.0, "b": t["b"] - 2, "count": t["count"] + 1}, donate_argnums=0)


def _state(mesh, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"w": rng.standard_normal((8, 6)).astype(np.float32),
              "b": rng.standard_normal((4,)).astype(jnp.bfloat16), "count": np.int32(7)}
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in arrays.items()}


def _numpy(tree):
    return {k: np.array(v) for k, v in tree.items()}  # copies: the reference, whatever happens to the arrays


def test_the_backend_has_a_host_memory_kind():
    assert host_kind(jax.devices()[0]) in HOST_KINDS  # CPU: pinned_host, as a GPU


def test_a_staged_copy_is_the_state_at_its_step_though_the_next_steps_donate_it(mesh, step):
    state = _state(mesh)
    want = _numpy(state)
    stager = Stager()
    staged = stager(state)  # dispatched, not waited for
    state = step(state)  # donates the buffers the copy reads
    state = step(state)
    for k, v in staged.items():
        assert v.sharding.memory_kind == stager.kind == host_kind(jax.devices()[0])
        assert v.sharding.spec == SPECS[k] and not v.is_deleted()
        np.testing.assert_array_equal(np.asarray(v), want[k])  # bit for bit, bf16 included
    np.testing.assert_array_equal(np.asarray(state["count"]), 9)  # the steps ran on their own buffers
    # the staged buffers given back and used again (or not, as the backend allows): the next copy is right
    stager.give_back(staged)
    del staged
    want = _numpy(state)
    again = stager(state)
    state = step(state)
    for k, v in again.items():
        np.testing.assert_array_equal(np.asarray(v), want[k])
    assert stager.staged == 2 and stager.reuses in (True, False)


class Gate:
    """Stands for the step's loss the writer waits for (`ready`): arrives when set."""

    def __init__(self):
        self.event = threading.Event()

    def block_until_ready(self):
        self.event.wait(60)
        return self


def test_a_commit_written_while_steps_run_restores_the_state_at_its_step(mesh, step, tmp_path):
    """The writer thread reads the staged copy only after the loop has run two more
    steps on the donated state: the file's pieces and the restore are the state at step 5."""
    state = _state(mesh, 1)
    want = _numpy(state)
    c, gate = Committer(str(tmp_path), "h0", 0, 1), Gate()
    c.commit(5, state, {"cursor": 40}, ready=gate)  # returns at once: the writer waits for the gate
    state = step(state)
    state = step(state)
    jax.block_until_ready(state)
    assert c.busy and state["w"].is_deleted() is False
    gate.event.set()
    c.flush()
    meta, pieces = decode(read(str(tmp_path / "h0" / "own" / "r0" / "s000000005_w1.bin")))
    assert (meta["step"], meta["cursor"]) == (5, 40)
    replica0 = [np.asarray(s.data) for k in sorted(want) for s in _state(mesh, 1)[k].addressable_shards
                if s.replica_id == 0]  # the pieces' order: the state's leaves (sorted keys), replica 0 shards
    assert len(pieces) == len(replica0)
    for got, ref in zip(pieces, replica0):
        np.testing.assert_array_equal(got, ref)
    c.close()
    template = {k: jnp.zeros_like(v) for k, v in state.items()}
    got, meta = Committer(str(tmp_path), "h0", 0, 1, fresh=False).restore(template)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])  # bit-equal to the state at step 5
