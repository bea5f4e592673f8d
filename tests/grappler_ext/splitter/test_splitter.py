"""splitter: whole programs brought under the limit by loops over slices, with the same results.

Sizes, worked out: a [4000, 4000] f32 matrix is 64 MB; with a 16 MB limit the splitter must cut it
into slices of at most a few hundred rows.  Every footprint below is XLA's own "Total bytes used"
of the compiled program (forward and backward separately when the tape is outside).
"""

import itertools
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import memory_model, shapes
from grappler_ext.graph_query import ancestors, live_ops
from grappler_ext.pipeline import Pipeline, default_pipeline
from grappler_ext.printer import format_graph
from grappler_ext.splitter import (
    DEFAULT_TUNING,
    Code,
    Splitter,
    Tuning,
    analysis,
    chunk_plan,
    mechanism,
    policy,
    search_budget,
)
from grappler_ext.splitter.chunk_plan import ChunkPlan
from tests.fakes import FakeMeasurer, raises
from tests.xla_run import run_and_measure
from tf_memsafe import hook
from tf_memsafe.memory import MeasurementError, XlaMeasurer

LIMIT = 16 * 10**6
RNG = np.random.default_rng(0)


def points(n, d, dtype=tf.float32, seed=0):
    return tf.constant(np.random.default_rng(seed).standard_normal((n, d)), dtype)


def sq_dist(x, y):
    return tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)        # [N, M], fused at d = 3


def knn_l2(x, y):
    return tf.math.top_k(-sq_dist(x, y), k=5).indices                          # [N, 5]


def knn_l1(x, y):
    return tf.math.top_k(-tf.reduce_sum(tf.abs(x[:, None] - y[None]), -1), k=3)  # values and indices


def logsumexp(x, y):
    return tf.reduce_logsumexp(-sq_dist(x, y), axis=1)                         # [N]


def attention(q, k, v):
    scores = tf.matmul(q, k, transpose_b=True) / 8.0                           # [L, S]
    return tf.nn.softmax(scores, axis=-1) @ v                                  # [L, D]


def masked_attention(q, k, v):
    scores = tf.matmul(q, k, transpose_b=True) / 8.0                           # [L, S]
    causal = tf.linalg.band_part(tf.ones(scores.shape), -1, 0)                 # [L, S] lower triangle
    scores = tf.where(causal > 0, scores, -1e9)
    return tf.nn.softmax(scores, axis=-1) @ v


def two_attentions(q, k, v, a, b, c):
    return tf.reduce_sum(attention(q, k, v)) + tf.reduce_sum(attention(a, b, c))


TWO_SPECS = (tf.TensorSpec([1300, 64]),) * 3 + (tf.TensorSpec([1000, 64]),) * 3


def large_output(x, y):
    """The output [N, M] fits; the naive [N, M, 64] intermediate (without pairwise_distance) does not."""
    return tf.exp(-tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1))


def chain_with_large_middle(a, b, c):
    return (a @ b) @ c                                                         # [N, J] [J, N] [N, P]: [N, N] middle


LENGTHSCALE = tf.Variable(1.3, dtype=tf.float64)


def kernel_matvec(x, y, v):
    k = tf.exp(-0.5 * sq_dist(x, y) / LENGTHSCALE**2)                          # [N, M]
    return k @ v                                                               # [N, P]


def as_written_and_split(written: int, split: int) -> FakeMeasurer:
    """A measurer whose figure is ``split`` for a program with a loop of the splitter's, else ``written``."""
    def figure(graph):
        return split if any(op.type in ("While", "StatelessWhile") for op in live_ops(graph)) else written

    return FakeMeasurer(program=figure)


def splitter_only(measurer=None):
    return hook.use_pipeline(Pipeline([Splitter(measurer or XlaMeasurer())]))


def rewrites():
    return [r for rep in tf_memsafe.reports() for r in rep.records if r.action == "rewritten"]


def skips():
    return [r for rep in tf_memsafe.reports() for r in rep.records if r.action == "skipped"]


def assert_same(got, expected, dtype):
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        if g.dtype.is_integer:
            np.testing.assert_array_equal(g, e)
        else:
            # (absolute error scaled by the largest value: a float32 product over 4,000 terms summed in
            # another order -- a chunk's own Eigen blocking -- is 3e-4 off on values of 400 on some CPUs)
            tol = 1e-10 if dtype == tf.float64 else 2e-5
            np.testing.assert_allclose(g, e, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(e), initial=0))))


CASES = {
    # name: (fn, args, dtype, limit); the naive program needs 10-20x the limit.
    "knn_l2": (knn_l2, (points(4000, 3), points(4000, 3, seed=1)), tf.float32, 4 * 10**6),
    "knn_l1": (knn_l1, (points(3000, 3), points(3000, 3, seed=1)), tf.float32, 3 * 10**6),
    "logsumexp": (logsumexp, (points(3000, 3, tf.float64), points(2000, 3, tf.float64, seed=1)), tf.float64,
                  4 * 10**6),
    "logsumexp_50x": (logsumexp, (points(3000, 3, tf.float64), points(2000, 3, tf.float64, seed=1)), tf.float64,
                      10**6),
    "attention": (attention, (points(4096, 64), points(4096, 64, seed=1), points(4096, 64, seed=2)), tf.float32,
                  64 * 10**5),
    "large_output": (large_output, (points(1000, 64), points(1000, 64, seed=1)), tf.float32, 25 * 10**6),
    "chain_with_large_middle": (chain_with_large_middle, (points(4000, 16), points(16, 4000, seed=1),
                                                          points(4000, 8, seed=2)), tf.float32, 4 * 10**6),
    "masked_attention": (masked_attention, (points(4096, 64), points(4096, 64, seed=1), points(4096, 64, seed=2)),
                         tf.float32, 64 * 10**5),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("jit", [True, False])
def test_forward_equal_and_within_the_limit(name, jit):
    fn, args, dtype, limit = CASES[name]
    call = run_and_measure if jit else lambda f, *a: (f(*a), None)      # (XLA's figure for the call's compile)
    expected, before = call(tf.function(fn, jit_compile=jit), *args)
    tf_memsafe.enable(limit, strict=True, rewrite_non_jit=True)
    with splitter_only():
        got, after = call(tf.function(fn, jit_compile=jit), *args)
        assert len(rewrites()) == 1
        if jit:
            assert before >= 10 * limit, "the case must need splitting"
            assert after <= limit
    assert_same(got, expected, dtype)


class TestKernelMatvecGradients:
    """K(x, y) v with a trainable lengthscale, tape outside: N = 3000, M = 2500 f64 is a 60 MB K.

    The forward is a loop over row slices; the backward recomputes the slices (smaller chunks,
    since a slice's gradient holds several slice-sized tensors).
    """

    x, y, v = points(3000, 3, tf.float64), points(2500, 3, tf.float64, seed=1), points(2500, 2, tf.float64, seed=2)

    def loss_and_grads(self, jit):
        f = tf.function(kernel_matvec, jit_compile=jit)
        with tf.GradientTape() as tape:
            tape.watch([self.x, self.y, self.v])
            out = f(self.x, self.y, self.v)
            loss = tf.reduce_sum(tf.sin(out))
        return out, tape.gradient(loss, [self.x, self.y, self.v, LENGTHSCALE])

    @pytest.mark.parametrize("jit", [True, False])
    def test_values_and_gradients_equal(self, jit):
        expected, expected_grads = self.loss_and_grads(jit)
        tf_memsafe.enable(LIMIT, strict=True, rewrite_non_jit=True)
        with splitter_only():
            got, got_grads = self.loss_and_grads(jit)
        assert len(rewrites()) == 1
        np.testing.assert_allclose(got, expected, rtol=1e-12)
        for g, e in zip(got_grads, expected_grads):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-10)

    def test_forward_and_backward_programs_each_within_the_limit(self):
        tf_memsafe.enable(LIMIT)
        before = tf_memsafe.tape_footprint(kernel_matvec, self.x, self.y, self.v, rewrite=False)
        with splitter_only():
            after = tf_memsafe.tape_footprint(kernel_matvec, self.x, self.y, self.v)
        assert before.forward > 10 * LIMIT and before.backward > 10 * LIMIT
        assert after.forward <= LIMIT and after.backward <= LIMIT


