"""The relayout plan (issue 31), without TensorFlow: for every pair of 1-D and 2-D layouts of a 2 x 4
mesh (and a few 3-D ones), each device's pieces tile its target box, each piece is held by the device
it is read from, a numpy simulation of the plan rebuilds every target shard exactly, and no device
allocates more than Rink's bound."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tf_memsafe.relayout_plan import CollectiveKind, Mesh, plan_relayout, shard_box

MESH = Mesh.grid([("x", 2), ("y", 4)])


def layouts(rank: int, mesh: Mesh = MESH) -> list[tuple[str | None, ...]]:
    """Every layout of a ``rank``-dimensional array: each dimension one mesh axis or none, no axis twice."""
    choices = [None, *mesh.names]
    return [specs for specs in itertools.product(choices, repeat=rank)
            if len([a for a in specs if a]) == len({a for a in specs if a})]


def _slices(box):
    return tuple(slice(lo, hi) for lo, hi in box)


def simulate(plan, array: np.ndarray) -> list[np.ndarray]:
    """Run the plan with numpy: every device's target shard, built only from the source shards."""
    held = [array[_slices(shard_box(plan.shape, plan.source, plan.mesh, d))] for d in range(plan.mesh.num_devices)]
    out = []
    for a in plan.assemblies:
        if a.reuse:
            out.append(held[a.device])
            continue
        shard = np.full([hi - lo for lo, hi in a.box], np.nan)
        for p in a.pieces:
            src = shard_box(plan.shape, plan.source, plan.mesh, p.holder)
            part = held[p.holder][tuple(slice(lo - s, hi - s) for (lo, hi), (s, _) in zip(p.box, src))]
            shard[tuple(slice(lo - t, hi - t) for (lo, hi), (t, _) in zip(p.box, a.box))] = part
        out.append(shard)
    return out


PAIRS = ([(s, t, (16, 24)) for s in layouts(2) for t in layouts(2)]
         + [(s, t, (24,)) for s in layouts(1) for t in layouts(1)]
         + [(s, t, (4, 8, 12)) for s, t in [((None, "x", "y"), ("y", None, "x")), (("x", "y", None), (None, None, "x")),
                                           ((None, None, None), ("y", "x", None))]])


def test_the_layouts_of_a_2x4_mesh_are_seven_for_a_matrix_and_three_for_a_vector():
    assert len(layouts(2)) == 7 and len(layouts(1)) == 3


@pytest.mark.parametrize("source,target,shape", PAIRS, ids=lambda v: str(v).replace(" ", ""))
def test_the_plan_rebuilds_every_target_shard_within_the_bound(source, target, shape):
    plan = plan_relayout(shape, 4, source, target, MESH)
    array = np.arange(np.prod(shape), dtype=float).reshape(shape)
    got = simulate(plan, array)
    for d, shard in enumerate(got):
        np.testing.assert_array_equal(shard, array[_slices(shard_box(shape, target, MESH, d))])
    for a in plan.assemblies:
        if a.reuse:
            continue
        # The pieces tile the box: they lie inside it, their sizes sum to its size, the grid counts them.
        assert len(a.pieces) == np.prod(a.grid)
        assert sum(np.prod([hi - lo for lo, hi in p.box]) for p in a.pieces) == np.prod([hi - lo for lo, hi in a.box])
        own = shard_box(shape, source, MESH, a.device)
        for p in a.pieces:
            held = shard_box(shape, source, MESH, p.holder)
            assert all(h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(p.box, held))
            if all(o0 <= lo and hi <= o1 for (lo, hi), (o0, o1) in zip(p.box, own)):
                assert p.holder == a.device          # what a device holds it reads from itself
    assert plan.peak_bytes <= plan.bound_bytes
    assert plan.peak_bytes == (0 if all(a.reuse for a in plan.assemblies) else plan.target_shard_bytes)


def test_equal_layouts_are_an_identity_that_allocates_nothing():
    plan = plan_relayout((16, 24), 4, ("x", "y"), ("x", "y"), MESH)
    assert plan.identity and all(a.reuse for a in plan.assemblies) and plan.peak_bytes == 0
    assert plan.collectives == ()


