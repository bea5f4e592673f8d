"""splitter.rules: every rule computes exactly the wanted slice, and every refusal says why.

The numeric check, for each case and each axis of the op's output: slice the op's inputs as the
:class:`Propagation` says, at a dynamic offset ``s`` with a static chunk ``c``, rebuild the op on
them, and compare with ``out[.., s:s+c, ..]`` of the original op (and the other outputs with their
slices), at offsets first, middle and last.  Axes a case lists in ``refused`` must be refused with
the given words instead.  Integer and boolean results are compared exactly, floating ones within
4 eps (see :func:`check`), contractions up to rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorflow.python.framework.func_graph import FuncGraph

from grappler_ext.splitter.rules import RULES, Propagation, Refusal, clone_op, leaf_kind, propagate
from grappler_ext.splitter.slicing import UNIT, Factor, factored_slice

F32, F64, I32, BOOL = tf.float32, tf.float64, tf.int32, tf.bool
FRACTIONS = (0.0, 0.5, 1.0)  # offsets s = fraction * (n - c): first, middle and last chunk


def _raw(op_type: str, *inputs, **attrs):
    """``tf.raw_ops.<op_type>`` with its inputs given in order."""
    fn = getattr(tf.raw_ops, op_type)
    names = list(inspect.signature(fn).parameters)
    return fn(**dict(zip(names, inputs)), **attrs)


def _data(shape, dtype, seed=0, low=None, high=None):
    rng = np.random.default_rng(seed)
    if dtype == BOOL:
        return rng.random(shape) < 0.5
    if dtype.is_integer:
        return rng.integers(1 if low is None else low, 6 if high is None else high, shape).astype(dtype.as_numpy_dtype)
    return rng.uniform(0.2 if low is None else low, 0.9 if high is None else high, shape).astype(dtype.as_numpy_dtype)


@dataclasses.dataclass
class Case:
    """One op under test.

    Attributes:
      op_type: the type of the op ``fn`` returns an output of (asserted).
      fn: builds the op from the input tensors; returns one of its outputs.
      inputs: numpy arrays fed as the function's parameters.
      refused: axis -> words the refusal's reason must contain; every other axis must split.
      output_index: which output is split.
      chunk: the static chunk c for every axis (default: about half the axis).
    """

    op_type: str
    fn: Callable
    inputs: list
    refused: dict = dataclasses.field(default_factory=dict)
    output_index: int = 0
    chunk: int | None = None
    id: str = ""


def _slice(t: tf.Tensor, axis: int, start: tf.Tensor, chunk: int) -> tf.Tensor:
    """``t[.., start:start+chunk, ..]`` along ``axis``, with a static shape."""
    rank = t.shape.rank
    begin = tf.one_hot(axis, rank, on_value=start, off_value=0, dtype=tf.int32)
    size = t.shape.as_list()
    size[axis] = chunk
    return tf.slice(t, begin, size)


def split_and_rebuild(case: Case):
    """Trace ``case``; return ``run(fraction) -> [(expected, rebuilt)]`` over every axis that splits."""
    specs = [tf.TensorSpec(np.shape(v), tf.as_dtype(np.asarray(v).dtype)) for v in case.inputs]

    @tf.function(autograph=False)
    def run(fraction, *xs):
        out = case.fn(*xs)
        op = out.op
        assert op.type == case.op_type, f"{case.id}: built `{op.type}`, expected `{case.op_type}`"
        dims = op.outputs[case.output_index].shape.as_list()
        pairs = []
        for axis in range(len(dims)):
            prop = propagate(op, case.output_index, axis)
            if axis in case.refused:
                assert isinstance(prop, Refusal) and not prop, f"axis {axis} was not refused: {prop}"
                assert case.refused[axis] in prop.reason, prop.reason
                continue
            assert isinstance(prop, Propagation), f"axis {axis}: {prop.reason}"
            chunk = case.chunk or max(1, dims[axis] // 2)
            start = tf.cast(tf.round(fraction * (dims[axis] - chunk)), tf.int32)
            # (a reshape's input holds the split axis at a factor of its axis: the rows it gives)
            new_inputs = [t if a is None else factored_slice(t, a, start, chunk, prop.factor(i))
                          for i, (t, a) in enumerate(zip(op.inputs, prop.input_axes))]
            rebuilt = prop.build(op, new_inputs, chunk, start)
            assert len(rebuilt) == len(op.outputs)
            for k, (old, new, a) in enumerate(zip(op.outputs, rebuilt, prop.output_axes)):
                if k >= 3 and op.type == "FusedBatchNormV3" and not op.get_attr("is_training"):
                    continue      # (reserve spaces an inference leaves as they were allocated: no values to compare)
                expected = old if a is None else _slice(old, a, start, chunk)
                # (a fused batch norm's third reserve space has no static shape: compared as it runs)
                assert new.shape == expected.shape or expected.shape.rank is None, (axis, new.shape, expected.shape)
                assert new.dtype == expected.dtype
                pairs.append((expected, new))
        return pairs

    concrete = run.get_concrete_function(tf.TensorSpec([], tf.float32), *specs)
    return lambda fraction: concrete(tf.constant(fraction, tf.float32), *case.inputs)


def check(case: Case, rtol: float | None = None):
    """Run ``case`` at every offset: integers and booleans bitwise equal; floats (values of order 1)
    within 4 eps, relative or absolute -- Eigen rounds a vector packet and the scalar tail
    differently, and slicing moves elements between them: measured up to 4 ulps for elu, selu,
    sigmoid, acos, 1 ulp for exp, log, sin, pow, add_n ...; or ``rtol`` for contractions."""
    run = split_and_rebuild(case)
    for fraction in FRACTIONS:
        for expected, got in run(fraction):
            expected, got = expected.numpy(), got.numpy()
            if got.dtype.kind != "f":
                np.testing.assert_array_equal(got, expected)
            elif rtol is None:
                eps = np.finfo(got.dtype).eps
                np.testing.assert_allclose(got, expected, rtol=4 * eps, atol=4 * eps)
            else:
                np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol)


# --- the cases, one per op type and variant ------------------------------------------------------

CASES: list[Case] = []


def case(op_type, fn, inputs, **kw):
    CASES.append(Case(op_type, fn, inputs, id=kw.pop("id", op_type), **kw))


# Elementwise unary: [3, 4, 5], every axis.
_FLOAT_UNARY = ("Neg Exp Expm1 Log Log1p Sqrt Rsqrt Square Abs Sign Floor Ceil Round Rint Reciprocal Inv "
                "Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Atanh Tanh Sigmoid Relu Relu6 Elu Selu "
                "LeakyRelu Softplus Softsign Erf Erfc Lgamma Digamma IsNan IsInf IsFinite "
                "Identity StopGradient PreventGradient Snapshot ZerosLike OnesLike").split()
_INT_UNARY = "Neg Abs Sign Square Invert Identity ZerosLike OnesLike Relu".split()
for _t in _FLOAT_UNARY:
    case(_t, lambda x, t=_t: _raw(t, x), [_data([3, 4, 5], F32, low=-0.9)], id=f"{_t}-f32")
for _t in _INT_UNARY:
    case(_t, lambda x, t=_t: _raw(t, x), [_data([3, 4, 5], I32, low=-5)], id=f"{_t}-i32")
case("Acosh", tf.math.acosh, [_data([3, 4, 5], F64, low=1.0, high=3.0)])
case("Exp", tf.exp, [_data([3, 4, 5], F64)], id="Exp-f64")
case("Cast", lambda x: tf.cast(x, I32), [_data([3, 4, 5], F32, low=-5, high=5)], id="Cast-f32-i32")
case("Cast", lambda x: tf.cast(x, F64), [_data([3, 4, 5], I32)], id="Cast-i32-f64")
case("LogicalNot", tf.logical_not, [_data([3, 4, 5], BOOL)])
case("EnsureShape", lambda x: tf.ensure_shape(tf.exp(x), [3, None, 5]), [_data([3, 4, 5], F32)])
case("EnsureShape", lambda x: tf.ensure_shape(tf.exp(x), [3, 4, 5]), [_data([3, 4, 5], F32)], id="EnsureShape-full")

# Elementwise binary with broadcasting: [3, 1, 5] op [4, 1] -> [3, 4, 5]: axis 0 only x, axis 1 only y
# (x broadcast), axis 2 only x (y broadcast).
_FLOAT_BINARY = ("Add AddV2 Sub Mul MulNoNan RealDiv Div DivNoNan FloorDiv FloorMod Mod Maximum Minimum Pow "
                 "SquaredDifference Xdivy Xlogy Xlog1py Atan2 Equal NotEqual Less LessEqual Greater "
                 "GreaterEqual").split()
_INT_BINARY = ("Add AddV2 Sub Mul Div FloorDiv FloorMod TruncateDiv TruncateMod Mod Maximum Minimum Pow "
               "SquaredDifference Equal NotEqual Less LessEqual Greater GreaterEqual BitwiseAnd BitwiseOr "
               "BitwiseXor LeftShift RightShift").split()
for _t in _FLOAT_BINARY:
    case(_t, lambda x, y, t=_t: _raw(t, x, y), [_data([3, 1, 5], F32, 1), _data([4, 1], F32, 2)], id=f"{_t}-f32")
for _t in _INT_BINARY:
    case(_t, lambda x, y, t=_t: _raw(t, x, y), [_data([3, 1, 5], I32, 1), _data([4, 1], I32, 2, high=4)],
         id=f"{_t}-i32")
for _t in ("LogicalAnd", "LogicalOr"):
    case(_t, lambda x, y, t=_t: _raw(t, x, y), [_data([3, 1, 5], BOOL, 1), _data([4, 1], BOOL, 2)])
case("AddV2", lambda x, y: x + y, [_data([3, 4, 5], F32, 1), _data([], F32, 2)], id="AddV2-scalar")
case("Mul", lambda x, y: x * y, [_data([1, 4, 1], I32, 1), _data([3, 1, 5], I32, 2)], id="Mul-both-broadcast")
_GRADS = ("ReluGrad Relu6Grad EluGrad SeluGrad LeakyReluGrad SoftplusGrad SoftsignGrad "
          "SigmoidGrad TanhGrad SqrtGrad RsqrtGrad ReciprocalGrad InvGrad").split()
for _t in _GRADS:
    case(_t, lambda x, y, t=_t: _raw(t, x, y), [_data([3, 4, 5], F32, 1, low=-0.9), _data([3, 4, 5], F32, 2)])
case("AddN", lambda x, y, z: tf.add_n([x, y, z]), [_data([3, 4, 5], F32, i) for i in range(3)])
case("AddN", lambda x, y: tf.add_n([x, y]), [_data([3, 4], I32, i) for i in range(2)], id="AddN-i32")
# A band of a matrix: row and column slices keep the band of their absolute indices.
case("MatrixBandPart", lambda x: tf.linalg.band_part(x, -1, 0), [_data([2, 6, 5], F32)], id="MatrixBandPart-lower")
case("MatrixBandPart", lambda x: tf.linalg.band_part(x, 1, 2), [_data([6, 5], F32)], id="MatrixBandPart-band")
case("MatrixBandPart", lambda x: tf.linalg.band_part(x, 0, -1), [_data([6, 5], I32)], id="MatrixBandPart-upper")
case("SelectV2", lambda c, x, y: tf.where(c, x, y),
     [_data([3, 1, 5], BOOL), _data([4, 1], F32, 1), _data([3, 4, 5], F32, 2)])
case("SelectV2", lambda c, x, y: tf.where(c, x, y),
     [_data([4, 1], BOOL), _data([3, 4, 5], I32, 1), _data([], I32, 2)], id="SelectV2-i32")
case("Select", lambda c, x, y: _raw("Select", c, x, y),
     [_data([3], BOOL), _data([3, 4], F32, 1), _data([3, 4], F32, 2)], id="Select-rows")
case("Select", lambda c, x, y: _raw("Select", c, x, y),
     [_data([3, 4], BOOL), _data([3, 4], I32, 1), _data([3, 4], I32, 2)], id="Select-same")
case("Select", lambda c, x, y: _raw("Select", c, x, y),
     [_data([], BOOL), _data([3, 4], F32, 1), _data([3, 4], F32, 2)], id="Select-scalar")
case("ClipByValue", lambda x: _raw("ClipByValue", x, 0.3, 0.6), [_data([3, 4, 5], F32)])
case("ClipByValue", lambda x, lo: _raw("ClipByValue", x, lo, 4), [_data([3, 4], I32), _data([3, 4], I32, 1)],
     id="ClipByValue-i32-tensor")
case("BiasAdd", tf.nn.bias_add, [_data([3, 4, 5], F32), _data([5], F32, 1)])
case("BiasAdd", lambda x, b: tf.nn.bias_add(x, b, data_format="NCHW"), [_data([2, 3, 4, 5], F32), _data([3], F32, 1)],
     id="BiasAdd-NCHW")
case("BiasAddV1", lambda x, b: _raw("BiasAddV1", x, b), [_data([3, 4], I32), _data([4], I32, 1)])
case("BiasAddGrad", lambda g: tf.raw_ops.BiasAddGrad(out_backprop=g), [_data([3, 4, 5], F32)])
case("BiasAddGrad", lambda g: tf.raw_ops.BiasAddGrad(out_backprop=g, data_format="NCHW"), [_data([2, 3, 4, 5], F32)],
     id="BiasAddGrad-NCHW")

# Contractions.
_MM = 1e-5
for _ta in (False, True):
    for _tb in (False, True):
        case("MatMul", lambda a, b, ta=_ta, tb=_tb: tf.linalg.matmul(a, b, transpose_a=ta, transpose_b=tb),
             [_data([5, 3] if _ta else [3, 5], F32), _data([4, 5] if _tb else [5, 4], F32, 1)],
             id=f"MatMul-ta{_ta:d}-tb{_tb:d}")
case("MatMul", tf.linalg.matmul, [_data([3, 5], I32), _data([5, 4], I32, 1)], id="MatMul-i32")
for _ax in (False, True):
    for _ay in (False, True):
        # x [2, 1, 3, 6] (adj: [.., 6, 3]) and y [5, 6, 4] (adj: [.., 4, 6]) -> [2, 5, 3, 4]
        case("BatchMatMulV2", lambda x, y, ax=_ax, ay=_ay: tf.linalg.matmul(x, y, adjoint_a=ax, adjoint_b=ay),
             [_data([2, 1, 6, 3] if _ax else [2, 1, 3, 6], F32), _data([5, 4, 6] if _ay else [5, 6, 4], F32, 1)],
             id=f"BatchMatMulV2-ax{_ax:d}-ay{_ay:d}")
case("BatchMatMulV2", tf.linalg.matmul, [_data([2, 3, 4], F32), _data([4, 5], F32, 1)], id="BatchMatMulV2-rank2-rhs")
case("BatchMatMulV3", lambda x, y: _raw("BatchMatMulV3", x, y, Tout=F32, adj_y=True),
     [_data([2, 3, 4], F32), _data([2, 5, 4], F32, 1)])
case("BatchMatMul", lambda x, y: _raw("BatchMatMul", x, y, adj_x=True),
     [_data([2, 4, 3], F64), _data([2, 4, 5], F64, 1)])
for _eq, _shapes in {
    "ij,jk->ik": ([3, 4], [4, 5]),
    "bij,bkj->bki": ([2, 3, 4], [2, 5, 4]),
    "bhqd,bhkd->bhqk": ([2, 3, 4, 5], [2, 3, 6, 5]),
    "ij,k->kji": ([3, 4], [2]),
    "ij->ji": ([3, 4],),
}.items():
    case("Einsum", lambda *xs, eq=_eq: tf.einsum(eq, *xs), [_data(s, F32, i) for i, s in enumerate(_shapes)],
         id=f"Einsum-{_eq}")
_lower = np.tril(_data([2, 4, 4], F64, 3)) + 4 * np.eye(4)
for _lo in (True, False):
    for _adj in (False, True):
        case("MatrixTriangularSolve",
             lambda m, r, lo=_lo, adj=_adj: tf.linalg.triangular_solve(m, r, lower=lo, adjoint=adj),
             [_lower if _lo else np.swapaxes(_lower, -1, -2), _data([2, 4, 3], F64, 1)],
             refused={1: "couples the rows"}, id=f"MatrixTriangularSolve-lower{_lo:d}-adj{_adj:d}")
case("MatrixTriangularSolve", tf.linalg.triangular_solve, [_lower[0], _data([2, 4, 3], F64, 1)],
     refused={1: "couples the rows"}, id="MatrixTriangularSolve-broadcast-matrix")
case("MatrixSolve", lambda m, r: tf.linalg.solve(m, r, adjoint=True), [_lower + _lower.swapaxes(1, 2),
                                                                      _data([2, 4, 3], F64, 1)],
     refused={1: "couples the rows"})
_spd = _lower @ _lower.swapaxes(1, 2)
case("Cholesky", tf.linalg.cholesky, [_spd], refused={1: "couples every entry", 2: "couples every entry"})
case("MatrixInverse", tf.linalg.inv, [_spd], refused={1: "couples every entry", 2: "couples every entry"})
case("MatrixDiagPartV3", tf.linalg.diag_part, [_data([2, 4, 5], F32)], refused={1: "diagonal axis"})
case("MatrixDiagPartV3", lambda x: tf.linalg.diag_part(x, k=(-1, 1)), [_data([2, 4, 5], F32)],
     refused={1: "diagonal axis", 2: "diagonal axis"}, id="MatrixDiagPartV3-band")
case("MatrixDiagV3", tf.linalg.diag, [_data([2, 4], F32)])          # rows and columns of the main diagonal's
case("MatrixDiagV3", lambda x: tf.linalg.diag(x, num_rows=4, num_cols=6, padding_value=-1.0), [_data([2, 4], F32)],
     id="MatrixDiagV3-wide-padded")
case("MatrixDiagV3", lambda x: tf.linalg.diag(x, k=1), [_data([2, 4], F32)],
     refused={1: "diagonal axis", 2: "diagonal axis"}, id="MatrixDiagV3-superdiagonal")
case("MatrixSetDiagV3", tf.linalg.set_diag, [_data([2, 4, 6], F32), _data([2, 4], F32, 1)])
case("MatrixSetDiagV3", lambda x, d: tf.linalg.set_diag(x, d, k=1), [_data([2, 4, 6], F32), _data([2, 4], F32, 1)],
     refused={1: "off the main diagonal", 2: "off the main diagonal"}, id="MatrixSetDiagV3-superdiagonal")
case("MatrixDiagPart", lambda x: _raw("MatrixDiagPart", x), [_data([2, 3, 4, 4], I32)], refused={2: "diagonal axis"})
case("MatrixDiag", lambda x: _raw("MatrixDiag", x), [_data([2, 3, 4], I32)])

# Reductions, normalisations, selections: [3, 4, 5].
for _t, _dt in (("Sum", F32), ("Sum", I32), ("Mean", F32), ("Max", I32), ("Min", F32), ("Prod", I32),
                ("All", BOOL), ("Any", BOOL), ("EuclideanNorm", F32)):
    _x = [_data([3, 4, 5], _dt)]
    case(_t, lambda x, t=_t: _raw(t, x, [1]), _x, id=f"{_t}-{_dt.name}")
    case(_t, lambda x, t=_t: _raw(t, x, [1], keep_dims=True), _x, refused={1: f"axis 1 is reduced by `{_t}`"},
         id=f"{_t}-{_dt.name}-keepdims")
case("Sum", lambda x: tf.reduce_sum(x, [0, -1], keepdims=True), [_data([3, 4, 5], F32)],
     refused={0: "axis 0 is reduced by `Sum`", 2: "axis 2 is reduced by `Sum`"}, id="Sum-two-axes-keepdims")
case("Mean", lambda x: tf.reduce_mean(x, axis=-1), [_data([3, 4, 5], F64)], id="Mean-last")
case("ArgMax", lambda x: tf.argmax(x, axis=1), [_data([3, 4, 5], F32)])
case("ArgMin", lambda x: tf.argmin(x, axis=-1, output_type=I32), [_data([3, 4, 5], I32, high=100)])
for _t in ("Softmax", "LogSoftmax"):
    case(_t, lambda x, t=_t: _raw(t, x), [_data([3, 4, 5], F32)], refused={2: f"`{_t}` normalises over axis 2"})
for _k in (0, 1):
    case("SparseSoftmaxCrossEntropyWithLogits",
         lambda x, y, k=_k: _raw("SparseSoftmaxCrossEntropyWithLogits", x, y)[k],
         [_data([6, 5], F32), _data([6], I32, low=0, high=5)], output_index=_k,
         refused={1: "`SparseSoftmaxCrossEntropyWithLogits` normalises over axis 1"} if _k else {},
         id=f"SparseSoftmaxCrossEntropyWithLogits-output{_k}")
    case("SoftmaxCrossEntropyWithLogits",
         lambda x, y, k=_k: _raw("SoftmaxCrossEntropyWithLogits", x, y)[k],
         [_data([6, 5], F64), _data([6, 5], F64, seed=1, low=0.0, high=1.0)], output_index=_k,
         refused={1: "`SoftmaxCrossEntropyWithLogits` normalises over axis 1"} if _k else {},
         id=f"SoftmaxCrossEntropyWithLogits-output{_k}")
    case("TopKV2", lambda x, k=_k: tf.math.top_k(x, 2)[k], [_data([3, 4, 6], F32)], output_index=_k,
         refused={2: "`TopKV2` selects along axis 2"}, id=f"TopKV2-output{_k}")
case("InTopKV2", lambda p, t: tf.math.in_top_k(t, p, 2), [_data([6, 5], F32), _data([6], I32, low=0, high=5)])
# Fused batch norm: tf_keras' LayerNormalization (training statistics over [1, B * L, D, 1] in NCHW),
# the batch norm of a convolution (NHWC), inference with given statistics, and the gradient.
_empty = tf.zeros([0], F32)
for _k in (0, 1, 2):
    case("FusedBatchNormV3", lambda x, k=_k: _raw("FusedBatchNormV3", x, tf.ones([6]), tf.zeros([6]), _empty, _empty,
                                                  data_format="NCHW", is_training=True, epsilon=1e-3)[k],
         [_data([1, 6, 5, 1], F32)], output_index=_k,
         refused={0: "normalises over axis 0", 2: "normalises over axis 2", 3: "normalises over axis 3"} if _k == 0
         else {}, id=f"FusedBatchNormV3-layer-norm-output{_k}")
case("FusedBatchNormV3", lambda x, g, b: _raw("FusedBatchNormV3", x, g, b, _empty, _empty, data_format="NHWC",
                                              is_training=True, epsilon=1e-3)[0],
     [_data([2, 3, 4, 5], F32), _data([5], F32, seed=1), _data([5], F32, seed=2)],
     refused={a: f"normalises over axis {a}" for a in (0, 1, 2)}, id="FusedBatchNormV3-NHWC")
case("FusedBatchNormV3", lambda x, m, v: _raw("FusedBatchNormV3", x, tf.ones([5]), tf.zeros([5]), m, v,
                                              data_format="NHWC", is_training=False, epsilon=1e-3)[0],
     [_data([2, 3, 4, 5], F32), _data([5], F32, seed=1), _data([5], F32, seed=2)], id="FusedBatchNormV3-inference")


for _t, _g in (("FusedBatchNorm", "FusedBatchNormGrad"), ("FusedBatchNormV2", "FusedBatchNormGradV2")):
    case(_t, lambda x, t=_t: _raw(t, x, tf.ones([6]), tf.zeros([6]), _empty, _empty, data_format="NCHW",
                                  is_training=True, epsilon=1e-3)[1],
         [_data([1, 6, 5, 1], F32)], output_index=1, id=f"{_t}-mean")
    case(_g, lambda dy, x, t=_t, g=_g: _raw(g, dy, x, tf.ones([6]),
                                            *_raw(t, x, tf.ones([6]), tf.zeros([6]), _empty, _empty,
                                                  data_format="NCHW", is_training=True, epsilon=1e-3)[3:5],
                                            data_format="NCHW", is_training=True, epsilon=1e-3)[0],
         [_data([1, 6, 5, 1], F32, seed=3), _data([1, 6, 5, 1], F32)],
         refused={a: "sums its scale and offset gradients" for a in (0, 2, 3)}, id=f"{_g}")


def _batch_norm_grad(dy, x):
    y, mean, var, r1, r2, r3 = _raw("FusedBatchNormV3", x, tf.ones([6]), tf.zeros([6]), _empty, _empty,
                                    data_format="NCHW", is_training=True, epsilon=1e-3)
    return _raw("FusedBatchNormGradV3", dy, x, tf.ones([6]), r1, r2, r3, data_format="NCHW", is_training=True,
                epsilon=1e-3)


for _k in (0, 1, 2):
    case("FusedBatchNormGradV3", lambda dy, x, k=_k: _batch_norm_grad(dy, x)[k],
         [_data([1, 6, 5, 1], F32, seed=3), _data([1, 6, 5, 1], F32)], output_index=_k,
         refused={a: "sums its scale and offset gradients" for a in (0, 2, 3)} if _k == 0 else {},
         id=f"FusedBatchNormGradV3-output{_k}")
for _t, _fn in (("Cumsum", tf.math.cumsum), ("Cumprod", tf.math.cumprod),
                ("CumulativeLogsumexp", tf.math.cumulative_logsumexp)):
    case(_t, lambda x, fn=_fn: fn(x, axis=1, exclusive=True), [_data([3, 4, 5], F32)],
         refused={1: f"`{_t}` accumulates along axis 1"}, id=f"{_t}")
case("Cumsum", lambda x: tf.math.cumsum(x, axis=-1, reverse=True), [_data([3, 4, 5], I32)],
     refused={2: "accumulates"}, id="Cumsum-i32-last")

# Layout.
_x3 = [_data([3, 4, 5], F32)]
_i3 = [_data([3, 4, 5], I32)]
case("Bitcast", lambda x: tf.bitcast(x, tf.int32), _x3)
case("Bitcast", lambda x: tf.bitcast(x, tf.int8), _x3, refused={3: "from the element bytes"}, id="Bitcast-wider")
case("Bitcast", lambda x: tf.bitcast(x, tf.int32), [_data([3, 4, 2], tf.int16)], id="Bitcast-narrower")
case("Transpose", lambda x: tf.transpose(x, [2, 0, 1]), _x3)
case("Transpose", lambda x: tf.transpose(x, [1, 0, 2]), _i3, id="Transpose-i32")
case("ConjugateTranspose", lambda x: _raw("ConjugateTranspose", x, [2, 0, 1]), _x3)
# By factors: axis 1 of [3, 2, 2, 5] is the outer factor of 4 (c rows are one run of 2c), axis 2 its
# inner factor (c rows are 2 runs of c), as is axis 1 of [6, 2, 5]; axis 1 of [3, 20] and axis 0 of
# [12, 5] span two input axes, and axis 0 of [6, 2, 5] is 3 and half of 4: refused.
case("Reshape", lambda x: tf.reshape(x, [3, 20]), _x3, refused={1: "within one input axis"})
case("Reshape", lambda x: tf.reshape(x, [-1, 5]), _i3, refused={0: "within one input axis"}, id="Reshape-minus1")
case("Reshape", lambda x: tf.reshape(x, [3, 1, -1, 5]), _x3, refused={1: "does not keep axis 1"},
     id="Reshape-unit")
case("Reshape", lambda x: tf.reshape(x, [3, 2, 2, 5]), _x3, id="Reshape-split-middle")
case("Reshape", lambda x: tf.reshape(x, [6, 2, 5]), _x3, refused={0: "within one input axis"},
     id="Reshape-merge-split")
case("Reshape", lambda x: tf.reshape(x, [3, 4, 5, 1]), _x3, refused={3: "does not keep"}, id="Reshape-trailing")
case("ExpandDims", lambda x: tf.expand_dims(x, 1), _x3, refused={1: "unit axis `ExpandDims` inserts"})
case("ExpandDims", lambda x: tf.expand_dims(x, -1), _i3, refused={3: "unit axis"}, id="ExpandDims-last")
case("Squeeze", lambda x: tf.squeeze(x, [1]), [_data([3, 1, 4, 1], F32)])
case("Squeeze", tf.squeeze, [_data([3, 1, 4, 1], I32)], chunk=1, id="Squeeze-all-chunk1")
case("Squeeze", lambda x: tf.squeeze(x, [-1]), [_data([3, 4, 1], F32)], chunk=1, id="Squeeze-last-chunk1")
for _name, _fn, _refused in (
    ("x[:, None]", lambda x: x[:, None], {1: "unit axis that `StridedSlice` inserts"}),
    ("x[..., None]", lambda x: x[..., None], {3: "unit axis"}),
    ("x[None]", lambda x: x[None], {0: "unit axis"}),
    ("x[:, 1:3]", lambda x: x[:, 1:3], {1: "takes [1:3:1] of axis 1"}),
    ("x[1, :, ::1]", lambda x: x[1, :, ::1], {}),
    ("x[:, ::-1]", lambda x: x[:, ::-1], {1: "not the whole split axis with stride 1"}),
    ("x[0:3, :, -5:]", lambda x: x[0:3, :, -5:], {}),
    ("x[0:100, -100:]", lambda x: x[0:100, -100:], {}),
    ("x[..., 1:3, :]", lambda x: x[..., 1:3, :], {1: "takes [1:3:1]"}),
    ("x[:, None, ..., 2]", lambda x: x[:, None, ..., 2], {1: "unit axis"}),
    ("x[..., ::2]", lambda x: x[..., ::2], {2: "[0:5:2]"}),
    ("x[None, ..., None, 1:]", lambda x: x[None, ..., None, 1:], {0: "unit axis", 3: "unit axis", 4: "[1:5:1]"}),
):
    case("StridedSlice", _fn, _x3, refused=_refused, id=f"StridedSlice-{_name}")
case("StridedSlice", lambda x: x[:, 2], [_data([3, 4], I32)], id="StridedSlice-i32-shrink")
case("Slice", lambda x: tf.slice(x, [0, 1, 0], [-1, 2, 5]), _x3, refused={1: "takes [1, +2] of axis 1"})
case("Slice", lambda x: tf.slice(x, [0, 0, 2], [3, 4, -1]), _i3, refused={2: "not the whole"}, id="Slice-i32")
case("ConcatV2", lambda x, y: tf.concat([x, y], 1), [_data([3, 2, 5], F32), _data([3, 4, 5], F32, 1)],
     refused={1: "concatenates along axis 1"})
case("ConcatV2", lambda x, y, z: tf.concat([x, y, z], -1), [_data([3, 4, i + 1], I32, i) for i in range(3)],
     refused={2: "concatenates along axis 2"}, id="ConcatV2-i32-last")
case("Pad", lambda x: tf.pad(x, [[0, 0], [1, 2], [0, 0]]), _x3, refused={1: "pads axis 1, the split axis, by (1, 2)"})
case("PadV2", lambda x: tf.pad(x, [[0, 0], [0, 0], [0, 1]], constant_values=7), _i3, refused={2: "pads axis 2"})
case("MirrorPad", lambda x: tf.pad(x, [[1, 1], [0, 0], [0, 0]], mode="REFLECT"), _x3, refused={0: "pads axis 0"})
# A dilated convolution's blocks: [4, 6, 5, 3] padded to [4, 6, 6, 3] and moved into the batch by
# blocks of [2, 3] ([24, 3, 2, 3]), and back.  Along the whole batch of blocks: refused (a row of it is
# one block of one example); the batch back, from rows of every block (Factor(6, 1)); channels as they are.
case("SpaceToBatchND", lambda x: tf.space_to_batch_nd(x, [2, 3], [[0, 0], [1, 0]]), [_data([4, 6, 5, 3], F32)],
     refused={0: "not within the batch its blocks are moved along", 1: "moves blocks of axis 1",
              2: "moves blocks of axis 2"})
case("BatchToSpaceND", lambda x: tf.batch_to_space(x, [2, 3], [[0, 0], [1, 0]]), [_data([24, 3, 2, 3], F32)],
     refused={1: "moves blocks of axis 1", 2: "moves blocks of axis 2"})
case("GatherV2", lambda p, i: tf.gather(p, i, axis=1), [_data([5, 4, 3], F32), _data([2, 6], I32, 1, low=0, high=4)])
case("GatherV2", lambda p, i: tf.gather(p, i, axis=0), [_data([5, 3], I32), _data([4], I32, 1, low=0, high=5)],
     id="GatherV2-i32-axis0")
case("GatherV2", lambda p, i: tf.gather(p, i, axis=1, batch_dims=1),
     [_data([3, 5, 4], F32), _data([3, 2], I32, 1, low=0, high=5)], id="GatherV2-batch_dims1")
case("GatherV2", lambda p, i: tf.gather(p, i, axis=2, batch_dims=-1),
     [_data([3, 2, 5, 4], F32), _data([3, 2, 6], I32, 1, low=0, high=5)], id="GatherV2-batch_dims-1")
case("Tile", lambda x: tf.tile(x, [1, 2, 1]), _x3, refused={1: "repeats axis 1, the split axis, 2 times"})
# A broadcast tiled (a mean's gradient: ones [1, 1] tiled to the input's shape): split along the
# tiled axis too, the tile rebuilt with the chunk's multiple.
case("Tile", lambda x: tf.tile(x, [2, 4, 1]), [_data([3, 1, 5], F32)], id="Tile-of-a-broadcast",
     refused={0: "repeats axis 0, the split axis, 2 times"})
case("BroadcastTo", lambda x: tf.broadcast_to(x, [3, 4, 5]), [_data([4, 1], F32)])
case("BroadcastTo", lambda x: tf.broadcast_to(x, [2, 3, 4]), [_data([3, 1], I32)], id="BroadcastTo-i32")
case("Fill", lambda: tf.fill([3, 4], 2.5), [])
case("Fill", lambda v: tf.fill([3, 4, 2], v), [np.int32(3)], id="Fill-i32-tensor-value")
case("Pack", lambda x, y: tf.stack([x, y], axis=1), [_data([3, 5], F32), _data([3, 5], F32, 1)],
     refused={1: "`Pack` stacks along axis 1"})
case("Pack", lambda x, y: tf.stack([x, y], axis=-1), [_data([3, 5], I32), _data([3, 5], I32, 1)],
     refused={2: "stacks"}, id="Pack-i32-last")
for _k in (0, 2):
    case("Unpack", lambda x, k=_k: tf.unstack(x, axis=1)[k], _x3, output_index=_k, id=f"Unpack-output{_k}")
case("Unpack", lambda x: tf.unstack(x, axis=-1)[1], _i3, output_index=1, id="Unpack-i32-last")
case("Split", lambda x: tf.split(x, 2, axis=1)[1], _x3, output_index=1, refused={1: "`Split` splits along axis 1"})
case("SplitV", lambda x: tf.split(x, [1, 4], axis=-1)[0], _i3, refused={2: "`SplitV` splits along axis 2"})
case("OneHot", lambda i: tf.one_hot(i, 5), [_data([3, 4], I32, low=0, high=5)], refused={2: "depth axis"})
case("OneHot", lambda i: tf.one_hot(i, 5, axis=0, dtype=I32), [_data([3, 4], I32, low=0, high=5)],
     refused={0: "depth axis of `OneHot`"}, id="OneHot-axis0")
case("ReverseV2", lambda x: tf.reverse(x, [1]), _x3, refused={1: "reverses axis 1"})

# Convolutions and pooling: the batch and the channels split, the spatial axes (windows) refused.
_img, _vol = _data([3, 6, 6, 4], F64, low=-0.9), _data([2, 5, 5, 5, 3], F32, low=-0.9)
_WINDOW = "slides a window"
_2D, _3D = {1: _WINDOW, 2: _WINDOW}, {1: _WINDOW, 2: _WINDOW, 3: _WINDOW}
_P2, _P3 = {"ksize": [1, 2, 2, 1], "strides": [1, 2, 2, 1], "padding": "VALID"}, \
    {"ksize": [1, 2, 2, 2, 1], "strides": [1, 2, 2, 2, 1], "padding": "VALID"}
case("Conv2D", lambda x, w: tf.nn.conv2d(x, w, 1, "VALID"), [_img, _data([3, 3, 4, 5], F64, 1, low=-0.9)],
     refused=_2D)
case("Conv2D", lambda x, w: tf.nn.conv2d(x, w, 2, "SAME"), [_img, _data([3, 3, 4, 5], F64, 1)], refused=_2D,
     id="Conv2D-strided-same")
case("Conv3D", lambda x, w: tf.nn.conv3d(x, w, [1] * 5, "VALID"), [_vol, _data([2, 2, 2, 3, 4], F32, 1)],
     refused=_3D)
case("DepthwiseConv2dNative", lambda x, w: tf.nn.depthwise_conv2d(x, w, [1] * 4, "VALID"),
     [_img, _data([3, 3, 4, 2], F64, 1)], refused={**_2D, 3: "interleaves input channels"})
case("MaxPool", lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), [_img], refused=_2D)
case("AvgPool", lambda x: tf.nn.avg_pool2d(x, 3, 1, "SAME"), [_img], refused=_2D)
case("MaxPool3D", lambda x: tf.nn.max_pool3d(x, 2, 2, "VALID"), [_vol], refused=_3D)
case("AvgPool3D", lambda x: tf.nn.avg_pool3d(x, 2, 1, "SAME"), [_vol], refused=_3D)
case("MaxPoolGrad", lambda x, dy: _raw("MaxPoolGrad", x, tf.nn.max_pool2d(x, 2, 2, "VALID"), dy, **_P2),
     [_img, _data([3, 3, 3, 4], F64, 1)], refused=_2D)
case("MaxPool3DGrad", lambda x, dy: _raw("MaxPool3DGrad", x, tf.nn.max_pool3d(x, 2, 2, "VALID"), dy, **_P3),
     [_vol, _data([2, 2, 2, 2, 3], F32, 1)], refused=_3D)
case("AvgPoolGrad", lambda dy: _raw("AvgPoolGrad", [3, 6, 6, 4], dy, **_P2), [_data([3, 3, 3, 4], F64, 1)],
     refused=_2D)
case("AvgPool3DGrad", lambda dy: _raw("AvgPool3DGrad", [2, 5, 5, 5, 3], dy, **_P3), [_data([2, 2, 2, 2, 3], F32, 1)],
     refused=_3D)
case("Conv2DBackpropInput", lambda w, dy: _raw("Conv2DBackpropInput", [3, 6, 6, 4], w, dy, strides=[1] * 4,
                                               padding="VALID"),
     [_data([3, 3, 4, 5], F64, 1), _data([3, 4, 4, 5], F64, 2)], refused=_2D)
case("Conv3DBackpropInputV2", lambda w, dy: _raw("Conv3DBackpropInputV2", [2, 5, 5, 5, 3], w, dy, strides=[1] * 5,
                                                 padding="VALID"),
     [_data([2, 2, 2, 3, 4], F32, 1), _data([2, 4, 4, 4, 4], F32, 2)], refused=_3D)
case("DepthwiseConv2dNativeBackpropInput",
     lambda w, dy: _raw("DepthwiseConv2dNativeBackpropInput", [3, 6, 6, 4], w, dy, strides=[1] * 4, padding="VALID"),
     [_data([3, 3, 4, 2], F64, 1), _data([3, 4, 4, 8], F64, 2)], refused={**_2D, 3: "interleaves input channels"})
case("Conv2DBackpropFilter", lambda x, dy: _raw("Conv2DBackpropFilter", x, [3, 3, 4, 5], dy, strides=[1] * 4,
                                                padding="VALID"),
     [_img, _data([3, 4, 4, 5], F64, 2)], refused={0: "sums over the batch", 1: "sums over the batch"})
case("Conv3DBackpropFilterV2", lambda x, dy: _raw("Conv3DBackpropFilterV2", x, [2, 2, 2, 3, 4], dy, strides=[1] * 5,
                                                  padding="VALID"),
     [_vol, _data([2, 4, 4, 4, 4], F32, 2)], refused={a: "sums over the batch" for a in (0, 1, 2)})

# Contractions on a smaller operand may be blocked differently by the kernel.
CONTRACTION_RTOL = {"MatMul": _MM, "BatchMatMulV2": _MM, "BatchMatMulV3": _MM, "BatchMatMul": 1e-12, "Einsum": _MM,
                    "MatrixTriangularSolve": 1e-12, "MatrixSolve": 1e-12, "Cholesky": 1e-12, "MatrixInverse": 1e-12,
                    # convolutions in float64 (the 3-D ones in float32: TensorFlow's CPU kernels)
                    **dict.fromkeys(["Conv2D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
                                     "DepthwiseConv2dNativeBackpropInput", "Conv2DBackpropFilter"], 1e-12),
                    **dict.fromkeys(["Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "AvgPool3D",
                                     "AvgPool3DGrad"], 1e-5)}


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_rule_computes_exactly_the_slice(c):
    check(c, rtol=CONTRACTION_RTOL.get(c.op_type))


def test_every_rule_is_exercised():
    missing = set(RULES) - {c.op_type for c in CASES}
    assert not missing, f"rules without a case: {sorted(missing)}"


# --- what each rule tells the splitter --------------------------------------------------------------


def _op(fn, *specs, op_type=None):
    graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
    ops = [o for o in graph.get_operations() if o.type == op_type] if op_type else None
    return ops[-1] if ops else graph.outputs[0].op.inputs[0].op  # the op the function's Identity reads


def test_matmul_row_axis_splits_only_the_left_operand():
    op = _op(tf.linalg.matmul, tf.TensorSpec([3, 5]), tf.TensorSpec([5, 4]))
    assert propagate(op, 0, 0) == Propagation((0, None), (0,))
    assert propagate(op, 0, 1) == Propagation((None, 1), (1,))


def test_batch_matmul_broadcast_operand_is_used_whole():
    op = _op(tf.linalg.matmul, tf.TensorSpec([2, 1, 3, 6]), tf.TensorSpec([5, 6, 4]))
    assert propagate(op, 0, 0).input_axes == (0, None)  # y has no axis 0
    assert propagate(op, 0, 1).input_axes == (None, 0)  # x has 1 there


def test_top_k_splits_both_outputs_and_keeps_k_whole():
    op = _op(lambda x: tf.math.top_k(x, 2).values, tf.TensorSpec([3, 6]))
    prop = propagate(op, 1, 0)
    assert (prop.input_axes, prop.output_axes) == ((0, None), (0, 0))
    assert not propagate(op, 0, 1)


def test_top_k_slices_are_blocked_where_that_is_faster():
    """A slice's top-k is rebuilt through its blocks' maxima over a long row, cloned over a short one."""
    for n, blocked in ((6, False), (4096, True)):
        op = _op(lambda x: tf.math.top_k(x, 2), tf.TensorSpec([3, n]), op_type="TopKV2")
        g = tf.Graph()
        with g.as_default():
            x = -tf.abs(tf.random.stateless_normal([2, n], seed=[1, 2]))       # negative scores, as a kNN's
            built = propagate(op, 0, 0).build(op, [x, tf.constant(2)], 2)
            expected = tf.math.top_k(x, 2)
        assert any(o.type == "Max" for o in g.get_operations()) == blocked
        with tf.compat.v1.Session(graph=g) as sess:
            got, want = sess.run([built, list(expected)])
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_reshape_maps_the_axis_through_a_merge_of_others():
    op = _op(lambda x: tf.reshape(x, [12, 5]), tf.TensorSpec([3, 4, 5]))
    assert propagate(op, 0, 1).input_axes == (2, None)


def test_reshape_maps_the_split_axis_by_its_factors():
    # Keras' Dense on [B, L, D]: [B * L, E] -> [B, L, E].  A batch row is 512 rows of the input, one
    # run; a sequence row is 4 rows, 512 apart.
    unmerge = _op(lambda x: tf.reshape(x, [4, 512, 8]), tf.TensorSpec([2048, 8]))
    prop = propagate(unmerge, 0, 0)
    assert (prop.input_axes, prop.output_axes, prop.factor(0)) == ((0, None), (0,), Factor(1, 512))
    assert (propagate(unmerge, 0, 1).input_axes, propagate(unmerge, 0, 1).factor(0)) == ((0, None), Factor(4, 1))
    # ... and [B, L, D] -> [B * L, D]: the merged rows hold the batch or the sequence at the factor
    # they were reached with, which is the whole axis of one input axis.
    merge = _op(lambda x: tf.reshape(x, [2048, 8]), tf.TensorSpec([4, 512, 8]))
    assert propagate(merge, 0, 0, factor=Factor(1, 512)).input_axes == (0, None)
    assert propagate(merge, 0, 0, factor=Factor(1, 512)).factor(0) == UNIT
    assert propagate(merge, 0, 0, factor=Factor(4, 1)).input_axes == (1, None)
    # All 2048 merged rows as the split axis span both input axes.
    assert "within one input axis" in propagate(merge, 0, 0).reason


def _rows(n_axis: int, factor: Factor, start: int, chunk: int) -> list[int]:
    """The rows of an axis of ``n_axis`` that rows ``start .. start + chunk - 1`` of a split axis lying
    in it at ``factor`` are, in order (the definition, written out)."""
    n = n_axis // (factor.outer * factor.inner)
    return [o * n * factor.inner + r * factor.inner + i
            for o in range(factor.outer) for r in range(start, start + chunk) for i in range(factor.inner)]


def _take(x: np.ndarray, axis: int, factor: Factor, start: int, chunk: int) -> np.ndarray:
    return np.take(x, _rows(x.shape[axis], factor, start, chunk), axis=axis)


def _flat(shape, axis: int, factor: Factor, start: int, chunk: int) -> set:
    """The flat indices of a slice of an array of ``shape``."""
    return set(_take(np.arange(math.prod(shape)).reshape(shape), axis, factor, start, chunk).reshape(-1).tolist())


@pytest.mark.parametrize("before, after", [
    ([2048, 8], [4, 512, 8]), ([4, 512, 8], [2048, 8]), ([6, 4, 10], [24, 2, 5]), ([24, 2, 5], [6, 4, 10]),
    ([2, 3, 4, 5], [6, 20]), ([6, 20], [2, 3, 4, 5]), ([12, 10], [3, 4, 2, 5]), ([3, 4, 2, 5], [12, 10]),
])
def test_a_reshape_maps_every_factor_it_can_and_only_those(before, after):
    """For every output axis and every factor the split axis can lie at in it: what the rule gives
    rebuilds the slice exactly (the slices of both sides are the same elements in the same order);
    what it refuses no input axis holds at any factor (the same flat indices, searched by brute force)."""
    x = np.arange(math.prod(before), dtype=np.float32).reshape(before)
    op = _op(lambda t: tf.reshape(t, after), tf.TensorSpec(before))
    for axis, size in enumerate(after):
        for outer in range(1, size + 1):
            for inner in range(1, size // outer + 1):
                if size % (outer * inner) or size // (outer * inner) < 2:
                    continue
                factor, n = Factor(outer, inner), size // (outer * inner)
                start, chunk = n // 3, max(1, n // 2)
                want = _take(x.reshape(after), axis, factor, start, chunk)
                prop = propagate(op, 0, axis, factor=factor)
                if prop:
                    b, f = prop.input_axes[0], prop.factor(0, factor)
                    got = prop.build(op, [tf.constant(_take(x, b, f, start, chunk))], factor.rows(chunk))[0]
                    np.testing.assert_array_equal(got.numpy(), want, err_msg=f"axis {axis} at {factor}")
                    continue
                target = _flat(after, axis, factor, start, chunk)
                for b, d in enumerate(before):
                    for o in (o for o in range(1, d + 1) if d % (o * n) == 0):
                        assert _flat(before, b, Factor(o, d // (o * n)), start, chunk) != target, (
                            f"axis {axis} at {factor} refused, but input axis {b} holds it: {prop.reason}")


def test_space_to_batch_gives_the_rows_of_every_block_for_a_slice_of_the_batch():
    """``SpaceToBatchND``'s batch, reached at the factor ``BatchToSpaceND`` puts the split batch at (the
    blocks outer, block-major): a slice of the input's rows gives exactly those rows of its output."""
    x = np.arange(4 * 6 * 5 * 3, dtype=np.float32).reshape([4, 6, 5, 3])
    op = _op(lambda t: tf.space_to_batch_nd(t, [2, 3], [[0, 0], [1, 0]]), tf.TensorSpec([4, 6, 5, 3]))
    back = _op(lambda t: tf.batch_to_space(t, [2, 3], [[0, 0], [1, 0]]), tf.TensorSpec([24, 3, 2, 3]))
    assert propagate(back, 0, 0).factor(0) == Factor(6, 1)
    for factor in (Factor(6, 1), Factor(12, 1)):
        n = 24 // factor.outer
        prop = propagate(op, 0, 0, factor=factor)
        assert prop.input_axes == (0, None, None) and prop.factor(0, factor) == Factor(factor.outer // 6, 1)
        start, chunk = n // 3, max(1, n // 2)
        want = _take(tf.space_to_batch_nd(x, [2, 3], [[0, 0], [1, 0]]).numpy(), 0, factor, start, chunk)
        rows = tf.constant(_take(x, 0, prop.factor(0, factor), start, chunk))
        rebuilt = functools.partial(prop.build, op, chunk=factor.rows(chunk))
        got = tf.function(lambda r, b=rebuilt: b([r, tf.constant([2, 3]), tf.constant([[0, 0], [1, 0]])])[0],
                          autograph=False)(rows)
        np.testing.assert_array_equal(got.numpy(), want)
    # The split axis at rows of one block only: no rows of the input give them.
    assert "not within the batch" in propagate(op, 0, 0, factor=Factor(4, 1)).reason


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn, op_type, spec", [
    (tf.linalg.det, "MatrixDeterminant", [2, 4, 4]),
    (lambda x: tf.linalg.qr(x)[0], "Qr", [2, 4, 4]),
])
def test_no_rule(fn, op_type, spec):
    op = _op(fn, tf.TensorSpec(spec), op_type=op_type)
    result = propagate(op, 0, 0)
    assert isinstance(result, Refusal) and not result
    assert result.reason == f"cannot split through `{op_type}`: no rule"


