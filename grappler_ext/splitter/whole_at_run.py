"""Loops that give way to the program as written where it fits at the sizes it runs at.

    y = where(fits, region(gate(x, fits)), loop(gate(x, not fits)))       one loop's readers read y
    fits = peak(run sizes) <= Tuning.whole_at_run (0.75) x limit
    peak(s) = fixed(s) + max over the schedule of the bytes live at each step, each buffer's bytes
              at the nominal sizes n times prod_k (s_k / n_k) ** power_k

A function with dimensions known only at run time (a padded ``tf.data`` batch) is planned at
nominal sizes (:mod:`.nominal`), where the program is over its limit by construction, and its loops
take their chunks from the sizes it runs at (:mod:`.scaling`).  Many runs are far smaller than the
nominal sizes: a Transformer's training step on batches of 8 sentences of 256 tokens needs 1.0 GiB
under a 2 GB limit, and was split all the same into eleven loops of a hundred rows (4.8 s a step
against 1.8 s as written).  XLA compiles the function once per concrete shape and resolves
shape-derived values then, so a predicate computed from the inputs' shapes is a compile-time
constant, and a ``select`` on it is folded to the side it picks: what only the other side reads is
dead, and XLA removes it, loops included.

So each loop's readers read ``where(fits, region as written, loop)`` (:func:`install`, after the
plan): the region's ops stay in the graph, reading their inputs through *gates*, identities whose
gradient passes where ``fits`` holds and is zero elsewhere, and the loop reads its inputs through
gates open where it does not; the gradients inside the function are then differentiated again
through both sides.  A region's ops that something outside it also reads (a loop built before it,
reading a layer the region recomputes) run on either side: they read their inputs ungated, and the
rest of the region reads them through gates, so that their gradient keeps that reader's share.  Where
the program fits, XLA keeps the region as written and its gradient and drops the loop's forward and
gradient: the program is the unsplit one, to the byte and to the bit (tested).  Elsewhere it keeps
the loop and drops the region.  A loop that cannot give way (its region holds a stateful op, which
XLA keeps even where nothing reads it, or writes a variable in place) takes the whole length as its
chunk where the program fits (:func:`~.loop._scaled`), and runs once.

The predicate is the memory model's count of the program as written (:mod:`grappler_ext.memory_model`),
read symbolically: every buffer's bytes at the nominal sizes and how they grow with the run-time sizes
(the monomials of :func:`grappler_ext.shapes.symbols`; a dimension that is not such a product grows as
the fastest of them).  The schedule's steps are kept where no other step holds at least as many bytes
of every kind of growth (a Pareto set; their element-wise maximum where that set is large, an upper
bound), so the count at the run's sizes is exact for the model, not a straight line through two sizes.

Why it is safe: nothing compiles the program at the sizes it runs at before it runs, so the threshold
is a share of the limit (:attr:`~.tuning.Tuning.whole_at_run`) no larger than the model's worst measured
ratio to XLA's figure, 0.75 (0.75-1.1x on its test workloads, 1.08x on that training step): a program
the model puts within it is within the limit by XLA's figure; 0 turns this off.  Where the model
cannot count the program as written (an op without a byte rule), nothing is decided at run time: the
loops keep their planned chunks.

What it does not do: a region whose slices have no run-time size beside the split axis keeps its
static chunk (its loop's shapes are static).  A tape outside the function (TensorFlow builds its
backward as a function of its own, where ``fits`` is an input, not a constant) gets the loop's
gradient alone, recomputing the region, in one step where the program fits: the forward then holds
nothing of the region as written for the backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops

from grappler_ext import gradients, graph_edit, graph_query, memory_model, shapes
from grappler_ext.splitter import rules, scaling
from grappler_ext.splitter.outcome import Code

__all__ = ["Peak", "Dispatch", "peak_of_program", "active", "fits", "dispatch", "dispatch_for", "loop_values", "record",
           "forget", "install", "largest_size", "note", "max_pareto"]

# More kept steps than this: their element-wise maximum instead (an upper bound of each).
max_pareto = 64


@dataclasses.dataclass(frozen=True)
class Peak:
    """The memory model's count of a program as a function of its run-time sizes.

    ``signatures[j]`` is a kind of growth (:class:`~.scaling.Row`: powers of the run-time sizes, and
    dimensions that grow as the fastest); ``fixed[j]`` the parameters' and constants' bytes of that
    kind at the ``nominal`` sizes (symbol -> size); ``steps[i][j]`` the bytes of that kind live at the
    i-th kept step of the schedule.  The count at sizes ``s`` is ``sum_j fixed[j] g_j(s) + max_i sum_j
    steps[i][j] g_j(s)`` with ``g_j(s) = prod_k (s_k / n_k) ** power_k``."""

    signatures: tuple[scaling.Row, ...]
    fixed: tuple[float, ...]
    steps: tuple[tuple[float, ...], ...]
    nominal: tuple[tuple[int, int], ...]

    def _growth(self, sizes: dict[int, float]) -> np.ndarray:
        ratios = {k: sizes[k] / n for k, n in self.nominal}
        fastest = max(ratios.values(), default=1.0)
        return np.array([np.prod([ratios[k] ** e for k, e in row.powers] or [1.0]) * fastest ** row.unknown
                         for row in self.signatures], dtype=np.float64)

    def at(self, sizes: dict[int, float]) -> float:
        """The count at ``sizes`` (symbol -> size), in bytes (what :meth:`run_bytes` builds as ops)."""
        g = self._growth(sizes)
        return float(np.dot(self.fixed, g) + (np.max(np.asarray(self.steps) @ g) if self.steps else 0.0))

    def run_bytes(self, table: shapes.Symbols) -> tf.Tensor:
        """The count at the sizes the function runs at: a float64 scalar XLA resolves when it compiles."""
        ratios = {k: tf.cast(table.run_size(k), tf.float64) / float(n) for k, n in self.nominal}
        g = tf.stack(scaling.growths(self.signatures, ratios))
        live = tf.reduce_max(tf.reduce_sum(tf.constant(self.steps, tf.float64) * g[None, :], axis=1)) \
            if self.steps else tf.constant(0.0, tf.float64)
        return tf.reduce_sum(tf.constant(self.fixed, tf.float64) * g) + live


def _signature(t: tf.Tensor | None, table: shapes.Symbols) -> scaling.Row:
    """How ``t``'s bytes grow with the run-time sizes (a tensor of unknown rank: as the fastest)."""
    if t is None or t.shape.rank is None:
        return scaling.Row((), 1 if t is not None else 0)
    return scaling.row_of(t, table)


