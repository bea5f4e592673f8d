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

1. **Rules** (:data:`RULES`, one :class:`Rule` per TF op type, in :mod:`grappler_ext.memory_rules`,
   which describes them): what kind of kernel each op is.  An op type without a rule is
   *unknown*: it is listed in :attr:`Estimate.unknown_ops` and the estimate has no
   ``peak_bytes``; nothing is guessed silently.
2. **Fusion**, the "fused into consumer" decision, made consumers first: a loop op's output gets
   no buffer when every op reading it will compute it inside its own fusion -- another loop op,
   a reduction that keeps its producers (:func:`reduction_plan`), a small matrix-vector product
   -- and XLA would not refuse to duplicate it: an *expensive* op (``Exp``, ``Tanh``, a division
   by a tensor, a loop-emitted reduction) read by two fusions, or read repeatedly by a
   broadcasting one, is computed once into memory.  A cheap op materialised for one reader is
   recomputed by the fusions of its other readers.  Everything else that makes data has a buffer.
3. **Liveness** over :func:`~grappler_ext.graph_query.topological_order`: a buffer is allocated when
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
* library expansions (Cholesky, triangular solve, inverse, solve, eigh, SVD): fitted formulas,
  within about 12% of the measured scratch above 128 x 128;
* what XLA does with a conditional: the model counts its branches on their own graphs, and the
  new values of the variables they write as the conditional's results (measured, an overcount);
* ``While`` loops and ops without a rule (reported, not modelled), and float16/bfloat16
  reductions, which XLA accumulates in float32 (an operand twice as large).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import tensorflow as tf

from grappler_ext import graph_edit, shapes
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.memory_rules import (  # the public names are re-exported: callers read memory_model.Rule etc.
    NO_RULE_REASONS,
    RULES,
    Kind,
    ReductionPlan,
    Rule,
    _elements,
    _register,
    _static_nbytes,
    dot_fused_into,
    merged_into,
    reduction_plan,
)
from grappler_ext.op_types import ARG_REDUCTIONS, BRANCH_TYPES
from grappler_ext.xla_facts import FOLDED_CONSTANT_MAX_BYTES, MATVEC_FUSION_MAX_BYTES  # the latter re-exported

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
    ``output_bytes`` is the outputs' share of the end state, for information.  ``unknown``: the
    ``(name, type, why)`` of each op without a rule, which ``unknown_ops`` renders for people.
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
    unknown: tuple[tuple[str, str, str], ...] = ()

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

# Layout ops whose output is larger than an input without reading any element twice.
_NO_REUSE = frozenset({"ConcatV2", "Pad", "PadV2", "MirrorPad", "SpaceToBatchND", "BatchToSpaceND"})
# Ops whose output is an array even where every input is one value broadcast (see _from_constants).
_ARRAY_MAKERS = frozenset({"Range", "LinSpace", "OneHot", "MatrixDiagV3", "MatrixSetDiagV3", "MatrixBandPart",
                           "ConcatV2", "Pad", "PadV2", "MirrorPad", "Cumsum", "Cumprod", "SpaceToBatchND"})
_FED = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})   # values from outside the graph


