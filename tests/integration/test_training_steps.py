"""Whole training steps with the tape inside the compiled function (issue 8): forward, backward and
an Adam update in one ``tf.function``, rewritten under a memory limit, against the step as written.

Four losses a user writes naively, each over a large pairwise matrix, in float64 so that the split
step (which only reassociates sums, or rescales an online softmax) is compared at 1e-10:

* kernel regression, ``K(X, Z) w`` with an ARD squared-exponential kernel written with
  broadcasting, trainable lengthscales, inducing inputs and weights, MSE loss;
* a soft nearest-neighbour (prototype) loss: softmax over negative squared distances between an
  embedded batch and many trainable prototypes, sparse cross-entropy;
* self-attention with a causal mask (the tutorial's spelling: scores divided by sqrt(d), an additive
  band-part mask) and with a padding mask (Keras's spelling: query pre-scaled, keys dropped by a
  boolean [B, L] mask through ``tf.where``);
* a contrastive logsumexp loss over all pairs of a batch's two projected views.

Each case's docstring works out its bytes: the naive step needs 10-50x the case's limit (XLA's
"Total bytes used", measured); the rewritten step must fit the limit.  Every numerical test also
asserts that the splitter rewrote the step and rebuilt the tape's gradient on it, so none can pass
by leaving the step alone.  The jit-compiled Adam steps, as written and rewritten, are run once per
case (the ``jit_adam`` fixture) for both the Adam test and the test of XLA's figure.

The loss-and-gradients test without XLA (``jit=False``, ``rewrite_non_jit``) is ``heavy`` (about 4 s
a case, 20 s in all; ``python -m tests -m heavy`` runs it): the same loss rewritten without XLA, its
gradient rebuilt, is test_variables_equal_after_three_adam_steps[<case>-False]'s, which compares the
loss of three steps and Adam's slots (the gradients' moments) and variables at 1e-10; the gradients
as the function's outputs are test_loss_and_every_gradient_equal_to_the_step_as_written[<case>-True]'s.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tf_memsafe
from tests.xla_run import run_and_measure
from tf_memsafe import hook

pytestmark = pytest.mark.slow

STEPS = 3


class KernelRegression:
    """K(X, Z) w, MSE, with K an ARD squared exponential written with broadcasting.

    N = 2000 points, M = 1000 inducing inputs, D = 3, P = 2 outputs, float64: K is [2000, 1000] =
    16 MB and the backward's [N, M, D] difference (for the lengthscales and Z) 48 MB; the naive
    step holds several of them (128 MB measured).  Limit 8 MB: the splitter computes K in slices of
    the data and the rebuilt backward recomputes them.
    """

    limit = 8 * 10**6
    N, M, D, P = 2000, 1000, 3, 2

    def __init__(self, dtype=tf.float64):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.N, self.D))
        self.inputs = (tf.constant(x, dtype), tf.constant(np.sin(x[:, :self.P]), dtype))
        self.initial = [rng.uniform(0.5, 1.5, self.D),                       # lengthscales [D]
                        rng.standard_normal((self.M, self.D)),               # inducing inputs Z [M, D]
                        rng.standard_normal((self.M, self.P)) / self.M]      # weights w [M, P]
        self.dtype = dtype

    def loss(self, variables, x, y):
        lengthscales, z, w = variables
        diff = (x[:, None, :] - z[None, :, :]) / lengthscales                # [N, M, D]
        k = tf.exp(-0.5 * tf.reduce_sum(tf.square(diff), -1))                # [N, M]
        return tf.reduce_mean(tf.square(k @ w - y))


class SoftNearestNeighbour:
    """Cross-entropy of a softmax over negative squared distances to K trainable prototypes.

    B = 500 queries embedded by a trainable [D, D] map, K = 2000 prototypes, D = 8, float64: the
    logits are [500, 2000] = 8 MB and the backward's [B, K, D] difference 64 MB (80 MB measured).
    Limit 4 MB: the splitter computes the loss in slices of the batch.
    """

    limit = 4 * 10**6
    B, K, D = 500, 2000, 8

    def __init__(self, dtype=tf.float64):
        rng = np.random.default_rng(1)
        self.inputs = (tf.constant(rng.standard_normal((self.B, self.D)), dtype),
                       tf.constant(rng.integers(0, self.K, self.B)))
        self.initial = [np.eye(self.D) + 0.1 * rng.standard_normal((self.D, self.D)),   # embedding [D, D]
                        rng.standard_normal((self.K, self.D))]                          # prototypes [K, D]
        self.dtype = dtype

    def loss(self, variables, x, labels):
        embedding, prototypes = variables
        e = x @ embedding                                                    # [B, D]
        d = tf.reduce_sum(tf.square(e[:, None, :] - prototypes[None, :, :]), -1)  # [B, K]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, -d))


class Attention:
    """Single-head self-attention, MSE against a target, with trainable query/key/value maps.

    B = 2 sequences of L = 1024, d = 32, float64: the scores are [2, 1024, 1024] = 16.8 MB, and the
    step holds several such (scores, probabilities, their gradients; measured: 61 MB causal, 53 MB
    padding).  Limit 5 MB: the splitter computes the attention in slices of the queries (the
    inputs, q, k, v and their gradients, over 4 MB, stay whole).

    ``mask="causal"``: the TensorFlow tutorial's spelling, ``q k^T / sqrt(d)`` plus
    ``-1e9 * (1 - band_part(ones))``.  ``mask="padding"``: Keras's spelling, ``(q / sqrt(d)) k^T``
    with the keys beyond each sequence's length dropped by ``tf.where`` on a boolean [B, L] mask
    (the second sequence's last quarter is padding).
    """

    limit = 5 * 10**6
    B, L, D = 2, 1024, 32

    def __init__(self, mask, dtype=tf.float64):
        rng = np.random.default_rng(2)
        self.mask = mask
        lengths = np.array([self.L, 3 * self.L // 4])                        # [B]
        self.inputs = (tf.constant(rng.standard_normal((self.B, self.L, self.D)), dtype),
                       tf.constant(rng.standard_normal((self.B, self.L, self.D)), dtype),
                       tf.constant(np.arange(self.L)[None, :] < lengths[:, None]))   # [B, L] bool
        self.initial = [rng.standard_normal((self.D, self.D)) / np.sqrt(self.D) for _ in range(3)]
        self.dtype = dtype

    def loss(self, variables, x, target, keep):
        w_q, w_k, w_v = variables
        q, k, v = x @ w_q, x @ w_k, x @ w_v                                  # [B, L, d] each
        scale = tf.math.sqrt(tf.cast(self.D, x.dtype))
        if self.mask == "causal":
            scores = tf.matmul(q, k, transpose_b=True) / scale               # [B, L, L]
            future = 1 - tf.linalg.band_part(tf.ones((self.L, self.L), x.dtype), -1, 0)  # [L, L]
            scores += future * -1e9
        else:
            scores = tf.matmul(q / scale, k, transpose_b=True)               # [B, L, L]
            scores = tf.where(keep[:, None, :], scores, tf.constant(-1e9, x.dtype))
        out = tf.nn.softmax(scores, axis=-1) @ v                             # [B, L, d]
        return tf.reduce_mean(tf.square(out - target))


class ContrastiveLogSumExp:
    """InfoNCE over all pairs: mean_i logsumexp_j(s a_i . b_j) - mean_i s a_i . b_i, with a = x W,
    b = y W and a trainable log scale s.

    N = 2000 pairs, D = 8, float64: the pairwise matrix is [2000, 2000] = 32 MB, and the step
    holds it with its softmax (the logsumexp's gradient; 96 MB measured).  Limit 4 MB: the splitter
    computes the logsumexp in slices of the rows.
    """

    limit = 4 * 10**6
    N, D = 2000, 8

    def __init__(self, dtype=tf.float64):
        rng = np.random.default_rng(3)
        x = rng.standard_normal((self.N, self.D))
        self.inputs = (tf.constant(x, dtype), tf.constant(x + 0.5 * rng.standard_normal(x.shape), dtype))
        self.initial = [np.eye(self.D) + 0.1 * rng.standard_normal((self.D, self.D)),   # projection W [D, D]
                        np.array(0.5)]                                                  # log scale s []
        self.dtype = dtype

    def loss(self, variables, x, y):
        projection, log_scale = variables
        a, b = x @ projection, y @ projection                                # [N, D] each
        logits = tf.exp(log_scale) * tf.matmul(a, b, transpose_b=True)       # [N, N]
        positive = tf.exp(log_scale) * tf.reduce_sum(a * b, -1)              # [N]
        return tf.reduce_mean(tf.reduce_logsumexp(logits, -1)) - tf.reduce_mean(positive)


CASES = {
    "kernel_regression": KernelRegression,
    "soft_nearest_neighbour": SoftNearestNeighbour,
    "causal_attention": lambda: Attention("causal"),
    "padding_attention": lambda: Attention("padding"),
    "contrastive_logsumexp": ContrastiveLogSumExp,
}


@pytest.fixture(params=list(CASES), scope="module")
def case(request):
    return CASES[request.param]()


def fresh_variables(case):
    return [tf.Variable(value, dtype=case.dtype) for value in case.initial]


def loss_and_grads_fn(case, variables):
    def loss_and_grads(*inputs):
        with tf.GradientTape() as tape:
            loss = case.loss(variables, *inputs)
        return loss, tape.gradient(loss, variables)

    return loss_and_grads


def adam_step_fn(case, variables):
    """Loss, gradients (tape inside) and Adam's update; the optimizer's slots are created here."""
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(variables)

    def adam_step(*inputs):
        with tf.GradientTape() as tape:
            loss = case.loss(variables, *inputs)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    return adam_step, optimizer


def splitter_records():
    return [r for rep in tf_memsafe.reports() for r in rep.records if r.pass_name == "splitter"]


def assert_rebuilt_by_the_splitter(records=None):
    """The splitter rewrote the step and rebuilt the tape's gradient on the split forward (by its
    ``records``: those of the reports kept now, without them)."""
    records = splitter_records() if records is None else records
    rebuilt = [r for r in records if r.action == "rewritten" and r.plan.rebuilt_gradients]
    assert rebuilt, [f"{r.action}: {r.reason}" for r in records]


def assert_close(got, expected, rtol=1e-10):
    """Relative to each tensor's norm: a gradient's tiny entries carry the absolute error of its big ones."""
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected), strict=True):
        g, e = np.asarray(g), np.asarray(e)
        assert g.shape == e.shape
        assert np.linalg.norm(g - e) <= rtol * np.linalg.norm(e), (np.linalg.norm(g - e) / np.linalg.norm(e), g, e)


@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=pytest.mark.heavy)])
def test_loss_and_every_gradient_equal_to_the_step_as_written(case, jit):
    """``jit=False`` is ``heavy`` (see the module's docstring: the Adam test's ``jit=False`` case checks it)."""
    naive = tf.function(loss_and_grads_fn(case, fresh_variables(case)), jit_compile=jit)
    expected = naive(*case.inputs)
    tf_memsafe.enable(case.limit, strict=True, rewrite_non_jit=True)
    split = tf.function(loss_and_grads_fn(case, fresh_variables(case)), jit_compile=jit)
    got = split(*case.inputs)
    assert_rebuilt_by_the_splitter()
    assert all(g is not None for g in got[1])
    assert_close(got, expected)


def three_adam_steps(case, jit, enabled):
    """Three Adam steps from the case's start, as written or (``enabled``) rewritten under its limit: the
    losses, the variables, the optimizer's variables, XLA's figure for the first call's program (with
    ``jit``: tests/xla_run.py) and the splitter's records."""
    mark = hook.report_mark()
    if enabled:
        tf_memsafe.enable(case.limit, strict=True, rewrite_non_jit=True, verify=True)
    try:
        variables = fresh_variables(case)
        step, optimizer = adam_step_fn(case, variables)
        step = tf.function(step, jit_compile=jit)
        first, figure = run_and_measure(step, *case.inputs) if jit else (step(*case.inputs), None)
        losses = [float(first)] + [float(step(*case.inputs)) for _ in range(STEPS - 1)]
    finally:
        tf_memsafe.disable()
    records = [r for rep in hook.reports_since(mark) for r in rep.records if r.pass_name == "splitter"]
    return {"losses": losses, "variables": [v.numpy() for v in variables],
            "slots": [v.numpy() for v in optimizer.variables()], "bytes": figure, "records": records}


