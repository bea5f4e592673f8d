"""memory_model: each byte rule on its own, fusion and liveness, refusals, and agreement with XLA.

Every expected figure is worked out in the test's docstring from the shapes (float32 is 4 bytes,
float64 8).  The last class compiles a dozen workloads with XLA (compile only) and checks that the
model's peak stays within a band of XLA's "Total bytes used"; its docstring has the table.
"""

import dataclasses

import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings

import tf_memsafe
from grappler_ext import shapes
from grappler_ext.memory_model import RULES, Buffer, Estimate, Kind, Step, annotate, bytes_for_chunk, estimate
from grappler_ext.printer import graph_fingerprint

f32, f64 = tf.float32, tf.float64


def spec(*shape, dtype=f32):
    return tf.TensorSpec(shape, dtype)


def trace(fn, *specs):
    """The FuncGraph XLA would compile for ``fn`` (tf_memsafe is disabled by the conftest fixture)."""
    return tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph


def infos(graph, op_type):
    """TensorInfo of output 0 of every op of ``op_type``, in creation order."""
    info = annotate(graph)
    return [info[op.outputs[0].name] for op in graph.get_operations() if op.type == op_type]


def one(graph, op_type):
    (found,) = infos(graph, op_type)
    return found


def naive_sqdist(x, y):
    return tf.reduce_sum((x[:, None] - y[None]) ** 2, -1)


def sqdist_matmul(x, y):
    x2 = tf.reduce_sum(x * x, -1)[:, None]
    y2 = tf.reduce_sum(y * y, -1)[None, :]
    return tf.maximum(x2 - 2.0 * tf.matmul(x, y, transpose_b=True) + y2, 0.0)


MB = 1_000_000
SQ = spec(1000, 1000)  # 4 MB


# --- parameters, constants, bitcasts -----------------------------------------------------------


class TestParameters:
    def test_parameter_and_output(self):
        """x + 1 on [1000, 1000]: parameter 4 MB + output 4 MB (XLA: 8,000,000)."""
        e = estimate(trace(lambda x: x + 1.0, SQ))
        assert (e.parameter_bytes, e.output_bytes, e.peak_bytes) == (4 * MB, 4 * MB, 8 * MB)

    def test_output_returning_a_parameter_is_a_copy(self):
        """tf.identity(x): XLA copies the parameter into the output: 4 + 4 MB."""
        e = estimate(trace(tf.identity, SQ))
        assert e.peak_bytes == 8 * MB
        assert [b.kind for b in e.buffers] == ["parameter", "output"]

    def test_variable_read_is_a_parameter(self):
        """x + v with a [1000, 1000] variable: two parameters and the output, 12 MB; the resource
        handle itself is no buffer."""
        v = tf.Variable(tf.zeros([1000, 1000]))
        g = trace(lambda x: x + v, SQ)
        assert one(g, "ReadVariableOp").materialised
        handles = [i for i in annotate(g).values() if i.dtype == tf.resource]
        assert handles and not any(i.materialised for i in handles)
        assert estimate(g).peak_bytes == 12 * MB


    def test_a_variable_read_nothing_reads_is_no_buffer(self):
        """A read kept live only by a control edge (one that grappler_ext.variable_updates forwarded to
        the value written before it) holds nothing: XLA reads nothing."""
        v = tf.Variable(tf.zeros([1000, 1000]))
        g = trace(lambda x: x + v, SQ)
        read = next(op for op in g.get_operations() if op.type == "ReadVariableOp")
        with g.as_default():
            unread = tf.raw_ops.ReadVariableOp(resource=read.inputs[0], dtype=tf.float32)
        g.control_outputs.append(unread.op)          # live through a control edge only
        info = annotate(g)
        assert not info[unread.name].materialised
        assert info[read.outputs[0].name].materialised
        assert estimate(g).peak_bytes == 12 * MB


class TestConstants:
    def test_large_constant_has_its_own_allocation(self):
        """x + C with a [1000, 1000] numpy constant: 4 MB each for x, C and the output."""
        c = np.ones((1000, 1000), np.float32)
        e = estimate(trace(lambda x: x + c, SQ))
        assert (e.constant_bytes, e.peak_bytes) == (4 * MB, 12 * MB)

    def test_scalars_and_axes_cost_nothing(self):
        """sum(2 x, 1): the scalar 2 is folded into the fusion, the axis is read at compile time."""
        g = trace(lambda x: tf.reduce_sum(x * 2.0, 1), spec(1000, 8, dtype=f64))
        consts = infos(g, "Const")
        assert {i.reason for i in consts} == {"scalar constant, folded into its consumers",
                                               "compile-time operand (axes, shapes)"}
        assert estimate(g).constant_bytes == 0


class TestBitcasts:
    def test_shape_only_ops_share_their_input(self):
        """Reshape, ExpandDims, Squeeze, StopGradient, Identity and x[:, None] are bitcasts: the only
        buffers are x and the output (2 x 4 MB)."""
        def fn(x):
            y = tf.stop_gradient(tf.squeeze(tf.expand_dims(x, 0), 0))
            return tf.reshape(tf.identity(y[:, None]), [1000, 1000]) * 2.0

        g = trace(fn, SQ)
        for op_type in ("ExpandDims", "Squeeze", "StopGradient", "StridedSlice", "Reshape"):
            info = infos(g, op_type)[0]
            assert not info.materialised and info.alias_of == "x:0", op_type
        assert estimate(g).peak_bytes == 8 * MB

    def test_real_slice_is_not_a_bitcast(self):
        """x[:500] @ w copies the slice out for the GEMM: 4 + 4 (params) + 2 (slice) + 2 (out) MB."""
        g = trace(lambda x, w: x[:500] @ w, SQ, SQ)
        assert one(g, "StridedSlice").materialised
        assert estimate(g).peak_bytes == 12 * MB