def test_the_remainder_slice_runs_after_the_loop(monkeypatch):
    """Chunks of 300 of 1000 rows (or 800 columns) leave a remainder, computed after the loop.  Its slices'
    offset is read from the loop's counter: with a constant offset XLA's scheduler was free to
    compute the remainder first and hold its tensors while the loop ran (seen in a Transformer's
    training step: two slices' worth at the peak)."""
    monkeypatch.setattr(chunk_plan, "plan_chunks",
                        lambda length, per_unit, fixed, budget: ChunkPlan(length, 300, int(fixed + 300 * per_unit)))
    x, y, v = points(1000, 3, tf.float64), points(800, 3, tf.float64, seed=1), points(800, 2, tf.float64, seed=2)
    expected = tf.function(kernel_matvec, jit_compile=True)(x, y, v)
    tf_memsafe.enable(10**6, strict=True, calibrate_chunks=False)     # the chunk stays the one forced
    with splitter_only():
        fn = tf.function(kernel_matvec, jit_compile=True)
        got = fn(x, y, v)
        graph = fn.get_concrete_function(x, y, v).graph
    (record,) = rewrites()
    plan = record.plan
    assert (plan.chunk, plan.tail, plan.length) in ((300, 100, 1000), (300, 200, 800)), record.reason
    live = live_ops(graph)            # (XLA's figure is over this tiny limit: plans undone stay, unreachable)
    loops = [op for op in live if op.type in ("While", "StatelessWhile")]
    tail = [op for op in live if op.type == "Slice" and op.name.startswith("tf_memsafe/splitter")
            and op.outputs[0].shape.rank == 2]                                  # not the anchor's scalar
    assert len(loops) == 1 and tail
    for op in tail:
        assert loops[0] in ancestors(list(op.inputs)), op.name
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_two_readers_reducing_the_same_axis_share_one_loop(monkeypatch):
    """K [N, M] read by a column sum and by K^T w, both reducing N: one loop, two sum combiners
    (SGPR's A A^T and A err have this shape).  N = 4000, M = 3000 f64: K is 96 MB.  (Only
    reductions are offered: slices of M, each result joined, would do as well here.)"""
    offered = analysis.root_options
    monkeypatch.setattr(analysis, "root_options",
                        lambda root, ignored=frozenset(): [o for o in offered(root, ignored) if o.kind != "concat"])
    x, y = points(4000, 3, tf.float64), points(3000, 3, tf.float64, seed=1)
    w = points(4000, 2, tf.float64, seed=2)

    def two_sums(x, y, w):
        k = tf.exp(-sq_dist(x, y))                                             # [N, M]
        return tf.reduce_sum(k, 0), tf.matmul(k, w, transpose_a=True)          # [M], [M, 2]

    def grads():
        f = tf.function(two_sums, jit_compile=True)
        with tf.GradientTape() as tape:
            tape.watch([x, y, w])
            a, b = f(x, y, w)
            loss = tf.reduce_sum(tf.sin(a)) + tf.reduce_sum(b**2)
        return (a, b), tape.gradient(loss, [x, y, w])

    expected, expected_grads = grads()
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only():
        got, got_grads = grads()
        after = tf_memsafe.memory_footprint(two_sums, x, y, w)
    reasons = {r.reason for r in rewrites()}  # the call's trace and the measurement's
    assert len(reasons) == 1 and "`Sum` sum over input 0 axis 0 and `MatMul` sum" in reasons.pop()
    for g, e in zip(got + tuple(got_grads), expected + tuple(expected_grads)):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-10)
    assert after <= LIMIT



def test_a_cholesky_solve_splits_along_its_right_hand_sides():
    """``tf.linalg.cholesky_solve`` (two triangular solves, the second adjoint) of 20000 right-hand
    sides built in the function, with its gradients taken inside: split along the columns, the
    [200, 200] factor read whole by every slice (issue 29); values and gradients equal."""
    rng = np.random.default_rng(4)
    m = rng.standard_normal((200, 203))
    chol = tf.constant(np.linalg.cholesky(m @ m.T / 200 + np.eye(200)))
    a, b = tf.constant(rng.standard_normal(200)), tf.constant(rng.standard_normal(20000))

    def fn(chol, a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            x = tf.linalg.cholesky_solve(chol, tf.cos(a[:, None] * b[None, :]))       # [200, 20000]
            loss = tf.reduce_sum(tf.square(x))
        return [loss] + tape.gradient(loss, [a, b])

    expected = tf.function(fn, jit_compile=True)(chol, a, b)
    tf_memsafe.enable(8 * 10**6, strict=True)                      # (32 MB a [200, 20000] tensor)
    got, after = run_and_measure(tf.function(fn, jit_compile=True), chol, a, b)    # (the call's compile)
    splits = [r for rep in tf_memsafe.reports() for r in rep.records
              if r.pass_name == "splitter" and r.action == "rewritten"]
    assert splits and all("axis 1" in r.reason for r in splits), [r.reason for r in splits]
    assert after <= 8 * 10**6
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12 * np.max(np.abs(e)))


def test_outputs_that_keep_the_split_axis_end_one_shared_loop():
    """A GP's predictive mean and variance at N test points, as GPflow computes them: T = L^-1 K(Z, X)
    is [M, N] (M = 200, N = 20000 f64: 32 MB) and is read by the mean T^T c and by the variance
    1 - sum(T^2, 0), both [N, ...] outputs.  Neither reduces N, so no single root can take T; one
    loop over slices of the test points computes both, each joined along N."""
    z, x = points(200, 3, tf.float64), points(20000, 3, tf.float64, seed=1)
    c = points(200, 1, tf.float64, seed=2)

    def predict(z, x, c):
        kzz = tf.exp(-sq_dist(z, z)) + 1e-6 * tf.eye(200, dtype=tf.float64)
        t = tf.linalg.triangular_solve(tf.linalg.cholesky(kzz), tf.exp(-sq_dist(z, x)), lower=True)  # [M, N]
        return tf.matmul(t, c, transpose_a=True), 1.0 - tf.reduce_sum(tf.square(t), 0)            # [N, 1], [N]

    def grads():
        f = tf.function(predict, jit_compile=True)
        with tf.GradientTape() as tape:
            tape.watch([z, x, c])
            mean, var = f(z, x, c)
            loss = tf.reduce_sum(tf.sin(mean)) + tf.reduce_sum(var**2)
        return (mean, var), tape.gradient(loss, [z, x, c])

    expected, expected_grads = grads()
    tf_memsafe.enable(4 * 10**6, strict=True)
    with splitter_only():
        got, got_grads = grads()
        after = tf_memsafe.memory_footprint(predict, z, x, c)
    reasons = {r.plan.describe() for r in rewrites()}
    assert reasons == {"`MatMul` concat over input 0 axis 0 and `Sub` concat"}, reasons
    assert all((r.bytes_before or 0) < 10**6 for r in skips())   # only [M, M] Kzz, too small to split
    for g, e in zip(got + tuple(got_grads), expected + tuple(expected_grads)):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12 * np.abs(e).max())
    assert after <= 4 * 10**6 < tf_memsafe.memory_footprint(predict, z, x, c, rewrite=False)


def sgpr_log_density(z, x, y, xs, ys):
    """SGPR's predictive log density as GPflow computes it (unit kernel variance and noise): the
    training side reduces [M, N] tensors to B and c; the test side reads K(Z, X*) [M, T] through two
    solves, the mean, the variance and the density, its [T] result 14 ops after K(Z, X*)."""
    m = z.shape[0]
    eye = tf.eye(m, dtype=z.dtype)
    chol = tf.linalg.cholesky(tf.exp(-sq_dist(z, z)) + 1e-6 * eye)
    a = tf.linalg.triangular_solve(chol, tf.exp(-sq_dist(z, x)))                    # [M, N]
    chol_b = tf.linalg.cholesky(tf.matmul(a, a, transpose_b=True) + eye)
    c = tf.linalg.triangular_solve(chol_b, a @ y)                                   # [M, 1]
    tmp1 = tf.linalg.triangular_solve(chol, tf.exp(-sq_dist(z, xs)))                # [M, T]
    tmp2 = tf.linalg.triangular_solve(chol_b, tmp1)                                 # [M, T]
    mean = tf.matmul(tmp2, c, transpose_a=True)[:, 0]                               # [T]
    var = 2.0 + tf.reduce_sum(tf.square(tmp2), 0) - tf.reduce_sum(tf.square(tmp1), 0)
    return -0.5 * (np.log(2 * np.pi) + tf.math.log(var) + tf.square(ys - mean) / var)


def test_the_test_points_side_of_a_predictive_density_is_one_loop():
    """After the training side's loop over N, the test side -- K(Z, X*) [M, T], both solves, the
    mean, the variance and the density -- is one loop over T, not a loop per solve.  M = 100,
    N = 20000, T = 6000 f64 under 12 MB: [M, N] is 16 MB, [M, T] 4.8 MB.  (GPflow's own graph, where
    the density lies beyond the first search for roots, is tested in tests/integration/test_sgpr.py.)"""
    args = (points(100, 3, tf.float64), points(20000, 3, tf.float64, seed=1), points(20000, 1, tf.float64, seed=2),
            points(6000, 3, tf.float64, seed=3), points(6000, 1, tf.float64, seed=4)[:, 0])
    limit = 12 * 10**6
    expected, before = run_and_measure(tf.function(sgpr_log_density, jit_compile=True), *args)
    tf_memsafe.enable(limit, strict=True)
    with splitter_only():
        got, after = run_and_measure(tf.function(sgpr_log_density, jit_compile=True), *args)
    reasons = sorted({r.plan.describe() for r in rewrites()})
    # (the test side's loop reaches on to the density itself, -0.5 * (..): the function's output)
    assert reasons == ["`MatMul` sum over input 0 axis 1, input 1 axis 1 and `MatMul` sum",
                       "`Mul` concat over input 0 axis 0"], reasons
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    assert after <= limit < before


def test_max_and_min_over_the_split_axis_with_ties_and_gradients(monkeypatch):
    """Column max and min of a [3000, 2000] f64 matrix (48 MB) whose entries tie often (rounded
    inputs): the split keeps the tie counts, so each tied element gets dy / T as unsplit.  (Only
    the row split is offered: slices of the columns, joined, would need no tie counts.)"""
    offered = analysis.root_options
    monkeypatch.setattr(analysis, "root_options",
                        lambda root, ignored=frozenset(): [o for o in offered(root, ignored) if o.kind != "concat"])
    x = tf.constant(np.round(np.random.default_rng(0).standard_normal((3000, 3)), 1))
    y = tf.constant(np.round(np.random.default_rng(1).standard_normal((2000, 3)), 1))

    def extremes(x, y):
        k = -sq_dist(x, y)                                                     # [N, M]
        return tf.reduce_max(k, axis=0), tf.reduce_min(tf.exp(k), axis=0)     # [M], [M]

    def grads():
        f = tf.function(extremes, jit_compile=True)
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            a, b = f(x, y)
            loss = tf.reduce_sum(tf.sin(a)) + tf.reduce_sum(b)
        return (a, b), tape.gradient(loss, [x, y])

    expected, expected_grads = grads()
    tf_memsafe.enable(8 * 10**6, strict=True)
    with splitter_only():
        got, got_grads = grads()
    (record,) = rewrites()
    assert "`Max` max over input 0 axis 0 and `Min` min" in record.reason
    for g, e in zip(got + tuple(got_grads), expected + tuple(expected_grads)):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


