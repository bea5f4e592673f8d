"""combiners: the partial results of the slices, folded in slice order, are the unsplit result.

Every test drives a combiner as :mod:`grappler_ext.splitter.loop` does (see :func:`fold`): ``init``
with one full slice's partial specs, a ``tf.while_loop`` with ``maximum_iterations = L // c`` whose
body computes the root op on ``x[.., i c : i c + c, ..]`` and calls ``step(carry, partials, i, i c)``,
then the root on the remainder slice (``L % c`` long) outside the loop, then ``finish``.  Each case
runs in a ``tf.function`` with and without ``jit_compile=True``, on a split axis of length
``L = 9`` cut into chunks of 3 (divides: three slices), 4 (two slices and a tail of 1), 2 (four
slices and a tail of 1) and 5 (one slice and a tail of 4); top_k has its own length, 16, and
chunks whose slices hold at least k.  The reference is the root op applied to the whole ``x``, run
eagerly; hypothesis varies lengths and chunks (1 and ``L`` included) for sum, concat and arg.

Exactness, per combiner: ``concat``, ``max``/``min``, ``all``/``any``, ``arg`` and ``top_k`` are
compared bit for bit, dtype and shape included; so are integer sums, integer products and floating
products of powers of two (exact in any order).  Floating sums and means reassociate, so they are
held to the standard bound on a summation's rounding, for either order:
``|got - want| <= 2 n eps sum_i |x_i|`` (``n``: the elements of ``x``, at least the terms).

Gradients (``slice_upstream``) are checked as ``splitter.loop._backward`` uses them (see
:func:`split_gradient`): each slice recomputed in a second loop, its partials differentiated with
``tf.gradients`` and the upstream the combiner routes to that slice, the slices' gradients joined
along the split axis; against ``tf.gradients`` of the unsplit root, on random upstream values, in
float64 (mean's in float32: see its xfails).  The backward's chunk may differ from the forward's,
as the splitter plans it.

Regressions guarded here: float64 ``mean`` weights must not be rounded to float32; an integer
``mean`` is refused; ``arg`` after a NaN picks what ``tf.math.argmax`` picks.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tf_memsafe
from grappler_ext.splitter.combiners import (
    REDUCTION_COMBINERS,
    Arg,
    Concat,
    Extremum,
    Group,
    Mean,
    OnlineSoftmax,
    Reduce,
    Sum,
    TopK,
    combiner_for_reduction,
    first_at,
    softmax_partials,
    tie_count,
    value_at,
)
from grappler_ext.splitter.slicing import dynamic_slice, join_slices

F16, F32, F64, BOOL = tf.float16, tf.float32, tf.float64, tf.bool
I8, U8, I32, I64 = tf.int8, tf.uint8, tf.int32, tf.int64
L = 9                   # the split axis' length in the forward cases
CHUNKS = (3, 4, 2, 5)   # divides; tail 1 after 2 slices; tail 1 after 4 slices; tail 4 after 1 slice
MODES = (pytest.param(False, id="graph"), pytest.param(True, id="xla"))


# ---------------------------------------------------------------------------------------------
# The driver: a combiner run exactly as splitter.loop runs it.
# ---------------------------------------------------------------------------------------------

def _partial_specs(partial_fn, shape, dtype) -> list[tf.TensorSpec]:
    """Shapes and dtypes of one full slice's partials (what ``init`` needs), traced in a scratch graph."""
    with tf.Graph().as_default():
        return [tf.TensorSpec(p.shape, p.dtype) for p in partial_fn(tf.zeros(shape, dtype))]


def fold(combiner, partial_fn, x: tf.Tensor, axis: int, chunk: int, arrays: bool = False) -> list[tf.Tensor]:
    """The combined outputs of ``partial_fn`` over the slices of ``x`` along ``axis``, in the current graph.

    As ``splitter.loop.build_split``'s forward: full slices in a while loop with a static trip count
    (offset ``i * chunk`` a tensor), the remainder slice after it, then ``finish``.  ``arrays``: the
    carry a count known only at run time gets (``init``: a concat's slices in ``TensorArray``s).
    """
    steps, tail = divmod(x.shape[axis], chunk)
    slice_shape = x.shape.as_list()
    slice_shape[axis] = chunk
    specs = _partial_specs(partial_fn, slice_shape, x.dtype)
    carry0 = combiner.init(specs, steps) if arrays else combiner.initial(specs, steps, None, tail)

    def body(i, *carry):
        offset = i * chunk
        partials = partial_fn(dynamic_slice(x, axis, offset, chunk))
        return (i + 1, *combiner.step(list(carry), partials, i, offset))

    result = tf.while_loop(lambda i, *carry: i < steps, body, (tf.constant(0), *carry0),
                           maximum_iterations=steps)
    tail_partials = partial_fn(dynamic_slice(x, axis, steps * chunk, tail)) if tail else None
    return combiner.finish(list(result[1:]), tail_partials, steps * chunk)


