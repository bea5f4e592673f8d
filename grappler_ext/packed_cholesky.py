"""packed_cholesky: the Cholesky factor of a kernel matrix held as packed lower-triangular blocks, the
matrix never formed, its solves, log-determinant and gradients computed from those blocks.

    L = cholesky(K(X) + σ² I)               =>   S = packed_factor(tiles of K from X, σ²)   (n² / 2 entries)
    A = solve(L, B);  d = diag_part(L)            A = S⁻¹ B;  d = diag(S)
    (and their gradients: CholeskyGrad ...)       gradients through S, a tile of K̄ at a time

A Gaussian process' marginal likelihood (GPflow's ``GPR.training_loss``, with its gradients taken
inside the function) at n = 20000 points holds the [n, n] kernel matrix, its factor and TensorFlow's
gradient of the factor (``CholeskyGrad``: the factor's inverse, two [n, n] products, their sum and
transpose): 16.4 GB of float64 by XLA's figure.  The factor alone is 3.2 GB whole, 1.6 GB as the
lower triangle.  So no rewrite that keeps any [n, n] tensor can bring the program under 2 GB; this
one keeps none (:mod:`grappler_ext.packed_factor`: the packed factor and a few [n, b] buffers).

When it applies (each refusal is a "skipped" record naming the reason): a ``Cholesky`` of one
float32/float64 matrix of static order ``n >= MIN_ORDER``, not in a recorded gradient's backward,
whose matrix is computed from smaller tensors (each at most n² / ``MAX_LEAF_SHARE`` elements: SGPR's
``I + A Aᵀ`` over A [M, N] is the splitter's) by ops :mod:`grappler_ext.kernel_tiles` can compute a
tile at a time (a kernel: matrix products of the points, elementwise ops, the noise on the
diagonal), none of its [n, n] tensors read elsewhere; the factor read only by ``MatrixTriangularSolve``
(``lower``, not ``adjoint``) of right-hand sides of at most ``b`` columns that do not depend on it, and
by its main diagonal (``diag_part``).  Those are GPflow's ``multivariate_normal`` (the GPR loss),
and any Gaussian log-density written with ``cholesky``, ``triangular_solve`` and the log of the
diagonal.  A right-hand side of many columns (a prediction's ``K(X, X*)``) is left to the splitter,
which splits it along its columns, and to :mod:`grappler_ext.blocked_linalg`.

Gradients: the outputs come from one ``tf.custom_gradient`` (TensorFlow's formulas, by blocks: see
:mod:`grappler_ext.packed_factor`); each gradient recorded inside the function that read the old
ops is taken again (:func:`grappler_ext.gradients.rebuild`), and the old backward, with its [n, n]
tensors, is left dead.

Policy: the block size ``b`` is the largest of :data:`BLOCKS` for which the packed factor and
:data:`WINDOWS` buffers of [n, b] fit the limit (larger blocks: fewer, larger products; smaller:
less padding and smaller windows).  Where even ``b = 32`` does not fit, the pass still applies (it is
the least this program can hold) and says so.  Its motive is memory: :mod:`grappler_ext.guard` runs
it only on programs over their limit and undoes it where XLA's figure rises.

Exactness: the same operations as the unblocked algorithms, grouped by blocks; the kernel's entries
are computed by the same ops on slices of the same inputs.  Values agree to rounding (about 1e-12
relative in float64 at n = 2000).  The cost: the tiles of K computed three times (the factor and the
gradient's two), about 3 n³ multiply-adds for the factor, its inverse and the gradient's tiles
(counted; XLA's factor and TensorFlow's gradient, about 4 n³); the loops of small blocks are slower
than that count (at n = 3000, blocks of 32: a warm loss and gradient 1.9x the program as written).

Pipeline position: before the splitter, which would otherwise try (and fail) to split a program
whose every large tensor is [n, n] and coupled through the factor.
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from grappler_ext import gradients, graph_edit, kernel_tiles, packed_factor
from grappler_ext.graph_query import ancestors, live_ops
from grappler_ext.op_types import nbytes
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import register_pass

__all__ = ["PackedCholesky", "Taken", "MIN_ORDER", "BLOCKS", "WINDOWS", "MAX_LEAF_SHARE", "block_for", "refusal"]

MIN_ORDER = 1024
BLOCKS = (512, 256, 128, 64, 32)
# [n, b] buffers the loops hold beside the factor at their peak, by XLA's figure (9 at n = 2000,
# b = 128 with its gradient: the windows of blocks, their products and masks), with a margin.
WINDOWS = 12
# A leaf (the points, their norms) of at most n² / MAX_LEAF_SHARE elements: the tiles read it whole.
MAX_LEAF_SHARE = 16
_FLOATS = (tf.float32, tf.float64)


def block_for(n: int, itemsize: int, limit: int) -> tuple[int, bool]:
    """``(b, fits)``: the largest block of :data:`BLOCKS` whose packed factor and windows fit ``limit``
    (``fits``), else the smallest."""
    for b in BLOCKS:
        if b <= n and packed_factor.packed_bytes(n, b, itemsize) + WINDOWS * n * b * itemsize <= limit:
            return b, True
    return BLOCKS[-1], False


@dataclasses.dataclass(frozen=True)
class Taken:
    """A factor the pass takes: its matrix's tiles, and its readers."""

    tiles: kernel_tiles.KernelTiles
    solves: tuple[tf.Operation, ...]             # MatrixTriangularSolve(factor, B), lower, not adjoint
    diagonals: tuple[tf.Operation, ...]          # its main diagonal


