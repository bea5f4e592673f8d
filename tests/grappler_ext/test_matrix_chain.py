"""matrix_chain: fires on chains written in a costly order, only there, and keeps the value.

FLOPs count 2 m k n for a [m, k] x [k, n] product (chain_order's convention); bytes are those of
the largest intermediate product, float32 in the golden cases.  The memory case, worked out:
(A B) v with A [2000, 10], B [10, 2000], v [2000, 1] materialises A B, [2000, 2000] x 4 B = 16 MB;
A (B v) needs B v, [10, 1] = 40 B, next to 160 kB of inputs.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.matrix_chain import EinsumForm, MatrixChain, einsum_form, einsum_transposes
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import assert_graph_text, format_graph
from tf_memsafe import hook

S = tf.TensorSpec
TOL = {tf.float32: dict(rtol=1e-5, atol=1e-4), tf.float64: dict(rtol=1e-12, atol=1e-11)}


def pipeline():
    return hook.use_pipeline(Pipeline([MatrixChain()]))


def records(action=None):
    return [r for rep in tf_memsafe.reports() for r in rep.records if action in (None, r.action)]


def trace(fn, *specs, jit=True):
    """The graph of ``fn`` traced with the pass."""
    tf_memsafe.enable("1GB", strict=True, rewrite_non_jit=True)
    with pipeline():
        return tf.function(fn, jit_compile=jit).get_concrete_function(*specs).graph


def trace_plain(fn, *specs):
    return tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph


def random_inputs(specs, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.standard_normal(s.shape), dtype) for s in specs]


class FiringCase:
    """A chain the pass must rewrite.  Subclasses give ``fn``, ``specs`` (float32), the golden text
    of the rewritten graph, the FLOPs and the largest intermediate's bytes before and after."""

    fn = None
    specs = ()
    golden = ""
    flops = (0, 0)
    bytes = (0, 0)

    def test_structure(self):
        assert_graph_text(trace(self.fn, *self.specs), self.golden)
        (record,) = records("rewritten")
        assert f"{self.flops[0]:,} -> {self.flops[1]:,} FLOPs" in record.reason
        assert (record.bytes_before, record.bytes_after) == self.bytes

    @pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
    @pytest.mark.parametrize("jit", [True, False])
    def test_numerics_forward_and_gradients(self, dtype, jit):
        values = random_inputs(self.specs, dtype)

        def value_and_grads(f):
            variables = [tf.Variable(v) for v in values]
            with tf.GradientTape() as tape:
                out = f(*variables)
                loss = tf.reduce_sum(tf.sin(out))
            return out, tape.gradient(loss, variables)

        expected, expected_grads = value_and_grads(tf.function(self.fn, jit_compile=jit))
        tf_memsafe.enable("1GB", strict=True, rewrite_non_jit=True)
        with pipeline():
            got, got_grads = value_and_grads(tf.function(self.fn, jit_compile=jit))
        assert len(records("rewritten")) == 1
        np.testing.assert_allclose(got, expected, **TOL[dtype])
        for g, e in zip(got_grads, expected_grads):
            if e is None:  # the output does not depend on this input (the backward case's A)
                assert g is None
                continue
            np.testing.assert_allclose(g, e, **TOL[dtype])

    def test_idempotent(self):
        g = trace(self.fn, *self.specs)
        once = format_graph(g)
        result = Pipeline([MatrixChain()]).run(g, tf_memsafe.get_options())
        assert not result.changed
        assert format_graph(g) == once


class TestKernelSquaredTimesVector(FiringCase):
    """The GP pattern (K K) v => K (K v); K [8, 8], v [8, 1].

    Before: K K 2*8*8*8 = 1,024 FLOPs, [8, 8] = 256 B; then [8, 8] x [8, 1] 128: 1,152 FLOPs.
    After: K v 128, [8, 1] = 32 B; K (K v) 128: 256 FLOPs.  K is a leaf twice.
    """

    fn = staticmethod(lambda k, v: (k @ k) @ v)
    specs = (S([8, 8]), S([8, 1]))
    flops, bytes = (1_152, 256), (256, 32)
    golden = """
        %0 = Placeholder f32[8,8] ()
        %1 = Placeholder f32[8,1] ()
        %2 = MatMul f32[8,1] (%0, %1)
        %3 = MatMul f32[8,1] (%0, %2)
        %4 = Identity f32[8,1] (%3)
        return %4
    """


