"""The splitter's mechanism for tiled attention: ``softmax(S) @ V`` in query x key tiles, masked tiles skipped.

Given an ``online_softmax`` region and its :class:`~.tiling.TilePlan`, this module builds

    outputs = custom_gradient(forward, backward)(*external inputs)

* ``forward``: a loop over the query blocks; for block ``i``, the tensors the region reads whole that
  carry the query rows are cut to the block's rows, and an inner loop folds the tiles of the block's
  span of key blocks (:attr:`~.tiling.TilePlan.spans`) into the running max, normaliser and
  accumulator (:class:`~.combiners.OnlineSoftmax`), each tile the region's ops rebuilt on the block's
  rows and one key block (the untiled loop's slice builder, :func:`.loop._slice_builder`).  A row
  whose running max is still at most :attr:`~.tiling.TilePlan.dead_below` saw only masked scores (a
  padded query under Keras' query mask): the unsplit softmax spreads such a row over every key, so
  then the block's other tiles are folded in too, and the result is the unsplit one.  The block's
  rows of ``[o / l, m, l]`` are written into the outputs.
* ``backward``: the same tiles again (FlashAttention-2's backward: each tile's probabilities
  recomputed from the forward's ``m`` and ``l``), each differentiated under the upstream gradient the
  combiner routes to it (:meth:`~.combiners.OnlineSoftmax.slice_upstream`); a tile's gradients are
  added into the inputs' gradients at its rows and keys.  The last query block, moved back over rows
  an earlier block computed, takes no upstream gradient for those rows, so none is counted twice.

A prologue (keys and values projected from the layer's input) is computed before the loops and again
in the backward, as in :mod:`.loop`.  The loops hold one tile's tensors at a time, never a slice of
all the query rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from grappler_ext import folding
from grappler_ext.splitter import replay
from grappler_ext.splitter.combiners import Combiner, accumulated, with_rows, write_slice
from grappler_ext.splitter.loop import (
    Region,
    _added,
    _carried_through_prologue,
    _in_order,
    _opaque_true,
    _roles,
    _slice_builder,
    _slice_gradients,
    _zero_after,
    external_inputs,
    region_inputs,
)
from grappler_ext.splitter.slicing import dynamic_slice, mask_rows
from grappler_ext.splitter.tiling import TilePlan

__all__ = ["build_tiled", "check"]


def _cut(t: tf.Tensor, axis: int | None, start, size: int) -> tf.Tensor:
    return t if axis is None else dynamic_slice(t, axis, start, size)


def _add_at(buffer: tf.Tensor, piece: tf.Tensor, offsets: dict) -> tf.Tensor:
    """``buffer`` with ``piece`` added in at ``offsets`` (``{axis: offset}``, 0 along the other axes)."""
    begin = tf.stack([tf.cast(offsets.get(d, 0), tf.int32) for d in range(buffer.shape.rank)])
    return xla.dynamic_update_slice(buffer, tf.slice(buffer, begin, piece.shape) + piece, begin)


def _tile_of(op, inputs, query_axis: int, key_axis: int | None, query_offset, key_offset, query_size: int,
             key_size: int) -> list[tf.Tensor]:
    """A tile of an op whose tile depends on where the tile starts and its size (``tiling._AT_BOTH_OFFSETS``)."""
    if op.type == "MatrixBandPart":
        return _band(inputs, query_axis, key_axis, query_offset, key_offset)
    shape = op.outputs[0].shape.as_list()
    shape[query_axis] = query_size
    if key_axis is not None:
        shape[key_axis] = key_size
    if op.type == "Fill":
        return [tf.fill(shape, inputs[1])]
    if op.type == "BroadcastTo":
        return [tf.broadcast_to(inputs[0], shape)]
    raise NotImplementedError(f"no tile rule for `{op.type}`")


def _band(inputs, query_axis: int, key_axis: int | None, query_offset, key_offset) -> list[tf.Tensor]:
    """A tile of ``MatrixBandPart``: its rows and columns numbered from where the tile's query rows
    and keys start (0 along an axis that carries neither)."""
    x, lower, upper = inputs
    rank = x.shape.rank

    def index(axis):
        start = query_offset if axis == query_axis else key_offset if axis == key_axis else 0
        return tf.cast(start, lower.dtype) + tf.range(x.shape[axis], dtype=lower.dtype)

    r, c = index(rank - 2)[:, None], index(rank - 1)[None, :]
    keep = tf.logical_and(tf.logical_or(lower < 0, r - c <= lower), tf.logical_or(upper < 0, c - r <= upper))
    return [tf.where(keep, x, tf.zeros_like(x))]


class _Block:
    """What the tiles of one query block read: the inputs read whole and the sources of the slices
    along the keys, cut to the block's rows where they carry them, and the prologue's outputs and
    inlined constants likewise (passed to the slice builder as ``derived``); the slice builder with
    the ops that depend on both offsets rebuilt from the block's (:func:`_band`)."""

    def __init__(self, region: Region, tiles: TilePlan, external, values, derived: dict, start, op_inputs: dict):
        axes, size = tiles.axes, tiles.query_block
        rebuild = dict(region.rebuild)
        for op, query_axis in axes.at_offsets.items():
            key_axis = region.rebuild[op].__self__.output_axes[0]
            rebuild[op] = (lambda q, k: lambda op_, ins, chunk, offset: _tile_of(op_, ins, q, k, start, offset, size,
                                                                                  chunk))(query_axis, key_axis)
        for op, prop in axes.composed.items():
            rebuild[op] = (lambda p, key: lambda op_, ins, chunk, offset: p.build(
                key(op_, ins, chunk, offset)[0].op, ins, size))(prop, region.rebuild[op])
        self.builder = _slice_builder(dataclasses.replace(region, rebuild=rebuild), external, op_inputs)
        n = len(external)
        self.whole = [_cut(v, axes.whole[k] if k < n else axes.derived.get(ref), start, size)
                      for k, (v, ref) in enumerate(zip(values, [t.ref() for t in external] + list(derived)))]
        self.sources = [_cut(v, axes.sliced[k], start, size) for k, v in enumerate(values[:n])]
        self.constants = {}
        for ref, axis in axes.constants.items():
            value = folding.static_value(ref.deref())
            self.constants[ref] = _cut(tf.constant(value, ref.deref().dtype), axis, start, size)
        self.n = n
        self.keys = list(derived)

    def build(self, whole, sources, offset, size):
        """``(partials, sliced)`` of one tile, ``sliced`` in ``whole``'s order (``None`` for the
        prologue's outputs: never cut along the keys)."""
        derived = {**self.constants, **dict(zip(self.keys, whole[self.n:]))}
        partials, sliced = self.builder(whole[:self.n], offset, size, derived, sliced_from=sources[:self.n])
        return partials, list(sliced) + [None] * len(self.keys)


