"""A loop's backward built once and copied after (``grappler_ext.splitter.replay``), and whose it is.

The splitter differentiates the function's gradients again after each loop it installs, so every
earlier loop's backward is copied once more each time.  The copies' gradient loops were counted by the
plan of the loop just built (a batch loop's 1.5 GB body given to every earlier loop's gradient in a
Transformer's step): each op a backward makes, built or copied, is its own loop's (:func:`replay.owner`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from grappler_ext.splitter import replay

LOOPS = ("While", "StatelessWhile")


def test_a_copied_backward_computes_the_same_and_is_owned_by_its_loop():
    token, seen = object(), {}

    def fn(x):
        @tf.custom_gradient
        def doubled(v):
            def grad(up):
                _, total = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a + up), (0, tf.zeros_like(up)))
                return [total]                                  # 3 * up
            return v * 2.0, replay.once(grad, token)

        y = doubled(x)
        graph = tf.compat.v1.get_default_graph()
        marks = [set(graph.get_operations())]
        (first,) = tf.gradients(tf.reduce_sum(y), [x])
        marks.append(set(graph.get_operations()))
        (second,) = tf.gradients(tf.reduce_sum(y * 3.0), [x])  # an upstream of the same kind: copied
        marks.append(set(graph.get_operations()))
        seen["made"] = [marks[1] - marks[0], marks[2] - marks[1]]
        seen["forward"] = y.op
        return first, second

    first, second = tf.function(fn, autograph=False)(tf.ones([4]))
    np.testing.assert_allclose(first, np.full(4, 3.0))
    np.testing.assert_allclose(second, np.full(4, 9.0))
    built, copied = ([op for op in made if op.type in LOOPS] for made in seen["made"])
    assert len(built) == len(copied) == 1
    assert replay.owner(built[0]) is token and replay.owner(copied[0]) is token
    assert copied[0].get_attr("body") == built[0].get_attr("body")         # referenced, not traced again
    assert replay.owner(seen["forward"]) is None
    assert all(replay.owner(op) is None for op in seen["made"][1] if "gradients_1/mul" in op.name)
