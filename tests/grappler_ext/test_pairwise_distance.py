"""pairwise_distance: fires on every spelling of the naive form above the fusion threshold, only there.

Bytes, worked out: N = 300, M = 400, D = 64 in float32.  The naive program materialises
[300, 400, 64] x 4 B = 30.7 MB; the matmul form needs [300, 400] x 4 B = 480 kB plus the inputs.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pairwise_distance import PairwiseDistance
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import format_graph
from grappler_ext.xla_facts import FUSED_REDUCTION_MAX
from tf_memsafe import hook

N, M, D = 30, 40, 64
# A limit every program here is over: rewrites made for memory run only there (grappler_ext.guard).
OVER = "1KB"
TOL = {tf.float32: dict(rtol=1e-4, atol=1e-3), tf.float64: dict(rtol=1e-10, atol=1e-9)}

SPELLINGS = {
    "square": lambda x, y: tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1),
    "pow": lambda x, y: tf.reduce_sum((x[:, None] - y[None]) ** 2, axis=-1),
    "mul": lambda x, y: (lambda diff: tf.reduce_sum(diff * diff, -1))(x[:, None] - y[None]),
    "squared_difference": lambda x, y: tf.reduce_sum(
        tf.math.squared_difference(tf.expand_dims(x, 1), tf.expand_dims(y, 0)), -1),
    "reshape_keepdims": lambda x, y: tf.reduce_sum(
        tf.square(tf.reshape(x, [N, 1, D]) - tf.reshape(y, [1, M, D])), -1, keepdims=True),
    "swapped": lambda x, y: tf.reduce_sum(tf.square(y[None, :, :] - x[:, None, :]), axis=2),
    "norm": lambda x, y: tf.norm(x[:, None] - y[None], axis=-1),
    "scaled": lambda x, y: tf.reduce_sum(tf.square(x[:, None] / 1.7 - y[None] / 1.7), -1),
    "add_neg": lambda x, y: tf.reduce_sum(tf.square(-y[None] + x[:, None]), -1),
    "scaled_after_by_vector": lambda x, y: tf.reduce_sum(
        tf.square((x[:, None] - y[None]) / tf.linspace(tf.constant(0.5, x.dtype), 2.0, D)), -1),
    "scaled_after_by_scalar": lambda x, y: tf.reduce_sum(((x[:, None] - y[None]) * 0.3) ** 2, -1),
    "euclidean": lambda x, y: tf.sqrt(tf.reduce_sum(tf.square(x[:, None] - y[None]), -1) + 1e-6),
    "self": lambda x, y: tf.reduce_sum(tf.square(x[:, None] - x[None]), -1) + tf.reduce_sum(y),
    "batched": lambda x, y: tf.reduce_sum(
        tf.square(tf.stack([x, 2 * x])[:, :, None] - tf.stack([y, y])[:, None, :]), -1),
}


def inputs(dtype, seed=0, d=D):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.standard_normal((N, d)), dtype), tf.constant(rng.standard_normal((M, d)), dtype))


def pipeline():
    return hook.use_pipeline(Pipeline([PairwiseDistance()]))


def rewritten_records():
    return [r for rep in tf_memsafe.reports() for r in rep.records if r.action == "rewritten"]


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("jit", [True, False])
def test_numerically_equal_forward_and_gradients(spelling, dtype, jit):
    fn = SPELLINGS[spelling]
    x, y = inputs(dtype)

    def loss_and_grads(f):
        xv, yv = tf.Variable(x), tf.Variable(y)
        with tf.GradientTape() as tape:
            out = f(xv, yv)
            loss = tf.reduce_sum(tf.sin(out))
        return out, tape.gradient(loss, [xv, yv])

    expected, expected_grads = loss_and_grads(tf.function(fn, jit_compile=jit))
    tf_memsafe.enable(OVER, strict=True, rewrite_non_jit=True)
    with pipeline():
        got, got_grads = loss_and_grads(tf.function(fn, jit_compile=jit))
    assert len(rewritten_records()) == 1
    np.testing.assert_allclose(got, expected, **TOL[dtype])
    for g, e in zip(got_grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=TOL[dtype]["rtol"] * 10, atol=TOL[dtype]["atol"] * 10)


def test_structure_matmul_replaces_the_broadcast():
    tf_memsafe.enable(OVER)
    with pipeline():
        g = tf.function(SPELLINGS["square"], jit_compile=True).get_concrete_function(
            tf.TensorSpec([N, D]), tf.TensorSpec([M, D])).graph
    text = format_graph(g)
    assert "MatMul{transpose_b=true} f32[30,40]" in text
    assert "Sub f32[30,40,64]" not in text
    assert "Maximum f32[30,40]" in text
    (record,) = rewritten_records()
    assert record.bytes_before == N * M * D * 4 and record.bytes_after == N * M * 4


def test_a_tensor_against_itself_uses_one_norm():
    """|x_i - x_j|^2 = |x_i|^2 + |x_j|^2 - 2 x_i.x_j: one [N] norm vector serves both sides."""
    tf_memsafe.enable(OVER)
    with pipeline():
        g = tf.function(SPELLINGS["self"], jit_compile=True).get_concrete_function(
            tf.TensorSpec([N, D]), tf.TensorSpec([M, D])).graph
    text = format_graph(g)
    assert "MatMul{transpose_b=true} f32[30,30]" in text
    assert text.count("Square f32[30,64]") == 1 and "Square f32[40,64]" not in text
    (record,) = rewritten_records()
    assert "one norm" in record.reason


def test_a_difference_scaled_afterwards_is_scaled_before():
    """((x - y) / s)^2 summed = |x/s - y/s|^2: the [D] scale moves onto the [N, D] and [M, D] operands."""
    tf_memsafe.enable(OVER)
    with pipeline():
        g = tf.function(SPELLINGS["scaled_after_by_vector"], jit_compile=True).get_concrete_function(
            tf.TensorSpec([N, D]), tf.TensorSpec([M, D])).graph
    text = format_graph(g)
    assert "RealDiv f32[30,64]" in text and "RealDiv f32[40,64]" in text
    assert "f32[30,40,64]" not in text


def test_idempotent():
    tf_memsafe.enable(OVER)
    with pipeline():
        g = tf.function(SPELLINGS["pow"], jit_compile=True).get_concrete_function(
            tf.TensorSpec([N, D]), tf.TensorSpec([M, D])).graph
    once = format_graph(g)
    result = Pipeline([PairwiseDistance()]).run(g, tf_memsafe.get_options())
    assert not result.changed
    assert format_graph(g) == once


class TestMustNotFire:
    def unchanged(self, fn, *specs):
        """Trace ``fn`` with the pass; assert the graph is exactly what tracing without it gives."""
        plain = format_graph(tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph)
        tf_memsafe.enable(OVER)
        with pipeline():
            g = tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph
        assert format_graph(g) == plain
        assert rewritten_records() == []
        return [r for rep in tf_memsafe.reports() for r in rep.records]

    def test_small_d_is_left_to_xla_fusion(self):
        d = FUSED_REDUCTION_MAX
        (rec,) = self.unchanged(SPELLINGS["square"], tf.TensorSpec([N, d]), tf.TensorSpec([M, d]))
        assert rec.action == "skipped" and "XLA fuses" in rec.reason

    def test_interior_op_with_extra_consumer(self):
        def fn(x, y):
            diff = x[:, None] - y[None]
            return tf.reduce_sum(tf.square(diff), -1), tf.reduce_max(diff)

        (rec,) = self.unchanged(fn, tf.TensorSpec([N, D]), tf.TensorSpec([M, D]))
        assert "consumer outside the pattern" in rec.reason

    def test_integers(self):
        fn = SPELLINGS["square"]
        self.unchanged(fn, tf.TensorSpec([N, D], tf.int32), tf.TensorSpec([M, D], tf.int32))

    def test_sum_over_another_axis(self):
        fn = lambda x, y: tf.reduce_sum(tf.square(x[:, None] - y[None]), 1)
        (rec,) = self.unchanged(fn, tf.TensorSpec([N, D]), tf.TensorSpec([M, D]))
        assert "not only the last axis" in rec.reason

    def test_scale_over_more_than_the_last_axis(self):
        fn = lambda x, y: tf.reduce_sum(tf.square((x[:, None] - y[None]) * tf.ones([N, 1, D])), -1)
        (rec,) = self.unchanged(fn, tf.TensorSpec([N, D]), tf.TensorSpec([M, D]))
        assert "not a scalar or [D = 64] vector" in rec.reason

    def test_reversed_self_is_not_one_norm(self):
        """x[::-1] against x is two different operands: the rewrite fires, but with two norms."""
        fn = lambda x: tf.reduce_sum(tf.square(x[::-1, None] - x[None]), -1)
        x = inputs(tf.float64)[0]
        expected = tf.function(fn, jit_compile=True)(x)
        tf_memsafe.enable(OVER)
        with pipeline():
            got = tf.function(fn, jit_compile=True)(x)
        (record,) = rewritten_records()
        assert "one norm" not in record.reason
        np.testing.assert_allclose(got, expected, **TOL[tf.float64])

    def test_queries_known_only_at_run_time_are_said_to_be(self):
        """The pass reads the operands' expansions statically: a kNN traced for any number of queries
        is left alone, and the record says that is why (before: "not a difference of [.., N, 1, D]
        and [.., 1, M, D] tensors", which it is)."""
        fn = SPELLINGS["square"]
        (rec,) = self.unchanged(fn, tf.TensorSpec([None, D]), tf.TensorSpec([M, D]))
        assert "shapes known only at run time" in rec.reason and "(None, 1, 64)" in rec.reason, rec.reason

    def test_not_a_pairwise_broadcast(self):
        fn = lambda x, y: tf.reduce_sum(tf.square(x - y), -1)
        (rec,) = self.unchanged(fn, tf.TensorSpec([N, 5, D]), tf.TensorSpec([N, 5, D]))
        assert "not [.., N, 1, D]" in rec.reason


def test_footprint_drops_from_the_broadcast_to_the_matrix():
    fn = SPELLINGS["square"]
    specs = (tf.TensorSpec([300, D]), tf.TensorSpec([400, D]))
    tf_memsafe.enable(OVER)
    before = tf_memsafe.memory_footprint(fn, *specs, rewrite=False)
    after = tf_memsafe.memory_footprint(fn, *specs)
    assert before >= 300 * 400 * D * 4
    assert after <= 300 * 400 * 4 + (300 + 400) * D * 4 * 2 + 4096


def test_tape_inside_the_function_gets_the_rewrite_and_its_gradients_rebuilt():
    """A soft nearest-neighbour loss differentiated inside the function: the tape's ops read the
    [300, 400, 64] difference (61 MB in f64); they are differentiated again from the matmul form."""
    def step(x, y):
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            d = tf.reduce_sum(tf.square(x[:, None] - y[None]), -1)
            loss = tf.reduce_sum(tf.nn.softmax(-d, axis=1) * d)
        return loss, tape.gradient(loss, [x, y])

    rng = np.random.default_rng(0)
    x, y = tf.constant(rng.standard_normal((300, D))), tf.constant(rng.standard_normal((400, D)))
    expected = tf.function(step, jit_compile=True)(x, y)
    tf_memsafe.enable(OVER, strict=True)
    with pipeline():
        got = tf.function(step, jit_compile=True)(x, y)
        before = tf_memsafe.memory_footprint(step, x, y, rewrite=False)
        after = tf_memsafe.memory_footprint(step, x, y)
    assert [r.reason for r in rewritten_records()] == ["[300] x [400] distances over D = 64 as a matmul"] * 2
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        np.testing.assert_allclose(g, e, **TOL[tf.float64])
    assert before >= 300 * 400 * D * 8 and after < 300 * 400 * D * 8 / 10
