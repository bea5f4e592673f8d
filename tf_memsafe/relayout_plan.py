"""Redistribution between two layouts of one array on a device mesh, planned within a memory bound.

    each device's target shard  =  concat over the grid of (target box  ∩  source blocks), each
    block read from one device that holds it (the device itself whenever it does)

A layout gives each dimension of the array one mesh axis, whose devices hold equal consecutive blocks
of it, or none (every device holds it whole): DTensor's ``Layout``. Under the source layout each device
holds one box of the global array; under the target, another. Rink, Paszke, Vytiniotis and Schmid
("Memory-efficient array redistribution through portable collective communication", 2021) show that a
redistribution never needs more memory per device than the larger of the two shards. Frameworks
instead gather first and slice after: DTensor's own relayout of f32[4096, 4096] between ``(x, -)`` and
``(-, x)`` on a 2 x 4 mesh allocates 1.5-16x that bound per device.

This module is the plan, a pure function of shapes and layouts (no TensorFlow): for every device, its
target box cut along each dimension at the source blocks' edges (a grid of pieces, in row-major order),
and for each piece the device it is read from. Written as a concatenation the compiler fuses, each
device allocates exactly its target shard and nothing else (``peak_bytes``), whatever the pair of
layouts: a device whose target box is its own source shard allocates nothing. The mechanism that
runs a plan is :mod:`tf_memsafe.relayout`.

Which collective each mesh axis amounts to (``collectives``), in Rink's terms: an axis that shards a
dimension only in the target is a local slice (no communication); one that moves from one dimension to
another is an all-to-all; one that shards a dimension only in the source is an all-gather. The plan
reads each piece from the holder that agrees with the receiving device on every axis the source does
not use, which is the group such a collective would run in, so the traffic is spread as it would be.

Not handled: a dimension split over two mesh axes (DTensor's layouts give a dimension at most one),
shapes the axes do not divide (DTensor refuses them too: ``ValueError`` naming the dimension), meshes
whose device count differs from the devices listed.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Sequence

__all__ = ["Mesh", "CollectiveKind", "Collective", "Piece", "Assembly", "RelayoutPlan", "shard_box",
           "plan_relayout"]

Interval = tuple[int, int]
Box = tuple[Interval, ...]
Specs = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A device mesh as the plan needs it: axis names and sizes, and each device's coordinates.

    ``coords[k]`` are device k's coordinates, one per axis, in the order the devices' shards are
    listed (DTensor's ``unpack`` order).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if len(self.names) != len(self.sizes) or len(set(self.names)) != len(self.names):
            raise ValueError(f"a mesh needs one size per distinct axis name; got {self.names} and {self.sizes}")
        if len(self.coords) != math.prod(self.sizes):
            raise ValueError(f"a {'x'.join(map(str, self.sizes))} mesh has {math.prod(self.sizes)} devices; "
                             f"{len(self.coords)} were listed")

    @classmethod
    def grid(cls, axes: Sequence[tuple[str, int]]) -> Mesh:
        """The mesh whose devices are numbered in row-major order of their coordinates."""
        names, sizes = zip(*axes) if axes else ((), ())
        return cls(tuple(names), tuple(sizes), tuple(itertools.product(*(range(s) for s in sizes))))

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    @property
    def num_devices(self) -> int:
        return len(self.coords)


class CollectiveKind(enum.Enum):
    """What one mesh axis amounts to between the two layouts."""

    LOCAL_SLICE = "local slice"     # shards a dimension in the target only: each device keeps a slice
    ALL_TO_ALL = "all-to-all"       # moves from one dimension to another
    ALL_GATHER = "all-gather"       # shards a dimension in the source only


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: CollectiveKind
    axis: str
    source_dim: int | None
    target_dim: int | None


@dataclasses.dataclass(frozen=True)
class Piece:
    """One box of the global array that a device receives, and the device it is read from."""

    holder: int
    box: Box


@dataclasses.dataclass(frozen=True)
class Assembly:
    """How one device builds its target shard.

    Attributes:
      device: the device's index in the mesh's list.
      box: its target box in global coordinates.
      grid: the number of pieces along each dimension; ``pieces`` lists them in row-major order, so
        the shard is their concatenation along the last dimension, then the one before, and so on.
      reuse: the target box is this device's own source shard: it is kept, nothing is allocated.
      leading_slice: the target box is a range of its own source shard's first dimension (all others
        whole): a contiguous view of it, which a runtime may hand out without copying.
    """

    device: int
    box: Box
    grid: tuple[int, ...]
    pieces: tuple[Piece, ...]
    reuse: bool
    leading_slice: bool = False


@dataclasses.dataclass(frozen=True)
class RelayoutPlan:
    """Every device's assembly of its target shard, and what it costs in memory and traffic.

    ``source`` and ``target`` give each dimension's mesh axis (``None``: not sharded).  Sizes are per
    device, in bytes: ``peak_bytes`` is the most any device allocates (its target shard, or nothing
    where it keeps its source shard); ``bound_bytes`` Rink's bound, the larger of the two shards;
    ``received_bytes`` the most any device reads from other devices.  ``peak_bytes`` counts a leading
    slice as a copy: an upper bound where the runtime shares the buffer.
    """

    shape: tuple[int, ...]
    itemsize: int
    mesh: Mesh
    source: Specs
    target: Specs
    collectives: tuple[Collective, ...]
    assemblies: tuple[Assembly, ...]

    @property
    def source_shard_bytes(self) -> int:
        return _shard_elements(self.shape, self.source, self.mesh) * self.itemsize

    @property
    def target_shard_bytes(self) -> int:
        return _shard_elements(self.shape, self.target, self.mesh) * self.itemsize

    @property
    def bound_bytes(self) -> int:
        return max(self.source_shard_bytes, self.target_shard_bytes)

    @property
    def peak_bytes(self) -> int:
        return max((0 if a.reuse else _box_elements(a.box) * self.itemsize for a in self.assemblies), default=0)

    @property
    def peak_over_bound(self) -> float:
        return self.peak_bytes / self.bound_bytes if self.bound_bytes else 0.0

    @property
    def received_bytes(self) -> int:
        return max((sum(_box_elements(p.box) for p in a.pieces if p.holder != a.device) * self.itemsize
                    for a in self.assemblies if not a.reuse), default=0)

    @property
    def identity(self) -> bool:
        return self.source == self.target


def _check_specs(shape: tuple[int, ...], specs: Specs, mesh: Mesh, which: str) -> None:
    if len(specs) != len(shape):
        raise ValueError(f"the {which} layout has {len(specs)} dimensions; the array has {len(shape)} "
                         f"(shape {list(shape)})")
    used = [a for a in specs if a is not None]
    for axis in used:
        if axis not in mesh.names:
            raise ValueError(f"the {which} layout names mesh axis {axis!r}; the mesh's axes are {list(mesh.names)}")
    if len(set(used)) != len(used):
        raise ValueError(f"the {which} layout {list(specs)} shards two dimensions over one mesh axis")
    for dim, (n, axis) in enumerate(zip(shape, specs)):
        if axis is not None and n % mesh.size(axis):
            raise ValueError(f"dimension {dim} of the array (size {n}) is not divisible by mesh axis {axis!r} "
                             f"(size {mesh.size(axis)}) of the {which} layout")


def _shard_elements(shape: tuple[int, ...], specs: Specs, mesh: Mesh) -> int:
    return math.prod(n // (mesh.size(a) if a is not None else 1) for n, a in zip(shape, specs))


def _box_elements(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def shard_box(shape: Sequence[int], specs: Specs, mesh: Mesh, device: int) -> Box:
    """The box of the global array that ``device`` holds under the layout ``specs``."""
    coord = dict(zip(mesh.names, mesh.coords[device]))
    box = []
    for n, axis in zip(shape, specs):
        if axis is None:
            box.append((0, n))
        else:
            extent = n // mesh.size(axis)
            box.append((coord[axis] * extent, (coord[axis] + 1) * extent))
    return tuple(box)


def _cuts(interval: Interval, n: int, axis: str | None, mesh: Mesh) -> tuple[Interval, ...]:
    """``interval`` cut at the edges of the source blocks along a dimension of size ``n``."""
    if axis is None:
        return (interval,)
    extent = n // mesh.size(axis)
    lo, hi = interval
    if extent == 0:                 # an empty dimension: one empty piece
        return (interval,)
    edges = [lo, *range((lo // extent + 1) * extent, hi, extent), hi]
    return tuple(zip(edges[:-1], edges[1:]))


def _holder(box: Box, receiver: int, shape: tuple[int, ...], source: Specs, mesh: Mesh) -> int:
    """The device holding the source block that contains ``box`` and agreeing with ``receiver`` on
    every mesh axis the source layout does not use (``receiver`` itself when it holds the block)."""
    coord = list(mesh.coords[receiver])
    for (lo, _), n, axis in zip(box, shape, source):
        if axis is not None and n:
            coord[mesh.names.index(axis)] = lo // (n // mesh.size(axis))
    return mesh.coords.index(tuple(coord))


def _collectives(source: Specs, target: Specs, mesh: Mesh) -> tuple[Collective, ...]:
    out = []
    for axis in mesh.names:
        s = source.index(axis) if axis in source else None
        t = target.index(axis) if axis in target else None
        if s == t:
            continue
        kind = (CollectiveKind.ALL_GATHER if t is None else CollectiveKind.LOCAL_SLICE if s is None
                else CollectiveKind.ALL_TO_ALL)
        out.append(Collective(kind, axis, s, t))
    return tuple(out)


def plan_relayout(shape: Sequence[int], itemsize: int, source: Sequence[str | None],
                  target: Sequence[str | None], mesh: Mesh) -> RelayoutPlan:
    """Plan the redistribution of an array of ``shape`` from layout ``source`` to ``target``.

    Raises ``ValueError`` naming the problem when a layout does not fit the array or the mesh.
    """
    shape, source, target = tuple(int(n) for n in shape), tuple(source), tuple(target)
    _check_specs(shape, source, mesh, "source")
    _check_specs(shape, target, mesh, "target")
    assemblies = []
    for device in range(mesh.num_devices):
        box = shard_box(shape, target, mesh, device)
        reuse = box == shard_box(shape, source, mesh, device)
        cuts = [_cuts(iv, n, axis, mesh) for iv, n, axis in zip(box, shape, source)]
        pieces = () if reuse else tuple(Piece(_holder(b, device, shape, source, mesh), b)
                                        for b in itertools.product(*cuts))
        own = shard_box(shape, source, mesh, device)
        leading = (not reuse and len(pieces) == 1 and pieces[0].holder == device
                   and all(b == o for b, o in zip(box[1:], own[1:])))
        assemblies.append(Assembly(device, box, tuple(len(c) for c in cuts), pieces, reuse, leading))
    return RelayoutPlan(shape, int(itemsize), mesh, source, target, _collectives(source, target, mesh),
                        tuple(assemblies))
