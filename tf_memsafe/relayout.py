"""``relayout(tensor, layout)``: DTensor's relayout, each device allocating no more than its target shard.

    y = tf_memsafe.relayout(x, dtensor.Layout(["unsharded", "x"], mesh))   # same values as dtensor.relayout
    print(tf_memsafe.explain_relayout(x, layout))                           # the plan, its peak, the bound

DTensor moves an array between layouts by gathering along the axes that change and slicing after: on a
2 x 4 mesh of CPU devices its relayout of f32[4096, 4096] from ``(x, y)`` to ``(y, x)`` allocates about
16x the larger shard per device.  Here each device builds its target shard in one XLA program that reads
the pieces of the source shards it needs (:mod:`tf_memsafe.relayout_plan` says which, and from which
device) and concatenates them: XLA fuses the slices into the concatenation, so the program allocates
its output and nothing else.  A device whose target box is its own source shard keeps it.

Where it applies: eagerly, on a mesh of this process's CPU devices, whose shards share the host's memory
(TensorFlow hands a tensor from one CPU device to another without copying it).  Elsewhere -- inside a
``tf.function``, on a GPU or TPU mesh, on a mesh spanning several clients -- each device would first
receive whole source shards, so the bound would not hold: ``relayout`` then calls ``dtensor.relayout``
and warns once per reason, saying so.  Values are exactly DTensor's (the pieces are copied, not
computed); the result is not differentiable (``tf.GradientTape`` does not see through ``unpack``):
inside a differentiated computation use ``dtensor.relayout``.

Each assembly program is compiled once per piece grid, dtype and shard shapes (the pieces' offsets are
arguments), so the eight devices of a mesh share one program per layout pair.
"""

from __future__ import annotations

import functools
import threading
import warnings

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.experimental import dtensor

from tf_memsafe import hook
from tf_memsafe.relayout_plan import Assembly, Mesh, plan_relayout, shard_box
from tf_memsafe.report import RelayoutReport

__all__ = ["relayout", "explain_relayout"]

_lock = threading.Lock()
_assemblers: dict[tuple, tf.types.experimental.PolymorphicFunction] = {}
_warned: set[str] = set()


def _mesh(mesh: dtensor.Mesh) -> Mesh:
    names = tuple(mesh.dim_names)
    coords = tuple(tuple(int(loc[n]) for n in names) for loc in mesh.local_device_locations())
    return Mesh(names, tuple(int(s) for s in mesh.shape()), coords)


def _specs(layout: dtensor.Layout) -> tuple[str | None, ...]:
    specs = tuple(layout.sharding_specs)
    if dtensor.MATCH in specs:
        raise ValueError(f"the target layout {list(specs)} has a {dtensor.MATCH!r} dimension: give every "
                         f"dimension a mesh axis or {dtensor.UNSHARDED!r}")
    return tuple(None if s == dtensor.UNSHARDED else s for s in specs)


def _check_layout(layout) -> None:
    if not isinstance(layout, dtensor.Layout):
        raise TypeError(f"tf_memsafe.relayout takes a dtensor.Layout as its layout; got {type(layout).__name__}")


def _checked(tensor, layout) -> dtensor.Layout:
    """The tensor's layout, after the checks that make a relayout well defined (eagerly)."""
    _check_layout(layout)
    if not tf.executing_eagerly():
        raise RuntimeError("tf_memsafe.explain_relayout runs eagerly: call it outside the tf.function")
    if not isinstance(tensor, tf.Tensor) or not dtensor.is_dtensor(tensor):
        raise TypeError(f"tf_memsafe.relayout takes a DTensor (from dtensor.copy_to_mesh, dtensor.pack or a "
                        f"function on DTensors); got {type(tensor).__name__}: put it on the mesh with "
                        f"dtensor.copy_to_mesh(tensor, dtensor.Layout.replicated(mesh, rank)) first")
    source = dtensor.fetch_layout(tensor)
    if source.mesh != layout.mesh:
        raise ValueError("the target layout is on another mesh than the tensor: a relayout keeps the mesh "
                         "(dtensor.copy_to_mesh moves a tensor between meshes)")
    if layout.rank != source.rank:
        raise ValueError(f"the target layout has {layout.rank} dimensions; the tensor has {source.rank} "
                         f"(shape {tensor.shape.as_list()})")
    return source


def explain_relayout(tensor: tf.Tensor, layout: dtensor.Layout) -> RelayoutReport:
    """What :func:`relayout` would do: ``print`` the result for the collectives it amounts to, each
    device's allocation and traffic, the peak and Rink's bound; its ``plan`` holds every device's
    assembly.  Raises as :func:`relayout` does on bad arguments; runs nothing."""
    source = _checked(tensor, layout)
    return RelayoutReport(plan_relayout(tensor.shape.as_list(), tensor.dtype.size, _specs(source), _specs(layout),
                                        _mesh(layout.mesh)), tensor.dtype.name)


_IN_FUNCTION = ("inside a tf.function DTensor expands the relayout itself (tf_memsafe.relayout runs "
                "eagerly, between steps)")


