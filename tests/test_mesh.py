"""Mesh specs: parsing, -1 inference, errors a user can cause, device layout."""

from __future__ import annotations

import re

import pytest

import dpjax
from dpjax.mesh import mesh_size


@pytest.mark.parametrize(
    "spec, devices, names, sizes",
    [
        ("8", 8, ("data", "model"), (8, 1)),
        ("2x4", 8, ("data", "model"), (2, 4)),
        ("8x1", 8, ("data", "model"), (8, 1)),
        ("2x2x2", 8, ("node", "data", "model"), (2, 2, 2)),
        ("data=2,model=4", 8, ("data", "model"), (2, 4)),
        ("model=4,data=2", 8, ("model", "data"), (4, 2)),
        ("data=8", 8, ("data",), (8,)),
        ("node=2,data=2,model=2", 8, ("node", "data", "model"), (2, 2, 2)),
        ("stage=2,node=1,data=4", 8, ("stage", "node", "data"), (2, 1, 4)),
        (" 2 x 4 ", 8, ("data", "model"), (2, 4)),
        ("2X4", 8, ("data", "model"), (2, 4)),
        ("data = 2 , model = 4", 8, ("data", "model"), (2, 4)),
        ("1", 1, ("data", "model"), (1, 1)),
        ("3x2", 6, ("data", "model"), (3, 2)),
        # one -1 takes the devices the other axes leave
        ("-1", 8, ("data", "model"), (8, 1)),
        ("-1x2", 8, ("data", "model"), (4, 2)),
        ("2x-1", 8, ("data", "model"), (2, 4)),
        ("2x-1x2", 8, ("node", "data", "model"), (2, 2, 2)),
        ("-1x1x1", 8, ("node", "data", "model"), (8, 1, 1)),
        ("data=-1,model=2", 8, ("data", "model"), (4, 2)),
        ("node=2,data=-1", 6, ("node", "data"), (2, 3)),
        ("-1x3", 6, ("data", "model"), (2, 3)),
    ],
    ids=lambda v: repr(v) if isinstance(v, str) else None,
)
def test_parse_mesh_spec(spec, devices, names, sizes):
    assert dpjax.parse_mesh_spec(spec, devices) == (names, sizes)


BAD_SPECS = [
    ("3x3", 8),  # needs 9 devices
    ("2x4", 6),  # needs 8
    ("0x8", 8),
    ("2x", 8),
    ("x", 8),
    ("abc", 8),
    ("2.5x2", 8),
    ("-1x-1", 8),
    ("-2x4", 8),
    ("-1x3", 8),  # 8 devices do not split into threes
    ("", 8),
    ("   ", 8),
    ("2x2x2x1", 8),  # at most three unnamed axes
    ("data=2,data=4", 8),
    ("data=2,model", 8),
    ("data=2,=4", 8),
    ("2data=8", 8),
    ("data=two", 8),
    ("data=4,model=4", 8),
    ("data=-1,model=-1", 8),
    ("data=0,model=8", 8),
]


@pytest.mark.parametrize("spec, devices", BAD_SPECS, ids=[repr(s) for s, _ in BAD_SPECS])
def test_bad_spec_names_spec_and_device_count(spec, devices):
    with pytest.raises(ValueError) as info:
        dpjax.parse_mesh_spec(spec, devices)
    msg = str(info.value)
    assert repr(spec) in msg
    assert re.search(rf"\b{devices}\b devices", msg), msg
    assert "\n" not in msg  # one line, for a command-line user


@pytest.mark.parametrize("spec", ["3x3", "0x8", "2x", "abc", "-1x-1", "", "data=2,data=4"])
def test_make_mesh_bad_spec_names_spec_and_device_count(devices, spec):
    with pytest.raises(ValueError) as info:
        dpjax.make_mesh(spec, devices)
    assert repr(spec) in str(info.value)
    assert re.search(r"\b8\b devices", str(info.value))


@pytest.mark.parametrize("spec, close", [("data=2,modle=4", "model"), ("nodes=2,data=4", "node"),
                                         ("data=4,stages=2", "stage"), ("data=2,x=4", None)])
def test_an_unknown_axis_name_is_refused_naming_the_closest(spec, close):
    """A misspelled axis used to become one more data axis (every name but model and stage
    splits the batch): `data=2,modle=4` trained as 8-way data parallelism."""
    with pytest.raises(ValueError) as info:
        dpjax.parse_mesh_spec(spec, 8)
    msg, wrong = str(info.value), spec.split(",")[1 if close != "node" else 0].split("=")[0]
    assert f"names an unknown axis {wrong!r}" in msg and "\n" not in msg
    assert ("did you mean" in msg) == (close is not None) and (close is None or f"did you mean {close}?" in msg)
    assert msg.endswith(f"; the axes are {', '.join(dpjax.mesh.AXES)} (8 devices available)")


def test_make_mesh_over_a_subset_checks_the_subset(devices):
    with pytest.raises(ValueError, match=r"'2x4'.*\b5\b devices"):
        dpjax.make_mesh("2x4", devices[:5])