def test_cholesky_reason_is_exact():
    op = _op(tf.linalg.cholesky, tf.TensorSpec([4, 4]))
    assert propagate(op, 0, 1) == Refusal("`Cholesky` couples every entry of its matrix (axis 1): only its batch "
                                          "axes are split")


@pytest.mark.parametrize("fn, op_type", [
    (lambda x: x + tf.random.uniform([3, 4]), "RandomUniform"),
    (lambda x: x + tf.random.normal([3, 4]), "RandomStandardNormal"),
    (lambda x: tf.debugging.check_numerics(x, "bad"), "CheckNumerics"),
])
def test_stateful_op_is_refused_by_name(fn, op_type):
    op = _op(fn, tf.TensorSpec([3, 4]), op_type=op_type)
    result = propagate(op, 0, 0)
    assert not result
    assert f"`{op_type}` ({op.name})" in result.reason and "stateful" in result.reason


def test_print_and_assert_are_refused():
    def fn(x):
        tf.print(x)
        tf.raw_ops.Assert(condition=tf.reduce_all(x > 0), data=[x])  # tf.debugging.Assert nests it in a cond
        return x

    graph = tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec([3])).graph
    found = {op.type: propagate(op, 0, 0) for op in graph.get_operations() if op.type in ("PrintV2", "Assert")}
    assert set(found) == {"PrintV2", "Assert"}  # neither has an output: refused before the index is checked
    assert all("stateful" in r.reason for r in found.values())


