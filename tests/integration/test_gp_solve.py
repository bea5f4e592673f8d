"""A Gaussian process' loss written by hand, the ordinary way: ``tf.linalg.solve`` and ``logdet`` of
``K + σ² I``, its gradients by a tape inside the function.

N = 700 float64 points in 5 dimensions: the [N, N, 5] differences are 19.6 MB, each [N, N] matrix
3.9 MB, and XLA's figure for the step 52.6 MB.  Under 6 MB the limit cannot be met (the solve's LU,
the Cholesky of ``logdet`` and their gradients hold several [N, N] matrices at once); what can be
split is.  Before ``MatrixSolve`` had a byte rule, the memory model could not count the program and
every best effort was refused: the step was left as written, 52.6 MB, with a warning.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from tests.xla_run import run_and_measure

N, D = 700, 5


def gp_step():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(size=(N, D)))
    y = tf.constant(rng.normal(size=(N, 1)))
    log_lengthscales = tf.Variable(tf.zeros([D], tf.float64))
    log_noise = tf.Variable(tf.constant(-1.0, tf.float64))

    def step():
        with tf.GradientTape() as tape:
            d = (x[:, None] - x[None]) / tf.exp(log_lengthscales)
            k = tf.exp(-0.5 * tf.reduce_sum(tf.square(d), -1)) + tf.exp(2 * log_noise) * tf.eye(N, dtype=tf.float64)
            loss = 0.5 * tf.reduce_sum(y * tf.linalg.solve(k, y)) + 0.5 * tf.linalg.logdet(k)
        return loss, tape.gradient(loss, [log_lengthscales, log_noise])

    return step


def test_a_loss_with_a_solve_is_split_as_far_as_it_can_be_with_the_same_gradients():
    step = gp_step()
    # (XLA's figures of the very programs run: tests/xla_run.py)
    (loss, grads), written = run_and_measure(tf.function(step, jit_compile=True))
    tf_memsafe.enable(memory_limit="6MB")
    with pytest.warns(RuntimeWarning, match=r"over its limit of 6\.0 MB"):
        (got_loss, got_grads), after = run_and_measure(tf.function(step, jit_compile=True))
    assert tf_memsafe.reports()[-1].status == "rewritten"
    assert after < 0.7 * written, (after, written)            # 33.0 MB of 52.6 MB
    np.testing.assert_allclose(got_loss, loss, rtol=1e-10)
    for got, expected in zip(got_grads, grads):
        np.testing.assert_allclose(got, expected, rtol=1e-8)
