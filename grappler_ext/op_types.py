"""The vocabulary every pass and analysis shares: op-type sets and the one byte count of a tensor.

A set named here means the same thing everywhere it is read; a module that needs a narrower set
(the reductions XLA:CPU's YNN kernels take) builds it from these, next to the fact it encodes.
"""

from __future__ import annotations

import tensorflow as tf

from grappler_ext import shapes

__all__ = ["MATMULS", "CONVOLUTIONS", "REDUCTIONS", "ARG_REDUCTIONS", "UNARY_ELEMENTWISE", "BROADCASTING_ELEMENTWISE",
           "LOOP_TYPES", "BRANCH_TYPES", "CALL_TYPES", "NOT_CLONED", "ARGUMENT_OPS", "HELD_OPS",
           "PASS_THROUGH", "SHAPE_READERS", "RESERVE_SPACES", "WHOLE_MATRICES", "nbytes", "static_shape_reader",
           "reserve_space"]

# Matrix products TensorFlow emits (``tf.matmul`` on rank 2 and on batches).
MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
# Convolutions (a window over the spatial axes; depthwise: one filter per input channel).
CONVOLUTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative"})
# Reductions with a reduction-indices operand (input 1) whose result is the reduced tensor.
REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any"})
ARG_REDUCTIONS = frozenset({"ArgMax", "ArgMin"})
# Elementwise ops: one output element from the same element of each input (unary), or of each input
# broadcast numpy-style (binary and more).
UNARY_ELEMENTWISE = frozenset((
    "Neg Exp Expm1 Log Log1p Sqrt Rsqrt Square Abs Sign Floor Ceil Round Rint Reciprocal Inv "
    "Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Tanh Sigmoid Relu Relu6 Elu Selu "
    "LeakyRelu Softplus Softsign Erf Erfc Lgamma Digamma IsNan IsInf IsFinite LogicalNot Invert "
    "Identity StopGradient PreventGradient Snapshot Cast ZerosLike OnesLike"
).split())
BROADCASTING_ELEMENTWISE = frozenset((
    "Add AddV2 Sub Mul MulNoNan RealDiv Div DivNoNan FloorDiv FloorMod TruncateDiv TruncateMod Mod "
    "Maximum Minimum Pow SquaredDifference Xdivy Xlogy Xlog1py Atan2 "
    "Equal NotEqual Less LessEqual Greater GreaterEqual LogicalAnd LogicalOr "
    "BitwiseAnd BitwiseOr BitwiseXor LeftShift RightShift "
    "SelectV2 ClipByValue AddN "
    # Gradients of elementwise ops (same shapes): what tf.gradients emits for relu, sigmoid, ...
    "ReluGrad Relu6Grad EluGrad SeluGrad LeakyReluGrad SoftplusGrad SoftsignGrad "
    "SigmoidGrad TanhGrad SqrtGrad RsqrtGrad ReciprocalGrad InvGrad"
).split())
# Control flow: loops, branches and calls, whose bodies are functions of the graph.
LOOP_TYPES = frozenset({"While", "StatelessWhile"})
BRANCH_TYPES = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})
CALL_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# Ops a pass never copies op by op (their bodies would have to be copied too).
NOT_CLONED = LOOP_TYPES | BRANCH_TYPES | CALL_TYPES
# Ops that only pass a value on: a report names the op before them.
PASS_THROUGH = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot", "Reshape", "Squeeze", "ExpandDims"})
# What a program holds whatever a rewrite does: its arguments and its variables' reads (parameters),
# and with them its constants.
ARGUMENT_OPS = frozenset({"Placeholder", "ReadVariableOp"})
HELD_OPS = ARGUMENT_OPS | {"Const"}
# Linear algebra that reads its matrix whole or writes its results whole, whatever is rewritten around
# it: XLA's solvers work on whole matrices ({op type: (the function a person calls, inputs, outputs)}
# held whole; a Cholesky's input is left out, :mod:`grappler_ext.blocked_linalg` computing it block by
# block).  A solve's right-hand side and solution split by columns.
WHOLE_MATRICES = {
    "SelfAdjointEigV2": ("tf.linalg.eigh", (0,), (0, 1)), "Svd": ("tf.linalg.svd", (0,), (0, 1, 2)),
    "Eig": ("tf.linalg.eig", (0,), (0, 1)), "Qr": ("tf.linalg.qr", (0,), (0, 1)),
    "MatrixInverse": ("tf.linalg.inv", (0,), (0,)), "MatrixSolve": ("tf.linalg.solve", (0,), ()),
    "Lu": ("tf.linalg.lu", (0,), (0,)), "MatrixSquareRoot": ("tf.linalg.sqrtm", (0,), (0,)),
    "MatrixDeterminant": ("tf.linalg.det", (0,), ()), "LogMatrixDeterminant": ("tf.linalg.slogdet", (0,), ()),
    "Cholesky": ("tf.linalg.cholesky", (), (0,)),
}
# Ops that read only their input's shape.
SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Tensors of unknown shape that hold nothing: the third reserve space of a fused batch norm (empty on
# CPU and under XLA, whose kernel makes it a constant [0]; cuDNN's workspace on a GPU without XLA),
# passed from the op to its gradient.  (op type, "input" or "output", index)
RESERVE_SPACES = frozenset({("FusedBatchNormV3", "output", 5), ("FusedBatchNormGradV3", "input", 5)})
_RESERVE_READERS = frozenset(op_type for op_type, side, _ in RESERVE_SPACES if side == "input")


def nbytes(t: tf.Tensor) -> int:
    """The bytes of ``t``'s value: elements times the dtype's size; 0 when its shape is not static
    (dimensions known at run time read at the nominal size, :mod:`grappler_ext.shapes`)."""
    return shapes.nbytes(t)


def static_shape_reader(op: tf.Operation) -> bool:
    """A ``Shape``-like op of static shapes: it reads no values (TF's own ops insert them, e.g.
    ``reduce_logsumexp``), and its result is a constant."""
    return op.type in SHAPE_READERS and all(t.shape.is_fully_defined() for t in op.inputs)


def reserve_space(t: tf.Tensor) -> bool:
    """Whether ``t`` is an opaque reserve space (:data:`RESERVE_SPACES`): no bytes XLA keeps, read
    whole, never sliced, whatever its static shape says."""
    if (t.op.type, "output", t.value_index) in RESERVE_SPACES:
        return True
    return any((c.type, "input", i) in RESERVE_SPACES for c in t.consumers() if c.type in _RESERVE_READERS
               for i, x in enumerate(c.inputs) if x is t)