def _shape_tuple(t: tf.Tensor):
    d = shapes.dims(t)          # a nominal size for dimensions known at run time (grappler_ext.shapes)
    return None if d is None else tuple(d)


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
        self.constant = self._from_constants()
        self.literals: set[str] = set()               # tensors XLA folds into literals of their own
        self.info: dict[str, TensorInfo] = {}
        self.fused_roots: dict[str, frozenset] = {}   # fused tensor -> the kernels whose fusion holds it
        self.unknown: list[tuple[str, str, str]] = []   # (name, type, why) of each op without a rule
        for op in reversed(self.order):               # readers are decided before their producers
            rule = rules.get(op.type)
            why = rule.unknown_when(op) if rule is not None and rule.unknown_when is not None else None
            if rule is None or why:
                self.unknown.append((op.name, op.type, why or NO_RULE_REASONS.get(op.type, "no rule")))
            for t in op.outputs:
                self.info[t.name] = self._decide(op, rule, t)
        self.unknown.reverse()

    def _from_constants(self) -> dict[str, bool]:
        """The tensors computed from constants only, each mapped to whether its value is an array
        rather than one value broadcast (a ``Fill``, and elementwise ops and layouts of such).  XLA
        folds them at compile time: one value broadcast stays a broadcast its readers fuse (measured:
        ``x * (tf.ones([n, n]) * 2)`` holds ``x`` and its result only); an array (an iota, a diagonal,
        a band, a comparison of iotas) of at most ``FOLDED_CONSTANT_MAX_BYTES`` becomes a literal of its
        full size where the program's data meets it (measured, n = 1000: ``x + tf.eye(n)``, ``x *
        band_part(ones, -1, 0)``, ``x + cast(range[:, None] - range[None])`` each hold an n x n constant
        beside ``x`` and the result; at n = 2000, none)."""
        constant: dict[str, bool] = {}
        for op in self.order:
            rule = self.rules.get(op.type)
            if rule is None or op.type in _FED or op.op_def.is_stateful or rule.kind not in (
                    Kind.CONSTANT, Kind.LOOP, Kind.BITCAST, Kind.REDUCE, Kind.STATIC):
                continue
            inputs = self.data_inputs(op)
            # (sizes known only at run time are no constants: a Range over a padded batch's length)
            shaped = [*op.outputs, *(op.inputs if rule.kind is Kind.STATIC else ())]
            if any(t.name not in constant for t in inputs) or not all(t.shape.is_fully_defined() for t in shaped):
                continue
            array = (op.type in _ARRAY_MAKERS or any(constant[t.name] for t in inputs)
                     or (rule.kind is Kind.CONSTANT and (_elements(op.outputs[0]) or 0) > 1))
            for t in op.outputs:
                constant[t.name] = array
        return constant

    def _folded(self, t: tf.Tensor) -> TensorInfo:
        """The decision for an array computed from constants only (:meth:`_from_constants`): a literal
        where an op of the program's data (or the function's caller) reads it, else folded into one."""
        meets = self.is_output(t) or any(
            not any(o.name in self.constant for o in reader.outputs) for reader, _ in self.readers(t))
        if not meets:
            return self._info(t, False, "computed from constants only: folded into the literal its readers make")
        if (_elements(t) or 0) <= 1:
            return self._info(t, False, "scalar computed from constants, folded into its consumers")
        if (_static_nbytes(t) or 0) > FOLDED_CONSTANT_MAX_BYTES:
            return self._fuse_or_keep(t.op, t, expensive=False)       # (iotas and compares, not folded)
        self.literals.add(t.name)
        return self._info(t, True, "computed from constants only: XLA folds it into a literal")

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
        return TensorInfo(t.name, t.op.type, _shape_tuple(t), t.dtype, _static_nbytes(t), materialised, reason,
                          alias_of)

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
        if self.constant.get(t.name) and rule.kind not in (Kind.CONSTANT, Kind.STATIC):
            return self._folded(t)
        if rule.kind is Kind.PARAMETER:
            if op.type == "ReadVariableOp" and not self.readers(t) and not is_output:
                # (kept live by a control edge only: a read forwarded to the value written before it)
                return self._info(t, False, "a variable read nothing reads")
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
            into = dot_fused_into(op, self)
            if into is not None:
                self.fused_roots[t.name] = self._roots(into)
                return self._info(t, False, f"fused with `{into.type}` ({into.name}): XLA:CPU runs a float32 dot "
                                            "and its reduction as one YNNPACK fusion")
            return self._info(t, True, f"`{op.type}` kernel output")
        if rule.kind is Kind.REDUCE:
            outer = merged_into(op, self)
            if outer is not None:
                self.fused_roots[t.name] = self._roots(outer)
                return self._info(t, False, f"merged into `{outer.type}` ({outer.name}): XLA folds a reduction "
                                            "of a reduction into one")
            plan = reduction_plan(op, self)
            if op.type in ARG_REDUCTIONS or not plan.keeps_producers:
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


_MEMO = "_tf_memsafe_analysis"


def _unknown_op(name: str, kind: str, why: str) -> str:
    """One op without a rule, as :attr:`Estimate.unknown_ops` lists it."""
    return f"{name} ({kind}): {why}"