class TestEinsumMatrixVector(FiringCase):
    """(A B) v spelled with einsums, 'ij,j->i' of 'ik,kj->ij' (issue 29): the vector is the column
    [8, 1] to the cost model, built with an ExpandDims and the result's unit axis dropped.

    Before: A B 2*8*3*8 = 384 FLOPs, [8, 8] = 256 B; (A B) v 2*8*8 = 128: 512 FLOPs.
    After: B v 2*3*8 = 48, [3, 1] = 12 B; A (B v) 48: 96 FLOPs.
    """

    fn = staticmethod(lambda a, b, v: tf.einsum("ij,j->i", tf.einsum("ik,kj->ij", a, b), v))
    specs = (S([8, 3]), S([3, 8]), S([8]))
    flops, bytes = (512, 96), (256, 12)
    golden = """
        %0 = Placeholder f32[8,3] ()
        %1 = Placeholder f32[3,8] ()
        %2 = Placeholder f32[8] ()
        %3 = Const i32[] = -1
        %4 = ExpandDims f32[8,1] (%2, %3)
        %5 = MatMul f32[3,1] (%1, %4)
        %6 = MatMul f32[8,1] (%0, %5)
        %7 = Const i32[1] = [8]
        %8 = Reshape f32[8] (%6, %7)
        %9 = Identity f32[8] (%8)
        return %9
    """


class TestEinsumDotThroughATranspose(FiringCase):
    """vᵀ (A B)ᵀ v: the dot 'i,i->' of v with 'ij,j->i' of tf.transpose(A @ B).  The Transpose op
    flips the interior product's flag: vᵀ Bᵀ Aᵀ v, ordered (vᵀ Bᵀ)(Aᵀ v) with no [8, 8] product.

    Before: A B 384 FLOPs, [8, 8] = 256 B; (A B)ᵀ v 128; vᵀ(..) 16: 528 FLOPs.
    After: vᵀ Bᵀ 48, [1, 3]; Aᵀ v 48, [3, 1] = 12 B; their dot 6: 102 FLOPs.
    """

    fn = staticmethod(lambda a, b, v: tf.einsum("i,i->", v, tf.einsum("ij,j->i", tf.transpose(a @ b), v)))
    specs = (S([8, 3]), S([3, 8]), S([8]))
    flops, bytes = (528, 102), (256, 12)
    golden = """
        %0 = Placeholder f32[8,3] ()
        %1 = Placeholder f32[3,8] ()
        %2 = Placeholder f32[8] ()
        %3 = Const i32[] = -1
        %4 = ExpandDims f32[8,1] (%2, %3)
        %5 = MatMul{transpose_a=true,transpose_b=true} f32[1,3] (%4, %1)
        %6 = Const i32[] = -1
        %7 = ExpandDims f32[8,1] (%2, %6)
        %8 = MatMul{transpose_a=true} f32[3,1] (%0, %7)
        %9 = MatMul f32[1,1] (%5, %8)
        %10 = Const i32[0] = []
        %11 = Reshape f32[] (%9, %10)
        %12 = Identity f32[] (%11)
        return %12
    """


class TestTransposedInterior(FiringCase):
    """(A B)^T c = B^T (A^T c); A [8, 3], B [3, 8], c [8, 1]: the transposed interior product
    reverses its factors, each transposed, and the flags land on the new MatMuls.

    Before: A B 2*8*3*8 = 384 FLOPs, [8, 8] = 256 B; (A B)^T c 2*8*8*1 = 128: 512 FLOPs.
    After: A^T c 2*3*8*1 = 48, [3, 1] = 12 B; B^T (A^T c) 2*8*3*1 = 48: 96 FLOPs.
    """

    fn = staticmethod(lambda a, b, c: tf.matmul(a @ b, c, transpose_a=True))
    specs = (S([8, 3]), S([3, 8]), S([8, 1]))
    flops, bytes = (512, 96), (256, 12)
    golden = """
        %0 = Placeholder f32[8,3] ()
        %1 = Placeholder f32[3,8] ()
        %2 = Placeholder f32[8,1] ()
        %3 = MatMul{transpose_a=true} f32[3,1] (%0, %2)
        %4 = MatMul{transpose_a=true} f32[8,1] (%1, %3)
        %5 = Identity f32[8,1] (%4)
        return %5
    """