def _buffer_tensor(graph, buffer) -> tf.Tensor | None:
    """The tensor whose shape a buffer of the model grows as: its first tensor, or for a library
    kernel's scratch the largest-growing of the op's inputs and outputs."""
    try:
        if buffer.kind == "scratch":
            op = graph.get_operation_by_name(buffer.name[:-len(" (scratch)")])
            candidates = [t for t in list(op.inputs) + list(op.outputs) if t.shape.rank is not None]
            return max(candidates, key=lambda t: (len(shapes.dynamic_axes(t)), t.shape.rank), default=None)
        return graph.get_tensor_by_name(buffer.tensors[0] if buffer.tensors else buffer.name)
    except (KeyError, ValueError):
        return None


def _pareto(rows: np.ndarray, most: int | None = None) -> np.ndarray:
    """The rows no other row is at least as large as in every column (one of equal rows kept); where
    there are more than ``most``, their element-wise maximum alone (at least as large as each)."""
    rows = np.unique(rows, axis=0)
    rows = rows[np.argsort(-rows.sum(axis=1), kind="stable")]
    kept = np.zeros((0, rows.shape[1]))
    for row in rows:
        if not np.any(np.all(kept >= row, axis=1)):
            kept = np.vstack([kept, row])
            if most is not None and len(kept) > most:
                return rows.max(axis=0, keepdims=True)
    return kept