# --- elementwise fusion ----------------------------------------------------------------------


class TestElementwise:
    def test_chain_of_big_elementwise_ops_is_fused(self):
        """Ten elementwise ops on [1000, 1000] are one fusion: 4 MB in, 4 MB out, nothing between,
        although the intermediates total 36 MB."""
        def fn(x):
            for _ in range(5):
                x = tf.sin(x) * 1.5
            return x

        g = trace(fn, SQ)
        assert not any(i.materialised for t in ("Sin", "Mul") for i in infos(g, t)[:-1])
        assert estimate(g).peak_bytes == 8 * MB

    def test_expensive_op_read_by_two_fusions_is_materialised(self):
        """y = exp(x) read by sin(y) and cos(y), both outputs: exp is computed once (4 MB), and the
        last reader writes its output over it, so the total is 4 (x) + 8 (outputs) = 12 MB."""
        g = trace(lambda x: (lambda y: (tf.sin(y), tf.cos(y)))(tf.exp(x)), SQ)
        info = one(g, "Exp")
        assert info.materialised and "read by 2 fusions" in info.reason
        assert estimate(g).peak_bytes == 12 * MB

    def test_cheap_op_read_by_two_fusions_is_duplicated(self):
        """y = 2 x read by exp(y) and sin(y): the multiply is recomputed in both fusions."""
        g = trace(lambda x: (lambda y: (tf.exp(y), tf.sin(y)))(x * 2.0), SQ)
        assert not one(g, "Mul").materialised
        assert estimate(g).peak_bytes == 12 * MB

    def test_expensive_op_into_broadcast_is_materialised(self):
        """exp(b)[:, None] + y[None], b [100000], y [10]: exp(b) (400 kB) is read 10 times per
        element, so XLA computes it first: 400,000 + 40 + 400,000 + 4,000,000 = 4,800,040 bytes."""
        g = trace(lambda b, y: tf.exp(b)[:, None] + y[None], spec(100000), spec(10))
        assert one(g, "Exp").materialised
        assert estimate(g).peak_bytes == 4_800_040

    def test_division_by_constant_and_integer_power_are_cheap(self):
        """``x / 3`` and ``x ** 2`` become multiplies in XLA (cheap); ``x / y`` and ``x ** 0.5`` do not."""
        g = trace(lambda x, y: (x / 3.0, x / y, x ** 2, x ** 0.5), spec(4), spec(4))
        found = sorted((op.type, op.inputs[1].op.type == "Const", RULES[op.type].is_expensive(op))
                       for op in g.get_operations() if op.type in ("RealDiv", "Pow"))
        assert found == [("Pow", True, False), ("Pow", True, True), ("RealDiv", False, True), ("RealDiv", True, False)]


# --- reductions -------------------------------------------------------------------------------


