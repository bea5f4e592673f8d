"""reduce_of_product: each rule fires on its spellings, computes the same values, and only there.

Bytes, worked out for the small cases: ``A @ B`` is [N, J] @ [J, M] = [30, 5] @ [5, 40] in
float32, so the product is 30 x 40 x 4 B = 4800 B.  Each case's docstring gives what replaces it
(the cost model's count: every new intermediate, as if materialised).
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.graph_query import live_ops
from grappler_ext.guard import Guard
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import assert_graph_text, format_graph
from grappler_ext.reduce_of_product import (
    FLOP_SLACK,
    Cost,
    Dims,
    ReduceOfProduct,
    diag_cost,
    gram_cost,
    linear_cost,
    product_cost,
    refusal,
)
from tf_memsafe import hook

N, J, M = 30, 5, 40
# A limit every program here is over: rewrites made for memory run only there (grappler_ext.guard).
OVER = "1KB"
F32 = 4
TOL = {tf.float32: 1e-4, tf.float64: 1e-10}


class _Unjudged(Guard):
    """The pass's own rule, unguarded: XLA:CPU fuses a float32 sum of a dot itself, so the pipeline's
    guard undoes some of these rewrites under XLA (tests/grappler_ext/test_guard.py has its tests)."""

    def verdict(self, graph, options, measure=True):
        return None

    @staticmethod
    def compare(before, after, limit=None, slower=False):
        return None


def unguarded(gram_forms=False) -> Pipeline:
    return Pipeline([ReduceOfProduct(gram_forms=gram_forms)], guard=_Unjudged())


def pipeline(gram_forms=False):
    return hook.use_pipeline(unguarded(gram_forms))


def all_records():
    return [r for rep in tf_memsafe.reports() for r in rep.records]


def rewritten_records():
    return [r for r in all_records() if r.action == "rewritten"]


def largest_live_elements(graph):
    """Elements of the largest tensor the (rewritten) function still computes."""
    return max(t.shape.num_elements() or 0 for op in live_ops(graph) for t in op.outputs
               if t.shape.is_fully_defined())


def assert_close(got, expected, dtype, scale=1.0):
    """Relative to the largest magnitude, since reordered sums differ in absolute terms."""
    expected = np.asarray(expected)
    atol = TOL[dtype] * scale * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(got, expected, rtol=TOL[dtype] * scale, atol=atol)


class _RewriteCase:
    """One rule on one spelling.  Subclasses set ``fn``, ``shapes``, ``bytes_after`` and optionally
    ``EXPECTED`` (golden text, float32) and ``gram_forms``."""

    fn = None
    shapes: tuple = ()
    product_elements = N * M
    bytes_after: int = 0
    gram_forms = False
    EXPECTED: str | None = None

    def specs(self, dtype=tf.float32):
        return [tf.TensorSpec(s, dtype) for s in self.shapes]

    def trace(self):
        tf_memsafe.enable(OVER, strict=True)
        with pipeline(self.gram_forms):
            return tf.function(self.fn, jit_compile=True).get_concrete_function(*self.specs()).graph

    def test_structure_and_count(self):
        g = self.trace()
        if self.EXPECTED is not None:
            assert_graph_text(g, self.EXPECTED)
        assert largest_live_elements(g) < self.product_elements
        (record,) = rewritten_records()
        assert record.bytes_before == self.product_elements * F32
        assert record.bytes_after == self.bytes_after

    def test_idempotent(self):
        g = self.trace()
        once = format_graph(g)
        result = unguarded(self.gram_forms).run(g, tf_memsafe.get_options())
        assert not result.changed and result.records == []
        assert format_graph(g) == once

    @pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
    @pytest.mark.parametrize("jit", [True, False])
    def test_forward_and_gradients(self, dtype, jit):
        rng = np.random.default_rng(0)
        values = [tf.constant(rng.standard_normal(s), dtype) for s in self.shapes]
        out_shape = tf.function(self.fn).get_concrete_function(*self.specs(dtype)).output_shapes
        weights = tf.constant(rng.standard_normal(out_shape), dtype)

        def value_and_grads(f):
            variables = [tf.Variable(v) for v in values]
            with tf.GradientTape() as tape:
                out = f(*variables)
                loss = tf.reduce_sum(out * weights)
            return out, tape.gradient(loss, variables)

        expected, expected_grads = value_and_grads(tf.function(self.fn, jit_compile=jit))
        tf_memsafe.enable(OVER, strict=True, rewrite_non_jit=True)
        with pipeline(self.gram_forms):
            got, got_grads = value_and_grads(tf.function(self.fn, jit_compile=jit))
        assert len(rewritten_records()) == 1
        assert_close(got, expected, dtype)
        for g, e in zip(got_grads, expected_grads):
            assert_close(g, e, dtype, scale=10)


class TestSumLastAxis(_RewriteCase):
    """sum(A @ B, -1) => A @ sum(B, -1, keepdims): [5, 1] + [30, 1] = 35 x 4 = 140 B for 4800 B."""

    @staticmethod
    def fn(a, b):
        return tf.reduce_sum(a @ b, -1)

    shapes = ([N, J], [J, M])
    bytes_after = (J + N) * F32
    EXPECTED = """
        %0 = Placeholder f32[30,5] ()
        %1 = Placeholder f32[5,40] ()
        %2 = Const i32[] = -1
        %3 = Sum{keep_dims=true} f32[5,1] (%1, %2)
        %4 = MatMul f32[30,1] (%0, %3)
        %5 = Const i32[1] = [30]
        %6 = Reshape f32[30] (%4, %5)
        %7 = Identity f32[30] (%6)
        return %7
    """


class TestSumFirstAxisTransposedAKeepdims(_RewriteCase):
    """sum(Aᵀ @ B, -2, keepdims) => sum(A, -1)ᵀ @ B, read as MatMul{transpose_a} of the [5, 1] sums:
    [5, 1] + [1, 40] = 45 x 4 = 180 B for 4800 B.  No transpose is built."""

    @staticmethod
    def fn(a, b):
        return tf.reduce_sum(tf.linalg.matmul(a, b, transpose_a=True), axis=-2, keepdims=True)

    shapes = ([J, N], [J, M])
    bytes_after = (J + M) * F32
    EXPECTED = """
        %0 = Placeholder f32[5,30] ()
        %1 = Placeholder f32[5,40] ()
        %2 = Const i32[] = -1
        %3 = Sum{keep_dims=true} f32[5,1] (%0, %2)
        %4 = MatMul{transpose_a=true} f32[1,40] (%3, %1)
        %5 = Identity f32[1,40] (%4)
        return %5
    """


class TestMeanEverythingBroadcastBatch(_RewriteCase):
    """mean(A[3, N, J] @ B[M, J]ᵀ) over all axes (B broadcast over the batch) =>
    sum_j mean(A, -2)[j] * mean(B, -1)[j], then the mean over the batch.  Product [3, 30, 40] =
    14400 B; new: [3, 5] + [5] + [3, 5] = 35 x 4 = 140 B."""

    @staticmethod
    def fn(a, b):
        return tf.reduce_mean(tf.linalg.matmul(a, b, transpose_b=True))

    shapes = ([3, N, J], [M, J])
    product_elements = 3 * N * M
    bytes_after = (3 * J + J + 3 * J) * F32


class TestSumBatchedAdjointLastAxisAndBatch(_RewriteCase):
    """sum(A[2, J, N]ᴴ @ B[2, J, M], [0, 2]) (BatchMatMulV2{adj_x}) => A ᴴ@ sum(B, -1), then the
    batch sum.  Product [2, 30, 40] = 9600 B; new: [2, 5, 1] + [2, 30, 1] = 70 x 4 = 280 B."""

    @staticmethod
    def fn(a, b):
        return tf.reduce_sum(tf.linalg.matmul(a, b, adjoint_a=True), axis=[0, 2])

    shapes = ([2, J, N], [2, J, M])
    product_elements = 2 * N * M
    bytes_after = (2 * J + 2 * N) * F32


class TestDiagPart(_RewriteCase):
    """diag_part(A[30, 5] @ B[5, 30]) => sum(A * Bᵀ, -1).  Product [30, 30] = 3600 B; new: Bᵀ and
    A * Bᵀ, [30, 5] each = 300 x 4 = 1200 B (XLA fuses the product into the sum; the count is an
    upper bound)."""

    @staticmethod
    def fn(a, b):
        return tf.linalg.diag_part(a @ b)

    shapes = ([N, J], [J, N])
    product_elements = N * N
    bytes_after = 2 * N * J * F32
    EXPECTED = """
        %0 = Placeholder f32[30,5] ()
        %1 = Placeholder f32[5,30] ()
        %2 = Const i32[2] = [1, 0]
        %3 = Transpose f32[30,5] (%1, %2)
        %4 = Mul f32[30,5] (%0, %3)
        %5 = Const i32[] = -1
        %6 = Sum f32[30] (%4, %5)
        %7 = Identity f32[30] (%6)
        return %7
    """


class TestDiagPartV1TransposedA(_RewriteCase):
    """MatrixDiagPart(Aᵀ @ B) with A, B [5, 30] => sum(A * B, -2): no transpose needed.  Product
    [30, 30] = 3600 B; new: A * B [5, 30] = 600 B."""

    @staticmethod
    def fn(a, b):
        return tf.raw_ops.MatrixDiagPart(input=tf.linalg.matmul(a, b, transpose_a=True))

    shapes = ([J, N], [J, N])
    product_elements = N * N
    bytes_after = N * J * F32


class TestTraceBatchedBothTransposed(_RewriteCase):
    """trace(Aᵀ @ Bᵀ) for A [2, 5, 30], B [2, 30, 5] is sum(diag_part(.), -1): the diagonal becomes
    sum(Aᵀ * B, -1), the trace's Sum stays.  Product [2, 30, 30] = 7200 B; new: Aᵀ and Aᵀ * B,
    [2, 30, 5] each = 600 x 4 = 2400 B."""

    @staticmethod
    def fn(a, b):
        return tf.linalg.trace(tf.linalg.matmul(a, b, transpose_a=True, transpose_b=True))

    shapes = ([2, J, N], [2, N, J])
    product_elements = 2 * N * N
    bytes_after = 2 * 2 * N * J * F32


class TestGramBothAxes(_RewriteCase):
    """sum((A @ B)²) => sum((AᵀA) * (B Bᵀ)), clamped at 0.  Product 4800 B; new: three [5, 5]
    = 75 x 4 = 300 B.  FLOPs: 2·30·40·5 + 2·1200 = 14400 before, 2·30·25 + 2·40·25 + 50 = 3550
    after."""

    gram_forms = True

    @staticmethod
    def fn(a, b):
        return tf.reduce_sum(tf.square(a @ b))

    shapes = ([N, J], [J, M])
    bytes_after = 3 * J * J * F32
    EXPECTED = """
        %0 = Placeholder f32[30,5] ()
        %1 = Placeholder f32[5,40] ()
        %2 = Const f32[] = 0.0
        %3 = MatMul{transpose_a=true} f32[5,5] (%0, %0)
        %4 = MatMul{transpose_b=true} f32[5,5] (%1, %1)
        %5 = Mul f32[5,5] (%3, %4)
        %6 = Const i32[2] = [-2, -1]
        %7 = Sum{keep_dims=true} f32[1,1] (%5, %6)
        %8 = Maximum f32[1,1] (%7, %2)
        %9 = Const i32[0] = []
        %10 = Reshape f32[] (%8, %9)
        %11 = Identity f32[] (%10)
        return %11
    """


class TestGramLastAxisTransposedAPow(_RewriteCase):
    """sum((Aᵀ @ B)**2, -1) with A [5, 30] => sum(((B Bᵀ) @ A) * A, -2).  Product 4800 B; new:
    [5, 5] + two [5, 30] = 325 x 4 = 1300 B."""

    gram_forms = True

    @staticmethod
    def fn(a, b):
        return tf.reduce_sum(tf.linalg.matmul(a, b, transpose_a=True) ** 2, -1)

    shapes = ([J, N], [J, M])
    bytes_after = (J * J + 2 * N * J) * F32


class TestGramFirstAxisTransposedBMulKeepdims(_RewriteCase):
    """sum(P * P, -2, keepdims) for P = A @ Bᵀ, B [40, 5] => sum((B @ (AᵀA)) * B, -1).  Product
    4800 B; new: [5, 5] + two [40, 5] = 425 x 4 = 1700 B."""

    gram_forms = True

    @staticmethod
    def fn(a, b):
        p = tf.linalg.matmul(a, b, transpose_b=True)
        return tf.reduce_sum(p * p, axis=0, keepdims=True)

    shapes = ([N, J], [M, J])
    bytes_after = (J * J + 2 * M * J) * F32


class TestTwoSitesInOneFunction:
    """sum(A @ B, -1) and trace(A @ C) in one function: two rewrites, neither product survives."""

    def test_both_fire(self):
        def fn(a, b, c):
            return tf.reduce_sum(a @ b, -1) + tf.linalg.trace(a @ c)

        tf_memsafe.enable(OVER, strict=True)
        with pipeline():
            g = tf.function(fn, jit_compile=True).get_concrete_function(
                tf.TensorSpec([N, J]), tf.TensorSpec([J, M]), tf.TensorSpec([J, N])).graph
        assert len(rewritten_records()) == 2
        assert largest_live_elements(g) == J * M  # the input B; no [30, 40] or [30, 30] product


class TestMustNotFire:
    def unchanged(self, fn, *specs, gram_forms=True):
        """Trace ``fn`` with the pass; assert the graph is exactly what tracing without it gives."""
        plain = format_graph(tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph)
        tf_memsafe.enable(OVER, strict=True)
        with pipeline(gram_forms):
            g = tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph
        assert format_graph(g) == plain
        assert rewritten_records() == []
        return all_records()

    def test_product_with_another_consumer(self):
        """The product is returned as well: it is built anyway, nothing would be saved."""
        def fn(a, b):
            p = a @ b
            return tf.reduce_sum(p, -1), tf.reduce_max(p)

        (rec,) = self.unchanged(fn, tf.TensorSpec([N, J]), tf.TensorSpec([J, M]))
        assert "consumer outside the pattern" in rec.reason and rec.bytes_before == N * M * F32

    def test_integers(self):
        (rec,) = self.unchanged(lambda a, b: tf.reduce_sum(a @ b, -1),
                                tf.TensorSpec([N, J], tf.int32), tf.TensorSpec([J, M], tf.int32))
        assert "is_floating()" in rec.reason

    def test_dynamic_shape(self):
        (rec,) = self.unchanged(lambda a, b: tf.reduce_sum(a @ b, -1),
                                tf.TensorSpec([None, J]), tf.TensorSpec([J, M]))
        assert "static_shape()" in rec.reason

    def test_thin_product_is_not_cheaper(self):
        """sum(A[30, 5] @ B[5, 1], -1): the product is [30, 1]; B's sums and A @ them are 35 elements."""
        (rec,) = self.unchanged(lambda a, b: tf.reduce_sum(a @ b, -1), tf.TensorSpec([N, J]), tf.TensorSpec([J, 1]))
        assert rec.reason.startswith("not cheaper")

    def test_diag_with_wide_inner_dimension(self):
        """diag_part(A[10, 40] @ B[40, 10]): A * Bᵀ is [10, 40], larger than the [10, 10] product."""
        (rec,) = self.unchanged(lambda a, b: tf.linalg.diag_part(a @ b),
                                tf.TensorSpec([10, 40]), tf.TensorSpec([40, 10]))
        assert rec.reason.startswith("not cheaper")

    def test_diag_of_non_square_product(self):
        (rec,) = self.unchanged(lambda a, b: tf.linalg.diag_part(a @ b), tf.TensorSpec([N, J]), tf.TensorSpec([J, M]))
        assert "non-square" in rec.reason

    def test_sum_over_batch_axis_only(self):
        (rec,) = self.unchanged(lambda a, b: tf.reduce_sum(a @ b, 0),
                                tf.TensorSpec([3, N, J]), tf.TensorSpec([3, J, M]))
        assert "not over a matrix axis" in rec.reason

    def test_gram_forms_off_by_default(self):
        (rec,) = self.unchanged(lambda a, b: tf.reduce_sum(tf.square(a @ b)),
                                tf.TensorSpec([N, J]), tf.TensorSpec([J, M]), gram_forms=False)
        assert "gram_forms=True" in rec.reason and rec.bytes_before == N * M * F32

    def test_gram_with_too_many_flops(self):
        """A[400, 20] @ B[20, 4]: 3 J² = 1200 < N M = 1600 elements, but AᵀA alone costs 2·400·400
        = 320000 FLOPs against 2·1600·20 + 3200 = 67200 for the product."""
        (rec,) = self.unchanged(lambda a, b: tf.reduce_sum(tf.square(a @ b)),
                                tf.TensorSpec([400, 20]), tf.TensorSpec([20, 4]))
        assert "the FLOPs of the product" in rec.reason

    def test_gram_as_in_svgp_is_not_cheaper(self):
        """GPflow's SVGP: sum((Lᵀ @ A)², -2) with L [1, 20, 20], A [1, 20, 200]: (L Lᵀ) @ A is as large
        as Lᵀ @ A, so 400 + 2 x 4000 elements would replace 4000."""
        (rec,) = self.unchanged(lambda l_, a: tf.reduce_sum(tf.square(tf.linalg.matmul(l_, a, adjoint_a=True)), -2),
                                tf.TensorSpec([1, 20, 20], tf.float64), tf.TensorSpec([1, 20, 200], tf.float64))
        assert rec.reason.startswith("not cheaper")

    def test_mean_of_squares_is_not_handled(self):
        (rec,) = self.unchanged(lambda a, b: tf.reduce_mean(tf.square(a @ b), -1),
                                tf.TensorSpec([N, J]), tf.TensorSpec([J, M]))
        assert "expected Sum, found Mean" in rec.reason

    def test_unrelated_reductions_leave_no_record(self):
        """Sums of squares, of elementwise products and a trace, none of a matmul: not even a record."""
        def fn(a, b):
            return tf.reduce_sum(tf.square(a), -1) + tf.reduce_sum(a * a, -1) + tf.linalg.trace(b[:, :J])

        assert self.unchanged(fn, tf.TensorSpec([N, J]), tf.TensorSpec([J, N])) == []