def peak_of_program(graph, est) -> Peak | None:
    """:class:`Peak` of the memory model's estimate ``est`` of ``graph``, analysed under the nominal
    sizes in effect (:func:`grappler_ext.shapes.nominal` with a table); ``None`` where it has no count
    (an op without a byte rule, sizes decided inside the program) or no table."""
    state = shapes.symbolic()
    if state is None or est.peak_bytes is None or est.dynamic_tensors:
        return None
    table, size, values = state
    kinds: dict[scaling.Row, int] = {}
    growth_of = [kinds.setdefault(_signature(_buffer_tensor(graph, b), table), len(kinds)) for b in est.buffers]
    if any(k not in table.sources for row in kinds for k, _ in row.powers):
        return None
    fixed = np.zeros(len(kinds))
    for b, j in zip(est.buffers, growth_of):
        if b.kind in ("parameter", "constant"):
            fixed[j] += b.bytes
    # The model's liveness (memory_model.peak_of), for each kind of growth apart.
    live = np.array([memory_model.peak_of([b for b, g in zip(est.buffers, growth_of) if g == j], len(est.schedule))[0]
                     for j in range(len(kinds))]).T
    kept = _pareto(live, max_pareto) if len(live) else live
    used = {k for row in kinds for k, _ in row.powers}
    if any(row.unknown for row in kinds):
        used |= set(table.sources)
    nominal = tuple((k, values.get(k, size)) for k in sorted(used) if k in table.sources)
    return Peak(tuple(kinds), tuple(map(float, fixed)), tuple(tuple(map(float, r)) for r in kept), nominal)


# --- the plan in effect while its loops are built ------------------------------------------------


@dataclasses.dataclass
class Dispatch:
    """One loop that may give way to its region as written: the region's ops (roots included), the
    roots' outputs as written (``old``) and the loop's in their place (``new``), and the predicate
    that opens the gradient into the loop's inputs (``None``: always open, until :func:`install`)."""

    ops: frozenset = frozenset()
    old: list = dataclasses.field(default_factory=list)
    new: list = dataclasses.field(default_factory=list)
    loop_open: tf.Tensor | None = None


@dataclasses.dataclass
class _State:
    peak: Peak
    table: shapes.Symbols
    threshold: float
    pending: list = dataclasses.field(default_factory=list)     # Dispatch, in the order installed


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("whole_at_run", default=None)


@contextlib.contextmanager
def active(peak: Peak | None, table: shapes.Symbols | None, threshold: float) -> Iterator[None]:
    """Loops built within the block run in one step where ``peak`` at the run's sizes is within
    ``threshold`` bytes (nothing changes where ``peak`` or ``table`` is ``None``)."""
    token = _ACTIVE.set(None if peak is None or table is None or threshold <= 0 else _State(peak, table, threshold))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def fits() -> tf.Tensor | None:
    """A bool scalar, in the default graph: whether the program as written is within the threshold at
    the sizes the function runs at (XLA resolves it when it compiles); ``None`` outside :func:`active`."""
    state = _ACTIVE.get()
    if state is None:
        return None
    return state.table.once(("whole_at_run", id(state.peak), state.threshold),
                            lambda: state.peak.run_bytes(state.table) <= state.threshold)


def dispatch_for(region) -> Dispatch | None:
    """A :class:`Dispatch` for a region whose loop is being built, where the run may take the region as
    written instead: its chunk is scaled to the run's sizes (a static one runs as planned), it writes
    no variable in place, and it holds no stateful op (a stateful draw XLA keeps even where its result
    is not read); else ``None``."""
    if _ACTIVE.get() is None or region.scaled is None or region.written_into:
        return None
    if any(rules.is_stateful(op) for op in region.ops):
        return None
    return Dispatch()


# Set while :func:`install` differentiates the function's recorded gradients again: the gradients
# built then are inside the function, where XLA resolves ``fits``.  A gradient built at any other time
# (TensorFlow's, for a tape outside the function: a backward function of its own, where ``fits`` is an
# input, not a constant) takes the loop's side alone, so that the forward holds nothing of the region
# as written for it.
_REBUILDING: contextvars.ContextVar = contextvars.ContextVar("whole_at_run_rebuilding", default=False)


# A gate's predicate, by its op (an ``Identity`` whose gradient is :func:`_gate_gradient`).
_PREDICATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gate(x: tf.Tensor, predicate) -> tf.Tensor:
    """``x``, whose gradient passes where ``predicate()`` (a bool scalar, or ``None``: always) holds and
    is zero elsewhere, in the gradients :func:`install` builds (others pass it): XLA, resolving the
    predicate, drops the gradient computation it closes.  One ``Identity`` (a ``tf.custom_gradient``
    would also pass ``x`` through, and a tape outside the function would then keep it)."""
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"Identity": _GATE}):
        gated = tf.identity(x)
    _PREDICATES[gated.op] = predicate
    return gated