@pytest.mark.parametrize("source,target,expected", [
    (("x", None), (None, "x"), [(CollectiveKind.ALL_TO_ALL, "x", 0, 1)]),
    (("x", "y"), ("y", "x"), [(CollectiveKind.ALL_TO_ALL, "x", 0, 1), (CollectiveKind.ALL_TO_ALL, "y", 1, 0)]),
    (("x", "y"), (None, None), [(CollectiveKind.ALL_GATHER, "x", 0, None), (CollectiveKind.ALL_GATHER, "y", 1, None)]),
    ((None, None), ("x", "y"),
     [(CollectiveKind.LOCAL_SLICE, "x", None, 0), (CollectiveKind.LOCAL_SLICE, "y", None, 1)]),
    (("x", None), ("y", None), [(CollectiveKind.ALL_GATHER, "x", 0, None), (CollectiveKind.LOCAL_SLICE, "y", None, 0)]),
])
def test_each_changed_axis_is_named_by_the_collective_it_amounts_to(source, target, expected):
    plan = plan_relayout((16, 24), 4, source, target, MESH)
    assert [(c.kind, c.axis, c.source_dim, c.target_dim) for c in plan.collectives] == expected


def test_a_local_slice_reads_nothing_from_other_devices_and_allocates_only_the_target_shard():
    plan = plan_relayout((16, 24), 4, (None, None), ("x", "y"), MESH)
    assert plan.received_bytes == 0
    assert plan.peak_bytes == plan.target_shard_bytes == 16 * 24 * 4 // 8
    assert plan.bound_bytes == 16 * 24 * 4


def test_pieces_come_from_the_holder_in_the_receivers_collective_group():
    # (x, -) -> (-, -) is an all-gather over x: device (0, 1) completes its rows from device (1, 1),
    # its group along x, not from (1, 0) which holds the same rows.
    plan = plan_relayout((16, 24), 4, ("x", None), (None, None), MESH)
    receiver = MESH.coords.index((0, 1))
    holders = {MESH.coords[p.holder] for p in plan.assemblies[receiver].pieces}
    assert holders == {(0, 1), (1, 1)}
    # and the traffic is spread: every device is read from by exactly one other device
    reads = [p.holder for a in plan.assemblies for p in a.pieces if p.holder != a.device]
    assert sorted(reads) == list(range(8))


def test_the_all_to_all_moves_one_eighth_of_the_array_into_each_device():
    plan = plan_relayout((4096, 4096), 4, ("x", "y"), ("y", "x"), MESH)
    assert plan.bound_bytes == plan.peak_bytes == 4096 * 4096 * 4 // 8
    assert plan.received_bytes == plan.target_shard_bytes     # device (1, 1) holds none of its target


def test_an_empty_array_plans_empty_pieces():
    plan = plan_relayout((0, 24), 4, ("x", None), (None, "y"), MESH)
    assert plan.peak_bytes == plan.bound_bytes == 0 and plan.peak_over_bound == 0.0


@pytest.mark.parametrize("source,target,shape,message", [
    (("x",), ("x", None), (16, 24), "the source layout has 1 dimensions; the array has 2"),
    (("x", "z"), ("x", None), (16, 24), "names mesh axis 'z'; the mesh's axes are ['x', 'y']"),
    (("x", None), ("y", "y"), (16, 24), "shards two dimensions over one mesh axis"),
    (("x", None), (None, "y"), (16, 6), "dimension 1 of the array (size 6) is not divisible by mesh axis 'y' (size 4)"),
])
def test_a_layout_that_does_not_fit_is_refused_naming_it(source, target, shape, message):
    with pytest.raises(ValueError) as e:
        plan_relayout(shape, 4, source, target, MESH)
    assert message in str(e.value)


def test_a_mesh_lists_one_coordinate_tuple_per_device():
    with pytest.raises(ValueError, match="a 2x4 mesh has 8 devices; 3 were listed"):
        Mesh(("x", "y"), (2, 4), ((0, 0), (0, 1), (0, 2)))
    with pytest.raises(ValueError, match="one size per distinct axis name"):
        Mesh(("x", "x"), (2, 4), tuple(itertools.product(range(2), range(4))))
