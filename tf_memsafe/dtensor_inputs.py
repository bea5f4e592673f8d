"""Which axes of a traced function's inputs a DTensor mesh shards, read from the call's arguments.

DTensor traces a ``tf.function`` called on DTensors like any other, with the global shapes, and expands
the graph for each device afterwards: nothing in the traced graph says which axes are sharded.  The
call's arguments do: the hook reads them from the trace's frames (:func:`tf_memsafe._tf_internals.call_arguments`)
and gives the splitter each sharded axis of each input (:class:`grappler_ext.pass_base.ShardedAxis`),
whose loops then never slice along one (:mod:`grappler_ext.splitter.sharding`).

Inputs are matched to the graph's placeholders in order (the function's tensor and variable
arguments, then its captures); where they cannot be matched the answer is ``None``: the hook then
leaves the function as traced, saying why.  A process that never imported DTensor pays nothing.
"""

from __future__ import annotations

import sys

import tensorflow as tf

from grappler_ext.pass_base import ShardedAxis
from tf_memsafe import _tf_internals

__all__ = ["sharded_inputs"]

_DTENSOR_API = "tensorflow.dtensor.python.api"


def _on_mesh(value) -> bool:
    device = getattr(value, "device", "") or ""
    if isinstance(value, tf.Variable):
        device = getattr(value.handle, "device", "") or ""
    return "CUSTOM" in device


def _axes(value, placeholder: str) -> list[ShardedAxis]:
    from tensorflow.experimental import dtensor

    layout = dtensor.fetch_layout(value.handle if isinstance(value, tf.Variable) else value)
    mesh = layout.mesh
    return [ShardedAxis(placeholder, axis, spec) for axis, spec in enumerate(layout.sharding_specs)
            if spec not in (dtensor.UNSHARDED, dtensor.MATCH) and mesh.dim_size(spec) > 1]


def sharded_inputs(graph) -> tuple[ShardedAxis, ...] | None:
    """The sharded axes of ``graph``'s inputs for the call being traced: ``()`` when none is a DTensor
    (or DTensor is not in use), ``None`` when DTensor inputs cannot be matched to the placeholders."""
    if _DTENSOR_API not in sys.modules:
        return ()
    call = _tf_internals.call_arguments()
    leaves = [v for v in tf.nest.flatten(call) if isinstance(v, (tf.Tensor, tf.Variable))] if call else []
    captures = list(getattr(graph, "captures", ()))
    with tf.init_scope():
        if not any(_on_mesh(v) for v in leaves) and not any(_on_mesh(e) for e, _ in captures):
            return ()
        inputs = [t for t in graph.inputs if all(t is not i for _, i in captures)]
        if len(inputs) != len(leaves):
            return None
        found = []
        for value, placeholder in [*zip(leaves, inputs), *captures]:
            wanted = tf.resource if isinstance(value, tf.Variable) else value.dtype
            if placeholder.dtype != wanted:
                return None
            if _on_mesh(value):
                found += _axes(value, placeholder.op.name)
    return tuple(found)
