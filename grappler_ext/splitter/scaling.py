"""Chunks scaled to the sizes a function runs at, for loops whose slices have other run-time sizes.

A loop along a padded batch's length (``[B, L, L]`` attention scores split along their queries)
holds, per row of its slice, ``B * L`` scores: how many rows a slice may hold depends on sizes
known only when the function runs.  The splitter plans such a loop at nominal sizes
(:class:`~.nominal.Nominal`: the batch at 8, the length at ``n``) and the loop computes its chunk
from the run's sizes, which XLA resolves when it compiles the function for its inputs' shapes:

    chunk = clip(floor(planned / growth), least, length)
    growth = max over the slice's tensors of prod_k (size_k / nominal_k) ** power_k

where ``power_k`` is how often run-time size ``k`` (a function input's axis ``k``: the batch, the
length) multiplies one row of that tensor (:func:`grappler_ext.shapes.symbols`).  No slice then
holds more than it was planned to, at any sizes, down to ``least`` rows (one row, or a top-k's
k): past that, a slice of one row is over its budget, and the loop runs as well as it can.  A
dimension that is not such a product (``L - 1``) grows as the fastest of the run-time sizes.

Where the plan's figures are given (:meth:`Scaling.room`: the budget, what the program holds
beside the loop, and a row's bytes, all at the nominal sizes), the chunk is at most the room the
run's sizes leave, what is held beside the loop grown as the largest of the region's inputs and
results:

    chunk = min(the above, floor((budget - fixed * growth_fixed) / (per_row * growth)))

so that a longer run than planned shrinks the loop for its larger inputs too.  A row's bytes there
are XLA's, the loop compiled alone at the nominal sizes (:func:`.policy.calibrated`), where that
could be measured; else the memory model's count.

The same sizes give the loop's accumulators their shapes (``[B, E]`` for a sum over the length):
:meth:`Scaling.dims`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from grappler_ext import shapes

__all__ = ["Row", "Scaling", "of", "growths", "row_of"]


@dataclasses.dataclass(frozen=True)
class Row:
    """How one row of a tensor a slice computes grows: ``powers`` of the run-time sizes (symbol ->
    power) and ``unknown`` dimensions that are not products of them."""

    powers: tuple[tuple[int, int], ...]
    unknown: int = 0


@dataclasses.dataclass
class Scaling:
    """A region's rows (:class:`Row`), the run-time sizes they read, and the sizes they were
    planned at (``nominal``: symbol -> size)."""

    rows: list[Row]
    table: shapes.Symbols
    nominal: dict[int, int]
    fixed: frozenset = frozenset()          # symbols planned at a set size (a batch), not the growing one
    held: list[Row] = dataclasses.field(default_factory=list)    # the inputs' and results' elements
    plan: tuple[float, float, float] | None = None                # (budget, beside the loop, a row's bytes)
    length: shapes.Monomial | None = None     # the split axis' length, where it is known only at run time

    def run_length(self) -> tf.Tensor | None:
        """The split axis' length when the function runs, from the function's input sizes (``None``
        for a static one)."""
        return None if self.length is None else self.table.run_value(self.length)

    def room(self, budget: float, beside: float, per_row: float) -> None:
        """Size the chunk from the plan's figures at the nominal sizes (see the module docstring)."""
        self.plan = (float(budget), max(float(beside), 0.0), float(per_row)) if per_row > 0 else None

    @property
    def degree(self) -> int:
        """How fast a row grows with the run-time sizes the plan let grow (a length, not a batch): the
        largest power among the rows.  A loop over a padded batch's queries holds [B, c, L] scores,
        degree 1; one over its examples [c, L, L], degree 2: its chunk runs out first as L grows."""
        return max((sum(e for k, e in row.powers if k not in self.fixed) + row.unknown for row in self.rows),
                   default=0)

    @property
    def steady(self) -> bool:
        """Whether a slice's row holds the same bytes at any run sizes (a loop along a batch of run-time
        size whose rows have no other such size; its inputs and results grow with the batch): its
        loop alone, compiled at the nominal sizes, measures a chunk's bytes as they are at any
        (:func:`.mechanism.loop_figure`: a Keras ViT's gradients computed along its batch grown from
        the model's one row to five)."""
        return not any(row.powers or row.unknown for row in self.rows)

    def _ratios(self) -> dict[int, tf.Tensor]:
        return {k: tf.cast(self.table.run_size(k), tf.float64) / float(n) for k, n in self.nominal.items()}

    def chunk(self, planned: int, length, least: int = 1) -> tf.Tensor:
        """``planned`` rows scaled to the run's sizes, within ``[least, max(length, least)]``."""
        ratios = self._ratios()
        largest = self._growth(self.rows, ratios)
        size = tf.floor(float(planned) / tf.maximum(largest, 1e-9))
        if self.plan is not None:
            budget, beside, per_row = self.plan
            room = budget - beside * self._growth(self.held, ratios)
            size = tf.minimum(size, tf.floor(room / (per_row * tf.maximum(largest, 1e-9))))
        most = tf.cast(tf.maximum(tf.cast(length, tf.int32), least), tf.float64)
        return tf.cast(tf.clip_by_value(size, float(least), most), tf.int32)

    @staticmethod
    def _growth(rows: list[Row], ratios: dict) -> tf.Tensor:
        growth = growths(rows, ratios)
        return tf.reduce_max(tf.stack(growth)) if growth else tf.constant(1.0, tf.float64)

    def dims(self, t: tf.Tensor, unit_axes: Sequence[int] = ()) -> tf.Tensor | None:
        """``t``'s shape when the function runs (size 1 along ``unit_axes``), or ``None`` where a
        dimension is not a product of the run-time sizes."""
        return self.table.run_shape(t, unit_axes)


