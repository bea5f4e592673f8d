"""memory_rules: the byte rule of every TF op type the memory model (:mod:`grappler_ext.memory_model`) knows.

:data:`RULES` holds one :class:`Rule` per TF op type, registered together below: each op is a
parameter, a constant, a bitcast (no bytes: its output shares its input's buffer), a loop op
(elementwise or layout: fusible), a reduction, or a library call (matmul, Cholesky, top-k: its
operands must be in memory).  An op type without a rule is *unknown* to the model
(:data:`NO_RULE_REASONS` says why some have none on purpose).  Each rule cites the measurement it
rests on; the XLA:CPU thresholds and op sets they read are in :mod:`grappler_ext.xla_facts`.

The rule functions read the op and the analysis in progress (``ctx``, see below); they change
nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from grappler_ext import folding, shapes
from grappler_ext.op_types import ARG_REDUCTIONS, MATMULS, reserve_space
from grappler_ext.xla_facts import (
    FUSED_REDUCTION_MAX,
    MATVEC_FUSION_MAX_BYTES,
    YNN_DOT_REDUCTIONS,
    YNN_DTYPES,
    YNN_REDUCTIONS,
)

__all__ = [
    "Kind",
    "is_multiply",
    "Rule",
    "RULES",
    "NO_RULE_REASONS",
    "ReductionPlan",
    "reduction_plan",
    "merged_into",
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
      all_static: every operand is read at compile time, however many (``ShapeN``).
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
      unknown_when: ``op -> reason or None``; with a reason the op is counted as one without a rule
        (a conditional whose branches the model cannot count).
      parameters: ``op -> bytes`` of the program's arguments only this op reads (variables a
        conditional's branches read and nothing outside them does).
    """

    kind: Kind
    static_inputs: tuple[int, ...] = ()
    all_static: bool = False
    expensive: bool | Callable[[tf.Operation], bool] = False
    in_place: bool = False
    fuses_operand: Callable[[tf.Operation, int, object], tuple[bool, str]] | None = None
    scratch: Callable[[tf.Operation, object], int] | None = None
    bitcast_when: Callable[[tf.Operation, object], str | None] | None = None
    recomputes_operand: bool = False
    unknown_when: Callable[[tf.Operation], str | None] | None = None
    parameters: Callable[[tf.Operation], int] | None = None

    def is_static_input(self, op: tf.Operation, index: int) -> bool:
        n = len(op.inputs)
        return self.all_static or any(index == (i % n if n else i) for i in self.static_inputs)

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
    return shapes.dims(t) if shapes.is_static(t) else None     # the nominal size for run-time dimensions


def _elements(t: tf.Tensor) -> int | None:
    dims = _dims(t)
    return None if dims is None else math.prod(dims)


# Not :func:`grappler_ext.op_types.nbytes`, which gives 0 for a shape that is not static: the
# analysis relies on None here to report a tensor as dynamic (``TensorInfo.bytes``,
# ``Estimate.dynamic_tensors``) instead of counting it as empty.
def _static_nbytes(t: tf.Tensor) -> int | None:
    """Bytes of ``t`` in memory; None for a dynamic shape or a dtype without a fixed size.  An opaque
    reserve space (a fused batch norm's third) holds none."""
    if reserve_space(t):
        return 0
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


def is_multiply(op: tf.Operation) -> bool:
    """Whether ``op`` is a multiply once XLA has simplified it (``x * y``, ``x**2``, ``x / 3``)."""
    if op.type in ("Mul", "Square", "SquaredDifference"):
        return True
    if op.type == "Pow":
        return _is_integer_power(op)
    if op.type in ("RealDiv", "Div"):
        return _is_constant_divisor(op)
    return False


# --- reductions -------------------------------------------------------------------------------

# Which reductions YNNPACK takes (YNN_REDUCTIONS, YNN_DTYPES) and the widest axis a loop
# reduction keeps fused (FUSED_REDUCTION_MAX): measured, in grappler_ext.xla_facts.
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


def dot_fused_into(op: tf.Operation, ctx) -> tf.Operation | None:
    """The reduction a float32 ``MatMul`` is fused with (YNNPACK: :data:`YNN_DOT_REDUCTIONS`), its
    only reader, so that the product is never in memory; ``None`` where the product is materialised."""
    if op.type != "MatMul" or op.outputs[0].dtype != tf.float32 or op.get_attr("transpose_a"):
        return None
    if ctx.is_output(op.outputs[0]):
        return None
    readers = ctx.readers(op.outputs[0])
    if len(readers) != 1 or readers[0][1] != 0 or readers[0][0].type not in YNN_DOT_REDUCTIONS:
        return None
    return readers[0][0]


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
    if op.type in ARG_REDUCTIONS:
        return ReductionPlan(True, f"`{op.type}` is a variadic (value, index) reduce: one loop fusion")
    found = _reduced_operand(op, ctx)
    if found is None:
        return ReductionPlan(False, "reduced axes or shape unknown")
    x, reduced = found
    dims = _dims(x)
    widest = max((dims[a] for a in reduced), default=1)
    if op.type in YNN_REDUCTIONS and x.dtype in YNN_DTYPES and not is_multiply(ctx.producer(x)):
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
    if op.type in ARG_REDUCTIONS:
        # XLA computes int32 indices and converts them (measured: 4 bytes an output element).
        return (_elements(op.outputs[0]) or 0) * 4 if op.outputs[0].dtype == tf.int64 else 0
    return reduction_plan(op, ctx).partial_elements * op.outputs[0].dtype.size