class TestCostModel:
    """The shape-only cost model, without TensorFlow."""

    D = Dims(batch_a=1, batch_b=1, batch=1, n=3000, j=50, m=3000)

    def test_product(self):
        assert product_cost(self.D) == Cost(9_000_000, 2 * 9_000_000 * 50 + 9_000_000)

    def test_linear_forms_are_cheaper(self):
        before = product_cost(self.D)
        for axes in [(False, True), (True, False), (True, True)]:
            after = linear_cost(self.D, *axes)
            assert refusal(before, after) is None and after.elements <= 3050

    def test_diag_refused_from_j_equal_n(self):
        d = Dims(1, 1, 1, n=50, j=50, m=50)
        assert refusal(product_cost(d), diag_cost(d, transposed=0)).startswith("not cheaper")
        d = Dims(1, 1, 1, n=50, j=25, m=50)
        assert refusal(product_cost(d), diag_cost(d, transposed=0)) is None
        assert refusal(product_cost(d), diag_cost(d, transposed=1)).startswith("not cheaper")

    def test_gram_needs_a_small_inner_dimension(self):
        assert refusal(product_cost(self.D, squared=True), gram_cost(self.D, True, True)) is None
        wide = Dims(1, 1, 1, n=100, j=60, m=100)  # 3 J² = 10800 > N M = 10000
        assert refusal(product_cost(wide, True), gram_cost(wide, True, True)).startswith("not cheaper")
        # sum((A @ B)², -2) with N = 10000, J = 100, M = 10: (AᵀA) and two [100, 10] hold 12000
        # elements against 100000, but AᵀA costs 2·10000·100² = 2e8 FLOPs against 2.02e7.
        skew = Dims(1, 1, 1, n=10000, j=100, m=10)
        after = gram_cost(skew, over_n=True, over_m=False)
        assert after.elements == 12000
        assert f"more than {FLOP_SLACK:g}x" in refusal(product_cost(skew, squared=True), after)


