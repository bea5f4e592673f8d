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

:func:`made` (called by the splitter on each op it builds) gives a ``Conv2D`` made in a loop body
the gradient :data:`GRADIENT` (through the ``_gradient_op_type`` attribute ``tf.gradients`` reads),
which builds both gradients as canonical XLA convolutions (``XlaConvV2``, so only for programs XLA
compiles) with the transposes XLA would have put at the top level: the same sums, in the same order
of the spatial window.  A transposed convolution (``Conv2DBackpropInput``: Keras' ``Conv2DTranspose``,
a VAE's or a GAN's decoder), itself such a convolution, is built again canonical there
(:func:`transposed`), with gradients of its own (:data:`TRANSPOSED_GRADIENT`).  Spatial sizes may be
known only when XLA compiles (a loop's slices: read from the shapes then).  What it does not cover
(``NCHW``, dilated, grouped or depthwise, ``Conv3D``) keeps TensorFlow's form.
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

from grappler_ext import folding

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


def made(op) -> list[tf.Tensor] | None:
    """A pass made ``op``; in a loop body of a program XLA compiles, a ``Conv2D`` is marked (:func:`mark`)
    and a transposed convolution (``Conv2DBackpropInput``, Keras' ``Conv2DTranspose``) is built again
    canonical (:func:`transposed`): its outputs to read instead are returned (``None``: ``op``'s)."""
    if op is None or not _FOR_XLA.get() or op.type not in ("Conv2D", "Conv2DBackpropInput") \
            or not in_loop_body(op.graph):
        return None
    if op.type == "Conv2D":
        mark(op)
        return None
    return transposed(op)


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


def _spatial(sizes: tf.Tensor | None, x: tf.Tensor | None):
    """The convolution's input's height and width: static ints, else int32 scalars from ``sizes`` (its
    shape as a vector) or ``x``'s shape, which XLA resolves when it compiles (a loop's slices)."""
    out = []
    for axis in (1, 2):
        static = x.shape[axis] if x is not None and x.shape.rank == 4 else None
        if static is None and sizes is not None:
            value = folding.static_value(sizes)
            static = None if value is None else int(value[axis])
        out.append(static if static is not None else (sizes[axis] if sizes is not None else tf.shape(x)[axis]))
    return out


def _pads(padding: str, explicit: list, kernel, strides, height, width):
    """A forward convolution's [[top, bottom], [left, right]] padding (``padding`` and its explicit
    paddings, as ``Conv2D`` takes them) for an input of ``height`` x ``width`` (ints, or int32 scalars
    XLA resolves when it compiles)."""
    if padding == "VALID":
        return [[0, 0], [0, 0]]
    if padding == "EXPLICIT":
        return [list(explicit[2:4]), list(explicit[4:6])]
    pads = []
    for size, k, s in ((height, kernel[0], strides[0]), (width, kernel[1], strides[1])):
        total = (tf.maximum if isinstance(size, tf.Tensor) else max)((-(-size // s) - 1) * s + k - size, 0)
        pads.append([total // 2, total - total // 2])
    return pads


def _paddings(op, height, width):
    """``op``'s (a ``Conv2D`` or ``Conv2DBackpropInput``) forward padding, by :func:`_pads`."""
    _, sh, sw, _ = op.get_attr("strides")
    return _pads(op.get_attr("padding").decode(), list(op.get_attr("explicit_paddings")),
                 op.inputs[1].shape[:2], (sh, sw), height, width)


def _covers(op, channels) -> bool:
    """NHWC, undilated, ungrouped (``channels``, the input's, where known, the kernel's), a kernel of
    static shape, a padding that leaves the kernel a tap on each side (SAME and VALID do)."""
    if op.get_attr("data_format") != b"NHWC" or list(op.get_attr("dilations")) != [1] * 4:
        return False
    w = op.inputs[1].shape
    if not w.is_fully_defined() or w.rank != 4 or channels not in (None, w[2]):
        return False
    if op.get_attr("padding") != b"EXPLICIT":
        return True
    (top, bottom), (left, right) = _paddings(op, None, None)
    return all(0 <= p <= k - 1 for p, k in ((top, w[0]), (bottom, w[0]), (left, w[1]), (right, w[1])))


def covered(op) -> bool:
    """Whether this module covers ``op``: a ``Conv2D`` or ``Conv2DBackpropInput`` that :func:`_covers`."""
    if op.type == "Conv2D":
        x = op.inputs[0].shape
        return x.rank in (None, 4) and _covers(op, x[3] if x.rank == 4 else None)
    if op.type == "Conv2DBackpropInput":
        return _covers(op, None)
    return False


def mark(op) -> None:
    """Give a ``Conv2D`` (made in a loop body) :data:`GRADIENT` where it is :func:`covered`."""
    if op.type == "Conv2D" and covered(op):
        op._set_attr("_gradient_op_type", attr_value_pb2.AttrValue(s=GRADIENT.encode()))  # noqa: SLF001


def _filter_gradient(x, dy, strides, pads, kernel):
    """dW[a, b, i, o] = sum over n, p, q of x[n, p*s + a - pad, q*s + b - pad, i] dy[n, p, q, o]: the
    input's channels as the batch, the batch as the feature summed, dy the kernel dilated by the stride."""
    (top, bottom), (left, right) = pads
    filters = xla.conv(tf.transpose(x, [3, 1, 2, 0]), tf.transpose(dy, [1, 2, 0, 3]), window_strides=[1, 1],
                       padding=tf.stack([tf.stack([top, bottom]), tf.stack([left, right])]),
                       lhs_dilation=[1, 1], rhs_dilation=list(strides), dimension_numbers=_CANONICAL)
    return tf.ensure_shape(tf.transpose(filters[:, :kernel[0], :kernel[1], :], [1, 2, 0, 3]), kernel)


def _input_gradient(dy, w, strides, pads, height, width, use_v2=False):
    """The input's gradient (a transposed convolution of ``dy``): dy dilated by the stride, over the
    kernel flipped with its channels swapped."""
    (top, _), (left, _) = pads
    kh, kw = w.shape[0], w.shape[1]
    out_h = dy.shape[1] if dy.shape[1] is not None else tf.shape(dy)[1]
    out_w = dy.shape[2] if dy.shape[2] is not None else tf.shape(dy)[2]
    flipped = tf.transpose(tf.reverse(w, [0, 1]), [0, 1, 3, 2])
    return xla.conv(dy, flipped, window_strides=[1, 1],
                    padding=tf.stack([tf.stack([kh - 1 - top, height - (out_h - 1) * strides[0] - 1 + top]),
                                      tf.stack([kw - 1 - left, width - (out_w - 1) * strides[1] - 1 + left])]),
                    lhs_dilation=list(strides), rhs_dilation=[1, 1], dimension_numbers=_CANONICAL, use_v2=use_v2)


@tf.RegisterGradient(GRADIENT)
def _canonical_gradient(op, dy):
    """``Conv2D``'s gradients as canonical convolutions (see the module's docstring)."""
    if not covered(op):                     # (an op given the attribute by hand)
        return nn_grad._Conv2DGrad(op, dy)  # noqa: SLF001
    x, w = op.inputs
    _, sh, sw, _ = op.get_attr("strides")
    height, width = _spatial(None, x)
    pads = _paddings(op, height, width)
    dx = _input_gradient(dy, w, (sh, sw), pads, height, width)
    return [tf.ensure_shape(dx, x.shape), _filter_gradient(x, dy, (sh, sw), pads, w.shape)]


TRANSPOSED_GRADIENT = "TfMemsafeCanonicalConv2DTranspose"


def transposed(op) -> list[tf.Tensor] | None:
    """``op`` (a ``Conv2DBackpropInput`` :func:`covered`, made in a loop body) built again as a canonical
    XLA convolution whose gradient is :data:`TRANSPOSED_GRADIENT`; its outputs (``None``: not covered)."""
    if not covered(op):
        return None
    sizes, w, dy = op.inputs
    _, sh, sw, _ = op.get_attr("strides")
    height, width = _spatial(sizes, None)
    y = _input_gradient(dy, w, (sh, sw), _paddings(op, height, width), height, width, use_v2=True)
    for name in ("strides", "explicit_paddings"):
        y.op._set_attr(f"_tf_memsafe_{name}", attr_value_pb2.AttrValue(  # noqa: SLF001
            list=attr_value_pb2.AttrValue.ListValue(i=list(op.get_attr(name)))))
    y.op._set_attr("_tf_memsafe_padding", attr_value_pb2.AttrValue(s=op.get_attr("padding")))  # noqa: SLF001
    y.op._set_attr("_gradient_op_type", attr_value_pb2.AttrValue(s=TRANSPOSED_GRADIENT.encode()))  # noqa: SLF001
    return [tf.ensure_shape(y, op.outputs[0].shape)]


@tf.RegisterGradient(TRANSPOSED_GRADIENT)
def _transposed_gradient(op, g):
    """A transposed convolution's gradients (:func:`transposed`): its input's, the forward convolution of
    ``g`` (canonical already); its kernel's, the filter's gradient with ``g`` as the forward's input."""
    dy, flipped = op.inputs[0], op.inputs[1]
    strides = list(op.get_attr("_tf_memsafe_strides"))
    padding, explicit = op.get_attr("_tf_memsafe_padding").decode(), list(op.get_attr("_tf_memsafe_explicit_paddings"))
    w = tf.reverse(tf.transpose(flipped, [0, 1, 3, 2]), [0, 1])
    d_dy = tf.nn.conv2d(g, w, strides, padding if padding != "EXPLICIT" else
                        [[0, 0], explicit[2:4], explicit[4:6], [0, 0]])
    height, width = _spatial(None, g)
    sh, sw = strides[1], strides[2]
    dw = _filter_gradient(g, dy, (sh, sw), _pads(padding, explicit, w.shape[:2], (sh, sw), height, width), w.shape)
    d_flipped = tf.transpose(tf.reverse(dw, [0, 1]), [0, 1, 3, 2])
    return [d_dy, d_flipped] + [None] * (len(op.inputs) - 2)
