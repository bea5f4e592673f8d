"""Shared test set-up: quiet TensorFlow, verifier always on, tf_memsafe off between tests."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import tf_memsafe  # noqa: E402
from tf_memsafe import hook  # noqa: E402


@pytest.fixture(autouse=True)
def _tf_memsafe_clean_state():
    """Every test starts disabled, with the verifier on, and leaves nothing behind."""
    tf_memsafe.disable()
    hook.clear_reports()
    with tf_memsafe.options(verify=True):
        yield
    tf_memsafe.disable()
    hook.clear_reports()
