"""memory_model: the bytes XLA:CPU will need for a traced graph, estimated before compiling.

    peak = parameters + constants + max over the schedule (live temporaries + scratch + outputs so far)

This is an analysis, not a pass: it reads a ``FuncGraph`` with static shapes and changes nothing.
The splitter's planner uses it to choose chunk sizes before anything is compiled;
:func:`tf_memsafe.memory_footprint` (XLA's "Total bytes used") stays the ground truth it is
tested against.

How XLA:CPU (TensorFlow 2.21) counts, measured from its buffer-assignment report:

* entry parameters (placeholders, variables read) and constants larger than a scalar have
  allocations of their own for the whole program;
* outputs and temporaries share memory as their lifetimes allow: a temporary that dies before
  an output is written can sit in the output's allocation (layer norm of a [4096, 512] input:
  the squared deviations and the output share 8 MB); an output that merely returns a parameter
  is a copy (``tf.identity(x)`` costs twice ``x``);
* an elementwise kernel writes its result over an operand that dies there (same shape), so a
  chain of such kernels needs one buffer (``exp(x @ w)`` costs ``x + w + out``).

The model, in three steps:

1. **Rules** (:data:`RULES`, one :class:`Rule` per TF op type, registered together below): each
   op is a parameter, a constant, a bitcast (no bytes: its output shares its input's buffer), a
   loop op (elementwise or layout: fusible), a reduction, or a library call (matmul, Cholesky,
   top-k: its operands must be in memory).  An op type without a rule is *unknown*: it is listed
   in :attr:`Estimate.unknown_ops` and the estimate has no ``peak_bytes``; nothing is guessed
   silently.  Each rule cites the measurement it rests on.
2. **Fusion**, the "fused into consumer" decision, made consumers first: a loop op's output gets
   no buffer when every op reading it will compute it inside its own fusion -- another loop op,
   a reduction that keeps its producers (:func:`reduction_plan`), a small matrix-vector product
   -- and XLA would not refuse to duplicate it: an *expensive* op (``Exp``, ``Tanh``, a division
   by a tensor, a loop-emitted reduction) read by two fusions, or read repeatedly by a
   broadcasting one, is computed once into memory.  A cheap op materialised for one reader is
   recomputed by the fusions of its other readers.  Everything else that makes data has a buffer.
3. **Liveness** over :func:`~grappler_ext.verifier.topological_order`: a buffer is allocated when
   its kernel runs and freed after the last kernel whose fusion reads it (outputs stay to the
   end); an elementwise kernel takes over a dying operand of its shape; library kernels add
   scratch for the duration of the call.

Precision, measured on the workloads of ``tests/grappler_ext/test_memory_model.py``: the
estimate is within 5% of XLA's figure for most of them, and between 0.75x and 1.05x for all (see
the table there).  It is an estimate because the model does not know:

* XLA's scheduler: it orders kernels its own way; the model walks TF's creation order (sums of
  two [2000, 1000] products: XLA computes both products before reducing either, 0.75x);
* XLA's heap simulator: it packs buffers by size and can fragment; the model adds sizes, and
  lets any freed bytes hold an output, which XLA cannot always do (0.95x on attention);
* fusion decisions not measured here (multi-output sibling fusion, a copy XLA inserts for a
  dot's layout) and XLA versions other than TensorFlow 2.21's;
* library expansions (Cholesky, triangular solve, inverse): fitted formulas, within about 12%
  of the measured scratch above 128 x 128;
* ``While`` loops and ops without a rule (reported, not modelled), and float16/bfloat16
  reductions, which XLA accumulates in float32 (an operand twice as large).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import tensorflow as tf

from grappler_ext import folding
from grappler_ext.pairwise_distance import FUSED_REDUCTION_MAX
from grappler_ext.verifier import live_ops, topological_order

__all__ = [
    "Kind",
    "Rule",
    "analyse",
    "RULES",
    "NO_RULE_REASONS",
    "TensorInfo",
    "Buffer",
    "Step",
    "Estimate",
    "annotate",
    "estimate",
    "bytes_for_chunk",
    "ReductionPlan",
    "reduction_plan",
    "merged_into",
    "MATVEC_FUSION_MAX_BYTES",
    "peak_of",
]


class Kind(enum.Enum):
    """How XLA:CPU treats an op's outputs."""

    PARAMETER = "parameter"  # an entry parameter: own allocation, live throughout
    CONSTANT = "constant"    # a literal: own allocation if larger than a scalar and read as data
    STATIC = "static"        # no runtime data (NoOp, Shape of a static shape)
    BITCAST = "bitcast"      # output i shares data input i's buffer (reshape, identity)
    LOOP = "loop"            # elementwise or layout: fused into its consumers when possible
    REDUCE = "reduce"        # output materialised; may keep its producers fused
    LIBRARY = "library"      # a kernel call: operands and outputs materialised, maybe scratch


@dataclasses.dataclass(frozen=True)
class Rule:
    """The byte rule of one op type.

    Attributes:
      kind: see :class:`Kind`.
      static_inputs: operand positions read at compile time (axes, shapes, permutations, ``k``);
        they are never buffers.  ``-1`` is the last operand (``ConcatV2``'s axis).
      expensive: LOOP only: XLA will not duplicate this op into several fusions, nor fuse it into
        a consumer that reads each element many times; a bool or a predicate on the op.
      in_place: the output may take over an operand buffer of the same shape that dies here.
      fuses_operand: REDUCE and LIBRARY: ``(op, input_index, ctx) -> (bool, reason)``, whether
        this op's fusion computes that operand's producers itself (so the operand needs no
        buffer).  Without it, operands are read from memory.
      scratch: REDUCE and LIBRARY: ``(op, ctx) -> bytes`` of temporaries while the kernel runs.
      bitcast_when: LOOP only: ``(op, ctx) -> reason or None``; with a reason the op costs
        nothing and its output shares its input's buffer (a full-range slice; a transpose XLA
        folds into a dot).
      recomputes_operand: LIBRARY only: besides reading its operand from memory, the kernel's
        own loop fusion recomputes a cheap operand from that operand's inputs, which so stay
        live until it runs (Softmax: the max reads ``x``, ``exp(x - max)`` recomputes ``x``).
    """

    kind: Kind
    static_inputs: tuple[int, ...] = ()
    expensive: bool | Callable[[tf.Operation], bool] = False
    in_place: bool = False
    fuses_operand: Callable[[tf.Operation, int, object], tuple[bool, str]] | None = None
    scratch: Callable[[tf.Operation, object], int] | None = None
    bitcast_when: Callable[[tf.Operation, object], str | None] | None = None
    recomputes_operand: bool = False

    def is_static_input(self, op: tf.Operation, index: int) -> bool:
        n = len(op.inputs)
        return any(index == (i % n if n else i) for i in self.static_inputs)

    def is_expensive(self, op: tf.Operation) -> bool:
        return self.expensive(op) if callable(self.expensive) else bool(self.expensive)


