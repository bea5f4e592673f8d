"""packed_cholesky: a kernel matrix's factor held as packed blocks, in the product's pipeline.

GPflow's GPR loss with its gradients taken inside the function (as ``gpflow.optimizers.Scipy``'s
compiled closure takes them) under a limit 4x below its figure (8x at n = 20000 in
``experiments/gpr.py``): within it, equal to the program as
written; a Gaussian log-density written by hand (``+ noise * tf.eye(n)``, float32, no gradient);
the refusals, each naming its reason; the block size policy.
"""

import warnings

import gpflow
import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import packed_cholesky
from grappler_ext.packed_cholesky import BLOCKS, MIN_ORDER, PackedCholesky, block_for
from grappler_ext.pass_base import PassOptions
from tests.xla_run import run_and_measure

gpflow.config.set_default_float(np.float64)


def _records(action=None):
    return [r for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "packed_cholesky" and (action is None or r.action == action)]


def _gpr(n):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3))
    y = np.sin(x[:, :1]) + 0.1 * rng.standard_normal((n, 1))
    model = gpflow.models.GPR((x, y), kernel=gpflow.kernels.SquaredExponential(lengthscales=np.ones(3)))

    def loss_and_gradients():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return (loss,) + tuple(tape.gradient(loss, model.trainable_variables))

    return loss_and_gradients


@pytest.fixture
def small(monkeypatch):
    """The pass at orders from 256 (its own floor is 1024: the tests' programs compile faster small)."""
    monkeypatch.setattr(packed_cholesky, "MIN_ORDER", 256)


def test_a_gpr_loss_with_its_gradients_fits_a_limit_4x_below_its_figure(small):
    """n = 400: 7.9 MB as written (the kernel matrix, its factor and CholeskyGrad's [n, n] tensors);
    1.7 MB rewritten (measured), the packed factor 0.85 MB of it.  (8x below at n = 20000:
    ``experiments/gpr.py``; at small n the loops' [n, b] buffers weigh more.)  Within the limit by
    XLA's figure: the pipeline warns where a memory rewrite leaves the program over it."""
    step = _gpr(400)
    want, naive = run_and_measure(tf.function(step, jit_compile=True))   # (XLA's figure for that compile)
    tf_memsafe.enable(naive // 4, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = tf.function(step, jit_compile=True)()
    (record,) = _records("rewritten")
    assert "packed blocks" in record.reason and "1 gradient(s) inside the function rebuilt" in record.reason
    assert len(got) == len(want) == 4                     # the loss; variance, lengthscales, noise
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_a_hand_written_log_density_in_float32(small):
    n = 300                                               # a short last block
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((n, 2)), tf.float32)
    y = tf.constant(rng.standard_normal((n, 1)), tf.float32)

    def log_density(x, y):
        r = tf.reduce_sum(tf.square(x), -1)
        k = tf.exp(-0.5 * (r[:, None] - 2.0 * tf.matmul(x, x, transpose_b=True) + r[None, :]))
        factor = tf.linalg.cholesky(k + 0.5 * tf.eye(n))
        alpha = tf.linalg.triangular_solve(factor, y)
        return -0.5 * tf.reduce_sum(tf.square(alpha)) - tf.reduce_sum(tf.math.log(tf.linalg.diag_part(factor)))

    want = tf.function(log_density, jit_compile=True)(x, y)
    tf_memsafe.enable(500_000)                            # (over it as written; 0.42 MB rewritten)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = tf.function(log_density, jit_compile=True)(x, y)
    assert [r.action for r in _records()] == ["rewritten"]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_a_tape_outside_the_function_differentiates_the_packed_factor(small):
    """No gradient recorded inside: TensorFlow differentiates the rewritten function itself, through
    the packed factor's custom gradient (blocked_linalg's test of the same program, the pass disabled)."""
    n = 300
    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((n, 3)))
    y = tf.constant(rng.standard_normal((n, 1)))

    def nlml(x):
        r = tf.reduce_sum(tf.square(x), -1)
        kmm = tf.exp(-0.5 * (r[:, None] - 2.0 * tf.matmul(x, x, transpose_b=True) + r[None, :]))
        lm = tf.linalg.cholesky(tf.linalg.set_diag(kmm, tf.linalg.diag_part(kmm) + 1e-2))
        alpha = tf.linalg.triangular_solve(lm, y, lower=True)
        return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(lm))) + 0.5 * tf.reduce_sum(tf.square(alpha))

    def value_and_gradient(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = fn(x)
        return value, tape.gradient(value, x)

    want = value_and_gradient(tf.function(nlml, jit_compile=True))
    tf_memsafe.enable(900_000, strict=True)               # (over it as written; 0.84 MB rewritten)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = value_and_gradient(tf.function(nlml, jit_compile=True))
    assert [r.action for r in _records()] == ["rewritten"]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-9 * np.max(np.abs(w)))


def _pass_on(fn, *specs, limit=1_000_000):
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return PackedCholesky().run(graph, PassOptions(memory_limit_bytes=limit)).records


def _kernel(x):
    return tf.exp(-tf.square(tf.matmul(x, x, transpose_b=True))) + tf.eye(int(x.shape[0]), dtype=x.dtype)


@pytest.mark.parametrize("case, reason", [
    ("read_whole", "(MatMul), which needs it whole"),
    ("wide", "solves for 600 columns (the splitter splits them"),
    ("small", f"its order 500 is under {MIN_ORDER}"),
    ("transposed", "the factor is read by `transpose`"),
    ("not_a_kernel", "its matrix is not computed a tile at a time: `"),
    ("wide_points", "its matrix is computed from `x:0` (1024, 2048), not small beside it"),
])
def test_what_it_leaves_and_why(case, reason):
    n = 500 if case == "small" else MIN_ORDER
    x = tf.TensorSpec([n, 2048 if case == "wide_points" else 2], tf.float64)
    rhs = tf.TensorSpec([n, 600 if case == "wide" else 1], tf.float64)

    def fn(x, b):
        k = tf.random.stateless_normal([n, n], [1, 2], dtype=tf.float64) if case == "not_a_kernel" else _kernel(x)
        factor = tf.linalg.cholesky(k)
        out = tf.linalg.triangular_solve(factor, b)
        if case == "read_whole":
            out += tf.matmul(factor, b)
        if case == "transposed":
            out += tf.linalg.triangular_solve(tf.transpose(factor), b, lower=False)
        return out

    (record,) = _pass_on(fn, x, rhs)
    assert record.action == "skipped" and reason in record.reason, record.reason


def test_the_block_is_the_largest_that_fits():
    assert block_for(20_000, 8, 2_050_163_951) == (128, True)     # GPR's loss at 1/8 of its figure
    assert block_for(20_000, 8, 10**12) == (BLOCKS[0], True)
    assert block_for(3_000, 8, 46_149_692) == (32, False)         # (XLA's figure for it: 43.3 MB, within)
    assert block_for(3_000, 8, 10_000_000) == (32, False)
