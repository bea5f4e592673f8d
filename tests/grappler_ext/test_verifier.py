"""The verifier's rule on generated ops' shapes: fully known in a static program; in a program with
inputs of run-time sizes, their rank known, except in what TensorFlow's gradient functions make."""

from __future__ import annotations

import pytest
import tensorflow as tf

from grappler_ext.graph_edit import GENERATED_SCOPE
from grappler_ext.verifier import VerificationError, verify

KERNEL = tf.constant([[1.0, 2.0], [3.0, 4.0]])


def _graph(spec, build):
    """A graph whose output is ``build(x)`` made under tf_memsafe's scope (as a pass would)."""
    def fn(x):
        with tf.name_scope(GENERATED_SCOPE):
            return build(x)
    return tf.function(fn).get_concrete_function(spec).graph


def _gradient_of_a_broadcast_matmul(x):
    # tf.gradients of a [B, L, 2] x [2, 2] product: the kernel's gradient sums over the axes a
    # BroadcastGradientArgs of the run-time shapes gives, of unknown rank where B is unknown.
    (grad,) = tf.gradients(tf.reduce_sum(tf.matmul(x, KERNEL)), [KERNEL])
    return grad


def _unknown_rank(x):
    return tf.reshape(x, tf.unique(tf.cast(tf.reshape(x, [-1]), tf.int32))[0])  # (a shape of the data's length)


def test_a_gradient_function_may_make_an_unknown_rank_in_a_dynamic_program():
    g = _graph(tf.TensorSpec([None, 3, 2]), _gradient_of_a_broadcast_matmul)
    assert any(op.name.startswith(GENERATED_SCOPE) and "_grad/" in op.name and op.outputs
               and op.outputs[0].shape.rank is None for op in g.get_operations())
    verify(g)


def test_a_generated_op_of_unknown_rank_elsewhere_is_refused():
    g = _graph(tf.TensorSpec([None, 3, 2]), _unknown_rank)
    with pytest.raises(VerificationError, match="unknown static shape <unknown>"):
        verify(g)


def test_a_static_program_keeps_every_generated_shape_known():
    verify(_graph(tf.TensorSpec([4, 3, 2]), _gradient_of_a_broadcast_matmul))    # (TensorFlow infers the sum)
    g = _graph(tf.TensorSpec([4, 3, 2]), _unknown_rank)
    with pytest.raises(VerificationError, match="unknown static shape"):
        verify(g)