def split_apply(combiner, partial_fn, x: np.ndarray, axis: int, chunk: int, jit: bool,
                arrays: bool = False) -> list[np.ndarray]:
    """:func:`fold` in a ``tf.function`` (XLA-compiled when ``jit``), on the array ``x``."""
    fn = tf.function(lambda v: fold(combiner, partial_fn, v, axis, chunk, arrays), jit_compile=jit,
                     autograph=False)
    return [t.numpy() for t in fn(tf.constant(x))]


def split_gradient(combiner, partial_fn, x: np.ndarray, upstream, axis: int, chunk: int, backward_chunk: int,
                   jit: bool) -> tuple[np.ndarray, np.ndarray]:
    """(gradient of the split computation, gradient of the unsplit root) w.r.t. ``x``, given ``upstream``.

    The split one as ``splitter.loop._backward`` builds it: forward by :func:`fold`; then, per slice of
    ``backward_chunk`` (in a while loop, remainder after it), the slice's partials recomputed and
    differentiated w.r.t. the slice with ``grad_ys = slice_upstream(...)``; slices joined along ``axis``.
    """
    upstream = [None if u is None else tf.constant(u) for u in upstream]

    def grad_of(outputs, ups, wrt):
        """``tf.gradients`` of the outputs that have an upstream gradient."""
        pairs = [(o, u) for o, u in zip(outputs, ups) if u is not None]
        (g,) = tf.gradients([o for o, _ in pairs], [wrt], grad_ys=[u for _, u in pairs])
        return g

    @tf.function(jit_compile=jit, autograph=False)
    def run(x):
        outputs = fold(combiner, partial_fn, x, axis, chunk)

        def slice_grad(offset, size):
            piece = dynamic_slice(x, axis, offset, size)
            partials = partial_fn(piece)
            return grad_of(partials, combiner.slice_upstream(upstream, outputs, partials, offset, size), piece)

        steps, tail = divmod(x.shape[axis], backward_chunk)
        grads0 = tf.TensorArray(x.dtype, size=steps, infer_shape=True)

        def body(i, grads):
            return i + 1, grads.write(i, slice_grad(i * backward_chunk, backward_chunk))

        _, grads = tf.while_loop(lambda i, _: i < steps, body, (tf.constant(0), grads0), maximum_iterations=steps)
        split = join_slices(grads, axis, slice_grad(steps * backward_chunk, tail) if tail else None)
        return split, grad_of(partial_fn(x), upstream, x)

    split, whole = run(tf.constant(x))
    return split.numpy(), whole.numpy()


# ---------------------------------------------------------------------------------------------
# Data and comparisons.
# ---------------------------------------------------------------------------------------------

def shape_with(axis: int, length: int = L, others=(3, 4)) -> list[int]:
    """A rank-3 shape with ``length`` at ``axis`` and ``others`` elsewhere, in order."""
    shape = list(others)
    shape.insert(axis, length)
    return shape


def integers(shape, dtype: tf.DType, low: int, high: int, seed: int = 0) -> np.ndarray:
    """Integer values in ``[low, high]`` (ties are likely), as ``dtype``."""
    return np.random.default_rng(seed).integers(low, high, size=shape, endpoint=True).astype(dtype.as_numpy_dtype)


def normal(shape, dtype: tf.DType, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype.as_numpy_dtype)


def reference(partial_fn, x: np.ndarray) -> list[np.ndarray]:
    """The unsplit result: the root op on the whole ``x``, eagerly."""
    return [t.numpy() for t in partial_fn(tf.constant(x))]


def assert_exact(got, want, where=""):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (where, g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=where)


def assert_summation_close(got, want, partial_fn, x, where=""):
    """Within ``2 n eps sum|x_i|`` elementwise; ``partial_fn(|x|)`` is ``sum|x_i|`` for sums, means, matmuls."""
    eps = np.finfo(x.dtype).eps
    for g, w, a in zip(got, want, reference(partial_fn, np.abs(x))):
        assert g.dtype == w.dtype and g.shape == w.shape, where
        bound = 2 * x.size * eps * a.astype(np.float64)
        err = np.abs(g.astype(np.float64) - w.astype(np.float64))
        assert np.all(err <= bound), f"{where}: error {err.max()} over the rounding bound {bound.max()}"


def assert_gradients_close(split, whole, tol=1e-12):
    assert split.shape == whole.shape and split.dtype == whole.dtype
    np.testing.assert_allclose(split, whole, rtol=tol, atol=tol)


def reduce_over(fn, axis):
    return lambda s: [fn(s, axis=axis)]


@st.composite
def split_problems(draw, rank: int, max_length: int = 10, low: int = -3, high: int = 3):
    """(x int32 with small values, axis, chunk): any length 1..max_length, any chunk 1..length."""
    shape = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    axis = draw(st.integers(0, rank - 1))
    shape[axis] = draw(st.integers(1, max_length))
    chunk = draw(st.integers(1, shape[axis]))
    x = draw(hnp.arrays(np.int32, shape, elements=st.integers(low, high)))
    return x, axis, chunk