# --- helpers the rules read -------------------------------------------------------------------
#
# Rule functions receive the op and ``ctx``, the analysis in progress, which offers
# ``ctx.readers(t)`` (the live ``(op, input_index)`` reading tensor ``t`` as data, looking through
# bitcasts), ``ctx.producer(t)`` (the op computing ``t``, looking through bitcasts) and
# ``ctx.is_output(t)``.


def _const(t: tf.Tensor) -> np.ndarray | None:
    """The value of ``t`` when the graph computes it from constants only (:func:`folding.static_value`)."""
    return folding.static_value(t)


def _dims(t: tf.Tensor) -> list[int] | None:
    return t.shape.as_list() if t.shape.is_fully_defined() else None


def _elements(t: tf.Tensor) -> int | None:
    dims = _dims(t)
    return None if dims is None else math.prod(dims)


def _nbytes(t: tf.Tensor) -> int | None:
    """Bytes of ``t`` in memory; None for a dynamic shape or a dtype without a fixed size."""
    n = _elements(t)
    if n is None or t.dtype in (tf.string, tf.variant):
        return None
    return 0 if t.dtype == tf.resource else n * t.dtype.size


def _is_integer_power(op: tf.Operation) -> bool:
    """``x ** n`` for a constant ``n`` of 1, 2 or 3: XLA's simplifier turns it into multiplies
    (measured: ``x**2``, ``x**3`` fuse like multiplies; ``x**4``, ``x**-1`` stay powers)."""
    value = _const(op.inputs[1])
    if value is None or value.size == 0:
        return False
    first = value.reshape(-1)[0]
    return bool(np.all(value == first)) and float(first) in (1.0, 2.0, 3.0)


def _is_constant_divisor(op: tf.Operation) -> bool:
    """``x / c`` for a constant ``c``: XLA multiplies by ``1 / c`` instead (measured: fused)."""
    return _const(op.inputs[1]) is not None


def _is_multiply(op: tf.Operation) -> bool:
    """Whether ``op`` is a multiply once XLA has simplified it (``x * y``, ``x**2``, ``x / 3``)."""
    if op.type in ("Mul", "Square", "SquaredDifference"):
        return True
    if op.type == "Pow":
        return _is_integer_power(op)
    if op.type in ("RealDiv", "Div"):
        return _is_constant_divisor(op)
    return False


# --- reductions -------------------------------------------------------------------------------

# Reductions XLA:CPU (TF 2.21) hands to YNNPACK, as a custom fusion that reads its operand from
# memory.  Measured: float32 (and bfloat16) Sum, Mean, Max and Min, over any axes, unless the
# operand is a multiply (then XLA keeps the reduction itself).  Prod, All, Any and float64,
# float16 or integer reductions stay in XLA's own loop emitter.
_YNN_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min"})
_YNN_DTYPES = frozenset({tf.float32, tf.bfloat16})
_ARG_REDUCTIONS = frozenset({"ArgMax", "ArgMin"})
# XLA's simplifier folds reduce(reduce(x)) with the same reducer into one reduce over both sets of
# axes (measured: ``sum(sum((x[:,None] - y[None])**2, -1), 1)`` with D = 3 materialises the
# [N, M, 3] difference, not the [N, M] distances: one reduction over an axis of M > 32).
_MERGEABLE = frozenset({"Sum", "Max", "Min", "Prod", "All", "Any"})


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
    """How XLA:CPU emits one reduction (see :func:`reduction_plan`)."""

    keeps_producers: bool
    reason: str
    partial_elements: int = 0


def merged_into(op: tf.Operation, ctx) -> tf.Operation | None:
    """The reduction ``op`` is folded into: its only reader, a reduction of the same type."""
    if op.type not in _MERGEABLE or ctx.is_output(op.outputs[0]):
        return None
    readers = ctx.readers(op.outputs[0])
    if len(readers) != 1:
        return None
    reader, index = readers[0]
    if reader.type != op.type or index != 0 or reader.inputs[0].shape != op.outputs[0].shape:
        return None
    return reader


def _reduced_operand(op: tf.Operation, ctx) -> tuple[tf.Tensor, set[int]] | None:
    """The tensor a (possibly merged) reduction reads and the axes of it that it reduces."""
    x = op.inputs[0]
    dims, axes = _dims(x), _const(op.inputs[1])
    if dims is None or axes is None:
        return None
    reduced = {int(a) % len(dims) for a in np.reshape(axes, -1)} if dims else set()
    inner = ctx.producer(x)
    if inner.type == op.type and merged_into(inner, ctx) is op:
        found = _reduced_operand(inner, ctx)
        if found is None:
            return None
        ix, inner_axes = found
        if inner.get_attr("keep_dims"):
            return ix, inner_axes | reduced
        kept = [d for d in range(ix.shape.rank) if d not in inner_axes]
        return ix, inner_axes | {kept[a] for a in reduced}
    return x, reduced


