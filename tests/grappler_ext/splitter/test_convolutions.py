"""Convolutions in split regions: along the batch (a slice of the images, the filter whole), and a
convolution as a loop's root contracting its input channels, so that a wide hidden layer between two
convolutions is computed a block of channels at a time, each block's share of the second
convolution summed.  Float64, against the program as written, forward and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from tests.xla_run import run_and_measure
from tf_memsafe import hook

RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((8, 32, 32, 3)))
W1 = tf.Variable(RNG.standard_normal((3, 3, 3, 256)) * 0.1)
W2 = tf.Variable(RNG.standard_normal((3, 3, 256, 8)) * 0.1)


def _forward(x):
    h = tf.nn.relu(tf.nn.conv2d(x, W1, 1, "SAME"))                  # [8, 32, 32, 256]: the wide layer
    return tf.reduce_sum(tf.nn.conv2d(h, W2, 1, "SAME") ** 2, axis=[1, 2])


def _step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(_forward(x))
    return [loss, *tape.gradient(loss, [W1, W2])]


def _split(fn, divisor):
    want, naive = run_and_measure(tf.function(fn, jit_compile=True), X)      # (XLA's figures for the
    mark = hook.report_mark()                                                   # compiles the calls made)
    tf_memsafe.enable(naive // divisor, strict=True)
    try:
        got, after = run_and_measure(tf.function(fn, jit_compile=True), X)
    finally:
        tf_memsafe.disable()
    plans = [r.plan for r in hook.reports_since(mark)[0].records
             if r.pass_name == "splitter" and r.action == "rewritten"]
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)
    return naive, after, plans


def test_a_wide_hidden_layer_is_computed_by_blocks_of_channels():
    naive, after, plans = _split(_forward, 8)
    assert after <= naive // 8, (after, naive)
    conv_roots = [p for p in plans if any(s.kind == "sum" and s.op_type == "Conv2D" for s in p.roots)]
    assert conv_roots and conv_roots[0].length == 256, [p.render() for p in plans]


def test_its_training_step_with_the_tape_inside():
    naive, after, plans = _split(_step, 6)
    assert after <= naive // 6, (after, naive)
    assert plans


@pytest.mark.parametrize("pool", [tf.nn.max_pool2d, tf.nn.avg_pool2d])
def test_convolution_and_pooling_along_the_batch(pool):
    w = tf.constant(RNG.standard_normal((5, 5, 3, 64)) * 0.1)

    def fn(x):
        h = pool(tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME")), 2, 2, "VALID")     # [8, 16, 16, 64]
        return tf.reduce_max(tf.reshape(h, [8, -1]), axis=1)

    naive, after, plans = _split(fn, 4)
    assert after <= naive // 4, (after, naive)
    assert any(p.length == 8 for p in plans), [p.render() for p in plans]


@pytest.mark.parametrize("version", ["keras3", pytest.param("tf_keras", marks=pytest.mark.heavy)])
def test_batch_normalisation_in_a_training_step_along_the_channels(version):
    """Convolution, batch normalisation in training (statistics over the batch: the batch cannot be
    split), ReLU, convolution: split along the hidden channels, the moving statistics updated slice by
    slice, the normalisation's gradient rebuilt in the loop; loss, gradients and moving statistics equal.

    The ``tf_keras`` case is ``heavy`` (about 12 s; ``python -m tests -m heavy`` runs it): the step, its
    split along the channels and its moving statistics are checked by the ``keras3`` case of this test;
    tf_keras' own op, ``FusedBatchNormV3`` in training (NHWC), split along the channels and its gradient
    ``FusedBatchNormGradV3``, by tests/grappler_ext/splitter/test_rules.py's
    ``test_rule_computes_exactly_the_slice`` (its ``FusedBatchNormV3-NHWC`` and ``FusedBatchNormGradV3``
    cases)."""
    from tests.integration.keras_fit import keras_of

    keras = keras_of(version)
    images = tf.constant(RNG.standard_normal((8, 32, 32, 3)))

    def build():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Conv2D(128, 3, padding="same", dtype="float64"),
                  keras.layers.BatchNormalization(dtype="float64"),
                  keras.layers.Conv2D(8, 3, padding="same", dtype="float64")]
        x = images
        layers[2](layers[1](layers[0](x)))
        weights = [w for layer in layers for w in layer.trainable_weights]
        stats = [w for w in layers[1].weights if "moving" in w.name]

        def step(x):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(layers[1](layers[0](x), training=True))
                loss = tf.reduce_sum(layers[2](h) ** 2)
            grads = tape.gradient(loss, weights)
            for w, g in zip(weights, grads):
                w.assign_sub(1e-4 * g)
            return loss
        return step, weights + stats, x

    step, variables, x = build()
    want, naive = run_and_measure(tf.function(step, jit_compile=True), x)    # (the calls' compiles)
    want_vars = [v.numpy() for v in variables]
    step, variables, x = build()
    mark = hook.report_mark()
    tf_memsafe.enable(naive // 8, strict=True)
    try:
        got, after = run_and_measure(tf.function(step, jit_compile=True), x)
        got_vars = [v.numpy() for v in variables]
    finally:
        tf_memsafe.disable()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)
    for g, w in zip(got_vars, want_vars):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
    assert after <= naive // 8, (after, naive)
    plans = [r.plan for r in hook.reports_since(mark)[0].records
             if r.pass_name == "splitter" and r.action == "rewritten"]
    assert any(p.length == 128 for p in plans), [p.render() for p in plans]


def test_dilated_convolutions_are_split_along_the_batch():
    """A WaveNet's stack of causal convolutions dilated 1, 2, 4 and 8 (what Keras' ``Conv1D(dilation_rate=...)``
    builds: ``SpaceToBatchND``, the convolution, ``BatchToSpaceND``), its training step with the tape
    inside: the batch passes through the blocks moved into it and back, so one loop over the examples
    computes each slice's forward and gradients (before: unchanged, over the limit)."""
    x = tf.constant(RNG.standard_normal((8, 512, 1)))
    y = tf.constant(RNG.standard_normal((8, 512, 1)))
    weights = [tf.Variable(RNG.standard_normal((1, 1, 16)) * 0.5)] + [
        tf.Variable(RNG.standard_normal((2, 16, 16)) * 0.3) for _ in range(4)] + [
        tf.Variable(RNG.standard_normal((1, 16, 1)) * 0.3)]

    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.nn.convolution(x, weights[0], padding="VALID")
            for rate, w in zip((1, 2, 4, 8), weights[1:-1]):
                h = h + tf.tanh(tf.nn.convolution(tf.pad(h, [[0, 0], [rate, 0], [0, 0]]), w, padding="VALID",
                                                  dilations=rate))
            loss = tf.reduce_mean(tf.square(tf.nn.convolution(h, weights[-1], padding="VALID") - y))
        return [loss, *tape.gradient(loss, weights)]

    traced = tf.function(step, jit_compile=True).get_concrete_function(x, y).graph
    assert {"SpaceToBatchND", "BatchToSpaceND"} <= {op.type for op in traced.get_operations()}
    want, naive = run_and_measure(tf.function(step, jit_compile=True), x, y)  # (the calls' compiles)
    mark = hook.report_mark()
    tf_memsafe.enable(naive // 6)
    try:
        got, after = run_and_measure(tf.function(step, jit_compile=True), x, y)
    finally:
        tf_memsafe.disable()
    plans = [r.plan for r in hook.reports_since(mark)[0].records
             if r.pass_name == "splitter" and r.action == "rewritten"]
    assert after <= naive // 6, (after, naive)
    assert any(p.length == 8 for p in plans), [p.render() for p in plans]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)
