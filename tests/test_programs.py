"""dpjax.recovery.programs: a kept program is loaded, not compiled, by the next Programs of the
same run (what a restarted process does), and computes what jit computes (checked
against numpy); another run's key, another signature or a device subset each get their
own executable; a program JAX served from its persistent cache is never kept (its
serialised copy would lack code on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.recovery.programs import Programs


def _inputs(mesh):
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    y = np.eye(8, dtype=np.float32) * 2 + 0.5
    return x, y, jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names[0]))), jax.device_put(y, NamedSharding(
        mesh, P()))


def _f(x, y):
    return jnp.tanh(x @ y) + 1.0


def _g(x, y):  # the same signature, another program: tells a loaded executable from a compiled one
    return x - y


def test_a_kept_program_is_loaded_by_the_next_process_of_the_run(tmp_path, devices):
    mesh = jax.make_mesh((8,), ("data",), devices=devices)
    x, y, xs, ys = _inputs(mesh)
    first = Programs(str(tmp_path), {"run": 1})
    out = first.keep("step", jax.jit(_f))(xs, ys)
    np.testing.assert_allclose(np.asarray(out), np.tanh(x @ y) + 1.0, rtol=1e-6)
    assert (first.compiled, first.loaded) == (1, 0) and len(list(tmp_path.iterdir())) == 1

    again = Programs(str(tmp_path), {"run": 1})  # a restarted process of the same run
    kept = again.keep("step", jax.jit(_g))  # were it compiled, it would compute x - y
    np.testing.assert_array_equal(np.asarray(kept(xs, ys)), np.asarray(out))
    assert (again.compiled, again.loaded) == (0, 1)
    # read as jit's lower(...).compile() is (the run's figures): the kept executable
    assert kept.lower(xs, ys).compile() is kept.compiled(xs, ys)

    other = Programs(str(tmp_path), {"run": 2})  # other settings: other programs
    np.testing.assert_array_equal(np.asarray(other.keep("step", jax.jit(_g))(xs, ys)), x - y)
    assert (other.compiled, other.loaded) == (1, 0)


def test_each_signature_and_a_device_subset_get_their_own(tmp_path, devices):
    mesh = jax.make_mesh((2,), ("data",), devices=devices[2:4])  # a program on 2 of the 8 devices
    x, y, xs, ys = _inputs(mesh)
    Programs(str(tmp_path), {}).keep("step", jax.jit(_f))(xs, ys)
    again = Programs(str(tmp_path), {})
    kept = again.keep("step", jax.jit(_f))
    out = kept(xs, ys)
    assert {d.id for d in out.sharding.device_set} == {devices[2].id, devices[3].id}
    np.testing.assert_allclose(np.asarray(out), np.tanh(x @ y) + 1.0, rtol=1e-6)
    wide = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("data")))
    np.testing.assert_allclose(np.asarray(kept(wide, jax.device_put(np.ones((16, 4), np.float32),
                                                                    NamedSharding(mesh, P())))),
                               np.tanh(np.full((8, 4), 16.0)) + 1.0, rtol=1e-6)
    assert (again.loaded, again.compiled) == (1, 1)


class _FromJaxCache:
    """A jitted function whose compile JAX reports as a persistent-cache hit."""

    def __init__(self, fn):
        self.fn = fn

    def lower(self, *args):
        lowered = self.fn.lower(*args)

        class Lowered:
            def compile(self_):
                jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
                return lowered.compile()

        return Lowered()


def test_a_program_from_jaxs_cache_is_not_kept(tmp_path, devices):
    mesh = jax.make_mesh((8,), ("data",), devices=devices)
    x, y, xs, ys = _inputs(mesh)
    programs = Programs(str(tmp_path), {})
    out = programs.keep("step", _FromJaxCache(jax.jit(_f)))(xs, ys)
    np.testing.assert_allclose(np.asarray(out), np.tanh(x @ y) + 1.0, rtol=1e-6)
    assert not list(tmp_path.iterdir())  # nothing written: the next process compiles it