@ops.RegisterGradient("TfMemsafeWholeAtRunGate")
def _gate_gradient(op, upstream):
    predicate = _PREDICATES.get(op)
    p = predicate() if predicate is not None and _REBUILDING.get() else None
    if p is None or upstream is None:
        return upstream
    if isinstance(upstream, tf.IndexedSlices):
        return tf.IndexedSlices(tf.where(p, upstream.values, tf.zeros_like(upstream.values)), upstream.indices,
                                upstream.dense_shape)
    return tf.where(p, upstream, tf.zeros_like(upstream))


_GATE = "TfMemsafeWholeAtRunGate"
_CHOOSE = "TfMemsafeWholeAtRunChoose"


@ops.RegisterGradient("TfMemsafeWholeAtRunChoose")
def _choose_gradient(op, upstream):
    """``where(whole, old, new)``'s gradient: in the gradients :func:`install` builds, each side gets the
    upstream gradient where it is chosen (zero elsewhere); in any other (a tape outside the function),
    the loop's side gets it all and the region as written none, and nothing of the forward is read."""
    if upstream is None:
        return None, None, None
    if not _REBUILDING.get():
        return None, None, upstream
    whole, zeros = op.inputs[0], tf.zeros_like(upstream)
    return None, tf.where(whole, upstream, zeros), tf.where(whole, zeros, upstream)


def _differentiable(t: tf.Tensor) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def loop_values(dispatch: Dispatch | None, external) -> list | None:
    """What the loop of ``dispatch`` reads for the region's ``external`` inputs: each differentiable one
    through a gate that :func:`install` closes where the region as written runs (``None``: no dispatch)."""
    if dispatch is None:
        return None
    return [_gate(t, lambda: dispatch.loop_open) if _differentiable(t) else t for t in external]


def record(dispatch: Dispatch | None, roots, new, region_ops) -> None:
    """The loop of ``dispatch`` installed in place of ``roots`` (its outputs ``new``), for the region of
    ``region_ops`` (roots included); journaled."""
    state = _ACTIVE.get()
    if dispatch is None or state is None:
        return
    dispatch.ops = frozenset(region_ops)
    dispatch.old = [t for r in roots for t in r.outputs]
    dispatch.new = list(new)
    state.pending.append(dispatch)
    graph_edit.on_undo(lambda: state.pending.remove(dispatch) if dispatch in state.pending else None)


def forget(dispatch: Dispatch | None) -> None:
    """The loop of ``dispatch`` given up (built again in other chunks, with a dispatch of its own); journaled."""
    state = _ACTIVE.get()
    if dispatch is None or state is None or dispatch not in state.pending:
        return
    at = state.pending.index(dispatch)
    state.pending.remove(dispatch)
    graph_edit.on_undo(lambda: state.pending.insert(at, dispatch))


def dispatch(graph, scope: str, result) -> int:
    """:func:`install`, journaled: how many loops give way to their regions as written at run time.
    Where that fails, the loops stay as built (each in one step where it fits), said in ``result``
    (the pass's records)."""
    with graph_edit.some_journal() as journal:
        mark = len(journal)
        try:
            return install(graph, scope)
        except (ValueError, TypeError, KeyError, LookupError, NotImplementedError) as e:
            journal.undo(to=mark)
            result.skip([], f"the loops cannot give way to the program as written at run time "
                            f"({type(e).__name__}: {str(e).splitlines()[0]}): each runs in one step where it "
                            "fits", code=Code.DYNAMIC_SHAPES)
            return 0


