"""Run-time sizes of ops a rewrite makes after the sizes' table was (``grappler_ext.shapes``).

Planning a padded batch's step reads each tensor's dimensions from a table made once, from the
program as traced (:func:`grappler_ext.shapes.symbols`).  The splitter then makes ops of its own
(a gradient differentiated again through a loop, a loop's stacked slices, a prologue's conditional)
whose dimensions TensorFlow's inference leaves unknown: read at the nominal size each, a [B, H, L, L]
gradient of 8 heads counted ``L``**4 elements, and the memory model put a Transformer's split step
at terabytes (7.7e12 B where XLA's figure was 630 MB), so the planner never believed it fitted.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from grappler_ext import memory_model, shapes
from grappler_ext.splitter import nominal

E = 16
SPEC = tf.TensorSpec([None, None, E])


def _graph_of(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph


def _table(g):
    return shapes.symbols(g, nominal.dynamic_inputs(g))


def _scores(x):
    return tf.einsum("bqe,bke->bqk", x, x) / 4.0                    # [B, L, L]


def _loss(x):
    return tf.reduce_sum(tf.sin(tf.einsum("bqk,bke->bqe", tf.nn.softmax(_scores(x), -1), x)))


def test_ops_made_after_the_table_are_read_at_the_nominal_sizes():
    g = _graph_of(_scores, SPEC)
    table, scores, x = _table(g), g.outputs[0], g.inputs[0]
    with g.as_default():
        row = tf.reduce_mean(scores, 1, keepdims=True)                           # [B, 1, L]
        (d_row,) = tf.gradients(tf.reduce_sum(tf.sin(scores + row)), [row])     # a sum over broadcast axes
        summed = d_row.op.inputs[0]
        heads = tf.reshape(scores, tf.stack([tf.shape(x)[0], 2, tf.shape(x)[1], -1]))   # from tf.shape
        _, carried = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2.0), (0, tf.zeros_like(scores)))
    assert summed.op.type == "Sum" and not summed.shape.is_fully_defined()
    with shapes.nominal(512, table, {0: 8}):
        assert shapes.resolve(g) > 0
        assert shapes.dims(row) == [8, 1, 512]
        assert shapes.num_elements(summed) == 8 * 512 and shapes.dims(d_row) == [8, 1, 512]
        assert shapes.dims(heads) == [8, 2, 512, 256]
        assert shapes.dims(carried) == [8, 512, 512]           # a loop's carried value keeps its shape
        assert shapes.resolve(g) == 0                          # each op examined once a size
    with shapes.nominal(64, table, {0: 2}):                    # another size: read again
        assert shapes.resolve(g) > 0 and shapes.num_elements(summed) == 2 * 64
    with shapes.nominal(512):                                  # no table: every unknown dimension at 512
        assert shapes.resolve(g) == 0 and shapes.dims(carried) == [512, 512, 512]
    assert shapes.dims(carried) == carried.shape.as_list()     # outside planning: as they are


def test_a_gradient_built_after_the_table_is_counted_as_if_traced_with_it():
    """The splitter differentiates the recorded gradients again after each loop: the memory model's
    count of a step whose gradient was built after the table equals its count of the same step traced
    with its gradient (within 5 %); read at the nominal size in every unknown dimension it was
    many times over."""
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _loss(x)
        return loss, tape.gradient(loss, x)
    traced, later = _graph_of(step, SPEC), _graph_of(_loss, SPEC)
    traced_table, later_table = _table(traced), _table(later)
    with later.as_default():
        (gx,) = tf.gradients(later.outputs[0], [later.inputs[0]])
    later.outputs.append(gx)
    with shapes.nominal(512, traced_table, {0: 8}):
        want = memory_model.estimate(traced).peak_bytes
    with shapes.nominal(512, later_table, {0: 8}):
        got = memory_model.estimate(later).peak_bytes
    assert want and abs(got - want) <= 0.05 * want, (got, want)
    with shapes.nominal(512, later_table, {0: 8}):
        assert later_table.resolved                            # (what made the difference)


def test_stacked_slices_copies_and_conditionals_are_read_as_declared():
    g = _graph_of(lambda x: x * 2.0, SPEC)
    table, x = _table(g), g.inputs[0]
    with shapes.nominal(300, table, {0: 4}):
        with g.as_default():
            steps = tf.shape(x)[1] // 7 + 1
            array = tf.TensorArray(tf.float32, size=steps, element_shape=[None, 7, E], infer_shape=True)
            shapes.declare_stacked(array, x)                  # its slices are x's, 7 rows each
            _, array = tf.while_loop(lambda i, a: i < steps, lambda i, a: (i + 1, a.write(i, x[:, :7] * 1.0)),
                                     (0, array))
            stacked = array.stack()                                                    # [S, B, 7, E]
            other = tf.TensorArray(tf.float32, size=steps, element_shape=[None, None, E], infer_shape=True)
            shapes.declare_stacked(other, x)
            unknown = tf.while_loop(lambda i, a: i < steps, lambda i, a: (i + 1, a.write(i, x * 1.0)),
                                    (0, other))[1].stack()
            moved = tf.transpose(stacked, [1, 0, 2, 3])
            copy = tf.identity(x + 1.0)
            chosen = tf.cond(tf.reduce_sum(x) > 0.0, lambda: x * 3.0, lambda: x)
        shapes.copied([(x, copy)])
        shapes.shaped_as(chosen, x)
        shapes.resolve(g)
        # ceil(300 / 7) slices of [4, 7, E]: x's elements and a chunk's rows more at most (not 300 slices).
        assert shapes.dims(stacked) == [43, 4, 7, E] and shapes.dims(moved) == [4, 43, 7, E]
        assert shapes.dims(unknown) == [1, 4, 300, E]          # a chunk known only at run time: x's shape
        assert shapes.dims(copy) == [4, 300, E]
        assert shapes.dims(chosen) == shapes.dims(chosen.op.inputs[0]) == [4, 300, E]   # and the If's output
    assert table.names[copy.name] == table.names[x.name]                                 # at every size
    assert shapes.dims(stacked) == stacked.shape.as_list()


def test_a_graph_without_a_table_of_its_own_is_left_as_read():
    g = _graph_of(_scores, SPEC)
    table = shapes.Symbols({}, 0)                              # made by hand: no ops known as born
    with g.as_default():
        extra = tf.reduce_mean(g.outputs[0], 1)
    with shapes.nominal(100, table):
        assert shapes.resolve(g) == 0 and shapes.dims(extra) == [100, 100]
    assert np.array_equal(shapes.dims(extra), [None, None])
