"""tape_check: a function called under a GradientTape outside it runs a forward and a backward of
TensorFlow's making, which the hook never sees; the first such call checks them against the limit.

A Gaussian mixture's negative log-likelihood, N = 4000 points, K = 16 components, D = 32 (its
[N, K, D] broadcast is 8.2 MB; 9.0 MB as written by XLA's figure).  Under 3 MB the splitter brings
the function's own program to 2.6 MB, within, but under a tape its forward keeps what the backward
reads: 3.7 MB by XLA's figure.  Before, nothing was said.
"""

import math
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from tf_memsafe import xla_flags

N, K, D = 4000, 16, 32


@pytest.fixture(scope="module")
def mixture():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((N, D)).astype(np.float32))
    means = tf.Variable(rng.standard_normal((K, D)).astype(np.float32))
    log_vars = tf.Variable(np.zeros((K, D), np.float32))

    def nll(x):
        diff = x[:, None, :] - means[None]
        log_prob = -0.5 * tf.reduce_sum(diff ** 2 * tf.exp(-log_vars)[None] + log_vars[None] + math.log(2 * math.pi),
                                        -1)
        return -tf.reduce_mean(tf.reduce_logsumexp(log_prob, axis=1))

    return nll, x, [means, log_vars]


def said(caught):
    return [str(w.message) for w in caught if "GradientTape outside" in str(w.message)]


def planned(fn, limit: str):
    """``fn`` as a jit function traced from now on under ``limit``."""
    tf_memsafe.enable(memory_limit=limit)
    return tf.function(fn, jit_compile=True)


def under_tape(fn, x, weights):
    """``fn(x)`` called under a tape outside it, and its gradients with respect to ``weights``."""
    with tf.GradientTape() as tape:
        loss = fn(x)
    return loss, tape.gradient(loss, weights)


def test_a_forward_kept_for_a_tape_outside_over_the_limit_is_said_once(mixture):
    nll, x, weights = mixture
    fn = planned(nll, "3MB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(x)                                                      # no tape: its own program, 2.6 MB
        assert not said(caught) and not caught
        for _ in range(2):
            _, grads = under_tape(fn, x, weights)
    (message,) = said(caught)
    assert "`nll` called under a GradientTape outside it runs a forward of 3.7 MB" in message, message
    assert "over its limit of 3.0 MB" in message and "Take the gradient inside the function" in message
    tf_memsafe.disable()
    for got, want in zip(grads, under_tape(tf.function(nll, jit_compile=True), x, weights)[1]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_the_pair_checked_is_the_pair_tensorflow_runs(mixture):
    """The check builds the pair through TensorFlow's own cache: the backward the tape then runs is the
    one measured (a second pair built beside TensorFlow's appended the side outputs to the function's
    graph again, and the backward run took each twice: 2.93 MB where 2.06 MB)."""
    nll, x, weights = mixture
    fn = planned(nll, "3MB")
    fn(x)
    pair = tf_memsafe.tape_footprint(nll, x)
    with warnings.catch_warnings(), xla_flags.dump_all_compiles(in_memory=True) as folder:
        warnings.simplefilter("ignore")
        under_tape(fn, x, weights)
        ran = dict(xla_flags.memory_reports(folder))
    (backward,) = [b for name, b in ran.items() if "backward" in name]
    assert backward <= 1.02 * pair.backward, (ran, pair)


def test_a_pair_within_the_limit_is_not_said(mixture):
    nll, x, weights = mixture
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        under_tape(planned(nll, "5MB"), x, weights)
    assert not said(caught)