def reduction_plan(op: tf.Operation, ctx) -> ReductionPlan:
    """Whether XLA:CPU fuses the elementwise ops feeding reduction ``op`` into it, and why.

    Measured on TF 2.21 XLA:CPU (bytes from the buffer assignment):

    ===================================================  =====  =================================
    program                                              fused  why
    ===================================================  =====  =================================
    ``sum((x[:,None] - y[None])**2, -1)``, D = 8, 32     yes    multiply root, axis <= 32
    same, D = 33, 64                                     no     split: [N, M, D] in memory
    ``sum(exp(x), -1)`` f32 [120000, 8]                  no     YNNPACK reads memory
    ``sum(x * x + 1, -1)`` f32 [120000, 8]               no     root is an add: YNNPACK
    ``sum(exp(x), -1)`` f64 [120000, 8]                  yes    loop reduce, axis <= 32
    ``sum(exp(x), [1, 2])`` f64 [20000, 16, 16]          yes    every reduced axis <= 32
    ``sum(exp(x), [1, 2])`` f64 [20000, 4, 40]           no     split: an axis of 40
    ``prod(exp(x), -1)`` f32 [120000, 8]                 yes    Prod is not a YNNPACK reduction
    ``argmin(exp(x), 1)`` f32 [1000, 1000]               yes    variadic reduce: one loop fusion
    ===================================================  =====  =================================

    A split reduction also writes partial results, ``ceil(d / 32)`` per reduced axis of size
    ``d`` and output element (measured: [1000, 1000] summed over both axes leaves [32, 32]):
    ``partial_elements``, counted as the reduction's scratch.  A reduction merged into its reader
    (:func:`merged_into`) follows its reader's plan.
    """
    while (outer := merged_into(op, ctx)) is not None:
        op = outer
    if op.type in _ARG_REDUCTIONS:
        return ReductionPlan(True, f"`{op.type}` is a variadic (value, index) reduce: one loop fusion")
    found = _reduced_operand(op, ctx)
    if found is None:
        return ReductionPlan(False, "reduced axes or shape unknown")
    x, reduced = found
    dims = _dims(x)
    widest = max((dims[a] for a in reduced), default=1)
    if op.type in _YNN_REDUCTIONS and x.dtype in _YNN_DTYPES and not _is_multiply(ctx.producer(x)):
        return ReductionPlan(False, f"{x.dtype.name} `{op.type}` runs in YNNPACK, which reads its operand from memory")
    if widest <= FUSED_REDUCTION_MAX:
        return ReductionPlan(True, f"each reduced axis has <= {FUSED_REDUCTION_MAX} elements: one loop fusion")
    partial = (_elements(op.outputs[0]) or 0) * math.prod(-(-dims[a] // FUSED_REDUCTION_MAX) for a in reduced)
    return ReductionPlan(False, f"a reduced axis has {widest} > {FUSED_REDUCTION_MAX} elements: XLA splits it "
                                "into reduce-windows of 32 over an operand in memory", partial)


def _reduction_fuses_operand(op: tf.Operation, index: int, ctx) -> tuple[bool, str]:
    plan = reduction_plan(op, ctx)
    return plan.keeps_producers, plan.reason


def _reduction_scratch(op: tf.Operation, ctx) -> int:
    if merged_into(op, ctx) is not None:
        return 0
    if op.type in _ARG_REDUCTIONS:
        # XLA computes int32 indices and converts them (measured: 4 bytes an output element).
        return (_elements(op.outputs[0]) or 0) * 4 if op.outputs[0].dtype == tf.int64 else 0
    return reduction_plan(op, ctx).partial_elements * op.outputs[0].dtype.size


# --- matmuls ----------------------------------------------------------------------------------

# XLA:CPU emits a matrix-vector product itself, with the matrix's producers fused in, when the
# vector is smaller than 16 KiB (measured: ``exp(a) @ v`` with v [3000, 1] (12 kB) is one fusion;
# with v [5000, 1] (20 kB), or v [3000, 2], or a batched product, ``exp(a)`` is materialised).
MATVEC_FUSION_MAX_BYTES = 16 * 1024


def _matvec_fuses_operand(op: tf.Operation, index: int, ctx) -> tuple[bool, str]:
    if op.type != "MatMul" or _dims(op.outputs[0]) is None:
        return False, "`MatMul` calls a GEMM kernel, which reads its operands from memory"
    n, m = _dims(op.outputs[0])
    vector = 1 if m == 1 else 0 if n == 1 else None
    if vector is None or index == vector:
        return False, "`MatMul` calls a GEMM kernel, which reads its operands from memory"
    size = _nbytes(op.inputs[vector]) or 0
    if size >= MATVEC_FUSION_MAX_BYTES:
        return False, f"matrix-vector product with a vector of {size} >= {MATVEC_FUSION_MAX_BYTES} bytes: a kernel call"
    return True, f"matrix-vector product with a vector of {size} < {MATVEC_FUSION_MAX_BYTES} bytes: one loop fusion"


# --- library kernels: scratch fitted to measurements ------------------------------------------


def _batch_and_matrix(t: tf.Tensor) -> tuple[int, int, int]:
    dims = _dims(t) or [0, 0]
    return math.prod(dims[:-2]), dims[-2], dims[-1]


def _cholesky_scratch(op: tf.Operation, ctx) -> int:
    """XLA's blocked Cholesky (block 128).  Fit: ``n^2/4 + 256 n`` elements per matrix for
    n > 128, ``5/4 n^2`` below.  Measured extra bytes / fit, float32 (float64 identical per
    element): n = 256: 347 kB / 328 kB; 500: 853 kB / 762 kB; 1000: 2.11 MB / 2.02 MB;
    2000: 6.12 MB / 6.05 MB.
    """
    batch, n, _ = _batch_and_matrix(op.inputs[0])
    per = n * n // 4 + 256 * n if n > 128 else 5 * n * n // 4
    return batch * per * op.inputs[0].dtype.size


def _triangular_solve_scratch(op: tf.Operation, ctx) -> int:
    """XLA's blocked triangular solve (block 128) of A [.., n, n] against B [.., n, m].  Fit in
    elements: ``max(n m + 128 n, n^2/2 + 256 n)`` for n > 128 (the solution assembled block by
    block, or the masked and inverted diagonal blocks of A), ``n^2`` for one block.  Measured
    (float32 and float64 identical per element), extra elements measured / fit:
    (n, m) = (128, 8000): 16.9 k / 16.4 k; (500, 100): 259 k / 253 k; (500, 2000): 1.06 M / 1.06 M;
    (1000, 500): 774 k / 756 k; (1000, 4000): 4.10 M / 4.13 M; (2000, 200): 2.43 M / 2.51 M.
    """
    _, n, _ = _batch_and_matrix(op.inputs[0])
    batch, _, m = _batch_and_matrix(op.inputs[1])
    per = max(n * m + 128 * n, n * n // 2 + 256 * n) if n > 128 else n * n
    return batch * per * op.inputs[1].dtype.size


def _inverse_scratch(op: tf.Operation, ctx) -> int:
    """LU factorisation plus two triangular solves.  Fit ``3 n^2 + 256 n`` elements; measured
    n = 256: 4.26 n^2 (fit 4.0); n = 1000: 3.03 n^2 (fit 3.26)."""
    batch, n, _ = _batch_and_matrix(op.inputs[0])
    return batch * (3 * n * n + 256 * n) * op.inputs[0].dtype.size


def _softmax_scratch(op: tf.Operation, ctx) -> int:
    """One row vector (the row maxima, then the row sums: never live together)."""
    dims = _dims(op.inputs[0]) or [0]
    return math.prod(dims[:-1]) * op.inputs[0].dtype.size


# --- bitcast-when predicates ------------------------------------------------------------------

# Layout ops whose output is larger than an input without reading any element twice.
_NO_REUSE = frozenset({"ConcatV2", "Pad", "PadV2", "MirrorPad"})
_MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def _transpose_into_dot(op: tf.Operation, ctx) -> str | None:
    """A transpose of the last two axes read only by matmuls: XLA folds it into the dot's
    dimension numbers (measured: ``x @ tf.transpose(w)`` costs ``x + w + out``).  Other
    permutations feeding a batched dot are copied (measured: heads moved to the front)."""
    perm = _const(op.inputs[1])
    rank = op.inputs[0].shape.rank
    if perm is None or rank is None or rank < 2:
        return None
    perm = [int(p) for p in np.reshape(perm, -1)]
    if perm == list(range(rank)):
        return "identity permutation"
    if perm != list(range(rank - 2)) + [rank - 1, rank - 2]:
        return None
    readers = ctx.readers(op.outputs[0])
    if readers and all(reader.type in _MATMULS for reader, _ in readers):
        return "transpose of the last two axes, folded into the dot that reads it"
    return None


def _full_range(op: tf.Operation, ctx) -> str | None:
    """A slice that keeps every element with unit strides is a reshape: a bitcast in XLA."""
    if _elements(op.inputs[0]) is None or _elements(op.inputs[0]) != _elements(op.outputs[0]):
        return None
    if op.type == "StridedSlice":
        strides = _const(op.inputs[3])
        if strides is None or not np.all(np.reshape(strides, -1) == 1):
            return None
    return "keeps every element in order: a reshape"


# --- the rule table ---------------------------------------------------------------------------

RULES: dict[str, Rule] = {}


def _register(types: str, rule: Rule) -> None:
    for t in types.split():
        if t in RULES:
            raise ValueError(f"two byte rules for `{t}`")
        RULES[t] = rule


# Why some op types deliberately have no rule (reported with the unknown op).
NO_RULE_REASONS: dict[str, str] = {
    "While": "loop bodies are not modelled: estimate one iteration's graph instead",
    "StatelessWhile": "loop bodies are not modelled: estimate one iteration's graph instead",
    "If": "branch graphs are not modelled",
    "StatelessIf": "branch graphs are not modelled",
}

# Entry parameters: ``tf.identity(x)`` of a [1000, 1000] f32 parameter costs 8 MB (4 MB in, 4 MB out).
_register("Placeholder", Rule(Kind.PARAMETER))
_register("ReadVariableOp", Rule(Kind.PARAMETER, static_inputs=(0,)))
# A [1000, 1000] f32 constant added to a parameter costs 4 MB of its own (measured: 12 MB in all).
_register("Const", Rule(Kind.CONSTANT))
# No runtime data.
_register("NoOp", Rule(Kind.STATIC))
_register("Shape Size Rank", Rule(Kind.STATIC, static_inputs=(0,)))
_register("BroadcastGradientArgs", Rule(Kind.STATIC, static_inputs=(0, 1)))

# Shape-only ops: XLA lowers them to bitcasts (0 bytes); measured ``x[:, None]`` costs nothing.
_register("Reshape ExpandDims", Rule(Kind.BITCAST, static_inputs=(1,)))
_register("Squeeze Identity IdentityN StopGradient Snapshot PreventGradient EnsureShape", Rule(Kind.BITCAST))

# Elementwise, cheap: XLA duplicates them into every fusion that reads them (measured: ``y = 2 x``
# read by two outputs gives two fusions and no buffer for ``y``; likewise Sin, Cos, Abs, Neg,
# Maximum, Select, Cast, Square, Floor).  In place over a dying operand of the same shape.
_ELEMENTWISE = Rule(Kind.LOOP, in_place=True)
_register("Neg Abs Sign Floor Ceil Round Rint Sin Cos Square Cast LogicalNot Relu Relu6 LeakyRelu "
          "IsNan IsInf IsFinite "
          "Add AddV2 Sub Mul Maximum Minimum SquaredDifference BiasAdd AddN "
          "Equal NotEqual Less LessEqual Greater GreaterEqual LogicalAnd LogicalOr "
          "Select SelectV2 ClipByValue "
          "ReluGrad Relu6Grad LeakyReluGrad TanhGrad SigmoidGrad RsqrtGrad", _ELEMENTWISE)
# Elementwise, expensive: materialised once when two fusions read them (measured: Exp, Tanh, Sqrt,
# Rsqrt, Log, Erf, Sigmoid, Softplus, RealDiv by a tensor, Pow to a tensor power; the rest by
# XLA's list of expensive opcodes).  ``x / c`` and ``x ** n`` (constant c, n of 2 or 3) become
# multiplies and are cheap (measured).
_EXPENSIVE = Rule(Kind.LOOP, in_place=True, expensive=True)
_register("Exp Expm1 Log Log1p Tanh Sigmoid Sqrt Rsqrt Erf Erfc Softplus Elu Selu Reciprocal Inv "
          "Atan2 Tan Atan Asin Acos Sinh Cosh Asinh Acosh Atanh FloorDiv FloorMod Xlogy Xdivy DivNoNan "
          "Softsign SqrtGrad SoftplusGrad EluGrad", _EXPENSIVE)
_register("Pow", Rule(Kind.LOOP, in_place=True, expensive=lambda op: not _is_integer_power(op)))
_register("RealDiv Div", Rule(Kind.LOOP, in_place=True, expensive=lambda op: not _is_constant_divisor(op)))
# Generators: a broadcast or an iota inside the consumer's fusion.
# Random draws are materialised (measured: dropout of an 8 MB tensor, summed, needs 8 MB beside its
# input, stateful or stateless alike); their shape operand is read at compile time.
_register("RandomUniform RandomStandardNormal TruncatedNormal RandomUniformInt StatelessRandomUniform "
          "StatelessRandomNormal StatelessTruncatedNormal StatelessRandomUniformV2 StatelessRandomNormalV2 "
          "StatelessTruncatedNormalV2 StatelessRandomUniformIntV2", Rule(Kind.LIBRARY, static_inputs=(0,)))
_register("StatelessRandomGetKeyCounter", Rule(Kind.LIBRARY))
_register("Fill", Rule(Kind.LOOP, static_inputs=(0,)))
_register("ZerosLike OnesLike", Rule(Kind.LOOP, static_inputs=(0,)))
_register("Range", Rule(Kind.LOOP, static_inputs=(0, 1, 2)))
_register("OneHot", Rule(Kind.LOOP, static_inputs=(1,)))

# Layout ops: fusible both ways (measured: ``exp(transpose(x))``, ``exp(concat(x, x))``,
# ``pad(exp(x))``, ``exp(x[:500])`` and ``exp(gather(x, i))`` are each one fusion), but an operand
# of a library call is copied out (``concat(x, x) @ w``, ``x[:500] @ w``, ``tile(x) @ w``).  Their
# output differs in shape from their input, so never in place.
_register("Transpose", Rule(Kind.LOOP, static_inputs=(1,), bitcast_when=_transpose_into_dot))
_register("Slice", Rule(Kind.LOOP, static_inputs=(1, 2), bitcast_when=_full_range))
_register("StridedSlice", Rule(Kind.LOOP, static_inputs=(1, 2, 3), bitcast_when=_full_range))
_register("ConcatV2", Rule(Kind.LOOP, static_inputs=(-1,)))
# Pack is ConcatV2 of its inputs each given a new unit axis (GPflow packs shapes and small tensors).
_register("Pack", Rule(Kind.LOOP))
# Training steps (Keras, GPflow with the tape inside): the ops gradients and optimizers emit.
# A variable update writes its value into the variable's buffer: the value's loop fuses into it.
_register("AssignVariableOp AssignAddVariableOp AssignSubVariableOp", Rule(Kind.LOOP, static_inputs=(0,)))
_register("CheckNumerics", Rule(Kind.BITCAST))
_register("InvertPermutation ConcatOffset", Rule(Kind.STATIC, static_inputs=(0, 1)))
_register("StridedSliceGrad", Rule(Kind.LOOP, static_inputs=(0, 1, 2, 3)))
_register("BiasAddGrad FusedBatchNormV3 FusedBatchNormGradV3", Rule(Kind.LIBRARY))
_register("Pad MirrorPad", Rule(Kind.LOOP, static_inputs=(1,)))
_register("PadV2", Rule(Kind.LOOP, static_inputs=(1,)))
_register("Tile BroadcastTo ReverseV2", Rule(Kind.LOOP, static_inputs=(1,)))
_register("GatherV2", Rule(Kind.LOOP, static_inputs=(2,)))
_register("Gather", Rule(Kind.LOOP))
# An embedding lookup reads the variable's buffer in place, like GatherV2 of a variable's read.
_register("ResourceGather", Rule(Kind.LOOP, static_inputs=(0,)))
# A sparse update (Keras' optimizers on an embedding's IndexedSlices): the scatter writes into the
# variable's buffer, as a dense update does.  Unique and the segment sum that merge repeated rows
# are kernels (their sizes are dynamic: the model's estimate of such a program is a lower bound).
_register("ResourceScatterAdd ResourceScatterSub ResourceScatterUpdate ResourceScatterMul ResourceScatterDiv "
          "ResourceScatterMax ResourceScatterMin", Rule(Kind.LOOP, static_inputs=(0,)))
_register("Unique", Rule(Kind.LIBRARY))
# A TensorArray written in a loop (the splitter's concatenating combiner): XLA allocates the stacked
# buffer, which the stack reads out as its output; the reserve itself holds nothing yet.
_register("TensorListReserve", Rule(Kind.STATIC, static_inputs=(0, 1)))
_register("TensorListStack", Rule(Kind.LIBRARY, static_inputs=(1,)))
_register("UnsortedSegmentSum UnsortedSegmentMax UnsortedSegmentMin UnsortedSegmentProd",
          Rule(Kind.LIBRARY, static_inputs=(2,)))
# Diagonals (``tf.eye``, ``tf.linalg.diag_part``, ``set_diag``, ``band_part``): iota, compare and
# select in XLA, so loop ops like the rest.
_register("MatrixDiagV3", Rule(Kind.LOOP, static_inputs=(1, 2, 3, 4)))
_register("MatrixDiagPartV3", Rule(Kind.LOOP, static_inputs=(1, 2)))
_register("MatrixSetDiagV3", Rule(Kind.LOOP, static_inputs=(2,)))
_register("MatrixBandPart", Rule(Kind.LOOP, static_inputs=(1, 2)))

# Reductions: see reduction_plan for their operands; their own output is materialised unless the
# reduction is a loop fusion that fuses into its reader (measured: ``argmin`` of a D = 3 distance
# [20000, 1000] is one fusion of 490 kB in all; ``sqrt`` of it is one fusion) or is merged.
_register("Sum Mean Max Min Prod All Any ArgMax ArgMin",
          Rule(Kind.REDUCE, static_inputs=(1,), fuses_operand=_reduction_fuses_operand, scratch=_reduction_scratch))

# Library calls: operands in memory, output materialised.  Measured: ``exp(x) @ w`` materialises
# ``exp(x)``; a bias add and relu after the dot run in place over its output.
# A matrix-vector product with a small vector is emitted by XLA itself, fusing the matrix.
_register("MatMul", Rule(Kind.LIBRARY, fuses_operand=_matvec_fuses_operand))
_register("BatchMatMul BatchMatMulV2 BatchMatMulV3 Einsum", Rule(Kind.LIBRARY))
_register("Cholesky", Rule(Kind.LIBRARY, scratch=_cholesky_scratch))
_register("MatrixTriangularSolve", Rule(Kind.LIBRARY, scratch=_triangular_solve_scratch))
_register("MatrixInverse", Rule(Kind.LIBRARY, scratch=_inverse_scratch))
# top-k is a kernel call: measured [1000, 1000] f32, k = 10 costs input + 2 x 40 kB, no scratch.
_register("TopKV2", Rule(Kind.LIBRARY, static_inputs=(1,)))
# Softmax is max, exp(x - max), sum, divide: the operand is read twice (so in memory), the result
# is written over it when it dies (measured: softmax of a [1000, 1000] parameter costs 8 MB).  A
# cheap operand is recomputed by the exp fusion: ``softmax(q k^T / 8)`` keeps ``q k^T`` and
# ``q k^T / 8`` live together (measured: 8.4 MB of temporaries for [4, 512, 512] scores).
_register("Softmax LogSoftmax",
          Rule(Kind.LIBRARY, in_place=True, scratch=_softmax_scratch, recomputes_operand=True))
# Cross-entropy from logits: a log-softmax of the logits, the loss [B] and its gradient [B, C]
# (written over the log-softmax); counted like Softmax.
_register("SparseSoftmaxCrossEntropyWithLogits SoftmaxCrossEntropyWithLogits",
          Rule(Kind.LIBRARY, scratch=_softmax_scratch, recomputes_operand=True))


# --- results ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What the model decided for one tensor.

    Attributes:
      name: the tensor's name (``"MatMul:0"``).
      op_type: the type of the op producing it.
      shape: static dims, ``None`` for an unknown dimension; ``None`` for an unknown rank.
      dtype: its dtype.
      bytes: its size in memory, ``None`` when its shape is dynamic.
      materialised: whether XLA gives it a buffer of its own (``None``: op without a rule).
      reason: one line saying why.
      alias_of: for a bitcast, the tensor whose buffer it shares.
    """

    name: str
    op_type: str
    shape: tuple[int | None, ...] | None
    dtype: tf.DType
    bytes: int | None
    materialised: bool | None
    reason: str
    alias_of: str | None = None


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One allocation of the model.

    Attributes:
      name: the tensor it was first allocated for (an op name for scratch).
      kind: ``"parameter"``, ``"constant"``, ``"output"``, ``"temp"`` or ``"scratch"``.
      bytes: its size.
      shape: the first tensor's static shape (``()`` for scratch).
      first_step, last_step: schedule steps it is live in (inclusive); outputs stay to the end;
        parameters and constants are counted for the whole program whatever these say.
      tensors: every tensor stored in it (the in-place chain; bitcasts are not listed).
    """

    name: str
    kind: str
    bytes: int
    shape: tuple[int, ...]
    first_step: int
    last_step: int
    tensors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Step:
    """One kernel of the schedule and the pool bytes (temporaries, scratch, outputs) live while it
    runs."""

    op: str
    op_type: str
    live_bytes: int


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The model's figure for one graph.

    ``peak_bytes = parameter_bytes + constant_bytes + live_peak_bytes``, or ``None`` when an op
    has no rule or a shape is dynamic (``reason`` says which).  ``live_peak_bytes`` is the peak of
    temporaries, scratch and outputs written so far, live together at ``peak_op``;
    ``output_bytes`` is the outputs' share of the end state, for information.
    """

    peak_bytes: int | None
    parameter_bytes: int
    constant_bytes: int
    output_bytes: int
    live_peak_bytes: int
    peak_op: str | None
    unknown_ops: tuple[str, ...]
    dynamic_tensors: tuple[str, ...]
    buffers: tuple[Buffer, ...]
    schedule: tuple[Step, ...]
    reason: str = ""

    @property
    def complete(self) -> bool:
        return self.peak_bytes is not None

    @property
    def largest(self) -> tuple[Buffer, ...]:
        """The five largest buffers, largest first."""
        return tuple(sorted(self.buffers, key=lambda b: -b.bytes)[:5])

    def summary(self) -> str:
        if self.peak_bytes is None:
            return f"no estimate: {self.reason}"
        top = ", ".join(f"{b.name} {b.bytes:,} B ({b.kind})" for b in self.largest[:3])
        return (f"peak {self.peak_bytes:,} B = parameters {self.parameter_bytes:,} + constants "
                f"{self.constant_bytes:,} + live {self.live_peak_bytes:,} at {self.peak_op} "
                f"(outputs {self.output_bytes:,} in all); largest: {top}")


# --- the analysis -----------------------------------------------------------------------------


def _shape_tuple(t: tf.Tensor):
    return None if t.shape.rank is None else tuple(t.shape.as_list())


class _Analysis:
    """The rules applied to every live op: buffer owners, readers and fusion decisions.

    This is the ``ctx`` rule functions receive (``readers``, ``producer``, ``is_output``).
    """

    def __init__(self, graph, rules: Mapping[str, Rule]):
        self.graph = graph
        self.rules = rules
        self.live = live_ops(graph)
        self.order = topological_order(graph, self.live, first=[t.op for t in getattr(graph, "inputs", [])])
        self.tensor: dict[str, tf.Tensor] = {t.name: t for op in self.order for t in op.outputs}
        # Direct data readers of each tensor (compile-time operands left out).
        self._direct: dict[str, list] = {}
        for op in self.order:
            for i in self.data_indices(op):
                self._direct.setdefault(op.inputs[i].name, []).append((op, i))
        self._readers: dict[str, list] = {}
        self._bitcast_reason: dict[str, str | None] = {}
        # The tensor owning each tensor's buffer: itself, or what a bitcast chain starts from.
        self.source: dict[str, str] = {}
        for op in self.order:
            inputs = self.data_inputs(op) if self.bitcast(op) is not None else []
            for k, t in enumerate(op.outputs):
                self.source[t.name] = self.source[inputs[k].name] if k < len(inputs) else t.name
        self.output_sources = {self.source[t.name] for t in getattr(graph, "outputs", []) if t is not None}
        self.info: dict[str, TensorInfo] = {}
        self.fused_roots: dict[str, frozenset] = {}   # fused tensor -> the kernels whose fusion holds it
        self.unknown: list[str] = []
        for op in reversed(self.order):               # readers are decided before their producers
            rule = rules.get(op.type)
            if rule is None:
                self.unknown.append(f"{op.name} ({op.type}): {NO_RULE_REASONS.get(op.type, 'no rule')}")
            for t in op.outputs:
                self.info[t.name] = self._decide(op, rule, t)
        self.unknown.reverse()

    # -- the ctx interface for rules --

    def readers(self, t: tf.Tensor) -> list:
        """``(op, input_index)`` reading ``t`` as data, looking through bitcasts."""
        if t.name not in self._readers:
            found = []
            for op, i in self._direct.get(t.name, []):
                if self.bitcast(op) is not None:
                    k = self.data_indices(op).index(i)
                    if k < len(op.outputs):
                        found.extend(self.readers(op.outputs[k]))
                else:
                    found.append((op, i))
            self._readers[t.name] = found
        return self._readers[t.name]

    def producer(self, t: tf.Tensor) -> tf.Operation:
        """The op computing ``t``, looking through bitcasts."""
        while self.bitcast(t.op) is not None and self.data_inputs(t.op):
            t = self.data_inputs(t.op)[min(t.value_index, len(self.data_inputs(t.op)) - 1)]
        return t.op

    def is_output(self, t: tf.Tensor) -> bool:
        return self.source.get(t.name, t.name) in self.output_sources

    # -- structure --

    def data_indices(self, op) -> list[int]:
        rule = self.rules.get(op.type)
        return [i for i in range(len(op.inputs)) if rule is None or not rule.is_static_input(op, i)]

    def data_inputs(self, op) -> list[tf.Tensor]:
        return [op.inputs[i] for i in self.data_indices(op)]

    def bitcast(self, op) -> str | None:
        """Why ``op`` is a bitcast (its output k shares data input k's buffer), or None."""
        if op.name not in self._bitcast_reason:
            rule = self.rules.get(op.type)
            reason = None
            if rule is not None and rule.kind is Kind.BITCAST:
                reason = "shape-only op: a bitcast"
            elif rule is not None and rule.kind is Kind.LOOP and rule.bitcast_when is not None:
                reason = rule.bitcast_when(op, self)
            self._bitcast_reason[op.name] = reason
        return self._bitcast_reason[op.name]

    # -- decisions --

    def _info(self, t, materialised, reason, alias_of=None) -> TensorInfo:
        return TensorInfo(t.name, t.op.type, _shape_tuple(t), t.dtype, _nbytes(t), materialised, reason, alias_of)

    def _roots(self, op) -> frozenset:
        """The kernels whose fusions compute ``op``'s output: itself if it is materialised."""
        if not op.outputs:  # a variable update: its own kernel
            return frozenset([op])
        out = self.info.get(op.outputs[0].name)
        if out is None or out.materialised is not False:
            return frozenset([op])
        return self.fused_roots.get(op.outputs[0].name, frozenset([op]))

    def accepts(self, reader, index: int) -> tuple[bool, str]:
        """Whether ``reader``'s fusion computes its operand ``index`` itself."""
        rule = self.rules.get(reader.type)
        if rule is None:
            return False, "an op without a rule, which needs it in memory"
        if rule.kind is Kind.LOOP:
            return True, ""
        if rule.fuses_operand is not None:
            return rule.fuses_operand(reader, index, self)
        return False, f"a {rule.kind.value} op, which reads it from memory"

    def _decide(self, op, rule: Rule | None, t: tf.Tensor) -> TensorInfo:
        if rule is None:
            return self._info(t, None, f"no rule for `{op.type}`: counted as a kernel that materialises")
        if self.source[t.name] != t.name:
            return self._info(t, False, self.bitcast(op) or "bitcast", alias_of=self.source[t.name])
        if t.dtype == tf.resource:
            return self._info(t, False, "resource handle")
        is_output = t.name in self.output_sources
        if rule.kind is Kind.PARAMETER:
            return self._info(t, True, "entry parameter: live throughout")
        if rule.kind is Kind.CONSTANT:
            if not self.readers(t) and not is_output:
                return self._info(t, False, "compile-time operand (axes, shapes)")
            if (_elements(t) or 0) <= 1 and not is_output:
                return self._info(t, False, "scalar constant, folded into its consumers")
            return self._info(t, True, "constant: own allocation")
        if rule.kind is Kind.STATIC:
            return self._info(t, False, "no runtime data")
        if rule.kind is Kind.LIBRARY:
            return self._info(t, True, f"`{op.type}` kernel output")
        if rule.kind is Kind.REDUCE:
            outer = merged_into(op, self)
            if outer is not None:
                self.fused_roots[t.name] = self._roots(outer)
                return self._info(t, False, f"merged into `{outer.type}` ({outer.name}): XLA folds a reduction "
                                            "of a reduction into one")
            plan = reduction_plan(op, self)
            if op.type in _ARG_REDUCTIONS or not plan.keeps_producers:
                return self._info(t, True, "reduction output")
            # A reduction emitted as a loop fusion can itself be fused into its reader; XLA treats
            # it as expensive (measured: read by two fusions, or broadcast, it is materialised).
            return self._fuse_or_keep(op, t, expensive=True)
        return self._fuse_or_keep(op, t, expensive=rule.is_expensive(op))

    def _fuse_or_keep(self, op, t: tf.Tensor, expensive: bool) -> TensorInfo:
        """The fusion decision for a loop op's output: fused into its readers' fusions, or kept."""
        if t.name in self.output_sources:
            return self._info(t, True, "graph output")
        readers = self.readers(t)
        if not readers:
            return self._info(t, False, "no data reader")
        roots: set = set()
        for reader, index in readers:
            accepted, why = self.accepts(reader, index)
            if not accepted:
                return self._info(t, True, f"read by `{reader.type}` ({reader.name}): {why}")
            reader_rule = self.rules[reader.type]
            if (expensive and reader_rule.kind is Kind.LOOP and reader.type not in _NO_REUSE and reader.outputs
                    and (_elements(reader.outputs[0]) or 0) > (_elements(t) or 0)):
                return self._info(t, True, f"expensive `{op.type}` read repeatedly by broadcasting "
                                           f"`{reader.type}` ({reader.name}): XLA does not fuse it there")
            roots |= self._roots(reader)
        if len(roots) > 1 and expensive:
            return self._info(t, True, f"expensive `{op.type}` read by {len(roots)} fusions: XLA computes it once")
        self.fused_roots[t.name] = frozenset(roots)
        names = ", ".join(sorted(f"`{r.type}` ({r.name})" for r in roots))
        return self._info(t, False, f"fused into {names}")


def annotate(graph, rules: Mapping[str, Rule] | None = None) -> dict[str, TensorInfo]:
    """Shape, dtype, bytes and the materialisation decision of every output of every live op,
    keyed by tensor name.  Dynamic shapes get ``bytes=None``; ops without a rule get
    ``materialised=None``.  Pure analysis: the graph is not changed."""
    return dict(_Analysis(graph, RULES if rules is None else rules).info)


# --- liveness ---------------------------------------------------------------------------------


def peak_of(buffers: Iterable[Buffer], n_steps: int) -> tuple[list[int], int]:
    """Bytes of the shared pool (temporaries, scratch, outputs) live at each step, and the step
    of the maximum.  Pure arithmetic over buffers, used by :func:`estimate` and
    :func:`bytes_for_chunk`."""
    n_steps = max(n_steps, 1)
    delta = [0] * (n_steps + 1)
    for b in buffers:
        if b.kind in ("temp", "scratch", "output"):
            delta[min(b.first_step, n_steps - 1)] += b.bytes
            delta[min(b.last_step, n_steps - 1) + 1] -= b.bytes
    live, running = [], 0
    for s in range(n_steps):
        running += delta[s]
        live.append(running)
    return live, max(range(n_steps), key=lambda s: live[s])


def estimate(graph, rules: Mapping[str, Rule] | None = None) -> Estimate:
    """Peak bytes XLA:CPU will need for ``graph`` (see the module docstring for what is counted)."""
    return analyse(graph, rules)[0]


def analyse(graph, rules: Mapping[str, Rule] | None = None) -> tuple[Estimate, dict[str, TensorInfo]]:
    """:func:`estimate` and :func:`annotate` of ``graph`` from one analysis."""
    a = _Analysis(graph, RULES if rules is None else rules)
    info, order = a.info, a.order
    # A dynamic output nothing reads (FusedBatchNormV3's reserve space) costs nothing XLA keeps.
    dynamic = tuple(name for name, i in info.items()
                    if i.bytes is None and i.dtype not in (tf.resource, tf.variant)
                    and (i.materialised or name in a.fused_roots)
                    and (a.tensor[name].consumers() or a.is_output(a.tensor[name])))

    # Kernels in schedule order: ops that materialise an output or run a library call.
    def runs(op) -> bool:
        rule = a.rules.get(op.type)
        if rule is None or rule.kind is Kind.LIBRARY:
            return True
        return rule.kind in (Kind.LOOP, Kind.REDUCE) and any(
            info[t.name].materialised and a.source[t.name] == t.name for t in op.outputs)

    steps = [op for op in order if runs(op)]
    step_of = {op.name: s for s, op in enumerate(steps)}

    # The buffers each kernel's fusion reads: materialised sources, or through fused producers.
    # A fusion that could have contained a materialised *cheap* loop op recomputes it from its
    # inputs rather than reading it (XLA duplicates cheap producers into every fusion that can
    # take them), so it reads that op's inputs instead.
    # Both tables are filled in topological order, so each entry only looks one op back.
    cluster_reads: dict[str, frozenset] = {}
    cheap: dict[str, bool] = {}   # a loop op's output whose whole fused cluster is cheap

    def recomputes(op, index: int) -> bool:
        rule = a.rules.get(op.type)
        return rule is not None and (rule.recomputes_operand or a.accepts(op, index)[0])

    for op in order:
        rule = a.rules.get(op.type)
        found: set = set()
        cluster_cheap = rule is not None and rule.kind is Kind.LOOP and not rule.is_expensive(op)
        for index in a.data_indices(op):
            src = a.source.get(op.inputs[index].name, op.inputs[index].name)
            si = info.get(src)
            if si is None:
                continue
            producer = a.tensor[src].op.name
            if si.materialised is not False:
                if recomputes(op, index) and cheap.get(src, False):
                    found |= cluster_reads[producer]
                    if not a.accepts(op, index)[0]:
                        found.add(src)
                else:
                    found.add(src)
            elif src in a.fused_roots:
                found |= cluster_reads[producer]
                cluster_cheap = cluster_cheap and cheap.get(src, False)
        cluster_reads[op.name] = frozenset(found)
        for t in op.outputs:
            cheap[t.name] = cluster_cheap and t.name not in a.output_sources

    def reads_of(op) -> frozenset:
        return cluster_reads[op.name]

    last_read: dict[str, int] = {}
    for op in steps:
        for src in reads_of(op):
            last_read[src] = step_of[op.name]

    def kind_of(src: str) -> str:
        rule = a.rules.get(a.tensor[src].op.type)
        if rule is not None and rule.kind is Kind.PARAMETER:
            return "parameter"
        if rule is not None and rule.kind is Kind.CONSTANT:
            return "constant"
        return "output" if src in a.output_sources else "temp"

    # In place: a kernel with an in-place rule writes over an operand buffer of its shape that
    # dies there (XLA's buffer sharing); the two tensors then form one buffer.
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    for op in steps:
        rule = a.rules.get(op.type)
        if rule is None or not rule.in_place or len(op.outputs) != 1:
            continue
        out = op.outputs[0]
        if not info[out.name].materialised or a.source[out.name] != out.name:
            continue
        for src in sorted(reads_of(op)):
            t = a.tensor[src]
            if (kind_of(src) == "temp" and last_read.get(src) == step_of[op.name]
                    and _shape_tuple(t) == _shape_tuple(out) and t.dtype.size == out.dtype.size):
                parent[out.name] = find(src)
                break

    members: dict[str, list[str]] = {}
    for src in (t.name for op in order for t in op.outputs):     # schedule order
        if info[src].materialised is not False and a.source[src] == src:
            members.setdefault(find(src), []).append(src)

    # Parameters and constants are counted whole; every other buffer -- temporaries, scratch and
    # outputs, which stay live to the end once written -- shares one pool sized by its peak.
    n_steps = max(len(steps), 1)
    buffers: list[Buffer] = []
    for root, names in members.items():
        size = max(info[n].bytes or 0 for n in names)
        kinds = {kind_of(n) for n in names}
        kind = "output" if "output" in kinds else kind_of(root)
        births = [step_of.get(a.tensor[n].op.name, 0) for n in names]
        first = min(births)
        last = n_steps - 1 if kind == "output" else max([first] + births + [last_read.get(n, -1) for n in names])
        buffers.append(Buffer(root, kind, size, _shape_tuple(a.tensor[root]) or (), first, last, tuple(names)))
    # An output that returns a parameter or a constant is a copy, written at the end (measured:
    # ``tf.identity(x)`` costs twice ``x``).
    for src in sorted(a.output_sources):
        if kind_of(src) in ("parameter", "constant"):
            buffers.append(Buffer(f"{src} (output copy)", "output", info[src].bytes or 0,
                                  _shape_tuple(a.tensor[src]) or (), n_steps - 1, n_steps - 1, (src,)))
    for op in steps:
        rule = a.rules.get(op.type)
        extra = rule.scratch(op, a) if rule is not None and rule.scratch is not None else 0
        if extra:
            s = step_of[op.name]
            buffers.append(Buffer(f"{op.name} (scratch)", "scratch", extra, (), s, s, ()))

    fixed = _fixed_bytes(buffers)
    live, peak_step = peak_of(buffers, n_steps)
    schedule = tuple(Step(op.name, op.type, live[s]) for s, op in enumerate(steps))
    reasons = []
    if a.unknown:
        reasons.append(f"{len(a.unknown)} op(s) without a rule: " + "; ".join(a.unknown))
    if dynamic:
        reasons.append(f"dynamic shapes: {', '.join(dynamic)}")
    return Estimate(
        peak_bytes=None if reasons else fixed["parameter"] + fixed["constant"] + live[peak_step],
        parameter_bytes=fixed["parameter"],
        constant_bytes=fixed["constant"],
        output_bytes=sum(b.bytes for b in buffers if b.kind == "output"),
        live_peak_bytes=live[peak_step],
        peak_op=steps[peak_step].name if steps else None,
        unknown_ops=tuple(a.unknown),
        dynamic_tensors=dynamic,
        buffers=tuple(buffers),
        schedule=schedule,
        reason="; ".join(reasons),
    ), dict(info)


def _fixed_bytes(buffers: Iterable[Buffer]) -> dict[str, int]:
    fixed = {"parameter": 0, "constant": 0}
    for b in buffers:
        if b.kind in fixed:
            fixed[b.kind] += b.bytes
    return fixed


# --- the planner's hook -----------------------------------------------------------------------


def bytes_for_chunk(est: Estimate, split: Mapping[str, int], chunk: int) -> int:
    """Peak bytes when the tensors in ``split`` are cut to ``chunk`` along the given axis.

    ``split`` maps a tensor name to the axis the splitter cuts it along (the splitter's axis
    rules say which tensors carry the split axis); every buffer holding such a tensor shrinks to
    ``bytes * chunk / size`` along that axis, others keep their size, and the peak is recomputed
    over the same schedule.  Pure arithmetic, no TensorFlow.

    Fusion decisions are those of the full-size graph: a chunk that changes a reduced extent
    across the 32-element threshold (:data:`FUSED_REDUCTION_MAX`) would change them, so split
    along axes that are not reduced.  Scratch (library kernels, split reductions) keeps its
    full size, an overestimate for smaller chunks.
    """
    if est.peak_bytes is None:
        raise ValueError(f"cannot scale an incomplete estimate: {est.reason}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    scaled: list[Buffer] = []
    for b in est.buffers:
        size = b.bytes
        for name in (b.name,) + b.tensors:
            if name in split:
                if b.shape:
                    extent = b.shape[split[name]]
                    if chunk > extent:
                        raise ValueError(f"chunk {chunk} exceeds {name}'s axis {split[name]} of size {extent}")
                    size = b.bytes // extent * chunk
                break
        scaled.append(dataclasses.replace(b, bytes=size))
    fixed = _fixed_bytes(scaled)
    live, peak_step = peak_of(scaled, len(est.schedule))
    return fixed["parameter"] + fixed["constant"] + live[peak_step]