PROPERTY = settings(max_examples=25, deadline=None)


# ---------------------------------------------------------------------------------------------
# concat
# ---------------------------------------------------------------------------------------------

def _square_and_cumsum(axis):
    """A two-output root: elementwise, and a cumsum along another axis (each split along ``axis``)."""
    other = (axis + 1) % 3
    return lambda s: [tf.square(s) - s, tf.cumsum(s, axis=other)]


class TestConcat:
    """concat: ``out[.., s:s+c, ..] = root(x[.., s:s+c, ..])``, written in order and joined, exactly.

    A static count of slices writes each slice, and the tail, at its offset into the output's
    buffer; otherwise ``join_slices`` stacks the loop's slices ``[S, .., c, ..]``, moves ``S`` next
    to the split axis, merges the two and appends the tail: the slice order must come out right on
    every axis, both ways.  Integer-valued data make the roots exact, so the comparison is bit for
    bit (int32 data in the property test).
    """

    CASES = {
        # id: (split axis of x, dtype, root, output axes)
        "axis0": (0, F32, _square_and_cumsum(0), (0, 0)),
        "axis1": (1, F32, _square_and_cumsum(1), (1, 1)),
        "axis2": (2, F32, _square_and_cumsum(2), (2, 2)),
        # the root moves the split axis: x's axis 0 is the output's axis 2
        "transposed-0-to-2": (0, F64, lambda s: [tf.transpose(s, (1, 2, 0))], (2,)),
    }

    @pytest.mark.parametrize("arrays", [False, True], ids=["buffer", "tensor_arrays"])
    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", CHUNKS)
    @pytest.mark.parametrize("case", CASES)
    def test_equals_the_whole(self, case, chunk, jit, arrays):
        axis, dtype, root, out_axes = self.CASES[case]
        x = integers(shape_with(axis), dtype, -4, 4)
        got = split_apply(Concat(out_axes), root, x, axis, chunk, jit, arrays)
        assert_exact(got, reference(root, x), f"{case} chunk={chunk}")

    @pytest.mark.parametrize("jit", MODES)
    def test_a_groups_init_joins_its_concat_and_the_tail_exactly(self, jit):
        """A ``Group``'s ``init`` (the fused loop's carry: the tail's rows not given) gives its concat
        ``TensorArray``s, whose tail is appended: a buffer without room for it would have the tail
        written past its end (XLA clamps the offset and overwrites the last slice).  ``initial``,
        which makes the buffers, must be told the tail."""
        x = integers(shape_with(1), F32, -4, 4)
        root, chunk = _square_and_cumsum(1), 4                                     # two slices, a tail of 1
        combiner = Group([(Concat((1, 1)), 2, 2)])
        specs = _partial_specs(root, shape_with(1, chunk), F32)
        with pytest.raises(TypeError, match="tail"):
            combiner.initial(specs, 2, None)

        def run(v):
            carry = combiner.init(specs, 2)
            assert all(isinstance(c, tf.TensorArray) for c in carry)
            for i in range(2):
                carry = combiner.step(carry, root(v[:, i * chunk:(i + 1) * chunk]), i, i * chunk)
            return combiner.finish(carry, root(v[:, 2 * chunk:]), 2 * chunk)

        got = [t.numpy() for t in tf.function(run, jit_compile=jit, autograph=False)(tf.constant(x))]
        assert_exact(got, reference(root, x))

    def test_the_output_is_the_loops_buffer_not_a_join_of_it(self):
        """A [4, 4099, 64] f32 input (4.2 MB) doubled along axis 1 in slices of 128 (a tail of 3): XLA
        holds the input and the output and one slice's tensors.  Joined from ``TensorArray``s it held
        the stacked slices and their transposed join as well (measured: 12.6 MB against 8.4 MB)."""
        spec = tf.TensorSpec([4, 4099, 64])
        size = 4 * 4099 * 64 * 4

        def figure(arrays):
            fn = tf.function(lambda v: fold(Concat((1,)), lambda s: [2.0 * s], v, 1, 128, arrays),
                             jit_compile=True, autograph=False)
            return tf_memsafe.memory_footprint(fn, spec, rewrite=False)

        assert figure(arrays=False) <= 2 * size + size // 8
        assert figure(arrays=True) >= 2 * size + size // 2

    @PROPERTY
    @given(split_problems(rank=3))
    def test_property_any_length_and_chunk(self, problem):
        """Any rank-3 shape, axis, length and chunk (chunk = 1 and chunk = L included)."""
        x, axis, chunk = problem
        root = _square_and_cumsum(axis)
        assert_exact(split_apply(Concat((axis, axis)), root, x, axis, chunk, False), reference(root, x))

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk, backward_chunk", [(3, 3), (4, 2)])
    @pytest.mark.parametrize("axis", (0, 1, 2))
    def test_gradient_slices_the_upstream(self, axis, chunk, backward_chunk, jit):
        """Slice ``[s, s+c)`` of the output gets ``upstream[.., s:s+c, ..]``; joined, the whole gradient."""
        other = (axis + 1) % 3
        root = lambda s: [tf.sin(s) * s, tf.cumsum(tf.square(s), axis=other)]
        x = normal(shape_with(axis), F64)
        upstream = [normal(shape_with(axis), F64, seed=1), normal(shape_with(axis), F64, seed=2)]
        split, whole = split_gradient(Concat((axis, axis)), root, x, upstream, axis, chunk, backward_chunk, jit)
        assert_gradients_close(split, whole)

    def test_gradient_of_one_output_only(self):
        """An output with no upstream (``None``) routes ``None`` to its partials."""
        root = lambda s: [tf.sin(s) * s, tf.exp(s)]
        x = normal(shape_with(1), F64)
        split, whole = split_gradient(Concat((1, 1)), root, x, [None, normal(shape_with(1), F64, seed=3)], 1, 4, 4,
                                      False)
        assert_gradients_close(split, whole)