def refusal(factor: tf.Operation, live, backward) -> Taken | str:
    """What the pass takes of the ``Cholesky`` ``factor`` (a :class:`Taken`), or why it leaves it."""
    matrix = factor.inputs[0]
    if matrix.dtype.base_dtype not in _FLOATS:
        return f"{matrix.dtype.name}: only float32 and float64"
    if matrix.shape.rank != 2 or not matrix.shape.is_fully_defined():
        return "not one matrix of static shape (batches are left to XLA)"
    n = int(matrix.shape[-1])
    if n < MIN_ORDER:
        return f"its order {n} is under {MIN_ORDER}"
    solves, diagonals = [], []
    for reader in factor.outputs[0].consumers():
        if reader not in live or reader in backward:
            continue
        if reader.type == "MatrixTriangularSolve" and reader.inputs[0] is factor.outputs[0] \
                and reader.get_attr("lower") and not reader.get_attr("adjoint"):
            rhs = reader.inputs[1]
            if rhs.shape.rank != 2 or not rhs.shape.is_fully_defined():
                return f"`{reader.name}`'s right-hand side has no static shape"
            if int(rhs.shape[1]) > BLOCKS[0]:
                return (f"`{reader.name}` solves for {int(rhs.shape[1])} columns (the splitter splits them; "
                        "blocked_linalg blocks the factor)")
            solves.append(reader)
        elif reader.type in kernel_tiles.DIAG_PART and kernel_tiles.main_diagonal(reader):
            diagonals.append(reader)
        else:
            return f"the factor is read by `{reader.name}` ({reader.type}), which needs it whole"
    if not solves and not diagonals:
        return "nothing but a gradient reads the factor"
    if factor in ancestors([s.inputs[1] for s in solves]):
        return "a right-hand side is computed from the factor"
    tiles = kernel_tiles.analyse(matrix, live, ignore=backward | {factor})
    if isinstance(tiles, str):
        return f"its matrix is not computed a tile at a time: {tiles}"
    largest = max(tiles.leaves, key=lambda t: t.shape.num_elements() or 0, default=None)
    if largest is not None and (largest.shape.num_elements() or 0) * MAX_LEAF_SHARE > n * n:
        # (SGPR's B = I + A Aᵀ, A = L⁻¹ K(Z, X) [M, N]: A is the splitter's to split along N)
        return (f"its matrix is computed from `{largest.name}` {largest.shape}, not small beside it: held whole "
                "for the tiles, it would cost more than the factor saves")
    return Taken(tiles, tuple(solves), tuple(diagonals))


@register_pass
class PackedCholesky(GraphPass):
    name = "packed_cholesky"
    motive = Motive.MEMORY

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        limit = options.memory_limit_bytes
        if limit is None:
            return result
        factors = [op for op in graph.get_operations() if op.type == "Cholesky" and not graph_edit.is_generated(op)]
        if not factors:
            return result
        can, why_not = gradients.rebuildable(graph)
        live = live_ops(graph)
        backward = frozenset(gradients.backward_ops(graph)) if can else frozenset()
        for factor in [f for f in factors if f in live and f not in backward]:
            matrix = factor.inputs[0]
            if not can and gradients.differentiated(graph, [factor]):
                result.skip([factor.name], f"`Cholesky` left: {why_not}", bytes_before=nbytes(matrix))
                continue
            taken = refusal(factor, live, backward)
            if isinstance(taken, str):
                result.skip([factor.name], f"`Cholesky` left: {taken}", bytes_before=nbytes(matrix))
                continue
            tiles, solves, diagonals = taken.tiles, list(taken.solves), list(taken.diagonals)
            n, dtype = int(matrix.shape[-1]), matrix.dtype.base_dtype
            block, fits = block_for(n, dtype.size, limit)
            with graph_edit.building(graph, self.name):
                tile = functools.partial(tiles.tile, block=block)
                alphas, diagonal = packed_factor.factor_solve(tile, tiles.floating, [s.inputs[1] for s in solves],
                                                              n, block, dtype)
                for new, old in zip(alphas, solves):
                    new.set_shape(old.outputs[0].shape)
                diagonal.set_shape([n])
            for new, old in zip(alphas, solves):
                graph_edit.replace_uses(old.outputs[0], new)
                gradients.retarget(graph, old.outputs[0], new)
            for reader in diagonals:
                graph_edit.replace_uses(reader.outputs[0], diagonal)
                gradients.retarget(graph, reader.outputs[0], diagonal)
            touched = [factor] + solves + diagonals + list(tiles.ops)
            rebuilt = gradients.rebuild(graph, self.name, touched) if can else 0
            stored = packed_factor.packed_bytes(n, block, dtype.size)
            counted = stored + WINDOWS * n * block * dtype.size
            result.rewrote(
                [factor.name] + [op.name for op in solves + diagonals],
                f"a Cholesky factor held as packed blocks of {block} ({stored:,} B, never [{n}, {n}]), its kernel "
                f"matrix computed a tile at a time from {len(tiles.leaves)} smaller tensors ({len(tiles.ops)} ops), "
                f"{len(solves)} solve(s) and {len(diagonals)} diagonal(s) read from the blocks"
                + (f"; {rebuilt} gradient(s) inside the function rebuilt" if rebuilt else "")
                + ("" if fits else f" (the smallest blocks; the pass counts {counted:,} B for the factor and "
                                   "its windows, over the limit: XLA's figure decides)"),
                bytes_before=nbytes(matrix), bytes_after=stored)
        return result