class TestReductions:
    def test_float32_sum_reads_its_operand_from_memory(self):
        """sum(exp(x), -1), f32 [1000, 8]: YNNPACK needs exp(x) in memory:
        32,000 (x) + 32,000 (exp) + 4,000 (out) = 68,000 bytes."""
        g = trace(lambda x: tf.reduce_sum(tf.exp(x), -1), spec(1000, 8))
        assert "YNNPACK" in one(g, "Exp").reason
        assert estimate(g).peak_bytes == 68_000

    def test_float64_sum_over_a_short_axis_keeps_producers(self):
        """The same in f64: a loop reduction over 8 <= 32 elements: 64,000 + 8,000 bytes."""
        g = trace(lambda x: tf.reduce_sum(tf.exp(x), -1), spec(1000, 8, dtype=f64))
        assert one(g, "Exp").reason == "fused into `Sum` (Sum)"
        assert estimate(g).peak_bytes == 72_000

    def test_multiply_root_keeps_producers_up_to_32(self):
        """Naive squared distances, N = 300, M = 400, D = 8: XLA keeps the reduction of a multiply
        and fuses the broadcast: (300 + 400) x 8 x 4 + 300 x 400 x 4 = 502,400 (XLA: 502,412)."""
        g = trace(naive_sqdist, spec(300, 8), spec(400, 8))
        assert not one(g, "Pow").materialised and not one(g, "Sub").materialised
        assert estimate(g).peak_bytes == 502_400

    def test_split_reduction_materialises_and_counts_partials(self):
        """D = 64 > 32: XLA splits the sum into reduce-windows of 32 over [300, 400, 64] in memory
        (30,720,000) with partials [300, 400, 2] (960,000): 179,200 + 30,720,000 + 960,000 +
        480,000 = 32,339,200 (XLA: 32,339,228)."""
        g = trace(naive_sqdist, spec(300, 64), spec(400, 64))
        assert one(g, "Pow").materialised
        e = estimate(g)
        assert [b.bytes for b in e.buffers if b.kind == "scratch"] == [960_000]
        assert e.peak_bytes == 32_339_200

    @pytest.mark.parametrize("shape, fused", [((2000, 16, 16), True), ((2000, 4, 40), False)])
    def test_every_reduced_axis_is_compared_with_32(self, shape, fused):
        """f64 sum over axes [1, 2]: 16 x 16 = 256 elements per output still fuse (each axis <= 32);
        an axis of 40 makes XLA split the reduction."""
        g = trace(lambda x: tf.reduce_sum(tf.exp(x), [1, 2]), spec(*shape, dtype=f64))
        assert one(g, "Exp").materialised is not fused

    def test_argmin_keeps_producers_and_converts_indices(self):
        """argmin(exp(x), 1) on [1000, 1000]: one fusion; int32 indices (4,000) converted to the
        int64 output (8,000): 4,000,000 + 4,000 + 8,000 = 4,012,000 (XLA: 4,012,098)."""
        g = trace(lambda x: tf.argmin(tf.exp(x), 1), SQ)
        assert not one(g, "Exp").materialised
        assert estimate(g).peak_bytes == 4_012_000

    def test_loop_reduction_fuses_into_its_reader(self):
        """argmin of naive D = 3 distances [20000, 1000]: the sum fuses into the argmin's fusion,
        so the 80 MB of distances never exist: 252,000 + 80,000 + 160,000 = 492,000 (XLA: 492,078)."""
        g = trace(lambda x, y: tf.argmin(naive_sqdist(x, y), 1), spec(20000, 3), spec(1000, 3))
        assert not one(g, "Sum").materialised
        assert estimate(g).peak_bytes == 492_000

    def test_loop_reduction_read_twice_is_materialised(self):
        g = trace(lambda x: (lambda s: (s * 2.0, s + 1.0))(tf.reduce_sum(tf.exp(x), -1)), spec(1000, 8, dtype=f64))
        info = one(g, "Sum")
        assert info.materialised and "read by 2 fusions" in info.reason

    def test_reduction_of_a_reduction_is_merged(self):
        """sum(naive D = 3 distances, 1), N = 200, M = 300: XLA merges the two sums into one over
        axes {1, 2}; the axis of 300 is split, so [200, 300, 3] is in memory (720,000) with partials
        [200, 10, 1] (8,000): 6,000 + 720,000 + 8,000 + 800 = 734,800."""
        g = trace(lambda x, y: tf.reduce_sum(naive_sqdist(x, y), 1), spec(200, 3), spec(300, 3))
        inner, outer = infos(g, "Sum")
        assert "merged into `Sum`" in inner.reason and outer.materialised
        assert one(g, "Pow").materialised
        assert estimate(g).peak_bytes == 734_800


# --- matmuls and layout -----------------------------------------------------------------------


class TestMatMul:
    def test_operand_of_a_gemm_is_materialised(self):
        """exp(x) @ w, [1000, 1000] each: x, w, exp(x), out: 16 MB."""
        g = trace(lambda x, w: tf.exp(x) @ w, SQ, SQ)
        assert "GEMM" in one(g, "Exp").reason
        assert estimate(g).peak_bytes == 16 * MB

    def test_matmul_chain_holds_two_products(self):
        """((a b) c) d with [500, 500] matrices (1 MB each): t1 = a b, t2 = t1 c, out = t2 d.
        When t2 is computed t1 and t2 are live; when out is computed t2 and out: 4 + 2 = 6 MB."""
        g = trace(lambda a, b, c, d: ((a @ b) @ c) @ d, *[spec(500, 500)] * 4)
        e = estimate(g)
        assert [s.live_bytes for s in e.schedule] == [MB, 2 * MB, 2 * MB]
        assert e.peak_bytes == 6 * MB

    def test_elementwise_after_dot_is_in_place(self):
        """exp(x @ w): exp overwrites the dot's output, which is the program's output: 12 MB."""
        e = estimate(trace(lambda x, w: tf.exp(x @ w), SQ, SQ))
        assert e.peak_bytes == 12 * MB
        assert [b.tensors for b in e.buffers if b.kind == "output"] == [("matmul:0", "Exp:0")]

    def test_transpose_of_last_two_axes_folds_into_dot(self):
        g = trace(lambda x, w: x @ tf.transpose(w), SQ, SQ)
        assert one(g, "Transpose").alias_of == "w:0"
        assert estimate(g).peak_bytes == 12 * MB

    def test_other_transposes_are_copied(self):
        """Heads moved to the front of [512, 8, 64] are copies (1 MB each) before the batched dot;
        scores [8, 512, 512] are 8 MB: 2 + 2 + 8.39 MB = 12,582,912 (XLA: the same)."""
        g = trace(lambda q, k: tf.transpose(q, [1, 0, 2]) @ tf.transpose(k, [1, 2, 0]),
                  spec(512, 8, 64), spec(512, 8, 64))
        assert all(i.materialised for i in infos(g, "Transpose"))
        assert estimate(g).peak_bytes == 12_582_912

    @pytest.mark.parametrize("m, fused", [(3000, True), (5000, False)])
    def test_small_matrix_vector_product_fuses_its_matrix(self, m, fused):
        """exp(a) @ v, v [m, 1]: a 12 kB vector (< 16 KiB) lets XLA emit the product itself with
        exp fused in; a 20 kB one calls a kernel that reads exp(a) from memory."""
        g = trace(lambda a, v: tf.exp(a) @ v, spec(2000, m), spec(m, 1))
        assert one(g, "Exp").materialised is not fused