class TestMemoryFootprint:
    """XLA's "Total bytes used" on [3000, 50] @ [50, 3000] float32: the product is 36 MB, the inputs
    2 x 600 kB.  The product goes away for Aᵀ @ B summed over -1 (37.2 MB -> 1.2 MB + 200 B for
    sum(B, -1)), for trace(A @ B) (37.2 MB -> 1.2 MB + Bᵀ 600 kB) and for the Gram form of
    sum((A @ B)², -1) (38.3 MB -> 1.2 MB + A (B Bᵀ) 600 kB).

    XLA:CPU (TF 2.21) already fuses sum(A @ B, -1) with the canonical layout into one custom
    ``__ynn_fusion`` without a product buffer: there the figures before and after are equal
    (1.2 MB) up to the 200 B of sum(B, -1).  Without XLA, TensorFlow's kernels build the product.
    """

    BIG = 3000

    @pytest.mark.parametrize("case", ["sum_transposed_a", "trace", "gram_last_axis"])
    def test_product_disappears(self, case):
        n, j = self.BIG, 50
        fn, specs = {
            "sum_transposed_a": (lambda a, b: tf.reduce_sum(tf.linalg.matmul(a, b, transpose_a=True), -1),
                                 (tf.TensorSpec([j, n]), tf.TensorSpec([j, n]))),
            "trace": (lambda a, b: tf.linalg.trace(a @ b), (tf.TensorSpec([n, j]), tf.TensorSpec([j, n]))),
            "gram_last_axis": (lambda a, b: tf.reduce_sum(tf.square(a @ b), -1),
                               (tf.TensorSpec([n, j]), tf.TensorSpec([j, n]))),
        }[case]
        tf_memsafe.enable(OVER)
        with pipeline(gram_forms=True):
            before = tf_memsafe.memory_footprint(fn, *specs, rewrite=False)
            after = tf_memsafe.memory_footprint(fn, *specs)
        inputs = 2 * n * j * F32
        assert before >= n * n * F32
        assert after <= inputs + n * j * F32 + 64 * 1024  # at most one [3000, 50] intermediate

    def test_never_worse_where_xla_already_fuses(self):
        fn = lambda a, b: tf.reduce_sum(a @ b, -1)
        specs = (tf.TensorSpec([self.BIG, 50]), tf.TensorSpec([50, self.BIG]))
        tf_memsafe.enable(OVER)
        with pipeline():
            before = tf_memsafe.memory_footprint(fn, *specs, rewrite=False)
            after = tf_memsafe.memory_footprint(fn, *specs)
        assert after <= before + 50 * F32 + 64


