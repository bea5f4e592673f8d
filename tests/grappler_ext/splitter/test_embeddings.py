"""An embedding lookup in a split training step: the gradient recorded for the embedding's table is
``IndexedSlices`` (the rows looked up), which a loop's gradient would sum dense.  So the lookup (a
``GatherV2`` of the variable's value read whole) stays outside the loops, its output sliced, and the
step is split around it: the gradients equal the step as written, the table's still sparse.  (Before,
the rebuilt gradient came out dense and the whole rewrite was dropped with a warning.)"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

import tf_memsafe
from grappler_ext.splitter.outcome import Code
from tests.xla_run import run_and_measure
from tf_memsafe import hook


def test_an_embedding_and_a_convolution_split_around_the_lookup():
    import keras

    keras.utils.set_random_seed(0)
    embed, conv = keras.layers.Embedding(500, 32, dtype="float64"), keras.layers.Conv1D(64, 5, dtype="float64")
    ids = tf.constant(np.random.default_rng(0).integers(0, 500, (32, 200)).astype("int32"))
    conv(embed(ids))
    weights = embed.trainable_weights + conv.trainable_weights

    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.reduce_max(tf.nn.relu(conv(embed(ids))), axis=1) ** 2)
        grads = tape.gradient(loss, weights)
        assert isinstance(grads[0], tf.IndexedSlices)
        return [loss, tf.convert_to_tensor(grads[0]), *grads[1:]]

    want, naive = run_and_measure(tf.function(step, jit_compile=True), ids)    # (the calls' compiles)
    mark = hook.report_mark()
    tf_memsafe.enable(naive // 4)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got, after = run_and_measure(tf.function(step, jit_compile=True), ids)
    finally:
        tf_memsafe.disable()
    assert not any("exactly as traced" in str(w.message) for w in said), [str(w.message) for w in said]
    report = hook.reports_since(mark)[0]
    assert report.status == "rewritten", report.reason
    # The lookup stays outside the loops: its own record says so, or a best effort's region stops there.
    assert any(r.code == Code.SPARSE_LOOKUP or (r.plan is not None and getattr(r.plan, "best_effort", None) and
               r.plan.best_effort.stop_code == Code.SPARSE_LOOKUP)
               for r in report.records if r.pass_name == "splitter"), [(r.code, r.reason) for r in report.records]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10, atol=1e-12)
    assert after < naive, (after, naive)