class TestLayout:
    def test_layout_ops_fuse_with_elementwise_ops(self):
        """concat([x, exp(x)]), pad and gather are loop fusions: no buffer between them."""
        g = trace(lambda x, i: tf.gather(tf.pad(tf.concat([x, tf.exp(x)], 0), [[0, 8], [0, 0]]), i),
                  SQ, spec(500, dtype=tf.int32))
        for op_type in ("Exp", "ConcatV2", "PadV2" if infos(g, "PadV2") else "Pad"):
            assert not one(g, op_type).materialised, op_type

    def test_layout_op_feeding_a_gemm_is_copied(self):
        """concat([x, x]) @ w: the [2000, 1000] concatenation is copied out (8 MB): 4 + 4 + 8 + 8."""
        g = trace(lambda x, w: tf.concat([x, x], 0) @ w, SQ, SQ)
        assert one(g, "ConcatV2").materialised
        assert estimate(g).peak_bytes == 24 * MB


# --- library kernels --------------------------------------------------------------------------


class TestComputedFromConstants:
    """XLA folds what is computed from constants only: a literal where the program's data meets an
    array; one value broadcast stays a broadcast its readers fuse.  XLA's figures, n = 1000 f32."""

    def test_an_identity_added_is_a_literal_of_its_own(self):
        """``x + tf.eye(n)``: x, the n x n literal and the sum, 12 MB (XLA: 12,000,000)."""
        g = trace(lambda x: x + tf.eye(1000), SQ)
        assert estimate(g).peak_bytes == 12 * MB and estimate(g).constant_bytes == 4 * MB
        assert one(g, "MatrixDiagV3").materialised

    def test_the_literal_is_where_data_meets_it(self):
        """``x * band_part(ones, -1, 0)`` and ``tf.where(range >= range, x, -1e9)``: one literal each, of the
        band (4 MB) and of the comparison's booleans (1 MB), none for what they are computed from
        (XLA: 12,000,000 and 9,000,000)."""
        g = trace(lambda x: x * tf.linalg.band_part(tf.ones([1000, 1000]), -1, 0), SQ)
        assert estimate(g).peak_bytes == 12 * MB
        g = trace(lambda x: tf.where(tf.range(1000)[:, None] >= tf.range(1000)[None], x, -1e9), SQ)
        assert estimate(g).peak_bytes == 9 * MB and estimate(g).constant_bytes == 1 * MB

    def test_an_array_over_ten_mebibytes_is_not_folded(self):
        """TensorFlow folds constants of at most 10 MiB: ``x + tf.eye(n)`` at n = 2000 f32 (16 MB) holds x
        and the sum only (XLA: 32,000,000)."""
        g = trace(lambda x: x + tf.eye(2000), spec(2000, 2000))
        assert estimate(g).peak_bytes == 32 * MB and estimate(g).constant_bytes == 0

    def test_a_range_over_a_size_known_only_at_run_time_is_no_literal(self):
        """``tf.range(tf.shape(x)[0])`` of a batch of unknown size, read as 1000 rows by the splitter's
        planning: computed when the function runs, fused, however large its nominal size."""
        g = trace(lambda x: x * tf.cast(tf.range(tf.shape(x)[0]), tf.float32)[:, None], spec(None, 3))
        with shapes.nominal(1000):
            assert estimate(g).constant_bytes == 0

    def test_one_value_broadcast_stays_a_broadcast(self):
        """``x * (tf.ones([n, n]) * 2)``: x and the product only (XLA: 8,000,000)."""
        g = trace(lambda x: x * (tf.ones([1000, 1000]) * 2.0), SQ)
        assert estimate(g).peak_bytes == 8 * MB and estimate(g).constant_bytes == 0


