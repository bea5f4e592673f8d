"""kernel_tiles: an [n, n] matrix computed in the graph from smaller tensors, recomputed a tile at a time.

    K = s exp(-0.5 (-2 X Xᵀ + r ⊕ r)) + diag(σ²)    =>   K[rows of blocks p, columns of block q]
                                                        = s exp(-0.5 (-2 X_p X_qᵀ + r_p ⊕ r_q)) (+ σ² on p = q)

A kernel matrix is made by ops whose [n, n] outputs are each computed, entry (i, j), from row i of
some of their inputs and column j of others: elementwise ops over operands broadcast against [n, n]
(an [n, 1] operand carries the rows, a [1, n] or [n] one the columns, a scalar neither), a matrix
product of two [n, d] operands (the first carries the rows, the second the columns), a reshape of an
[n, n] tensor to itself, and a diagonal set from a vector (``set_diag``, GPflow's likelihood noise),
the vector itself computed from the matrix's own diagonal and from tensors of its rows.
:func:`analyse` finds these ops behind a matrix (a :class:`KernelTiles`, or the reason there is
none), and :meth:`KernelTiles.tile` computes its tiles for a batch of row blocks and one column
block from the small tensors (the *leaves*: the points, the norms, the kernel's parameters),
each sliced by the blocks it is read along.  No [n, n] buffer is made.

The tiles follow :mod:`grappler_ext.packed_factor`'s convention: rows and columns past n (the last
block's padding) are those of the identity.  The leaves are padded by reflection (their own
values), so the padded entries computed before the mask are finite, as are their gradients.

Not handled (the reason names it): any op outside those above on the way (a ``BroadcastTo``, a
gather, a reduction over an [n, n] tensor), an [n, n] tensor read by anything else (the matrix is
needed whole there), a diagonal vector made by other ops than elementwise ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from grappler_ext import graph_edit
from grappler_ext.graph_query import topological_order
from grappler_ext.op_types import BROADCASTING_ELEMENTWISE, MATMULS, UNARY_ELEMENTWISE

__all__ = ["KernelTiles", "analyse", "main_diagonal", "DIAG_PART"]

_SET_DIAG = frozenset({"MatrixSetDiag", "MatrixSetDiagV2", "MatrixSetDiagV3"})
DIAG_PART = frozenset({"MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3"})
_DIAG = frozenset({"MatrixDiag", "MatrixDiagV2", "MatrixDiagV3"})
_ELEMENTWISE = UNARY_ELEMENTWISE | BROADCASTING_ELEMENTWISE
ROW, COL, DIAG, NONE = "row", "col", "diag", "none"


@dataclasses.dataclass(frozen=True)
class _Use:
    """How a leaf is read: along the rows (``axis`` its row axis), the columns, the diagonal, or whole."""
    role: str
    axis: int = 0


def main_diagonal(op: tf.Operation) -> bool:
    """A diagonal op on the main diagonal (``k = 0``), a diagonal matrix padded with zeros."""
    if op.type in ("MatrixSetDiag", "MatrixDiagPart", "MatrixDiag"):
        return True
    if tf.get_static_value(op.inputs[2 if op.type in _SET_DIAG else 1]) not in (0, [0]):
        return False
    return op.type not in ("MatrixDiagV2", "MatrixDiagV3") or tf.get_static_value(op.inputs[4]) == 0


def _role(op: tf.Operation, index: int, n: int) -> _Use | str:
    """How the region op ``op`` reads its small input ``index`` (or why it cannot)."""
    x = op.inputs[index]
    shape = x.shape.as_list() if x.shape.rank is not None else None
    if shape is None or None in shape:
        return f"`{op.name}`'s input {index} has no static shape"
    if op.type in MATMULS:
        ta, tb = _transposes(op)
        if len(shape) != 2:
            return f"`{op.name}` is a batched product"
        if index == 0:
            return _Use(ROW, 1 if ta else 0) if shape[1 if ta else 0] == n else f"`{op.name}`'s rows are not n"
        return _Use(COL, 0 if tb else 1) if shape[0 if tb else 1] == n else f"`{op.name}`'s columns are not n"
    if op.type in _SET_DIAG and index == 1 or op.type in _DIAG and index == 0:
        return _Use(DIAG, 0) if shape == [n] else f"`{op.name}` sets a diagonal of shape {shape}"
    if op.type in _ELEMENTWISE:
        if all(d == 1 for d in shape):
            return _Use(NONE)
        if shape in ([n], [1, n]):
            return _Use(COL, len(shape) - 1)
        if shape == [n, 1]:
            return _Use(ROW, 0)
        return f"`{op.name}` broadcasts an operand of shape {shape} against [{n}, {n}]"
    return f"`{op.name}` ({op.type}) reads it"


@dataclasses.dataclass
class KernelTiles:
    """The ops computing ``matrix`` [n, n] from ``leaves`` (see the module docstring)."""

    matrix: tf.Tensor
    ops: list[tf.Operation]                     # in the order they run: the [n, n] ops and the diagonal's
    uses: dict                                  # (op name, input index) -> _Use, for every leaf read
    leaves: list[tf.Tensor]                     # the small tensors read, in a fixed order

    @property
    def n(self) -> int:
        return int(self.matrix.shape[-1])

    @property
    def floating(self) -> list[tf.Tensor]:
        return [x for x in self.leaves if x.dtype.is_floating]

    def tile(self, values: Sequence[tf.Tensor], rows: tf.Tensor, col: tf.Tensor, block: int) -> tf.Tensor:
        """The matrix's tiles (``rows[i]``, ``col``) [m, b, b] with the floating leaves given as
        ``values`` (in :attr:`floating`'s order); padding as the identity's."""
        n, b = self.n, block
        given = {x.ref(): v for x, v in zip(self.floating, values)}
        nb = -(-n // b)

        def leaf(x):
            return given.get(x.ref(), x)

        def blocks(x, axis):
            """``x`` padded along ``axis`` to nb b (by reflection) and cut there into [.., nb, b, ..]."""
            v = leaf(x)
            pad = [[0, 0]] * v.shape.rank
            pad[axis] = [0, nb * b - n]
            v = tf.pad(v, pad, mode="SYMMETRIC") if nb * b > n else v
            shape = v.shape.as_list()
            return tf.reshape(v, shape[:axis] + [nb, b] + shape[axis + 1:])

        def sliced(x, use: _Use, ids, diagonal: bool):
            """``x`` at the blocks ``ids`` ([m]: the rows, or a scalar: the column), shaped to broadcast."""
            if use.role == NONE:
                return leaf(x)
            out = tf.gather(blocks(x, use.axis), ids, axis=use.axis)
            if diagonal and use.role == COL and x.shape.rank == 2:      # [1, m, b] -> [m, b]
                return tf.squeeze(out, 0)
            if diagonal and use.role == ROW and x.shape.rank == 2 and x.shape[1] == 1:
                return tf.squeeze(out, -1)                                   # [m, b, 1] -> [m, b]
            return out

        on = tf.reshape(tf.equal(rows, col), [-1, 1, 1])
        eye = tf.eye(b, dtype=self.matrix.dtype)[None]
        tiles: dict = {}
        diagonals: dict = {}                                                 # [n, n] or [n] -> [m, b]

        def diagonal_of(t):
            return diagonals[t.ref()]

        for op in self.ops:
            out = op.outputs[0]
            big = out.shape == (n, n)
            if op.type in DIAG_PART:
                diagonals[out.ref()] = diagonal_of(op.inputs[0])
                continue
            if op.type == "Reshape":
                tiles[out.ref()], diagonals[out.ref()] = tiles[op.inputs[0].ref()], diagonals[op.inputs[0].ref()]
                continue
            if op.type in _SET_DIAG:
                d = self._input(op, 1, tiles, diagonals, sliced, rows, diagonal=True)
                tiles[out.ref()] = tf.where(tf.logical_and(on, eye > 0), d[:, :, None], tiles[op.inputs[0].ref()])
                diagonals[out.ref()] = d
                continue
            if op.type in _DIAG:
                d = self._input(op, 0, tiles, diagonals, sliced, rows, diagonal=True)
                tiles[out.ref()] = tf.where(tf.logical_and(on, eye > 0), d[:, :, None], tf.zeros([], out.dtype))
                diagonals[out.ref()] = d
                continue
            if op.type in MATMULS:
                ta, tb = _transposes(op)
                a = sliced(op.inputs[0], self.uses[(op.name, 0)], rows, False)   # [m, b, d] or [d, m, b]
                a = tf.transpose(a, [1, 2, 0]) if ta else a
                c = sliced(op.inputs[1], self.uses[(op.name, 1)], col, False)    # [b, d] or [d, b]
                c = c if tb else tf.transpose(c)
                tiles[out.ref()] = tf.matmul(a, c, transpose_b=True)
                cd = sliced(op.inputs[1], self.uses[(op.name, 1)], rows, False)  # its columns at the rows' blocks
                cd = cd if tb else tf.transpose(cd, [1, 2, 0])
                diagonals[out.ref()] = tf.reduce_sum(a * cd, -1)
                continue
            # elementwise: on the tiles where it is [n, n], on the diagonals where it is (or makes) one
            if big:
                inputs = [self._input(op, i, tiles, diagonals, sliced, col if self._col(op, i) else rows, False)
                          for i in range(len(op.inputs))]
                tiles[out.ref()] = graph_edit.clone_op(op, inputs)[0]
            inputs = [self._input(op, i, tiles, diagonals, sliced, rows, diagonal=True) for i in range(len(op.inputs))]
            diagonals[out.ref()] = graph_edit.clone_op(op, inputs)[0]
        out = tiles[self.matrix.ref()]
        within = tf.range(b)
        inside = tf.logical_and((rows[:, None] * b + within[None, :] < n)[:, :, None],
                                (col * b + within < n)[None, None, :])
        return tf.where(inside, out, tf.where(tf.logical_and(on, eye > 0), tf.ones_like(out), tf.zeros_like(out)))

    def _col(self, op, i) -> bool:
        use = self.uses.get((op.name, i))
        return use is not None and use.role == COL

    def _input(self, op, i, tiles, diagonals, sliced, ids, diagonal: bool):
        x = op.inputs[i]
        if diagonal and x.ref() in diagonals:
            return diagonals[x.ref()]
        if not diagonal and x.ref() in tiles:
            return tiles[x.ref()]
        use = self.uses[(op.name, i)]
        if use.role == DIAG:                                   # a diagonal's vector: [m, b] at the rows
            return sliced(x, _Use(COL, 0), ids, True)
        return sliced(x, use, ids, diagonal)


def _transposes(op: tf.Operation) -> tuple[bool, bool]:
    if op.type == "MatMul":
        return op.get_attr("transpose_a"), op.get_attr("transpose_b")
    return op.get_attr("adj_x"), op.get_attr("adj_y")


def analyse(matrix: tf.Tensor, live, ignore=frozenset()) -> KernelTiles | str:
    """The ops computing ``matrix`` (a KernelTiles), or why its tiles cannot be computed apart;
    ``ignore``: ops not counted as readers (a recorded gradient's)."""
    if matrix.shape.rank != 2 or not matrix.shape.is_fully_defined() or matrix.shape[0] != matrix.shape[1]:
        return "not a square matrix of static shape"
    n = int(matrix.shape[0])
    inside: dict[str, tf.Operation] = {}
    uses: dict = {}
    leaves: dict = {}
    stack = [matrix]
    while stack:
        t = stack.pop()
        op = t.op
        if op.name in inside:
            continue
        big = t.shape == (n, n)
        if not _computes_tiles(op, t, n):
            return f"`{op.name}` ({op.type}) computes {'the' if t is matrix else 'a'} {t.shape} tensor on the way"
        inside[op.name] = op
        for i, x in enumerate(op.inputs):
            if op.type == "Reshape" and i == 1 or i >= {**dict.fromkeys(_SET_DIAG, 2),
                                                       **dict.fromkeys(DIAG_PART | _DIAG, 1)}.get(op.type, 99):
                continue                                                     # shapes, offsets, padding
            if x.shape == (n,) and _depends_on_big(x, n) and big and op.type not in _SET_DIAG | _DIAG:
                return f"`{op.name}` reads the matrix's diagonal along its rows or columns"
            if x.shape == (n, n) or x.shape == (n,) and _depends_on_big(x, n):
                stack.append(x)
                continue
            if not big and op.type in _ELEMENTWISE:                       # the diagonal's own operands
                shape = x.shape.as_list()
                if shape not in ([n], [1]) and shape != []:
                    return f"`{op.name}` reads a {shape} tensor beside the diagonal"
                use = _Use(COL, 0) if shape == [n] else _Use(NONE)
            else:
                use = _role(op, i, n)
                if isinstance(use, str):
                    return use
            uses[(op.name, i)] = use
            leaves[x.ref()] = x
    ops = topological_order(matrix.graph, inside.values())
    made = [o for op in ops for o in op.outputs]
    for t in made:
        for c in t.consumers():
            if c in live and c.name not in inside and c not in ignore:
                return f"`{t.name}` is also read by `{c.name}` ({c.type}): it is needed whole there"
    return KernelTiles(matrix, ops, uses, list(leaves.values()))


def _computes_tiles(op: tf.Operation, t: tf.Tensor, n: int) -> bool:
    """Whether ``op``, making ``t`` ([n, n], or an [n] vector of a diagonal), has a tile rule."""
    big = t.shape == (n, n)
    if op.type == "Reshape":
        return big and op.inputs[0].shape == (n, n)
    if op.type in _SET_DIAG | _DIAG:
        return big and main_diagonal(op)
    if op.type in DIAG_PART:
        return not big and main_diagonal(op) and op.inputs[0].shape == (n, n)
    if op.type in MATMULS:
        return big and len(op.outputs) == 1
    return op.type in _ELEMENTWISE and len(op.outputs) == 1 and (big or t.shape == (n,))


def _depends_on_big(x: tf.Tensor, n: int) -> bool:
    """Whether the [n] vector ``x`` is computed from an [n, n] tensor (through a diagonal)."""
    stack, seen = [x], set()
    while stack:
        t = stack.pop()
        if t.ref() in seen:
            continue
        seen.add(t.ref())
        if t.op.type in DIAG_PART and t.op.inputs[0].shape == (n, n):
            return True
        if t.op.type in _ELEMENTWISE and t.shape == (n,):
            stack.extend(t.op.inputs)
    return False