# --- matmuls ----------------------------------------------------------------------------------

# The vector size below which XLA:CPU fuses a matrix-vector product itself
# (MATVEC_FUSION_MAX_BYTES): measured, in grappler_ext.xla_facts.


def _matvec_fuses_operand(op: tf.Operation, index: int, ctx) -> tuple[bool, str]:
    if op.type != "MatMul" or _dims(op.outputs[0]) is None:
        return False, "`MatMul` calls a GEMM kernel, which reads its operands from memory"
    n, m = _dims(op.outputs[0])
    vector = 1 if m == 1 else 0 if n == 1 else None
    if vector is None or index == vector:
        return False, "`MatMul` calls a GEMM kernel, which reads its operands from memory"
    size = _static_nbytes(op.inputs[vector]) or 0
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


def _factorised_operand(op: tf.Operation, index: int, ctx) -> tuple[bool, str]:
    """XLA's linear-algebra expansions copy their matrix into the buffer they factorise in place
    (Cholesky, eigh, SVD, QR, the LU of a solve or an inverse), and a triangular solve reads its
    operands a block at a time: a cheap elementwise or layout computation producing the operand is
    done there instead of materialised.  Measured, float64 n = 1000: ``cholesky(a * 2)``,
    ``eigh(a * 2)``, ``svd(a * 2)``, ``qr(a * 2)``, ``inv(a * 2)``, ``solve(a * 2, b)`` and
    ``triangular_solve(a * 2, b * 2)`` each need what the op on ``a`` does (``svd(concat([s, a]))``
    holds no concatenation).  A computation with an expensive op in it is materialised first
    (``cholesky(exp(a) + a)`` holds ``exp(a) + a``: 8 MB more), and so is a solve's right-hand
    side (``solve(a, b * 2)`` holds ``b * 2``)."""
    if op.type == "MatrixSolve" and index == 1:
        return False, "a solve's right-hand side is read from memory"
    seen, stack = set(), [ctx.producer(op.inputs[index])]
    while stack and len(seen) < 64:
        producer = stack.pop()
        rule = ctx.rules.get(producer.type)
        if rule is None or rule.kind is not Kind.LOOP or producer.name in seen:
            continue
        seen.add(producer.name)
        if rule.is_expensive(producer):
            return False, f"computed with an expensive `{producer.type}` ({producer.name}), which XLA materialises"
        stack.extend(ctx.producer(t) for i, t in enumerate(producer.inputs) if not rule.is_static_input(producer, i))
    return True, f"a cheap computation, done as `{op.type}` reads its operand"


def _solve_scratch(op: tf.Operation, ctx) -> int:
    """``tf.linalg.solve`` (``MatrixSolve``): an LU factorisation with its pivoted copy, then two
    triangular solves.  Fit ``4 n^2 + 256 n`` elements a matrix, whatever the right-hand side's width;
    measured, extra elements / fit: n = 256, m = 1: 328 k / 328 k; (500, 100): 1.07 M / 1.13 M;
    (1000, 1) f64: 4.03 M / 4.26 M; (1000, 500): 3.91 M / 4.26 M; (2000, 200): 15.8 M / 16.5 M;
    a batch of four (500, 7): 1.13 M / 1.13 M each."""
    batch, n, _ = _batch_and_matrix(op.inputs[0])
    return batch * (4 * n * n + 256 * n) * op.inputs[0].dtype.size


