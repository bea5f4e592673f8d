"""Axes a device mesh shards (DTensor), carried from the function's inputs through the graph: no loop
slices along them.

DTensor traces a function once, with the global shapes, and expands it for each device afterwards: an
op along a sharded axis runs on each device's block of it.  A loop over slices of a sharded axis does
not: DTensor expands a slice at a run-time offset by gathering the whole axis on every device first.
Measured on a 4-device mesh: a forward split along its batch-sharded [32768, 64] input went from
4 MiB per device as written to 45 MiB.  So the axes that carry a sharded input axis are pinned, and
a region that would slice one stops there, saying so (:func:`why_pinned`), unless the sliced tensor
is small: gathering it whole on every device costs its global size, which is allowed up to
:data:`GATHER_SHARE` of the limit (a self-kernel of batch-sharded points [4096, 8] reads them along
both of its axes: the loop gathers 256 KB and cuts each device's 577 MB to 7 MB).

An output axis is sharded when the split rule of its op (:mod:`.rules`) reads a sharded input axis for
it; an op the rules refuse along an axis, reading a sharded tensor, counts that axis of its output as
sharded (nothing is known of it, and a gather would be silent); a variable's value is sharded as its
handle says; both factors of a sharded axis a reshape splits count as sharded (DTensor's blocks are the
leading factor's, but which is not checked). Sizes are still the global ones: a loop along an unsharded
axis is sized for the whole arrays, which bounds each device's share from above.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import tensorflow as tf

from grappler_ext.op_types import nbytes
from grappler_ext.pass_base import PassOptions, ShardedAxis
from grappler_ext.splitter import rules
from grappler_ext.splitter.outcome import Code, Why

__all__ = ["Pinned", "pinned_axes", "why_pinned", "GATHER_SHARE"]

GATHER_SHARE = 1 / 8    # of the limit: the most a sliced sharded tensor may hold whole on every device


@dataclasses.dataclass(frozen=True)
class Pinned:
    """Each tensor's sharded axes (tensor ref -> {axis: mesh axis}) and the bytes a tensor sliced along
    one may hold (gathered whole on every device)."""

    axes: dict
    gather_bytes: int


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> (ops, sharded, pinned)


def pinned_axes(graph, options: PassOptions) -> Pinned | None:
    """Every tensor's sharded axes, from the inputs' (``None`` without sharded inputs); computed again
    only when the graph has gained ops (a loop built) since the last call."""
    sharded = options.sharded_inputs
    if not sharded:
        return None
    gather = int((options.memory_limit_bytes or 0) * GATHER_SHARE)
    every = graph.get_operations()
    ops = (len(every), every[-1].name if every else "")
    known = _cache.get(graph)
    if known is None or known[0] != ops or known[1] != tuple(sharded):
        known = _cache[graph] = (ops, tuple(sharded), _propagate(graph, sharded))
    return Pinned(known[2], gather)


def _propagate(graph, sharded: Sequence[ShardedAxis]) -> dict:
    by_name = {op.name: op for op in graph.get_operations()}
    pinned: dict = {}
    for s in sharded:
        op = by_name.get(s.placeholder)
        if op is not None and op.outputs:
            pinned.setdefault(op.outputs[0].ref(), {})[s.axis] = s.mesh_axis
    for op in graph.get_operations():
        held = [pinned.get(t.ref(), {}) for t in op.inputs]
        if not any(held):
            continue
        if op.type == "ReadVariableOp":
            pinned[op.outputs[0].ref()] = dict(held[0])
            continue
        for k, out in enumerate(op.outputs):
            if out.shape.rank is None:
                continue
            axes = {}
            for a in range(out.shape.rank):
                try:
                    prop = rules.propagate(op, k, a)
                except ValueError:
                    prop = None
                if not prop:
                    mesh_axis = next(iter(v for h in held for v in h.values()))
                else:
                    mesh_axis = next((h[b] for h, b in zip(held, prop.input_axes) if b is not None and b in h), None)
                if mesh_axis is not None:
                    axes[a] = mesh_axis
            if axes:
                pinned[out.ref()] = axes
    return pinned


def why_pinned(pinned: Pinned, sliced_inputs: dict) -> Why | None:
    """Why a region whose inputs are sliced as ``sliced_inputs`` (tensor ref -> axis) cannot be a loop:
    one of them, larger than ``pinned.gather_bytes``, is sliced along a sharded axis; ``None`` if none is."""
    for ref, axis in sliced_inputs.items():
        mesh_axis = pinned.axes.get(ref, {}).get(axis)
        t: tf.Tensor = ref.deref()
        if mesh_axis is not None and nbytes(t) > pinned.gather_bytes:
            return Why(Code.SHARDED_AXIS, f"`{t.op.name}` is sharded along axis {axis} over mesh axis "
                                          f"'{mesh_axis}' (DTensor): a loop over its slices would gather its "
                                          f"{nbytes(t):,} B on every device, more than "
                                          f"1/{round(1 / GATHER_SHARE)} of the limit")
    return None
