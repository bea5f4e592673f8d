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
  by XLA's figure; equal to the unsplit layer; at L = 1024 within a sixteenth (tf_keras: its
  attention computed over key blocks in each slice);
- a training step with the tape inside (mean squared output, the gradients of every weight) is
  within a limit of an eighth of its naive footprint, loss and gradients equal to the unsplit step's;
  with dropout (``redraw_random``), within that same limit;
- a model of that layer and a per-position classifier trained with ``fit(jit_compile=True)`` (Adam,
  accuracy) on ``.batch(4)`` (the batch ``None`` in the step), at L = 1024 within a sixteenth of its
  step as written, and in mixed precision at L = 512 within 8 MB: nothing said, losses equal.
  Under tf_keras, the stack of two, the dropout step and the two fits are ``heavy``
  (``keras_fit.KERAS3_TF_KERAS_HEAVY``): its layer's forward (at both lengths) and training step run
  by default here, its attention at every shape in test_padded_batches, its ``fit`` on ``tf.data`` in
  test_dynamic_batches, its stateful dropout in the splitter's padded-batch tests.
  The fit at L = 1024 is ``heavy`` under Keras 3 too (see its docstring).
  (``python -m experiments.encoder_layer`` measures the layer, a stack of two and the fit at L = 1024
  and 2048 within a sixteenth: at L = 512 the keys, values, input and output read whole by every
  slice are already more than that.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from experiments.encoder_layer import BATCH, D_MODEL, encoder_layer
from grappler_ext.splitter.outcome import Code, LoopPlan
from tests.integration.keras_fit import KERAS3_TF_KERAS_HEAVY, fit_under, keras_of
from tests.xla_run import run_and_measure
from tf_memsafe import hook, xla_flags

pytestmark = pytest.mark.slow

B, L, D, HEADS = BATCH, 512, D_MODEL, 4


def _encoder(keras, dropout: float = 0.0, length: int = L):
    """The layer (``experiments.encoder_layer``'s, built on ``x``) and ``x`` [B, length, D]."""
    keras.utils.set_random_seed(0)
    layer = encoder_layer(keras, dropout)
    x = tf.constant(np.random.default_rng(0).standard_normal((B, length, D)).astype(np.float32))
    layer(x)
    return layer, x


def _naive(fn, x):
    """``fn(x)`` jit-compiled as written and XLA's figure for it (tests/xla_run.py): what ``_run``
    compares the split program with, and ``memory_footprint(fn, x, rewrite=False)``'s figure."""
    return run_and_measure(tf.function(fn, jit_compile=True), x)


def _run(fn, x, limit, want=None, **options):
    """``fn`` split under ``limit``: XLA's figure for the program run, and the splitter's records; its
    results equal to ``want`` (``fn``'s as written, from ``_naive``) where given."""
    mark = hook.report_mark()
    tf_memsafe.enable(limit, strict=True, **options)
    try:
        # (XLA's figure of the very program run, not of a fresh trace planned again: tests/xla_run.py)
        got, after = run_and_measure(tf.function(fn, jit_compile=True), x)
    finally:
        tf_memsafe.disable()
    records = [r for r in hook.reports_since(mark)[0].records if r.pass_name == "splitter"]
    if want is None:
        return after, records
    # float32 sums reassociated; the keys' bias gradient is 0 up to rounding (softmax ignores it)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
    return after, records


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_the_forward_is_one_loop_along_the_sequence(version):
    layer, x = _encoder(keras_of(version))

    def forward(x):
        return layer(x)      # (inference: no dropout)

    want, naive = _naive(forward, x)
    after, records = _run(forward, x, naive // 8, want=want)
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert len(loops) == 1 and loops[0].length == L, [r.reason for r in records]
    assert after <= naive / 4, (after, naive)


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_the_forward_at_twice_the_length_within_a_sixteenth(version):
    """At L = 1024 a sixteenth of tf_keras' forward (4.5 MB) is less than its input, output, keys and
    values (1 MiB each): each slice computes its attention over blocks of the keys, projected there
    (it was 5.4 MB, a best effort).  Keras 3's forward as written is twice tf_keras' (its mask
    arithmetic): a sixteenth of it fits without."""
    layer, x = _encoder(keras_of(version), length=1024)

    def forward(x):
        return layer(x)

    want, naive = _naive(forward, x)
    after, records = _run(forward, x, naive // 16, want=want)
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert len(loops) == 1 and loops[0].best_effort is None, [r.reason for r in records]
    assert (loops[0].nested is not None) == (version == "tf_keras"), loops[0].render()
    assert after <= naive // 16, (after, naive)


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_a_stack_of_two_is_one_loop_per_layer(version):
    """The first layer's output is read by the second one's queries and keys: the loop along the
    first one's queries ends there, joined (it made three loops, the first layer's attention and its
    feed-forward block apart)."""
    keras = keras_of(version)
    first, x = _encoder(keras)
    second = encoder_layer(keras)
    second(x)

    def forward(x):
        return second(first(x))

    want, naive = _naive(forward, x)
    after, records = _run(forward, x, naive // 8, want=want)
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert len(loops) == 2 and {p.length for p in loops} == {L}, [r.reason for r in records]
    assert after <= naive / 3.5, (after, naive)      # (3.8x tf_keras, 6.6x Keras 3: read whole, x, k, v)


def _step(layer):
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x, training=True)))
        return (loss,) + tuple(tape.gradient(loss, layer.trainable_variables))
    return step


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_a_training_step_fits_an_eighth_of_its_footprint(version):
    layer, x = _encoder(keras_of(version))
    step = _step(layer)
    want, naive = _naive(step, x)
    after, records = _run(step, x, naive // 8, want=want)
    assert any(isinstance(r.plan, LoopPlan) and r.plan.length == L for r in records), [r.reason for r in records]
    assert after <= naive // 8, (after, naive)


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_a_step_with_dropout_fits_the_limit_of_the_step_without(version):
    """Dropout 0.1 on the attention's probabilities and the feed-forward block's output (Keras 3 keys
    a stateless draw from its seed generator, tf_keras draws statefully): with ``redraw_random`` each
    slice draws its own masks (its gradient the same ones), and the step fits the limit the step
    without dropout is given, although it holds more as written (the masks)."""
    keras = keras_of(version)
    without, x = _encoder(keras)
    limit = tf_memsafe.memory_footprint(_step(without), x, rewrite=False) // 8
    layer, _ = _encoder(keras, dropout=0.1)
    step = _step(layer)
    naive = tf_memsafe.memory_footprint(step, x, rewrite=False)
    after, records = _run(step, x, limit, redraw_random=True)
    assert after <= limit < naive // 8, (after, limit, naive)
    assert any(isinstance(r.plan, LoopPlan) and r.plan.length == L for r in records), [r.reason for r in records]


def _fit(keras, limit: int | None, policy: str = "float32", measured: bool = False, length: int = L):
    """Two epochs of ``fit(jit_compile=True)`` (Adam, sparse cross-entropy per position, accuracy) on
    8 sequences of such a model in batches of 4 (``.batch(4)``, as users write it: the step is traced
    with the batch ``None``), under Keras' dtype ``policy``; the losses, the splitter's records and
    warnings (and, ``measured``, XLA's largest figure among the programs compiled)."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input([length, D])
        # (``Add`` layers: under mixed_float16 they cast the float32 inputs to the layers' float16)
        x = keras.layers.LayerNormalization()(keras.layers.Add()(
            [inputs, keras.layers.MultiHeadAttention(HEADS, D // HEADS)(inputs, inputs)]))
        x = keras.layers.LayerNormalization()(keras.layers.Add()(
            [x, keras.layers.Dense(D)(keras.layers.Dense(4 * D, activation="relu")(x))]))
        # the logits in float32 for the loss, as Keras' mixed precision guide writes them
        model = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(keras.layers.Dense(10)(x)))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((rng.standard_normal((8, length, D)).astype(np.float32),
                                               rng.integers(0, 10, (8, length)))).batch(B)
    if not measured:
        return fit_under(model, data, limit, epochs=2)
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        fitted = fit_under(model, data, limit, epochs=2)
        return (*fitted, max(total for _, total in xla_flags.memory_reports(folder)))


@pytest.mark.heavy
@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_fit_trains_an_attention_model_within_a_sixteenth_of_its_footprint(version):
    """At L = 1024 the training step is about 210 MB as written; under a sixteenth of that it is split
    along the sequence, within the limit by XLA's figure (nothing said), losses equal to the unsplit
    fit's.  Keras 3's ``Dense`` kernels' gradients (sums over axes a ``BroadcastGradientArgs`` of the
    run-time batch gives, of unknown rank in the graph) left the step unsplit before the memory model
    read their shapes through the symbol table.

    ``heavy`` under both versions (about 50 s; ``python -m tests -m heavy`` runs it): Keras 3's fit
    with ``jit_compile=True`` on batches of run-time size, split within its limit with the unsplit
    fit's losses, is checked by the mixed-precision fit below, by
    tests/integration/test_padded_batches.py's fit and by test_wide_layer.py's and
    test_dynamic_batches.py's fits."""
    keras = keras_of(version)
    want, _, _, naive = _fit(keras, None, measured=True, length=2 * L)
    got, records, said, after = _fit(keras, naive // 16, measured=True, length=2 * L)
    assert not said, said
    assert any(r.plan is not None and r.code == Code.SPLIT and r.plan.dynamic and r.plan.length == 2 * L
               for r in records), [r.reason for r in records]
    assert after <= naive // 16, (after, naive)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_fit_in_mixed_precision_within_the_limit(version):
    """Keras' ``mixed_float16`` policy (float16 activations, float32 weights and logits, the optimizer a
    ``LossScaleOptimizer`` whose dynamic scale is a variable updated under a ``tf.cond``): the step,
    about 50 MB as written, split along the sequence within 8 MB by XLA's figure, nothing said, losses
    equal to the unsplit fit's to float16's rounding."""
    keras = keras_of(version)
    want, _, _, naive = _fit(keras, None, policy="mixed_float16", measured=True)
    got, records, said, after = _fit(keras, 8 * 10**6, policy="mixed_float16", measured=True)
    assert not said, said
    assert any(isinstance(r.plan, LoopPlan) and r.plan.length == L for r in records), [r.reason for r in records]
    assert after <= 8 * 10**6 < naive // 5, (after, naive)
    np.testing.assert_allclose(got, want, rtol=1e-4)