def install(graph, scope: str) -> int:
    """Each recorded loop's readers read ``where(fits, region as written, loop)`` instead: the region's
    ops, kept in the graph, read their inputs through gates open where the program fits, the loop
    through gates open where it does not; then the gradients inside the function are differentiated
    again through both.  XLA resolves ``fits`` for each shape it compiles, and drops the side not
    taken, forward and gradient.  Returns how many loops; journaled (undone as a whole by the caller)."""
    state = _ACTIVE.get()
    if state is None or not state.pending:
        return 0
    live, backward = graph_query.live_ops(graph), gradients.backward_ops(graph)
    with graph_edit.building(graph, scope):
        whole = fits()
        closed = tf.logical_not(whole)
        for dispatch in state.pending:
            gates: dict = {}
            shared = _read_outside(dispatch.ops, live, backward)
            for op in sorted(dispatch.ops - shared, key=lambda o: o._id):  # noqa: SLF001 - creation order
                for i, x in enumerate(op.inputs):
                    # (a shared op's value is gated where the rest of the region reads it)
                    if (x.op in dispatch.ops and x.op not in shared) or not _differentiable(x):
                        continue
                    if x.ref() not in gates:
                        gates[x.ref()] = _gate(x, lambda: whole)
                    graph_edit.rewire_input(op, i, gates[x.ref()])
            chosen = _choose(whole, dispatch.old, dispatch.new)
            upstream = graph_query.ancestors(chosen)
            for new, sel in zip(dispatch.new, chosen):
                graph_edit.replace_uses(new, sel, upstream=upstream)
                gradients.retarget(graph, new, sel)
                shapes.same_as(sel, new)
            before = dispatch.loop_open
            dispatch.loop_open = closed
            graph_edit.on_undo(lambda d=dispatch, b=before: setattr(d, "loop_open", b))
    if gradients.records(graph):
        token = _REBUILDING.set(True)
        try:
            gradients.rebuild(graph, scope, graph.get_operations())
        finally:
            _REBUILDING.reset(token)
    return len(state.pending)


def _read_outside(region_ops: frozenset, live: set, backward: set) -> frozenset:
    """The region's ops whose values something outside it reads, and the region's ops those depend on.

    A region may hold ops whose values a live op of the forward outside it reads: another loop (a
    forward loop built before, reading a layer's output the region recomputes slice by slice), or a
    branch the region did not grow into.  As written they run whether the program fits or not, and
    their gradient carries that reader's as well as the region's, so their inputs are not gated: a gate
    closed where the program does not fit would drop the reader's share (a training step's first
    layer lost its attention's share of the gradient).  The recorded gradients' own ops
    (``backward``) are not readers: they are built again through the choice."""
    read = [op for op in region_ops
            if any(c not in region_ops and c in live and c not in backward for o in op.outputs for c in o.consumers())]
    return frozenset(graph_query.ancestor_ops(read) & region_ops) if read else frozenset()


def _choose(whole: tf.Tensor, old: list, new: list) -> list:
    """``where(whole, old, new)`` for each pair, with :func:`_choose_gradient`."""
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"SelectV2": _CHOOSE}):
        return [tf.where(whole, a, b) for a, b in zip(old, new)]


def largest_size(peak: Peak, values, threshold: float) -> int:
    """The largest size ``s`` (each run-time size at ``s``, those ``values(s)`` sets at theirs) where
    ``peak`` is within ``threshold``; 0 where not even at 1."""
    def count(s: int) -> float:
        set_ = values(s)
        return peak.at({k: float(set_.get(k, s)) for k, _ in peak.nominal})

    if count(1) > threshold:
        return 0
    low, high = 1, 2
    while high < 2**31 and count(high) <= threshold:
        low, high = high, high * 2
    if high >= 2**31:
        return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if count(mid) <= threshold else (low, mid)
    return low


def note(peak: Peak | None, at, threshold: float, limit: int, dispatched: int = 0) -> str:
    """What the plan of a program planned at nominal sizes (``at``: :class:`~.nominal.Nominal`) does at
    the sizes it runs at, for its record (``dispatched``: how many of its loops give way to their
    regions as written there)."""
    if threshold <= 0:
        return ""
    if peak is None:
        return ("; the memory model cannot count the program as written (an op without a byte rule), so its "
                "loops keep their chunks at every size")
    share = threshold / limit
    upto = largest_size(peak, at.values, threshold)
    where = (f"with the batch at {min(upto, 8)} and the other dimensions up to about {upto:,}"
             if at.batch else f"its dimensions up to about {upto:,}")
    if upto == 0:
        return f"; the program as written is over {share:.0%} of the limit at every size, so its loops always run split"
    how = ("each loop runs in one step" if not dispatched else
           f"{dispatched} loop{'s' if dispatched > 1 else ''} give{'' if dispatched > 1 else 's'} way to the region "
           "as written (XLA drops the loop, forward and gradient) and any other runs in one step")
    return (f"; where the program as written is within {share:.0%} of the limit at the sizes it runs at, by the "
            f"memory model ({where}), {how}")