# ---------------------------------------------------------------------------------------------
# sum
# ---------------------------------------------------------------------------------------------

def _contract(s):
    """MatMul contracting the split axis: x[0]^T x[1], [4, 4] from [c, 4] and [c, 4]."""
    return [tf.matmul(s[0], s[1], transpose_a=True)]


class TestSum:
    """sum: ``sum over L = sum over slices of the slice's sum`` (Sum; MatMul contracting the axis).

    Floating results within the rounding of a reassociated sum; integer results exactly.
    """

    CASES = {
        # id: (x's shape, split axis, dtype, root)
        "axis1-f32": (shape_with(1), 1, F32, reduce_over(tf.reduce_sum, 1)),
        "axis1-f64": (shape_with(1), 1, F64, reduce_over(tf.reduce_sum, 1)),
        "axis1-int32": (shape_with(1), 1, I32, reduce_over(tf.reduce_sum, 1)),
        "all-axes-int64": (shape_with(0), 0, I64, reduce_over(tf.reduce_sum, None)),
        "axes02-f32": (shape_with(2), 2, F32, reduce_over(tf.reduce_sum, (0, 2))),
        "matmul-f32": ([2, L, 4], 1, F32, _contract),
    }

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", CHUNKS)
    @pytest.mark.parametrize("case", CASES)
    def test_equals_the_whole(self, case, chunk, jit):
        shape, axis, dtype, root = self.CASES[case]
        if dtype.is_integer:
            x = integers(shape, dtype, -1000, 1000)
            assert_exact(split_apply(Sum(), root, x, axis, chunk, jit), reference(root, x), case)
        else:
            x = normal(shape, dtype)
            assert_summation_close(split_apply(Sum(), root, x, axis, chunk, jit), reference(root, x), root, x, case)

    def test_integer_overflow_wraps_as_the_whole(self):
        """int32 sums that overflow wrap around the same way in any order (arithmetic mod 2^32)."""
        x = integers(shape_with(1), I32, 2**30, 2**31 - 1)
        root = reduce_over(tf.reduce_sum, 1)
        assert_exact(split_apply(Sum(), root, x, 1, 4, False), reference(root, x))

    @PROPERTY
    @given(split_problems(rank=2, low=-1000, high=1000))
    def test_property_any_length_and_chunk(self, problem):
        x, axis, chunk = problem
        root = reduce_over(tf.reduce_sum, axis)
        assert_exact(split_apply(Sum(), root, x, axis, chunk, False), reference(root, x))

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk, backward_chunk", [(3, 3), (4, 4), (4, 2), (5, 5)])
    def test_gradient_passes_the_upstream_whole(self, chunk, backward_chunk, jit):
        """Every slice's sum gets the whole upstream: d/dx_i sum_s p_s = d p_s(i) / dx_i."""
        root = lambda s: [tf.reduce_sum(tf.sin(s) * s, axis=1)]
        x = normal(shape_with(1), F64)
        upstream = [normal([3, 4], F64, seed=1)]
        assert_gradients_close(*split_gradient(Sum(), root, x, upstream, 1, chunk, backward_chunk, jit))

    @pytest.mark.parametrize("jit", MODES)
    def test_gradient_of_a_contraction(self, jit):
        """MatMul contracting the split axis: both operands' slices get their share of x[0]^T x[1]'s gradient."""
        x = normal([2, L, 4], F64)
        upstream = [normal([4, 4], F64, seed=1)]
        assert_gradients_close(*split_gradient(Sum(), _contract, x, upstream, 1, 4, 3, jit))


# ---------------------------------------------------------------------------------------------
# mean
# ---------------------------------------------------------------------------------------------

