"""A Transformer encoder layer written the ordinary Keras way, at batch 4, split along its sequence (issue 28).

``MultiHeadAttention`` (4 heads), a feed-forward pair of ``Dense`` layers on the 3-D activations and
two ``LayerNormalization``s, residuals around each, as the Keras and TensorFlow tutorials write it.
Both Keras versions: Keras 3 (``Dense`` on [B, L, D] is a ``tensordot`` through [B * L, D], its
layer norm moments and multiplies) and tf_keras (the same ``tensordot``; its layer norm a
``FusedBatchNormV3`` on [1, B * L, D, 1]: one channel per position).  The batch is 4, so a loop
along the sequence reads the merged [B * L, ..] rows through the reshapes' inner factor, and passes
the fused batch norm along its channels.

What is checked, at L = 512, D = 64 (naive: 19 to 54 MB):
- the forward is one loop along the sequence through the whole layer (from the attention's queries
  to the second layer norm's output), not one per op group; within a quarter of the naive footprint
  by XLA's figure; equal to the unsplit layer;
- a training step with the tape inside (mean squared output, the gradients of every weight) is
  within a limit of an eighth of its naive footprint, loss and gradients equal to the unsplit step's.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.splitter.outcome import Code
from tf_memsafe import hook

pytestmark = pytest.mark.slow

B, L, D, HEADS = 4, 512, 64, 4


def _keras(version: str):
    if version == "keras3":
        import keras
    else:
        import tf_keras as keras
    return keras


def _encoder(keras):
    class Encoder(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(HEADS, D // HEADS)
            self.hidden = keras.layers.Dense(4 * D, activation="relu")
            self.out = keras.layers.Dense(D)
            self.norm1 = keras.layers.LayerNormalization()
            self.norm2 = keras.layers.LayerNormalization()

        def call(self, x):
            x = self.norm1(x + self.attention(x, x))
            return self.norm2(x + self.out(self.hidden(x)))

    keras.utils.set_random_seed(0)
    layer = Encoder()
    x = tf.constant(np.random.default_rng(0).standard_normal((B, L, D)).astype(np.float32))
    layer(x)
    return layer, x


def _run(fn, x, limit):
    mark = hook.report_mark()
    tf_memsafe.enable(limit, strict=True)
    try:
        got = tf.function(fn, jit_compile=True)(x)
        after = tf_memsafe.memory_footprint(fn, x)
    finally:
        tf_memsafe.disable()
    # (the call's trace: memory_footprint traces again)
    records = [r for r in hook.reports_since(mark)[0].records if r.pass_name == "splitter"]
    want = tf.function(fn, jit_compile=True)(x)
    # float32 sums reassociated; the keys' bias gradient is 0 up to rounding (softmax ignores it)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
    return after, records


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_the_forward_is_one_loop_along_the_sequence(version):
    layer, x = _encoder(_keras(version))

    def forward(x):
        return layer(x)

    naive = tf_memsafe.memory_footprint(forward, x, rewrite=False)
    after, records = _run(forward, x, naive // 8)
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert len(loops) == 1 and loops[0].length == L, [r.reason for r in records]
    assert after <= naive / 4, (after, naive)


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_a_training_step_fits_an_eighth_of_its_footprint(version):
    layer, x = _encoder(_keras(version))

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x)))
        return (loss,) + tuple(tape.gradient(loss, layer.trainable_variables))

    naive = tf_memsafe.memory_footprint(step, x, rewrite=False)
    after, records = _run(step, x, naive // 8)
    assert any(r.plan is not None and r.plan.length == L for r in records), [r.reason for r in records]
    assert after <= naive // 8, (after, naive)
