"""unrolled_reduction: a float32 sum over a short innermost axis as a sum of its slices.

    sum(f(a, b, ..), -1)   with a: [.., 1, D], b: [1, .., D]   =>   f(a_0, b_0, ..) + .. + f(a_{D-1}, b_{D-1}, ..)

where ``f`` is elementwise, ``D <= 32``, and ``a_j = unstack(a, -1)[j]`` (an operand with 1 there is
squeezed and read in every term).  ``mean`` is the same sum divided by ``D``.

Why: XLA:CPU (TF 2.21) hands a float32 or bfloat16 ``Sum``/``Mean`` whose operand is not a multiply
to YNNPACK, which reads that operand from memory (:data:`grappler_ext.xla_facts.YNN_REDUCTIONS`): the
[N, M, D] broadcast of an L1 distance ``sum(abs(x[:, None] - y[None]), -1)`` is materialised, D times
the [N, M] result, and reduced 3-8 elements at a time.  The slices' sum is one loop fusion over
[N, M] that XLA vectorises.  Measured on TF 2.21 XLA:CPU, 2 cores (median of 5 calls, N = 2000,
M = 20000): ``abs`` of the difference at D = 3: 0.21x the time, D = 10: 0.21x, D = 16: 0.50x, D = 32:
0.42x; ``exp(-(a - b)^2)``: 0.36-0.39x; ``maximum(a - b, 0)``: 0.22x; XLA's buffers 640 MB -> 160 MB at
D = 3.  A multiply operand (``Square``, ``Mul``, ``SquaredDifference``, small integer powers) is not
YNNPACK's, XLA fuses it already, and the slices are no faster (1.00-1.02x, measured): left alone, as
are float64 and integer sums (XLA's own loop reduction, fused: 1.00x for float64 ``abs``).  This is
the brute-force kNN search's L1 metric in ``experiments/knn.py``.

When it applies (records say why not):

* ``Sum`` or ``Mean`` of float32 or bfloat16 over exactly the innermost axis, a constant, of static
  length 2 to 32 (longer axes would make a long chain of terms);
* its operand computed by elementwise ops (:data:`grappler_ext.op_types.UNARY_ELEMENTWISE`,
  :data:`~grappler_ext.op_types.BROADCASTING_ELEMENTWISE`) read by nothing else, the last of them not a
  multiply (the fact above);
* the operands those ops start from (the leaves) carry the axis with length ``D`` or 1 (or not at
  all: scalars and lower ranks broadcast), and together hold at most half the operand's bytes: the
  operand is a broadcast, so that no large tensor is read D times in strides;
* a result of at least ``MIN_ELEMENTS`` elements (below that there is nothing to measure).

Records: a sum with the pattern that is refused (a small result, an operand read elsewhere) is
recorded with the reason; sums without it (float64, long axes, multiplies, no broadcast: every
LayerNorm's mean) are not.

Why it is safe: each term computes exactly the elements the operand holds at that index, with the
same ops, so the terms are bit-identical to the operand's slices; the sum adds them left to right,
where XLA's reduction may associate them otherwise: results agree to rounding (a few ulps at D = 10,
measured 1.4e-6 relative at float32; bit-identical at D = 3 in the measurement).  NaN and infinities
propagate alike.  Gradients: the terms are ordinary differentiable ops (a tape outside the function
differentiates them); where a gradient recorded inside the function reads the operand's ops (the
derivative of ``abs`` reads the difference), the [.., D] tensors exist anyway: left alone.

Pipeline position: before the splitter, after ``pairwise_distance`` (which takes the squared
distances of more than 32 dimensions into a matmul; the squared ones here are a multiply and left
alone): the splitter then slices [N, M] sums of terms along either axis, and its chunk sizes count
no [N, M, D] operand.  It fires whether or not the program fits: it is faster and holds fewer bytes.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import gradients, graph_edit
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.memory_rules import is_multiply
from grappler_ext.op_types import BROADCASTING_ELEMENTWISE, UNARY_ELEMENTWISE, nbytes
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import register_pass
from grappler_ext.xla_facts import FUSED_REDUCTION_MAX, YNN_DTYPES

__all__ = ["UnrolledReduction", "MIN_ELEMENTS", "Expression", "expression"]

MIN_ELEMENTS = 1 << 16
_ELEMENTWISE = (UNARY_ELEMENTWISE | BROADCASTING_ELEMENTWISE) - {"ZerosLike", "OnesLike"}


@dataclasses.dataclass(frozen=True)
class Expression:
    """The elementwise ops an innermost reduction reads (``ops``, in a topological order, the last one
    computing its operand) and the tensors they start from (``leaves``)."""

    ops: list[tf.Operation]
    leaves: list[tf.Tensor]


def expression(x: tf.Tensor, reader: tf.Operation) -> Expression | str | None:
    """The elementwise expression computing ``x`` (read only by ``reader``); ``None`` where the
    tensors it starts from do not all carry the innermost axis (length D or 1); why it cannot be
    unrolled where an op of it is read elsewhere too."""
    rank, depth = x.shape.rank, x.shape[-1]
    found: dict[tf.Operation, None] = {}          # in the order found; sorted below
    leaves: dict = {}
    stack = [x]
    while stack:
        t = stack.pop()
        op = t.op
        if (op.type in _ELEMENTWISE and len(op.outputs) == 1 and t.shape.rank == rank and t.shape[-1] == depth
                and not op.control_inputs):
            if op not in found:
                found[op] = None
                stack.extend(op.inputs)
            continue
        if t.shape.rank is None or (t.shape.rank and t.shape[-1] not in (1, depth)):
            return None
        leaves[t.ref()] = t
    inside = set(found) | {reader}
    for op in found:
        outside = [c for c in op.outputs[0].consumers() if c not in inside]
        if outside:
            return (f"`{op.name}` is read outside the sum too (by `{outside[0].name}`): its [.., {depth}] tensor "
                    "exists anyway")
    # (creation order is not topological once an earlier pass has rewired inputs)
    return Expression(topological_order(x.graph, found), list(leaves.values()))


def _refusal(op: tf.Operation) -> str | tuple[Expression, int] | None:
    """``(expression, D)`` for a reduction this pass unrolls; why not, for one that has the pattern
    (a broadcast elementwise operand YNNPACK would read) but is refused; ``None`` for the rest, which
    are not recorded (every LayerNorm's mean would be)."""
    x = op.inputs[0]
    rank = x.shape.rank
    if rank is None or rank < 2 or x.dtype.base_dtype not in YNN_DTYPES:
        return None
    axes = tensor_util.constant_value(op.inputs[1])
    if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) % rank != rank - 1:
        return None
    depth = x.shape[-1]
    if depth is None or not 2 <= depth <= FUSED_REDUCTION_MAX or is_multiply(x.op):
        return None             # a multiply: XLA fuses it into its own reduction already
    found = expression(x, op)
    if found is None or (isinstance(found, Expression) and (
            not found.ops or 2 * sum(nbytes(t) for t in found.leaves) > nbytes(x))):
        return None             # not a broadcast: the operand's inputs are as large as it
    out = op.outputs[0]
    if not out.shape.is_fully_defined() or out.shape.num_elements() < MIN_ELEMENTS:
        return f"a result of {out.shape}: under {MIN_ELEMENTS:,} elements, nothing to gain"
    return found if isinstance(found, str) else (found, depth)


