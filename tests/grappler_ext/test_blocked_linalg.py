"""blocked_linalg: a large Cholesky factor and triangular solve a block at a time, in place.

The loops against TensorFlow's own ops (values and gradients, both triangles, a short last block),
the refusals, and the pass on a GP prediction written as GPflow's ``base_conditional`` writes it
(``Lm = cholesky(Kmm)``, ``A = solve(Lm, Kmn)``, ``solve(Lmᵀ, A, lower=False)``), where XLA's own
expansions hold several copies of the factor: within a limit that the program with the pass disabled
is over, equal to the program as written.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import blocked_linalg
from grappler_ext.blocked_linalg import MIN_ORDER, cholesky, refusal, triangular_solve
from grappler_ext.guard import Code as GuardCode
from tests.xla_run import run_and_measure

rng = np.random.default_rng(0)


def _spd(n):
    x = rng.standard_normal((n, n + 3))
    return x @ x.T / n + np.eye(n)


def _jit(fn, *args):
    return tf.function(fn, jit_compile=True)(*args)


@pytest.mark.parametrize("n, block", [(256, 64), (300, 64), (70, 64)])
def test_cholesky_equals_tensorflows_and_reads_the_lower_triangle(n, block):
    a = _spd(n)
    noisy = tf.constant(a + np.triu(rng.standard_normal((n, n)), 1))     # the upper triangle is not read
    got = _jit(lambda a: cholesky(a, block), noisy)
    want = tf.linalg.cholesky(tf.constant(a))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    assert np.all(np.triu(got.numpy(), 1) == 0)

    def grad(factor, a):
        with tf.GradientTape() as tape:
            tape.watch(a)
            value = tf.reduce_sum(tf.sin(factor(a)))
        return tape.gradient(value, a)

    got = _jit(lambda a: grad(lambda a: cholesky(a, block), a), tf.constant(a))
    want = grad(tf.linalg.cholesky, tf.constant(a))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.max(np.abs(want)))


@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("adjoint", [False, True])
def test_triangular_solve_equals_tensorflows(lower, adjoint):
    n, block = 300, 64
    matrix = tf.constant(rng.standard_normal((n, n)) + 4 * np.sqrt(n) * np.eye(n))    # both triangles set
    rhs = tf.constant(rng.standard_normal((n, 7)))

    def both(solve, matrix, rhs):
        with tf.GradientTape() as tape:
            tape.watch([matrix, rhs])
            x = solve(matrix, rhs)
            value = tf.reduce_sum(tf.sin(x))
        return [x] + tape.gradient(value, [matrix, rhs])

    got = _jit(lambda m, r: both(lambda m, r: triangular_solve(m, r, lower, adjoint, block), m, r), matrix, rhs)
    want = both(lambda m, r: tf.linalg.triangular_solve(m, r, lower=lower, adjoint=adjoint), matrix, rhs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-14 * np.max(np.abs(w)))


def _op(fn, *specs):
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return next(op for op in graph.get_operations() if op.type in ("Cholesky", "MatrixTriangularSolve",
                                                                     "MatrixSolve"))


def test_refusals():
    big, small = tf.TensorSpec([MIN_ORDER, MIN_ORDER], tf.float64), tf.TensorSpec([64, 64], tf.float64)
    assert refusal(_op(tf.linalg.cholesky, big)) is None
    assert "under 1024" in refusal(_op(tf.linalg.cholesky, small))
    assert "batches" in refusal(_op(tf.linalg.cholesky, tf.TensorSpec([2, MIN_ORDER, MIN_ORDER], tf.float64)))
    assert "float32 and float64" in refusal(_op(tf.linalg.cholesky, tf.TensorSpec([MIN_ORDER] * 2, tf.complex64)))
    assert "no blocked form" in refusal(_op(tf.linalg.solve, big, tf.TensorSpec([MIN_ORDER, 3], tf.float64)))
    assert refusal(_op(tf.linalg.triangular_solve, big, tf.TensorSpec([MIN_ORDER, 3], tf.float64))) is None
    assert "static shape" in refusal(_op(tf.linalg.triangular_solve, big, tf.TensorSpec([MIN_ORDER, None],
                                                                                          tf.float64)))


N, T = MIN_ORDER, 6000
X = tf.constant(rng.standard_normal((N, 3)))
ERR = tf.constant(rng.standard_normal((N, 1)))
TEST = tf.constant(rng.standard_normal((T, 3)))


def _kernel(a, b):
    return tf.exp(-0.5 * (tf.reduce_sum(a * a, 1)[:, None] - 2 * tf.matmul(a, b, transpose_b=True)
                          + tf.reduce_sum(b * b, 1)[None]))


def predict(x, test):
    """A GP's predictive mean and marginal variance as GPflow's ``base_conditional`` computes them.
    (The data is an argument, and the noise is added to the diagonal as GPflow adds it: XLA folds a
    constant's kernel matrix, or ``1e-2 * eye(N)``, into a constant, which a loop cannot update in
    place.)"""
    kmm = _kernel(x, x)
    lm = tf.linalg.cholesky(tf.linalg.set_diag(kmm, tf.linalg.diag_part(kmm) + 1e-2))     # GPflow's noise
    a = tf.linalg.triangular_solve(lm, _kernel(x, test), lower=True)
    variance = 1.0 - tf.reduce_sum(tf.square(a), 0)
    a = tf.linalg.triangular_solve(tf.linalg.adjoint(lm), a, lower=False)
    return tf.matmul(a, ERR, transpose_a=True), variance


def _figure(limit, **options):
    with tf_memsafe.options(memory_limit=limit, **options):
        return tf_memsafe.memory_footprint(predict, X, TEST)


def test_a_gp_prediction_fits_a_limit_only_the_blocked_factor_and_solves_meet():
    want, naive = run_and_measure(tf.function(predict, jit_compile=True), X, TEST)   # (XLA's figure for it)
    limit = naive // 8
    tf_memsafe.enable(limit, strict=True)
    without = _figure(limit, disabled_passes=frozenset({"blocked_linalg"}))
    # (disabling the pass leaves the splitter's slices blocked: the split solves are the splitter's)
    assert without > limit, (without, limit, naive)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tf.function(predict, jit_compile=True)(X, TEST)
    # The splitter's best effort (the factor held whole) was over the limit; blocked_linalg, after it,
    # brought the program within: the warning, given when the pipeline ends, is withdrawn (a record).
    assert not [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]
    assert any(r.code is GuardCode.WITHDRAWN and "its warning withdrawn: after blocked_linalg" in r.reason
               for rep in tf_memsafe.reports() for r in rep.records if r.pass_name == "splitter")
    records = [r for rep in tf_memsafe.reports() for r in rep.records if r.pass_name == "blocked_linalg"]
    assert [r.action for r in records] == ["rewritten"] and "Cholesky factor" in records[0].reason
    # the kernel's exp and scaling computed on each block of the product's columns, the noise added
    assert "elementwise ops before it computed on each block" in records[0].reason
    assert "its diagonal added to as it goes" in records[0].reason
    # (the withdrawn warning's record gives XLA's figure for the program as rewritten, within the
    # limit: the program is not compiled again here to say it twice)
    for g, w in zip(got, want):                   # (the kernel matrix's condition number is about 1e5)
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-10 * np.max(np.abs(w)))


def test_a_program_within_its_limit_keeps_xlas_factorisation():
    tf_memsafe.enable("4GB", strict=True)
    tf.function(predict, jit_compile=True)(X, TEST[:100])
    assert not any(r.action == "rewritten" for rep in tf_memsafe.reports() for r in rep.records
                   if r.pass_name == "blocked_linalg")


def test_the_splitters_slices_solve_blocked():
    """A solve split along its right-hand side's columns, the factor read whole by each slice, is
    rebuilt by :func:`blocked_linalg.rebuilt_solve` (a loop over the factor's panels); a small one is cloned."""
    graph = tf.function(predict).get_concrete_function(X, TEST).graph
    solve = next(op for op in graph.get_operations() if op.type == "MatrixTriangularSolve")
    g = tf.Graph()
    with g.as_default():
        lm = tf.compat.v1.placeholder(tf.float64, [N, N])
        rhs = tf.compat.v1.placeholder(tf.float64, [N, 40])
        (out,) = blocked_linalg.rebuilt_solve(solve, [lm, rhs])
    assert out.shape == (N, 40) and any(op.type in ("While", "StatelessWhile") for op in g.get_operations())
    with g.as_default():
        (small,) = blocked_linalg.rebuilt_solve(solve, [lm[:64, :64], rhs[:64]])
    assert small.op.type == "MatrixTriangularSolve"


@pytest.mark.parametrize("through", ["transpose", "adjoint", "broadcast"])
def test_a_solve_read_through_the_factors_transpose(through):
    """GPflow's second solve is ``solve(adjoint(Lm), A, lower=False)``: read as ``solve(Lm, A,
    lower=True, adjoint=True)`` (both flags flipped), equal to TensorFlow's."""
    graph = tf.function(predict).get_concrete_function(X, TEST).graph
    upper = [op for op in graph.get_operations() if op.type == "MatrixTriangularSolve"][1]
    assert not upper.get_attr("lower")
    lm = tf.linalg.cholesky(tf.constant(_spd(N)))
    rhs = tf.constant(rng.standard_normal((N, 5)))
    view = {"transpose": lambda m: tf.transpose(m), "adjoint": tf.linalg.adjoint,
            "broadcast": lambda m: tf.broadcast_to(tf.transpose(m), [N, N])}[through]

    @tf.function(jit_compile=True)
    def blocked(lm, rhs):
        (out,) = blocked_linalg.rebuilt_solve(upper, [view(lm), rhs])
        assert out.op.type != "MatrixTriangularSolve"
        return out

    want = tf.linalg.triangular_solve(tf.transpose(lm), rhs, lower=False)
    np.testing.assert_allclose(blocked(lm, rhs), want, rtol=0, atol=1e-12 * np.max(np.abs(want)))


def test_a_factor_of_a_matrix_with_its_diagonal_set():
    """``cholesky(set_diag(K, d))`` (GPflow's likelihood noise) factors ``K`` in its own buffer,
    setting each block's diagonal as it reads it: equal to TensorFlow's, gradients for ``K`` and ``d``."""
    n, block = 300, 64
    k, d = tf.constant(_spd(n)), tf.constant(rng.uniform(2.0, 3.0, n))

    def both(factor, k, d):
        with tf.GradientTape() as tape:
            tape.watch([k, d])
            value = tf.reduce_sum(tf.sin(factor(k, d)))
        return [value] + tape.gradient(value, [k, d])

    got = _jit(lambda k, d: both(lambda k, d: cholesky(k, block, diagonal=d), k, d), k, d)
    want = both(lambda k, d: tf.linalg.cholesky(tf.linalg.set_diag(k, d)), k, d)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12 * np.max(np.abs(w)))