def _tile_index(t, first, stop):
    """The ``t``-th key block a block folds: its span ``[first, stop)``, then the others in order."""
    span = stop - first
    rest = t - span
    return tf.where(t < span, first + t, tf.where(rest < first, rest, rest + span))


def _schedule_tensors(tiles: TilePlan):
    return (tf.constant(tiles.starts, tf.int32), tf.constant(tiles.owned, tf.int32),
            tf.constant([a for a, _ in tiles.spans], tf.int32), tf.constant([b for _, b in tiles.spans], tf.int32))


def _forward(region, op_inputs, tiles: TilePlan, external, values, derived, combiner: Combiner, partial_specs):
    starts, _, firsts, stops = _schedule_tensors(tiles)
    qc, kc, nk = tiles.query_block, tiles.key_block, tiles.key_blocks
    block_specs = with_rows(partial_specs, qc, tiles.rows_axis)
    inputs = list(values) + list(derived.values())

    def block(i, *outputs):
        start = starts[i]
        cut = _Block(region, tiles, external, inputs, derived, start, op_inputs)

        def fold(index):
            def body(t, *carry):
                j = index(t)
                partials, _ = cut.build(cut.whole, cut.sources, j * kc, kc)
                return (t + 1, *combiner.step(list(carry), partials, j, j * kc))

            return body

        first, stop = firsts[i], stops[i]
        carry = combiner.init(block_specs, nk)
        carry = tf.while_loop(lambda t, *c: t < stop - first, fold(lambda t: first + t),
                              (tf.constant(0), *carry), maximum_iterations=nk)[1:]
        dead = tf.reduce_any(carry[0] <= tiles.dead_below)
        rest = tf.where(dead, nk - (stop - first), 0)
        carry = tf.while_loop(lambda t, *c: t < rest, fold(lambda t: _tile_index(t + stop - first, first, stop)),
                              (tf.constant(0), *carry), maximum_iterations=nk)[1:]
        rows = combiner.finish(list(carry), None, 0)
        return (i + 1, *[write_slice(o, r, tiles.rows_axis % o.shape.rank, start) for o, r in zip(outputs, rows)])

    m_spec, l_spec, o_spec = partial_specs                    # OnlineSoftmax's partials; it finishes [o / l, m, l]
    outputs0 = [tf.zeros(s.shape, s.dtype) for s in (o_spec, m_spec, l_spec)]
    return list(tf.while_loop(lambda i, *o: i < len(tiles.starts), block, (tf.constant(0), *outputs0),
                              maximum_iterations=len(tiles.starts))[1:])