@pytest.fixture(scope="module")
def jit_adam(case):
    """The jit-compiled Adam step as written and rewritten (``three_adam_steps``), once per case: read by
    test_variables_equal_after_three_adam_steps[<case>-True] and test_whole_step_fits_the_limit_and_runs.
    (A module fixture is made before the tests' own set-up: it disables tf_memsafe itself, and turns
    the verifier on as conftest's does.)"""
    tf_memsafe.disable()
    return {"naive": three_adam_steps(case, True, False), "split": three_adam_steps(case, True, True)}


@pytest.mark.parametrize("jit", [True, False])
def test_variables_equal_after_three_adam_steps(case, jit, request):
    """The update reads the rebuilt gradients; Adam's slots and the variables end as unrewritten."""
    if jit:
        naive, split = request.getfixturevalue("jit_adam").values()
    else:
        naive, split = three_adam_steps(case, False, False), three_adam_steps(case, False, True)
    assert_rebuilt_by_the_splitter(split["records"])
    np.testing.assert_allclose(split["losses"], naive["losses"], rtol=1e-10)
    assert naive["losses"][-1] != naive["losses"][0]                         # the steps did train
    assert_close(split["variables"], naive["variables"])
    assert_close(split["slots"], naive["slots"])


def test_whole_step_fits_the_limit_and_runs(case, jit_adam):
    """XLA's figure for the whole Adam step (tape inside): naive > 10x the limit, rewritten within it;
    the rewritten step ran, to a finite loss, and moved every variable."""
    naive, split = jit_adam["naive"], jit_adam["split"]
    assert_rebuilt_by_the_splitter(split["records"])
    assert naive["bytes"] > 10 * case.limit, f"the case must need splitting: {naive['bytes']:,} B"
    assert split["bytes"] <= case.limit, (f"{split['bytes']:,} B over the limit of {case.limit:,} B",
                                          [f"{r.action}: {r.reason}" for r in split["records"]])
    assert np.isfinite(split["losses"][0])
    assert all(not np.array_equal(v, np.asarray(i)) for v, i in zip(split["variables"], case.initial))