def test_a_training_loss_with_its_gradients_keeps_the_kernel_whole():
    """With the tape inside (a GP's log marginal likelihood and its gradient for the data), the
    factor is blocked but the kernel's elementwise ops are not taken into the loop (TensorFlow would
    differentiate through it).  The backward holds [n, n] matrices anyway, so XLA's figure does not
    fall and the guard undoes the rewrite (its record says what it tried); loss and gradient equal to
    the step as written."""
    y = tf.constant(rng.standard_normal((N, 1)))

    def loss_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            kmm = _kernel(x, x)
            lm = tf.linalg.cholesky(tf.linalg.set_diag(kmm, tf.linalg.diag_part(kmm) + 1e-2))
            alpha = tf.linalg.triangular_solve(lm, y, lower=True)
            loss = tf.reduce_sum(tf.math.log(tf.linalg.diag_part(lm))) + 0.5 * tf.reduce_sum(tf.square(alpha))
        return loss, tape.gradient(loss, x)

    # (packed_cholesky, before the splitter, would take this factor whole: test_packed_cholesky.py)
    tf_memsafe.enable(25 * 10**6, strict=True, disabled_passes={"packed_cholesky"})   # (about 51 MB as written)
    got = tf.function(loss_and_gradient, jit_compile=True)(X)
    records = [r for rep in tf_memsafe.reports() for r in rep.records if r.pass_name == "blocked_linalg"]
    assert any("a Cholesky factor written" in r.reason for r in records), [r.reason for r in records]
    assert all("elementwise" not in r.reason for r in records), [r.reason for r in records]
    tf_memsafe.disable()
    want = tf.function(loss_and_gradient, jit_compile=True)(X)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-9 * np.max(np.abs(w)))


