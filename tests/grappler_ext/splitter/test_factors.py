"""Splits through a reshape's factors: a batch axis through Keras' [B, L, E] <-> [B * L, E] reshapes.

``tf.tensordot`` (tf_keras' ``Dense`` on a 3-D input) merges batch and sequence into the rows of a
matmul and splits them back.  A loop along the batch reads ``[s L, (s + c) L)`` of the merged rows
(the outer factor: a contiguous slice), and through the merge back, ``c`` batch rows again.  Here a
per-example loss over a two-layer feed-forward block, forward and as a training step with the tape
inside: one loop along the batch, within the limit by XLA's figure, equal to the unsplit function.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.splitter.outcome import Code

B, L, D, E = 16, 256, 64, 1024
rng = np.random.default_rng(0)
X = tf.constant(rng.standard_normal((B, L, D)).astype(np.float32))
W1 = tf.Variable(rng.standard_normal((D, E)).astype(np.float32) / 8)
W2 = tf.Variable(rng.standard_normal((E, D)).astype(np.float32) / 30)


def dense(t, w):
    return tf.tensordot(t, w, [[2], [0]])          # [B, L, D] -> reshape [B * L, D] @ w -> [B, L, E]


def per_example(x):
    y = dense(tf.nn.relu(dense(x, W1)), W2)
    return tf.reduce_sum(tf.square(y), axis=[1, 2])                 # [B]


def training_step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example(x))
    return (loss,) + tuple(tape.gradient(loss, [W1, W2]))


@pytest.mark.parametrize("fn", [per_example, training_step], ids=lambda f: f.__name__)
def test_a_batch_loop_through_merged_rows(fn):
    naive = tf_memsafe.memory_footprint(fn, X, rewrite=False)
    limit = naive // 4
    tf_memsafe.enable(limit, strict=True)
    try:
        got = tf.function(fn, jit_compile=True)(X)
        records = [r for r in tf_memsafe.reports()[-1].records if r.pass_name == "splitter"]
        after = tf_memsafe.memory_footprint(fn, X)
    finally:
        tf_memsafe.disable()
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert len(loops) == 1 and loops[0].length == B, [r.reason for r in records]
    assert after <= limit < naive
    want = tf.function(fn, jit_compile=True)(X)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):   # float32 sums reassociated
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


def test_the_sequence_inside_a_merged_batch_is_never_sliced_through_the_merge():
    """Per-position sums reduce the batch: a loop along the sequence would read rows of the merged
    [B * L, E] tensor with a stride, which no rule gives (the reshape refuses the inner factor).
    Whatever is split instead computes what the unsplit function does."""
    def per_position(x):
        return tf.reduce_sum(tf.square(dense(tf.nn.relu(dense(x, W1)), W2)), axis=[0, 2])   # [L]

    tf_memsafe.enable(tf_memsafe.memory_footprint(per_position, X, rewrite=False) // 4)
    try:
        got = tf.function(per_position, jit_compile=True)(X)
    finally:
        tf_memsafe.disable()
    want = tf.function(per_position, jit_compile=True)(X).numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))