def test_variable_ops():
    v = tf.Variable(tf.ones([3, 4]))
    graph = tf.function(lambda: v.assign_add(v.read_value() * 2.0) + 0.0).get_concrete_function().graph
    types = {op.type: op for op in graph.get_operations()}
    read = types["ReadVariableOp"]
    assert leaf_kind(read) == "variable read"
    assert "is a leaf (variable read)" in propagate(read, 0, 0).reason
    assert "stateful" in propagate(types["AssignAddVariableOp"], 0, 0).reason


@pytest.mark.parametrize("fn, spec, axis, reason", [
    (lambda x: tf.reduce_sum(x, 1, keepdims=True), [3, 4], 1, "axis 1 is reduced by `Sum`"),
    (tf.nn.softmax, [3, 4], 1, "`Softmax` normalises over axis 1, the split axis"),
    (lambda x: tf.reshape(x, [6, 2]), [3, 4], 0, "`Reshape` [3, 4] -> [6, 2] does not keep axis 0 (size 6) within "
     "one input axis"),
    (tf.exp, [None, 3], 1, "`Exp` (Exp): input 0 has dynamic shape (None, 3); only the split axis may be dynamic"),
    (lambda x: tf.reshape(x, tf.shape(x)), [None, 3], 1, "dynamic shape"),
    # [n, 4] -> [2n, 2]: both first dimensions unknown, but the axis is merged with another.
    (lambda x: tf.reshape(x, [-1, 2]), [None, 4], 0, "cannot split through `Reshape`"),
    (lambda x: tf.reduce_sum(x, 1), [None, None], 0, "only the split axis may be dynamic"),
])
def test_refusal_reasons(fn, spec, axis, reason):
    op = _op(fn, tf.TensorSpec(spec))
    result = propagate(op, 0, axis)
    assert isinstance(result, Refusal) and not result
    assert reason in result.reason
    assert "\n" not in result.reason