def _backward(region, op_inputs, tiles: TilePlan, external, values, outputs, upstream, combiner, floating, key_axes,
              read_whole):
    n = len(external)
    d_out = upstream[0]
    if d_out is None:
        return [None] * n
    d_out = tf.convert_to_tensor(d_out)
    values = list(values)
    derived = _in_order(region, external, values, [d_out])
    keys = [ref for ref in derived if ref in region.whole_inputs]
    derived = {ref: derived[ref] for ref in keys}
    inputs = values + [derived[ref] for ref in keys]
    axes = tiles.axes
    floating = list(floating) + [derived[ref].dtype.is_floating for ref in keys]
    key_axes = [a if f else None for a, f in zip(list(key_axes) + [None] * len(keys), floating)]
    read_whole = [w and f for w, f in zip(list(read_whole) + [True] * len(keys), floating)]
    q_whole = list(axes.whole) + [axes.derived.get(ref) for ref in keys]
    q_sliced = list(axes.sliced) + [None] * len(keys)
    # A buffer of the input's size where its gradient comes in pieces; a sum where it comes whole.
    buffered = [f and (a is not None or (w and q is not None))
                for f, a, w, q in zip(floating, key_axes, read_whole, q_whole)]
    summed = [w and q is None and not b for w, q, b in zip(read_whole, q_whole, buffered)]
    anchor = _opaque_true([d_out])
    carry0 = [tf.fill(v.shape, _zero_after(anchor, v.dtype)) for v, b in zip(inputs, buffered) if b]
    # (a half type's sum in float32, as XLA sums the unsplit gradient's reduction)
    carry0 += [tf.fill(v.shape, _zero_after(anchor, accumulated(v.dtype))) for v, s in zip(inputs, summed) if s]
    starts, owned, firsts, stops = _schedule_tensors(tiles)
    qc, kc, nk = tiles.query_block, tiles.key_block, tiles.key_blocks
    out, m, norm = outputs
    rows_axis = tiles.rows_axis % out.shape.rank

    def block(i, *carry):
        start = starts[i]
        cut = _Block(region, tiles, external, inputs, derived, start, op_inputs)
        mine = start + tf.range(qc) >= owned[i]            # rows no earlier block took
        up = mask_rows(dynamic_slice(d_out, rows_axis, start, qc), rows_axis, mine, 0)
        outs = [dynamic_slice(x, rows_axis, start, qc) for x in (out, m, norm)]
        first, stop = firsts[i], stops[i]
        dead = tf.reduce_any(outs[1] <= tiles.dead_below)
        count = (stop - first) + tf.where(dead, nk - (stop - first), 0)

        def tile(t, *acc):
            j = _tile_index(t, first, stop)
            _, sliced_grads, whole_grads = _slice_gradients(
                lambda inner, sources: cut.build(inner, sources, j * kc, kc), cut.whole,
                [a is not None for a in key_axes[:n]] + [False] * len(keys), read_whole,
                lambda partials: combiner.slice_upstream([up, None, None], outs, partials, j * kc, kc),
                sliced_values=cut.sources + [None] * len(keys))
            acc = list(acc)
            buffers, sums = iter(range(sum(buffered))), iter(range(sum(buffered), len(acc)))
            for k in range(len(inputs)):
                b = next(buffers) if buffered[k] else None
                s = next(sums) if summed[k] else None
                if b is not None and sliced_grads[k] is not None:
                    at = {key_axes[k]: j * kc}
                    if q_sliced[k] is not None:
                        at[q_sliced[k]] = start
                    acc[b] = _add_at(acc[b], sliced_grads[k], at)
                if whole_grads[k] is not None:
                    if s is not None:
                        acc[s] = _added(acc[s], whole_grads[k])
                    elif q_whole[k] is not None:
                        acc[b] = _add_at(acc[b], whole_grads[k], {q_whole[k]: start})
                    else:
                        acc[b] = acc[b] + whole_grads[k]
            return (t + 1, *acc)

        return (i + 1, *tf.while_loop(lambda t, *a: t < count, tile, (tf.constant(0), *carry),
                                      maximum_iterations=nk)[1:])

    result = tf.while_loop(lambda i, *c: i < len(tiles.starts), block, (tf.constant(0), *carry0),
                           maximum_iterations=len(tiles.starts))[1:]
    it = iter(result)
    grads = [next(it) if b else None for b in buffered]
    for k, s in enumerate(summed):
        if s:
            grads[k] = tf.cast(next(it), inputs[k].dtype)
    return _carried_through_prologue(region, external, values, keys, grads[n:], floating[:n], grads[:n])