def _without_rules(unknown: list[tuple[str, str, str]], listed: int = 3) -> str:
    """The reason for ops the model has no rule for (``(name, type, why)`` each): every op where
    they are few, else their types, each with how many, why and the first op's name (an LSTM's
    step has 18, ten of them its loop's accumulators: a reason a person can read to the end)."""
    head = f"{len(unknown)} op(s) without a rule: "
    if len(unknown) <= listed:
        return head + "; ".join(_unknown_op(*u) for u in unknown)
    kinds: dict[tuple[str, str], list[str]] = {}
    for name, kind, why in unknown:
        kinds.setdefault((kind, why), []).append(name)
    return head + "; ".join(f"{kind} x{len(names)} ({why}; first `{names[0]}`)" for (kind, why), names in kinds.items())


def analyse(graph, rules: Mapping[str, Rule] | None = None) -> tuple[Estimate, dict[str, TensorInfo]]:
    """:func:`estimate` and :func:`annotate` of ``graph`` from one analysis.

    Within a journaled run (a pipeline's), a graph not edited since its last analysis with the
    default rules at the same nominal size is not analysed again (the hook, the guard and the
    splitter each ask for the program as traced).  The result is shared: read it, never change it."""
    journal = graph_edit.active_journal()
    shapes.resolve(graph)        # ops a rewrite made since the sizes' table was: their dimensions at these sizes
    key = (journal, None if journal is None else journal.version, shapes.nominal_key())
    memo = getattr(graph, _MEMO, None) if rules is None else None
    if journal is not None and memo is not None and memo[0][0] is journal and memo[0][1:] == key[1:]:
        return memo[1]
    with shapes.read_once():     # (the graph is not edited while it is analysed)
        result = _analyse(graph, rules)
    if journal is not None and rules is None:
        setattr(graph, _MEMO, (key, result))
    return result


