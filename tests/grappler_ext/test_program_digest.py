"""A traced program's digest (:mod:`grappler_ext.program_digest`): names aside, shapes included."""

from __future__ import annotations

import tensorflow as tf

from grappler_ext.program_digest import graph_fingerprint


def traced(variable: tf.Variable, rows: int):
    def step(x):
        def body(i, acc):
            return i + 1, acc + tf.reduce_sum(tf.matmul(x, variable))
        return tf.while_loop(lambda i, acc: i < 3, body, (0, 0.0))[1]
    return tf.function(step).get_concrete_function(tf.TensorSpec([rows, 4])).graph


def test_the_same_program_traced_again_has_the_same_digest_and_another_does_not():
    """Traced twice (its loop's functions named anew): one digest.  A variable of
    another shape, which the graph's ops do not spell, or inputs of another shape: another."""
    weights = tf.Variable(tf.ones([4, 8]))
    first, again = traced(weights, 16), traced(weights, 16)
    def bodies(graph):
        return {f.signature.name for f in graph.as_graph_def().library.function}

    assert bodies(first) and not bodies(first) & bodies(again)
    assert graph_fingerprint(first) == graph_fingerprint(again)
    assert graph_fingerprint(traced(tf.Variable(tf.ones([4, 9])), 16)) != graph_fingerprint(first)
    assert graph_fingerprint(traced(weights, 17)) != graph_fingerprint(first)