def _fallback_reason(tensor: tf.Tensor, layout: dtensor.Layout) -> str | None:
    mesh = layout.mesh
    if mesh.device_type() != "CPU":
        return (f"on a {mesh.device_type()} mesh each device would receive whole source shards "
                f"(tf_memsafe.relayout assembles in place on host CPU meshes only)")
    if dtensor.num_clients() > 1 or mesh.is_remote() or mesh.num_local_devices() != mesh.size:
        return "the mesh spans several clients, whose shards this process cannot read"
    if not tensor.shape.is_fully_defined() or tensor.shape.num_elements() == 0:
        return "the tensor is empty or its shape is not fully known"
    return None


def _warn_once(reason: str) -> None:
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(f"tf_memsafe.relayout used dtensor.relayout, whose peak per device may exceed the larger "
                  f"shard: {reason}.", RuntimeWarning, stacklevel=3)


def _assembler(assembly: Assembly, dtype: tf.DType, part_shapes: tuple[tuple[int, ...], ...]):
    """The compiled program building one device's shard from its pieces' holders' shards and the pieces'
    offsets in them; shared by every assembly with the same piece sizes, dtype and holder shapes."""
    sizes = tuple(tuple(hi - lo for lo, hi in p.box) for p in assembly.pieces)
    shape = tuple(hi - lo for lo, hi in assembly.box)
    # where each piece lies in the shard
    offsets = tuple(tuple(lo - start for (lo, _), (start, _) in zip(p.box, assembly.box)) for p in assembly.pieces)
    key = (sizes, offsets, shape, dtype, part_shapes)
    with _lock:
        fn = _assemblers.get(key)
        if fn is None:
            def assemble(parts, begins):
                # The first piece padded to the shard's shape, then every other piece written into it in
                # place: XLA updates a dynamic-update-slice's operand where it stands and fuses the slice
                # into it.  (A concatenation would not fuse its operands on XLA:CPU, and a zero-filled
                # start would be folded into a constant as large as the shard.)
                pieces = [xla.dynamic_slice(part, begins[k], size) for k, (part, size) in enumerate(zip(parts, sizes))]
                shard = tf.pad(pieces[0], [[0, n - m] for n, m in zip(shape, sizes[0])])
                for k in range(1, len(pieces)):
                    shard = xla.dynamic_update_slice(shard, pieces[k], tf.constant(offsets[k], tf.int64))
                return shard

            fn = _assemblers[key] = tf.function(assemble, jit_compile=True, autograph=False)
    return fn


@functools.lru_cache(maxsize=256)
def _program(shape: tuple[int, ...], dtype: tf.DType, source, target, mesh: Mesh, devices: tuple[str, ...],
             part_shape: tuple[int, ...]):
    """The plan, and a function running every device's assembly at once (TensorFlow's executor runs the
    devices' programs side by side, as DTensor's own relayout does).  Cached: a training loop relayouts
    the same shapes every step."""
    plan = plan_relayout(shape, dtype.size, source, target, mesh)
    work = []
    for a in plan.assemblies:
        if a.reuse:
            continue
        begins = [[lo - held_lo for (lo, _), (held_lo, _) in zip(p.box, shard_box(shape, source, mesh, p.holder))]
                  for p in a.pieces]
        work.append((a, begins, None if a.leading_slice else _assembler(a, dtype, (part_shape,) * len(a.pieces))))

    def run(parts):
        shards = []
        for a, begins, assemble in work:
            with tf.device(devices[a.device]):
                if assemble is None:         # a range of rows of its own shard: TensorFlow shares the buffer
                    shards.append(tf.slice(parts[a.device], begins[0], [hi - lo for lo, hi in a.box]))
                else:
                    shards.append(assemble([parts[p.holder] for p in a.pieces], tf.constant(begins, tf.int64)))
        return shards

    return plan, tf.function(run, autograph=False)


def relayout(tensor: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """``dtensor.relayout(tensor, layout)``, with no device allocating more than its target shard.

    Raises:
      TypeError: ``tensor`` is not a DTensor, or ``layout`` not a ``dtensor.Layout``.
      ValueError: the layout is on another mesh, has another rank, or does not divide the shape.
    Warns (``RuntimeWarning``, once per reason) and returns ``dtensor.relayout``'s result where the bound
    cannot be kept this way (see the module's docstring).
    """
    _check_layout(layout)
    if not tf.executing_eagerly():
        _warn_once(_IN_FUNCTION)
        return dtensor.relayout(tensor, layout)
    source = _checked(tensor, layout)
    if source == layout:
        return tensor
    reason = _fallback_reason(tensor, layout)
    if reason is not None:
        _warn_once(reason)
        return dtensor.relayout(tensor, layout)
    parts = dtensor.unpack(tensor)
    devices = tuple(layout.mesh.local_devices())
    plan, run = _program(tuple(tensor.shape.as_list()), tensor.dtype, _specs(source), _specs(layout),
                         _mesh(layout.mesh), devices, tuple(parts[0].shape.as_list()))
    with hook.suspended():                   # our own programs are not the user's to rewrite
        built = iter(run(parts))
    shards = [parts[a.device] if a.reuse else next(built) for a in plan.assemblies]
    return dtensor.pack(shards, layout)