def _analyse(graph, rules: Mapping[str, Rule] | None = None) -> tuple[Estimate, dict[str, TensorInfo]]:
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
        if rule is not None and rule.kind is Kind.CONSTANT or src in a.literals:
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
        arguments = rule.parameters(op) if rule is not None and rule.parameters is not None else 0
        if arguments:
            buffers.append(Buffer(f"{op.name} (arguments read in it)", "parameter", arguments, (), 0, n_steps - 1, ()))

    fixed = _fixed_bytes(buffers)
    live, peak_step = peak_of(buffers, n_steps)
    schedule = tuple(Step(op.name, op.type, live[s]) for s, op in enumerate(steps))
    reasons = []
    if a.unknown:
        reasons.append(_without_rules(a.unknown))
    if dynamic:
        reasons.append(f"dynamic shapes: {', '.join(dynamic)}")
    return Estimate(
        peak_bytes=None if reasons else fixed["parameter"] + fixed["constant"] + live[peak_step],
        parameter_bytes=fixed["parameter"],
        constant_bytes=fixed["constant"],
        output_bytes=sum(b.bytes for b in buffers if b.kind == "output"),
        live_peak_bytes=live[peak_step],
        peak_op=steps[peak_step].name if steps else None,
        unknown_ops=tuple(_unknown_op(*u) for u in a.unknown),
        unknown=tuple(a.unknown),
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


# --- conditionals -----------------------------------------------------------------------------
# A conditional (tf.cond, tf.switch_case: mixed precision's loss scaling applies the optimizer's
# update only where the gradients are finite) is a kernel of the program: its operands and results
# are buffers, and while it runs its branch's temporaries are live beside them -- the most any
# branch holds beyond its arguments and results, each branch counted by the model on its own graph.
# A variable only the branches read (an optimizer's slots) is an argument of the whole program.

_BRANCH_MEMO = "_tf_memsafe_branch_estimates"


def branch_graphs(op: tf.Operation) -> list | str:
    """The graphs of a conditional's branches (their inputs are ``op.inputs[1:]``), or why not."""
    names = ([op.get_attr("then_branch").name, op.get_attr("else_branch").name] if op.type in ("If", "StatelessIf")
             else [f.name for f in op.get_attr("branches")])
    graphs = []
    for name in names:
        graph, fn = op.graph, None
        while graph is not None and fn is None:
            fn = graph._get_function(name)
            graph = getattr(graph, "outer_graph", None)
        if getattr(fn, "graph", None) is None:
            return f"branch `{name}` has no graph to read"
        graphs.append(fn.graph)
    return graphs


def _branch_estimates(op: tf.Operation) -> list | str:
    """The model's estimate of each branch of ``op``, or why there is none (memoised on the op)."""
    key = shapes.nominal_key()
    memo = getattr(op, _BRANCH_MEMO, None)
    if memo is not None and memo[0] == key:
        return memo[1]
    graphs = branch_graphs(op)
    found = graphs
    if not isinstance(graphs, str):
        found = []
        for graph in graphs:
            est, _ = analyse(graph)
            if est.peak_bytes is None:
                found = f"branch `{graph.name}`: {est.reason}"
                break
            found.append((graph, est))
    setattr(op, _BRANCH_MEMO, (key, found))
    return found


def _branches_unknown(op: tf.Operation) -> str | None:
    found = _branch_estimates(op)
    return found if isinstance(found, str) else None


def _branch_variables(op: tf.Operation, found: list):
    """``(input index, variable op, the value it reads or writes)`` for each read or update of a variable
    whose handle a branch of ``op`` takes (the conditional's input ``index + 1``)."""
    for graph, _ in found:
        handles = {t.ref(): i for i, t in enumerate(graph.inputs)}
        for inner in graph.get_operations():
            value = (inner.outputs[0] if inner.type == "ReadVariableOp" else
                     inner.inputs[1] if inner.type in _VARIABLE_WRITES else None)
            if value is not None and inner.inputs[0].ref() in handles:
                yield handles[inner.inputs[0].ref()], inner, value


def _branches_scratch(op: tf.Operation, ctx) -> int:
    """The most a branch holds beyond its arguments and results, and the new values of the variables
    the branches write (XLA makes them results of the conditional: a branch that does not write one
    passes its value through; measured, 16 MB for two 4 MB variables updated in a branch, 12 MB for
    the same updates outside a conditional)."""
    found = _branch_estimates(op)
    if isinstance(found, str):
        return 0
    written = {i: _static_nbytes(value) or 0 for i, inner, value in _branch_variables(op, found)
               if inner.type in _VARIABLE_WRITES}
    held = max([est.peak_bytes - est.parameter_bytes - est.output_bytes for _, est in found] + [0])
    return held + sum(written.values())


def _branches_parameters(op: tf.Operation) -> int:
    """The bytes of the variables the branches read or write whose handles nothing outside reads as
    values (XLA takes each variable a branch touches as an argument of the program)."""
    found = _branch_estimates(op)
    if isinstance(found, str):
        return 0
    counted: dict = {}
    for i, _, value in _branch_variables(op, found):
        outer = op.inputs[1 + i]
        if not any(reader.type == "ReadVariableOp" for reader in outer.consumers()):
            counted[i] = max(counted.get(i, 0), _static_nbytes(value) or 0)
    return sum(counted.values())


_VARIABLE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


_register(" ".join(sorted(BRANCH_TYPES)), Rule(Kind.LIBRARY, scratch=_branches_scratch, unknown_when=_branches_unknown,
                                                 parameters=_branches_parameters))


# --- the planner's hook -----------------------------------------------------------------------


def bytes_for_chunk(est: Estimate, split: Mapping[str, int], chunk: int) -> int:
    """Peak bytes when the tensors in ``split`` are cut to ``chunk`` along the given axis.

    ``split`` maps a tensor name to the axis the splitter cuts it along (the splitter's axis
    rules say which tensors carry the split axis); every buffer holding such a tensor shrinks to
    ``bytes * chunk / size`` along that axis, others keep their size, and the peak is recomputed
    over the same schedule.  Pure arithmetic, no TensorFlow.

    Fusion decisions are those of the full-size graph: a chunk that changes a reduced extent
    across the 32-element threshold (:data:`~grappler_ext.xla_facts.FUSED_REDUCTION_MAX`) would change them, so split
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
