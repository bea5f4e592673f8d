"""Two-dimensional tiles for an attention split along its keys: which tiles are computed, and their sizes.

    softmax(S) @ V over key slices, queries whole  =>  query blocks x key blocks, masked tiles skipped

An ``online_softmax`` region (:class:`~.combiners.OnlineSoftmax`) computes ``softmax(S) @ V`` over
slices of the keys with every query row in each slice.  A causal mask then makes no slice wholly
masked: the last query row sees every key.  Cut the query rows into blocks as well and the tiles
above the diagonal hold only masked scores (:mod:`.masked_tiles` proves which), so they contribute
nothing to any row that has an unmasked score: FlashAttention's causal schedule computes only the
tiles on and below the diagonal, about half of them.  This module decides whether a region can be
tiled, and how (:class:`TilePlan`); :mod:`.tiled_loop` builds the loops.

When a region can be tiled (:func:`query_axes`): every op of the region that carries the query rows
passes them on, op by op (elementwise ops, casts, selects, matrix products, axis moves:
:data:`_QUERY_SAFE`; others by their split rules, a key slice's rebuild rebuilt again for the query
block), its slice along the keys does not depend on where the slice starts, and no
random draw, reshape factor, run-time length or in-place write is involved.  A band of a matrix
(``tf.linalg.band_part``, a causal mask built in the region) and a fill or broadcast to a shape are
rebuilt from both offsets and sizes.  Each tensor the region
reads whole that carries the query rows (the queries, a mask's query positions) is then cut by query
block, and the region's own ops, rebuilt on those pieces, compute that block's rows of every slice.
A dry run (:func:`_builds`) builds one tile in a scratch graph and checks its partials' shapes.

The tile sizes (:func:`plan`, pure): a tile holds no more scores than a slice of the untiled loop
(all query rows by its gradient's chunk of keys), so the loop's bytes do not rise; square tiles of
at least :data:`MIN_TILE` rows, at most an eighth of the keys (finer tiles skip more of a causal
mask: (n - 1) / 2n of n x n tiles); key blocks divide the keys (no remainder slice), query blocks
need not: the last one is moved back to end at the last row (its rows already computed are computed
again, the same values, and receive no gradient twice).  Tiling is chosen only where at least
:data:`MIN_SKIPPED` of the tiles are skipped; otherwise the untiled loop is as fast and simpler.

Rows with no unmasked score (a padded query under Keras' query mask) would see only the tiles
computed, not every key as the unsplit softmax does; :mod:`.tiled_loop` computes all of such a
block's tiles (:attr:`TilePlan.dead_below`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from grappler_ext.op_types import BROADCASTING_ELEMENTWISE, MATMULS, UNARY_ELEMENTWISE
from grappler_ext.splitter import analysis, rules
from grappler_ext.splitter.masked_tiles import MaskedTiles, masked_tiles
from grappler_ext.splitter.outcome import Tiles

__all__ = ["TilePlan", "QueryAxes", "query_axes", "tile_sizes", "plan", "MIN_TILE", "MIN_SKIPPED"]

MIN_TILE = 128          # rows of a tile at least (smaller ones cost more in loop steps than they save)
MIN_SKIPPED = 0.2       # the share of tiles skipped for tiling to be chosen

# Ops whose tile is rebuilt from its rows' and its keys' offsets and sizes (:mod:`.tiled_loop`): a
# band of a matrix, a fill or a broadcast to a shape.
_AT_BOTH_OFFSETS = frozenset({"MatrixBandPart", "Fill", "BroadcastTo"})
# Ops that pass the query rows through unchanged when rebuilt on a block of them.
_QUERY_SAFE = (UNARY_ELEMENTWISE | BROADCASTING_ELEMENTWISE | MATMULS
               | {"Select", "Einsum", "ExpandDims", "Squeeze", "Transpose", "Softmax", "LogSoftmax"})


@dataclasses.dataclass(frozen=True)
class QueryAxes:
    """Where the query rows lie in what the region reads: ``whole[k]`` in external input ``k`` read
    whole, ``sliced[k]`` in its slices along the keys (``None``: not there); ``derived`` the same for
    the prologue's outputs (``{ref: axis}``), ``constants`` for small constants the region inlines;
    ``at_offsets``: the region's ops whose tile depends on where its rows and keys start (a band of a
    matrix), with their output's query axis; ``composed``: ops whose slices are rebuilt with other
    attributes (a strided slice's masks, a reshape's shape), with their query rows' propagation: a
    tile is the key slice's rebuild, rebuilt again for the block's rows."""

    whole: tuple
    sliced: tuple
    derived: dict
    constants: dict
    at_offsets: dict = dataclasses.field(default_factory=dict)
    composed: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """A tiled loop's schedule.

    Attributes:
      query_block, key_block: a tile's rows and keys (key blocks divide the keys).
      starts: each query block's first row (the last one moved back to end at the last row).
      owned: each block's first row that no earlier block computed (its gradient's rows start there).
      spans: each query block's key blocks computed, ``(first, stop)``: the hull of its tiles not skipped.
      dead_below: a row whose running maximum is at most this saw only masked scores (then all of
        its block's tiles are computed).
      skipped: tiles skipped, of ``total``.
      axes: the query axes (:class:`QueryAxes`).
      rows_axis: the query rows' axis in the outputs ``[o / l, m, l]`` (the output's layout:
        ``BTNH`` for Keras' attention, an ``Einsum``).
    """

    query_block: int
    key_block: int
    starts: tuple[int, ...]
    owned: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    dead_below: float
    skipped: int
    total: int
    axes: QueryAxes
    rows_axis: int = -2

    @property
    def key_blocks(self) -> int:
        return self.total // len(self.starts)

    def count(self, backward: TilePlan) -> Tiles:
        """What the loop's record says of its tiles, its gradient's in ``backward``."""
        return Tiles(self.query_block, self.key_block, self.skipped, self.total,
                     (backward.query_block, backward.key_block))


def _carries_key_offset(region, op) -> bool:
    prop = getattr(region.rebuild[op], "__self__", None)
    return not isinstance(prop, rules.Propagation) or prop.rebuild_at is not None


def query_axes(region, option, external: Sequence[tf.Tensor]) -> QueryAxes | str:
    """Where the query rows of ``option``'s ``softmax(S) @ V`` lie in each tensor ``region`` reads
    (``external`` its inputs, in the loop's order), or why it cannot be tiled."""
    if region.dynamic or region.factors or region.written_into:
        return "a run-time length, a reshape's factor or an in-place write"
    scores = option.requests[0][0]
    along: dict = {scores.ref(): scores.shape.rank - 2, option.root.inputs[1].ref(): None}  # tensor -> query axis
    at_offsets: dict = {}
    composed: dict = {}
    reads: dict = {}                                             # (tensor ref, sliced?) -> query axes
    region_ops = set(region.ops)

    def read(t, sliced: bool, axis):
        reads.setdefault((t.ref(), sliced), set()).add(axis)

    read(option.root.inputs[1], True, None)                      # V, sliced along the keys
    if scores.op not in region_ops:
        read(scores, True, along[scores.ref()])
    for op in reversed(region.ops):
        wanted = {k: along[o.ref()] for k, o in enumerate(op.outputs) if along.get(o.ref()) is not None}
        if not wanted:
            axes_in = [None] * len(op.inputs)
        else:
            k, axis = next(iter(wanted.items()))
            banded = op.type in _AT_BOTH_OFFSETS
            if not banded and _carries_key_offset(region, op):
                return f"`{op.type}` ({op.name}) carries the query rows, and its slice depends on where it starts"
            prop = rules.propagate(op, k, axis)
            if not prop or (prop.rebuild_at is not None and not banded) or any(
                    f is not None for f in prop.input_factors or ()):
                return f"`{op.type}` ({op.name}) does not pass the query rows on"
            if banded:
                at_offsets[op] = axis
            elif op.type not in _QUERY_SAFE and prop.rebuild is not None:
                composed[op] = prop      # its key slice's rebuild, then the query block's on that
            if any(prop.output_axes[i] != a for i, a in wanted.items()):
                return f"`{op.type}` ({op.name}) has its outputs' query rows along other axes"
            axes_in = prop.input_axes
        for t, a, key_axis in zip(op.inputs, axes_in, region.input_axes[op]):
            if t.op in region_ops:
                if along.get(t.ref(), a) != a:
                    return f"`{t.name}` is read with its query rows along two axes"
                along[t.ref()] = a
            else:
                read(t, key_axis is not None, a)
    for key, axes in reads.items():
        if len(axes) > 1:
            return f"`{key[0].deref().name}` is read with its query rows along two axes"
    derived_refs = {o.ref() for op in region.prologue for o in op.outputs}
    whole = tuple(next(iter(reads.get((t.ref(), False), {None}))) for t in external)
    sliced = tuple(next(iter(reads.get((t.ref(), True), {None}))) for t in external)
    known = {t.ref() for t in external}
    derived = {ref: next(iter(axes)) for (ref, s), axes in reads.items() if ref in derived_refs and not s}
    if any(s and ref in derived_refs for ref, s in reads):
        return "a tensor the prologue computes is read along the keys"
    constants = {ref: next(iter(axes)) for (ref, s), axes in reads.items()
                 if ref not in known and ref not in derived_refs and next(iter(axes)) is not None}
    if any(s for (ref, s) in reads if ref in constants):
        return "an inlined constant is read along the keys"
    if all(a is None for a in whole + sliced) and not any(a is not None for a in derived.values()):
        return "no input carries the query rows"
    return QueryAxes(whole, sliced, derived, constants, at_offsets, composed)


def tile_sizes(queries: int, keys: int, elements: int) -> tuple[int, int] | None:
    """``(query_block, key_block)`` for tiles of at most ``elements`` scores (pure): square (or every
    query, if fewer), at least :data:`MIN_TILE`, at most ``keys / 8`` where that allows; the key block
    divides ``keys``.  ``None`` where no such tiles exist (too few keys, or no divisor of ``keys`` near
    the size wanted)."""
    want = min(int(math.isqrt(max(elements, 1))), max(MIN_TILE, keys // 8))
    if want < MIN_TILE or keys < 2 * MIN_TILE:
        return None
    divisors = [d for d in range(MIN_TILE // 2, want + 1) if keys % d == 0]
    if not divisors or divisors[-1] * 2 < want:
        return None
    return min(queries, divisors[-1]), divisors[-1]


def _schedule(queries: int, query_block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each query block's first row, the last moved back to end at the last row; and its first row no
    earlier block holds."""
    owned = tuple(range(0, queries, query_block))
    starts = tuple(min(s, queries - query_block) for s in owned)
    return starts, owned


def plan(region, option, external: Sequence[tf.Tensor], elements: int,
         proof=masked_tiles) -> TilePlan | str:
    """The tiles for ``option``'s region (``external`` its inputs), each of at most ``elements``
    scores, or why it is left untiled."""
    scores = option.requests[0][0]
    if not scores.shape.is_fully_defined():
        return "the scores' shape is known only at run time"
    queries, keys = scores.shape[-2], scores.shape[-1]
    axes = query_axes(region, option, external)
    if isinstance(axes, str):
        return axes
    sizes = tile_sizes(queries, keys, elements)
    if sizes is None:
        return f"no tiles of at most {elements} scores fit {queries} x {keys}"
    query_block, key_block = sizes
    starts, owned = _schedule(queries, query_block)
    cols = [(j, j + key_block) for j in range(0, keys, key_block)]
    proven: MaskedTiles | None = proof(scores, [(s, s + query_block) for s in starts], cols)
    if proven is None:
        return "no tile is proven masked"
    spans = []
    for row in proven.skipped:
        kept = np.flatnonzero(~row)
        spans.append((int(kept[0]), int(kept[-1]) + 1) if kept.size else (0, 1))
    total = len(starts) * len(cols)
    skipped = total - sum(b - a for a, b in spans)
    if skipped < MIN_SKIPPED * total:
        return f"only {skipped} of {total} tiles are masked"
    out = option.root.outputs[0].shape.rank
    layout = analysis.softmax_einsum(option.root) if option.root.type == "Einsum" else None
    rows_axis = out - 2 if layout is None else layout.output.index(layout.probs[-2])
    return TilePlan(query_block, key_block, starts, owned, tuple(spans), proven.bound / 2, skipped, total, axes,
                    rows_axis)