@pytest.mark.parametrize("fn, spec, axis, input_axes", [
    (tf.exp, [None, 3], 0, (0,)),
    (lambda x: tf.reshape(x, [-1, 3, 2]), [None, 6], 0, (0, None)),
    (lambda x: x + tf.ones([1, 3]), [None, 3], 0, (0, None)),
    (lambda x: tf.reduce_sum(x, 1), [None, 3], 0, (0, None)),
])
def test_a_dynamic_split_axis_is_split(fn, spec, axis, input_axes):
    op = _op(fn, tf.TensorSpec(spec))
    result = propagate(op, 0, axis)
    assert result, result
    assert result.input_axes == input_axes


def test_non_constant_arguments_are_refused():
    # (A non-constant permutation or reduction axis already leaves the output's shape dynamic.)
    op = _op(lambda x, a: tf.math.cumsum(x, a), tf.TensorSpec([3, 4]), tf.TensorSpec([], tf.int32))
    assert "the cumulative axis is not a constant" in propagate(op, 0, 0).reason
    op = _op(lambda x, a: tf.reverse(x, a), tf.TensorSpec([3, 4]), tf.TensorSpec([1], tf.int32))
    assert "the list of reversed axes is not a constant" in propagate(op, 0, 0).reason


def test_einsum_refusals():
    op = _op(lambda a, b: tf.einsum("...ij,...jk->...ik", a, b), tf.TensorSpec([2, 3, 4]), tf.TensorSpec([2, 4, 5]))
    assert "ellipsis" in propagate(op, 0, 0).reason
    op = _op(lambda a: _raw("Einsum", [a], equation="iij->ij"), tf.TensorSpec([3, 3, 4]))
    assert "diagonal" in propagate(op, 0, 0).reason


