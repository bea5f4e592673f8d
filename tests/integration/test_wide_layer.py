"""A wide layer's training step (issue 29): the weight, its gradient and the optimizer's slots crowd the
limit, so splitting the batch's rows is not enough; the step is split along the weight's output axis,
each column block's forward, gradient and update computed in one loop and written into the
variables' own buffers.

Sizes (float64): a Dense(2048) on x [256, 512] regressing a target [256, 2048]; the kernel is 8 MiB,
x 1 MiB, the target and the layer's output 4 MiB each.  As written, SGD's step holds the kernel, its
gradient, the output and its gradient (about 29 MiB by XLA's figure); split along the rows it would
still hold the kernel and its whole gradient, 21 MiB.  Along the kernel's columns only the kernel,
x and the target stay: 13 MiB.  The SGD limit, 17 MiB, is met only that way; each optimizer slot
(momentum, Adam's two moments) adds 8 MiB to all three.

Each case runs three steps as written and three rewritten, from the same start, in Keras 3 (what
``tf.keras`` is on TF 2.21) and tf_keras, and compares losses and every variable, slots included,
at 1e-10; and checks XLA's figure for the rewritten step against the limit, and that the plan wrote
the kernel's update in place.  tf_keras' cases are ``heavy`` (about a minute in all; ``python -m
tests -m heavy`` runs them): its optimizers' updates written in place are the splitter's
test_variable_updates tests', and a tf_keras fit on ``tf.data`` test_dynamic_batches'.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_memsafe
from tests.keras_steps import OPTIMIZERS, dense_step
from tests.xla_run import run_and_measure
from tf_memsafe import hook

N, D_IN, D_OUT = 256, 512, 2048
STEPS = 3
MIB = 2**20
KERAS_HEAVY_TF_KERAS = [tf.keras, pytest.param(tf_keras, marks=pytest.mark.heavy)]


def limit(keras, name) -> int:
    """Half a kernel above the column split's floor (the kernel, its optimizer slots, x and the target),
    half a kernel below the row split's (which adds the kernel's whole gradient).  tf_keras's SGD
    keeps a momentum slot even at momentum 0."""
    slots = {"sgd": 0 if keras is tf.keras else 1, "momentum": 1, "adam": 2}[name]
    return (13 + 8 * slots + 4) * MIB


RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((N, D_IN)))
Y = tf.constant(RNG.standard_normal((N, D_OUT)))


def _run(keras, name, limit=None):
    step, values = dense_step(keras, name, D_IN, D_OUT, dtype="float64")
    if limit is None:
        fn = tf.function(step, jit_compile=True)
        losses = [float(fn(X, Y)) for _ in range(STEPS)]
        return losses, values(), None
    with tf_memsafe.options(memory_limit=limit, strict=True):
        fn = tf.function(step, jit_compile=True)
        # (XLA's figure of the program the first step compiled and ran: tests/xla_run.py)
        first, footprint = run_and_measure(fn, X, Y)
        losses = [float(first)] + [float(fn(X, Y)) for _ in range(STEPS - 1)]
        assert tf_memsafe.memory_footprint(fn, X, Y, rewrite=False) > limit   # the step as written does not fit
    return losses, values(), footprint


@pytest.fixture(autouse=True)
def _enabled():
    tf_memsafe.enable(memory_limit="1GB")
    yield
    tf_memsafe.disable()


def _plans(mark):
    return [r.plan for rep in hook.reports_since(mark) for r in rep.records
            if r.pass_name == "splitter" and r.action == "rewritten"]


@pytest.mark.parametrize("keras", KERAS_HEAVY_TF_KERAS, ids=["keras3", "tf_keras"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_split_along_the_kernel_columns_matches_and_fits(keras, name):
    with tf_memsafe.options(disabled_passes="splitter"):
        losses0, variables0, _ = _run(keras, name)
    mark = hook.report_mark()
    losses, variables, footprint = _run(keras, name, limit(keras, name))
    np.testing.assert_allclose(losses, losses0, rtol=1e-10)
    for got, want in zip(variables, variables0):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert footprint <= limit(keras, name), f"{footprint:,} B over the limit of {limit(keras, name):,} B"
    plans = _plans(mark)
    assert any(p.written_into for p in plans), [p.render() for p in plans]


def test_a_step_written_by_hand():
    """The same layer and loss written without Keras: the tape watches the variables' reads, and the
    step assigns ``w - 0.1 g`` (an assignment of a value already).  Before the update regions, the
    splitter failed on it (a region grew into the gradients an earlier loop had rebuilt: KeyError)."""
    def run(budget=None):
        w = tf.Variable(np.random.default_rng(3).standard_normal((D_IN, D_OUT)) / 30)
        b = tf.Variable(np.zeros(D_OUT))

        def step(x, y):
            w0, b0 = w.read_value(), b.read_value()
            with tf.GradientTape() as tape:
                tape.watch([w0, b0])
                loss = tf.reduce_mean(tf.square(x @ w0 + b0 - y))
            gw, gb = tape.gradient(loss, [w0, b0])
            w.assign(w0 - 0.1 * gw)
            b.assign(b0 - 0.1 * gb)
            return loss

        with tf_memsafe.options(memory_limit=budget or 10**12, strict=True):
            fn = tf.function(step, jit_compile=True)
            first, footprint = run_and_measure(fn, X, Y) if budget else (fn(X, Y), None)
            losses = [float(first)] + [float(fn(X, Y)) for _ in range(STEPS - 1)]
        return losses, [w.numpy(), b.numpy()], footprint

    losses0, values0, _ = run()
    mark = hook.report_mark()
    losses, values, footprint = run(limit(tf.keras, "sgd"))
    np.testing.assert_allclose(losses, losses0, rtol=1e-10)
    for got, want in zip(values, values0):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert footprint <= limit(tf.keras, "sgd")
    assert any(p.written_into for p in _plans(mark))


@pytest.mark.parametrize("keras", KERAS_HEAVY_TF_KERAS, ids=["keras3", "tf_keras"])
def test_keras_fit_on_batches_of_a_static_size(keras):
    """``model.fit`` on a ``tf.data`` pipeline with ``drop_remainder=True`` (a static batch): Keras'
    own train step, loss and Adam, split along the kernel's columns, the same losses and weights."""
    from tests.integration.keras_fit import fit_under

    x, y = X.numpy().astype(np.float32), Y.numpy().astype(np.float32)

    def fit(budget):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input([D_IN]), keras.layers.Dense(D_OUT)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=True)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(N, drop_remainder=True)
        mark = hook.report_mark()
        losses, records, said = fit_under(model, data, budget, epochs=3)
        return losses, [v.numpy() for v in model.trainable_variables], said, _plans(mark)

    losses0, weights0, _, _ = fit(None)
    # float32: the kernel 4 MiB, the moments 8, x 0.5, the targets 2; its whole gradient 4 MiB more
    losses, weights, said, plans = fit(int(16.5 * MIB))
    assert said == []
    np.testing.assert_allclose(losses, losses0, rtol=1e-5)
    for got, want in zip(weights, weights0):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert any(p.written_into for p in plans), [p.render() for p in plans]
