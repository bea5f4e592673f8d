"""unrolled_reduction: a float32 sum over a short innermost axis as its slices added, only where
YNNPACK would read a broadcast operand from memory.

Bytes, worked out for an L1 distance of 2000 x 20000 points in 3 dimensions: as written, XLA:CPU
materialises the [2000, 20000, 3] float32 operand (480 MB) for YNNPACK's reduction beside the
[2000, 20000] result (160 MB); as three slices added, the operand never exists (160 MB; measured
640 -> 160 MB, module docstring).  Here at [200, 400, 3]: 0.96 MB of operand.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.graph_query import live_ops
from grappler_ext.memory_rules import is_multiply
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import format_graph
from grappler_ext.unrolled_reduction import MIN_ELEMENTS, UnrolledReduction
from tf_memsafe import hook

Q = tf.random.stateless_uniform([200, 3], seed=[1, 1])
P = tf.random.stateless_uniform([400, 3], seed=[1, 2])
assert 200 * 400 >= MIN_ELEMENTS


def pipeline():
    return hook.use_pipeline(Pipeline([UnrolledReduction()]))


def records(action=None):
    return [r for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "unrolled_reduction" and (action is None or r.action == action)]


def traced(fn, *args, rewrite=True):
    if not rewrite:
        return tf.function(fn, jit_compile=True).get_concrete_function(*args).graph
    tf_memsafe.enable("1GB", strict=True)
    with pipeline():
        return tf.function(fn, jit_compile=True).get_concrete_function(*args).graph


def run_both(fn, *args):
    expected = tf.nest.map_structure(lambda t: t.numpy(), tf.function(fn, jit_compile=True)(*args))
    tf_memsafe.enable("1GB", strict=True)
    with pipeline():
        got = tf.nest.map_structure(lambda t: t.numpy(), tf.function(fn, jit_compile=True)(*args))
    return got, expected


def l1(q, p):
    return tf.reduce_sum(tf.abs(q[:, None] - p[None]), -1)


FIRES = {
    "l1": l1,
    "l1_keepdims": lambda q, p: tf.reduce_sum(tf.abs(q[:, None, :] - p[None, :, :]), -1, keepdims=True),
    "mean": lambda q, p: tf.reduce_mean(tf.abs(tf.expand_dims(q, 1) - tf.expand_dims(p, 0)), axis=2),
    "scaled": lambda q, p: tf.reduce_sum(tf.exp(-tf.abs(q[:, None] - p[None]) / tf.constant([1.0, 2.0, 3.0])), -1),
    "hinge": lambda q, p: tf.reduce_sum(tf.maximum(q[:, None] - p[None], 0.0), -1),
    "bfloat16": lambda q, p: tf.reduce_sum(tf.abs(tf.cast(q, tf.bfloat16)[:, None] - tf.cast(p, tf.bfloat16)[None]),
                                           -1),
    "knn_l1": lambda q, p: tf.math.top_k(-l1(q, p), 5),
}


@pytest.mark.parametrize("name", sorted(FIRES))
def test_equal_to_the_sum_as_written(name):
    got, expected = run_both(FIRES[name], Q, P)
    assert len(records("rewritten")) == 1
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        if e.dtype.kind == "i":
            np.testing.assert_array_equal(g, e)
        else:
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(e, np.float64), rtol=1e-2 if
                                       name == "bfloat16" else 1e-6)


def test_structure_three_terms_no_three_dimensional_tensor():
    graph = traced(l1, Q, P)
    adds = [op for op in graph.get_operations() if op.type in ("AddV2", "Add") and "unrolled_reduction" in op.name]
    assert len(adds) == 2
    assert not [op for op in live_ops(graph) if op.type == "Abs" and op.outputs[0].shape.rank == 3]
    (record,) = records("rewritten")
    assert record.bytes_before == 200 * 400 * 3 * 4 and record.bytes_after == 200 * 400 * 4


def test_the_figure_falls():
    tf_memsafe.enable("1GB", strict=True)
    before = tf_memsafe.memory_footprint(l1, Q, P, rewrite=False)
    with pipeline():
        after = tf_memsafe.memory_footprint(l1, Q, P)
    assert after < before / 2


def test_gradient_tape_outside():
    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([Q, P])
            value = tf.reduce_sum(fn(Q, P) ** 2)
        return [g.numpy() for g in tape.gradient(value, [Q, P])]

    expected = grads(tf.function(l1, jit_compile=True))
    tf_memsafe.enable("1GB", strict=True)
    with pipeline():
        got = grads(tf.function(l1, jit_compile=True))
    assert records("rewritten")
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5)


def test_idempotent():
    graph = traced(l1, Q, P)
    once = format_graph(graph)
    assert not Pipeline([UnrolledReduction()]).run(graph, tf_memsafe.get_options()).changed
    assert format_graph(graph) == once


class TestMustNotFire:
    def unchanged(self, fn, *args, said=None):
        plain = format_graph(traced(fn, *args, rewrite=False))
        assert format_graph(traced(fn, *args)) == plain
        assert not records("rewritten")
        if said is None:
            assert not records(), "a sum without the pattern is not recorded"
        else:
            assert any(said in r.reason for r in records("skipped")), [r.reason for r in records()]

    def test_a_multiply_operand_xla_fuses_already(self):
        self.unchanged(lambda q, p: tf.reduce_sum(tf.square(q[:, None] - p[None]), -1), Q, P)

    def test_float64(self):
        self.unchanged(l1, tf.cast(Q, tf.float64), tf.cast(P, tf.float64))

    def test_an_axis_over_32(self):
        q, p = tf.zeros([200, 33]), tf.zeros([400, 33])
        self.unchanged(l1, q, p)

    def test_not_the_innermost_axis(self):
        self.unchanged(lambda q, p: tf.reduce_sum(tf.abs(q[:, None] - p[None]), 1), Q, P)

    def test_a_small_result(self):
        self.unchanged(l1, Q[:10], P[:10], said="nothing to gain")

    def test_no_broadcast(self):
        x = tf.random.stateless_uniform([200, 400, 3], seed=[2, 2])
        self.unchanged(lambda x: tf.reduce_sum(tf.abs(x - 0.5), -1), x)

    def test_an_operand_read_elsewhere(self):
        def fn(q, p):
            d = tf.abs(q[:, None] - p[None])
            return tf.reduce_sum(d, -1), tf.reduce_max(d)
        self.unchanged(fn, Q, P, said="read outside the sum")

    def test_tape_inside_reads_the_difference(self):
        def step(q, p):
            with tf.GradientTape() as tape:
                tape.watch(p)
                value = tf.reduce_sum(l1(q, p))
            return value, tape.gradient(value, p)
        got, expected = run_both(step, Q, P)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)
        assert not records("rewritten")


def test_is_multiply_is_the_memory_models_fact():
    graph = tf.function(lambda x: (tf.square(x), tf.abs(x))).get_concrete_function(tf.TensorSpec([3])).graph
    ops = {op.type: op for op in graph.get_operations()}
    assert is_multiply(ops["Square"]) and not is_multiply(ops["Abs"])
