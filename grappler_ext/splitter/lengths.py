"""Where the run-time length of a tensor's axis comes from, for loops along sizes known only when the
function runs: the function's inputs (a padded batch's length), or a tensor the ops keeping that axis
lead back to (a sum's gradient broadcast to ``tf.shape(x)``: ``x``'s).  Two loops' axes with one source
are one length (:func:`length_source`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from grappler_ext import folding
from grappler_ext.splitter import rules

__all__ = ["length_source", "INPUTS"]

INPUTS = "(the function's inputs)"


def length_source(t: tf.Tensor, axis: int, depth: int = 256) -> tuple[str, int]:
    """Where the run-time length of ``t``'s ``axis`` comes from: ``(INPUTS, axis)`` for the function's
    inputs (their unknown dimensions at one axis are taken as one: a batch's features and labels, a
    padded batch's lengths), else the tensor and axis the ops keeping it lead back to (an op that
    keeps it is one whose split rule reads exactly one input along a dynamic axis, or several with
    one source)."""
    for _ in range(depth):
        if t.op.type in ("Placeholder", "PlaceholderWithDefault") and not t.op.inputs:
            return (INPUTS, axis)
        if t.shape.rank is None or t.shape[axis] is not None:
            return (t.name, axis)
        same = _SAME_LENGTH.get((t.op.type, t.value_index, axis))
        if same is not None:
            t, axis = t.op.inputs[same[0]], same[1]
            continue
        if t.op.type == "IdentityN":                   # a custom gradient's outputs: its inputs
            t = t.op.inputs[t.value_index]
            continue
        shaped = _shape_source(t, axis)
        if shaped is not None:
            # broadcast_to(g, tf.shape(x)) (a reduction's gradient), a slice cut to x's length: x's.
            t, axis = shaped
            continue
        prop = rules.propagate(t.op, t.value_index, axis)
        if not prop:
            return (t.name, axis)
        carried = [(x, a) for x, a in zip(t.op.inputs, prop.input_axes)
                   if a is not None and x.shape.rank is not None and x.shape[a] is None]
        if not carried:
            return (t.name, axis)
        if len({(x.ref(), a) for x, a in carried}) > 1:
            found = {length_source(x, a, depth // 2) for x, a in carried}
            return found.pop() if len(found) == 1 else (t.name, axis)
        t, axis = carried[0]
    return (t.name, axis)


# (op type, output, axis) -> (input, axis) of the same length, for ops with no split rule: a
# loss's per-example values and its gradient have the logits' batch.
_SAME_LENGTH = {(op_type, k, 0): (0, 0) for op_type in ("SparseSoftmaxCrossEntropyWithLogits",
                                                       "SoftmaxCrossEntropyWithLogits") for k in (0, 1)}


# Ops that make their output in a shape given as a tensor: which input holds it.
_SHAPE_OPERAND = {"BroadcastTo": 1, "Reshape": 1, "Fill": 0, "Slice": 2, "Tile": 1}


def _shape_source(t: tf.Tensor, axis: int) -> tuple[tf.Tensor, int] | None:
    """``(x, a)`` where ``t``'s ``axis`` is made as long as ``x``'s ``a`` read at run time
    (``BroadcastTo``, ``Fill``, ``Reshape`` or ``Slice`` to sizes from ``tf.shape(x)``; ``Tile`` of a
    unit axis that many times), else ``None``."""
    op = t.op
    index = _SHAPE_OPERAND.get(op.type)
    if index is None:
        return None
    if op.type == "Tile" and op.inputs[0].shape.rank is not None and op.inputs[0].shape[axis] != 1:
        return None
    return _element_source(op.inputs[index], axis)


def _element_source(shape: tf.Tensor, i: int, depth: int = 16) -> tuple[tf.Tensor, int] | None:
    """``(x, a)`` where element ``i`` of the 1-D int tensor ``shape`` is ``tf.shape(x)[a]``, else ``None``."""
    op = shape.op
    if depth == 0:
        return None
    if op.type in ("Identity", "Cast") and op.inputs:
        return _element_source(op.inputs[0], i, depth - 1)
    if op.type == "Shape":
        return (op.inputs[0], i)
    if op.type == "Pack" and i < len(op.inputs):
        return _scalar_source(op.inputs[i], depth - 1)
    if op.type == "Reshape" and i == 0 and op.inputs[0].shape.num_elements() == 1:
        return _scalar_source(op.inputs[0], depth - 1)
    if op.type == "ConcatV2":
        start = 0
        for piece in op.inputs[:-1]:
            n = piece.shape.num_elements() if piece.shape.is_fully_defined() else None
            if n is None:
                return None
            if i < start + n:
                return _element_source(piece, i - start, depth - 1)
            start += n
    return None


def _scalar_source(t: tf.Tensor, depth: int) -> tuple[tf.Tensor, int] | None:
    """``(x, a)`` where the int scalar ``t`` is ``tf.shape(x)[a]``, else ``None``."""
    op = t.op
    if depth == 0:
        return None
    if op.type in ("Identity", "Cast") or (op.type == "Reshape" and t.shape.num_elements() == 1):
        return _scalar_source(op.inputs[0], depth - 1) if t.shape.rank == 0 else _element_source(t, 0, depth - 1)
    if op.type == "StridedSlice" and op.inputs[0].op.type == "Shape" and op.get_attr("shrink_axis_mask") == 1:
        begin = folding.static_value(op.inputs[1])
        if begin is not None and np.asarray(begin).size == 1:
            x = op.inputs[0].op.inputs[0]
            return (x, int(np.asarray(begin).reshape(-1)[0]) % max(1, x.shape.rank or 1))
    return None
