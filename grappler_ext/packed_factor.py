"""packed_factor: the Cholesky factor of a matrix given a tile at a time, held as packed lower-triangular
blocks (never an [n, n] buffer), with its triangular solves, its diagonal and their gradient.

    K = tile(p, q) for blocks p, q        =>   S: the factor's blocks L_pq (p >= q), column-major packed
    L = cholesky(K)                             (left-looking, each block column computed from K's tiles)
    A = L⁻¹ B,  d = diag(L)                     A by block forward substitution on S, d from S's diagonal

This is the mechanism under :mod:`grappler_ext.packed_cholesky` (a Gaussian process' marginal
likelihood at n = 20000: the kernel matrix alone is 3.2 GB of float64, its factor in [n, n] buffers
three or four times that).  Packed, the factor takes n² / 2 entries and no other buffer is larger than
a column of blocks ([n, b]); the matrix K is never formed, its tiles computed from the points as each
block column needs them.

Layout: ``nb = ceil(n / b)`` blocks; block (a, c), a >= c, is tile ``offset(c) + a - c`` of the
storage, ``offset(c) = c nb - c (c - 1) / 2`` (column c's blocks in order, columns in order).  The
storage has ``nb`` tiles more than the ``nb (nb + 1) / 2`` blocks, so that a window of ``nb`` tiles
from any block of a column stays inside it: the loops compute on such windows (rows a >= c of block
column c, then whatever follows, masked), one batched matrix product a step.  Rows and columns
beyond n (the last block's padding) are those of the identity: the tile function gives 1 on their
diagonal and 0 elsewhere, so the padded factor is the factor with the identity beside it.

Gradient (TensorFlow's ``CholeskyGrad`` and ``MatrixTriangularSolve`` gradients, by blocks, never
[n, n]): for cotangents G of A = L⁻¹ B (several solves: their columns side by side) and v of d,
the factor's cotangent is L̄ = -tril(L⁻ᵀ G Aᵀ) + diag(v), and TensorFlow's formula gives

    K̄ = sym(Λᵀ P Λ),  Λ = L⁻¹,  P = Φ(Lᵀ L̄) = -Φ(G Aᵀ) + diag(l ∘ v / 2)

(Φ: the lower triangle, its diagonal halved; ``sym(S) = (S + Sᵀ) / 2``; l the factor's diagonal:
with H = L⁻ᵀ G, the lower triangle of Lᵀ tril(H Aᵀ) is that of (Lᵀ H) Aᵀ = G Aᵀ; D = diag(l ∘ v / 2)).
Λ is computed in the factor's own storage (block forward substitution by columns, in place), and
each tile of K̄ on the fly:

    (Λᵀ P Λ)_pq = Σ_{a >= max(p, q)} Λ_apᵀ Q_aq,   Q_aq = -(G_a Z_aqᵀ + Φ(G_a A_aᵀ) Λ_aq) + D_a Λ_aq,
    Z_aq = Σ_{q <= c < a} Λ_cqᵀ A_c                 (a prefix sum down block column q)

so the tile K̄_pq is contracted at once with the tiles' vector-Jacobian product, for (p, q) and
(q, p) (the tile function need not be symmetric), and nothing [n, n] is held.  B's cotangent is
Λᵀ G.  The cost, counted (multiply-adds, the windows' masked rows included): the factor about
n³ / 2, Λ n³ / 2, the tiles of K̄ about 2 n³, each tile of K computed three times (the factor, and
the gradient's (p, q) and (q, p)); XLA's factor and TensorFlow's gradient on [n, n] matrices come to
about 4 n³.

Exactness: the same products as the unblocked algorithms, grouped by blocks, so the values agree
to rounding.  A matrix that is not positive definite gives NaN, as XLA's Cholesky does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

__all__ = ["Layout", "TileFunction", "factor_solve", "packed_bytes"]

# tile(leaves, rows [m] int32, col int32) -> [m, b, b]: the matrix's tiles (rows[i], col), the padded
# rows and columns those of the identity; ``leaves`` the floating tensors it is computed from.
TileFunction = Callable[[Sequence[tf.Tensor], tf.Tensor, tf.Tensor], tf.Tensor]


@dataclasses.dataclass(frozen=True)
class Layout:
    n: int          # the matrix's order
    block: int      # b, rows and columns of a block

    @property
    def blocks(self) -> int:
        return -(-self.n // self.block)

    @property
    def padded(self) -> int:
        return self.blocks * self.block

    @property
    def tiles(self) -> int:
        """Tiles of the storage: the nb (nb + 1) / 2 blocks, and nb more for the windows."""
        return self.blocks * (self.blocks + 1) // 2 + self.blocks

    def offset(self, c):
        """The storage tile of block (c, c), column c's first."""
        return c * self.blocks - c * (c - 1) // 2


