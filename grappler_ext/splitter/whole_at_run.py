"""Loops run in one step where the program as written fits at the sizes it runs at.

    peak(s) = fixed(s) + max over the schedule of the bytes live at each step, each buffer's bytes
              at the nominal sizes n times prod_k (s_k / n_k) ** power_k
    chunk   = length  where peak(run sizes) <= Tuning.whole_at_run x limit,  else the planned chunk

A function with dimensions known only at run time (a padded ``tf.data`` batch) is planned at
nominal sizes (:mod:`.nominal`), where the program is over its limit by construction, and its loops
take their chunks from the sizes it runs at (:mod:`.scaling`).  Many runs are far smaller than the
nominal sizes: a Transformer's training step on batches of 8 sentences of 256 tokens needs 1.0 GiB
under a 2 GB limit, and was split all the same into eleven loops of a hundred rows (4.8 s a step
against 1.8 s as written).  XLA compiles the function once per concrete shape and resolves
shape-derived values then, so a predicate computed from the inputs' shapes is a compile-time
constant: each loop's chunk becomes the whole length where the program as written is within the
limit at those sizes, and the loop is one step (XLA keeps a loop of one iteration: a padded attention's
training step measured 1.02-1.08x the unsplit figure at such sizes, the loop's own buffers).

The predicate is the memory model's count of the program as written (:mod:`grappler_ext.memory_model`),
read symbolically: every buffer's bytes at the nominal sizes and how they grow with the run-time sizes
(the monomials of :func:`grappler_ext.shapes.symbols`; a dimension that is not such a product grows as
the fastest of them).  The schedule's steps are kept where no other step holds at least as many bytes
of every kind of growth (a Pareto set; the element-wise maximum where that set is large, an upper
bound), so the count at the run's sizes is exact for the model, not a straight line through two sizes.

Why it is safe: a loop of one step computes exactly what its slices do; its gradient recomputes the
region whole (the region's tensors are held during its own gradient only, not from the forward to the
backward).  The model is 0.75-1.1x XLA's figure on its test workloads (1.08x on that training step),
so the threshold is a share of the limit (:attr:`~.tuning.Tuning.whole_at_run`, ``model_trust``'s
0.8 by default); 0 turns this off.  Where the model cannot count the program as written (an op
without a byte rule), nothing is decided at run time: the loops keep their planned chunks.

What it does not do: a region whose slices have no run-time size beside the split axis keeps its
static chunk (its loop's shapes are static; see :func:`~.loop._scaled`); and a one-step loop still
recomputes its region in the gradient, so a training step run whole costs one more forward pass of
its split regions than as written (the cond between the region as written and its loop, which would
cost nothing, needs the region's gradient kept inside the cond's branch).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from grappler_ext import shapes

__all__ = ["Peak", "peak_of_program", "active", "fits", "max_pareto"]

# More kept steps than this: their element-wise maximum instead (an upper bound of each).
max_pareto = 64

# A kind of growth: ((symbol, power), ...) and the count of dimensions that grow as the fastest symbol.
Signature = tuple[tuple[tuple[int, int], ...], int]


@dataclasses.dataclass(frozen=True)
class Peak:
    """The memory model's count of a program as a function of its run-time sizes.

    ``signatures[j]`` is a kind of growth; ``fixed[j]`` the parameters' and constants' bytes of that
    kind at the ``nominal`` sizes (symbol -> size); ``steps[i][j]`` the bytes of that kind live at the
    i-th kept step of the schedule.  The count at sizes ``s`` is ``sum_j fixed[j] g_j(s) + max_i sum_j
    steps[i][j] g_j(s)`` with ``g_j(s) = prod_k (s_k / n_k) ** power_k``."""

    signatures: tuple[Signature, ...]
    fixed: tuple[float, ...]
    steps: tuple[tuple[float, ...], ...]
    nominal: tuple[tuple[int, int], ...]

    def _growth(self, sizes: dict[int, float]) -> np.ndarray:
        ratios = {k: sizes[k] / n for k, n in self.nominal}
        fastest = max(ratios.values(), default=1.0)
        return np.array([np.prod([ratios[k] ** e for k, e in powers] or [1.0]) * fastest ** unknown
                         for powers, unknown in self.signatures], dtype=np.float64)

    def at(self, sizes: dict[int, float]) -> float:
        """The count at ``sizes`` (symbol -> size), in bytes."""
        g = self._growth(sizes)
        return float(np.dot(self.fixed, g) + (np.max(np.asarray(self.steps) @ g) if self.steps else 0.0))

    def run_bytes(self, table: shapes.Symbols) -> tf.Tensor:
        """The count at the sizes the function runs at: a float64 scalar XLA resolves when it compiles."""
        ratios = {k: tf.cast(table.run_size(k), tf.float64) / float(n) for k, n in self.nominal}
        fastest = tf.reduce_max(tf.stack(list(ratios.values()))) if ratios else tf.constant(1.0, tf.float64)
        growth = []
        for powers, unknown in self.signatures:
            g = tf.constant(1.0, tf.float64)
            for k, e in powers:
                g *= ratios[k] ** e
            growth.append(g * fastest ** unknown)
        g = tf.stack(growth)
        live = tf.reduce_max(tf.reduce_sum(tf.constant(self.steps, tf.float64) * g[None, :], axis=1)) \
            if self.steps else tf.constant(0.0, tf.float64)
        return tf.reduce_sum(tf.constant(self.fixed, tf.float64) * g) + live


def _signature(t: tf.Tensor | None) -> Signature:
    """How ``t``'s bytes grow with the run-time sizes under the nominal sizes in effect."""
    if t is None or t.shape.rank is None:
        return ((), 1 if t is not None else 0)
    known = shapes.monomials(t)
    powers: dict[int, int] = {}
    unknown = 0
    for i, d in enumerate(t.shape.as_list()):
        if d is not None:
            continue
        m = known[i] if known is not None and i < len(known) else None
        if m is None:
            unknown += 1
            continue
        for k, e in m[1]:
            powers[k] = powers.get(k, 0) + e
    return tuple(sorted(powers.items())), unknown


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
    kinds: dict[Signature, int] = {}
    growth_of = []
    for b in est.buffers:
        sig = _signature(_buffer_tensor(graph, b))
        growth_of.append(kinds.setdefault(sig, len(kinds)))
    n_steps = max(len(est.schedule), 1)
    fixed = np.zeros(len(kinds))
    delta = np.zeros((n_steps + 1, len(kinds)))
    for b, j in zip(est.buffers, growth_of):
        if b.kind in ("parameter", "constant"):
            fixed[j] += b.bytes
        else:
            delta[min(b.first_step, n_steps - 1), j] += b.bytes
            delta[min(b.last_step, n_steps - 1) + 1, j] -= b.bytes
    live = np.cumsum(delta[:-1], axis=0)
    kept = _pareto(live, max_pareto) if len(live) else live
    used = sorted({k for sig in kinds for k, _ in sig[0]} | (set(table.sources) if any(u for _, u in kinds) else set()))
    nominal = tuple((k, values.get(k, size)) for k in used if k in table.sources)
    if any(k not in table.sources for sig in kinds for k, _ in sig[0]):
        return None
    return Peak(tuple(kinds), tuple(map(float, fixed)), tuple(tuple(map(float, r)) for r in kept), nominal)


# --- the plan in effect while its loops are built ------------------------------------------------

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("whole_at_run", default=None)


@contextlib.contextmanager
def active(peak: Peak | None, table: shapes.Symbols | None, threshold: float) -> Iterator[None]:
    """Loops built within the block run in one step where ``peak`` at the run's sizes is within
    ``threshold`` bytes (nothing changes where ``peak`` or ``table`` is ``None``)."""
    token = _ACTIVE.set(None if peak is None or table is None or threshold <= 0 else (peak, table, threshold, {}))
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
    peak, table, threshold, made = state
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "_control_dependencies_stack", None):
        return peak.run_bytes(table) <= threshold
    if id(graph) not in made or made[id(graph)][0] is not graph:
        made[id(graph)] = (graph, peak.run_bytes(table) <= threshold)
    return made[id(graph)][1]


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


def note(peak: Peak | None, at, threshold: float, limit: int) -> str:
    """What the plan of a program planned at nominal sizes (``at``: :class:`~.nominal.Nominal`) does at
    the sizes it runs at, for its record."""
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
    return (f"; where the program as written is within {share:.0%} of the limit at the sizes it runs at, by the "
            f"memory model ({where}), each loop runs in one step")