class TestLibrary:
    def test_a_factorisation_computes_a_cheap_operand_as_it_copies_it(self):
        """``cholesky(a * 2)`` needs what ``cholesky(a)`` does, f64 n = 1000: a, the factor and the scratch
        (XLA: 20,187,549 both); ``cholesky(exp(a) + a)`` holds ``exp(a) + a`` too (XLA: 8 MB more)."""
        f64_sq = spec(1000, 1000, dtype=f64)
        plain = estimate(trace(tf.linalg.cholesky, f64_sq)).peak_bytes
        assert estimate(trace(lambda a: tf.linalg.cholesky(a * 2), f64_sq)).peak_bytes == plain
        assert estimate(trace(lambda a: tf.linalg.cholesky(tf.exp(a) + a), f64_sq)).peak_bytes == plain + 8 * MB

    def test_cholesky_scratch(self):
        """f64 n = 256: scratch (256^2 / 4 + 256 x 256) x 8 = 655,360; in 524,288 + out 524,288."""
        g = trace(tf.linalg.cholesky, spec(256, 256, dtype=f64))
        assert estimate(g).peak_bytes == 2 * 524_288 + 655_360

    def test_triangular_solve_scratch(self):
        """A [500, 500], B [500, 2000] f32: scratch max(500 x 2000 + 128 x 500, 500^2 / 2 + 256 x 500)
        = 1,064,000 elements = 4,256,000 bytes; plus A 1 MB, B 4 MB, out 4 MB."""
        g = trace(lambda a, b: tf.linalg.triangular_solve(a, b), spec(500, 500), spec(500, 2000))
        assert estimate(g).peak_bytes == 9 * MB + 4_256_000

    def test_inverse_scratch(self):
        """n = 1000 f32: (3 x 1000^2 + 256 x 1000) x 4 = 13,024,000 beside 4 + 4 MB (XLA: 20,133,036)."""
        assert estimate(trace(tf.linalg.inv, SQ)).peak_bytes == 8 * MB + 13_024_000

    def test_solve_scratch(self):
        """A [1000, 1000] f32 against [1000, 20]: (4 x 1000^2 + 256 x 1000) x 4 = 17,024,000 beside
        4 MB + 80 kB + 80 kB (XLA: 20,227,500)."""
        g = trace(lambda a, b: tf.linalg.solve(a, b), SQ, spec(1000, 20))
        assert estimate(g).peak_bytes == 4 * MB + 160_000 + 17_024_000

    def test_eigh_scratch(self):
        """n = 1000 f32, values and vectors: 27/8 x 1000^2 x 4 = 13,500,000 beside 4 + 4 MB + 4 kB
        (XLA: 21,262,977)."""
        assert estimate(trace(tf.linalg.eigh, SQ)).peak_bytes == 8 * MB + 4_000 + 13_500_000

    def test_svd_scratch_with_and_without_vectors(self):
        """Square n = 1000 f32: 4 n^2 with the vectors (16 MB beside 4 + 8 MB + 4 kB; XLA 28,025,593),
        6 n^2 without (24 MB beside 4 MB + 4 kB); [2000, 500] without: 2 (2000^2 + 2000 x 500 + 500^2)
        elements (42 MB beside 4 MB + 2 kB; XLA 46,019,268)."""
        assert estimate(trace(tf.linalg.svd, SQ)).peak_bytes == 28 * MB + 4_000
        assert estimate(trace(lambda a: tf.linalg.svd(a, compute_uv=False), SQ)).peak_bytes == 28 * MB + 4_000
        assert estimate(trace(lambda a: tf.linalg.svd(a, compute_uv=False),
                              spec(2000, 500))).peak_bytes == 46 * MB + 2_000

    def test_in_top_k_scratch(self):
        """Keras' top-k accuracy on [4096, 1000] f32 scores, k = 5: an s32 comparison of their shape
        and partial sums [4096, 32] beside them, 16,924,672 bytes in all beside the scores' 16,384,000,
        the targets' 16,384 and the output's 4,096 (XLA: 33,329,196); rows of 7 fuse: 4,000."""
        ints = tf.TensorSpec([4096], tf.int32)
        g = trace(lambda p, t: tf.math.in_top_k(t, p, 5), spec(4096, 1000), ints)
        assert estimate(g).peak_bytes == 16_384_000 + 16_384 + 4_096 + 16_924_672
        g = trace(lambda p, t: tf.math.in_top_k(t, p, 5), spec(1000, 7), tf.TensorSpec([1000], tf.int32))
        assert estimate(g).peak_bytes == 28_000 + 4_000 + 1_000 + 4_000

    def test_softmax_is_written_over_its_operand(self):
        """softmax(x @ w): the scores (4 MB) become the output; one row vector of scratch (4 kB):
        8 + 4 + 4,000 = 12,004,000 (XLA: 12,004,024)."""
        g = trace(lambda x, w: tf.nn.softmax(x @ w), SQ, SQ)
        assert estimate(g).peak_bytes == 12_004_000

    def test_top_k_outputs(self):
        """top_k(x, 10) on [1000, 1000]: values and indices, 40 kB each (XLA: 4,080,059)."""
        g = trace(lambda x: tf.math.top_k(x, 10).indices, SQ)
        assert infos(g, "Const")[0].reason == "compile-time operand (axes, shapes)"
        assert estimate(g).peak_bytes == 4_080_000


# --- refusals ---------------------------------------------------------------------------------


class TestUnknown:
    def test_op_without_rule_is_reported_not_guessed(self):
        g = trace(lambda x: tf.math.cumsum(tf.exp(x)), spec(10, 3))
        e = estimate(g)
        assert e.peak_bytes is None and not e.complete
        assert e.unknown_ops == ("Cumsum (Cumsum): no rule",)
        assert one(g, "Cumsum").materialised is None
        assert e.summary().startswith("no estimate: 1 op(s) without a rule: Cumsum")

    def test_rule_table_is_a_parameter(self):
        """With a table that lacks Exp, the same graph has an unknown op; with the full table none."""
        g = trace(lambda x: tf.exp(x) * 2.0, spec(10, 3))
        partial = {k: v for k, v in RULES.items() if k != "Exp"}
        assert estimate(g, partial).unknown_ops == ("Exp (Exp): no rule",)
        assert estimate(g).complete

    def test_while_loop_is_unknown_with_a_reason(self):
        g = trace(lambda x: tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0), [0, x])[1], spec(10))
        (unknown,) = estimate(g).unknown_ops
        assert "While" in unknown and "loop bodies are not modelled" in unknown
        assert "While" not in RULES and "StatelessWhile" not in RULES

    def test_dynamic_shapes_are_reported_not_guessed(self):
        g = trace(lambda x: tf.exp(x) * 2.0, spec(None, 3))
        e = estimate(g)
        assert e.peak_bytes is None and "x:0" in e.dynamic_tensors
        assert annotate(g)["x:0"].bytes is None and annotate(g)["x:0"].shape == (None, 3)

    def test_every_rule_is_well_formed(self):
        for op_type, rule in RULES.items():
            assert isinstance(rule.kind, Kind), op_type
            if rule.fuses_operand is not None or rule.scratch is not None:
                assert rule.kind in (Kind.REDUCE, Kind.LIBRARY), op_type
            if rule.bitcast_when is not None or rule.expensive:
                assert rule.kind is Kind.LOOP, op_type


