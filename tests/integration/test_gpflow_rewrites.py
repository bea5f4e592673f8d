"""GPflow's SGPR through tf_memsafe's rewrites: same loss, smaller XLA program.

GPflow 2.11's stationary kernels already compute distances in the matmul form
(``gpflow.utilities.ops.square_distance``), so a stock ``SquaredExponential`` gives
``pairwise_distance`` nothing to do; that is checked below too.  Users' own kernels are often
written the naive way; ``NaiveARDSquaredExponential`` is such a kernel, with ARD lengthscales
applied after the difference.  With N = 2000 data points, M = 50 inducing points and D = 40
features in float64, its ``Kuf`` broadcast is [50, 2000, 40] x 8 B = 32 MB and ``Kuu``'s
[50, 50, 40] x 8 B = 0.8 MB; rewritten, ``Kuf`` is a [50, 2000] x 8 B = 0.8 MB matrix.
"""

import gpflow
import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pairwise_distance import PairwiseDistance
from grappler_ext.pipeline import Pipeline
from tf_memsafe import hook

N, M, D = 2000, 50, 40
# Below the naive program's 32 MB broadcast: rewrites made for memory run only on programs over their
# limit (grappler_ext.guard).
LIMIT = "16MB"


class NaiveARDSquaredExponential(gpflow.kernels.Kernel):
    """k(x, y) = s^2 exp(-|(x - y) / l|^2 / 2), written with the [.., N, M, D] broadcast."""

    def __init__(self, dim):
        super().__init__()
        self.variance = gpflow.Parameter(1.3, transform=gpflow.utilities.positive())
        self.lengthscales = gpflow.Parameter(np.linspace(2.0, 6.0, dim), transform=gpflow.utilities.positive())

    def K(self, X, X2=None):
        X2 = X if X2 is None else X2
        r2 = tf.reduce_sum(tf.square((X[:, None, :] - X2[None, :, :]) / self.lengthscales), -1)  # [N, M]
        return self.variance * tf.exp(-0.5 * r2)

    def K_diag(self, X):
        return tf.fill(tf.shape(X)[:-1], tf.squeeze(self.variance))


def sgpr(kernel):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, D))
    Y = np.sin(X[:, :1]) + 0.1 * rng.standard_normal((N, 1))
    return gpflow.models.SGPR((X, Y), kernel=kernel, inducing_variable=X[::N // M].copy())


def rewrites():
    return [r for rep in tf_memsafe.reports() for r in rep.records if r.action == "rewritten"]


def loss_and_grads(model):
    """The training loss and its gradients with the tape outside the jit function (two XLA programs)."""
    loss_fn = tf.function(model.training_loss, jit_compile=True)
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


class TestNaiveKernelSGPR:
    def test_loss_and_gradients_agree_and_the_distances_are_rewritten(self):
        model = sgpr(NaiveARDSquaredExponential(D))
        expected, expected_grads = loss_and_grads(model)
        tf_memsafe.enable(LIMIT, strict=True)
        with hook.use_pipeline(Pipeline([PairwiseDistance()])):
            got, got_grads = loss_and_grads(model)
        reasons = sorted(r.reason for r in rewrites())
        assert reasons == ["[50] x [2000] distances over D = 40 as a matmul",
                           "[50] x [50] distances over D = 40 as a matmul, one norm (a tensor against itself)"]
        np.testing.assert_allclose(got, expected, rtol=1e-10)
        for g, e in zip(got_grads, expected_grads):
            np.testing.assert_allclose(g, e, rtol=1e-8, atol=1e-10)

    def test_footprint_drops_by_the_kuf_broadcast(self):
        model = sgpr(NaiveARDSquaredExponential(D))
        tf_memsafe.enable(LIMIT)
        with hook.use_pipeline(Pipeline([PairwiseDistance()])):
            before = tf_memsafe.memory_footprint(model.training_loss, rewrite=False)
            after = tf_memsafe.memory_footprint(model.training_loss)
        assert before >= M * N * D * 8                    # the [50, 2000, 40] f64 broadcast
        assert before - after >= 0.9 * M * N * D * 8      # ... is what disappears

    def test_within_its_limit_it_is_left_as_written(self):
        """Under 1 GB the naive kernel's program fits: no rewrite, the same figure (issue 29)."""
        model = sgpr(NaiveARDSquaredExponential(D))
        tf_memsafe.enable("1GB")
        with hook.use_pipeline(Pipeline([PairwiseDistance()])):
            before = tf_memsafe.memory_footprint(model.training_loss, rewrite=False)
            after = tf_memsafe.memory_footprint(model.training_loss)
        assert rewrites() == [] and after == before


def test_stock_squared_exponential_is_already_in_matmul_form():
    """GPflow's own kernel: nothing to rewrite, and the program is exactly what it was."""
    model = sgpr(gpflow.kernels.SquaredExponential(lengthscales=np.ones(D)))
    tf_memsafe.enable("1GB", strict=True)
    with hook.use_pipeline(Pipeline([PairwiseDistance()])):
        before = tf_memsafe.memory_footprint(model.training_loss, rewrite=False)
        after = tf_memsafe.memory_footprint(model.training_loss)
    assert rewrites() == []
    assert after == before


@pytest.fixture(autouse=True)
def _float64():
    with gpflow.config.as_context(gpflow.config.Config(float=np.float64, jitter=1e-6)):
        yield


def test_tape_footprint_of_sgpr_needs_a_run_and_gets_one():
    """SGPR's backward rebuilds a diagonal whose shape XLA needs as a value at compile time, so
    compiling from shapes fails; tape_footprint then runs the loss once under a tape (documented)."""
    model = sgpr(gpflow.kernels.SquaredExponential(lengthscales=np.ones(D)))
    figures = tf_memsafe.tape_footprint(model.training_loss)
    assert figures.forward >= N * D * 8 and figures.backward >= M * N * 8
    assert figures.total == figures.forward + figures.backward