def test_bad_arguments_raise():
    op = _op(tf.exp, tf.TensorSpec([3, 4]))
    with pytest.raises(ValueError, match="axis 2 out of range"):
        propagate(op, 0, 2)
    with pytest.raises(ValueError, match="no output 1"):
        propagate(op, 1, 0)


# --- leaves -----------------------------------------------------------------------------------------


def test_leaf_kinds():
    def fn(x):
        return (tf.constant([1.0, 2.0, 3.0]) + x + tf.fill([3], x[0]) + _raw("ZerosLike", x) + _raw("OnesLike", x)
                + tf.cast(tf.range(3), tf.float32) + _raw("LinSpace", 0.0, 1.0, 3))

    graph = tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec([3])).graph
    kinds = {op.type: leaf_kind(op) for op in graph.get_operations()}
    assert kinds["Const"] == "constant" and kinds["Placeholder"] == "input"
    # Rebuilt per chunk by their rules rather than sliced from a full-size buffer:
    assert kinds["Fill"] is kinds["ZerosLike"] is kinds["OnesLike"] is None
    assert kinds["Range"] == kinds["LinSpace"] == "range"
    assert kinds["AddV2"] is None
    for op in graph.get_operations():
        if op.type in ("Const", "Placeholder", "Range", "LinSpace") and op.outputs[0].shape.rank:
            assert f"is a leaf ({leaf_kind(op)})" in propagate(op, 0, 0).reason


