"""matrix_chain: re-associate a chain of matrix products into the order with the fewest FLOPs.

    (A B) v  =>  A (B v)      A: [N, D], B: [D, N], v: [N, 1]: the [N, N] intermediate becomes [D, 1]

A chain is a tree of products whose interior products feed only their parent: ``(K @ K) @ v``,
``a @ b @ c @ d``, ``tf.matmul(tf.matmul(a, b, transpose_a=True), c)``.  The pass flattens it into
factors ``op(X0) op(X1) ... op(X(n-1))`` (``op`` a transpose or not), asks the cost model
:func:`grappler_ext.chain_order.choose_order` for a better order, builds it with
``tf.linalg.matmul`` and rewires the chain's consumers to the new result.

When it applies:

* products spelled ``MatMul``, ``BatchMatMul``, ``BatchMatMulV2`` or ``BatchMatMulV3`` (input and
  output dtypes equal), and ``Einsum`` with two operands that is a (batch) product of matrices and
  vectors (:func:`einsum_form`): a plain matmul (``ij,jk->ik``, ``bij,bkj->bik``,
  ``...ji,...jk->...ik``), a matrix-vector or vector-matrix product (``ij,j->i``, ``ji,j->i``,
  ``j,jk->k``, ``bij,bj->bi``) or a dot product (``i,i->``).  A vector is read as a column
  ``[.., J, 1]`` (a row where it enters transposed), so ``(A B) v`` spelled with einsums is the
  same chain as with matmuls.  Any other ``Einsum`` is not guessed at: it ends the chain, and a
  chain stopped by it says so;
* transposes are folded through: ``transpose_a``/``transpose_b`` and ``adj_x``/``adj_y`` mark a
  factor transposed, so does a ``Transpose`` op that swaps the last two axes (``tf.transpose(A)``,
  ``tf.linalg.matrix_transpose``) between products or on a factor, and a transposed interior
  product is ``(X Y)^T = Y^T X^T``, its factors reversed and each transposed.  The new products
  carry the leaves' flags, so no ``Transpose`` op is ever built;
* real floating dtypes only (half, bfloat16, float32, float64).  Complex chains are refused:
  ``adj_x`` conjugates and ``MatMul``'s ``transpose_a`` does not, and a reversed interior would
  need conjugates the pass does not build.  Integer chains are refused: reassociation would be
  exact in wrapping arithmetic, but signed overflow in an intermediate is not defined behaviour in
  the kernels;
* every factor has a fully known static shape and the same batch dimensions (no broadcasting);
* every interior product has exactly one reader, its parent: a product with another consumer, a
  graph output, a control dependency or control inputs of its own ends the chain there (breaking
  it would compute that product twice).  A gradient taken inside the same ``tf.function`` reads
  forward intermediates, so it cuts the forward chain at each one it reads (differentiate outside
  the function to keep the chain whole); the backward products form chains of their own, which
  the pass treats like any other (``(dy c^T) B^T  =>  dy (c^T B^T)``).  Rebuilt products drop
  ``MatMul``'s ``grad_a``/``grad_b`` hints, which do not change values;
* the cost model proves a FLOP gain of at least ``FLOP_MARGIN`` (1.5x) without a larger largest
  intermediate (the rule in :mod:`grappler_ext.chain_order`).  Otherwise the record says "already
  optimal order", which cheaper order was refused for its intermediate, or that the gain is below
  the margin.

Why it is safe, and what changes numerically:

* matrix products are associative in real arithmetic, so the value is the same; in floating point
  each entry becomes a different sum of products and rounds differently.  Both orders obey the
  same componentwise error bound (a small multiple of ``eps |A| |B| |C|``), so the change is at
  the level of rounding, not bitwise;
* an ``inf`` in a factor may give ``nan`` in one order and ``inf`` in the other (where ``0 * inf``
  happens depends on the order); a ``nan`` still propagates to the entries it touched in either;
* gradients are taken of the new products; they equal the old ones up to the same rounding.

What it does not handle: matrix-vector chains through ``tf.linalg.matvec`` (an ``ExpandDims`` and a
``Squeeze`` sit between the products), products through ``Reshape`` (Keras ``Dense`` on rank-3
inputs), a ``Transpose`` that moves batch axes, triangular solves, complex dtypes, broadcast batches.

Pipeline position: before the splitter, which must not chunk an ``[N, N]`` intermediate this pass
removes.  Independent of ``pairwise_distance`` (its generated ``MatMul`` is a leaf here, as is
every op under the generated name scope, which also makes the pass idempotent).  XLA does not
re-associate dots itself on CPU (measured on TF 2.21: ``(A B) v`` at N = 2000, D = 10 compiles to
16 MB, ``A (B v)`` to 176 kB).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import tensorflow as tf

from grappler_ext import folding, graph_edit
from grappler_ext.chain_order import Tree, choose_order
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pattern import Any, Op, match
from grappler_ext.pipeline import register_pass

__all__ = ["MatrixChain", "PRODUCT_TYPES", "EinsumForm", "einsum_form", "einsum_transposes"]

# Op type -> the attributes saying whether operand 0 and operand 1 enter transposed.
PRODUCT_TYPES: dict[str, tuple[str, str] | None] = {
    "MatMul": ("transpose_a", "transpose_b"),
    "BatchMatMul": ("adj_x", "adj_y"),
    "BatchMatMulV2": ("adj_x", "adj_y"),
    "BatchMatMulV3": ("adj_x", "adj_y"),
    "Einsum": None,  # flags from the equation, see einsum_transposes
}

# One product node; a chain has any depth, so the pass walks it node by node with this pattern.
_PRODUCT = Op("|".join(PRODUCT_TYPES), Any("x"), Any("y"), name="product")



@dataclasses.dataclass(frozen=True)
class EinsumForm:
    """A two-operand ``Einsum`` read as the product ``op(F0) op(F1)`` of matrices and column vectors.

    ``swap``: ``F0`` is the equation's second operand (``j,jk->k`` is ``Yᵀ x``); ``transposed``: the
    flags of ``F0`` and ``F1``; ``vector``: which of ``F0``, ``F1`` is a vector (read as a column
    ``[.., J, 1]``, a row where transposed); ``out``: ``"matrix"``, ``"vector"`` (the product's
    ``[.., I, 1]`` without its unit axis) or ``"scalar"`` (a dot product's ``[.., 1, 1]``).
    """

    swap: bool
    transposed: tuple[bool, bool]
    vector: tuple[bool, bool]
    out: str


def einsum_form(equation: str) -> EinsumForm | None:
    """How a two-operand ``equation`` is a product of matrices and vectors, else None.

    Batch letters (or a leading ``...``) must be the same prefix of all three terms; after them
    each operand has one letter (a vector) or two (a matrix), exactly one letter ``j`` is shared by
    the operands and absent from the output, and the output keeps the other letters in operand
    order: ``ij,jk->ik``, ``ij,j->i``, ``j,jk->k``, ``i,i->``.
    """
    eq = equation.replace(" ", "")
    if eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        return None
    x, y = operands
    # A leading ellipsis in all three is a batch prefix; anywhere else it is not a product.
    if x.startswith("...") and y.startswith("...") and out.startswith("..."):
        x, y, out = x[3:], y[3:], out[3:]
    if not all(s.isalpha() or not s for s in (x, y, out)):
        return None
    if any(len(set(s)) != len(s) for s in (x, y, out)):
        return None  # a repeated letter is a trace or a diagonal
    for bx in range(len(x) + 1):
        batch = x[:bx]
        xc, yc = x[bx:], y[bx:]
        if not (1 <= len(xc) <= 2 and 1 <= len(yc) <= 2 and y[:bx] == batch and out[:bx] == batch):
            continue
        oc = out[bx:]
        shared = set(xc) & set(yc)
        if len(shared) != 1 or set(batch) & (set(xc) | set(yc) | set(oc)):
            continue
        (j,) = shared
        free_x, free_y = [c for c in xc if c != j], [c for c in yc if c != j]
        if j in oc or oc != "".join(free_x + free_y):
            continue
        tx, ty = len(xc) == 2 and xc[0] == j, len(yc) == 2 and yc[1] == j
        if len(xc) == 2 and len(yc) == 2:                    # [.., i, j] [.., j, k]
            return EinsumForm(False, (tx, ty), (False, False), "matrix")
        if len(xc) == 2:                                     # [.., i, j] [.., j]: op(X) y
            return EinsumForm(False, (tx, False), (False, True), "vector")
        if len(yc) == 2:                                     # [.., j] [.., j, k]: (xᵀ op(Y))ᵀ = op(Y)ᵀ x
            return EinsumForm(True, (yc[0] == j, False), (False, True), "vector")
        return EinsumForm(False, (True, False), (True, True), "scalar")   # [.., j] [.., j]: xᵀ y
    return None


def einsum_transposes(equation: str) -> tuple[bool, bool] | None:
    """``(transpose_x, transpose_y)`` if ``equation`` is a plain (batch) matmul, else None: the
    matrix-by-matrix case of :func:`einsum_form`, whose output keeps ``i`` then ``k``."""
    form = einsum_form(equation)
    if form is None or form.out != "matrix":
        return None
    return form.transposed


@dataclasses.dataclass(frozen=True)
class _Product:
    """``op(x) op(y)``: one product op of a chain, with its operands' transpose flags."""

    op: tf.Operation
    x: tf.Tensor
    y: tf.Tensor
    transpose_x: bool
    transpose_y: bool
    vector_x: bool = False          # read as a column [.., J, 1] (an Einsum's vector operand)
    vector_y: bool = False
    out: str = "matrix"             # "vector" / "scalar": the [.., I, 1] / [.., 1, 1] product, unit axes dropped


def _as_product(op: tf.Operation) -> _Product | str | None:
    """The product ``op`` computes; a reason string if it is a product this pass will not read;
    None if it is no product at all."""
    if op.type not in PRODUCT_TYPES or len(op.outputs) != 1:
        return None
    m = match(_PRODUCT, op.outputs[0])
    if not m:
        return f"`{op.name}` ({op.type}) is not a two-operand product: {m.reason}"
    x, y, out = m["x"], m["y"], m["product"]
    if not x.dtype == y.dtype == out.dtype:
        return f"`{op.name}` ({op.type}) mixes dtypes {x.dtype.name}, {y.dtype.name} -> {out.dtype.name}"
    attrs = PRODUCT_TYPES[op.type]
    if attrs is None:
        equation = op.get_attr("equation")
        equation = equation.decode() if isinstance(equation, bytes) else equation
        form = einsum_form(equation)
        if form is None:
            return f"`{op.name}` (Einsum '{equation}') is not a product of matrices and vectors"
        if form.swap:
            x, y = y, x
        return _Product(op, x, y, *form.transposed, *form.vector, form.out)
    return _Product(op, x, y, bool(op.get_attr(attrs[0])), bool(op.get_attr(attrs[1])))


@dataclasses.dataclass
class _Chain:
    """A flattened chain: ``leaves[0] @ ... @ leaves[n-1]`` in the order ``tree``."""

    root: _Product
    ops: list[tf.Operation] = dataclasses.field(default_factory=list)  # root first
    # (tensor, transposed, vector): a vector is read as a column [.., J, 1], a row if transposed.
    leaves: list[tuple[tf.Tensor, bool, bool]] = dataclasses.field(default_factory=list)
    cuts: list[str] = dataclasses.field(default_factory=list)  # why the chain stops where it does
    tree: Tree = 0


class _Uses:
    """Who reads what among the live ops, taken once before any edit."""

    def __init__(self, graph, live: set[tf.Operation]):
        self.readers = collections.Counter(t.ref() for op in live for t in op.inputs)
        self.outputs = {t.ref() for t in getattr(graph, "outputs", []) if t is not None}
        self.control_sources = {c for op in live for c in op.control_inputs}

    def why_not_interior(self, t: tf.Tensor) -> str | None:
        """Why the product ``t`` cannot be an interior product of its reader's chain, or None."""
        op = t.op
        if t.ref() in self.outputs:
            return f"interior product `{op.name}` is a graph output"
        if self.readers[t.ref()] > 1:
            return f"interior product `{op.name}` has another consumer"
        if op in self.control_sources:
            return f"interior product `{op.name}` is a control dependency"
        if op.control_inputs:
            return f"interior product `{op.name}` has control inputs"
        return None


@register_pass
class MatrixChain(GraphPass):
    name = "matrix_chain"
    motive = Motive.FLOPS

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)  # a chain already rewritten is dead: never rewritten twice
        uses = _Uses(graph, live)
        # Consumers before producers: a chain's root is met before its interior products, which
        # the root's walk claims.
        claimed: set[tf.Operation] = set()
        chains: list[_Chain] = []
        for op in reversed(topological_order(graph, live)):
            if op in claimed or graph_edit.is_generated(op):
                continue
            product = _as_product(op)
            if isinstance(product, str) and any(_as_product(t.op) is not None for t in op.inputs):
                # A product we do not read (an unusual Einsum) on top of a product: say why we stop.
                result.skip([op], f"{product}: not re-associated with the products it reads")
            if not isinstance(product, _Product):
                continue
            chain = _Chain(product)
            chain.tree = self._walk(product, False, chain, uses)
            claimed.update(chain.ops)
            chains.append(chain)
        # Analyse every chain before building anything; producers first from here on.
        planned = [(c, d) for c in reversed(chains) if (d := self._plan(c, result)) is not None]
        # Build every new chain, then rewire.  A leaf that is an earlier chain's root is read by the
        # new ops as it was by the old ones, and moves to that root's replacement with them.
        built = []
        for chain, decision in planned:
            with graph_edit.building(graph, self.name):
                built.append(self._build(decision.best.tree, chain))
        for (chain, decision), new in zip(planned, built):
            graph_edit.replace_uses(chain.root.op.outputs[0], new)
            result.rewrote(chain.ops, f"{len(chain.leaves)}-factor chain over {list(decision.current.dims)}"
                                      f"{_batch_text(chain)}: {decision.reason}",
                           bytes_before=decision.current.peak_intermediate_bytes,
                           bytes_after=decision.best.peak_intermediate_bytes)
        return result

    def _walk(self, product: _Product, transposed: bool, chain: _Chain, uses: _Uses) -> Tree:
        """Flatten ``product`` (transposed if ``transposed``) into ``chain``; its order as a tree."""
        chain.ops.append(product.op)
        # op(X) op(Y) as it stands; (op(X) op(Y))^T = op(Y)^T op(X)^T, and op(Y)^T flips Y's flag.
        x, y = (product.x, product.transpose_x, product.vector_x), (product.y, product.transpose_y, product.vector_y)
        operands = [x, y]
        if transposed:
            operands = [(y[0], not y[1], y[2]), (x[0], not x[1], x[2])]
        trees = []
        for t, t_transposed, vector in operands:
            t, t_transposed, through = _through_transposes(t, t_transposed, vector)
            sub = None if graph_edit.is_generated(t.op) else _as_product(t.op)
            why = sub
            if isinstance(sub, _Product):
                # An interior product is read as its parent reads it: a vector in a vector's place.
                why = next((w for w in map(uses.why_not_interior, [t] + [o.outputs[0] for o in through]) if w),
                           None)
                if why is None and (sub.out == "scalar" or (sub.out == "vector") != vector):
                    why = f"`{sub.op.name}` is a {sub.out} product read as a {'vector' if vector else 'matrix'}"
            if isinstance(sub, _Product) and why is None:
                chain.ops.extend(through)
                trees.append(self._walk(sub, t_transposed, chain, uses))
                continue
            if why:
                chain.cuts.append(why)
            chain.leaves.append((t, t_transposed, vector))
            trees.append(len(chain.leaves) - 1)
        return trees[0], trees[1]

    def _plan(self, chain: _Chain, result: PassResult):
        """The cost model's decision for ``chain`` if it is to be rewritten; else a skip record."""
        ops, n = chain.ops, len(chain.leaves)
        cut = f"; the chain stops there: {'; '.join(chain.cuts)}" if chain.cuts else ""
        # Two factors have one order: nothing to say unless a longer chain was cut short.
        if n < 3:
            if chain.cuts:
                result.skip(ops, f"{'; '.join(chain.cuts)}: the chain stops there, leaving {n} factors")
            return None
        dtype = chain.root.op.outputs[0].dtype
        # Complex: adj_x conjugates and MatMul's transpose_a does not; not guessed at.
        if dtype.is_complex:
            result.skip(ops, f"{dtype.name} chain: adjoint is a conjugate transpose, complex chains are not handled")
            return None
        # Integers: signed overflow of an intermediate is undefined in the kernels.
        if not dtype.is_floating:
            result.skip(ops, f"{dtype.name} chain: only floating dtypes are re-associated")
            return None
        shapes = [_view(t, vector) for t, _, vector in chain.leaves]
        for (t, _, _), shape in zip(chain.leaves, shapes):
            if not shape.is_fully_defined():
                result.skip(ops, f"dynamic shape: factor `{t.name}` is {shape}")
                return None
        # [B.., m, k] x [B'.., k, n] with B != B' broadcasts: one batch for all factors, or refuse.
        batch = shapes[0].as_list()[:-2]
        if any(s.rank != shapes[0].rank or s.as_list()[:-2] != batch for s in shapes):
            result.skip(ops, "batch dimensions differ between factors (broadcast): "
                             f"{', '.join(str(s) for s in shapes)}")
            return None
        # Factor i is op(X_i): [B.., rows_i, cols_i], transposed or not.
        mats = [(s[-1], s[-2]) if tr else (s[-2], s[-1]) for s, (_, tr, _) in zip(shapes, chain.leaves)]
        dims = [mats[0][0]] + [cols for _, cols in mats]
        if any(mats[i][1] != mats[i + 1][0] for i in range(n - 1)):
            result.skip(ops, f"inner dimensions of the factors disagree: {mats}")
            return None
        decision = choose_order(dims, chain.tree, batch=math.prod(batch), itemsize=dtype.size)
        if not decision.reorder:
            result.skip(ops, f"{n}-factor chain over {dims}{_batch_text(chain)}: {decision.reason}{cut}",
                        bytes_before=decision.current.peak_intermediate_bytes)
            return None
        return decision

    @staticmethod
    def _build(tree: Tree, chain: _Chain) -> tf.Tensor:
        """``tree`` over the chain's factors as ``tf.linalg.matmul`` ops, flags folded in."""

        def build(t: Tree) -> tuple[tf.Tensor, bool]:
            if isinstance(t, int):
                leaf, transposed, vector = chain.leaves[t]
                if vector:
                    leaf = tf.expand_dims(leaf, -1)                  # the column [B.., J, 1]
                return leaf, transposed                              # op(X_t): [B.., d_t, d_t+1]
            (a, ta), (b, tb) = build(t[0]), build(t[1])
            # op(a) op(b): [B.., d_i, d_k+1] x [B.., d_k+1, d_j+1] => [B.., d_i, d_j+1]
            return tf.linalg.matmul(a, b, transpose_a=ta, transpose_b=tb), False

        out, _ = build(tree)
        if chain.root.out != "matrix":
            # [B.., I, 1] or [B.., 1, 1]: the unit axes the vector or dot product drops.
            out = tf.reshape(out, chain.root.op.outputs[0].shape)
        return out


def _view(t: tf.Tensor, vector: bool) -> tf.TensorShape:
    """``t``'s shape as a factor's: a vector ``[B.., J]`` as its column ``[B.., J, 1]``."""
    return t.shape.concatenate([1]) if vector else t.shape


def _through_transposes(t: tf.Tensor, transposed: bool, vector: bool):
    """``(source, transposed, ops)``: ``t`` read through the ``Transpose`` ops that swap its last two
    axes (``tf.transpose`` of a matrix, ``tf.linalg.matrix_transpose``), each flipping the flag."""
    through = []
    while not vector and t.op.type == "Transpose" and t.shape.rank is not None and t.shape.rank >= 2:
        perm = folding.static_value(t.op.inputs[1])
        rank = t.shape.rank
        if perm is None or list(perm) != list(range(rank - 2)) + [rank - 1, rank - 2]:
            break
        through.append(t.op)
        t, transposed = t.op.inputs[0], not transposed
    return t, transposed, through


def _batch_text(chain: _Chain) -> str:
    t, _, vector = chain.leaves[0]
    batch = _view(t, vector).as_list()[:-2]
    return f" x batch {batch}" if batch else ""
