"""folding.static_value: constant-only chains that TF does not fold are evaluated; anything fed,
stateful, large or guarded by a control input is not."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import tensor_util
from tensorflow.python.framework.func_graph import FuncGraph

from grappler_ext import folding
from grappler_ext.splitter import rules as split_rules


def in_graph(build):
    g = FuncGraph("folding")
    with g.as_default():
        return build()


def gpflow_permutation(rank):
    """GPflow's base_conditional: perm = concat([range(rank - 2), [rank - 1], [rank - 2]]) via Sub and Reshape."""
    rank = tf.constant(rank)
    leading = tf.reshape(tf.range(0, rank - 2), [-1])
    return tf.concat([leading, tf.reshape(rank - 1, [1]), tf.reshape(rank - 2, [1])], 0)


def test_a_chain_tf_does_not_fold_is_evaluated():
    perm = in_graph(lambda: gpflow_permutation(3))
    assert tensor_util.constant_value(perm) is None          # what the rules saw before
    np.testing.assert_array_equal(folding.static_value(perm), [0, 2, 1])


def test_what_tf_folds_is_returned_as_it_folds_it():
    t = in_graph(lambda: tf.constant([[1, 2], [3, 4]]))
    np.testing.assert_array_equal(folding.static_value(t), [[1, 2], [3, 4]])


def test_a_static_shape_of_a_placeholder_enters_as_a_constant():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [7, 5])
        return tf.reshape(tf.shape(x)[0] - 1, [1])
    np.testing.assert_array_equal(folding.static_value(in_graph(build)), [6])


@pytest.mark.parametrize("build, why", [
    (lambda: tf.compat.v1.placeholder(tf.int32, [2]) + 1, "a placeholder's value"),
    (lambda: tf.Variable([1, 2]).read_value() + 1, "a variable"),
    (lambda: tf.random.uniform([3], maxval=5, dtype=tf.int32) + 1, "a stateful random op"),
    (lambda: tf.range(folding.MAX_ELEMENTS + 1) + 1, "too many elements"),
])
def test_fed_stateful_and_large_values_are_not_evaluated(build, why):
    assert folding.static_value(in_graph(build)) is None, why


def test_a_control_input_stops_folding():
    def build():
        guard = tf.constant(1.0)
        with tf.control_dependencies([guard]):
            return tf.reshape(tf.constant(3) - 1, [1])
    assert folding.static_value(in_graph(build)) is None


def test_results_are_cached_per_graph(monkeypatch):
    perm = in_graph(lambda: gpflow_permutation(4))
    calls = []
    evaluate = folding._evaluate
    monkeypatch.setattr(folding, "_evaluate", lambda t: calls.append(t) or evaluate(t))
    first, second = folding.static_value(perm), folding.static_value(perm)
    np.testing.assert_array_equal(first, [0, 1, 3, 2])
    np.testing.assert_array_equal(second, first)
    assert len(calls) == 1


def test_a_transpose_by_a_computed_permutation_is_split():
    """GPflow's GPR predictions transpose K(X, X*) by such a permutation: the rule now maps the axis."""
    def build():
        x = tf.compat.v1.placeholder(tf.float64, [6, 10])
        return tf.transpose(x, gpflow_permutation(2))
    out = in_graph(build)                                   # perm [1, 0]: output axis a reads input axis 1 - a
    for axis in (0, 1):
        propagation = split_rules.propagate(out.op, 0, axis)
        assert isinstance(propagation, split_rules.Propagation), propagation
        assert propagation.input_axes[0] == 1 - axis
