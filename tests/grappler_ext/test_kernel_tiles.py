"""kernel_tiles: a kernel matrix's tiles computed from its points, equal to the matrix's blocks.

Kernels as GPflow and hand-written code build them (broadcast outer sums, matrix products either
way round, GPflow's ``set_diag(K, diag_part(K) + noise)``, ``+ noise * tf.eye(n)``), a short last
block (padding: the identity's rows and columns), and the refusals.
"""

import gpflow
import numpy as np
import pytest
import tensorflow as tf

from grappler_ext import kernel_tiles

N, BLOCK, D = 150, 64, 3                # three blocks, the last of 22 rows
rng = np.random.default_rng(0)
X = tf.constant(rng.standard_normal((N, D)))


MATERN = gpflow.kernels.Matern32(lengthscales=[0.7, 1.2, 2.0], variance=1.7)
SQUARED_EXPONENTIAL = gpflow.kernels.SquaredExponential(lengthscales=1.3)


def _gpflow_matern(x):
    m = MATERN(x)
    return tf.linalg.set_diag(m, tf.linalg.diag_part(m) + tf.constant(0.3, tf.float64))


def _gpflow_squared_exponential(x):
    m = SQUARED_EXPONENTIAL(x)
    return tf.linalg.set_diag(m, tf.linalg.diag_part(m) + tf.constant(0.1, tf.float64))


def _linear_with_eye(x):
    return 2.0 * tf.matmul(x, x, transpose_b=True) + 0.5 * tf.eye(N, dtype=x.dtype)


def _transposed_points(x):
    xt = tf.transpose(x)                                      # [D, N]: the product reads them as columns
    r = tf.reduce_sum(tf.square(x), -1)
    return tf.exp(-0.5 * (r[:, None] - 2.0 * tf.matmul(xt, xt, transpose_a=True) + r)) + 0.2 * tf.eye(N, dtype=x.dtype)


def _expected_tiles(matrix, rows, col):
    nb = -(-N // BLOCK)
    padded = np.eye(nb * BLOCK)
    padded[:N, :N] = matrix
    blocks = padded.reshape(nb, BLOCK, nb, BLOCK).transpose(0, 2, 1, 3)
    return blocks[rows, col]


@pytest.mark.parametrize("kernel", [_gpflow_matern, _gpflow_squared_exponential, _linear_with_eye, _transposed_points])
@pytest.mark.parametrize("rows, col", [([0, 1, 2], 0), ([2], 2), ([1, 2, 2], 1)])
def test_tiles_equal_the_matrixs_blocks(kernel, rows, col):
    @tf.function(jit_compile=True)
    def both(x):
        matrix = kernel(x)
        graph = tf.compat.v1.get_default_graph()
        tiles = kernel_tiles.analyse(matrix, set(graph.get_operations()))
        assert isinstance(tiles, kernel_tiles.KernelTiles), tiles
        assert all(t.shape.num_elements() < N * N for t in tiles.leaves)
        return matrix, tiles.tile(tiles.floating, tf.constant(rows), tf.constant(col), BLOCK)

    matrix, got = both(X)
    np.testing.assert_allclose(got, _expected_tiles(matrix.numpy(), rows, col), rtol=1e-12, atol=1e-12)


def test_the_tiles_gradients_are_the_matrixs():
    """The sum of a tile's entries weighted by w has the gradient of the matrix's, w on that block."""
    rows, col = [2], 1

    @tf.function(jit_compile=True)
    def both(x):
        # (tf.gradients, as the pass takes them: the tiles' ops are cloned, which no tape records)
        matrix = _gpflow_squared_exponential(x)
        tiles = kernel_tiles.analyse(matrix, set(tf.compat.v1.get_default_graph().get_operations()))
        tile = tiles.tile(tiles.floating, tf.constant(rows), tf.constant(col), BLOCK)[0]
        weights = tf.reshape(tf.sin(tf.range(BLOCK * BLOCK, dtype=x.dtype)), [BLOCK, BLOCK])
        placed = tf.pad(weights, [[2 * BLOCK, 0], [BLOCK, BLOCK]])[:N, :N]     # rows 128.., columns 64..127
        from_tile = tf.gradients(tf.reduce_sum(tile * weights), x)[0]
        from_matrix = tf.gradients(tf.reduce_sum(matrix * placed), x)[0]
        return tf.convert_to_tensor(from_tile), from_matrix

    got, want = both(X)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_refusals_name_the_op():
    @tf.function
    def reasons(x):
        graph = tf.compat.v1.get_default_graph()
        m = _gpflow_squared_exponential(x)
        total = tf.reduce_sum(m)                                   # the matrix needed whole elsewhere
        read_elsewhere = kernel_tiles.analyse(m, set(graph.get_operations()))
        t = tf.transpose(tf.exp(tf.matmul(x, x, transpose_b=True)))
        transposed = kernel_tiles.analyse(t + 1.0, set(graph.get_operations()))
        g = tf.gather(tf.matmul(x, x, transpose_b=True), tf.range(N))
        gathered = kernel_tiles.analyse(g, set(graph.get_operations()))
        wide = tf.exp(tf.matmul(x, x, transpose_b=True)) + tf.ones([N, 2 * N], x.dtype)[:, :N]
        sliced = kernel_tiles.analyse(wide, set(graph.get_operations()))
        k = tf.exp(tf.matmul(x, x, transpose_b=True))
        scaled = kernel_tiles.analyse(k / tf.linalg.diag_part(k), set(graph.get_operations()))
        return total, read_elsewhere, transposed, gathered, sliced, scaled

    out = {}

    def trace(x):
        out["reasons"] = reasons.python_function(x)

    tf.function(trace).get_concrete_function(X)
    _, read_elsewhere, transposed, gathered, sliced, scaled = out["reasons"]
    assert "is also read by" in read_elsewhere and "Sum" in read_elsewhere
    assert "(Transpose) computes" in transposed
    assert "(GatherV2) computes" in gathered
    assert "(StridedSlice) computes" in sliced
    assert "reads the matrix's diagonal along its rows or columns" in scaled