def test_nan_in_a_split_max_or_min_propagates_as_in_tensorflow(monkeypatch):
    """TensorFlow's reduce_max/min propagate NaN (eagerly, like NumPy), while XLA:CPU's skip it: the
    split program follows TensorFlow.  Column max and min of a [3000, 2000] f64 matrix (48 MB) with a
    NaN every 99,991 elements (61 NaNs in as many columns), over row slices: NaN exactly in those
    columns, every other column equal to TensorFlow's."""
    offered = analysis.root_options
    monkeypatch.setattr(analysis, "root_options",
                        lambda root, ignored=frozenset(): [o for o in offered(root, ignored) if o.kind != "concat"])
    x, y = points(3000, 3, tf.float64), points(2000, 3, tf.float64, seed=1)

    def extremes(x, y):
        k = -sq_dist(x, y)                                                     # [N, M]
        index = tf.range(3000)[:, None] * 2000 + tf.range(2000)[None, :]
        k = tf.where(tf.equal(index % 99991, 0), tf.constant(np.nan, tf.float64), k)
        return tf.reduce_max(k, axis=0), tf.reduce_min(tf.exp(k), axis=0)     # [M], [M]

    expected = extremes(x, y)                                                   # TensorFlow's, eagerly
    assert 50 < np.isnan(expected[0].numpy()).sum() < 100
    tf_memsafe.enable(8 * 10**6, strict=True)
    with splitter_only():
        got = tf.function(extremes, jit_compile=True)(x, y)
    (record,) = rewrites()
    assert record.plan.describe() == "`Max` max over input 0 axis 0 and `Min` min"
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.isnan(g.numpy()), np.isnan(e.numpy()))
        np.testing.assert_allclose(g, e, rtol=1e-12)                            # NaN where NaN


def output_and_grads(fn, q, k, v):
    """``fn(q, k, v)`` traced anew with ``jit_compile`` and the gradients of ``sum(sin(out))`` by a tape outside."""
    f = tf.function(fn, jit_compile=True)
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = f(q, k, v)
        loss = tf.reduce_sum(tf.sin(out))
    return out, tape.gradient(loss, [q, k, v])


def test_attention_split_along_the_keys_with_an_online_softmax(monkeypatch):
    """softmax(q k^T / 8) v with 64 queries and 20000 keys: scores [64, 20000] f64 = 10 MB.  Here
    only the key split is offered (row splits, which the planner prefers here, are withheld), so
    the loop runs over slices of the keys with the running max and normaliser."""
    offered = analysis.root_options
    monkeypatch.setattr(analysis, "root_options",
                        lambda root, ignored=frozenset(): [o for o in offered(root, ignored) if o.kind != "concat"])
    q, k, v = (points(n, 32, tf.float64, seed=s) for n, s in ((64, 0), (20000, 1), (20000, 2)))

    def cross_attention(q, k, v):
        return tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 8.0, axis=-1) @ v   # [64, 32]

    expected, expected_grads = output_and_grads(cross_attention, q, k, v)
    tf_memsafe.enable(16 * 10**6, strict=True)
    with splitter_only():
        got, got_grads = output_and_grads(cross_attention, q, k, v)
        after = tf_memsafe.memory_footprint(cross_attention, q, k, v)
    described = {r.plan.describe() for r in rewrites()}
    assert described == {"`MatMul` online_softmax over input 0 axis 1, input 1 axis 0"}
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    for g, e in zip(got_grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-12)
    assert after <= 16 * 10**6


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_online_softmax_backward_with_masks(monkeypatch, mask):
    """The online softmax's backward is FlashAttention-2's (the forward's row max and normaliser kept,
    each block of keys' probabilities recomputed once, dS = P (dP - rowsum(dO O))): its gradients
    equal the unsplit ones in float64 under a causal mask (a band, rebuilt per slice at its offset)
    and a padding mask (keys past a length read as -inf), masked rows' gradients included."""
    offered = analysis.root_options
    monkeypatch.setattr(analysis, "root_options",
                        lambda root, ignored=frozenset(): [o for o in offered(root, ignored) if o.kind != "concat"])
    n = 4000
    q, k, v = (points(n, 16, tf.float64, seed=s) for s in (3, 4, 5))

    def masked(q, k, v):
        scores = tf.matmul(q, k, transpose_b=True) / 4.0                              # [n, n]
        if mask == "causal":
            keep = tf.linalg.band_part(tf.ones([n, n], tf.float64), -1, 0) > 0
        else:
            keep = tf.range(n)[None, :] < 3 * n // 4
        scores = tf.where(keep, scores, tf.constant(-1e9, tf.float64))
        return tf.nn.softmax(scores, axis=-1) @ v

    expected, expected_grads = output_and_grads(masked, q, k, v)
    tf_memsafe.enable(48 * 10**6, strict=True)
    with splitter_only():
        got, got_grads = output_and_grads(masked, q, k, v)
    assert rewrites() and {root.kind for r in rewrites() for root in r.plan.roots} == {"online_softmax"}
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    for g, e in zip(got_grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-11)


def test_top_k_values_gradient_routes_to_the_selected_points():
    x, y = points(2000, 3, tf.float64), points(3000, 3, tf.float64, seed=1)

    def nearest_sum(x, y):
        return tf.reduce_sum(tf.math.top_k(-sq_dist(x, y), k=4).values)

    def grads():
        f = tf.function(nearest_sum, jit_compile=True)
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            loss = f(x, y)
        return loss, tape.gradient(loss, [x, y])

    expected, expected_grads = grads()
    tf_memsafe.enable(8 * 10**6, strict=True)
    with splitter_only():
        got, got_grads = grads()
    assert len(rewrites()) == 1
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    for g, e in zip(got_grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-9)


def test_default_pipeline_rewrites_the_distance_then_splits_the_matrix():
    """kNN at d = 64: pairwise_distance turns [4000, 4000, 64] (4 GB) into a matmul, the splitter
    then cuts the [4000, 4000] (64 MB) distance matrix into row slices."""
    x, y = points(4000, 64), points(4000, 64, seed=1)
    expected = tf.function(knn_l2, jit_compile=True)(x, y)
    tf_memsafe.enable(LIMIT, strict=True)
    with hook.use_pipeline(default_pipeline()):
        got, after = run_and_measure(tf.function(knn_l2, jit_compile=True), x, y)
    (report,) = tf_memsafe.reports()     # the call's trace
    assert sorted(r.pass_name for r in report.records if r.action == "rewritten") == [
        "pairwise_distance", "splitter"]
    # Near-ties between distances may order differently after the rewrite; nearly all agree.
    assert np.mean(got.numpy() == expected.numpy()) > 0.99
    assert after <= LIMIT


class TestChunksFromXlasFigure:
    """kNN at d = 64, N = M = 4000 under 16 MB: the memory model counts each of the slice's
    materialised [c, 4000] f32 tensors (the product, the distances, the negated scores) at once and
    keeps a margin, while XLA fuses them into one buffer: compiling the loop alone at two chunk
    sizes gives the bytes a row really costs (about 16 kB: one 4000-float row), so the chunks grow."""

    x, y = points(4000, 64), points(4000, 64, seed=1)

    def split(self, measurer=None, **options):
        tf_memsafe.enable(LIMIT, strict=True, **options)
        mark = hook.report_mark()
        with hook.use_pipeline(default_pipeline({"splitter": Splitter(measurer or XlaMeasurer())})):
            got, after = run_and_measure(tf.function(knn_l2, jit_compile=True), self.x, self.y)
        (record,) = [r for rep in hook.reports_since(mark) for r in rep.records
                     if r.pass_name == "splitter" and r.action == "rewritten"][:1]
        tf_memsafe.disable()
        return got, after, record.reason, record.plan.steps

    def test_larger_chunks_still_within_the_limit(self):
        expected = tf.function(knn_l2, jit_compile=True)(self.x, self.y)
        got, after, reason, steps = self.split()
        _, after_model, reason_model, steps_model = self.split(calibrate_chunks=False)
        assert "chunk from XLA's figure for the loop" in reason
        assert "XLA's figure" not in reason_model
        assert steps < steps_model and after_model < after <= LIMIT, (reason, reason_model, after, after_model)
        assert np.mean(got.numpy() == expected.numpy()) > 0.99

    def test_a_failed_measurement_keeps_the_models_chunk_and_says_so(self):
        expected = tf.function(knn_l2, jit_compile=True)(self.x, self.y)
        got, after, reason, steps = self.split(FakeMeasurer(function=raises(MeasurementError("no report"))))
        assert "chunk from the memory model (measuring the loop failed: MeasurementError)" in reason
        assert steps == self.split(calibrate_chunks=False)[3] and after <= LIMIT
        assert np.mean(got.numpy() == expected.numpy()) > 0.99

    def test_a_loop_that_is_the_program_fills_the_limit(self):
        """L1 kNN of 2000 queries among 20000 points at d = 3 under 16 MB: the inputs are 0.3 MB and
        the loop over points is all the program holds, so its chunk is sized from XLA's figure up to
        Tuning.whole_program_margin of the limit (checked by compiling at that chunk), as a person sizing the
        loop by hand would, not at the half of it the program-wide margins leave."""
        q, p = points(2000, 3), points(20000, 3, seed=1)

        def knn_l1(q, p):
            return tf.math.top_k(-tf.reduce_sum(tf.abs(q[:, None] - p[None]), -1), k=10).indices

        expected = tf.function(knn_l1, jit_compile=True)(q, p)
        tf_memsafe.enable(LIMIT, strict=True)
        mark = hook.report_mark()
        with hook.use_pipeline(default_pipeline({"splitter": Splitter(XlaMeasurer())})):
            got, after = run_and_measure(tf.function(knn_l1, jit_compile=True), q, p)
        records = {r.reason for rep in hook.reports_since(mark) for r in rep.records
                   if r.pass_name == "splitter" and r.action == "rewritten"}
        tf_memsafe.disable()
        (reason,) = records                                  # the call's trace: one plan
        assert "which is the program" in reason, reason
        assert 0.8 * LIMIT < after <= DEFAULT_TUNING.whole_program_margin * LIMIT, (after, reason)
        assert np.mean(got.numpy() == expected.numpy()) > 0.99


