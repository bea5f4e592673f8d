"""Keras' ``fit`` on ``tf.data`` batches whose size is known only at run time: a step planned at a nominal
batch and run at a larger one is checked at the run's shape, and said to be over the limit there
(:mod:`tf_memsafe.run_check`), under both Keras versions.

A Dense(1024) layer's step under 2 MB is planned at a batch of about 1,000, a loop along the batch;
its inputs and targets are not split, so a batch of 60,000 is about 4.4 MB by XLA's figure.  Batches
of 64 are not checked (smaller than the plan's); the batch of 60,000 is, before its step runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.integration.keras_fit import fit_under, keras_of
from tf_memsafe import hook

pytestmark = pytest.mark.slow

LIMIT, BIG = 2 * 10**6, 60_000


def _model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True)
    return model


def _batches():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((192 + BIG, 16)).astype("float32")
    y = rng.standard_normal((192 + BIG, 1)).astype("float32")
    return (tf.data.Dataset.from_tensor_slices((x[:192], y[:192])).batch(64)
            .concatenate(tf.data.Dataset.from_tensor_slices((x[192:], y[192:])).batch(BIG)))


@pytest.mark.parametrize("version", ["keras3", "tf_keras"])
def test_a_fit_step_run_at_a_batch_beyond_its_plan_is_said_over_the_limit(version):
    keras = keras_of(version)
    reference, _, _ = fit_under(_model(keras), _batches(), None)
    mark = hook.report_mark()
    losses, records, said = fit_under(_model(keras), _batches(), LIMIT)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert any(r.plan is not None and getattr(r.plan, "dynamic", False) for r in records), [r.reason for r in records]
    (step,) = [r for r in hook.reports_since(mark) if r.run_checks]
    (check,) = step.run_checks                                  # the batches of 64 were not compiled again
    assert check.shapes == ((BIG, 16), (BIG, 1)) and check.over, check
    assert LIMIT < check.bytes < 4 * LIMIT
    (message,) = said
    assert f"`{step.function_name}`" in message and "[60,000, 16]" in message and "over the limit" in message