def growths(rows: Sequence[Row], ratios: dict) -> list[tf.Tensor]:
    """How much each row has grown at the run's sizes: ``prod_k ratios[k] ** power_k``, each dimension
    that is not a product of the sizes as the fastest ratio (``ratios``: symbol -> run size / nominal,
    float64 scalars)."""
    fastest = tf.reduce_max(tf.stack(list(ratios.values()))) if ratios else tf.constant(1.0, tf.float64)
    out = []
    for row in rows:
        g = tf.constant(1.0, tf.float64)
        for k, e in row.powers:
            g *= ratios[k] ** e
        out.append(g * fastest ** row.unknown)
    return out


def row_of(t: tf.Tensor, table: shapes.Symbols, split: dict | None = None, dynamic: bool = False) -> Row:
    """How ``t``'s elements grow with the run-time sizes, as ``table`` reads its dimensions (a tensor it
    does not know: each dimension known only at run time as one that is not a product of them); a
    slice's row of it, without the split axis' own growth, with ``split`` (the axis' powers) and
    ``dynamic`` (the axis known only at run time: one such dimension fewer where ``t`` is not known)."""
    known = table.names.get(t.name)
    if known is None:
        return Row((), max(0, len(shapes.dynamic_axes(t)) - int(dynamic)))
    powers, unknown = _powers(known)
    for k, e in (split or {}).items():
        powers[k] = max(0, powers.get(k, 0) - e)
    return Row(tuple(sorted((k, e) for k, e in powers.items() if e)), unknown)


def _powers(monomials) -> tuple[dict[int, int], int]:
    powers: dict[int, int] = {}
    unknown = 0
    for m in monomials:
        if m is None:
            unknown += 1
            continue
        for k, e in m[1]:
            powers[k] = powers.get(k, 0) + e
    return powers, unknown


def of(tensors: Sequence[tf.Tensor], axis_monomial, dynamic: bool, held: Sequence[tf.Tensor] = ()) -> Scaling | None:
    """The :class:`Scaling` of a region whose slices compute ``tensors``, split along an axis whose
    length is ``axis_monomial`` (``None``: static), beside ``held`` (its inputs and results, whole),
    under the nominal sizes in effect; ``None`` where they have no table
    (:func:`grappler_ext.shapes.symbolic`)."""
    state = shapes.symbolic()
    if state is None:
        return None
    table, size, values = state
    split, _ = _powers([axis_monomial]) if axis_monomial is not None else ({}, 0)
    # (each kind of row once: the growth is the largest of theirs, and a row is a few ops to compute it
    # at run time; a Keras ViT's region has 2,000 tensors of one kind)
    rows = list(dict.fromkeys(row_of(t, table, split, dynamic) for t in tensors))
    whole = list(dict.fromkeys(row_of(t, table) for t in held if shapes.dynamic_axes(t)))
    used = {k for row in rows + whole for k, _ in row.powers}
    if any(row.unknown for row in rows + whole):
        used |= set(table.sources)
    nominal = {k: values.get(k, size) for k in sorted(used) if k in table.sources}
    return Scaling(rows, table, nominal, frozenset(values), whole, length=axis_monomial if dynamic else None)


def loop_sizes(region, run_time: bool) -> frozenset:
    """The sizes ``region``'s loop runs along, as a plan again with loops along other sizes first
    avoids them: in a program with sizes known only at ``run_time``, those sizes
    (:func:`split_sizes`); in a static one, its length (``("static", length)``: its axes told apart
    by their lengths, a Chamfer loss' batch of 2 from its 3,000 points)."""
    if run_time:
        return split_sizes(region)
    return frozenset() if region.dynamic else frozenset({("static", region.length)})


def split_sizes(region) -> frozenset:
    """The run-time sizes (:func:`grappler_ext.shapes.monomials`) a region's loop runs along: those of
    the axes it slices its inputs along (whole axes, not a reshape's factors); empty for a static one
    (``region``: a :class:`~.loop.Region`)."""
    if not region.dynamic:
        return frozenset()
    found = set()
    for ref, axis in region.sliced_inputs.items():
        dims = None if ref in region.factors else shapes.monomials(ref.deref())
        if dims is not None and axis < len(dims) and dims[axis] is not None and dims[axis][1]:
            found.add(dims[axis])
    return frozenset(found)