class TestTransposedLeaves(FiringCase):
    """(A^T B) c^T => A^T (B c^T); A [3, 8], B [3, 8], c [1, 8]: leaf flags are kept.

    Before: A^T B 2*8*3*8 = 384 FLOPs, [8, 8] = 256 B; times c^T 2*8*8*1 = 128: 512 FLOPs.
    After: B c^T 2*3*8*1 = 48, [3, 1] = 12 B; A^T (B c^T) 48: 96 FLOPs.
    """

    fn = staticmethod(lambda a, b, c: tf.matmul(tf.matmul(a, b, transpose_a=True), c, transpose_b=True))
    specs = (S([3, 8]), S([3, 8]), S([1, 8]))
    flops, bytes = (512, 96), (256, 12)
    golden = """
        %0 = Placeholder f32[3,8] ()
        %1 = Placeholder f32[3,8] ()
        %2 = Placeholder f32[1,8] ()
        %3 = MatMul{transpose_b=true} f32[3,1] (%1, %2)
        %4 = MatMul{transpose_a=true} f32[8,1] (%0, %3)
        %5 = Identity f32[8,1] (%4)
        return %5
    """


class TestFourFactors(FiringCase):
    """(A B)(C d) => A (B (C d)); A [8, 3], B [3, 8], C [8, 8], d [8, 1].

    Before: A B 384 FLOPs ([8, 8] = 256 B), C d 128 ([8, 1]), their product 128: 640 FLOPs.
    After: C d 128 ([8, 1] = 32 B), B (C d) 2*3*8 = 48 ([3, 1]), A (..) 48: 224 FLOPs.
    """

    fn = staticmethod(lambda a, b, c, d: (a @ b) @ (c @ d))
    specs = (S([8, 3]), S([3, 8]), S([8, 8]), S([8, 1]))
    flops, bytes = (640, 224), (256, 32)
    golden = """
        %0 = Placeholder f32[8,3] ()
        %1 = Placeholder f32[3,8] ()
        %2 = Placeholder f32[8,8] ()
        %3 = Placeholder f32[8,1] ()
        %4 = MatMul f32[8,1] (%2, %3)
        %5 = MatMul f32[3,1] (%1, %4)
        %6 = MatMul f32[8,1] (%0, %5)
        %7 = Identity f32[8,1] (%6)
        return %7
    """


class TestBatchedEinsumAndAdjoint(FiringCase):
    """einsum('bji,bjk->bik', A, B) C^H => A^T (B C^T) per batch; A, B [2, 3, 8], C [2, 1, 8] (real:
    the adjoint is the transpose).  The Einsum is a plain batch matmul with a transposed first operand.

    Before: A^T B 2*2*8*3*8 = 768 FLOPs, [2, 8, 8] = 512 B; times C^T 2*2*8*8*1 = 256: 1,024 FLOPs.
    After: B C^T 2*2*3*8*1 = 96, [2, 3, 1] = 24 B; A^T (B C^T) 96: 192 FLOPs.
    """

    fn = staticmethod(lambda a, b, c: tf.matmul(tf.einsum("bji,bjk->bik", a, b), c, adjoint_b=True))
    specs = (S([2, 3, 8]), S([2, 3, 8]), S([2, 1, 8]))
    flops, bytes = (1_024, 192), (512, 24)
    golden = """
        %0 = Placeholder f32[2,3,8] ()
        %1 = Placeholder f32[2,3,8] ()
        %2 = Placeholder f32[2,1,8] ()
        %3 = BatchMatMulV2{adj_y=true} f32[2,3,1] (%1, %2)
        %4 = BatchMatMulV2{adj_x=true} f32[2,8,1] (%0, %3)
        %5 = Identity f32[2,8,1] (%4)
        return %5
    """


def _grad_inside(a, b, c):
    with tf.GradientTape() as tape:
        tape.watch(a)
        y = tf.reduce_sum((a @ b) @ c)
    return tape.gradient(y, a)


class TestBackwardChainInsideTheFunction(FiringCase):
    """d/dA sum((A B) c) = (1 c^T) B^T with 1 [8, 1] of ones, taken inside the function; A [8, 3],
    B [3, 8], c [8, 1].  The forward products are dead (only the gradient is returned); the backward
    chain is re-associated: 1 c^T 2*8*1*8 = 128 FLOPs ([8, 8] = 256 B), times B^T 2*8*8*3 = 384: 512;
    after, c^T B^T 2*1*8*3 = 48 ([1, 3] = 12 B), 1 (c^T B^T) 48: 96 FLOPs."""

    fn = staticmethod(_grad_inside)
    specs = (S([8, 3]), S([3, 8]), S([8, 1]))
    flops, bytes = (512, 96), (256, 12)
    golden = """
        %0 = Placeholder f32[3,8] ()
        %1 = Placeholder f32[8,1] ()
        %2 = Const f32[] = 1.0
        %3 = Const i32[2] = [1, 1]
        %4 = Reshape f32[1,1] (%2, %3)
        %5 = Const i32[2] = [8, 1]
        %6 = Tile f32[8,1] (%4, %5)
        %7 = MatMul{transpose_a=true,transpose_b=true} f32[1,3] (%1, %0)
        %8 = MatMul f32[8,3] (%6, %7)
        %9 = Identity f32[8,3] (%8)
        return %9
    """