class TestConditionals:
    """A conditional (mixed precision's loss scaling applies the update only where the gradients are
    finite) counted as a kernel: its operands and results, and while it runs the most one of its
    branches holds beyond them, each branch counted by the model on its own graph."""

    def test_a_branch_s_temporaries_are_counted(self):
        def fn(x, p):
            return tf.cond(p > 0, lambda: tf.reduce_sum(tf.exp(x @ x)), lambda: tf.reduce_sum(x))

        specs = (spec(1000, 1000), spec())
        e = estimate(trace(fn, *specs))
        assert e.complete, e.reason
        xla = tf_memsafe.memory_footprint(tf.function(fn), *specs, rewrite=False)
        assert 0.95 <= e.peak_bytes / xla <= 1.05, (e.peak_bytes, xla)
        assert e.peak_bytes >= 2 * 4 * 10**6        # x, and the product in the branch

    def test_variables_only_its_branches_read_or_write_are_arguments(self):
        s, v = tf.Variable(tf.zeros([1000, 1000])), tf.Variable(tf.zeros([1000, 1000]))

        def fn(x, p):
            def apply():
                s.assign_add(x)
                v.assign_sub(0.1 * s * s)
                return tf.constant(1.0)

            return tf.cond(p > 0, apply, lambda: tf.constant(0.0)) + tf.reduce_sum(x)

        specs = (spec(1000, 1000), spec())
        e = estimate(trace(fn, *specs))
        assert e.complete and e.parameter_bytes >= 12 * 10**6, (e.reason, e.parameter_bytes)   # x, s and v
        xla = tf_memsafe.memory_footprint(tf.function(fn), *specs, rewrite=False)
        # (never under: the variables' new values counted as the conditional's results; 16 MB by XLA)
        assert 1.0 <= e.peak_bytes / xla <= 1.3, (e.peak_bytes, xla)

    def test_a_branch_the_model_cannot_count_leaves_the_conditional_unknown(self):
        g = trace(lambda x, p: tf.cond(p > 0, lambda: tf.math.cumsum(x), lambda: x), spec(10), spec())
        (unknown,) = estimate(g).unknown_ops
        assert "If" in unknown and "Cumsum (Cumsum): no rule" in unknown, unknown


class TestAnnotate:
    def test_keys_reasons_and_no_mutation(self):
        g = trace(lambda x, w: tf.nn.relu(x @ w + 1.0), spec(4, 3), spec(3, 5))
        before = graph_fingerprint(g)
        info = annotate(g)
        assert graph_fingerprint(g) == before
        assert set(info) == {t.name for op in g.get_operations() for t in op.outputs}
        assert info["matmul:0"].shape == (4, 5) and info["matmul:0"].bytes == 80
        assert info["add:0"].reason == "fused into `Relu` (Relu)"
        assert all(i.reason and "\n" not in i.reason for i in info.values())


# --- the planner's hook -----------------------------------------------------------------------


def _toy_estimate() -> Estimate:
    """x [1000, 8] parameter (32 kB); t [1000, 500] temp at steps 0-1 (2 MB); out [1000] output
    from step 1 (4 kB); scratch of 100 bytes at step 1.  Peak at step 1: 32,000 + 2,004,100."""
    buffers = (
        Buffer("x:0", "parameter", 32_000, (1000, 8), 0, 0, ("x:0",)),
        Buffer("t:0", "temp", 2_000_000, (1000, 500), 0, 1, ("t:0",)),
        Buffer("out:0", "output", 4_000, (1000,), 1, 1, ("out:0",)),
        Buffer("k (scratch)", "scratch", 100, (), 1, 1, ()),
    )
    return Estimate(2_036_100, 32_000, 0, 4_000, 2_004_100, "k", (), (), buffers,
                    (Step("t", "MatMul", 2_000_000), Step("k", "Sum", 2_004_100)))