def packed_bytes(n: int, block: int, itemsize: int) -> int:
    """Bytes of the packed factor of an [n, n] matrix in blocks of ``block``."""
    layout = Layout(n, block)
    return layout.tiles * block * block * itemsize


def _window(s, layout: Layout, c, start):
    """Storage tiles of block column ``c`` from its block ``start`` (rows c + start + i), nb of them."""
    b = layout.block
    return tf.slice(s, tf.stack([layout.offset(c) + start, 0, 0]), [layout.blocks, b, b])


def _tile(s, index):
    b = s.shape[-1]
    return tf.reshape(tf.slice(s, tf.stack([index, 0, 0]), [1, b, b]), [b, b])


def _rows(x, start, count: int):
    """``count`` blocks of a blocked [2 nb, b, ...] tensor from block ``start``."""
    begin = tf.concat([tf.reshape(start, [1]), tf.zeros([x.shape.rank - 1], tf.int32)], 0)
    return tf.slice(x, begin, [count] + x.shape.as_list()[1:])


def _put(x, part, start):
    begin = tf.concat([tf.reshape(start, [1]), tf.zeros([x.shape.rank - 1], tf.int32)], 0)
    return xla.dynamic_update_slice(x, part, begin)


def _valid(layout: Layout, first):
    """[nb, 1, 1]: window rows ``first + i`` inside the matrix's blocks."""
    return tf.reshape(first + tf.range(layout.blocks) < layout.blocks, [layout.blocks, 1, 1])


def _masked(valid, x):
    return tf.where(valid, x, tf.zeros_like(x))


def _solve_right_transposed(ljj, t):
    """t[i] L⁻ᵀ for each i, as one solve L Y = [t[0]ᵀ t[1]ᵀ ...] with the blocks side by side."""
    m, b = t.shape[0], t.shape[-1]
    stacked = tf.reshape(tf.transpose(t, [2, 0, 1]), [b, m * b])
    solved = tf.linalg.triangular_solve(ljj, stacked, lower=True)
    return tf.transpose(tf.reshape(solved, [b, m, b]), [1, 2, 0])


def _loop(count, body, state, start=0):
    """``body(i, *state)`` for i in [start, count) in a ``tf.while_loop`` (no parallel iterations)."""
    out = tf.while_loop(lambda i, *s: i < count, lambda i, *s: (i + 1,) + tuple(body(i, *s)),
                        (tf.convert_to_tensor(start),) + tuple(state), parallel_iterations=1)
    return out[1:]


def _cholesky(tile: TileFunction, leaves, layout: Layout, dtype):
    nb, b = layout.blocks, layout.block
    rows = tf.range(nb)

    def column(j, s):
        first = tf.minimum(j + rows, nb - 1)
        t = tile(leaves, first, j)                                        # K's blocks (j + i, j)

        def update(c, t, s):                                              # - Σ_c<j L_ac L_jcᵀ
            return t - tf.matmul(_window(s, layout, c, j - c), _tile(s, layout.offset(c) + j - c),
                                 transpose_b=True), s

        t, s = _loop(j, update, (t, s))
        ljj = tf.linalg.band_part(tf.linalg.cholesky(t[0]), -1, 0)
        below = _solve_right_transposed(ljj, t)
        new = tf.concat([ljj[None], below[1:]], 0)
        return (_put(s, _masked(_valid(layout, j), new), layout.offset(j)),)

    (s,) = _loop(nb, column, (tf.zeros([layout.tiles, b, b], dtype),))
    return s


def _blocked(x, layout: Layout):
    """[n, k] -> [2 nb, b, k], zero-padded (room for a window from any block)."""
    k = x.shape[-1]
    x = tf.pad(x, [[0, 2 * layout.padded - layout.n], [0, 0]])
    return tf.reshape(x, [2 * layout.blocks, layout.block, k])