class TestMean:
    """mean: ``mean over L = sum over slices of (slice mean) * c / L``, ``c`` the slice's length.

    The tail's weight is ``tail / L``, not ``chunk / L``; floating results within rounding.  The
    gradient: each slice's mean gets ``upstream * c / L``, so each element ``upstream / L``.
    float64 weights are built in float64 (``tf.cast`` of a Python float would round them to
    float32 first); an integer mean is refused.
    """

    CASES = {
        "axis1-f32": (1, F32, reduce_over(tf.reduce_mean, 1)),
        "all-axes-f32": (2, F32, reduce_over(tf.reduce_mean, None)),
        "axis0-f16": (0, F16, reduce_over(tf.reduce_mean, 0)),
    }

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", CHUNKS)
    @pytest.mark.parametrize("case", CASES)
    def test_equals_the_whole(self, case, chunk, jit):
        axis, dtype, root = self.CASES[case]
        x = normal(shape_with(axis), dtype)
        got = split_apply(Mean(L, chunk, L % chunk), root, x, axis, chunk, jit)
        assert_summation_close(got, reference(root, x), root, x, f"{case} chunk={chunk}")

    @pytest.mark.parametrize("jit", MODES)
    def test_float64_within_float64_rounding(self, jit):
        """chunk 3 of L = 9: weights 1/3, which float32 cannot hold; the error bound is float64's."""
        root = reduce_over(tf.reduce_mean, 1)
        x = normal(shape_with(1), F64)
        got = split_apply(Mean(L, 3, 0), root, x, 1, 3, jit)
        assert_summation_close(got, reference(root, x), root, x)

    def test_integer_mean_is_refused(self):
        """Truncated slice means cannot give the truncated mean of the whole: refused, not guessed."""
        with pytest.raises(TypeError, match="int32 cannot be combined exactly"):
            Mean(L, 4, 1).init([tf.TensorSpec([3, 4], I32)], 2)

    @staticmethod
    def _gradients(dtype, backward_chunk, jit):
        root = lambda s: [tf.reduce_mean(tf.sin(s) * s, axis=1)]
        x = normal(shape_with(1), dtype)
        upstream = [normal([3, 4], dtype, seed=1)]
        return split_gradient(Mean(L, 4, 1), root, x, upstream, 1, 4, backward_chunk, jit)

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("backward_chunk", (4, 3, 2))
    def test_gradient_weights_each_slice(self, backward_chunk, jit):
        """Forward in chunks of 4 (tail 1); backward in its own chunks, each slice weighted by its length / L.

        float32 (see the float64 xfail): elementwise, so within a few float32 roundings.
        """
        assert_gradients_close(*self._gradients(F32, backward_chunk, jit), tol=1e-6)

    def test_gradient_float64(self):
        assert_gradients_close(*self._gradients(F64, 3, False))


# ---------------------------------------------------------------------------------------------
# max, min, prod, all, any
# ---------------------------------------------------------------------------------------------

_REDUCERS = {"max": tf.reduce_max, "min": tf.reduce_min, "prod": tf.reduce_prod, "all": tf.reduce_all,
             "any": tf.reduce_any}


def _reduce_data(kind: str, dtype: tf.DType) -> np.ndarray:
    """[3, L, 4] data for ``kind``, reduced along axis 1, with each lane ``x[a, :, b]`` telling something.

    max/min: lanes all at the identity (-inf/+inf, dtype.min/max), lanes holding the other
    extreme, extremes in the tail only; prod: powers of two (exact products), a zero, sign flips;
    all/any: lanes all true, all false, and the odd one out in the tail.
    """
    shape = shape_with(1)
    if kind in ("all", "any"):
        x = np.random.default_rng(0).random(shape) < (0.8 if kind == "all" else 0.2)
        x[0, :, 0], x[0, :, 1] = True, False
        x[1, :, 0], x[1, -1, 0] = kind == "all", kind != "all"  # decided by the tail's last element
        x[1, :, 1], x[1, 0, 1] = kind == "all", kind != "all"  # decided by the first element
        return x
    np_dtype = dtype.as_numpy_dtype
    if kind == "prod":
        if dtype.is_floating:
            x = np.random.default_rng(0).choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], size=shape).astype(np_dtype)
        elif dtype.is_unsigned:
            x = integers(shape, dtype, 0, 255)  # products wrap mod 256, the same in any order
        else:
            x = np.random.default_rng(0).choice([-1, 1, 1, 2], size=shape).astype(np_dtype)
        x[2, 3, 1] = 0
        return x
    if dtype.is_floating:
        lo, hi = -np.inf, np.inf
        x = normal(shape, dtype)
    else:
        lo, hi = dtype.min, dtype.max
        x = integers(shape, dtype, lo, hi)
    x[0, :, 0] = lo                    # all at max's identity
    x[0, :, 1] = hi                    # all at min's identity
    x[0, :, 2], x[0, -1, 2] = lo, hi   # the other extreme only in the tail (chunk 4, 2)
    x[0, :, 3], x[0, 0, 3] = hi, lo
    x[1, 2, 0], x[1, 7, 0] = lo, hi    # both extremes present
    x[1, 5, 1] = lo
    x[2, 6, 2] = hi
    return x


