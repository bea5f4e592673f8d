"""blocked_linalg: a large Cholesky factor and a large triangular solve computed a block at a time, in place.

    L = cholesky(A)        A: [n, n]   =>   M = A; for each block J of b columns, in order:
                                              S = M[:, J] - M mask(M[J, :])ᵀ      (columns left of J: L's)
                                              L_JJ = cholesky(S[J]);  M[:, J] = rows below J of S L_JJ⁻ᵀ,
                                                                              L_JJ on J, 0 above
    X = solve(T, B)        T = L or Lᵀ     =>   X = B; for each block J of b rows (from the top where T is
                                              lower, from the bottom where it is upper):
                                              X[J] = solve(T[J, J], B[J] - mask(T[J, :]) X)

Why: XLA expands ``Cholesky`` and ``TriangularSolve`` into blocked algorithms of its own that hold
several [n, n] buffers (measured on TF 2.21 XLA:CPU, float64, n = 2000: the factor of a kernel
matrix computed in the function holds 2.4 n² doubles; a solve against it inside a loop over the
right-hand side's columns holds two masked copies of the factor and slices of it, about 1.75 n² more,
hoisted out of the loop as invariant).  The loops here keep one [n, n] buffer: the factor is written
into the matrix's own buffer (XLA updates a loop-carried buffer in place, and the matrix, read only by
the factorisation, is handed to the loop), and a solve reads its matrix a panel of b rows (or columns)
at a time, sliced at the loop's index, which XLA cannot hoist.  GPflow's GPR ``predict_f`` at
n = 20000 (a 3.2 GB factor) is the case (issue 29): its limit is 1.8 n² doubles.

Exactness: the same operations as the unblocked algorithms, grouped by blocks (left-looking
Cholesky; block forward and back substitution), so the results agree to rounding.  The masked panel
products multiply the not-yet-computed part of the buffer (the matrix's own entries, or the
right-hand side's rows) by zeros: an ``inf`` or ``NaN`` there would reach entries the unblocked
algorithm keeps finite (a matrix with them has no Cholesky factor anyway).  Only the lower triangle
of the Cholesky's input is read, as ``tf.linalg.cholesky`` reads it, and only the triangle the solve
names; the factor's strict upper triangle is zero.  The cost: the Cholesky's panel products run over
all n columns (the zeros included), about 3x the unblocked FLOPs; a solve's about 2x.  So the pass is
for programs over their limit only (its motive is memory: :mod:`grappler_ext.guard` runs it only
there and undoes it where XLA's figure rises).

When it applies (:func:`refusal` says why not): a ``Cholesky`` or ``MatrixTriangularSolve`` of one
matrix (rank 2, static order ``n >= MIN_ORDER``; batches and ``MatrixSolve`` are left), real floats.
A solve's matrix read through a ``Transpose`` or an ``adjoint`` (GPflow's ``Lᵀ``) is read untransposed
with ``adjoint`` and ``lower`` flipped, and a ``BroadcastTo`` of its own shape is looked through.

Gradients: a gradient recorded in the function reads the op's output, which the loop now gives.  A
solve built by the splitter inside a loop it will differentiate (:func:`rebuilt_solve`) carries
TensorFlow's own gradient formula (``grad_B = solve(T, dX, adjoint)``, ``grad_T = -grad_B Xᵀ`` on
the triangle), its solves blocked too.

The splitter uses :func:`rebuilt_solve` for each slice's solve where it splits a solve along the
right-hand side's columns (the factor read whole by every slice).  Pipeline position: after the
splitter (which must see the ``Cholesky`` and the solves, whose rules it has), before
``blocked_top_k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from grappler_ext import gradients, graph_edit
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.op_types import BROADCASTING_ELEMENTWISE, UNARY_ELEMENTWISE, nbytes
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import register_pass

__all__ = ["BlockedLinalg", "BLOCK", "MIN_ORDER", "cholesky", "triangular_solve", "refusal", "rebuilt_solve"]

BLOCK = 256
MIN_ORDER = 1024           # below this, XLA's own expansion holds little (8 MB of float64 at 1024)
_FLOATS = (tf.float32, tf.float64)


def refusal(op: tf.Operation, inputs: Sequence[tf.Tensor] | None = None) -> str | None:
    """Why ``op`` (a ``Cholesky`` or ``MatrixTriangularSolve``) is left as it is on ``inputs`` (its
    own by default; a slice's where the splitter rebuilds it) (``None``: blocked)."""
    if op.type not in ("Cholesky", "MatrixTriangularSolve"):
        return f"`{op.type}` has no blocked form here"
    inputs = list(op.inputs) if inputs is None else list(inputs)
    matrix = inputs[0]
    if matrix.dtype.base_dtype not in _FLOATS:
        return f"{matrix.dtype.name}: only float32 and float64 are blocked"
    shapes = [matrix.shape] + ([inputs[1].shape] if op.type == "MatrixTriangularSolve" else [])
    if any(s.rank != 2 or not s.is_fully_defined() for s in shapes):
        return "not one matrix of static shape (batches are left to XLA)"
    n = int(matrix.shape[-1])
    if n < MIN_ORDER:
        return f"its order {n} is under {MIN_ORDER}: XLA's own expansion holds little"
    return None


class Tail:
    """Elementwise ops from an [n, n] tensor ``raw`` to a factor's matrix, their other inputs
    broadcast scalars and vectors, or [n, n] tensors made from those by elementwise ops and reshapes
    of their own shape (GPflow's kernel: ``variance * exp(-0.5 * (-2 X Xᵀ + (|x|² ⊕ |x|²)))``, its
    outer sum a reshaped broadcast add) or put on the main diagonal (the noise of ``K + σ² I``, with
    ``tf.eye`` or ``tf.linalg.diag``); :meth:`columns` computes them on a block of ``raw``'s
    columns.  ``ops`` in the order they run."""

    def __init__(self, raw: tf.Tensor, ops: Sequence[tf.Operation]):
        self.raw, self.ops = raw, list(ops)
        self.n = int(raw.shape[-1])

    @classmethod
    def of(cls, matrix: tf.Tensor, live) -> Tail | None:
        """The tail ending in ``matrix`` (its [n, n] tensors read by nothing else live), or ``None``."""
        n = int(matrix.shape[-1])
        inside: dict[str, tf.Operation] = {}
        raws: list[tf.Tensor] = []
        stack = [matrix]
        while stack:
            t = stack.pop()
            op = t.op
            if op.name in inside:
                continue
            if not _recomputable(op, n) or t.dtype != matrix.dtype:
                raws.append(t)
                continue
            inside[op.name] = op
            for x in op.inputs:
                if x.shape == (n, n):
                    stack.append(x)
                elif not _small(x, n) and not (op.type == "Reshape" and x is op.inputs[1]):
                    return None
        raws = list({r.ref(): r for r in raws}.values())
        if len(raws) != 1 or not inside or raws[0].dtype != matrix.dtype:
            return None                    # (a cast's float32 product cannot hold the float64 factor)
        ops = topological_order(matrix.graph, inside.values())
        tensors = [raws[0]] + [op.outputs[0] for op in ops if op.outputs[0] is not matrix]
        if any(c not in inside.values() for t in tensors for c in t.consumers() if c in live):
            return None
        return cls(raws[0], ops)

    @property
    def output(self) -> tf.Tensor:
        return self.ops[-1].outputs[0]

    @property
    def inputs(self) -> list[tf.Tensor]:
        """The floating tensors the ops read besides ``raw`` and each other's outputs (what a
        gradient reaches through them: a kernel's variance and lengthscales, the points' norms)."""
        made = {op.outputs[0].ref() for op in self.ops} | {self.raw.ref()}
        found = {x.ref(): x for op in self.ops for x in op.inputs if x.ref() not in made and x.dtype.is_floating}
        return list(found.values())

    def columns(self, cols: tf.Tensor, start, size: int) -> tf.Tensor:
        """The tail on ``cols``, ``raw``'s columns ``[start, start + size)``."""
        env = {self.raw.ref(): cols}
        for op in self.ops:
            if op.type == "Reshape":                       # of its own shape: the same block
                env[op.outputs[0].ref()] = env[op.inputs[0].ref()] if op.inputs[0].ref() in env else \
                    self._sliced(op.inputs[0], start, size)
                continue
            if op.type in _DIAGONALS:                      # d[i] where row i is the block's column
                rows = tf.range(self.n)[:, None]
                at = tf.range(size)[None, :] + tf.cast(start, tf.int32)
                d = op.inputs[0][:, None]
                env[op.outputs[0].ref()] = tf.where(tf.equal(rows, at), d, tf.zeros_like(d))
                continue
            inputs = [env[x.ref()] if x.ref() in env else self._sliced(x, start, size) for x in op.inputs]
            env[op.outputs[0].ref()] = graph_edit.clone_op(op, inputs)[0]
        return env[self.ops[-1].outputs[0].ref()]

    def _sliced(self, t: tf.Tensor, start, size: int) -> tf.Tensor:
        """``t``, broadcast against [n, n], at the columns' block: its last axis sliced where it is n."""
        if t.shape.rank == 0 or t.shape[-1] != self.n or self.n == 1:
            return t
        begin = tf.concat([tf.zeros([t.shape.rank - 1], tf.int32), tf.reshape(start, [1])], 0)
        return tf.slice(t, begin, t.shape.as_list()[:-1] + [size])


def _small(t: tf.Tensor, n: int) -> bool:
    """A scalar or vector broadcast against [n, n]: rank <= 2, at most n elements."""
    return t.shape.rank is not None and t.shape.rank <= 2 and t.shape.num_elements() is not None \
        and t.shape.num_elements() <= n


def _recomputable(op: tf.Operation, n: int) -> bool:
    """An [n, n] output a block of columns of which is computed from the same block of its inputs:
    an elementwise op, or a reshape of an [n, n] tensor (or of a broadcast [n, 1] + [1, n]) to itself."""
    if len(op.outputs) != 1 or op.outputs[0].shape != (n, n):
        return False
    if op.type == "Reshape":
        return op.inputs[0].shape == (n, n)
    if op.type in _DIAGONALS:
        return _main_diagonal(op, n)
    return op.type in UNARY_ELEMENTWISE | BROADCASTING_ELEMENTWISE


# A matrix with a vector on its main diagonal (``tf.eye(n)``, ``tf.linalg.diag(s)``): a kernel's noise
# written ``K + σ² I``.  Its columns are made from the vector whole.
_DIAGONALS = ("MatrixDiag", "MatrixDiagV3")


def _main_diagonal(op: tf.Operation, n: int) -> bool:
    """Whether ``op`` puts an [n] vector on the main diagonal of an [n, n] matrix, zeros elsewhere."""
    if op.inputs[0].shape != (n,):
        return False
    values = [tf.get_static_value(x) for x in op.inputs[1:]]
    return op.type == "MatrixDiag" or all(v is not None and np.size(v) == 1 and np.asarray(v).item() in ok
                                          for v, ok in zip(values, ((0,), (-1, n), (-1, n), (0,))))


def cholesky(a: tf.Tensor, block: int = BLOCK, diagonal: tf.Tensor | None = None, added: bool = False,
             tail: Tail | None = None) -> tf.Tensor:
    """``tf.linalg.cholesky(a)`` for one [n, n] matrix, a block of ``block`` columns at a time in
    ``a``'s buffer (left-looking); the strict upper triangle is zero.  With ``diagonal`` [n], the
    factor of ``set_diag(a, diagonal)`` (``added``: of ``a + diag(diagonal)``), each block of the
    diagonal set as its columns are read, so that ``a``, a kernel matrix, is factored in its own
    buffer: XLA computes ``set_diag(K, diag_part(K) + noise)``, GPflow's likelihood noise, into a
    second [n, n] buffer, and reading ``K``'s diagonal keeps the kernel's own fusion from writing
    over its matrix product.  With ``tail``, ``a`` is the [n, n] operand of elementwise ops (a
    kernel's ``exp`` of its distances' matrix product) computed on each block of columns as the loop
    reads it (:class:`Tail`; ``a`` is its ``raw``): the product's buffer becomes the factor's, where XLA would hold the
    product and the kernel matrix at once (a loop's input buffer is not shared with its producer's
    operands).  Differentiable: TensorFlow's own formula for a Cholesky's gradient (``linalg_grad``),
    its solve blocked; with ``tail``, carried back through the tail's own ops on the whole matrix (a
    tape outside the function: the backward computes the kernel matrix again)."""
    inputs = tail.inputs if tail is not None else []
    extra = [] if diagonal is None else [diagonal]

    @tf.custom_gradient
    def factor(a, *rest):
        lower = _cholesky(a, block, diagonal, added, tail)

        def grad(dl):
            grad_a = _cholesky_gradient(lower, dl, block)
            share = grad_a if diagonal is None or added else tf.linalg.set_diag(grad_a, tf.zeros_like(diagonal))
            through = [share]
            if tail is not None:
                through = tf.gradients(tail.output, [a] + inputs, grad_ys=share)
                through = [tf.zeros_like(x) if g is None else g for g, x in zip(through, [a] + inputs)]
            return through + ([tf.linalg.diag_part(grad_a)] if extra else [])

        return lower, grad

    return factor(a, *inputs, *extra)


def _cholesky_gradient(lower: tf.Tensor, dl: tf.Tensor, block: int) -> tf.Tensor:
    """TensorFlow's gradient of a Cholesky factor ``lower`` (``linalg_grad``), its solve blocked."""
    eye = tf.eye(int(lower.shape[-1]), dtype=lower.dtype)
    inverse = triangular_solve(lower, eye, lower=True, block=block)
    middle = tf.matmul(lower, dl, transpose_a=True)
    middle = tf.linalg.band_part(tf.linalg.set_diag(middle, 0.5 * tf.linalg.diag_part(middle)), -1, 0)
    grad_a = tf.matmul(tf.matmul(inverse, middle, transpose_a=True), inverse)
    return 0.5 * (grad_a + tf.transpose(grad_a))


def _cholesky(a: tf.Tensor, block: int, diagonal: tf.Tensor | None = None, added: bool = False,
              tail: Tail | None = None) -> tf.Tensor:
    n = int(a.shape[-1])
    rows = tf.range(n)[:, None]
    cols = tf.range(n)[None, :]

    def column(m, start, size):
        panel = tf.slice(m, tf.stack([start, 0]), [size, n])                      # rows J
        panel = tf.where(cols < start, panel, tf.zeros_like(panel))              # L[J, :start]
        own = tf.slice(m, tf.stack([0, start]), [n, size])                       # A[:, J]
        if tail is not None:
            own = tail.columns(own, start, size)
        if diagonal is not None:                                                 # its diagonal entries set
            on = tf.equal(rows, start + tf.range(size)[None, :])
            part = tf.slice(diagonal, tf.reshape(start, [1]), [size])[None, :]
            own = tf.where(on, own + part if added else part, own)
        s = own - tf.matmul(m, panel, transpose_b=True)
        ljj = tf.linalg.band_part(tf.linalg.cholesky(tf.slice(s, tf.stack([start, 0]), [size, size])), -1, 0)
        below = tf.transpose(tf.linalg.triangular_solve(ljj, tf.transpose(s), lower=True))   # S L_JJ^-T
        below = tf.where(rows < start + size, tf.zeros_like(below), below)
        return xla.dynamic_update_slice(m, xla.dynamic_update_slice(below, ljj, tf.stack([start, 0])),
                                        tf.stack([0, start]))

    return _blocks(a, n, block, column, forward=True)


def _blocks(x, n: int, block: int, step, forward: bool):
    """``step(x, start, size)`` over the blocks of ``n`` rows in order (``forward``) or in reverse:
    the whole blocks in a ``tf.while_loop``, a shorter last one (``n % block`` rows, at the end of the
    axis) after them forward, before them in reverse."""
    whole, tail = divmod(n, block)
    if not forward and tail:
        x = step(x, tf.constant(whole * block), tail)
    if whole:
        def body(j, x):
            start = j * block if forward else (whole - 1 - j) * block
            return j + 1, step(x, start, block)
        _, x = tf.while_loop(lambda j, x: j < whole, body, (tf.constant(0), x), parallel_iterations=1)
    if forward and tail:
        x = step(x, tf.constant(whole * block), tail)
    return x


def _solve(matrix, rhs, lower: bool, adjoint: bool, block: int):
    n, k = int(matrix.shape[0]), int(rhs.shape[1])
    forward = lower != adjoint                                 # op(matrix) lower: from the top
    index = tf.range(n)

    def step(x, start, size):
        if adjoint:                                            # op(matrix)[J, :] = matrix[:, J]ᵀ
            panel = tf.slice(matrix, tf.stack([0, start]), [n, size])
            solved = index[:, None] < start if forward else index[:, None] >= start + size
        else:
            panel = tf.slice(matrix, tf.stack([start, 0]), [size, n])
            solved = index[None, :] < start if forward else index[None, :] >= start + size
        panel = tf.where(solved, panel, tf.zeros_like(panel))
        s = tf.slice(x, tf.stack([start, 0]), [size, k]) - tf.matmul(panel, x, transpose_a=adjoint)
        diagonal = tf.slice(matrix, tf.stack([start, start]), [size, size])
        part = tf.linalg.triangular_solve(diagonal, s, lower=lower, adjoint=adjoint)
        return xla.dynamic_update_slice(x, part, tf.stack([start, 0]))

    return _blocks(rhs, n, block, step, forward)


def triangular_solve(matrix: tf.Tensor, rhs: tf.Tensor, lower: bool = True, adjoint: bool = False,
                     block: int = BLOCK) -> tf.Tensor:
    """``tf.linalg.triangular_solve(matrix, rhs, lower, adjoint)`` for one [n, n] matrix and an [n, k]
    right-hand side, a block of ``block`` rows at a time in ``rhs``'s buffer; differentiable (the
    gradient's solve blocked too)."""

    @tf.custom_gradient
    def solve(matrix, rhs):
        x = _solve(matrix, rhs, lower, adjoint, block)

        def grad(dx):
            grad_rhs = _solve(matrix, dx, lower, not adjoint, block)
            grad_matrix = -(tf.matmul(x, grad_rhs, transpose_b=True) if adjoint else
                            tf.matmul(grad_rhs, x, transpose_b=True))
            return tf.linalg.band_part(grad_matrix, -1, 0) if lower else tf.linalg.band_part(grad_matrix, 0, -1), \
                grad_rhs

        return x, grad

    return solve(matrix, rhs)


def _untransposed(t: tf.Tensor) -> tuple[tf.Tensor, bool]:
    """``(base, transposed)``: ``t`` read through a ``BroadcastTo`` of its own shape and a real 2-D
    ``Transpose``/``ConjugateTranspose`` with perm [1, 0] (``transposed``: ``t`` is ``baseᵀ``)."""
    transposed = False
    while True:
        op = t.op
        if op.type == "BroadcastTo" and op.inputs[0].shape == t.shape:
            t = op.inputs[0]
        elif (op.type in ("Transpose", "ConjugateTranspose") and t.shape.rank == 2 and not t.dtype.is_complex
              and tf.get_static_value(op.inputs[1]) is not None and list(tf.get_static_value(op.inputs[1])) == [1, 0]):
            t, transposed = op.inputs[0], not transposed
        else:
            return t, transposed


def _solve_of(op: tf.Operation, matrix: tf.Tensor, rhs: tf.Tensor) -> tf.Tensor:
    base, transposed = _untransposed(matrix)
    lower, adjoint = op.get_attr("lower"), op.get_attr("adjoint")
    # solve(Lᵀ, B, upper) = solve(L, B, lower, adjoint): the triangle named is the base's
    return triangular_solve(base, rhs, lower=lower != transposed, adjoint=adjoint != transposed)


def rebuilt_solve(op: tf.Operation, inputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``MatrixTriangularSolve`` ``op`` on ``inputs`` (a slice of its right-hand side's columns):
    blocked where :func:`refusal` allows, else cloned."""
    if op.type != "MatrixTriangularSolve" or refusal(op, inputs) is not None:
        return graph_edit.clone_op(op, inputs)
    out = _solve_of(op, inputs[0], inputs[1])
    out.set_shape(inputs[1].shape)
    return [out]


def _set_diagonal(factor: tf.Operation, live) -> tuple[tf.Tensor, tf.Tensor | None, bool]:
    """``(base, diagonal, added)`` where the Cholesky ``factor``'s matrix is ``set_diag(base, diagonal)``
    (the main diagonal) read by nothing else live, with ``added`` where that is ``set_diag(base,
    diag_part(base) + s)`` (``diagonal`` then ``s``: ``base + diag(s)``); else ``(matrix, None, False)``."""
    matrix = factor.inputs[0]
    op = matrix.op
    if op.type not in ("MatrixSetDiag", "MatrixSetDiagV2", "MatrixSetDiagV3") or matrix.shape.rank != 2:
        return matrix, None, False
    if op.type != "MatrixSetDiag" and tf.get_static_value(op.inputs[2]) not in (0, [0]):
        return matrix, None, False
    if [c for c in matrix.consumers() if c in live] != [factor]:
        return matrix, None, False
    base, diagonal = op.inputs[0], op.inputs[1]
    if diagonal.op.type in ("AddV2", "Add"):
        for own, other in ((0, 1), (1, 0)):
            part = diagonal.op.inputs[own].op
            if part.type in ("MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3") and part.inputs[0] is base \
                    and (part.type == "MatrixDiagPart" or tf.get_static_value(part.inputs[1]) in (0, [0])) \
                    and part.outputs[0].shape == diagonal.shape:
                return base, tf.broadcast_to(diagonal.op.inputs[other], diagonal.shape), True
    return base, diagonal, False


@register_pass
class BlockedLinalg(GraphPass):
    name = "blocked_linalg"
    motive = Motive.MEMORY
    slower = True            # (about 3x a Cholesky's FLOPs, 2x a solve's)

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)
        for op in [op for op in graph.get_operations() if op in live and not graph_edit.is_generated(op)
                   and op.type in ("Cholesky", "MatrixTriangularSolve")]:
            why = refusal(op)
            if why is not None:
                result.skip([op], f"`{op.type}` left to XLA: {why}", bytes_before=nbytes(op.inputs[0]))
                continue
            with graph_edit.building(graph, self.name):
                if op.type == "Cholesky":
                    base, diagonal, added = _set_diagonal(op, live)
                    tail = None if gradients.records(graph) else Tail.of(base, live)
                    new = cholesky(tail.raw if tail else base, diagonal=diagonal, added=added, tail=tail)
                    what = ("a Cholesky factor written in its matrix's buffer a block of columns at a time"
                            + (f", the {len(tail.ops)} elementwise ops before it computed on each block"
                               if tail else "")
                            + (", its diagonal added to as it goes" if added else
                               ", its diagonal set as it goes" if diagonal is not None else ""))
                else:
                    new = _solve_of(op, op.inputs[0], op.inputs[1])
                    what = "a triangular solve reading its matrix a panel of rows at a time"
                new.set_shape(op.outputs[0].shape)
            graph_edit.replace_uses(op.outputs[0], new)
            gradients.retarget(graph, op.outputs[0], new)
            n = int(op.inputs[0].shape[-1])
            result.rewrote([op.name], f"{what} ({op.inputs[0].dtype.name}[{n}, {n}], blocks of {BLOCK})",
                           bytes_before=nbytes(op.inputs[0]), bytes_after=nbytes(op.inputs[0]))
        return result
