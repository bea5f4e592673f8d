"""A convolutional network trained the ordinary Keras way: ``Conv2D``, ``MaxPooling2D``, ``Flatten`` and
``Dense`` (Keras' MNIST convnet example, without its dropout), ``fit(jit_compile=True)`` with Adam on a
``tf.data`` pipeline, at batch 128 on 28 x 28 images: about 115 MB as written, mostly the first
convolution's activations and their gradients.  Split along the batch (a convolution and a pool
take a slice of the images with the filter whole), the step fits an eighth of that by XLA's figure,
with the losses of the unsplit fit, under both Keras versions (tf_keras' ``heavy``: its ``Conv2D``
training step runs by default in the splitter's test_convolutions, split along the channels); its
loop, which computes its gradients as it goes, is grown from the memory model's chunk into the room
XLA's figure leaves.

With batch normalisation after each convolution (statistics over the batch) the batch cannot be
split; the splitter says so in one warning rather than leaving the step over its limit silently.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from grappler_ext.splitter.outcome import Code, LoopPlan
from tests.integration.keras_fit import KERAS3_TF_KERAS_HEAVY, fit_under, keras_of
from tf_memsafe import xla_flags

pytestmark = pytest.mark.slow

B = 128


def _fit(keras, limit, batch_norm=False):
    """Two epochs of two batches; (losses, splitter records, warnings, XLA's largest figure)."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input([28, 28, 1])]
    for filters in (32, 64):
        layers += ([keras.layers.Conv2D(filters, 3), keras.layers.BatchNormalization(), keras.layers.ReLU()]
                   if batch_norm else [keras.layers.Conv2D(filters, 3, activation="relu")])
        layers.append(keras.layers.MaxPooling2D())
    model = keras.Sequential(layers + [keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((rng.standard_normal((2 * B, 28, 28, 1)).astype(np.float32),
                                               rng.integers(0, 10, (2 * B,)))).batch(B, drop_remainder=True)
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        losses, records, said = fit_under(model, data, limit, epochs=2)
        return losses, records, said, max(total for _, total in xla_flags.memory_reports(folder))


@pytest.mark.parametrize("version", KERAS3_TF_KERAS_HEAVY)
def test_a_convnet_trains_along_its_batch_within_the_limit(version):
    keras = keras_of(version)
    want, _, _, naive = _fit(keras, None)
    limit = naive // 8
    got, records, said, after = _fit(keras, limit)
    assert not said, said
    assert any(r.action == "rewritten" and r.plan is not None and r.plan.length == B for r in records), \
        [r.reason for r in records]
    assert after <= limit, (after, limit, naive)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # 32 steps of the 4 examples the memory model gave the loop (its slices capped to a share of the
    # budget) starve it: it is grown into the room XLA's figure for the program leaves.
    grown = [r for r in records if r.code == Code.GROWN]
    chunks = [r.plan.chunk for r in records if isinstance(r.plan, LoopPlan)]
    assert grown and chunks[-1] > grown[0].plan.starved_chunks[0], [r.reason for r in records]


@pytest.mark.heavy
def test_batch_normalisation_over_the_limit_is_said_once():
    """A convnet with batch normalisation fitted under an eighth of its step: smaller than as written,
    and, where over the limit, said once, naming the convolution.

    ``heavy`` (about 50 s; ``python -m tests -m heavy`` runs it): batch normalisation in a training
    step split within its limit by tests/grappler_ext/splitter/test_convolutions.py (Keras 3 by default,
    tf_keras' case ``heavy``); a
    plan over its limit said once, naming what could not be split, by test_kernel_ridge.py and
    tests/tf_memsafe/test_hostile_inputs.py."""
    keras = keras_of("keras3")
    _, _, _, naive = _fit(keras, None, batch_norm=True)
    limit = naive // 8
    _, _, said, after = _fit(keras, limit, batch_norm=True)
    assert after < naive
    if after > limit:
        assert len(said) == 1 and "over its limit" in said[0] and "conv2d" in said[0], said
    else:
        assert not said, said