def test_two_chains_fire_and_the_second_reads_the_first_rewritten():
    """kv = (K K) v is returned and also starts the chain (kv r) s, r [1, 8], s [8, 1]: kv is a leaf
    there (it has another consumer).  Both chains are rewritten: (K K) v 1,152 -> 256 FLOPs, and
    (kv r) s 2*8*1*8 + 2*8*8*1 = 256 -> kv (r s) 2*1*8*1 + 2*8*1*1 = 32 FLOPs.  The second chain must
    read the first one's new result: no [8, 8] product is left."""

    def fn(k, v, r, s):
        kv = (k @ k) @ v
        return (kv @ r) @ s, kv

    g = trace(fn, S([8, 8]), S([8, 1]), S([1, 8]), S([8, 1]))
    rewritten = records("rewritten")
    assert len(rewritten) == 2
    assert sorted(r.bytes_before for r in rewritten) == [256, 256]
    text = format_graph(g)
    assert text.count("= MatMul") == 4
    assert "MatMul f32[8,8]" not in text


class TestMustNotFire:
    def unchanged(self, fn, *specs):
        """Trace ``fn`` with the pass; assert the graph is exactly what tracing without it gives."""
        plain = format_graph(trace_plain(fn, *specs))
        assert format_graph(trace(fn, *specs)) == plain
        assert records("rewritten") == []
        return records()

    def test_already_optimal(self):
        """K (K v): 256 FLOPs, the fewest; (K K) v would cost 1,152."""
        (rec,) = self.unchanged(lambda k, v: k @ (k @ v), S([8, 8]), S([8, 1]))
        assert "already optimal order (0 (1 2)): 256 FLOPs" in rec.reason
        assert rec.bytes_before == 32

    def test_equal_flops_smaller_intermediate_is_not_enough(self):
        """d = [2, 3, 6, 3]: both orders cost 144 FLOPs; A (B C) has the smaller intermediate
        ([3, 3] = 36 B against [2, 6] = 48 B), but no FLOP is gained, so the written order stays."""
        (rec,) = self.unchanged(lambda a, b, c: (a @ b) @ c, S([2, 3]), S([3, 6]), S([6, 3]))
        assert "already optimal order" in rec.reason

    def test_cheaper_order_with_a_larger_intermediate(self):
        """d = [10, 1, 10, 200]: A (B C) needs 8,000 FLOPs against 40,200, but its intermediate
        [1, 200] = 800 B is larger than A B's [10, 10] = 400 B."""
        (rec,) = self.unchanged(lambda a, b, c: (a @ b) @ c, S([10, 1]), S([1, 10]), S([10, 200]))
        assert "larger intermediate (800 > 400 B)" in rec.reason

    def test_interior_product_with_another_consumer(self):
        """(A B) c would be rewritten ((A B) c 512 -> 96 FLOPs, as in TestTransposedInterior), but
        A B is also summed: it must exist anyway, so the chain stops at it."""

        def fn(a, b, c):
            p = a @ b
            return p @ c + tf.reduce_sum(p)

        (rec,) = self.unchanged(fn, S([8, 3]), S([3, 8]), S([8, 1]))
        assert "has another consumer" in rec.reason and "leaving 2 factors" in rec.reason

    def test_interior_product_is_returned(self):
        def fn(a, b, c):
            p = a @ b
            return p @ c, p

        (rec,) = self.unchanged(fn, S([8, 3]), S([3, 8]), S([8, 1]))
        assert "has another consumer" in rec.reason

    def test_gradient_inside_the_function_reads_the_intermediate(self):
        """The gradient for c is (A B)^T dy: it reads A B, so the forward chain stops there, and the
        backward products are pairs with an operand that has another reader."""

        def fn(a, b, c):
            with tf.GradientTape() as tape:
                tape.watch([a, b, c])
                y = tf.reduce_sum((a @ b) @ c)
            return y, tape.gradient(y, [a, b, c])

        recs = self.unchanged(fn, S([8, 3]), S([3, 8]), S([8, 1]))
        assert recs and all("has another consumer" in r.reason for r in recs)

    def test_integer_dtype(self):
        (rec,) = self.unchanged(lambda a, b, c: (a @ b) @ c,
                                S([8, 3], tf.int32), S([3, 8], tf.int32), S([8, 1], tf.int32))
        assert "int32 chain: only floating dtypes" in rec.reason

    def test_complex_dtype(self):
        (rec,) = self.unchanged(lambda a, b, c: (a @ b) @ c,
                                S([8, 3], tf.complex64), S([3, 8], tf.complex64), S([8, 1], tf.complex64))
        assert "complex chains are not handled" in rec.reason

    def test_dynamic_shape(self):
        (rec,) = self.unchanged(lambda a, b, c: (a @ b) @ c, S([None, 3]), S([3, 8]), S([8, 1]))
        assert rec.reason.startswith("dynamic shape")

    def test_broadcast_batch(self):
        """[2, 8, 3] x [3, 8] broadcasts the second factor over the batch: refused."""
        (rec,) = self.unchanged(lambda a, b, c: (a @ b) @ c, S([2, 8, 3]), S([3, 8]), S([8, 1]))
        assert "broadcast" in rec.reason

    def test_einsum_that_is_not_a_plain_matmul(self):
        """'ij,kj->ki' is (P c^T)^T: a matmul with a transposed output, which the pass does not read."""
        (rec,) = self.unchanged(lambda a, b, c: tf.einsum("ij,kj->ki", a @ b, c),
                                S([8, 3]), S([3, 8]), S([1, 8]))
        assert "Einsum 'ij,kj->ki') is not a product of matrices and vectors" in rec.reason