class TestBytesForChunk:
    def test_scales_the_split_tensors_only(self):
        """Cutting rows of x, t and out to 100 of 1000: 3,200 + 200,000 + 400 + 100 (scratch kept)."""
        est = _toy_estimate()
        assert bytes_for_chunk(est, {"x:0": 0, "t:0": 0, "out:0": 0}, 100) == 3_200 + 200_000 + 400 + 100
        assert bytes_for_chunk(est, {"t:0": 1}, 50) == 32_000 + 200_000 + 4_000 + 100

    def test_full_chunk_gives_the_estimate(self):
        e = estimate(trace(naive_sqdist, spec(300, 64), spec(400, 64)))
        split = {"x:0": 0, "pow:0": 0, "Sum:0": 0}
        assert bytes_for_chunk(e, split, 300) == e.peak_bytes

    def test_chunk_of_a_real_graph(self):
        """Rows of x, of the [300, 400, 64] squares and of the output cut to 30 of 300: 7,680 (x) +
        102,400 (y, whole) + 3,072,000 + 48,000 + the partials kept whole (960,000)."""
        e = estimate(trace(naive_sqdist, spec(300, 64), spec(400, 64)))
        got = bytes_for_chunk(e, {"x:0": 0, "pow:0": 0, "Sum:0": 0}, 30)
        assert got == 7_680 + 102_400 + 3_072_000 + 48_000 + 960_000

    @settings(max_examples=50, deadline=None)
    @given(a=st.integers(1, 1000), b=st.integers(1, 1000))
    def test_monotone_in_the_chunk(self, a, b):
        est = _toy_estimate()
        split = {"x:0": 0, "t:0": 0}
        lo, hi = sorted((a, b))
        assert bytes_for_chunk(est, split, lo) <= bytes_for_chunk(est, split, hi) <= est.peak_bytes

    def test_refuses_incomplete_estimates_and_bad_chunks(self):
        incomplete = dataclasses.replace(_toy_estimate(), peak_bytes=None, reason="1 op(s) without a rule")
        with pytest.raises(ValueError, match="incomplete"):
            bytes_for_chunk(incomplete, {}, 1)
        with pytest.raises(ValueError, match="exceeds"):
            bytes_for_chunk(_toy_estimate(), {"t:0": 0}, 1001)
        with pytest.raises(ValueError, match="at least 1"):
            bytes_for_chunk(_toy_estimate(), {}, 0)


# --- agreement with XLA -----------------------------------------------------------------------


def _attention(q, k, v):
    return tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 8.0) @ v