def _eigh_scratch(op: tf.Operation, ctx) -> int:
    """``tf.linalg.eigh`` (``SelfAdjointEigV2``, XLA's Jacobi eigensolver): ``27/8 n^2`` elements a
    matrix beside its input and both outputs; measured, extra elements / fit: n = 256: 218 k / 221 k;
    1000: 3.31 M / 3.38 M; 2000: 13.3 M / 13.5 M; a batch of eight 300 x 300: 294 k / 304 k each.
    Without the vectors (``eigvalsh``) ``29/8 n^2``: n = 600: 1.30 M / 1.31 M; 1000: 3.56 M / 3.63 M."""
    batch, n, _ = _batch_and_matrix(op.inputs[0])
    return batch * ((27 if op.get_attr("compute_v") else 29) * n * n // 8) * op.inputs[0].dtype.size


def _svd_scratch(op: tf.Operation, ctx) -> int:
    """``tf.linalg.svd`` (XLA's one-sided Jacobi SVD) of [.., m, n], ``k = min(m, n)``, ``K = max``:
    ``2 K^2 + 2 K k + 2 k^2`` elements a matrix in all beside its input and singular values, of which
    the singular vectors, when computed, are outputs (``K k + k^2``).  Exact to 0.1% on every case
    measured, extra elements without / with vectors: [1000, 1000]: 6.00 M / 4.00 M; [1200, 600]
    and [600, 1200]: 5.04 M / 3.96 M; [2000, 500]: 10.5 M / 9.25 M; [3000, 300]: 20.0 M / 19.0 M;
    [4000, 500]: 36.5 M / 34.3 M; [1000, 100]: 2.22 M / 2.11 M."""
    batch, m, n = _batch_and_matrix(op.inputs[0])
    k, big = min(m, n), max(m, n)
    per = 2 * (big * big + big * k + k * k) - ((big * k + k * k) if op.get_attr("compute_uv") else 0)
    return batch * per * op.inputs[0].dtype.size


def _in_top_k_scratch(op: tf.Operation, ctx) -> int:
    """``tf.math.in_top_k`` (``InTopKV2``: predictions [B, C], targets [B]): TF's XLA kernel gathers
    each row's target value, compares the row with it into an s32 array of the predictions' shape,
    and sums that along the row, in partial sums of ``ceil(C / 32)`` where the row is longer than
    32.  Measured, bytes beyond the predictions and the output, and this count: [4096, 1000]:
    16,924,716 / 16,924,672; [64, 100000]: 26,400,324 / 26,400,256; [256, 5000]: 5,281,848 /
    5,281,792; [8, 32768]: 1,081,432 / 1,081,376; rows of at most 32 fuse: [1000, 7]: 4,024 / 4,000."""
    dims = _dims(op.inputs[0])
    if dims is None or len(dims) != 2:
        return 0
    rows, width = dims
    values = rows * op.inputs[0].dtype.size                     # (each row's target value)
    if width <= FUSED_REDUCTION_MAX:
        return values
    return values + 4 * rows * width + 4 * rows * -(-width // FUSED_REDUCTION_MAX)


def _softmax_scratch(op: tf.Operation, ctx) -> int:
    """One row vector (the row maxima, then the row sums: never live together)."""
    dims = _dims(op.inputs[0]) or [0]
    return math.prod(dims[:-1]) * op.inputs[0].dtype.size


# --- bitcast-when predicates ------------------------------------------------------------------


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
    if readers and all(reader.type in MATMULS for reader, _ in readers):
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
}

# Entry parameters: ``tf.identity(x)`` of a [1000, 1000] f32 parameter costs 8 MB (4 MB in, 4 MB out).
_register("Placeholder", Rule(Kind.PARAMETER))
_register("ReadVariableOp", Rule(Kind.PARAMETER, static_inputs=(0,)))
# A [1000, 1000] f32 constant added to a parameter costs 4 MB of its own (measured: 12 MB in all).
_register("Const", Rule(Kind.CONSTANT))
# No runtime data.
_register("NoOp", Rule(Kind.STATIC))
# XLA drops asserts ("Ignoring Assert operator"): a loss' check of its labels' run-time shape.
_register("Assert", Rule(Kind.STATIC))
_register("Shape Size Rank", Rule(Kind.STATIC, static_inputs=(0,)))
# ShapeN (a convolution's gradient asks its operands' shapes): every operand read at compile time.
_register("ShapeN", Rule(Kind.STATIC, all_static=True))
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
          "Select SelectV2 ClipByValue BitwiseAnd BitwiseOr BitwiseXor LeftShift RightShift Invert "
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
          "StatelessTruncatedNormalV2 StatelessRandomUniformIntV2 StatelessRandomUniformFullIntV2 "
          "StatelessRandomUniformInt StatelessRandomUniformFullInt", Rule(Kind.LIBRARY, static_inputs=(0,)))
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
# Slices along an axis (``tf.unstack``, ``tf.split``): each output a slice, fused into its readers.
_register("Unpack", Rule(Kind.LOOP))
_register("Split", Rule(Kind.LOOP, static_inputs=(0,)))
_register("SplitV", Rule(Kind.LOOP, static_inputs=(1, 2)))
# Training steps (Keras, GPflow with the tape inside): the ops gradients and optimizers emit.
# A variable update writes its value into the variable's buffer: the value's loop fuses into it.
_register("AssignVariableOp AssignAddVariableOp AssignSubVariableOp", Rule(Kind.LOOP, static_inputs=(0,)))
_register("CheckNumerics", Rule(Kind.BITCAST))
_register("Bitcast", Rule(Kind.LOOP, in_place=True))   # XLA's bitcast-convert: elementwise, a copy between widths
_register("InvertPermutation ConcatOffset", Rule(Kind.STATIC, static_inputs=(0, 1)))
# Shape arithmetic in the gradients of reductions over dimensions known only at run time (the
# reduced shape stitched from the input's): a few ints, read at compile time by what reshapes.
_register("DynamicStitch ParallelDynamicStitch", Rule(Kind.LOOP))
_register("StridedSliceGrad", Rule(Kind.LOOP, static_inputs=(0, 1, 2, 3)))
_register("BiasAddGrad FusedBatchNormV3 FusedBatchNormGradV3", Rule(Kind.LIBRARY))
_register("Pad MirrorPad", Rule(Kind.LOOP, static_inputs=(1,)))
# Blocks of the spatial axes moved into the batch and back (a dilated convolution): XLA pads, reshapes
# and transposes, a copy of the (padded) input.
_register("SpaceToBatchND BatchToSpaceND", Rule(Kind.LOOP, static_inputs=(1, 2)))
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
# A dense scatter (the gradient of a top-k or a gather_nd): XLA's scatter writes into a buffer of the
# output's shape, zeros (ScatterNd: the shape is read at compile time) or the input's copy.
_register("ScatterNd", Rule(Kind.LIBRARY, static_inputs=(2,)))
_register("TensorScatterUpdate TensorScatterAdd TensorScatterSub TensorScatterMax TensorScatterMin",
          Rule(Kind.LIBRARY))
