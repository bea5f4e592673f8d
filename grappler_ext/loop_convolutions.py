"""Gradients of a convolution inside a loop body, in the form XLA:CPU runs fast there.

    dW = transpose(conv(transpose(x, ci..b), transpose(dy, .. b co), rhs_dilation=strides)[:, :kh, :kw])
    dx = conv(dy, transpose(reverse(w)), lhs_dilation=strides)         both in XLA's canonical layout

XLA:CPU computes a convolution with Eigen's fast kernel only where its dimension numbers are
canonical (input ``b01f``, kernel ``01io``, output ``b01f``), and brings a convolution to that form
(``ConvCanonicalization``, transposes around it) only at the top level of the program
(:data:`grappler_ext.xla_facts.CANONICAL_CONVOLUTIONS_TOP_LEVEL_ONLY`).  TensorFlow's gradient of
``Conv2D`` lowers to convolutions that are not canonical (the filter's gradient takes the batch as
the feature it sums), so in the body of a ``while`` loop (a splitter's slice of a CNN's training
step) they run in XLA's naive loop emitter: measured on TF 2.21, the filter's gradient of a [32, 128,
128, 16] activation 0.096 s at the top level and 9.4 s in a loop, the input's 0.043 s and 1.16 s, a
split Keras CNN's step 12x slower than as written; a forward ``Conv2D`` is canonical already.

:func:`mark` gives a ``Conv2D`` made in a loop body the gradient :data:`GRADIENT` (through the
``_gradient_op_type`` attribute ``tf.gradients`` reads), which builds both gradients as canonical XLA
convolutions (``XlaConvV2``, so only for programs XLA compiles) with the transposes XLA would have
put at the top level: the same sums, in the same order of the spatial window.  A ``Conv2D`` it does
not cover (``NCHW``, dilated, grouped, spatial sizes known only at run time) keeps TensorFlow's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import nn_grad

__all__ = ["GRADIENT", "covered", "mark", "in_loop_body", "made", "for_xla"]

GRADIENT = "TfMemsafeCanonicalConv2D"

# Whether the program being rewritten is compiled by XLA (the gradient's ``XlaConvV2`` has no kernel of
# TensorFlow's own): set by the pass that builds loops, for the time it builds them.
_FOR_XLA: contextvars.ContextVar = contextvars.ContextVar("loop_convolutions_for_xla", default=False)


@contextlib.contextmanager
def for_xla(compiled: bool) -> Iterator[None]:
    """Within: ops :func:`made` in loop bodies are marked where ``compiled`` (XLA compiles the program)."""
    token = _FOR_XLA.set(compiled)
    try:
        yield
    finally:
        _FOR_XLA.reset(token)


def made(op) -> None:
    """A pass made ``op``: marked (:func:`mark`) if it is in a loop body of a program XLA compiles."""
    if op is not None and _FOR_XLA.get() and op.type == "Conv2D" and in_loop_body(op.graph):
        mark(op)

# b01f input, 01io kernel, b01f output: the layout XLA:CPU's Eigen convolution takes.
_CANONICAL = xla_data_pb2.ConvolutionDimensionNumbers(
    input_batch_dimension=0, input_feature_dimension=3, input_spatial_dimensions=[1, 2],
    kernel_spatial_dimensions=[0, 1], kernel_input_feature_dimension=2, kernel_output_feature_dimension=3,
    output_batch_dimension=0, output_feature_dimension=3, output_spatial_dimensions=[1, 2])


def in_loop_body(graph) -> bool:
    """Whether ``graph`` is the body of a ``while`` loop (or a function inside one)."""
    while graph is not None:
        if type(graph).__name__ == "WhileBodyFuncGraph":
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _paddings(op, x: tf.Tensor):
    """The forward's [[top, bottom], [left, right]] padding: ints, or int32 tensors from ``x``'s shape
    where its spatial sizes are known only when XLA compiles (a loop's slices); XLA resolves them then."""
    kh, kw = op.inputs[1].shape[0], op.inputs[1].shape[1]
    _, sh, sw, _ = op.get_attr("strides")
    padding = op.get_attr("padding").decode()
    if padding == "VALID":
        return [[0, 0], [0, 0]]
    if padding == "EXPLICIT":
        p = list(op.get_attr("explicit_paddings"))
        return [[p[2], p[3]], [p[4], p[5]]]
    pads = []
    for axis, k, s in ((1, kh, sh), (2, kw, sw)):
        size = x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]
        total = tf.maximum((-(-size // s) - 1) * s + k - size, 0) if isinstance(size, tf.Tensor) else max(
            (-(-size // s) - 1) * s + k - size, 0)
        pads.append([total // 2, total - total // 2])
    return pads


def covered(op) -> bool:
    """Whether :data:`GRADIENT` covers ``op``: a ``Conv2D`` in NHWC, undilated, ungrouped (its input's
    channels, where known, the kernel's), of a kernel of static shape, whose padding leaves the kernel
    a tap on each side (SAME and VALID do)."""
    if op.type != "Conv2D" or op.get_attr("data_format") != b"NHWC" or list(op.get_attr("dilations")) != [1] * 4:
        return False
    x, w = op.inputs[0].shape, op.inputs[1].shape
    if x.rank not in (None, 4) or not w.is_fully_defined() or w.rank != 4 or (x.rank == 4 and x[3] not in (None, w[2])):
        return False
    if op.get_attr("padding") != b"EXPLICIT":
        return True
    (top, bottom), (left, right) = _paddings(op, op.inputs[0])
    return all(0 <= p <= k - 1 for p, k in ((top, w[0]), (bottom, w[0]), (left, w[1]), (right, w[1])))


def mark(op) -> None:
    """Give ``op`` (made in a loop body) :data:`GRADIENT` where it :func:`covered`."""
    if covered(op):
        op._set_attr("_gradient_op_type", attr_value_pb2.AttrValue(s=GRADIENT.encode()))  # noqa: SLF001


@tf.RegisterGradient(GRADIENT)
def _canonical_gradient(op, dy):
    """``Conv2D``'s gradients as canonical convolutions (see the module's docstring)."""
    if not covered(op):                     # (an op given the attribute by hand)
        return nn_grad._Conv2DGrad(op, dy)  # noqa: SLF001
    x, w = op.inputs
    _, sh, sw, _ = op.get_attr("strides")
    (top, bottom), (left, right) = _paddings(op, x)
    kh, kw = w.shape[0], w.shape[1]
    # dW[a, b, i, o] = sum over n, p, q of x[n, p*s + a - pad, q*s + b - pad, i] dy[n, p, q, o]: the
    # input's channels as the batch, the batch as the feature summed, dy the kernel dilated by the stride.
    filters = xla.conv(tf.transpose(x, [3, 1, 2, 0]), tf.transpose(dy, [1, 2, 0, 3]), window_strides=[1, 1],
                       padding=tf.stack([tf.stack([top, bottom]), tf.stack([left, right])]),
                       lhs_dilation=[1, 1], rhs_dilation=[sh, sw], dimension_numbers=_CANONICAL)
    dw = tf.transpose(filters[:, :kh, :kw, :], [1, 2, 0, 3])
    # dx: dy dilated by the stride, over the kernel flipped with its channels swapped.
    size, out = tf.shape(x), tf.shape(dy)
    height = x.shape[1] if x.shape[1] is not None else size[1]
    width = x.shape[2] if x.shape[2] is not None else size[2]
    out_h = dy.shape[1] if dy.shape[1] is not None else out[1]
    out_w = dy.shape[2] if dy.shape[2] is not None else out[2]
    flipped = tf.transpose(tf.reverse(w, [0, 1]), [0, 1, 3, 2])
    dx = xla.conv(dy, flipped, window_strides=[1, 1],
                  padding=tf.stack([tf.stack([kh - 1 - top, height - (out_h - 1) * sh - 1 + top]),
                                    tf.stack([kw - 1 - left, width - (out_w - 1) * sw - 1 + left])]),
                  lhs_dilation=[sh, sw], rhs_dilation=[1, 1], dimension_numbers=_CANONICAL)
    return [tf.ensure_shape(dx, x.shape), tf.ensure_shape(dw, w.shape)]