def _multi_head_attention(x, wq, wk, wv):
    b, n, d = x.shape

    def heads(t):                                                        # [B, H, L, D / H]
        return tf.transpose(tf.reshape(t, [b, n, 8, d // 8]), [0, 2, 1, 3])

    q, k, v = (heads(tf.einsum("bld,de->ble", x, w)) for w in (wq, wk, wv))
    out = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 8.0) @ v    # [B, H, L, D / H]
    return tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [b, n, d])


def _sgpr(x, z, y):
    """The bound's core: Kuu, Kuf, two Cholesky factors and two triangular solves, in f64."""
    m = z.shape[0]
    kuu = tf.exp(-0.5 * naive_sqdist(z, z)) + 1e-6 * tf.eye(m, dtype=z.dtype)   # [M, M]
    kuf = tf.exp(-0.5 * naive_sqdist(z, x))                                     # [M, N]
    a = tf.linalg.triangular_solve(tf.linalg.cholesky(kuu), kuf) / 0.1          # [M, N]
    lb = tf.linalg.cholesky(tf.eye(m, dtype=z.dtype) + a @ tf.transpose(a))     # [M, M]
    c = tf.linalg.triangular_solve(lb, a @ y) / 0.1                             # [M, 1]
    return tf.reduce_sum(tf.math.log(tf.linalg.diag_part(lb))) + tf.reduce_sum(c * c)


def _gp_solve(x, y, noise):
    """A GP's negative log marginal likelihood written with ``tf.linalg.solve`` and ``logdet``, f64."""
    k = tf.exp(-0.5 * naive_sqdist(x, x)) + noise * tf.eye(x.shape[0], dtype=x.dtype)        # [N, N]
    return 0.5 * tf.reduce_sum(y * tf.linalg.solve(k, y)) + 0.5 * tf.linalg.logdet(k)


def _spectral(a):
    """Eigenvalues and singular values of a symmetric matrix and of a tall one built from it."""
    s = a + tf.transpose(a)
    return tf.reduce_sum(tf.linalg.eigvalsh(s)) + tf.reduce_sum(tf.linalg.svd(tf.concat([s, a], 0), compute_uv=False))


WORKLOADS = {
    "naive distance D=3": (naive_sqdist, [spec(2000, 3), spec(3000, 3)]),
    "naive distance D=64": (naive_sqdist, [spec(300, 64), spec(400, 64)]),
    "matmul distance D=64": (sqdist_matmul, [spec(2000, 64), spec(3000, 64)]),
    "kNN distance + top_k": (lambda x, y: tf.math.top_k(-sqdist_matmul(x, y), 10).indices,
                             [spec(2000, 64), spec(3000, 64)]),
    "naive distance + argmin": (lambda x, y: tf.argmin(naive_sqdist(x, y), 1), [spec(20000, 3), spec(1000, 3)]),
    "matmul chain": (lambda a, b, c: (a @ b) @ c, [spec(1000, 2000), spec(2000, 500), spec(500, 1000)]),
    "softmax attention": (_attention, [spec(4, 512, 64)] * 3),
    "multi-head attention": (_multi_head_attention, [spec(2, 512, 256)] + [spec(256, 256)] * 3),
    "SGPR Cholesky + solves f64": (_sgpr, [spec(5000, 5, dtype=f64), spec(300, 5, dtype=f64),
                                           spec(5000, 1, dtype=f64)]),
    "GP solve + logdet f64": (_gp_solve, [spec(1000, 5, dtype=f64), spec(1000, 1, dtype=f64), spec(dtype=f64)]),
    "eigenvalues + SVD": (_spectral, [spec(600, 600)]),
    "reductions of products": (lambda a, b: tf.reduce_sum(a * b, 1) + tf.reduce_sum(tf.exp(a) * b, 0)[:1],
                               [spec(2000, 1000)] * 2),
    "MLP layer": (lambda x, w1, b1, w2, b2: tf.nn.relu(x @ w1 + b1) @ w2 + b2,
                  [spec(4096, 512), spec(512, 1024), spec(1024), spec(1024, 256), spec(256)]),
    "layer norm": (lambda x: (lambda m: (x - m) * tf.math.rsqrt(tf.reduce_mean((x - m) ** 2, -1, keepdims=True)
                                                                + 1e-5))(tf.reduce_mean(x, -1, keepdims=True)),
                   [spec(4096, 512)]),
}

# Measured on TensorFlow 2.21, XLA:CPU (estimate / XLA's "Total bytes used"):
#
#   workload                        estimate (B)    XLA (B)     ratio   where they differ
#   naive distance D=3                24,060,000    24,060,012  1.000
#   naive distance D=64               32,339,200    32,339,228  1.000
#   matmul distance D=64              25,300,000    26,576,052  0.952   XLA holds x*x, y*y beside the dot (scheduler)
#   kNN distance + top_k              25,440,000    26,656,111  0.954   the same (scheduler)
#   naive distance + argmin              492,000       492,078  1.000
#   matmul chain                      20,000,000    20,000,000  1.000
#   softmax attention                  9,969,664    10,485,800  0.951   XLA gives the 0.5 MB output its own memory
#   multi-head attention              36,470,784    37,486,632  0.973   XLA runs the 3 projections first (scheduler)
#   SGPR Cholesky + solves f64        38,724,000    36,518,238  1.060   fitted triangular-solve scratch (the two
#                                                                       tf.eye literals, 720 kB each, counted by both)
#   GP solve + logdet f64             50,104,008    55,779,285  0.898   XLA interleaves the solve's LU with the
#                                                                       Cholesky and packs a 38.6 MB peak into 47.7 MB
#   eigenvalues + SVD                 21,602,404    21,613,689  0.999
#   reductions of products            24,264,000    32,260,052  0.752   XLA computes both products before either sum
#   MLP layer                         32,510,976    32,510,976  1.000
#   layer norm                        17,072,128    17,055,784  1.001
#
# The band [0.7, 1.1] is the measured range with a margin of about 0.05: below 1, XLA's
# scheduler can hold more temporaries at once than TF's creation order (0.75 is the worst seen);
# above 1, only the fitted library scratch overshoots (1.06 here, 1.04 for a lone inverse).  Eight
# of the fourteen are within 1%, and all but the three explained above within 5%.
BAND = (0.7, 1.1)


class TestAgainstXLA:
    """The model against XLA's buffer assignment (compile only, no run)."""

    @pytest.fixture(scope="class")
    @classmethod
    def ratios(cls):
        tf_memsafe.disable()
        found = {}
        for name, (fn, specs) in WORKLOADS.items():
            e = estimate(trace(fn, *specs))
            assert e.complete, f"{name}: {e.reason}"
            xla = tf_memsafe.memory_footprint(fn, *specs, rewrite=False)
            found[name] = e.peak_bytes / xla
        return found

    def test_ratio_band(self, ratios):
        outside = {k: round(r, 3) for k, r in ratios.items() if not BAND[0] <= r <= BAND[1]}
        assert not outside, f"estimate / XLA outside {BAND}: {outside}"

    def test_most_are_within_five_percent(self, ratios):
        far = {k for k, r in ratios.items() if not 0.95 <= r <= 1.05}
        explained = {"reductions of products", "GP solve + logdet f64", "SGPR Cholesky + solves f64"}
        assert far <= explained, {k: round(r, 3) for k, r in ratios.items()}


def test_a_graph_not_edited_since_is_not_analysed_again_within_a_journaled_run(monkeypatch):
    """The hook, the guard and the splitter each ask for the program as traced: one analysis."""
    from grappler_ext import graph_edit, memory_model

    g = tf.function(lambda a: tf.reduce_sum(tf.exp(a) * 2.0), jit_compile=True).get_concrete_function(
        tf.TensorSpec([100, 100])).graph
    runs = []
    real = memory_model._analyse
    monkeypatch.setattr(memory_model, "_analyse", lambda *a: (runs.append(1), real(*a))[1])
    with graph_edit.journaled(graph_edit.Journal()):
        first = memory_model.analyse(g)
        assert memory_model.analyse(g) is first and len(runs) == 1
        exp = next(op for op in g.get_operations() if op.type == "Exp")
        graph_edit.replace_uses(exp.outputs[0], exp.inputs[0])         # an edit: analysed again
        after = memory_model.analyse(g)
        assert len(runs) == 2 and after is not first
        assert memory_model.analyse(g, dict(memory_model.RULES)) is not after and len(runs) == 3   # other rules
    memory_model.analyse(g)                                            # outside a journaled run: always
    memory_model.analyse(g)
    assert len(runs) == 5
