"""grappler_ext.loop_convolutions: a convolution made in a loop's body gets gradients XLA:CPU runs
with its fast kernel there (canonical dimension numbers), equal to TensorFlow's; the splitter's
loops through a CNN's training step hold no other convolution."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import loop_convolutions
from tests.xla_run import run_and_measure

RNG = np.random.default_rng(0)


def _gradients(x, w, strides, padding, ours: bool, signature=None):
    """``d/dx, d/dw`` of ``sum(y sin y)``, ``y = conv2d(x, w)``, compiled by XLA: TensorFlow's, or
    :data:`loop_convolutions.GRADIENT`."""
    def grads(x, w):
        graph = tf.compat.v1.get_default_graph()
        with graph.gradient_override_map({"Conv2D": loop_convolutions.GRADIENT} if ours else {}):
            y = tf.nn.conv2d(x, w, strides, padding)
        return tf.gradients(tf.reduce_sum(y * tf.sin(y)), [x, w])

    return [g.numpy() for g in tf.function(grads, jit_compile=True, input_signature=signature)(x, w)]


@pytest.mark.parametrize("size, kernel, strides, padding", [
    (9, 3, 1, "SAME"), (10, 3, 2, "SAME"), (11, 5, 3, "VALID"), (12, 4, 2, "SAME"), (7, 2, 1, "SAME"),
    (8, 1, 1, "VALID"), (9, 3, 1, [[0, 0], [1, 2], [0, 1], [0, 0]])])
@pytest.mark.parametrize("run_time_sizes", [False, True])
def test_the_gradients_are_tensorflows(size, kernel, strides, padding, run_time_sizes):
    """Strides that do and do not divide the size, SAME, VALID and explicit padding, even and odd
    kernels; spatial sizes known or known only when XLA compiles (the loops' slices)."""
    x = tf.constant(RNG.standard_normal((3, size, size + 2, 4)).astype(np.float32))
    w = tf.constant(RNG.standard_normal((kernel, kernel, 4, 5)).astype(np.float32))
    signature = [tf.TensorSpec([None, None, None, None]), tf.TensorSpec(w.shape)] if run_time_sizes else None
    want = _gradients(x, w, strides, padding, ours=False, signature=signature)
    got = _gradients(x, w, strides, padding, ours=True, signature=signature)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_only_what_it_covers_is_marked_and_only_in_a_loop_body_of_an_xla_program():
    """NCHW, dilated and grouped convolutions keep TensorFlow's gradient; a convolution made outside
    a loop body (XLA canonicalizes those itself), or while the program is not XLA's, is not marked."""
    seen = {}

    def probe(x, w, wide):
        def body(i, acc):
            ops = {
                "plain": tf.nn.conv2d(x, w, 1, "SAME").op,
                "dilated": tf.nn.conv2d(x, w, 1, "SAME", dilations=2).op,
                "grouped": tf.nn.conv2d(x, wide, 1, "SAME").op,         # 2 input channels a group of 4
            }
            for name, op in ops.items():
                loop_convolutions.made(op)
                seen[name] = op.node_def.attr.get("_gradient_op_type")
            return i + 1, acc
        top = tf.nn.conv2d(x, w, 1, "SAME").op
        loop_convolutions.made(top)
        seen["top"] = top.node_def.attr.get("_gradient_op_type")
        return tf.while_loop(lambda i, _: i < 1, body, (0, 0.0))[1]

    specs = (tf.TensorSpec([2, 8, 8, 4]), tf.TensorSpec([3, 3, 4, 5]), tf.TensorSpec([3, 3, 2, 6]))
    with loop_convolutions.for_xla(True):
        tf.function(probe).get_concrete_function(*specs)
    assert seen["plain"].s == loop_convolutions.GRADIENT.encode(), seen
    assert all(seen[k] is None for k in ("dilated", "grouped", "top")), seen
    with loop_convolutions.for_xla(False):
        tf.function(probe).get_concrete_function(*specs)
    assert seen["plain"] is None


def _cnn_step(x, labels, weights):
    """A small CNN's training step with the tape inside: two convolutions (one strided), pooling, a
    classifier; the loss and every weight's gradient."""
    w1, w2, w3 = weights
    with tf.GradientTape() as tape:
        h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME"))
        h = tf.nn.relu(tf.nn.conv2d(h, w2, 2, "SAME"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        logits = tf.reshape(h, [tf.shape(h)[0], -1]) @ w3
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    return (loss, *tape.gradient(loss, weights))


def test_a_split_cnn_step_holds_only_canonical_convolutions_and_computes_the_same():
    """The step over 64 images of 32 x 32 under a limit that splits it along the batch: every
    convolution in XLA's optimized program (the loop's gradients among them) is canonical, the
    loss and gradients equal the unsplit step's, and XLA's figure is within the limit."""
    x = tf.constant(RNG.standard_normal((64, 32, 32, 3)).astype(np.float32))
    labels = tf.constant(RNG.integers(0, 10, 64))
    weights = [tf.Variable(RNG.standard_normal(s).astype(np.float32) * 0.1)
               for s in ((3, 3, 3, 16), (3, 3, 16, 32), (8 * 8 * 32, 10))]

    def step(x, labels):
        return _cnn_step(x, labels, weights)

    want, naive = run_and_measure(tf.function(step, jit_compile=True), x, labels)
    limit = naive // 4
    tf_memsafe.enable(limit, strict=True)
    try:
        fn = tf.function(step, jit_compile=True)
        got, after = run_and_measure(fn, x, labels)
        hlo = fn.experimental_get_compiler_ir(x, labels)(stage="optimized_hlo")
        split = any(r.code is not None and r.code.name == "SPLIT"
                    for rep in tf_memsafe.reports() for r in rep.records)
    finally:
        tf_memsafe.disable()
    assert split and " while(" in hlo
    labels_seen = set(re.findall(r"dim_labels=(\S+?)[,}]", hlo))
    assert labels_seen == {"b01f_01io->b01f"}, labels_seen
    assert after <= limit < naive, (after, limit, naive)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize("size, kernel, strides, padding", [
    (7, 5, 2, "SAME"), (7, 3, 1, "SAME"), (8, 4, 2, "VALID"), (9, 3, 3, "SAME")])
def test_a_transposed_convolution_in_a_loop_is_built_canonical_with_tensorflows_values(size, kernel, strides,
                                                                                        padding):
    """``Conv2DTranspose``'s op made in a loop body is built again as a canonical XLA convolution: its
    value and the gradients of its input and kernel equal TensorFlow's at the top level, and XLA's
    program holds no other convolution."""
    x = tf.constant(RNG.standard_normal((2, size, size + 1, 6)).astype(np.float32))
    w = tf.constant(RNG.standard_normal((kernel, kernel, 3, 6)).astype(np.float32))     # 6 -> 3 channels
    out_h = size * strides if padding == "SAME" else (size - 1) * strides + kernel
    out_w = (size + 1) * strides if padding == "SAME" else size * strides + kernel
    shape = [2, out_h, out_w, 3]

    def loss(x, w, in_loop):
        y = tf.nn.conv2d_transpose(x, w, shape, strides, padding)
        if in_loop:
            (y,) = loop_convolutions.made(y.op)
        return y, tf.reduce_sum(y * tf.sin(y))

    @tf.function(jit_compile=True)
    def top(x, w):
        y, value = loss(x, w, False)
        return (y, *tf.gradients(value, [x, w]))

    @tf.function(jit_compile=True)
    def looped(x, w):
        def body(i, y, gx, gw):
            y, value = loss(x, w, True)
            return (i + 1, y, *tf.gradients(value, [x, w]))
        start = (0, tf.zeros(shape), tf.zeros_like(x), tf.zeros_like(w))
        with loop_convolutions.for_xla(True):
            return tf.while_loop(lambda i, *_: i < 1, body, start)[1:]

    want, got = top(x, w), looped(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b.numpy()).max())
    hlo = looped.experimental_get_compiler_ir(x, w)(stage="optimized_hlo")
    assert set(re.findall(r"dim_labels=(\S+?)[,}]", hlo)) == {"b01f_01io->b01f"}


def test_a_transposed_convolution_of_a_run_time_batch_is_split_along_it():
    """A decoder's step on batches of run-time size (Keras' ``Conv2DTranspose`` on ``tf.data`` batches: its
    output's shape computed from ``tf.shape``): the transposed convolution is split along the batch (its
    shape operand rebuilt with the slice's rows), within the limit, loss and gradients equal."""
    weights = [tf.Variable(RNG.standard_normal(s).astype(np.float32) * 0.1)
               for s in ((3, 3, 16, 8), (3, 3, 4, 16), (3, 3, 4, 1))]

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 16, 16, 8])])
    def step(z):
        w1, w2, w3 = weights
        with tf.GradientTape() as tape:
            b = tf.shape(z)[0]
            h = tf.nn.relu(tf.nn.conv2d_transpose(z, w1, tf.stack([b, 32, 32, 16]), 2, "SAME"))
            h = tf.nn.relu(tf.nn.conv2d_transpose(h, w2, tf.stack([b, 64, 64, 4]), 2, "SAME"))
            loss = tf.reduce_mean(tf.square(tf.nn.conv2d(h, w3, 1, "SAME")))
        return (loss, *tape.gradient(loss, weights))

    z = tf.constant(RNG.standard_normal((24, 16, 16, 8)).astype(np.float32))
    want, naive = run_and_measure(step, z)           # (XLA's figures for the compiles the calls made)
    tf_memsafe.enable(naive // 4, strict=True)
    try:
        fn = tf.function(step.python_function, jit_compile=True, input_signature=[tf.TensorSpec([None, 16, 16, 8])])
        got, after = run_and_measure(fn, z)
        records = [r for rep in tf_memsafe.reports() for r in rep.records if r.pass_name == "splitter"]
    finally:
        tf_memsafe.disable()
    assert any(r.code is not None and r.code.name == "SPLIT" for r in records), [r.reason for r in records]
    assert not any("conv_transpose" in r.reason and "not a constant" in r.reason for r in records)
    assert after <= naive // 4, (after, naive)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b.numpy()).max())
