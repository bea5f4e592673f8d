"""reduce_of_product: reductions of a matrix product that never build the product.

    sum(A @ B, -1)  =>  A @ sum(B, -1)        diag_part(A @ B)  =>  sum(A * Bᵀ, -1)

Letters: ``A @ B`` is ``[.., N, J] @ [.., J, M] -> [.., N, M]`` after its transpose (adjoint)
flags; ``J`` is the contracted dimension.  Every rule replaces the ``[.., N, M]`` product by
tensors of ``[.., N]``, ``[.., M]``, ``[.., J]`` or ``[.., N, J]`` size:

* linear reductions, ``Sum`` or ``Mean``, over the last, the second-to-last or both matrix axes,
  batch axes too, with or without ``keepdims``:

      sum(A @ B, -1)        =>  A @ sum(B, -1, keepdims)             [.., N, 1]
      sum(A @ B, -2)        =>  sum(A, -2, keepdims) @ B             [.., 1, M]   (1ᵀ A) B
      sum(A @ B, [-2, -1])  =>  sum(sum(A, -2) * sum(B, -1), -1)     [..]

  (``mean`` the same with means of ``A`` and ``B``; the sum over ``J`` stays a sum);
* ``diag_part(A @ B)`` (``MatrixDiagPart``, or ``MatrixDiagPartV2/V3`` with ``k = 0``; square
  product) => ``sum(A * Bᵀ, -1)``.  ``tf.linalg.trace(A @ B)`` is ``sum(diag_part(A @ B), -1)``,
  so it becomes ``sum(sum(A * Bᵀ, -1), -1)`` through this rule, its ``Sum`` left as it is;
* sums of squares (``Square``, ``Pow(., 2)`` or ``Mul(P, P)``) through Gram matrices, only with
  ``ReduceOfProduct(gram_forms=True)`` (see numerics):

      sum((A @ B)², [-2, -1])  =>  sum((AᵀA) * (B Bᵀ))               [.., J, J]
      sum((A @ B)², -1)        =>  sum((A @ (B Bᵀ)) * A, -1)          [.., N, J]
      sum((A @ B)², -2)        =>  sum(((AᵀA) @ B) * B, -2)           [.., J, M]

Transpose flags (``transpose_a/b`` of ``MatMul``, ``adj_x/y`` of ``BatchMatMul*``, the same for
real dtypes) are folded into the new ops' flags or reduction axes; a transpose is only built for
``diag_part`` with ``A @ B`` or ``Aᵀ @ Bᵀ`` (and counted).  Batch dimensions may broadcast as
``BatchMatMulV2`` broadcasts them.

When it applies (otherwise a "skipped" record says which condition failed):

* the product has no consumer but the reduction (a ``Square`` in between counts as part of the
  match): if anything else reads it, it is built anyway and nothing is saved;
* ``A``, ``B`` and the product share one floating dtype.  Integer reductions are left alone: the
  identities hold in modular arithmetic too, but a reordered integer sum overflows in other
  places, and a mean of integers truncates at each step, so results would differ;
* ``A`` and ``B`` have fully static shapes and the axes are constants;
* cost (a pure function of shapes: :func:`product_cost`, :func:`linear_cost`, :func:`diag_cost`,
  :func:`gram_cost`, decided by :func:`refusal`): the new intermediates, each counted as if
  materialised (an upper bound: XLA fuses some elementwise ones into their reductions), hold
  fewer elements than the product, and cost at most :data:`FLOP_SLACK` times its FLOPs.  The
  linear and diagonal rules always cost fewer FLOPs; they are refused when the product is already
  thin (``M = 1`` in ``sum(A @ B, -1)``; ``J >= N`` in ``diag_part``, ``J >= N / 2`` when a
  transpose is built).  The Gram rules need a small ``J``: ``3 J² < N M`` over both axes,
  ``J² + 2 N J < N M`` over one, and ``J (N + M) <= 2 N M`` or so for the FLOPs.

What XLA already does (TF 2.21, XLA:CPU, "Total bytes used" for [3000, 50] @ [50, 3000] float32):
a sum or mean of a dot over a non-contracted axis in the canonical layout is already fused into
one custom ``__ynn_fusion`` with no product buffer (1.2 MB before and after), so there the linear
rule saves nothing under XLA, and costs only ``[.., J]`` more.  It does matter without XLA (the
hook's ``rewrite_non_jit``: TensorFlow's kernels build the product, +583 MB peak RSS measured for
[12000, 50] @ [50, 12000]) and for layouts XLA does not fuse (``sum(Aᵀ @ B, -1)``: 37.2 MB ->
1.2 MB).  ``diag_part``/``trace`` (37.2 MB -> 1.8 MB) and the Gram forms (38.3 MB -> 1.8 MB) are
never fused by XLA.

Why it is safe, and what changes numerically:

* each identity is exact in real arithmetic; in floating point the summation order changes, so
  results differ in the last bits.  For the linear and diagonal rules the error bound has the
  original's form, a small multiple of ``eps * sum |A[n, j] B[j, m]|`` over the terms summed:
  both add up the same products, grouped differently;
* a NaN in ``A`` or ``B`` still reaches the affected outputs.  Infinities and overflow can differ:
  ``sum(B, -1)`` can overflow, or meet ``inf - inf``, where no single product entry did, and the
  reverse; ``0 * inf`` appears in both orders alike;
* the Gram rules square the condition of the computation: the original's relative error grows
  like ``eps * |A| |B| / |A @ B|``, the Gram form's like its square, so a product that is small
  next to its operands (nearly orthogonal rows and columns) loses accuracy, and the result, a sum
  of squares, can come out slightly negative: it is clamped at zero (``tf.maximum`` keeps NaN;
  its gradient at exactly zero goes to the sum, which is zero there).  For that reason these
  rules are off by default, per the house rule that numerics-changing switches start off;
* gradients flow through ``matmul``, ``reduce_sum``/``reduce_mean`` and ``transpose``.

GPflow (2.11, float64, SquaredExponential, 200 points, 20 inducing points; ``training_loss`` and
``predict_f`` traced with ``jit_compile=True`` and printed):

* ``SGPR`` training loss: ``trace_q = reduce_sum(diag_part(AAT))`` with
  ``AAT = A @ Aᵀ`` (``MatMul{transpose_b=true} f64[20,20]``, ``MatrixDiagPartV3 f64[20]``, ``Sum``)
  matches the diagonal rule but is not rewritten: ``AAT`` is also read by ``B = I + AAT``
  (``MatrixDiagPartV3`` + ``MatrixSetDiagV3`` -> ``Cholesky``), so it is built anyway; and it is
  [20, 20] while ``A * A`` would be [20, 200], so it would not be cheaper either;
* ``SGPR`` and ``GPR``: every ``reduce_sum(square(.))`` (``fvar`` in ``predict_f``, the data fit
  and ``c`` terms of the bound, ``Kdiag`` of the kernel) squares a ``MatrixTriangularSolve``
  output or an input, never a matmul; ``GPR``'s diagonals are those of ``K`` and of its Cholesky
  factor, not of products.  Nothing there is covered: a solve is not a product;
* ``SVGP`` (checked too): ``fvar += reduce_sum(square(Lᵀ @ A), -2)``
  (``BatchMatMulV2{adj_x=true} f64[1,20,200]``) matches the Gram rule over ``-2`` but is refused by
  the cost model: ``L`` is [20, 20], so ``(L Lᵀ) @ A`` is as large as ``Lᵀ @ A`` (8400 elements
  would replace 4000; in ``predict_f``, 2400 would replace 1000).

Not handled: a product read through ``Reshape``/``Transpose``/``Identity``; a mean of squares;
``sum(P * Y)`` with ``Y`` not the product itself (``sum(A * (Y Bᵀ))`` needs ``J < M``); non-square
``diag_part``; integer and complex dtypes; a solve instead of a product.

Pipeline position: after ``pairwise_distance`` and before the splitter, so the splitter never
has to chunk a product that is not needed.  It does not look at ops that tf_memsafe generated
(``tf_memsafe/`` name scope), so it is idempotent and leaves other passes' matmuls alone.  Its
motive is memory: the pipeline runs it only on a program over its limit and undoes it where XLA's
figure rises with it (:mod:`grappler_ext.guard`: XLA:CPU often fuses the reduction of a dot itself,
so the count above can promise bytes the program never held).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from grappler_ext import graph_edit
from grappler_ext.graph_query import live_ops
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pattern import Any, Const, OneOf, Op, is_floating, match, static_shape
from grappler_ext.pipeline import register_pass

__all__ = [
    "ReduceOfProduct", "Dims", "Cost", "FLOP_SLACK", "product_cost", "linear_cost", "diag_cost",
    "gram_cost", "refusal",
]

# The rewrite may spend at most this many times the FLOPs of the product it removes.
FLOP_SLACK = 2.0

_MATMUL_TYPES = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_DIAG_TYPES = ("MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3")
_SQUARE_TYPES = ("Square", "Pow", "Mul")

_a = Any("a", where=[is_floating(), static_shape()])
_b = Any("b", where=[is_floating(), static_shape()])
_product = Op("|".join(_MATMUL_TYPES), _a, _b, name="product", exclusive=True)
LINEAR = Op("Sum|Mean", _product, Const("axis"), name="total")
SQUARE = Op("Sum", OneOf(
    Op("Square", _product, exclusive=True),                   # tf.square(A @ B)
    Op("Pow", _product, Const(value=2), exclusive=True),      # (A @ B) ** 2
    Op("Mul", _product, _product, exclusive=True),            # P * P
), Const("axis"), name="total")
DIAG = OneOf(
    Op("MatrixDiagPart", _product, name="total"),
    Op("MatrixDiagPartV2|MatrixDiagPartV3", _product, Const("k", value=0), Any(), name="total"),
)


# --------------------------------------------------------------------------------------------
# Cost model: pure functions of shapes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dims:
    """``[.., N, J] @ [.., J, M]``: element counts of the batch dimensions of A, B and the product."""

    batch_a: int
    batch_b: int
    batch: int
    n: int
    j: int
    m: int


@dataclasses.dataclass(frozen=True)
class Cost:
    """Elements of the intermediates a form builds (its result excluded) and its FLOPs."""

    elements: int
    flops: int


def product_cost(d: Dims, squared: bool = False) -> Cost:
    """The original: the [.., N, M] product, then the (squaring and) reduction."""
    nm = d.batch * d.n * d.m
    return Cost(nm, 2 * nm * d.j + nm * (2 if squared else 1))


def linear_cost(d: Dims, over_n: bool, over_m: bool) -> Cost:
    """``A @ sum(B, -1)``, ``sum(A, -2) @ B`` or ``sum(sum(A, -2) * sum(B, -1))``."""
    a_red = Cost(d.batch_a * d.j, d.batch_a * d.n * d.j)              # sum(A, -2): [.., J]
    b_red = Cost(d.batch_b * d.j, d.batch_b * d.j * d.m)              # sum(B, -1): [.., J]
    if over_n and over_m:
        return Cost(a_red.elements + b_red.elements + d.batch * d.j, a_red.flops + b_red.flops + 2 * d.batch * d.j)
    if over_m:
        return Cost(b_red.elements + d.batch * d.n, b_red.flops + 2 * d.batch * d.n * d.j)
    return Cost(a_red.elements + d.batch * d.m, a_red.flops + 2 * d.batch * d.j * d.m)


def diag_cost(d: Dims, transposed: int) -> Cost:
    """``sum(A * Bᵀ, -1)``: the [.., N, J] elementwise product, plus ``transposed`` operand copies."""
    nj = d.batch * d.n * d.j
    copies = transposed * max(d.batch_a, d.batch_b) * d.n * d.j
    return Cost(nj + copies, 2 * nj + copies)


def gram_cost(d: Dims, over_n: bool, over_m: bool) -> Cost:
    """The Gram forms of ``sum((A @ B)², axes)`` (module docstring)."""
    jj = d.j * d.j
    gram_a = Cost(d.batch_a * jj, 2 * d.batch_a * d.n * jj)           # AᵀA: [.., J, J]
    gram_b = Cost(d.batch_b * jj, 2 * d.batch_b * d.m * jj)           # B Bᵀ: [.., J, J]
    if over_n and over_m:
        return Cost(gram_a.elements + gram_b.elements + d.batch * jj, gram_a.flops + gram_b.flops + 2 * d.batch * jj)
    if over_m:  # A @ (B Bᵀ), then times A: two [.., N, J]
        nj = d.batch * d.n * d.j
        return Cost(gram_b.elements + 2 * nj, gram_b.flops + 2 * nj * d.j + 2 * nj)
    jm = d.batch * d.j * d.m  # (AᵀA) @ B, then times B: two [.., J, M]
    return Cost(gram_a.elements + 2 * jm, gram_a.flops + 2 * jm * d.j + 2 * jm)


def refusal(before: Cost, after: Cost) -> str | None:
    """Why the new form is not cheaper, or ``None`` when the model proves it is."""
    if after.elements >= before.elements:
        return f"not cheaper: the new intermediates hold {after.elements} elements, the product {before.elements}"
    if after.flops > FLOP_SLACK * before.flops:
        return (f"{after.flops / before.flops:.1f}x the FLOPs of the product ({after.flops} vs {before.flops}), "
                f"more than {FLOP_SLACK:g}x")
    return None


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


def _flags(product: tf.Tensor) -> tuple[bool, bool]:
    """``(transpose_a, transpose_b)``; an adjoint is a transpose for the real dtypes matched."""
    op = product.op
    if op.type == "MatMul":
        return op.get_attr("transpose_a"), op.get_attr("transpose_b")
    return op.get_attr("adj_x"), op.get_attr("adj_y")


def _dims(a: tf.Tensor, b: tf.Tensor, product: tf.Tensor, ta: bool, tb: bool) -> Dims:
    sa, sb = a.shape.as_list(), b.shape.as_list()
    n, j = (sa[-1], sa[-2]) if ta else (sa[-2], sa[-1])
    m = sb[-2] if tb else sb[-1]
    return Dims(math.prod(sa[:-2]), math.prod(sb[:-2]), math.prod(product.shape.as_list()[:-2]), n, j, m)


def _product_read_by(op: tf.Operation) -> tf.Tensor | None:
    """The matmul output ``op`` reads, directly or through a square; ``None`` if it reads none.

    Only decides whether a failed match deserves a "skipped" record; the patterns do the matching.
    """
    if not op.inputs:
        return None
    first = op.inputs[0]
    if first.op.type in _MATMUL_TYPES:
        return first
    if first.op.type in _SQUARE_TYPES:
        return next((t for t in first.op.inputs if t.op.type in _MATMUL_TYPES), None)
    return None


def _bytes(t: tf.Tensor) -> int | None:
    return t.shape.num_elements() * t.dtype.size if t.shape.is_fully_defined() else None


def _shape_text(t: tf.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape.as_list())) + "]"


@register_pass
class ReduceOfProduct(GraphPass):
    """See the module docstring.  ``gram_forms=True`` enables the sum-of-squares rules."""

    name = "reduce_of_product"
    motive = Motive.MEMORY

    def __init__(self, gram_forms: bool = False):
        self.gram_forms = gram_forms

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)  # a reduction already rewritten is dead: never rewritten twice
        for op in list(graph.get_operations()):
            if op not in live or graph_edit.is_generated(op):
                continue
            product = _product_read_by(op)
            if product is None:
                continue
            if op.type in _DIAG_TYPES:
                kind, pattern = "diag", DIAG
            elif op.type in ("Sum", "Mean") and op.inputs[0] is product:
                kind, pattern = "linear", LINEAR
            elif op.type in ("Sum", "Mean"):
                kind, pattern = "square", SQUARE
            else:
                continue
            m = match(pattern, op.outputs[0])
            if not m:
                result.skip([op], f"not a reduction of a product: {m.reason}", bytes_before=_bytes(product))
                continue
            self._rewrite(graph, kind, m, result)
        return result

    def _rewrite(self, graph, kind: str, m, result: PassResult) -> None:
        product, total = m["product"], m["total"]
        ops = [o.name for o in m.ops]  # root first
        bytes_before = _bytes(product)
        plan = self._plan(kind, m)
        if isinstance(plan, str):
            result.skip(ops, plan, bytes_before=bytes_before)
            return
        build, text, elements_after = plan
        try:
            with graph_edit.building(graph, self.name):
                new = build()
        except (ValueError, TypeError) as e:  # unreachable new ops are inert: the graph is as it was
            result.skip(ops, f"could not build the replacement: {str(e).splitlines()[0]}", bytes_before=bytes_before)
            return
        if new.shape != total.shape or new.dtype != total.dtype:
            result.skip(ops, f"the replacement is {new.dtype.name}{new.shape}, not {total.dtype.name}{total.shape}",
                        bytes_before=bytes_before)
            return
        graph_edit.replace_uses(total, new)
        result.rewrote(ops, text, bytes_before=bytes_before, bytes_after=elements_after * product.dtype.size)

    def _plan(self, kind: str, m):
        """``(build, reason, elements after)`` for a match, or a one-line reason to leave it alone."""
        a, b, product, total = m["a"], m["b"], m["product"], m["total"]
        if not (a.dtype == b.dtype == product.dtype):
            return f"mixed dtypes {a.dtype.name} @ {b.dtype.name} -> {product.dtype.name}"
        ta, tb = _flags(product)
        d = _dims(a, b, product, ta, tb)
        if kind == "diag":
            if d.n != d.m:
                return f"diag_part of a non-square {_shape_text(product)} product"
            transposed = int(ta == tb)  # A @ B and Aᵀ @ Bᵀ need one operand transposed
            cost = diag_cost(d, transposed)
            reason = refusal(product_cost(d), cost)
            if reason:
                return reason
            return (lambda: self._diag(a, b, ta, tb), f"diag_part(A @ B) as sum(A * Bᵀ, -1): the "
                    f"{_shape_text(product)} product is never built", cost.elements)
        rank = product.shape.rank
        axes = sorted({int(v) % rank for v in m.const_values["axis"].reshape(-1)})
        over_n, over_m = rank - 2 in axes, rank - 1 in axes
        batch_axes = [x for x in axes if x < rank - 2]
        if not (over_n or over_m):
            return f"reduces over {axes or 'no axes'}, not over a matrix axis"
        squared = kind == "square"
        cost = gram_cost(d, over_n, over_m) if squared else linear_cost(d, over_n, over_m)
        reason = refusal(product_cost(d, squared), cost)
        if reason:
            return reason
        if squared and not self.gram_forms:
            saved = (d.batch * d.n * d.m - cost.elements) * product.dtype.size
            return (f"the Gram form would save {saved} bytes but loses accuracy when the product is small; "
                    "off unless gram_forms=True")
        mean = total.op.type == "Mean"
        reduce = tf.reduce_mean if mean else tf.reduce_sum

        def build():
            if squared:
                q = self._gram(a, b, ta, tb, over_n, over_m)
            else:
                q = self._linear(a, b, ta, tb, over_n, over_m, mean)
            if batch_axes:
                q = reduce(q, axis=batch_axes, keepdims=True)                # [.., 1, .., N|1, M|1]
            return q if q.shape == total.shape else tf.reshape(q, total.shape.as_list())  # its shape

        form = "sum((A @ B)²)" if squared else f"{total.op.type.lower()}(A @ B)"
        return build, (f"{form} over axes {axes} without the {_shape_text(product)} product "
                       f"(N={d.n}, J={d.j}, M={d.m})"), cost.elements

    @staticmethod
    def _linear(a, b, ta, tb, over_n, over_m, mean):
        """``reduce(A @ B)`` over the matrix axes asked for, those axes kept as size 1."""
        reduce = tf.reduce_mean if mean else tf.reduce_sum
        if over_n and over_m:
            # sum(A @ B, [-2, -1]) = sum(sum(A, -2) * sum(B, -1))
            u = reduce(a, axis=-1 if ta else -2)                             # [.., J]
            v = reduce(b, axis=-2 if tb else -1)                             # [.., J]
            return tf.reduce_sum(u * v, axis=-1)[..., None, None]            # [.., 1, 1]
        if over_m:
            # sum(A @ B, -1) = A @ sum(B, -1)
            v = reduce(b, axis=-2 if tb else -1, keepdims=True)              # [.., J, 1] or [.., 1, J]
            return tf.linalg.matmul(a, v, transpose_a=ta, transpose_b=tb)    # [.., N, 1]
        # sum(A @ B, -2) = sum(A, -2) @ B
        u = reduce(a, axis=-1 if ta else -2, keepdims=True)                  # [.., 1, J] or [.., J, 1]
        return tf.linalg.matmul(u, b, transpose_a=ta, transpose_b=tb)        # [.., 1, M]

    @staticmethod
    def _diag(a, b, ta, tb):
        """``diag_part(A @ B)``: sum over J of A[i, j] B[j, i], read in each operand's own layout."""
        t = tf.linalg.matrix_transpose
        if not ta and tb:
            # diag_part(A @ Bᵀ) = sum(A * B, -1)
            return tf.reduce_sum(a * b, axis=-1)                             # [.., N, J] -> [.., N]
        if ta and not tb:
            # diag_part(Aᵀ @ B) = sum(A * B, -2)
            return tf.reduce_sum(a * b, axis=-2)                             # [.., J, N] -> [.., N]
        if not ta:
            # diag_part(A @ B) = sum(A * Bᵀ, -1)
            return tf.reduce_sum(a * t(b), axis=-1)                          # [.., N, J] -> [.., N]
        # diag_part(Aᵀ @ Bᵀ) = sum(Aᵀ * B, -1)
        return tf.reduce_sum(t(a) * b, axis=-1)                              # [.., N, J] -> [.., N]

    @staticmethod
    def _gram(a, b, ta, tb, over_n, over_m):
        """``sum((A @ B)²)`` over the matrix axes asked for, those axes kept as size 1."""
        zero = tf.zeros([], a.dtype)
        if over_n and over_m:
            # sum((A @ B)²) = sum((AᵀA) * (B Bᵀ))
            gram_a = tf.linalg.matmul(a, a, transpose_a=not ta, transpose_b=ta)   # [.., J, J]
            gram_b = tf.linalg.matmul(b, b, transpose_a=tb, transpose_b=not tb)   # [.., J, J]
            q = tf.reduce_sum(gram_a * gram_b, axis=[-2, -1], keepdims=True)      # [.., 1, 1]
        elif over_m:
            # sum((A @ B)², -1) = sum((A @ (B Bᵀ)) * A, -1)
            gram_b = tf.linalg.matmul(b, b, transpose_a=tb, transpose_b=not tb)   # [.., J, J]
            if ta:  # A is [.., J, N]; B Bᵀ is symmetric
                q = tf.reduce_sum(tf.linalg.matmul(gram_b, a) * a, axis=-2)       # [.., N]
            else:
                q = tf.reduce_sum(tf.linalg.matmul(a, gram_b) * a, axis=-1)       # [.., N]
            q = q[..., :, None]                                                   # [.., N, 1]
        else:
            # sum((A @ B)², -2) = sum(((AᵀA) @ B) * B, -2)
            gram_a = tf.linalg.matmul(a, a, transpose_a=not ta, transpose_b=ta)   # [.., J, J]
            if tb:  # B is [.., M, J]; AᵀA is symmetric
                q = tf.reduce_sum(tf.linalg.matmul(b, gram_a) * b, axis=-1)       # [.., M]
            else:
                q = tf.reduce_sum(tf.linalg.matmul(gram_a, b) * b, axis=-2)       # [.., M]
            q = q[..., None, :]                                                   # [.., 1, M]
        # A sum of squares: cancellation can make it slightly negative.
        return tf.maximum(q, zero)
