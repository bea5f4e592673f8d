"""The value of a small tensor that a graph computes from constants only, read without changing it.

``tensor_util.constant_value`` (``tf.get_static_value``) folds what TF can at trace time: a
``Const``, a static ``Shape``/``Rank``/``Size``, and a few ops over those (``ConcatV2``, ``Pack``,
``Range``, ``Cast``...).  Library code often builds a permutation or a shape from those with ops it
does not fold: GPflow's ``base_conditional`` transposes ``Kmn`` by
``concat([range(rank - 2), [rank - 1], [rank - 2]])`` written with ``Sub`` and ``Reshape``, so a
rule that needs the permutation as a constant refuses an identity transpose.  :func:`static_value`
falls back to evaluating such a tensor: its ancestors are copied into a fresh graph and run in a
session there, when every one of them is a registered, stateless op without control inputs, is
at most :data:`MAX_OPS` ops away from the tensor, and has static outputs of at most
:data:`MAX_ELEMENTS` elements; an ancestor whose outputs ``constant_value`` already knows (a
``Shape`` of a placeholder with a static shape) enters as a ``Const`` of that value.  Anything else
(a placeholder's value, a variable, a random op, a function call) gives ``None``, as
``constant_value`` does.

Why it is safe: the copy computes the same ops on the same constants, on the CPU, so the value is
the one the graph would compute at run time for integer and layout tensors (what the rules read);
the traced graph is only read.  Results (``None`` included) are cached per graph by tensor name:
ops are never removed from a TF graph and an op's inputs only change when a pass rewires them, which
never happens to these constant-only chains.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

__all__ = ["static_value", "MAX_OPS", "MAX_ELEMENTS"]

MAX_OPS = 64               # ancestors evaluated at most: a shape computation, not a program
MAX_ELEMENTS = 1 << 16     # elements of each ancestor's outputs at most

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> {tensor name: value or None}


def _known(t: tf.Tensor) -> np.ndarray | None:
    try:
        value = tensor_util.constant_value(t)
    except (TypeError, ValueError):
        return None
    return None if value is None else np.asarray(value)


def static_value(t: tf.Tensor) -> np.ndarray | None:
    """The value of ``t`` if the graph computes it from constants only (see the module docstring), else ``None``."""
    value = _known(t)
    if value is not None:
        return value
    if not t.shape.is_fully_defined() or t.shape.num_elements() > MAX_ELEMENTS:
        return None
    per_graph = _cache.setdefault(t.graph, {})
    if t.name not in per_graph:
        per_graph[t.name] = _evaluate(t)
    return per_graph[t.name]


_FED = ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault")   # stateless, but their value comes from outside


def _foldable(op: tf.Operation) -> bool:
    return (op.type not in _FED and not op.control_inputs and not op.op_def.is_stateful
            and all(o.dtype not in (tf.resource, tf.variant) for o in op.outputs)
            and op.graph._get_function(op.type) is None          # a function call: its body is elsewhere
            and all(o.shape.is_fully_defined() and o.shape.num_elements() <= MAX_ELEMENTS for o in op.outputs))


def _evaluate(t: tf.Tensor) -> np.ndarray | None:
    """Copy ``t``'s constant-only ancestry into a fresh graph and run it there; ``None`` if it is not one."""
    nodes: dict[str, tf.compat.v1.NodeDef] = {}
    stack = [t.op]
    while stack:
        op = stack.pop()
        if op.name in nodes:
            continue
        if len(nodes) >= MAX_OPS:
            return None
        if op.type != "Const":
            known = _known(op.outputs[0]) if len(op.outputs) == 1 else None
            if known is not None:        # e.g. the static Shape of a placeholder: its inputs are not needed
                nodes[op.name] = _const_node(op.name, known, op.outputs[0].dtype)
                continue
            if not _foldable(op):
                return None
        node = tf.compat.v1.NodeDef()
        node.CopyFrom(op.node_def)
        node.ClearField("device")
        nodes[op.name] = node
        stack.extend(i.op for i in op.inputs)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(nodes.values())
    try:
        with tf.Graph().as_default() as g:
            tf.graph_util.import_graph_def(graph_def, name="")
            with tf.compat.v1.Session(graph=g) as session:
                return np.asarray(session.run(t.name))
    except (tf.errors.OpError, ValueError, TypeError, KeyError):
        return None


def _const_node(name: str, value: np.ndarray, dtype: tf.DType) -> tf.compat.v1.NodeDef:
    node = tf.compat.v1.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = dtype.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value, dtype=dtype))
    return node