# --- cloning ----------------------------------------------------------------------------------------


def test_clone_captures_outer_tensors_and_drops_control_inputs():
    def fn(x, w):
        with tf.control_dependencies([tf.print(x)]):
            return tf.linalg.matmul(x, w, transpose_b=True)

    graph = tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec([3, 4]), tf.TensorSpec([5, 4])).graph
    op = next(o for o in graph.get_operations() if o.type == "MatMul")
    assert op.control_inputs
    inner = FuncGraph("inner")
    with inner.as_default():
        (out,) = clone_op(op, [inner.capture(op.inputs[0])[:2], op.inputs[1]])
    assert out.graph is inner and out.op.type == "MatMul" and not out.op.control_inputs
    assert out.op.get_attr("transpose_b") and out.shape.as_list() == [2, 5]
    assert len(inner.captures) == 2  # x captured explicitly, w by the clone


def test_rebuilt_ops_run_inside_a_while_loop():
    """The splitter's use: exp(x @ w) over row chunks of 2 in a tf.while_loop, from the rules alone."""
    x, w = _data([6, 4], F64), _data([4, 3], F64, 1)

    @tf.function(autograph=False)
    def run(x, w):
        out = tf.exp(tf.linalg.matmul(x, w))
        exp_op, mm_op = out.op, out.op.inputs[0].op
        chunk = 2

        def body(i, acc):
            start = i * chunk
            mm = propagate(mm_op, 0, 0)
            inputs = [t if a is None else _slice(t, a, start, chunk) for t, a in zip(mm_op.inputs, mm.input_axes)]
            (y,) = mm.build(mm_op, inputs, chunk)
            (z,) = propagate(exp_op, 0, 0).build(exp_op, [y], chunk)
            return i + 1, acc.write(i, z)

        _, acc = tf.while_loop(lambda i, acc: i < 3, body, [0, tf.TensorArray(F64, 3, element_shape=[2, 3])])
        return out, tf.reshape(acc.stack(), [6, 3])

    expected, got = run(x, w)
    np.testing.assert_allclose(got, expected, rtol=1e-13)