def _unblocked(x, layout: Layout):
    k = x.shape[-1]
    return tf.reshape(x[:layout.blocks], [layout.padded, k])[:layout.n]


def _solve(s, rhs, layout: Layout):
    """``(L⁻¹ rhs, s)``, by block columns of L (right-looking forward substitution); rhs [n, k]."""
    r = _blocked(rhs, layout)
    nb = layout.blocks

    def step(c, r, s):
        xc = tf.linalg.triangular_solve(_tile(s, layout.offset(c)), _rows(r, c, 1)[0], lower=True)
        below = _rows(r, c + 1, nb) - tf.matmul(_window(s, layout, c, 1), xc)
        return _put(_put(r, below, c + 1), xc[None], c), s

    r, s = _loop(nb, step, (r, s))
    return _unblocked(r, layout), s


def _diagonal(s, layout: Layout):
    blocks = tf.gather(s, layout.offset(tf.range(layout.blocks)))
    return tf.reshape(tf.linalg.diag_part(blocks), [layout.padded])[:layout.n]


def _inverse(s, layout: Layout):
    """Λ = L⁻¹ in L's storage: column j solves L Λ[:, j] = E_j down the blocks (right-looking), each
    block Λ_cj written over L_cj once L's column j is read (in the step c = j)."""
    nb, b = layout.blocks, layout.block
    eye = tf.eye(b, dtype=s.dtype)[None]

    def column(j, s):
        # rows j + i of E_j - L Λ (made at each step: as a constant, XLA would hold a [2 nb, b, b] one)
        w = _put(tf.zeros([2 * nb, b, b], s.dtype), _depending(eye, j), 0)

        def step(c, w, s):
            i = c - j
            lam = tf.linalg.triangular_solve(_tile(s, layout.offset(c)), _rows(w, i, 1)[0], lower=True)
            below = _rows(w, i + 1, nb) - tf.matmul(_window(s, layout, c, 1), lam)
            return _put(w, below, i + 1), _put(s, _depending(lam, below)[None], layout.offset(j) + i)

        _, s = _loop(nb, step, (w, s), start=j)
        return (s,)

    (s,) = _loop(nb, column, (s,))
    return s


def _transposed_product(s, g, layout: Layout):
    """``(Λᵀ g, s)`` for g [n, k]: block c is Σ_a>=c Λ_acᵀ g_a."""
    gb = _blocked(g, layout)
    nb = layout.blocks

    def step(c, out, s):
        part = tf.einsum("iab,iak->bk", _masked(_valid(layout, c), _window(s, layout, c, 0)), _rows(gb, c, nb))
        return _put(out, part[None], c), s

    out, s = _loop(nb, step, (tf.zeros_like(gb), s))
    return _unblocked(out, layout), s


def _depending(x, *tensors):
    """``x``, made to depend on ``tensors``: ``x (1 + 0 Σ t)``, which XLA does not simplify for floats
    (``0 y`` is not 0 where y may be NaN).  A loop writing its storage in place after reading it needs
    its writes to depend on every read (XLA orders an in-place update only after the reads it can
    see before it; otherwise it copies the storage)."""
    zero = tf.add_n([0.0 * tf.reduce_sum(tf.cast(t, x.dtype)) for t in tensors])
    return x * (1.0 + zero)


def _after(s, *tensors):
    """``s``, its first entry made to depend on ``tensors`` (see :func:`_depending`)."""
    return _put(s, _depending(tf.slice(s, [0, 0, 0], [1, 1, 1]), *tensors), 0)