# A TensorArray written in a loop (the splitter's concatenating combiner): XLA allocates the stacked
# buffer, which the stack reads out as its output; the reserve itself holds nothing yet.
_register("TensorListReserve", Rule(Kind.STATIC, static_inputs=(0, 1)))
# A slice written into a buffer (the concatenating combiner's remainder slice, after its loop): XLA
# writes it over the buffer in place when the buffer dies there, the slice fused into the write.
_register("XlaDynamicUpdateSlice", Rule(Kind.LOOP, in_place=True))
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
_register("Cholesky", Rule(Kind.LIBRARY, scratch=_cholesky_scratch, fuses_operand=_factorised_operand))
_register("MatrixTriangularSolve", Rule(Kind.LIBRARY, scratch=_triangular_solve_scratch,
                                        fuses_operand=_factorised_operand))
_register("MatrixInverse", Rule(Kind.LIBRARY, scratch=_inverse_scratch, fuses_operand=_factorised_operand))
_register("MatrixSolve", Rule(Kind.LIBRARY, scratch=_solve_scratch, fuses_operand=_factorised_operand))
_register("SelfAdjointEigV2", Rule(Kind.LIBRARY, scratch=_eigh_scratch, fuses_operand=_factorised_operand))
_register("Svd", Rule(Kind.LIBRARY, scratch=_svd_scratch, fuses_operand=_factorised_operand))
# Convolutions and their gradients are kernel calls (XLA:CPU's Eigen/oneDNN convolution): operands
# in memory, output materialised; their shape operands are read at compile time.  Pooling is XLA's
# reduce-window (its gradient a select-and-scatter), each input element read by several windows:
# counted as a call too (operand and output in memory), an upper bound where XLA fuses a cheap producer.
_register("Conv2D Conv3D DepthwiseConv2dNative", Rule(Kind.LIBRARY))
_register("Conv2DBackpropInput Conv3DBackpropInputV2 DepthwiseConv2dNativeBackpropInput",
          Rule(Kind.LIBRARY, static_inputs=(0,)))
_register("Conv2DBackpropFilter Conv3DBackpropFilterV2 DepthwiseConv2dNativeBackpropFilter",
          Rule(Kind.LIBRARY, static_inputs=(1,)))
_register("MaxPool AvgPool MaxPool3D AvgPool3D MaxPoolGrad MaxPool3DGrad", Rule(Kind.LIBRARY))
_register("AvgPoolGrad AvgPool3DGrad", Rule(Kind.LIBRARY, static_inputs=(0,)))
# top-k is a kernel call: measured [1000, 1000] f32, k = 10 costs input + 2 x 40 kB, no scratch.
_register("TopKV2", Rule(Kind.LIBRARY, static_inputs=(1,)))
# Whether each target is among its row's k largest (Keras' top-k accuracy metrics): its predictions
# in memory, an s32 comparison of their shape beside them (:func:`_in_top_k_scratch`); ``k`` is read
# at compile time.
_register("InTopKV2", Rule(Kind.LIBRARY, static_inputs=(2,), scratch=_in_top_k_scratch))
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

