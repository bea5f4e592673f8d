"""pairwise_distance: squared distances through a matmul instead of an [.., N, M, D] broadcast.

    sum((a - b)**2, -1)  =>  max(|x|^2[.., :, None] - 2 x y^T + |y|^2[.., None, :], 0)

where ``a`` has static shape ``[.., N, 1, D]`` and ``b`` ``[.., 1, M, D]`` (either order), and
``x = reshape(a, [.., N, D])``, ``y = reshape(b, [.., M, D])``.  The reshapes only drop a unit axis:
XLA lowers them to bitcasts, and they see through every spelling of the expansion
(``x[:, None]`` strided slices, ``tf.expand_dims``, ``tf.reshape``) because only shapes are read.

When it applies:

* the difference is spelled ``Sub(a, b)`` or ``AddV2(a, Neg(b))`` (either order), squared as
  ``Square``, ``Pow(., 2)``, ``Mul(e, e)`` (what ``tf.norm`` emits for real tensors, so
  ``tf.norm(x - y, axis=-1)`` is covered through its ``Sqrt``) or ``SquaredDifference``; the sum
  runs over the last axis only, with or without ``keepdims``.  ``Sqrt`` of the sum (Euclidean
  distance) keeps working on the rewritten sum;
* scaled differences: operands scaled before the difference (``x / lengthscale`` on both, as
  GPflow's kernels do) need nothing special, since only the operands' shapes are read; a
  difference scaled afterwards, ``(a - b) * s`` or ``(a - b) / s`` with ``s`` a scalar or a
  ``[D]`` vector, is rewritten with ``x * s`` and ``y * s`` (``x / s``, ``y / s``) first;
* a tensor against itself (both operands expansions of the same tensor by ``ExpandDims``,
  ``Reshape`` or unit-stride ``StridedSlice``): one squared norm serves both sides;
* leading batch dimensions are equal in both operands (no broadcasting across batches);
* floating dtypes only: for integers the identity holds but intermediate overflow differs;
* the interior ``Sub``/``Square`` have no other consumer (otherwise the [.., N, M, D] tensor is
  still needed and nothing is saved);
* cost: only when XLA would materialise the broadcast.  Measured on TF 2.21 XLA:CPU, a reduction
  over an innermost axis of at most 32 elements fuses with its elementwise producers, so the
  [N, M, D] tensor never exists, and the direct form is faster (1.6x at D = 3); from D = 33 on it
  is materialised.  Below the threshold the pass skips with that reason.

Why it is safe, and what changes numerically:

* the identity is exact in real arithmetic; in floating point the matmul form suffers
  cancellation when ``|x - y|`` is small next to ``|x|``, ``|y|``: tiny distances can come out
  slightly negative, hence the clamp at zero (so a following ``Sqrt`` stays real).  Relative
  error of small distances grows like eps * |x|^2 / |x - y|^2;
* a NaN in an input row still makes that row's (and column's) distances NaN; an infinite
  coordinate gives NaN (inf - inf) where the original gave inf;
* gradients flow through ``matmul`` and ``reduce_sum``; at exactly zero distance the clamp's
  gradient is zero on the clamped side, as the original's is zero there too;
* a difference scaled afterwards is scaled before instead: ``(a - b) / s`` becomes
  ``a / s - b / s``, equal in real arithmetic, within a few ulps in floating point.

Pipeline position: first, before the splitter, so that the splitter sees an [N, M] matmul region
instead of a three-dimensional broadcast.  Its motive is memory: the pipeline runs it only on a
program over its limit, and undoes it where XLA's figure rises (:mod:`grappler_ext.guard`), so a
program that fits keeps its exact distances.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import gradients, graph_edit
from grappler_ext.graph_query import live_ops
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pattern import Any, Const, OneOf, Op, is_floating, match, static_shape
from grappler_ext.pipeline import register_pass
from grappler_ext.xla_facts import FUSED_REDUCTION_MAX

__all__ = ["PairwiseDistance"]

_a = Any("a", where=[is_floating(), static_shape()])
_b = Any("b", where=[static_shape()])
_scale = Any("scale", where=[static_shape()])
_plain_diff = OneOf(
    Op("Sub", _a, _b, exclusive=True),                                          # a - b
    Op("AddV2|Add", _a, Op("Neg", _b, exclusive=True), commutative=True, exclusive=True),  # a + (-b)
)
_diff = OneOf(
    _plain_diff,
    Op("Mul", _plain_diff, _scale, commutative=True, exclusive=True, name="scaled_mul"),  # (a - b) * s
    Op("RealDiv", _plain_diff, _scale, exclusive=True, name="scaled_div"),              # (a - b) / s
    name="diff",
)
_SQUARED_DIFF = OneOf(
    Op("Square", _diff, exclusive=True),                     # tf.square(a - b)
    Op("Pow", _diff, Const(value=2), exclusive=True),        # (a - b) ** 2
    Op("Mul", _diff, _diff, exclusive=True),                 # (a - b) * (a - b); tf.norm
    Op("SquaredDifference", _a, _b, exclusive=True),         # tf.math.squared_difference(a, b)
)
PATTERN = Op("Sum", _SQUARED_DIFF, Const("axis"), name="sum")


_EXPANSIONS = ("ExpandDims", "Reshape", "StridedSlice", "Identity")


def _unexpanded(t: tf.Tensor) -> tf.Tensor:
    """The tensor ``t`` was made from by element-preserving expansions (same elements, same order)."""
    while t.op.type in _EXPANSIONS and t.shape.is_fully_defined():
        source = t.op.inputs[0]
        if not source.shape.is_fully_defined() or source.shape.num_elements() != t.shape.num_elements():
            break
        if t.op.type == "StridedSlice":
            strides = tensor_util.constant_value(t.op.inputs[3])
            if strides is None or np.any(strides != 1):  # x[::-1, None] reorders elements
                break
        t = source
    return t


def _scale_vector(scale: tf.Tensor, dim: int):
    """``scale`` as a scalar or ``[D]`` shape for the operands, or ``None`` if it scales more than axis -1."""
    shape = scale.shape.as_list()
    while shape and shape[0] == 1:
        shape = shape[1:]
    if shape in ([], [1]):
        return []
    if shape == [dim]:
        return [dim]
    return None


def _sums_a_square(total: tf.Operation) -> bool:
    """Whether ``total`` sums something squared (worth a record when it is not a distance)."""
    inner = total.inputs[0].op
    if inner.type == "Mul":
        return inner.inputs[0] is inner.inputs[1]
    return inner.type in ("Square", "Pow", "SquaredDifference")


def _short_reason(total: tf.Operation, failed) -> str:
    """One short line: the matcher's reason when it is about an outside reader, else what was squared."""
    if failed.outside_use:
        return failed.reason
    square = total.inputs[0].op
    operand = square.inputs[0].op
    if operand.type in ("Sub", "SquaredDifference") and not all(t.shape.is_fully_defined() for t in operand.inputs):
        # (a difference of shapes known only at run time: the pattern's expansions are read statically)
        return (f"`{operand.name}` is a difference of {' and '.join(str(t.shape) for t in operand.inputs)}, shapes "
                "known only at run time; the pass rewrites differences of static shapes")
    return (f"`{square.name}` squares `{operand.name}` ({operand.type}), not a difference of "
            "[.., N, 1, D] and [.., 1, M, D] tensors")