# --- property: broadcasting binary ops over random shapes -------------------------------------------

_PROPERTY_OPS = {"AddV2": F32, "Mul": I32, "Maximum": F32, "SquaredDifference": F64, "Less": I32,
                 "FloorMod": I32, "Pow": F32}


@st.composite
def _broadcast_problem(draw):
    out = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    shapes = []
    for _ in range(2):
        drop = draw(st.integers(0, len(out)))
        shapes.append([1 if draw(st.booleans()) else n for n in out[drop:]])
    # The broadcast output may be smaller than ``out`` where both operands have 1 or are short.
    rank = max(len(s) for s in shapes)
    padded = [[1] * (rank - len(s)) + s for s in shapes]
    result = [max(a, b) for a, b in zip(*padded)]
    if not result:
        shapes[0] = [out[-1]]
        result = [out[-1]]
    axis = draw(st.integers(0, len(result) - 1))
    chunk = draw(st.integers(1, result[axis]))
    op_type = draw(st.sampled_from(sorted(_PROPERTY_OPS)))
    return op_type, shapes, axis, chunk, draw(st.floats(0, 1))


@settings(max_examples=25, deadline=None)
@given(_broadcast_problem())
def test_broadcasting_binary_ops_split_exactly(problem):
    op_type, shapes, axis, chunk, fraction = problem
    dtype = _PROPERTY_OPS[op_type]
    x, y = (_data(s, dtype, i, low=1, high=3) for i, s in enumerate(shapes))

    @tf.function(autograph=False)
    def run(x, y):
        out = _raw(op_type, x, y)
        prop = propagate(out.op, 0, axis)
        n = out.shape[axis]
        for t, a in zip(out.op.inputs, prop.input_axes):  # sliced exactly where aligned and not 1
            j = axis - (out.shape.rank - t.shape.rank)
            assert a == (j if j >= 0 and t.shape[j] == n else None)
        start = tf.constant(round(fraction * (n - chunk)))
        sliced = [t if a is None else _slice(t, a, start, chunk) for t, a in zip(out.op.inputs, prop.input_axes)]
        return _slice(out, axis, start, chunk), prop.build(out.op, sliced, chunk)[0]

    expected, got = run(x, y)
    if dtype.is_floating:
        eps = np.finfo(got.numpy().dtype).eps  # see check()
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=4 * eps, atol=4 * eps)
    else:
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
