"""The size a program's run-time dimensions are planned at, from how its memory grows with them.

A function traced with a ``None`` in its ``input_signature`` (or generalised by
``reduce_retracing``, or by Keras' ``fit`` on a ``tf.data`` pipeline with a short last batch) has
dimensions known only when it runs.  The splitter plans it at one nominal size for all of them
(:mod:`grappler_ext.shapes`), builds loops that read their lengths at run time, and XLA compiles
the result once per concrete shape.  This module says which size:

    growth(graph)                    the memory model's bytes at size 1, and per unit of size more
    nominal_size(growth, limit, ..)  the size where what grows is ``over`` times the limit
    with_room_for_io(size, ..)       smaller where the inputs and outputs would crowd the limit there

At that size every tensor that grows with the dimension is large for the limit (so each gets a
loop), and what cannot be split (the inputs themselves, the outputs) is still a small part of it.
A loop's chunk is planned there, and is right at every other size: a slice's cost does not depend on
the length (only the split axis may be unknown), so the loops keep the limit wherever the rest of
the program does.  The plan does not stop where the program fits at that size while a large tensor
left whole grows faster than the inputs and outputs (:func:`outgrowing`): that tensor would outgrow
the limit a little beyond it, so it gets a loop too.  Where the memory model puts the program within
the limit there, those tensors are split before XLA's figure for the whole program is asked: one
compile of it, not one before and one after (each is tens of seconds for a Transformer's step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import tensorflow as tf

from grappler_ext import memory_model, shapes
from grappler_ext.splitter import scaling

__all__ = ["Growth", "Nominal", "dynamic_inputs", "dimension", "needs_at", "io_bytes", "growth", "nominal_size",
           "with_room_for_io", "growth_note", "planned_shapes", "outgrowing", "describe_growth"]

PROBE = 1024          # the second size the model is asked at (the first: 1)
FAR = 8               # the third: 1 + FAR * PROBE (how fast it grows beyond)
BATCH = 8             # a batch's nominal size beside other run-time sizes (a padded batch's length)


@dataclasses.dataclass(frozen=True)
class Growth:
    """The memory model's count of a program with run-time dimensions: ``base_bytes`` at size 1 and
    ``per_unit`` bytes more for each unit of size up to ``1 + PROBE`` (all of them taken as one size),
    and beyond it as the size to the power ``power`` (from the count at ``1 + FAR * PROBE``: 2 where a
    [B, B] matrix grows with the batch, a CLIP loss' logits; at least 1)."""

    base_bytes: int
    per_unit: float
    power: float = 1.0

    def within(self, limit: int) -> float | None:
        """The size up to which the program is within ``limit`` (``inf``: at any size; ``None``: not even at 1)."""
        if self.base_bytes > limit:
            return None
        if self.per_unit <= 0:
            return float("inf")
        return 1 + PROBE * ((limit - self.base_bytes) / (self.per_unit * PROBE)) ** (1 / self.power)


def dynamic_inputs(graph) -> list[tf.Tensor]:
    """The function's own inputs with dimensions known only at run time (what the user chose: a
    ``None`` in an ``input_signature``, a batch from ``tf.data``)."""
    return [t for t in graph.inputs if t.dtype not in (tf.resource, tf.variant) and not t.shape.is_fully_defined()]


def dimension(graph, name: str) -> str:
    """A dynamic tensor as a person finds it: "`x:0` dimension 0 of [?, 3]"."""
    try:
        shape = graph.get_tensor_by_name(name).shape
    except (KeyError, ValueError):
        return f"`{name}`"
    if shape.rank is None:
        return f"`{name}` of unknown rank"
    dims = [i for i, d in enumerate(shape.as_list()) if d is None]
    text = "[" + ", ".join("?" if d is None else str(d) for d in shape.as_list()) + "]"
    return f"`{name}` dimension{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))} of {text}"


class Nominal:
    """How a program's run-time dimensions are read when it is planned: every tensor's dimensions as
    products of the function's run-time sizes (:func:`grappler_ext.shapes.symbols`) where they can be
    found, a batch (an input's axis 0) at :data:`BATCH` beside other run-time sizes, every other at
    the nominal size.  A padded batch's [B, L, L] scores are then planned as [8, n, n], as
    batches and sequences usually are (a few examples, long sequences), not [n, n, n]; the loops'
    chunks are scaled to the run's sizes anyway (:mod:`.scaling`)."""

    def __init__(self, graph):
        self.graph = graph
        try:
            self.table = shapes.symbols(graph, dynamic_inputs(graph))
        except Exception:  # noqa: BLE001 - a graph the copy cannot be made of: one nominal size for all
            self.table = None
        used = {k for dims in (self.table.names.values() if self.table else ()) for m in dims if m for k, _ in m[1]}
        batch = {k for k in used if self.table.axis(k) == 0}
        self.batch = frozenset(batch) if batch and used - batch else frozenset()

    def values(self, size: int) -> dict[int, int]:
        return {k: min(size, BATCH) for k in self.batch}

    def sizes(self, size: int):
        """The context (:func:`grappler_ext.shapes.nominal`) that reads the program at ``size``."""
        return shapes.nominal(size, self.table, self.values(size))

    def needs(self, size: int) -> int | None:
        return needs_at(self.graph, size, self)

    def describe(self, size: int) -> str:
        if self.batch:
            return f"{min(size, BATCH):,} for the batch (the inputs' axis 0) and {size:,} for the other dimensions"
        return f"{size:,} for each dimension"


def needs_at(graph, size: int, at: Nominal | None = None) -> int | None:
    """The memory model's count of ``graph`` with its run-time dimensions at ``size`` (read as ``at``
    says, if given; where an op has no byte rule, the rest of the program, a lower bound: a mixed
    precision optimizer's loss-scale conditional does not stop a padded batch's step being planned,
    and XLA's figure at the nominal size judges the plan); ``None`` where sizes decided inside the
    program stay unknown (a sparse update's ``Unique``)."""
    with (at.sizes(size) if at is not None else shapes.nominal(size)):
        est, _ = memory_model.analyse(graph)
    if est.dynamic_tensors:
        return None
    if est.peak_bytes is not None:
        return est.peak_bytes
    return est.parameter_bytes + est.constant_bytes + est.live_peak_bytes


def planned_shapes(graph, size: int, at: Nominal) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The shapes of the function's inputs with run-time dimensions at ``size`` (read as ``at`` says), by name."""
    with at.sizes(size):
        return tuple((t.name, tuple(shapes.dims(t))) for t in dynamic_inputs(graph) if shapes.dims(t) is not None)


def io_bytes(graph, size: int, at: Nominal | None = None) -> int:
    """The bytes of the function's inputs with run-time dimensions and of its outputs at ``size`` (read
    as ``at`` says): what no loop inside it makes smaller."""
    with (at.sizes(size) if at is not None else shapes.nominal(size)):
        return sum(shapes.nbytes(t) or 0 for t in list(dynamic_inputs(graph)) + list(getattr(graph, "outputs", []))
                   if t.dtype not in (tf.resource, tf.variant))


def outgrowing(graph, tensors) -> list[tf.Tensor]:
    """Of ``tensors``, under the table of the nominal sizes in effect, those whose elements grow with
    the run-time sizes faster than each of the function's inputs and outputs does, in the power of
    some size (a [B, H, L, L] attention's scores beside [B, L] tokens and [B, L, V] logits; a CLIP
    loss' [B, B] logits beside [B, E] embeddings); ``[]`` without a table, and for tensors it does not
    know.  A plan at the nominal sizes that leaves such a tensor whole holds only up to a little
    beyond them: the loops' slices keep their bytes at every size (:mod:`.scaling`), and the rest of
    the program grows as its inputs and outputs do, but such a tensor faster (a Transformer's padded
    step planned at a length of 653, its last decoder layer's attention whole: 1.2 GB there, 5.1 GB at
    2,048 against a limit of 2 GB)."""
    state = shapes.symbolic()
    if state is None:
        return []
    table = state[0]
    bounds = [scaling.row_of(t, table) for t in list(dynamic_inputs(graph)) + list(getattr(graph, "outputs", []))
              if t.dtype not in (tf.resource, tf.variant) and t.shape.rank is not None and t.name in table.names]

    def bounded(row: scaling.Row) -> bool:
        return any(row.unknown <= b.unknown and all(e <= dict(b.powers).get(k, 0) for k, e in row.powers)
                   for b in bounds)

    return [t for t in tensors if t.name in table.names and not bounded(scaling.row_of(t, table))]


def describe_growth(t: tf.Tensor) -> str:
    """How ``t``'s elements grow with the run-time sizes, for people: ``s0*s1^2`` (symbol ``k`` the
    size of :meth:`grappler_ext.shapes.Symbols.sources`' ``k``), under the table in effect; ``""`` without one."""
    state = shapes.symbolic()
    if state is None or t.name not in state[0].names:
        return ""
    row = scaling.row_of(t, state[0])
    return "*".join(f"s{k}" if e == 1 else f"s{k}^{e}" for k, e in row.powers) or "1"


def growth(needs: Callable[[int], int | None]) -> Growth | None:
    """How ``needs(size)`` grows, from sizes 1, ``1 + PROBE`` and ``1 + FAR * PROBE``; ``None`` where it
    cannot say."""
    low, high = needs(1), needs(1 + PROBE)
    if low is None or high is None:
        return None
    far = needs(1 + FAR * PROBE) if high > low else None
    power = max(1.0, math.log((far - low) / (high - low), FAR)) if far is not None and far > high else 1.0
    return Growth(low, (high - low) / PROBE, power)


def nominal_size(grows: Growth, needs: Callable[[int], int | None], limit: int, over: float) -> int | None:
    """The size where what grows is about ``over`` times ``limit`` by the memory model (within a
    factor of two), or ``None`` where nothing grows.  The straight line through sizes 1 and
    ``1 + PROBE`` first; what grows faster than the size (a [n, n] matrix, a padded batch's
    [B, L, L] scores) is halved until within twice the target, and what the line overshoots
    doubled until at least half of it."""
    if grows.per_unit <= 0:
        return None
    target = over * limit
    size = max(2, min(2**31 - 1, int(-(-target // grows.per_unit))))
    for _ in range(16):
        at = needs(size)
        if at is None or size <= 2 or at - grows.base_bytes <= 2 * target:
            break
        size //= 2
    for _ in range(16):
        at = needs(size)
        if at is None or at - grows.base_bytes >= target / 2 or size * 2 > 2**31 - 1:
            break
        size *= 2
    return size


def with_room_for_io(size: int, grows: Growth, needs: Callable[[int], int | None], limit: int,
                     io: Callable[[int], int], share: float) -> int:
    """``size`` halved while ``io(size)`` (the function's inputs and outputs, which no loop makes
    smaller) is over ``share`` of the limit and what grows would stay over half the limit at the
    halved size.  A Vision Transformer's evaluation at a run-time batch grows about four times its
    inputs and logits: at the size where it is 4 x the limit, those alone filled it, and every plan
    was a best effort."""
    while size > 2 and io(size) > share * limit:
        at = needs(size // 2)
        if at is None or at - grows.base_bytes <= limit / 2:
            break                 # (what grows would no longer be large for the limit: nothing planned)
        size //= 2
    return size


def growth_note(grows: Growth | None, limit: int) -> str:
    """What the memory model says the program needs as its run-time dimensions grow, if it could say."""
    if grows is None:
        return ""
    within = grows.within(limit)
    upto = ("; over the limit at a size of 1 already" if within is None else
            "; within the limit at any size" if within == float("inf") else
            f"; within the limit up to about {int(within):,}")
    faster = f", growing beyond as the size to the power {grows.power:.1f}" if grows.power > 1.05 else ""
    return (f" (by the memory model, about {grows.base_bytes / 1e6:,.1f} MB and {grows.per_unit:,.0f} B more "
            f"for each unit of those dimensions{faster}{upto})")