def test_a_tape_outside_differentiates_the_factor_through_its_kernel():
    """A GP's negative log marginal likelihood under a limit, the tape outside the function: the factor
    is blocked with the kernel's elementwise ops in its loop, and its gradient (TensorFlow's formula,
    carried back through those ops on the whole matrix) equals the unrewritten function's."""
    y = tf.constant(rng.standard_normal((N, 1)))

    def nlml(x):
        kmm = _kernel(x, x)
        lm = tf.linalg.cholesky(tf.linalg.set_diag(kmm, tf.linalg.diag_part(kmm) + 1e-2))
        alpha = tf.linalg.triangular_solve(lm, y, lower=True)
        return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(lm))) + 0.5 * tf.reduce_sum(tf.square(alpha))

    def value_and_gradient(fn):
        with tf.GradientTape() as tape:
            tape.watch(X)
            value = fn(X)
        return value, tape.gradient(value, X)

    # (over it as written: the rewrite below fires; packed_cholesky's own case: test_packed_cholesky.py)
    tf_memsafe.enable(15 * 10**6, strict=True, disabled_passes={"packed_cholesky"})
    got = value_and_gradient(tf.function(nlml, jit_compile=True))
    records = [r for rep in tf_memsafe.reports() for r in rep.records
               if r.pass_name == "blocked_linalg" and r.action == "rewritten"]
    assert any("elementwise ops before it computed on each block" in r.reason for r in records), records
    tf_memsafe.disable()
    want = value_and_gradient(tf.function(nlml, jit_compile=True))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-9 * np.max(np.abs(w)))


