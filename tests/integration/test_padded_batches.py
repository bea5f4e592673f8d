"""Padded batches: the batch and the sequence length both known only at run time (issue 28).

``tf.data``'s ``padded_batch`` gives every batch its own longest length, so Keras traces its step with
``[None, None]`` tokens, as the TensorFlow Transformer tutorial's pipeline does.  The splitter plans
such a program at nominal sizes (a batch of 8, the length where what grows is 4x the limit), reads
every tensor's dimensions as products of the run-time sizes through TensorFlow's own shape inference
(:func:`grappler_ext.shapes.symbols`), and scales its loops' chunks to the sizes of each run
(:mod:`grappler_ext.splitter.scaling`).  XLA compiles the one trace once per concrete shape.

Both Keras versions:
- a ``MultiHeadAttention`` layer traced with ``input_signature=[TensorSpec([None, None, 64])]``:
  within a sixth of its footprint (at batch 4, length 512) by XLA's figure, compiled at that shape
  and at [2, 1024]; equal to the unsplit layer at both and at [3, 77];
- ``fit(jit_compile=True)`` of an embedding, that attention and a pooled classifier on padded
  batches of 3 sequences of 128 to 512 tokens (Adam): losses equal to the unsplit fit's, every
  program XLA compiles for the step within 6 MB (about 41 MB as written), and nothing said.

Under tf_keras the fit, the encoder layer's step and the wide heads' step are ``heavy``
(``keras_fit.KERAS3_TF_KERAS_HEAVY``): its attention on padded batches runs by default here, its
``fit`` on batches of run-time size in test_dynamic_batches, its encoder step in test_encoder_layer.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from experiments.padded import attention_classifier
from grappler_ext.splitter.outcome import Code
from tests.integration.keras_fit import KERAS3_TF_KERAS_HEAVY, fit_under, keras_of
from tests.xla_run import run_and_measure
from tf_memsafe import hook, xla_flags

pytestmark = pytest.mark.slow

D, HEADS, VOCAB = 64, 4, 50


def _attention(keras):
    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(HEADS, D // HEADS)
    x = _tokens(4, 512)
    layer(x, x)
    return layer


def _tokens(batch, length):
    return tf.constant(np.random.default_rng(batch * 1000 + length).standard_normal((batch, length, D)),
                       tf.float32)


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_an_attention_layer_on_padded_batches_keeps_its_limit_at_every_shape(version):
    layer = _attention(keras_of(version))

    def attend(x):
        return tf.reduce_sum(tf.sin(layer(x, x)))

    # (XLA's figures of the very programs run, at their first call: tests/xla_run.py)
    naive = tf.function(attend, jit_compile=True)
    want, naive_bytes = run_and_measure(naive, _tokens(4, 512))
    limit = naive_bytes // 6
    mark = hook.report_mark()
    tf_memsafe.enable(limit, strict=True)
    try:
        padded = tf.function(attend, jit_compile=True, input_signature=[tf.TensorSpec([None, None, D])])
        got, after = {}, {}
        for shape in ((4, 512), (2, 1024), (3, 77)):
            got[shape], after[shape] = run_and_measure(padded, _tokens(*shape))
        del after[3, 77]
    finally:
        tf_memsafe.disable()
    records = [r for r in hook.reports_since(mark)[0].records if r.pass_name == "splitter"]
    assert records[0].code == Code.DYNAMIC_SHAPES and "8 for the batch" in records[0].reason, records[0].reason
    assert any(r.code == Code.SPLIT and r.plan.dynamic for r in records), [r.reason for r in records]
    for shape, value in got.items():
        np.testing.assert_allclose(value.numpy(), (want if shape == (4, 512) else naive(_tokens(*shape))).numpy(),
                                   rtol=1e-4, err_msg=str(shape))
    for shape, figure in after.items():
        before = tf_memsafe.memory_footprint(padded, tf.TensorSpec([*shape, D]), rewrite=False)
        assert figure <= limit < before // 4, (shape, figure, limit, before)


def _fit(keras, limit):
    """One epoch of ``fit(jit_compile=True)`` on padded batches of 3 (lengths 128 to 512): losses,
    splitter records, warnings, and XLA's largest figure among the programs compiled."""
    model = attention_classifier(keras, VOCAB)         # (experiments/padded.py's model)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, VOCAB, n) for n in (300, 512, 420, 512, 128, 512, 512, 200)]
    data = tf.data.Dataset.from_generator(
        lambda: ((s, np.int32(s.sum() % VOCAB)) for s in sequences),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))).padded_batch(3)
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        losses, records, said = fit_under(model, data, limit)
        return losses, records, said, max(total for _, total in xla_flags.memory_reports(folder))


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_fit_on_padded_batches_is_split_within_the_limit(version):
    keras = keras_of(version)
    want, _, _, naive = _fit(keras, None)
    got, records, said, after = _fit(keras, 6 * 10**6)
    assert not said, said            # (nothing about Keras 3's first trace, which creates the optimizer's slots)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    loops = [r.plan for r in records if r.code == Code.SPLIT]
    assert loops and all(p.dynamic for p in loops), [r.reason for r in records]
    assert after <= 6 * 10**6 < naive // 5, (after, naive)


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_an_encoder_layer_on_padded_batches_is_split_along_its_sequence_within_an_eighth(version):
    """test_encoder_layer's layer (attention, a ``Dense`` pair on the 3-D activations, two layer norms)
    as a training step traced with ``input_signature=[TensorSpec([None, None, 64])]``: its ``Dense``
    layers merge the run-time batch and length into [B * L, ..] rows, read with ``tf.shape``.  One
    loop along the sequence through the whole layer and its gradient, planned at nominal sizes (and
    with tf_keras one more along the batch, for what is left at those sizes):
    within an eighth of the step's footprint at [4, 512] and at [2, 1024] by XLA's figure, loss and
    gradients equal to the unsplit step's at [4, 512] and [3, 77]."""
    from tests.integration.test_encoder_layer import _encoder, _step

    layer, _ = _encoder(keras_of(version))
    step = _step(layer)
    batch = {shape: tf.constant(np.random.default_rng(shape[1]).standard_normal((*shape, D)), tf.float32)
             for shape in ((4, 512), (3, 77))}
    # (XLA's figures of the very programs run, at their first call: tests/xla_run.py)
    naive = tf.function(step, jit_compile=True)
    want = {}
    want[4, 512], naive_bytes = run_and_measure(naive, batch[4, 512])
    limit = naive_bytes // 8
    mark = hook.report_mark()
    tf_memsafe.enable(limit, strict=True)
    try:
        padded = tf.function(step, jit_compile=True, input_signature=[tf.TensorSpec([None, None, D])])
        got, after = {}, {}
        got[4, 512], after[4, 512] = run_and_measure(padded, batch[4, 512])
        got[3, 77] = padded(batch[3, 77])
        after[2, 1024] = tf_memsafe.memory_footprint(padded, tf.TensorSpec([2, 1024, D]))
    finally:
        tf_memsafe.disable()
    records = [r for r in hook.reports_since(mark)[0].records if r.pass_name == "splitter"]
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    # (tf_keras' plan adds a loop along the batch for what is left at its nominal sizes)
    along = [p for p in loops if p.dynamic and p.roots[0].kind == "mean" and p.roots[0].input_axes[0] == 1]
    assert records[0].code == Code.DYNAMIC_SHAPES and along and len(loops) <= 2, [r.reason for r in records]
    for shape, figure in after.items():
        assert figure <= limit, (shape, figure, limit)
    want[3, 77] = naive(batch[3, 77])
    for shape in batch:
        # float32 sums reassociated; the keys' bias gradient is 0 up to rounding (softmax ignores it)
        for g, w in zip(got[shape], want[shape]):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=max(1e-6, 1e-5 * float(np.max(np.abs(w)))),
                                       err_msg=str(shape))


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_attention_with_heads_as_wide_as_the_layer_is_split_along_the_batch(version):
    """A ``MultiHeadAttention`` of 8 heads of ``key_dim`` the layer's width (as Keras' seq2seq
    translation example writes it: its projections 8x the input), trained on padded batches (SGD,
    ``input_signature=[TensorSpec([None, None, 128])]``) under 128 MB.  Ranked first by how slowly
    its slices grow, the plan at the nominal sizes (a batch of 8, length 570) is a loop over the
    queries, which holds the keys' and values' projections and their gradients whole: 140-156 MB by
    XLA's figure there, and the program at [16, 256] 134 MiB of its 164 MiB as written.  Planned again
    with its loops ranked as for static shapes, one loop over the batch: within the limit at the
    nominal sizes, and at [16, 256]; the step's loss and updated weights equal to the unsplit one's."""
    keras = keras_of(version)
    keras.utils.set_random_seed(0)
    width = 128
    x_in = keras.Input((None, width))
    model = keras.Model(x_in, keras.layers.LayerNormalization()(
        x_in + keras.layers.MultiHeadAttention(num_heads=8, key_dim=width)(x_in, x_in)))

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        return [loss] + [w - 0.01 * g for w, g in zip(model.trainable_variables, grads)]

    x = tf.constant(np.random.default_rng(1).standard_normal((16, 256, width)), tf.float32)
    limit = 128 * 10**6
    mark = hook.report_mark()
    tf_memsafe.enable(limit, strict=True)
    try:
        padded = tf.function(step, jit_compile=True, input_signature=[tf.TensorSpec([None, None, width])])
        got, after = run_and_measure(padded, x)      # (XLA's figure of the program run: tests/xla_run.py)
    finally:
        tf_memsafe.disable()
    records = [r for r in hook.reports_since(mark)[0].records if r.pass_name == "splitter"]
    again = [r for r in records if r.code == Code.OTHER_SIZES]
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert again and [p.roots[0].input_axes[0] for p in loops] == [0], [r.reason for r in records]
    assert after <= limit, after
    for g, w in zip(got, tf.function(step, jit_compile=True)(x)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