@pytest.mark.parametrize("equation, flags", [
    ("ij,jk->ik", (False, False)),
    ("ji,jk->ik", (True, False)),
    ("ij,kj->ik", (False, True)),
    ("bji,bkj->bik", (True, True)),
    ("...ij,...jk->...ik", (False, False)),
    ("ij,jk->ki", None),          # transposed output
    ("ij,jk->ijk", None),         # no contraction
    ("bij,cjk->bik", None),       # batch letters differ
    ("ii,ik->ik", None),          # diagonal
    ("ij,jk,kl->il", None),       # three operands
    ("ij,...jk->...ik", None),    # broadcasting ellipsis
    ("ijk,jkl->il", None),        # two contracted letters
])
def test_einsum_transposes(equation, flags):
    assert einsum_transposes(equation) == flags


@pytest.mark.parametrize("equation, form", [
    ("ij,jk->ik", EinsumForm(False, (False, False), (False, False), "matrix")),
    ("ij,j->i", EinsumForm(False, (False, False), (False, True), "vector")),
    ("ji,j->i", EinsumForm(False, (True, False), (False, True), "vector")),
    ("j,jk->k", EinsumForm(True, (True, False), (False, True), "vector")),     # Yᵀ x
    ("j,kj->k", EinsumForm(True, (False, False), (False, True), "vector")),    # Y x
    ("i,i->", EinsumForm(False, (True, False), (True, True), "scalar")),
    ("bij,bj->bi", EinsumForm(False, (False, False), (False, True), "vector")),
    ("...ij,...j->...i", EinsumForm(False, (False, False), (False, True), "vector")),
    ("bj,bj->b", EinsumForm(False, (True, False), (True, True), "scalar")),
    ("ij,k->ik", None),           # no contraction: an outer product
    ("b,bi->bi", None),           # a scaling, not a product
    ("ij,j->ji", None),           # a letter out of nowhere
    ("ij,jk->ki", None),          # transposed output
    ("bij,cj->bi", None),         # batch letters differ
])
def test_einsum_form(equation, form):
    assert einsum_form(equation) == form


def test_footprint_drops_without_the_n_by_n_intermediate():
    """(A B) v, N = 2000, D = 10: 16 MB for A B before; after, inputs (2 x 80 kB + 8 kB) and small
    intermediates."""
    fn = lambda a, b, v: (a @ b) @ v
    specs = (S([2000, 10]), S([10, 2000]), S([2000, 1]))
    tf_memsafe.enable("1GB")
    with pipeline():
        before = tf_memsafe.memory_footprint(fn, *specs, rewrite=False)
        after = tf_memsafe.memory_footprint(fn, *specs)
    assert before >= 2000 * 2000 * 4
    assert after <= (2 * 2000 * 10 + 2 * 2000) * 4 + 4096
