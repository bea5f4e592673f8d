"""Keras ``fit`` on a ``tf.data`` pipeline whose last batch is short: the step is traced with the batch
dimension unknown (``None``), and the splitter splits it along the batch all the same (issue 27).

An MLP written the ordinary way (two ``Dense(1024, relu)`` layers on 64 features, a 10-way sparse
cross-entropy, SGD), 5000 examples in batches of 2048 (the last 904), under a 30 MB limit.  The
step is planned at a nominal batch where what grows with it is 4x the limit (7172 rows: each
[7172, 1024] activation is 29 MB, the naive step over 100 MB by the memory model) and its loops read
the batch when the step runs; a top-k accuracy metric (``InTopKV2``) is split with the rows.  Both
Keras versions: losses equal to the unsplit fit's, one loop with a run-time length, within the limit
by XLA's figure at the nominal batch, and nothing said.  Under tf_keras both tests are ``heavy``
(``keras_fit.KERAS3_TF_KERAS_HEAVY``): its ``fit`` on batches of run-time size runs by default in
test_run_time_shapes, its attention on padded batches in test_padded_batches.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from grappler_ext.splitter.outcome import Code
from tests.integration.keras_fit import KERAS3_TF_KERAS_HEAVY, fit_under, keras_of

pytestmark = pytest.mark.slow

N, FEATURES, HIDDEN, BATCH = 5000, 64, 1024, 2048
LIMIT = 30 * 10**6


def _fit(keras, enabled: bool):
    rng = np.random.RandomState(0)
    x, y = rng.randn(N, FEATURES).astype(np.float32), rng.randint(0, 10, N)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)       # 2048, 2048, 904: batch None
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input([FEATURES]), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseTopKCategoricalAccuracy(3)])    # (an `InTopKV2`)
    return fit_under(model, data, LIMIT if enabled else None)


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_fit_on_a_short_last_batch_is_split_along_the_batch(version):
    keras = keras_of(version)
    expected, _, _ = _fit(keras, enabled=False)
    losses, records, said = _fit(keras, enabled=True)
    assert said == []
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    codes = [r.code for r in records]
    assert codes[0] == Code.DYNAMIC_SHAPES and "`data:0` dimension 0 of [?, 64]" in records[0].reason
    loops = [r.plan for r in records if r.code == Code.SPLIT]
    assert loops and all(p.dynamic and p.rebuilt_gradients for p in loops)
    # XLA's figure for the step as split, at the nominal batch, is within the limit.
    figures = [r for r in records if r.code in (Code.CHECKED_WITHIN, Code.GROWN)]
    assert figures or Code.WITHIN_LIMIT in codes, [r.reason for r in records]


VOCAB, WIDTH, WORDS, TEXTS = 2000, 32, 50, 64


def _fit_embedding(keras, enabled: bool):
    """A bag of embeddings (Keras' text-classification tutorial: ``Embedding``, global average pooling,
    a sigmoid), Adam, two epochs of batches of 64 texts (the last 17: the batch unknown)."""
    rng = np.random.default_rng(0)
    ids, labels = rng.integers(0, VOCAB, (2 * TEXTS + 17, WORDS)), rng.integers(0, 2, (2 * TEXTS + 17, 1))
    data = tf.data.Dataset.from_tensor_slices((ids.astype(np.int32), labels.astype(np.float32))).batch(TEXTS)
    keras.utils.set_random_seed(0)
    inputs = keras.Input([WORDS], dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, WIDTH)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(pooled))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", jit_compile=True)
    losses, records, said = fit_under(model, data, 10**7 if enabled else None, epochs=2)
    return losses, model.layers[1].get_weights()[0], records, said


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_an_embedding_on_batches_of_unknown_size_keeps_its_sparse_update(version):
    """Planned at a nominal batch, the step is split along the batch through a region holding the
    lookup: the table's gradient, the rows looked up (``IndexedSlices``) as traced, comes out of the
    loop dense.  It is given back on the ids looked up (each id's row once), so the optimizer updates
    those rows alone, as Adam's sparse update does.  Before, the pass failed and the step was left
    as traced with a warning to disable the splitter, at any limit (a 50,000-word table at 100 GB).
    Whatever plan is kept, the losses and the table are the unsplit fit's, bit for bit."""
    keras = keras_of(version)
    want_losses, want_table, _, _ = _fit_embedding(keras, enabled=False)
    losses, table, records, said = _fit_embedding(keras, enabled=True)
    assert not any("pass 'splitter' failed" in s for s in said), said
    np.testing.assert_array_equal(losses, want_losses)
    np.testing.assert_array_equal(table, want_table)