class TestGPflow:
    """GPflow 2.11's SGPR and GPR (SquaredExponential, 200 points, 20 inducing points, float64).

    The one reduction of a product in their training losses is SGPR's
    trace_q = reduce_sum(diag_part(AAT)), AAT = A @ Aᵀ [20, 20]: AAT is also read by
    B = I + AAT (diag_part and set_diag), so the pass leaves it with that reason, and the loss is
    what it was.  GPR's reductions read solves and kernels, never a product: no record at all.
    """

    @pytest.fixture(scope="class")
    @classmethod
    def data(cls):
        pytest.importorskip("gpflow")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((200, 2))
        return x, np.sin(x[:, :1]) + 0.1 * rng.standard_normal((200, 1))

    def losses(self, make_model):
        model = make_model()
        expected = tf.function(model.training_loss, jit_compile=True)()
        tf_memsafe.enable(OVER, strict=True)
        with pipeline(gram_forms=True):
            got = tf.function(model.training_loss, jit_compile=True)()
        return float(got), float(expected)

    def test_sgpr_trace_spot_is_skipped_and_loss_unchanged(self, data):
        import gpflow

        got, expected = self.losses(lambda: gpflow.models.SGPR(
            data, gpflow.kernels.SquaredExponential(), inducing_variable=data[0][:20].copy()))
        records = all_records()
        assert rewritten_records() == []
        assert records and all("consumer outside the pattern" in r.reason for r in records)
        assert {r.bytes_before for r in records} == {20 * 20 * 8}
        assert got == pytest.approx(expected, rel=1e-10)

    def test_gpr_has_no_reduction_of_a_product(self, data):
        import gpflow

        got, expected = self.losses(lambda: gpflow.models.GPR(data, gpflow.kernels.SquaredExponential()))
        assert all_records() == []
        assert got == pytest.approx(expected, rel=1e-10)
