"""Keras as the integration tests use it: either version by name, and ``fit`` under a limit.

``fit_under(model, data, limit)`` runs ``model.fit`` with tf_memsafe enabled at ``limit`` (``None``: not
enabled, the reference run) and returns ``(losses, splitter records, tf_memsafe's warnings)``.
"""

from __future__ import annotations

import warnings

import pytest

import tf_memsafe
from experiments.encoder_layer import keras_of  # Keras 3 ("keras3") or tf_keras ("tf_keras") by name
from tf_memsafe import hook

__all__ = ["keras_of", "fit_under", "KERAS3_TF_KERAS_HEAVY"]

# Both versions, tf_keras' case ``heavy`` (left out of the default run, setup.cfg): for the tests of
# most of a minute a version whose tf_keras paths (its ``Dense`` and layer norm, stateful dropout, its
# ``train_function`` on ``tf.data``) cheaper tests of the same module or a sibling run by default.
# Keras 3 stays in the default run: it is what ``tf.keras`` is on TensorFlow 2.21.
KERAS3_TF_KERAS_HEAVY = ["keras3", pytest.param("tf_keras", marks=pytest.mark.heavy)]


def fit_under(model, data, limit, epochs: int = 1):
    """``(losses per epoch, splitter records of the traces made, tf_memsafe's warnings)`` of ``model.fit``."""
    mark = hook.report_mark()
    if limit is not None:
        tf_memsafe.enable(limit)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(data, epochs=epochs, verbose=0)
    finally:
        tf_memsafe.disable()
    said = [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]
    records = [r for rep in hook.reports_since(mark) for r in rep.records if r.pass_name == "splitter"]
    return history.history["loss"], records, said