def _operand_shapes(a: tf.Tensor, b: tf.Tensor):
    """``(x_shape, y_shape, swapped)`` if a is [.., N, 1, D] and b is [.., 1, M, D] (or swapped)."""
    sa, sb = a.shape.as_list(), b.shape.as_list()
    if len(sa) != len(sb) or len(sa) < 3 or sa[:-3] != sb[:-3] or sa[-1] != sb[-1]:
        return None
    if sa[-2] == 1 and sb[-3] == 1:
        return sa[:-2] + sa[-1:], sb[:-3] + sb[-2:], False
    if sa[-3] == 1 and sb[-2] == 1:
        return sb[:-2] + sb[-1:], sa[:-3] + sa[-2:], True
    return None


@register_pass
class PairwiseDistance(GraphPass):
    name = "pairwise_distance"
    motive = Motive.MEMORY

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)  # a Sum already rewritten is dead: never rewritten twice
        # A gradient taken inside the function reads the difference; it is differentiated again
        # after the rewrite (grappler_ext.gradients), so its reads do not count.
        backward = gradients.backward_ops(graph) if gradients.rebuildable(graph)[0] else set()
        for op in list(graph.get_operations()):
            if (op.type != "Sum" or op not in live or op in backward
                    or graph_edit.is_generated(op)):
                continue
            m = match(PATTERN, op.outputs[0], ignore=backward)
            if not m:
                if _sums_a_square(op):
                    result.skip([op], f"not a pairwise distance: {_short_reason(op, m)}")
                continue
            if self._rewrite(graph, m, result) and backward:
                gradients.rebuild(graph, self.name, m.ops)
        return result

    def _rewrite(self, graph, m, result: PassResult) -> bool:
        a, b, total = m["a"], m["b"], m["sum"]
        ops = [o.name for o in m.ops]  # root (Sum) first
        shapes = _operand_shapes(a, b)
        if shapes is None:
            result.skip(ops, f"operands {a.shape} and {b.shape} are not [.., N, 1, D] and [.., 1, M, D]")
            return False
        x_shape, y_shape, swapped = shapes
        rank = len(a.shape)
        axes = [int(v) % rank for v in m.const_values["axis"].reshape(-1)]
        if axes != [rank - 1]:
            result.skip(ops, f"sums over axes {axes}, not only the last axis")
            return False
        dim = x_shape[-1]
        item = a.dtype.size
        n_pairs = x_shape[-2] * y_shape[-2]
        for s in x_shape[:-2]:
            n_pairs *= s
        if dim <= FUSED_REDUCTION_MAX:
            result.skip(ops, f"D = {dim} <= {FUSED_REDUCTION_MAX}: XLA fuses the broadcast into the sum, "
                             "which is already cheap and faster than a matmul", bytes_before=n_pairs * item)
            return False
        bytes_before = n_pairs * dim * item
        scale, scale_shape = None, None
        for kind in ("scaled_mul", "scaled_div"):
            if kind in m:
                scale = m["scale"]
                scale_shape = _scale_vector(scale, dim)
                if scale_shape is None or scale.dtype != a.dtype:
                    result.skip(ops, f"the difference is scaled by a {scale.dtype.name}{scale.shape} tensor, "
                                     f"not a scalar or [D = {dim}] vector of its dtype")
                    return False
                divide = kind == "scaled_div"
        same = _unexpanded(a) is _unexpanded(b) and x_shape == y_shape
        if swapped:
            a, b = b, a
        with graph_edit.building(graph, self.name):
            x = tf.reshape(a, x_shape)                                           # [.., N, D]
            y = x if same else tf.reshape(b, y_shape)                            # [.., M, D]
            if scale is not None:
                # (a - b) * s = a * s - b * s, and likewise for / s.
                s_vec = tf.reshape(scale, scale_shape)                           # [] or [D]
                x = x / s_vec if divide else x * s_vec                           # [.., N, D]
                y = x if same else (y / s_vec if divide else y * s_vec)          # [.., M, D]
            x2 = tf.reduce_sum(tf.square(x), axis=-1)                            # [.., N]
            y2 = x2 if same else tf.reduce_sum(tf.square(y), axis=-1)            # [.., M]
            x2, y2 = x2[..., :, None], y2[..., None, :]                          # [.., N, 1], [.., 1, M]
            xy = tf.linalg.matmul(x, y, transpose_b=True)                       # [.., N, M]
            # Cancellation can make tiny distances negative: clamp at zero.
            dist = tf.maximum(x2 - 2.0 * xy + y2, tf.zeros([], x.dtype))        # [.., N, M]
            if total.shape.rank == rank:                                         # keepdims=True
                dist = dist[..., None]                                           # [.., N, M, 1]
        graph_edit.replace_uses(total, dist)
        gradients.retarget(graph, total, dist)
        result.rewrote(ops, f"[{', '.join(map(str, x_shape[:-1]))}] x [{', '.join(map(str, y_shape[:-1]))}] "
                            f"distances over D = {dim} as a matmul" + (", one norm (a tensor against itself)"
                                                                       if same else ""), bytes_before=bytes_before,
                       bytes_after=n_pairs * item)
        return True