class TestReduce:
    """max, min, prod, all, any: the reduction of the slices' reductions, exactly, from the identity.

    ``init`` starts from the identity: -inf/+inf for floating max/min, ``dtype.min``/``dtype.max``
    for integers (so a lane of nothing but ``dtype.min`` still gives ``dtype.min``), 1 for prod,
    true/false for all/any.  Floating products are of powers of two, so exact in any order.
    """

    CASES = [("max", F32), ("max", I64), ("max", U8), ("max", I8), ("min", F64), ("min", I32),
             ("prod", F32), ("prod", I64), ("prod", U8), ("all", BOOL), ("any", BOOL)]

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", CHUNKS)
    @pytest.mark.parametrize("kind, dtype", CASES, ids=[f"{k}-{d.name}" for k, d in CASES])
    def test_equals_the_whole(self, kind, dtype, chunk, jit):
        x = _reduce_data(kind, dtype)
        root = reduce_over(_REDUCERS[kind], 1)
        assert_exact(split_apply(Reduce(kind), root, x, 1, chunk, jit), reference(root, x), f"{kind} chunk={chunk}")

    @pytest.mark.parametrize("kind", ("max", "min"))
    def test_reduces_several_axes(self, kind):
        """Reducing the split axis with another (here 0 and 1, to shape [4])."""
        x = _reduce_data(kind, F32)
        root = reduce_over(_REDUCERS[kind], (0, 1))
        assert_exact(split_apply(Reduce(kind), root, x, 1, 4, False), reference(root, x))

    @pytest.mark.parametrize("kind", ("max", "min", "prod"))
    def test_not_differentiable(self, kind):
        """max/min/prod would need every slice's ties or zeros first: no gradient, each partial gets None."""
        combiner = Reduce(kind)
        assert combiner.differentiable is False
        up = [tf.ones([3, 4])]
        assert combiner.slice_upstream(up, up, up, 0, 4) == [None]

    @pytest.mark.parametrize("kind", ("all", "any"))
    def test_booleans_have_nothing_to_differentiate(self, kind):
        assert Reduce(kind).differentiable is True

    def test_unknown_kind_is_refused(self):
        with pytest.raises(ValueError, match="unknown reduction"):
            Reduce("mean")

    def test_combiner_for_each_reduction(self):
        """Sum -> Sum, Mean -> Mean with its length and chunks, the others -> Reduce of their kind."""
        assert set(REDUCTION_COMBINERS) == {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any"}
        assert type(combiner_for_reduction("Sum")) is Sum
        mean = combiner_for_reduction("Mean", 9, 4, 1)
        assert type(mean) is Mean and (mean.length, mean.chunk, mean.tail) == (9, 4, 1)
        for op_type in ("Max", "Min", "Prod", "All", "Any"):
            combiner = combiner_for_reduction(op_type)
            assert type(combiner) is Reduce and combiner.name == op_type.lower()


# ---------------------------------------------------------------------------------------------
# argmax, argmin
# ---------------------------------------------------------------------------------------------

def _arg_root(kind: str, axis: int, output_type: tf.DType):
    """The splitter's partials for an arg root: (local index, value at it) of each slice."""
    arg = tf.math.argmax if kind == "max" else tf.math.argmin
    def partials(s):
        index = arg(s, axis=axis, output_type=output_type)
        return [index, value_at(s, index, axis)]

    return partials


def _arg_data(kind: str, dtype: tf.DType, axis: int) -> np.ndarray:
    """Values 0..2 (ties within and across slices), with lanes along ``axis`` that test the first-index rule.

    Lanes: all equal; the best twice, in the first slice and the tail; the best only in the tail;
    every value the worst one (-inf/+inf, dtype.min/max) so only "first slice sets the carry"
    gives index 0; infinities (or the extreme integers) twice.
    """
    x = np.moveaxis(integers(shape_with(axis), dtype, 0, 2), axis, 1)     # lanes x[a, :, b]
    if dtype.is_floating:
        worst, top = (-np.inf, np.inf) if kind == "max" else (np.inf, -np.inf)
    else:
        worst, top = (dtype.min, dtype.max) if kind == "max" else (dtype.max, dtype.min)
    best = 3 if kind == "max" else -1
    x[0, :, 0] = 1
    x[0, :, 1], x[0, 1, 1], x[0, 8, 1] = 1, best, best
    x[0, :, 2], x[0, 8, 2] = 1, best
    x[1, :, 0] = worst
    x[1, :, 1], x[1, 4, 1], x[1, 6, 1] = worst, top, top
    x[1, :, 2], x[1, 3, 2], x[1, 5, 2] = 1, best, best                      # same value in two slices
    return np.moveaxis(x, 1, axis)


class TestArg:
    """argmax/argmin: running (index + s, value); a later slice wins only if strictly better.

    So among equal values the first index stays, within a slice (the slice's own arg) and across
    slices: exactly ``tf.math.argmax``/``argmin`` of the whole, ties included, for int32 and int64
    indices.  The first slice always sets the carry, so a lane of nothing but the worst value
    (-inf for argmax, dtype.min for an integer argmax) still gives index 0.
    """

    CASES = [  # (kind, value dtype, index dtype, axis): each kind with float and int values, int32 and int64 indices
        ("max", F32, I64, 1), ("max", I32, I32, 1), ("min", F32, I32, 1), ("min", I32, I64, 1),
        ("max", F64, I32, 0), ("min", I64, I64, 2)]

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", CHUNKS)
    @pytest.mark.parametrize("kind, dtype, output_type, axis", CASES,
                             ids=[f"arg{k}-{d.name}-to-{o.name}-axis{a}" for k, d, o, a in CASES])
    def test_equals_the_whole_ties_included(self, kind, dtype, output_type, axis, chunk, jit):
        x = _arg_data(kind, dtype, axis)
        got = split_apply(Arg(kind, output_type), _arg_root(kind, axis, output_type), x, axis, chunk, jit)
        assert_exact(got, reference(_arg_root(kind, axis, output_type), x)[:1], f"chunk={chunk}")

    @PROPERTY
    @given(split_problems(rank=2, low=0, high=2), st.sampled_from(("max", "min")), st.sampled_from((I32, I64)))
    def test_property_any_length_and_chunk(self, problem, kind, output_type):
        """Values 0..2 on any shape: the lowest index of the best value, as numpy's argmax/argmin."""
        x, axis, chunk = problem
        got = split_apply(Arg(kind, output_type), _arg_root(kind, axis, output_type), x, axis, chunk, False)
        want = (np.argmax if kind == "max" else np.argmin)(x, axis=axis)
        np.testing.assert_array_equal(got[0], want)
        assert got[0].dtype == output_type.as_numpy_dtype

    def test_nan_in_an_earlier_slice(self):
        """``[0, nan, 0, 0 | 3, ..]``: ``tf.math.argmax`` gives 4, and so does the split loop.

        Graph mode only: under XLA the unsplit argmax of a lane holding a NaN follows neither rule
        (zeros with a NaN at 6 give 7, on TF 2.21 CPU), so there is no one answer to match there.
        """
        x = np.zeros([2, L], np.float32)
        x[0, 1], x[0, 4] = np.nan, 3
        root = _arg_root("max", 1, I64)
        assert_exact(split_apply(Arg("max", I64), root, x, 1, 4, False), reference(root, x)[:1])

    def test_no_gradient(self):
        """Integer output: the index and value partials both get None."""
        up = [tf.ones([3])]
        assert Arg("max", I64).slice_upstream(up, up, [tf.zeros([3], I64), tf.ones([3])], 0, 4) == [None, None]

    def test_unknown_kind_is_refused(self):
        with pytest.raises(ValueError, match="unknown arg kind"):
            Arg("mean", I64)


# ---------------------------------------------------------------------------------------------
# top_k
# ---------------------------------------------------------------------------------------------

TOPK_LENGTH = 16


def _top_k_root(k: int, index_type: tf.DType = I32):
    return lambda s: list(tf.math.top_k(s, k=k, index_type=index_type))


def _top_k_data(dtype: tf.DType) -> np.ndarray:
    """[6, 16] integer values 0..3 (lots of ties), with rows of -inf (or dtype.min for integers).

    Rows: all equal; all -inf; -inf at every other position; -inf but one value in the last
    position (the tail of chunks 5, 3, 6, 11, 7); the maximum repeated across slices; random.
    """
    x = integers([6, TOPK_LENGTH], dtype, 0, 3)
    low = -np.inf if dtype.is_floating else dtype.min
    x[0] = 2
    x[1] = low
    x[2, ::2] = low
    x[3], x[3, -1] = low, 1
    x[4, [1, 5, 9, 15]] = 7
    return x


class TestTopK:
    """top_k: merge the carry's k with the slice's k (carry first) and keep the top k again.

    ``tf.math.top_k`` orders equal values by lower index, and a carry placed first holds lower
    indices, so values and indices equal ``top_k`` of the whole axis, ties included.  The first
    slice replaces the carry's -inf placeholders outright, so rows of -inf get indices 0..k-1.
    Slices hold at least k (the splitter's planner guarantees it; so does every case here).
    """

    CASES = [  # (k, chunk): k = 1; k = chunk; tails of size k and more
        (1, 4), (1, 5), (1, 3), (4, 4), (3, 6), (5, 11), (2, 7)]

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("dtype", (F32, I32), ids=lambda d: d.name)
    @pytest.mark.parametrize("k, chunk", CASES, ids=[f"k{k}-chunk{c}-tail{TOPK_LENGTH % c}" for k, c in CASES])
    def test_equals_the_whole_ties_included(self, k, chunk, dtype, jit):
        x = _top_k_data(dtype)
        got = split_apply(TopK(k), _top_k_root(k), x, 1, chunk, jit)
        assert_exact(got, reference(_top_k_root(k), x), f"k={k} chunk={chunk}")

    @pytest.mark.parametrize("jit", MODES)
    def test_int64_indices(self, jit):
        x = _top_k_data(F32)
        root = _top_k_root(3, I64)
        assert_exact(split_apply(TopK(3), root, x, 1, 6, jit), reference(root, x))

    def test_batch_of_rows_rank3(self):
        """top_k of the last axis of a rank-3 tensor: the batch dims are carried through the gather."""
        x = integers([2, 3, TOPK_LENGTH], F32, 0, 3)
        root = _top_k_root(2)
        assert_exact(split_apply(TopK(2), root, x, 2, 7, False), reference(root, x))

    GRADIENT_CASES = [  # (k, forward chunk, backward chunk), every slice holding at least k
        (1, 4, 4), (1, 5, 3), (3, 6, 4), (4, 4, 4), (2, 7, 8)]

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("k, chunk, backward_chunk", GRADIENT_CASES,
                             ids=[f"k{k}-chunk{c}-back{b}" for k, c, b in GRADIENT_CASES])
    def test_gradient_scatters_to_the_selected(self, k, chunk, backward_chunk, jit):
        """Each selected element gets its upstream value, in the slice that holds it; the rest zero.

        Distinct values (no ties), so the selection is unique and the gradient well defined.
        """
        x = np.stack([np.random.default_rng(r).permutation(TOPK_LENGTH) for r in range(4)]).astype(np.float64)
        x += normal(x.shape, F64) * 0.1  # still distinct, not integer
        upstream = [normal([4, k], F64, seed=1), None]
        root = _top_k_root(k)
        split, whole = split_gradient(TopK(k), root, x, upstream, 1, chunk, backward_chunk, jit)
        assert_gradients_close(split, whole)
        assert np.count_nonzero(whole) == 4 * k


class TestExtremum:
    """max/min of floats with their gradient: values 0..2 along L = 9 (ties within and across
    slices); the tie count is exact, and each tied element gets ``dy / T`` as ``tf.reduce_max``'s
    own gradient gives it, whatever the forward and backward chunks."""

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", (3, 4))
    @pytest.mark.parametrize("kind", ("max", "min"))
    def test_values_counts_and_gradient(self, kind, chunk, jit):
        reduce = tf.reduce_max if kind == "max" else tf.reduce_min
        root = lambda s: [reduce(s, axis=1), tie_count(s, [1], False, kind),
                          first_at(s, reduce(s, axis=1), [1], 1, kind)]
        x = np.random.default_rng(3).integers(0, 3, (4, L)).astype(np.float64)
        assert_exact(split_apply(Extremum(kind), root, x, 1, chunk, jit), reference(root, x))
        upstream = [np.random.default_rng(4).standard_normal(4), None, None]
        assert_gradients_close(*split_gradient(Extremum(kind), root, x, upstream, 1, chunk, 2, jit))

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("kind", ("max", "min"))
    def test_a_unique_extremum_recomputed_a_bit_off_gets_its_gradient(self, kind, jit):
        """The backward recomputes each slice in slices of its own size, which XLA may reduce in
        another order: a slice's maximum a bit off the forward's (here: shifted by its size, 1e-13
        a row).  A unique maximum is found by where it was, not by its value: its upstream reaches
        it whole (before: no slice equal to the maximum, and a zero gradient)."""
        reduce = tf.reduce_max if kind == "max" else tf.reduce_min

        def root(s):
            v = s + tf.cast(tf.shape(s)[1], s.dtype) * 1e-13
            return [reduce(v, axis=1), tie_count(v, [1], False, kind), first_at(v, reduce(v, axis=1), [1], 1, kind)]

        x = np.stack([np.random.default_rng(r).permutation(L) for r in range(4)]).astype(np.float64)
        upstream = [np.random.default_rng(4).standard_normal(4), None, None]
        split, whole = split_gradient(Extremum(kind), root, x, upstream, 1, 3, 2, jit)
        assert_gradients_close(split, whole)
        assert np.count_nonzero(split) == 4


class TestOnlineSoftmax:
    """softmax(S) @ V over slices of the keys (S [3, 9] scores, V [9, 4] values, folded together as
    one [7, 9] array sliced along the keys): the running max, normaliser and rescaled accumulator
    give the unsplit product.  Its gradient is checked end to end in test_splitter."""

    @pytest.mark.parametrize("jit", MODES)
    @pytest.mark.parametrize("chunk", (3, 4))
    def test_values(self, chunk, jit):
        scores = 3 * np.random.default_rng(6).standard_normal((3, L))
        values = np.random.default_rng(5).standard_normal((L, 4))
        both = np.concatenate([scores, values.T], axis=0)                        # [3 + 4, L]

        def partial(piece):
            return softmax_partials(piece[:3], lambda e: e @ tf.transpose(piece[3:]))

        got = split_apply(OnlineSoftmax(), partial, both, 1, chunk, jit)
        want = tf.nn.softmax(scores, -1).numpy() @ values
        np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)