def _terms(found: Expression, depth: int) -> list[tf.Tensor]:
    """The expression computed once per index of the innermost axis."""
    columns = {}
    for leaf in found.leaves:
        if leaf.shape.rank == 0:
            columns[leaf.ref()] = [leaf] * depth
        elif leaf.shape[-1] == 1:
            columns[leaf.ref()] = [tf.squeeze(leaf, -1)] * depth
        else:
            columns[leaf.ref()] = tf.unstack(leaf, axis=-1)
    terms = []
    for j in range(depth):
        env = {ref: cols[j] for ref, cols in columns.items()}
        for op in found.ops:
            env[op.outputs[0].ref()] = graph_edit.clone_op(op, [env[t.ref()] for t in op.inputs])[0]
        terms.append(env[found.ops[-1].outputs[0].ref()])
    return terms


@register_pass
class UnrolledReduction(GraphPass):
    name = "unrolled_reduction"
    motive = Motive.TIME

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)
        backward = gradients.backward_ops(graph)
        for op in list(graph.get_operations()):
            if (op.type not in ("Sum", "Mean") or op not in live or op in backward
                    or graph_edit.is_generated(op)):
                continue
            found = _refusal(op)
            if found is None:
                continue
            if isinstance(found, str):
                result.skip([op], f"a sum over its innermost axis left as it is: {found}",
                            bytes_before=nbytes(op.inputs[0]))
                continue
            self._rewrite(graph, op, *found, result)
        return result

    def _rewrite(self, graph, op: tf.Operation, found: Expression, depth: int, result: PassResult) -> None:
        out = op.outputs[0]
        with graph_edit.building(graph, self.name):
            terms = _terms(found, depth)
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            if op.type == "Mean":
                total = total / tf.constant(depth, total.dtype)
            if op.get_attr("keep_dims"):
                total = tf.expand_dims(total, -1)
            total.set_shape(out.shape)
        graph_edit.replace_uses(out, total)
        gradients.retarget(graph, out, total)
        x = op.inputs[0]
        result.rewrote([op.name] + [o.name for o in found.ops],
                       f"{op.type.lower()} of {x.dtype.name}{x.shape.as_list()} over its innermost {depth} as "
                       f"{depth} slices of `{x.op.type}` added: one fused loop, where YNNPACK would read the "
                       "operand from memory", bytes_before=nbytes(x), bytes_after=nbytes(out))
