"""A t-SNE gradient step written the usual way (van der Maaten's: squared distances of the embedding
by ``x @ x^T``, Student-t affinities, each normalised by their total, the KL divergence from fixed
affinities ``P``, the embedding's gradient by the tape), in float64 over 1,200 points.

Every [1200, 1200] matrix is 11.5 MB; ``P`` is an argument, and the limit is 1.5 times it.  The
affinities are read by their total and again by the divergence: each region computes its own slices
of them (and of the distances' product), so the total is one loop over the rows and the divergence
with its gradients another.  Before, the divergence's region stopped at the affinities (read outside
it, by the total), and the program stayed at 2.7 times such a limit, with a warning.
"""

import warnings

import numpy as np
import tensorflow as tf

import tf_memsafe
from tests.xla_run import run_and_measure

N = 1200


def step(p, y):
    with tf.GradientTape() as tape:
        tape.watch(y)
        sum_y = tf.reduce_sum(tf.square(y), axis=1)
        d = sum_y[:, None] - 2.0 * tf.matmul(y, y, transpose_b=True) + sum_y[None, :]
        num = 1.0 / (1.0 + d) * (1.0 - tf.eye(N, dtype=tf.float64))      # q_ii = 0
        q = tf.maximum(num / tf.reduce_sum(num), 1e-12)
        kl = tf.reduce_sum(p * tf.math.log(tf.maximum(p, 1e-12) / q))
    return kl, tape.gradient(kl, y)


def test_the_affinities_total_and_the_divergence_are_each_a_loop_over_the_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 10))
    sq = (x ** 2).sum(1)
    affinity = np.exp(-np.maximum(sq[:, None] + sq[None] - 2 * x @ x.T, 0) / 50.0)
    np.fill_diagonal(affinity, 0)
    affinity /= affinity.sum(1, keepdims=True)
    p = tf.constant((affinity + affinity.T) / (2 * N))
    y = tf.constant(1e-2 * rng.standard_normal((N, 2)))
    # (XLA's figures of the very programs run: tests/xla_run.py)
    want, naive = run_and_measure(tf.function(step, jit_compile=True), p, y)
    limit = int(1.5 * N * N * 8)
    assert naive > 4 * limit, naive
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_memsafe.enable(limit)
        try:
            got, after = run_and_measure(tf.function(step, jit_compile=True), p, y)
        finally:
            tf_memsafe.disable()
    said = [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]
    assert after <= limit and not said, (after, limit, said)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10, atol=1e-16)