def _gradient(tile: TileFunction, leaves, s, alphas, diagonal, d_alphas, d_diagonal, layout: Layout):
    """The cotangents of ``leaves`` and of the right-hand sides (see the module docstring)."""
    nb, b = layout.blocks, layout.block
    dtype = s.dtype
    lam = _inverse(_after(s, diagonal, *alphas), layout)
    d_rhs = []
    for g in d_alphas:
        part, lam = _transposed_product(lam, g, layout)
        d_rhs.append(part)
    if not alphas:                                                       # (a log-determinant alone)
        alphas, d_alphas = [tf.zeros([layout.n, 1], dtype)], [tf.zeros([layout.n, 1], dtype)]
    a = _blocked(tf.concat(alphas, 1), layout)                            # [2 nb, b, K]
    g = _blocked(tf.concat(d_alphas, 1), layout)
    d = _blocked((0.5 * diagonal * d_diagonal)[:, None], layout)           # [2 nb, b, 1]
    within = tf.range(b)

    def prefix(lam, c):
        """Z_{c + i, c} = Σ_{c <= r < c + i} Λ_rcᵀ A_r, i in [0, 2 nb) (zero past the matrix)."""
        y = tf.einsum("iab,iak->ibk", _masked(_valid(layout, c), _window(lam, layout, c, 0)), _rows(a, c, nb))
        z = tf.cumsum(y, 0, exclusive=True)
        return tf.concat([z, tf.zeros_like(z)], 0)

    def vjp(acc, rows, col, cotangent):
        inner = [tf.identity(x) for x in leaves]
        out = tile(inner, tf.reshape(rows, [1]), col)[0]
        grads = tf.gradients(out, inner, grad_ys=cotangent)
        return [s_ if gr is None else s_ + tf.convert_to_tensor(gr) for s_, gr in zip(acc, grads)]

    def column(q, lam, *acc):
        zq = prefix(lam, q)

        def pair(p, lam, *acc):
            valid = _valid(layout, p)
            lam_p, lam_q = _window(lam, layout, p, 0), _window(lam, layout, q, p - q)   # rows p + i
            gw, aw, dw = _rows(g, p, nb), _rows(a, p, nb), _rows(d, p, nb)
            outer = tf.matmul(gw, aw, transpose_b=True)
            phi = tf.linalg.band_part(outer, -1, 0) - 0.5 * tf.linalg.diag(tf.linalg.diag_part(outer))

            def q_of(lam_c, z):
                return _masked(valid, dw * lam_c - tf.matmul(gw, z, transpose_b=True) - tf.matmul(phi, lam_c))

            s_pq = tf.einsum("iab,iac->bc", lam_p, q_of(lam_q, _rows(zq, p - q, nb)))
            s_qp = tf.einsum("iab,iac->bc", lam_q, q_of(lam_p, prefix(lam, p)[:nb]))
            rows_in = p * b + within < layout.n
            cols_in = q * b + within < layout.n
            inside = tf.logical_and(rows_in[:, None], cols_in[None, :])
            bar = tf.where(inside, 0.5 * (s_pq + tf.transpose(s_qp)), tf.zeros([b, b], dtype))
            acc = vjp(list(acc), p, q, bar)
            mirror = tf.where(tf.equal(p, q), tf.zeros_like(bar), tf.transpose(bar))
            return [lam] + vjp(acc, q, p, mirror)

        return _loop(nb, pair, (lam,) + tuple(acc), start=q)

    zeros = [tf.zeros_like(x) for x in leaves]
    d_leaves = list(_loop(nb, column, [lam] + zeros))[1:] if leaves else []
    return d_leaves, d_rhs


def factor_solve(tile: TileFunction, leaves: Sequence[tf.Tensor], rhs: Sequence[tf.Tensor], n: int, block: int,
                 dtype) -> tuple[list[tf.Tensor], tf.Tensor]:
    """``([L⁻¹ B for B in rhs], diag(L))`` for ``L = cholesky(K)``, K's tiles from ``tile(leaves, ...)``
    (floating ``leaves``, differentiated; the tile function closes over anything else), each B
    [n, k]; differentiable in ``leaves`` and ``rhs``.  No [n, n] buffer is made."""
    layout = Layout(n, block)
    leaves, rhs = list(leaves), list(rhs)
    count = len(leaves)

    @tf.custom_gradient
    def factor(*args):
        ls, bs = list(args[:count]), list(args[count:])
        s = _cholesky(tile, ls, layout, dtype)
        alphas = []
        for x in bs:                                   # (each loop carries the storage: XLA keeps one)
            alpha, s = _solve(s, x, layout)
            alphas.append(alpha)
        diagonal = _diagonal(s, layout)

        def grad(*dys):
            dys = [tf.zeros_like(y) if dy is None else tf.convert_to_tensor(dy)
                   for dy, y in zip(dys, alphas + [diagonal])]
            d_leaves, d_rhs = _gradient(tile, ls, s, alphas, diagonal, dys[:-1], dys[-1], layout)
            return d_leaves + d_rhs

        return alphas + [diagonal], grad

    out = factor(*leaves, *rhs)
    return list(out[:-1]), out[-1]