@pytest.mark.parametrize(
    "spec, shape",
    [
        ("2x4", {"data": 2, "model": 4}),
        ("2x2x2", {"node": 2, "data": 2, "model": 2}),
        ("data=2,model=4", {"data": 2, "model": 4}),
        ("8", {"data": 8, "model": 1}),
        ("-1x2", {"data": 4, "model": 2}),
    ],
)
def test_make_mesh(devices, spec, shape):
    mesh = dpjax.make_mesh(spec, devices)
    assert tuple(mesh.axis_names) == tuple(shape)
    assert dict(mesh.shape) == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_make_mesh_defaults_to_every_device():
    import jax

    n = len(jax.devices())
    mesh = dpjax.make_mesh(f"data={n}")
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("count", [1, 3, 5, 8])
def test_make_mesh_over_subset(devices, count):
    mesh = dpjax.make_mesh(f"data={count}", devices[:count])
    assert dict(mesh.shape) == {"data": count}
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices[:count]}


def test_devices_sorted_by_id_whatever_order_given(devices):
    mesh = dpjax.make_mesh("2x4", list(reversed(devices)))
    ids = sorted(d.id for d in devices)
    assert [[d.id for d in r] for r in mesh.devices] == [ids[:4], ids[4:]]


class FakeDevice:
    """Just enough of a jax Device for Mesh: a process index and an id."""

    def __init__(self, process_index: int, id: int):
        self.process_index, self.id = process_index, id

    def __repr__(self):
        return f"FakeDevice({self.process_index}, {self.id})"


def test_devices_laid_out_process_major():
    # Two processes whose device ids interleave (as on some multi-host platforms):
    # the outer axis must split by process so the inner axes stay inside a process.
    devs = [FakeDevice(p, i) for i, p in enumerate([1, 0, 1, 0, 0, 1, 0, 1])]
    mesh = dpjax.make_mesh("2x2x2", devs)
    got = [[(d.process_index, d.id) for d in row] for row in mesh.devices.reshape(2, 4)]
    assert got == [[(0, 1), (0, 3), (0, 4), (0, 6)], [(1, 0), (1, 2), (1, 5), (1, 7)]]
    # "node" varies slowest: each node is one process.
    for node in range(2):
        assert {d.process_index for d in mesh.devices[node].flat} == {node}


def test_make_mesh_devices_not_mutated(devices):
    given = list(reversed(devices))
    before = list(given)
    dpjax.make_mesh("8", given)
    assert given == before


@pytest.mark.parametrize(
    "spec, axes",
    [
        ("2x4", ("data",)),
        ("8", ("data",)),
        ("2x2x2", ("node", "data")),
        ("data=8", ("data",)),
        ("model=8", ()),
        ("model=2,data=4", ("data",)),
        ("stage=2,node=2,data=2", ("node", "data")),
    ],
)
def test_data_axes(devices, spec, axes):
    assert dpjax.data_axes(dpjax.make_mesh(spec, devices)) == axes


@pytest.mark.parametrize(
    "spec, size",
    [("8", 8), ("2x4", 8), ("2x2x2", 8), ("data=2,model=3", 6), ("-1x2", None),
     ("abc", None), ("0x8", None), ("data=x", None)],
)
def test_mesh_size(spec, size):
    assert mesh_size(spec) == size


def test_dp_size_counts_data_parallel_ranks_not_processes(devices):
    assert dpjax.dp_size(dpjax.make_mesh("2x4", devices)) == 2
    assert dpjax.dp_size(dpjax.make_mesh("2x2x2", devices)) == 4
    assert dpjax.dp_size(dpjax.make_mesh("8", devices)) == 8
    assert dpjax.process_count() == 1  # one process drives all 8 devices here


def test_parse_axes(devices):
    from dpjax.mesh import MeshError, parse_axes

    mesh = dpjax.make_mesh("2x2x2", devices)
    assert parse_axes("node", mesh) == ("node",)
    assert parse_axes("data,node", mesh) == ("node", "data")  # the mesh's order
    assert parse_axes("", mesh) == ()
    with pytest.raises(MeshError, match="'model' is not a data axis"):
        parse_axes("model", mesh)


def test_bound_names_the_axes_a_shard_map_binds_here():
    """`mesh.bound`, the one "is this axis bound here" test (tensor_parallel, nn, rng,
    horovod and the collectives ask it): true inside a shard_map for the axes it is manual
    over (all of a tuple), false for the others, outside, under jit with a mesh set, and for None."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from dpjax.mesh import bound

    mesh = dpjax.make_mesh("2x4", jax.devices()[:8])
    names = ("data", "model", ("data", "model"), None)
    seen = {}

    def probe(tag):
        seen[tag] = [bound(a) for a in names]

    def body(x):
        probe("data only")
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"data"}))(jnp.ones(2))
    jax.shard_map(lambda x: (probe("both"), x)[1], mesh=mesh, in_specs=P(), out_specs=P())(jnp.ones(2))
    with jax.set_mesh(mesh):
        jax.jit(lambda x: (probe("jit under set_mesh"), x)[1])(jnp.ones(2))
    probe("outside")
    assert seen == {"data only": [True, False, False, False], "both": [True, True, True, False],
                    "jit under set_mesh": [False] * 4, "outside": [False] * 4}