def test_a_tail_is_taken_only_from_a_product_of_the_factors_dtype():
    """The loop writes the factor into the tail's [n, n] operand: a float32 product cast to float64
    cannot hold it, and two [n, n] operands that are not made from vectors are not a tail."""
    def graph_of(fn):
        return tf.function(fn).get_concrete_function(tf.TensorSpec([64, 3], tf.float32)).graph

    def matrix_of(graph):
        return next(op for op in graph.get_operations() if op.type == "Exp").outputs[0]

    cast = graph_of(lambda x: tf.exp(tf.cast(tf.matmul(x, x, transpose_b=True), tf.float64)))
    assert blocked_linalg.Tail.of(matrix_of(cast), set(cast.get_operations())) is None
    plain = graph_of(lambda x: tf.exp(-2.0 * tf.matmul(x, x, transpose_b=True)
                                      + tf.reshape(tf.reduce_sum(x * x, 1), [-1, 1])))
    tail = blocked_linalg.Tail.of(matrix_of(plain), set(plain.get_operations()))
    assert tail is not None and tail.raw.op.type == "MatMul" and [op.type for op in tail.ops] == ["Mul", "AddV2", "Exp"]
    two = graph_of(lambda x: tf.exp(tf.matmul(x, x, transpose_b=True) * tf.matmul(x, x, transpose_b=True)))
    assert blocked_linalg.Tail.of(matrix_of(two), set(two.get_operations())) is None


@pytest.mark.parametrize("noise", ["eye", "diag"])
def test_a_kernels_noise_added_as_a_diagonal_matrix_is_in_its_tail(noise):
    """``K + σ² I`` written with ``tf.eye`` (or ``tf.linalg.diag`` of a vector), as a kernel ridge
    regression writes it: the diagonal matrix's columns are made from its vector on each block, so the
    kernel's ops stay in the factor's loop (before, ``tf.eye`` was a second [n, n] operand and no tail
    was taken: XLA held the product and the kernel matrix at once, 129 MB where 80 MB with it).  The
    factor equals TensorFlow's."""
    n, block = 300, 64
    x = tf.constant(rng.standard_normal((n, 3)))
    s = tf.constant(rng.uniform(0.1, 0.2, n))
    add = {"eye": lambda: 0.1 * tf.eye(n, dtype=tf.float64), "diag": lambda: tf.linalg.diag(s)}[noise]

    def matrix(x):
        return _kernel(x, x) + add()

    graph = tf.function(matrix).get_concrete_function(x).graph
    tail = blocked_linalg.Tail.of(graph.outputs[0].op.inputs[0], set(graph.get_operations()))
    assert tail is not None and tail.raw.op.type == "MatMul", tail
    assert {"MatrixDiagV3", "Exp"} <= {op.type for op in tail.ops}

    def blocked(x):
        own = blocked_linalg.Tail.of(matrix(x), set(tf.compat.v1.get_default_graph().get_operations()))
        return cholesky(own.raw, block, tail=own)

    np.testing.assert_allclose(_jit(blocked, x), tf.linalg.cholesky(matrix(x)), rtol=0, atol=1e-12)