_RNG = np.random.RandomState(1)
_WQ, _WK, _WV = (tf.constant(_RNG.randn(16, 4, 16).astype(np.float32) / 4) for _ in range(3))
_WO = tf.constant(_RNG.randn(4, 16, 16).astype(np.float32) / 8)


def pooled_attention_step(x):
    """A four-head attention over [4, 512, 16] pooled into a head, with its gradient: the loop along the
    queries ends at the pooling (its result [4, 16] has a gradient of its own: a loop of its own computes
    the slices' gradients after the forward), its keys and values in its prologue."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        q, k, v = (tf.einsum("ble,ehd->blhd", x, w) for w in (_WQ, _WK, _WV))
        p = tf.nn.softmax(tf.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -1)
        y = tf.einsum("bqhd,hde->bqe", tf.einsum("bhqk,bkhd->bqhd", p, v), _WO)
        loss = tf.reduce_sum(tf.tanh(tf.matmul(tf.reduce_mean(tf.sin(y), axis=1), _WO[0])))
    return loss, tape.gradient(loss, x)


def test_a_gradient_loop_of_many_steps_is_sized_by_xlas_figure_for_it():
    """The model plans a gradient step at ``backward_cost_factor`` (5) times its count of a forward slice:
    256 steps of 2 rows here, each rewriting the keys' and values' gradients.  XLA's figures for the
    loop and its gradient alone at two chunks give about 67 kB a row, the forward's: the gradient in
    the forward's chunks of 8, within the limit, equal to the unsplit step (the model's plan is traced,
    not run)."""
    x = tf.constant(_RNG.randn(4, 512, 16).astype(np.float32))
    want, naive = run_and_measure(tf.function(pooled_attention_step, jit_compile=True), x)   # (the call's compile)
    limit = naive // 8
    plans, figures = {}, {}
    for name, tuning in (("figure", DEFAULT_TUNING), ("model", Tuning(backward_sizing_steps=10**9))):
        tf_memsafe.enable(limit, strict=True)
        mark = hook.report_mark()
        try:
            with hook.use_pipeline(hook.product_pipeline(tuning)):
                f = tf.function(pooled_attention_step, jit_compile=True)
                if name == "model":        # (planned only: the plan is what is compared)
                    f.get_concrete_function(x)
                else:
                    got, figures[name] = run_and_measure(f, x)
        finally:
            tf_memsafe.disable()
        (plans[name],) = [r.plan for rep in hook.reports_since(mark)[:1] for r in rep.records if r.code == Code.SPLIT]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6 * float(np.max(np.abs(w))))
    sized, model = plans["figure"], plans["model"]
    assert model.backward_bytes_per_row is None and model.backward_steps >= 4 * sized.backward_steps, model.render()
    assert sized.backward_bytes_per_row > 0 and sized.backward_chunk == sized.chunk, sized.render()
    assert "by XLA's figure for the loop and its gradient alone" in sized.render()
    assert figures["figure"] <= limit, (figures, limit)


class TestProgramsCheckedWithXla:
    """Attention over 1000 queries: the memory model counts 8.8 MB, between Tuning.check_from and
    model_trust of 16 MB, so the program is compiled whole (never run) before it is left alone."""

    specs = (tf.TensorSpec([1000, 64]),) * 3

    def trace(self, measurer=None, **options):
        hook.clear_reports()
        tf_memsafe.enable(LIMIT, strict=True, **options)
        with splitter_only(measurer):
            graph = tf.function(attention, jit_compile=True).get_concrete_function(*self.specs).graph
        tf_memsafe.disable()
        return graph, [r.reason for r in skips()], rewrites()

    def test_within_by_xlas_figure_too_is_left_alone_with_both_figures(self):
        plain = format_graph(tf.function(attention, jit_compile=True).get_concrete_function(*self.specs).graph)
        graph, (reason,), done = self.trace()
        figure = tf_memsafe.memory_footprint(attention, *self.specs, rewrite=False)
        assert format_graph(graph) == plain and done == []
        assert reason.startswith("already within the limit") and f"(memory model; XLA's figure {figure:,} B)" in reason

    def test_over_by_xlas_figure_is_split_against_the_scaled_limit(self):
        twice = as_written_and_split(2 * LIMIT, LIMIT // 2)            # as if XLA needed twice the limit
        q, k, v = (points(1000, 64, seed=s) for s in range(3))
        expected = tf.function(attention, jit_compile=True)(q, k, v)
        graph, reasons, done = self.trace(twice)
        (checked,) = [r for r in reasons if "XLA's figure for the program as written" in r]
        model = memory_model.estimate(tf.function(attention, jit_compile=True).get_concrete_function(
            *self.specs).graph).peak_bytes
        assert f"is {2 * LIMIT:,} B: planned against {LIMIT * model // (2 * LIMIT):,} B" in checked
        assert len(done) == 1
        tf_memsafe.enable(LIMIT, strict=True)
        with splitter_only():
            got = tf.function(attention, jit_compile=True)(q, k, v)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)

    def test_off_or_failed_the_models_word_stands(self):
        twice = FakeMeasurer(program=lambda graph: 2 * LIMIT)
        _, (reason,), done = self.trace(twice, check_programs=False)
        assert twice.calls == [] and done == [] and reason.endswith("(memory model)")
        _, (reason,), done = self.trace(FakeMeasurer(program=raises(MeasurementError("no report"))))
        assert done == [] and "(memory model; not checked with XLA: MeasurementError: no report)" in reason

    def test_after_a_split_the_models_word_is_checked_too(self):
        """Two attentions, over 1300 and 1000 queries: the model counts the program within the limit
        once the larger is split; if XLA's figure says otherwise, the other is split as well."""
        def splits(measurer=None):
            _, reasons = self.trace_two(measurer)
            return len(rewrites()), reasons

        trusted, _ = splits()
        assert trusted == 1
        # Still over by XLA's figure with both split, and no better with smaller chunks: the first
        # plan again, and the user is told.
        with pytest.warns(RuntimeWarning, match=r"needs 32\.0 MB by XLA's figure as split, over its limit of 16\.0 MB"):
            checked, reasons = splits(as_written_and_split(3 * LIMIT, 2 * LIMIT))
        assert checked == 2 and any(r.startswith("with 1 loop the memory model counts") and
                                    f"XLA's figure is {2 * LIMIT:,} B" in r for r in reasons), reasons
        assert f"no better: planned against {LIMIT:,} B again" in " ".join(reasons), reasons
        assert f"XLA's figure as split is {2 * LIMIT:,} B, over the limit of {LIMIT:,} B, with nothing left to " \
               "split" in reasons, reasons

    def test_a_plan_built_again_is_not_compiled_again(self):
        """The case above, counted: the first plan (its loops, the journal as long) built again after
        a plan no better is the program measured before, its ops made anew in another order: its
        figure is the one known (before: compiled again, and again when it was warned of; a mixed-
        precision Keras step took 55 s to rewrite, 30 s of them six compiles of one program)."""
        measurer = as_written_and_split(3 * LIMIT, 2 * LIMIT)
        with pytest.warns(RuntimeWarning, match="over its limit"):
            self.trace_two(measurer)
        # The first plan with one loop and with two, the second plan, the program as written (before: 11).
        assert len(measurer.calls) == 4, len(measurer.calls)

    def test_a_split_over_by_xlas_figure_is_planned_again_with_smaller_chunks(self):
        """XLA's figure for the first plan is over the limit (faked: twice it, at both checks), within
        it afterwards: the first plan's loops are undone and the program split again against the
        limit scaled by limit / figure, in smaller chunks, computing what it computed."""
        def chunks(records):
            return sorted(r.plan.chunk for r in records)

        inputs = [points(n, 64, seed=s) for s, n in enumerate((1300,) * 3 + (1000,) * 3)]
        expected = tf.function(two_attentions, jit_compile=True)(*inputs)
        with pytest.warns(RuntimeWarning):
            self.trace_two(as_written_and_split(3 * LIMIT, 2 * LIMIT))
        first = chunks(rewrites())
        assert len(first) == 2, first
        figures = iter([2 * LIMIT, 2 * LIMIT])
        graph, reasons = self.trace_two(FakeMeasurer(program=lambda graph: next(figures, LIMIT // 2)))
        lower = int(LIMIT * LIMIT / (2 * LIMIT) * DEFAULT_TUNING.replan_margin)
        assert f"planned against {LIMIT:,} B, with 2 loops XLA's figure is {2 * LIMIT:,} B, over the limit of " \
               f"{LIMIT:,} B: planned again against {lower:,} B" in reasons, reasons
        again = chunks(rewrites())
        assert len(again) == 2 and all(a < f for a, f in zip(again, first)), (first, again)
        loops = [op for op in live_ops(graph) if op.type in ("While", "StatelessWhile")]
        assert len(loops) == 2                       # the first plan's loops are unreachable
        tf_memsafe.enable(LIMIT, strict=True)
        figures = iter([2 * LIMIT, 2 * LIMIT])
        with splitter_only(FakeMeasurer(program=lambda graph: next(figures, LIMIT // 2))):
            got = tf.function(two_attentions, jit_compile=True)(*inputs)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5)

    def test_a_search_past_its_budget_keeps_the_plan_built_and_says_so(self):
        """Over by XLA's figure as split (faked: twice the limit, at once, so the program's longest
        compile is a few microseconds and Tuning.search_budget times it is spent before the first
        replan): the first plan stands, not planned again; the records and the warning
        say the search stopped, not that nothing is left to split; the values are the program's."""
        inputs = [points(n, 64, seed=s) for s, n in enumerate((1300,) * 3 + (1000,) * 3)]
        expected = tf.function(two_attentions, jit_compile=True)(*inputs)
        twice = as_written_and_split(3 * LIMIT, 2 * LIMIT)
        hook.clear_reports()
        tf_memsafe.enable(LIMIT, strict=True)
        pipeline = hook.use_pipeline(Pipeline([Splitter(twice, tuning=Tuning(search_floor_s=0))]))
        with pipeline, pytest.warns(RuntimeWarning, match=r"needs 32\.0 MB by XLA's figure as split, over its limit "
                                                          r"of 16\.0 MB .*the search for a smaller plan stopped"):
            got = tf.function(two_attentions, jit_compile=True)(*inputs)
        tf_memsafe.disable()
        records = [r for rep in tf_memsafe.reports() for r in rep.records]
        codes = [r.code for r in records]
        assert Code.SEARCH_STOPPED in codes and Code.REPLANNED not in codes and Code.GROWN not in codes, codes
        (stopped,) = [r.reason for r in records if r.code == Code.SEARCH_STOPPED]
        assert stopped.startswith("searched for a plan for") and "the plan built so far stands" in stopped, stopped
        (over,) = [r.reason for r in records if r.code == Code.STILL_OVER]
        assert over.endswith("the search for another plan stopped (its time spent)"), over
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5)

    def test_a_program_traced_again_is_planned_as_it_was_whatever_the_clock_says(self, monkeypatch):
        """Over by XLA's figure as split (faked: 2x the limit), the first trace's search plans again
        against lower limits.  Traced again (as ``memory_footprint`` and Keras do) with the clock past any
        budget, the same program is given the first search's decisions: the same records, the same loops;
        another program (other sizes) traced then is stopped by the clock, said."""
        splitter = Splitter(as_written_and_split(3 * LIMIT, 2 * LIMIT))

        def trace(*specs):
            hook.clear_reports()
            tf_memsafe.enable(LIMIT)
            try:
                with hook.use_pipeline(Pipeline([splitter])), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tf.function(two_attentions, jit_compile=True).get_concrete_function(*specs)
            finally:
                tf_memsafe.disable()
            return [(r.code, r.reason) for r in skips()], len(rewrites())

        first, loops = trace(*TWO_SPECS)
        assert Code.REPLANNED in [code for code, _ in first] and Code.SEARCH_STOPPED not in [c for c, _ in first]
        ticks = itertools.count(step=10**4)                      # each look at the clock: hours later
        monkeypatch.setattr(search_budget.time, "perf_counter", lambda: float(next(ticks)))
        assert trace(*TWO_SPECS) == (first, loops)
        other, _ = trace(*(tf.TensorSpec([n - 100, 64]) for n in (1300,) * 3 + (1000,) * 3))
        assert Code.SEARCH_STOPPED in [code for code, _ in other], other

    def test_a_plan_no_smaller_than_the_program_as_written_is_undone_and_said(self):
        """Over the limit as split, and not a tenth smaller by XLA's figure than as written (faked: 2x the
        limit both, then 1.9x as split): the program is left exactly as traced, its record and warning say
        why with both figures; a plan smaller than as written (3x as written) is kept, over the limit, and
        said so."""
        plain = format_graph(tf.function(two_attentions, jit_compile=True).get_concrete_function(*TWO_SPECS).graph)
        for split in (2 * LIMIT, 19 * LIMIT // 10):
            with pytest.warns(RuntimeWarning, match=r"needs 32\.0 MB by XLA's figure as written, over its limit of "
                                                    r"16\.0 MB, and the splitter's best plan for it was not 10% "
                                                    rf"smaller \({split / 1e6:.1f} MB\): left as written"):
                graph, reasons = self.trace_two(as_written_and_split(2 * LIMIT, split))
            assert format_graph(graph) == plain and rewrites() == []
            assert f"XLA's figure as split, {split:,} B, is not 10% below as written, {2 * LIMIT:,} B: left as " \
                   "written" in reasons, reasons
        with pytest.warns(RuntimeWarning, match=r"needs 32\.0 MB by XLA's figure as split"):
            graph, reasons = self.trace_two(as_written_and_split(3 * LIMIT, 2 * LIMIT))
        assert len(rewrites()) == 2 and format_graph(graph) != plain

    def test_a_nominal_plan_no_smaller_than_as_written_there_is_undone_and_left_to_the_run_check(self):
        """Sizes known only at run time: the plan is compared with the program as written at the
        nominal sizes it was made at (faked: 2x the limit both, as a MobileNetV2's step planned under a
        quarter of its footprint, 490 MiB as split at its batch of 32 against 399 MiB as written): left
        exactly as traced, recorded, and not said when traced (its sizes are the splitter's): each shape
        it runs at is checked."""
        specs = (tf.TensorSpec([None, 64]),) * 6
        plain = format_graph(tf.function(two_attentions, jit_compile=True).get_concrete_function(*specs).graph)
        hook.clear_reports()
        tf_memsafe.enable(LIMIT, strict=True)
        faked = as_written_and_split(2 * LIMIT, 2 * LIMIT).program

        def figure(graph):      # (as XLA's: none for run-time sizes, outside the nominal ones planned at)
            if not all(shapes.is_static(t) for t in graph.inputs if t.dtype != tf.resource):
                raise MeasurementError("an input without a static shape")
            return faked(graph)

        with splitter_only(FakeMeasurer(program=figure)), warnings.catch_warnings():
            warnings.simplefilter("error")
            graph = tf.function(two_attentions, jit_compile=True).get_concrete_function(*specs).graph
        tf_memsafe.disable()
        assert format_graph(graph) == plain and rewrites() == []
        assert [r.code for r in skips()].count(Code.NO_SMALLER) == 1, [r.reason for r in skips()]
        # Run at a shape over the limit by XLA's figure (two [2000, 2000] score matrices): said once, why.
        fn = tf.function(two_attentions, jit_compile=True, input_signature=specs)
        tf_memsafe.enable(LIMIT)
        try:
            with splitter_only(FakeMeasurer(program=figure)), pytest.warns(
                    RuntimeWarning, match=r"nothing in it was split \(the splitter's plan for it, at sizes of its "
                                          r"choosing, was no smaller than the program as written there.*Raise "
                                          r"memory_limit, or call it on less at a time"):
                fn(*[points(2000, 64, seed=i) for i in range(6)])
        finally:
            tf_memsafe.disable()

    def trace_two(self, measurer=None):
        hook.clear_reports()
        tf_memsafe.enable(LIMIT, strict=True)
        with splitter_only(measurer):
            graph = tf.function(two_attentions, jit_compile=True).get_concrete_function(*TWO_SPECS).graph
        tf_memsafe.disable()
        return graph, [r.reason for r in skips()]

    def test_far_below_the_limit_is_not_compiled(self):
        twice = FakeMeasurer(program=lambda graph: 2 * LIMIT)
        tf_memsafe.enable(LIMIT, strict=True)
        with splitter_only(twice):
            tf.function(knn_l2, jit_compile=True).get_concrete_function(tf.TensorSpec([300, 3]),
                                                                        tf.TensorSpec([400, 3]))
        assert twice.calls == [] and [r.reason for r in skips()][0].endswith("(memory model)")


def test_impossible_limit_gets_the_best_effort_and_a_warning():
    """Attention over L = 3000 (36 MB of scores) under 2 MB: the inputs and output alone (3 MB)
    exceed it, so the limit cannot be met; the splitter still cuts the scores to a small part of
    what must stay, and warns with the numbers."""
    q, k, v = (points(3000, 64, seed=s) for s in range(3))
    expected, before = run_and_measure(tf.function(attention, jit_compile=True), q, k, v)   # (the calls'
    tf_memsafe.enable(2 * 10**6, strict=True)                                                  # compiles)
    with splitter_only(), pytest.warns(RuntimeWarning, match=r"over its limit of 2\.0 MB.*could only reduce it"):
        got, after = run_and_measure(tf.function(attention, jit_compile=True), q, k, v)
    assert all(r.code == Code.BEST_EFFORT and "best effort, the limit cannot be met" in r.reason for r in rewrites())
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
    assert after < before / 5


def test_a_best_effort_where_an_op_has_no_byte_rule():
    """The same attention beside a QR of a small matrix: ``Qr`` has no byte rule, so the model cannot
    count the program; its best effort is weighed against the model's lower bound for the program as
    written instead (before, every best effort was refused for want of a count and the program left
    as written, a GP's loss with ``tf.linalg.solve`` at 348 MB under 71 MB)."""
    def fn(q, k, v, w):
        return attention(q, k, v) + tf.reduce_sum(tf.linalg.qr(w)[1])

    q, k, v = (points(3000, 64, seed=s) for s in range(3))
    w = points(8, 8, seed=3)
    expected, before = run_and_measure(tf.function(fn, jit_compile=True), q, k, v, w)
    tf_memsafe.enable(2 * 10**6, strict=True)
    with splitter_only(), pytest.warns(RuntimeWarning, match=r"over its limit of 2\.0 MB"):
        got, after = run_and_measure(tf.function(fn, jit_compile=True), q, k, v, w)
    assert rewrites() and {r.code for r in rewrites()} == {Code.BEST_EFFORT}
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
    assert after < before / 5


def test_a_self_pair_mask_made_with_tf_eye_is_split_with_its_rows():
    """A contrastive (NT-Xent) loss over 3000 embeddings masks each one's pair with itself by
    ``tf.where(tf.eye(n) > 0, -1e9, logits)``: the identity's rows are made in each slice (a compare of
    offset indices), so the [3000, 3000] logits and mask are never whole.  Before, the identity's
    diagonal axis stopped every region: 36.8 MB as written under 8 MB, and a warning."""
    def loss_and_grad(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            u = tf.math.l2_normalize(z, 1)
            logits = tf.where(tf.eye(tf.shape(u)[0]) > 0, -1e9, u @ tf.transpose(u) / 0.1)
            loss = tf.reduce_mean(tf.reduce_logsumexp(logits, 1))
        return loss, tape.gradient(loss, z)

    z = points(3000, 32, seed=7)
    expected = tf.function(loss_and_grad, jit_compile=True)(z)
    tf_memsafe.enable(8 * 10**6, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # within the limit: nothing to say
        got, after = run_and_measure(tf.function(loss_and_grad, jit_compile=True), z)
    assert after <= 8 * 10**6, after
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-4, atol=1e-7)


def test_a_diagonal_set_with_set_diag_is_split_with_its_rows():
    """An N-body potential energy zeroes each body's pair with itself by ``tf.linalg.set_diag``: the rows
    of the [3000, 3000] pair matrix are set in each slice, so it is never whole (before, `MatrixSetDiagV3`
    had no split rule and stopped the region: 36 MB as written under 8 MB, and a warning)."""
    def energy(x, m):
        r = tf.sqrt(tf.reduce_sum(tf.square(x[:, None] - x[None]), -1) + 1e-3)
        return tf.reduce_sum(tf.linalg.set_diag(-m[:, None] * m[None] / r, tf.zeros([3000])))

    x, m = points(3000, 3, seed=8), tf.abs(points(3000, 1, seed=9))[:, 0]
    expected = tf.function(energy, jit_compile=True)(x, m)
    tf_memsafe.enable(8 * 10**6, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # within the limit: nothing to say
        got, after = run_and_measure(tf.function(energy, jit_compile=True), x, m)
    assert after <= 8 * 10**6, after
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def two_attention_outputs(q, k, v, a, b, c):
    return attention(q, k, v), attention(a, b, c)


def test_best_efforts_larger_than_the_program_as_written_are_undone():
    """Two attentions whose inputs and outputs are over the limit: best efforts only, which XLA's
    figure puts above the program as written (faked: 3x the limit as split, 2x as written, as a GAN's
    step measured 201 MB against 179 MB): the program is left exactly as traced, and said so."""
    limit = 1_500_000
    specs = [tf.TensorSpec([n, 32]) for n in (2000,) * 3 + (1500,) * 3]
    plain = format_graph(tf.function(two_attention_outputs, jit_compile=True).get_concrete_function(*specs).graph)
    hook.clear_reports()
    tf_memsafe.enable(limit, strict=True)
    # (the program as written measured with the plan undone: its own figure, not the plan's)
    # (and what the plan could not help: a DCGAN's step said only "not 10% smaller")
    said = (r"needs 3\.0 MB by XLA's figure as written, .* best plan for it was not 10% smaller \(4\.5 MB\): "
            r"left as written; the splitter could only reduce it: `\w+` .*best effort")
    with splitter_only(as_written_and_split(2 * limit, 3 * limit)), pytest.warns(RuntimeWarning, match=said):
        graph = tf.function(two_attention_outputs, jit_compile=True).get_concrete_function(*specs).graph
    tf_memsafe.disable()
    assert format_graph(graph) == plain and rewrites() == []
    assert [r.code for r in skips()].count(Code.NO_SMALLER) == 1


def test_best_efforts_that_gain_nothing_stop_there_and_are_undone():
    """Two attentions over the limit whatever is split: the program as written is measured before the
    first best effort (faked: 2x the limit); with that one built, XLA's figure (1.9x) is not a tenth
    below it, so the second is never built (MobileNetV2's training step built six more, each calibrated
    by compiles, for a plan then undone), and the plan is undone: the program left exactly as traced."""
    limit = 1_500_000
    specs = [tf.TensorSpec([n, 32]) for n in (2000,) * 3 + (1500,) * 3]
    plain = format_graph(tf.function(two_attention_outputs, jit_compile=True).get_concrete_function(*specs).graph)
    loops_measured = []

    def figure(graph):
        loops_measured.append(sum(op.type in ("While", "StatelessWhile") for op in live_ops(graph)))
        return 19 * limit // 10 if loops_measured[-1] else 2 * limit

    tf_memsafe.enable(limit, strict=True)
    with splitter_only(FakeMeasurer(program=figure)), pytest.warns(RuntimeWarning, match=r"not 10% smaller"):
        graph = tf.function(two_attention_outputs, jit_compile=True).get_concrete_function(*specs).graph
    tf_memsafe.disable()
    assert format_graph(graph) == plain and rewrites() == []
    assert loops_measured[0] == 0 and max(loops_measured) == 1, loops_measured


@pytest.mark.parametrize("within", [True, False], ids=["within_by_xla", "over_by_xla"])
def test_best_efforts_wait_for_xla_once_loops_are_built(within):
    """Two attentions whose inputs and outputs (2 MB) are over a 1.5 MB limit: by the model's count
    each can only be a best effort.  Before the second, XLA's figure for the program as split so far
    is asked once: where it is within the limit, the plan stops there (one loop, the second attention
    as written, said so); where not, the second is split too."""
    limit = 1_500_000
    inputs = [points(n, 32, seed=s) for s, n in enumerate((2000,) * 3 + (1500,) * 3)]
    expected = tf.function(two_attention_outputs, jit_compile=True)(*inputs)
    # (over: smaller than as written, or the plan would be undone: test_a_plan_no_smaller_...)
    figure = FakeMeasurer(program=lambda graph: limit // 2) if within else as_written_and_split(3 * limit, 2 * limit)
    hook.clear_reports()
    tf_memsafe.enable(limit, strict=True)
    with splitter_only(figure), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tf.function(two_attention_outputs, jit_compile=True)(*inputs)
    tf_memsafe.disable()
    loops = rewrites()
    stops, go_ons = ([r for r in skips() if r.code == code] for code in (Code.BEST_EFFORTS_STOPPED,
                                                                          Code.BEST_EFFORTS_GO_ON))
    assert loops and all(r.code == Code.BEST_EFFORT for r in loops), [r.reason for r in loops]
    if within:
        assert len(loops) == 1 and len(stops) == 1 and not go_ons, [r.reason for r in skips()]
        assert f"with 1 loop built, XLA's figure for the program as split is {limit // 2:,} B" in stops[0].reason
    else:
        assert len(loops) == 2 and not stops and len(go_ons) == 1, [r.reason for r in skips()]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


class TestMustNotFire:
    def unchanged(self, fn, *specs, limit=LIMIT):
        plain = format_graph(tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph)
        tf_memsafe.enable(limit, strict=True)
        with splitter_only():
            g = tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph
        assert format_graph(g) == plain
        assert rewrites() == []
        self.codes = [r.code for r in skips()]
        return [r.reason for r in skips()]

    def test_already_within_the_limit(self):
        (reason,) = self.unchanged(knn_l2, tf.TensorSpec([300, 3]), tf.TensorSpec([400, 3]))
        assert self.codes == [Code.WITHIN_LIMIT] and reason.startswith("already within the limit")

    def test_argmin_assignment_fuses_and_fits(self):
        """argmin of a [20000, 1000] distance: XLA fuses the producers (under 1 MB), nothing to split."""
        fn = lambda x, y: tf.argmin(sq_dist(x, y), axis=1)
        (reason,) = self.unchanged(fn, tf.TensorSpec([20000, 3]), tf.TensorSpec([1000, 3]))
        assert self.codes == [Code.WITHIN_LIMIT] and reason.startswith("already within the limit")

    def test_a_tensor_the_programs_own_loop_reads_is_named_with_the_loop(self):
        """Sinkhorn's iterations in a ``tf.while_loop`` read the kernel matrix exp(-C) whole at every step:
        its region stops there, and the reason names the loop (it named only the matrix)."""
        def fn(x, y):
            k = tf.exp(-sq_dist(x, y))                                                         # [N, M]

            def step(i, u):
                return i + 1, 1.0 / tf.linalg.matvec(k, 1.0 / (tf.linalg.matvec(k, u, transpose_a=True) + 1e-9))

            return tf.reduce_sum(tf.while_loop(lambda i, u: i < 5, step, (0, tf.ones([3000])))[1])

        with pytest.warns(RuntimeWarning, match="program's own loop `while`"):
            reasons = self.unchanged(fn, tf.TensorSpec([3000, 3]), tf.TensorSpec([3000, 3]))
        assert any("the program's own loop `while` (a tf.while_loop), which reads it whole" in r for r in reasons), \
            reasons

    def test_huge_cholesky_warns_with_the_numbers_and_the_op(self):
        fn = lambda x: tf.linalg.cholesky(tf.exp(-sq_dist(x, x)) + 1e-3 * tf.eye(3000))
        with pytest.warns(RuntimeWarning, match=r"needs about 84\.1 MB .* over its limit of 16\.0 MB.*`Cholesky`"):
            reasons = self.unchanged(fn, tf.TensorSpec([3000, 3]))
        assert any("`Cholesky` couples every entry of its matrix" in r for r in reasons), reasons
        assert Code.REFUSED_OP in self.codes, self.codes

    def test_an_eigh_over_the_limit_alone_is_named_with_the_limit_it_needs(self):
        """A spectral embedding: ``eigh`` of the normalised affinity [600, 600] under 2.06 MB, which the
        matrix and its vectors alone (2.9 MB) are over.  The warning named a slice of the eigenvalues."""
        def fn(x):
            a = tf.exp(-sq_dist(x, x))
            s = tf.math.rsqrt(tf.reduce_sum(a, 1))
            e, v = tf.linalg.eigh(s[:, None] * a * s[None, :])
            return tf.math.l2_normalize(v[:, -4:], axis=1), e[-4:]
        with pytest.warns(RuntimeWarning, match=r"over its limit of 2\.1 MB: `SelfAdjointEigV2` \(tf\.linalg\.eigh\) "
                                                r"holds 2\.9 MB whole at once.*raise memory_limit well above 2\.9 MB"):
            self.unchanged(fn, tf.TensorSpec([600, 3]), limit=2_060_000)

    def test_a_loop_that_would_only_write_its_result_is_refused(self):
        """Three products returned whole, [1500, 1000] f32 = 6 MB each, 18 MB over a 16 MB limit: a
        loop over one's rows would write the very tensor it was meant to avoid (the function returns
        it), so the program is left as it is, with the reason and a warning."""
        def fn(x, y):
            return tuple(tf.matmul(x * s, y, transpose_b=True) for s in (1.0, 2.0, 3.0))  # [N, M] each
        with pytest.warns(RuntimeWarning, match="over its limit of 16.0 MB"):
            reasons = self.unchanged(fn, tf.TensorSpec([1500, 8]), tf.TensorSpec([1000, 8]))
        assert any("saves too little" in r for r in reasons) and Code.SAVES_TOO_LITTLE in self.codes, reasons

    def test_random_op_is_never_moved_into_a_loop(self):
        fn = lambda x, y: tf.math.top_k(tf.random.uniform([4000, 4000]) - sq_dist(x, y), k=3).indices
        with pytest.warns(RuntimeWarning, match="RandomUniform"):
            reasons = self.unchanged(fn, tf.TensorSpec([4000, 3]), tf.TensorSpec([4000, 3]))
        assert any("RandomUniform" in r for r in reasons), reasons

    def test_no_estimate_and_no_tensor_over_the_limit(self):
        """An op without a byte rule (`Qr`) leaves the model without a figure; the largest tensor
        (4 MB) with the inputs is within 16 MB, so nothing is split on a guess.  (``tf.linalg.det``
        was the op here: XLA has no kernel for it, and such a function is now left before any pass.)"""
        fn = lambda x: tf.reduce_sum(tf.exp(x @ tf.transpose(x))) + tf.reduce_sum(tf.linalg.qr(x[:3, :3])[1])
        (reason,) = self.unchanged(fn, tf.TensorSpec([1000, 3]))
        assert self.codes == [Code.NO_ESTIMATE] and reason.startswith("the memory model cannot estimate it")
        assert "Qr" in reason

    def test_dynamic_shapes(self):
        # Inputs of unknown rank: no size can be planned.  (Run-time sizes of known rank are split:
        # tests/grappler_ext/splitter/test_dynamic.py.)
        (reason,) = self.unchanged(knn_l2, tf.TensorSpec(None), tf.TensorSpec(None))
        assert self.codes == [Code.DYNAMIC_SHAPES] and reason.startswith("dynamic shapes")
        assert "input_signature" in reason



def _gradient_matches_central_differences(loss_and_grads, args, weights, rng):
    """``loss_and_grads(*args)`` split under 4 MB with ``redraw_random``: its gradient along a random
    direction of ``weights`` equals the loss' central difference (the draws fixed by the call's seed
    or key): a slice's gradient recomputed the masks its forward drew."""
    tf_memsafe.enable(4 * 10**6, redraw_random=True, strict=True)
    with splitter_only():
        fn = tf.function(loss_and_grads, jit_compile=True)
        (_, grads), figure = run_and_measure(fn, *args)      # (XLA's figure for the compile the call made)
        assert len(rewrites()) >= 1
        assert figure <= 4 * 10**6, figure
        direction = [rng.standard_normal(w.shape) for w in weights]
        start = [w.numpy() for w in weights]
        losses = []
        for sign in (1, -1):
            for w, w0, d in zip(weights, start, direction):
                w.assign(w0 + sign * 1e-6 * d)
            losses.append(float(fn(*args)[0]))
    slope = (losses[0] - losses[1]) / 2e-6
    expected = sum(float(np.sum(g.numpy() * d)) for g, d in zip(grads, direction))
    assert slope == pytest.approx(expected, rel=1e-6)


class TestRandomDrawsRedrawn:
    """``redraw_random=True``: dropout's mask, [4096, 1024] f32 = 16 MB, drawn slice by slice.

    The values are other draws of the same distribution: each slice keys its draw on the call's
    seed, the op and its offset, so slices (and calls) draw apart, and a slice's gradient draws what
    its forward drew (checked against central differences with the seed fixed)."""

    L, D = 1024, 16

    @staticmethod
    def kept_per_row(x):
        return tf.reduce_sum(tf.nn.dropout(tf.ones([4096, 1024]), 0.25) * x, axis=1)     # [4096]

    def test_by_default_the_draw_stays_whole_and_the_reason_names_the_option(self):
        tf_memsafe.enable(4 * 10**6)
        with splitter_only(), pytest.warns(RuntimeWarning, match="redraw_random=True"):
            tf.function(self.kept_per_row, jit_compile=True).get_concrete_function(tf.TensorSpec([1024]))
        assert rewrites() == []

    def test_a_draw_that_stops_regions_other_reasons_seem_to_stop_is_named_with_the_option(self):
        """A draw added to distances whose total also feeds a variable's update: the region through the
        draw stops there, and the record the warning shows names another reason (the sum read outside
        the region).  The warning still says what ``redraw_random=True`` would allow (which splits it)."""
        total = tf.Variable(0.0)

        def nearest(q):
            d = tf.reduce_sum(tf.square(q[:, None] - q[None]), -1) + tf.random.uniform([2000, 2000])
            total.assign_add(tf.reduce_sum(d))
            return tf.math.top_k(-d, 5).indices

        tf_memsafe.enable(2 * 10**6)
        with splitter_only(), pytest.warns(RuntimeWarning, match="random draw .* redraw_random=True"):
            tf.function(nearest, jit_compile=True).get_concrete_function(tf.TensorSpec([2000, 16]))
        assert rewrites() == []

    def test_a_draw_two_regions_read_one_after_the_other_is_not_said_to_be_helped_by_the_option(self):
        """Normal equations on a design matrix drawn in the function: ``X`` is read by ``XᵀX`` and ``Xᵀy``,
        and after the solve by the residual.  No loop may draw it twice, so ``redraw_random=True`` splits
        nothing more (the warning advised it: a user turned it on, and the program stayed as it was)."""
        def normal_equations(seed, y):
            x = tf.random.stateless_normal([20000, 64], seed=seed)
            w = tf.linalg.solve(tf.matmul(x, x, transpose_a=True) + 0.1 * tf.eye(64), tf.matmul(x, y, transpose_a=True))
            return w, tf.reduce_mean(tf.square(y - x @ w))

        for redraw in (False, True):
            tf_memsafe.enable(8 * 10**6, redraw_random=redraw)
            with splitter_only(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tf.function(normal_equations, jit_compile=True).get_concrete_function(
                    tf.TensorSpec([2], tf.int64), tf.TensorSpec([20000, 1]))
            said = [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]
            assert said and "cannot split `stateless_random_normal" in said[0], said
            assert "redraw_random" not in said[0] and rewrites() == [], said

    def test_each_slice_draws_its_own_mask_at_the_rate(self):
        tf_memsafe.enable(4 * 10**6, redraw_random=True, strict=True)
        with splitter_only():
            fn = tf.function(self.kept_per_row, jit_compile=True)
            first, second = fn(tf.ones([1024])).numpy(), fn(tf.ones([1024])).numpy()
            footprint = tf_memsafe.memory_footprint(fn, tf.ones([1024]))
        assert len(rewrites()) >= 1 and footprint <= 4 * 10**6
        kept = first * 0.75                                        # ones kept per row, of 1024
        assert abs(kept.mean() / 1024 - 0.75) < 0.005              # 4M draws: sd 2e-4
        assert len(np.unique(first)) > 100                          # rows, slices apart, draw apart
        assert not np.array_equal(first, second)                    # and calls

    def test_a_slices_gradient_recomputes_the_mask_its_forward_drew(self, monkeypatch):
        monkeypatch.setattr(mechanism, "call_seed", lambda: tf.constant([3, 5], tf.int64))
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((self.L, self.D)))
        weights = [tf.Variable(rng.standard_normal((self.D, self.D)) / 4) for _ in range(3)]

        def loss_and_grads(x):
            with tf.GradientTape() as tape:
                q, k, v = (x @ w for w in weights)
                probs = tf.nn.dropout(tf.nn.softmax(tf.matmul(q, k, transpose_b=True), -1), 0.2)   # [L, L]
                loss = tf.reduce_mean(tf.square(probs @ v))
            return loss, tape.gradient(loss, weights)

        _gradient_matches_central_differences(loss_and_grads, (x,), weights, rng)
        assert any(r.plan.fused for r in rewrites())        # the mask drawn and differentiated in one step
        assert any(r.plan.redrawn and "drawn again slice by slice" in r.reason for r in rewrites())

    def test_each_loops_gradient_recomputes_its_own_loops_masks(self):
        """Two loops that draw, each keyed on its own seed of the call.  The first loop's gradient is
        built again when the second's is installed (the recorded gradient differentiated again):
        it must still recompute the masks its forward drew, not draws keyed on the second loop's seed.
        With ``a = sum_j dropout(u)_ij * w1``, ``d loss / d w1 = sum(a) / w1`` exactly when they agree
        (float64: a mask drawn apart is off by about 1e-4 of it)."""
        def step(x, y, w1, w2):
            with tf.GradientTape() as tape:
                tape.watch([w1, w2])
                a = tf.reduce_sum(tf.nn.dropout(tf.sigmoid(x[:, None] * y[None, :]), 0.5) * w1, axis=1)  # [2048]
                b = tf.reduce_sum(tf.nn.dropout(tf.sin(x[:, None] + y[None, :]), 0.5) * w2, axis=1)
                loss = tf.reduce_sum(a) + tf.reduce_sum(b)
            return a, b, tape.gradient(loss, [w1, w2])

        rng = np.random.default_rng(0)
        x, y = (tf.constant(rng.standard_normal(n)) for n in (2048, 1024))      # [2048, 1024] f64: 16 MB
        w1, w2 = tf.constant(0.3, tf.float64), tf.constant(0.7, tf.float64)
        tf_memsafe.enable(4 * 10**6, redraw_random=True, strict=True)
        with splitter_only():
            fn = tf.function(step, jit_compile=True)
            a, b, (g1, g2) = fn(x, y, w1, w2)
        assert len(rewrites()) == 2 and all(r.plan.rebuilt_gradients for r in rewrites())
        assert float(g1) == pytest.approx(float(tf.reduce_sum(a)) / 0.3, rel=1e-9)
        assert float(g2) == pytest.approx(float(tf.reduce_sum(b)) / 0.7, rel=1e-9)


class TestKeyedDrawsRedrawn:
    """A stateless draw keyed by a tensor of the program (Keras 3's dropout: ``StatelessRandomUniformV2``
    keyed from its seed generator), [4096, 1024] f32 = 16 MB.  Refused by default; with
    ``redraw_random=True`` each slice draws again with the op's key moved by the op and its offset:
    the rate kept, slices apart, calls with other seeds apart, and a slice's gradient recomputes the
    mask its forward drew (central differences)."""

    L, D = 1024, 16

    @staticmethod
    def kept_per_row(x, seed):
        mask = tf.nn.experimental.stateless_dropout(tf.ones([4096, 1024]), 0.25, seed=seed)
        return tf.reduce_sum(mask * x, axis=1)                                          # [4096]

    def test_by_default_the_draw_stays_whole_and_the_reason_names_the_option(self):
        tf_memsafe.enable(4 * 10**6)
        with splitter_only(), pytest.warns(RuntimeWarning, match="redraw_random=True"):
            tf.function(self.kept_per_row, jit_compile=True).get_concrete_function(
                tf.TensorSpec([1024]), tf.TensorSpec([2], tf.int64))
        assert rewrites() == []

    def test_each_slice_draws_its_own_mask_at_the_rate(self):
        tf_memsafe.enable(4 * 10**6, redraw_random=True, strict=True)
        ones = tf.ones([1024])
        with splitter_only():
            fn = tf.function(self.kept_per_row, jit_compile=True)
            first, again = fn(ones, tf.constant([1, 2], tf.int64)).numpy(), fn(ones, tf.constant([1, 2], tf.int64))
            other = fn(ones, tf.constant([7, 9], tf.int64)).numpy()
            footprint = tf_memsafe.memory_footprint(fn, ones, tf.constant([1, 2], tf.int64))
        assert len(rewrites()) >= 1 and footprint <= 4 * 10**6
        kept = first * 0.75                                        # ones kept per row, of 1024
        assert abs(kept.mean() / 1024 - 0.75) < 0.005              # 4M draws: sd 2e-4
        assert len(np.unique(first)) > 100                          # rows, slices apart, draw apart
        np.testing.assert_array_equal(first, again.numpy())         # a key: the same draws
        assert not np.array_equal(first, other)                     # another key: others

    def test_a_slices_gradient_recomputes_the_mask_its_forward_drew(self):
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((self.L, self.D)))
        seed = tf.constant([3, 5], tf.int64)
        weights = [tf.Variable(rng.standard_normal((self.D, self.D)) / 4) for _ in range(3)]

        def loss_and_grads(x, seed):
            with tf.GradientTape() as tape:
                q, k, v = (x @ w for w in weights)
                scores = tf.nn.softmax(tf.matmul(q, k, transpose_b=True), -1)                  # [L, L]
                probs = tf.nn.experimental.stateless_dropout(scores, 0.2, seed=seed)
                loss = tf.reduce_mean(tf.square(probs @ v))
            return loss, tape.gradient(loss, weights)

        _gradient_matches_central_differences(loss_and_grads, (x, seed), weights, rng)
        assert any(r.plan.fused for r in rewrites())


def test_idempotent():
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only():
        g = tf.function(knn_l2, jit_compile=True).get_concrete_function(
            tf.TensorSpec([4000, 3]), tf.TensorSpec([4000, 3])).graph
    once = format_graph(g)
    result = Pipeline([Splitter(XlaMeasurer())]).run(g, tf_memsafe.get_options().__class__(memory_limit_bytes=LIMIT,
                                                                              memory_limit_fraction=None))
    assert not result.changed
    assert format_graph(g) == once
    assert "While" in once


def test_slices_with_gradients_inside_take_at_most_a_share_of_the_limit():
    """A Transformer training step's attention at L = 4096 under 2 GB: XLA's figure of 262 kB a row
    (374 kB with the calibration margin) planned halves of 2048 rows; capped at Tuning.slice_share of the
    limit, eighths of 512 (no remainder).  A slice already within the share is left as planned."""
    plan = ChunkPlan(4096, 2048, 10**9)
    capped = policy.capped(plan, 374_000, 2 * 10**9, DEFAULT_TUNING)
    assert (capped.chunk, capped.steps, capped.tail) == (512, 8, 0)
    assert capped.chunk * 374_000 <= DEFAULT_TUNING.slice_share * 2 * 10**9
    assert capped.predicted_bytes == 10**9 - (2048 - 512) * 374_000
    assert policy.capped(plan, 100_000, 2 * 10**9, DEFAULT_TUNING) is plan


def pca_error(x):
    """PCA by the covariance's eigenvectors, with the reconstruction error: the centred data is read by
    the covariance and again, after `eigh`, by the scores."""
    xc = x - tf.reduce_mean(x, 0, keepdims=True)
    w = tf.linalg.eigh(tf.matmul(xc, xc, transpose_a=True) / 6000)[1][:, -8:]
    r = xc - (xc @ w) @ tf.transpose(w)
    return tf.reduce_mean(tf.reduce_sum(r * r, 1))


def test_an_elementwise_tensor_two_regions_read_is_computed_again_in_each():
    """The centred data ``x - mean`` of a PCA, [6000, 64], is read by the covariance and, after
    ``eigh``, by the reconstruction error: two regions, one after the other.  Each computes its own
    slices of it, so that it is never whole beside ``x`` (before, the first region stopped there,
    "also read outside the region", and the program stayed at 3.3 MB as written under 2.2 MB)."""
    x = points(6000, 64, seed=3)
    expected = tf.function(pca_error, jit_compile=True)(x)
    tf_memsafe.enable(2_200_000, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # within the limit: nothing to say
        got, after = run_and_measure(tf.function(pca_error, jit_compile=True), x)
    assert after <= 2_200_000, after
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_an_elementwise_tensor_two_regions_read_is_computed_again_with_its_gradient():
    """As above with the tape inside: ``x * s - m`` is read by a Gram matrix and by the product with
    it; the gradients for ``s`` and ``m`` through both regions equal the unsplit ones."""
    s, m = tf.Variable(tf.fill([64], 0.5)), tf.Variable(tf.fill([64], 0.1))

    def step(x):
        with tf.GradientTape() as tape:
            xc = x * s - m
            g = tf.matmul(xc, xc, transpose_a=True) / 6000
            loss = tf.reduce_sum(tf.square(xc @ g)) / 6000
        return [loss] + tape.gradient(loss, [s, m])

    x = points(6000, 64, seed=4)
    expected, before = run_and_measure(tf.function(step, jit_compile=True), x)   # (the calls' compiles)
    tf_memsafe.enable(int(before * 0.7), strict=True)
    got, after = run_and_measure(tf.function(step, jit_compile=True), x)
    assert after <= before * 0.7, (before, after)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


def test_a_plan_along_a_short_axis_over_by_xlas_figure_is_planned_again_along_another():
    """A Chamfer loss between two batches of 2 point clouds, with its gradient: halves of the batch, the
    memory model's plan (an axis of 2 gives no second chunk to measure), are over by XLA's figure and
    cannot be smaller.  The plan again with loops along other axes first splits the points, within the
    limit (before: 6.0 MB under 4.2 MB, "nothing left in it can be split usefully")."""
    def chamfer(a, b):
        with tf.GradientTape() as tape:
            tape.watch(a)
            d2 = tf.reduce_sum(tf.square(a[:, :, None, :] - b[:, None, :, :]), axis=-1)
            loss = tf.reduce_mean(tf.reduce_min(d2, axis=2)) + tf.reduce_mean(tf.reduce_min(d2, axis=1))
        return loss, tape.gradient(loss, a)

    a, b = tf.reshape(points(1200, 3, seed=5), [2, 600, 3]), tf.reshape(points(1000, 3, seed=6), [2, 500, 3])
    expected = tf.function(chamfer, jit_compile=True)(a, b)
    tf_memsafe.enable(4_200_000, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # within the limit: nothing to say
        got, after = run_and_measure(tf.function(chamfer, jit_compile=True), a, b)
    assert after <= 4_200_000, after
    assert Code.OTHER_SIZES in {r.code for r in skips()}
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


def test_what_an_op_computed_again_reads_is_not_drawn_again():
    """``h = x * noise``, a draw per row, is read by a sum over its rows and, after it, by a loop over
    its rows: each region computes its own slices of ``h`` from ``x`` and the one draw, never a draw of
    its own (with ``redraw_random`` a region takes a draw in, and the draw read by the op computed again
    would have been drawn twice).  So ``sum(r) = sum(s)²`` holds as it does unsplit."""
    def f(x):
        h = x * tf.random.uniform([20000, 1], dtype=tf.float64)
        s = tf.reduce_sum(h, 0)
        r = tf.reduce_sum(tf.exp(h / 4) * tf.reduce_sum(s), 1)
        return s, r, tf.reduce_sum(tf.exp(h / 4), 1)

    x = tf.constant(np.random.default_rng(1).uniform(size=(20000, 64)))          # [20000, 64] f64: 10 MB
    tf_memsafe.enable(12 * 10**6, redraw_random=True, strict=True)
    s, r, e = tf.function(f, jit_compile=True)(x)
    after = tf_memsafe.memory_footprint(f, x)
    assert after <= 12 * 10**6 and rewrites(), after
    np.testing.assert_allclose(r, e * float(tf.reduce_sum(s)), rtol=1e-12)