def build_tiled(region: Region, tiles: TilePlan, backward_tiles: TilePlan, combiner: Combiner,
                partial_specs: Sequence[tf.TensorSpec], differentiable: bool = True) -> list[tf.Tensor]:
    """The tiled loops for ``region`` (its graph the default one), the gradient's in ``backward_tiles``
    (smaller where the gradient's slices must be); returns ``[o / l, m, l]``."""
    external = external_inputs(region)
    op_inputs = region_inputs(region)        # as they are now: a later split may rewire them
    floating, key_axes, read_whole = _roles(region, external)

    def forward(values):
        derived = _in_order(region, external, values, [v for t, v in zip(external, values)
                                                       if t.ref() in region.sliced_inputs] or values)
        derived = {ref: t for ref, t in derived.items() if ref in region.whole_inputs}
        return _forward(region, op_inputs, tiles, external, values, derived, combiner, partial_specs)

    if not differentiable or not any(floating):
        return forward(list(external))

    @tf.custom_gradient
    def tiled(*values):
        outputs = forward(list(values))

        def grad(*upstream):
            return _backward(region, op_inputs, backward_tiles, external, values, outputs, upstream, combiner, floating,
                             key_axes, read_whole)

        return outputs, replay.once(grad, region)

    return list(tiled(*external))


def check(region: Region, tiles: TilePlan, combiner: Combiner, partial_specs) -> str | None:
    """Build one tile and its gradient in a scratch graph: ``None`` if its partials have the block's
    shapes, else why not (an op that does not pass the query rows through as planned)."""
    external = external_inputs(region)
    derived_refs = [o.ref() for op in region.prologue for o in op.outputs if o.ref() in region.whole_inputs]
    try:
        with tf.Graph().as_default():
            values = [tf.compat.v1.placeholder(t.dtype, t.shape) for t in external]
            derived = {ref: tf.compat.v1.placeholder(ref.deref().dtype, ref.deref().shape) for ref in derived_refs}
            cut = _Block(region, tiles, external, values + list(derived.values()), derived, tiles.starts[-1],
                         region_inputs(region))
            partials, _ = cut.build(cut.whole, cut.sources, 0, tiles.key_block)
            want = with_rows(partial_specs, tiles.query_block, tiles.rows_axis)
            if [p.shape.as_list() for p in partials] != [s.shape.as_list() for s in want]:
                return (f"a tile's partials are {[p.shape.as_list() for p in partials]}, not "
                        f"{[s.shape.as_list() for s in want]}")
            floating = [p for p in partials if p.dtype.is_floating]
            sources = [v for v in cut.whole if v.dtype.is_floating]
            if floating and sources:
                tf.gradients(floating, sources)
    except (ValueError, TypeError, KeyError, NotImplementedError, tf.errors.OpError) as e:
        return f"building a tile failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None

