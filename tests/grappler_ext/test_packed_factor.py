"""packed_factor: a Cholesky factor from a matrix's tiles, packed, with its solves, diagonal and gradient.

Against TensorFlow's own ops on the whole matrix (values and gradients, in XLA): a short last block
and an exact one, several solves, a cotangent that is not a quadratic form's (the general
``-Φ(G Aᵀ)`` term), a log-determinant alone; and XLA's figure for the forward and backward at
n = 2000: the storage once, never an [n, n] buffer.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.packed_cholesky import WINDOWS
from grappler_ext.packed_factor import Layout, factor_solve, packed_bytes

D = 3


def _kernel_tile(n, block):
    """A squared-exponential kernel plus noise, tile by tile (the padding the identity's)."""
    layout = Layout(n, block)

    def tile(leaves, rows, col):
        xs, variance, noise = leaves
        pad = layout.padded - n
        xb = tf.reshape(tf.pad(xs, [[0, pad], [0, 0]], mode="SYMMETRIC"), [layout.blocks, block, D])
        xr, xc = tf.gather(xb, rows), tf.gather(xb, col)
        k = variance * tf.exp(-0.5 * tf.reduce_sum(tf.square(xr[:, :, None, :] - xc[None, None]), -1))
        eye = tf.eye(block, dtype=k.dtype)[None]
        on = tf.reshape(tf.equal(rows, col), [-1, 1, 1])
        k = k + tf.where(on, noise * eye, tf.zeros_like(eye))
        within = tf.range(block)
        inside = tf.logical_and((rows[:, None] * block + within < n)[:, :, None],
                                (col * block + within < n)[None, None])
        return tf.where(inside, k, tf.where(on, eye, tf.zeros_like(eye)))

    return tile


def _matrix(xs, variance, noise):
    d2 = tf.reduce_sum(tf.square(xs[:, None] - xs[None]), -1)
    return variance * tf.exp(-0.5 * d2) + noise * tf.eye(int(xs.shape[0]), dtype=xs.dtype)


def _objective(solutions, diagonal, n):
    """A Gaussian log-density's terms, and a linear one (its cotangent not the solution's multiple)."""
    weights = tf.cast(tf.range(n), diagonal.dtype)[:, None] / n
    value = -tf.reduce_sum(tf.math.log(diagonal))
    for a in solutions:
        value += -0.5 * tf.reduce_sum(tf.square(a)) + tf.reduce_sum(tf.sin(3.0 * weights) * a[:, :1])
    return value


def _both(n, block, rhs_columns):
    rng = np.random.default_rng(n + block)
    x = tf.constant(rng.standard_normal((n, D)))
    lengthscales = tf.constant([0.8, 1.1, 1.5], tf.float64)
    variance, noise = tf.constant(1.3, tf.float64), tf.constant(0.1, tf.float64)
    rhs = [tf.constant(np.sin(rng.standard_normal((n, k)))) for k in rhs_columns]
    tile = _kernel_tile(n, block)

    def naive(x, lengthscales, variance, noise, *rhs):
        factor = tf.linalg.cholesky(_matrix(x / lengthscales, variance, noise))
        return _objective([tf.linalg.triangular_solve(factor, b) for b in rhs], tf.linalg.diag_part(factor), n)

    def packed(x, lengthscales, variance, noise, *rhs):
        solutions, diagonal = factor_solve(tile, [x / lengthscales, variance, noise], rhs, n, block, tf.float64)
        return _objective(solutions, diagonal, n)

    def with_gradients(f):
        def g(*args):
            with tf.GradientTape() as tape:
                tape.watch(args)
                value = f(*args)
            return [value] + tape.gradient(value, list(args))
        return tf.function(g, jit_compile=True)

    args = (x, lengthscales, variance, noise, *rhs)
    return with_gradients(naive)(*args), with_gradients(packed)(*args)


@pytest.mark.parametrize("n, block, rhs_columns", [(300, 64, [2]), (256, 64, [1, 3]), (200, 32, [])])
def test_values_and_gradients_equal_tensorflows(n, block, rhs_columns):
    want, got = _both(n, block, rhs_columns)
    assert len(got) == len(want) == 5 + len(rhs_columns)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-10 * max(np.max(np.abs(w)), 1e-3))


def test_layout_offsets_are_column_major_packed():
    layout = Layout(1000, 128)                          # 8 blocks, the last of 104 rows
    assert (layout.blocks, layout.padded, layout.tiles) == (8, 1024, 36 + 8)
    offsets = [int(layout.offset(c)) for c in range(layout.blocks)]
    assert offsets == [0, 8, 15, 21, 26, 30, 33, 35]    # column c holds blocks (c..7, c)
    assert packed_bytes(1000, 128, 8) == 44 * 128 * 128 * 8


def test_the_gradients_hold_the_storage_once_and_nothing_n_by_n():
    """XLA's figure for the factor, a solve, the diagonal and the gradient of a log-density at
    n = 2000: 34 MB (measured: the 20 MB storage once, the loops writing it in place, and windows of
    [n, b] beside it), where TensorFlow's ops hold about 190 MB (one [n, n] buffer is 32 MB)."""
    n, block = 2000, 128
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((n, D)))
    y = tf.constant(rng.standard_normal((n, 1)))
    scalars = (tf.constant(1.0, tf.float64), tf.constant(0.1, tf.float64))
    tile = _kernel_tile(n, block)

    def step(x, y, variance, noise):
        with tf.GradientTape() as tape:
            tape.watch([x, variance, noise])
            (a,), diagonal = factor_solve(tile, [x, variance, noise], [y], n, block, tf.float64)
            value = _objective([a], diagonal, n)
        return [value] + tape.gradient(value, [x, variance, noise])

    def naive(x, y, variance, noise):
        with tf.GradientTape() as tape:
            tape.watch([x, variance, noise])
            factor = tf.linalg.cholesky(_matrix(x, variance, noise))
            value = _objective([tf.linalg.triangular_solve(factor, y)], tf.linalg.diag_part(factor), n)
        return [value] + tape.gradient(value, [x, variance, noise])

    figure = tf_memsafe.memory_footprint(tf.function(step), x, y, *scalars, rewrite=False)
    as_written = tf_memsafe.memory_footprint(tf.function(naive), x, y, *scalars, rewrite=False)
    stored = packed_bytes(n, block, 8)
    assert stored <= figure <= stored + WINDOWS * n * block * 8, (figure, stored)
    assert figure < as_written / 4, (figure, as_written)


def test_a_matrix_that_is_not_positive_definite_gives_nan():
    n, block = 100, 32

    def tile(leaves, rows, col):
        (scale,) = leaves
        m = tf.fill([tf.size(rows), block, block], scale)         # rank one: not positive definite
        return tf.cast(m, tf.float64)

    out = tf.function(lambda s, y: factor_solve(tile, [s], [y], n, block, tf.float64), jit_compile=True)(
        tf.constant(-1.0, tf.float64), tf.ones([n, 1], tf.float64))
    assert np.isnan(out[1].numpy()).any()
