"""The splitter's mechanism: build a region's loop over slices, with its gradient.

Given a :class:`Region` (which ops, along which axis each tensor is split, what enters sliced and
what enters whole), a chunk size and a :class:`~grappler_ext.splitter.combiners.Combiner`, this module
builds, in the region's graph:

    outputs = custom_gradient(forward, backward)(*external inputs)

* ``forward``: a ``tf.while_loop`` with a static trip count (``maximum_iterations``) over the full
  slices, each computing the region's ops on ``[s, s + c)`` of the sliced inputs and folding the
  root's partial result into the carry; then the remainder slice, if any, outside the loop; then
  the combiner's ``finish``;
* ``backward``: the same slices again in a second loop, each recomputed under a local
  ``GradientTape`` and differentiated with the upstream gradient the combiner routes to it;
  gradients of sliced inputs are written slice by slice and joined, those of inputs used whole
  are summed.  So no full-size intermediate exists in the backward either.  It is built once in a
  graph, the first time ``tf.gradients`` asks for it, and copied when it asks again (the splitter
  differentiates the function again after each loop: :mod:`.replay`).

Where the region's one floating output is a scalar combined by a sum or a mean and the gradients
inside the function differentiate it (the loss), ``forward`` can do both at once
(:func:`_fused_forward`): each step computes its slice and that slice's gradients for an upstream
of one, summed (or written, for inputs read sliced) in the loop's carry, and ``backward`` only
multiplies them by the upstream scalar.  A slice is then computed once, not twice.  Those gradients
are differentiated again, where a tape outside asks (a gradient penalty), through the loop built
anew in the backward program (:func:`_held`).

Why ``custom_gradient``: with the tape outside a ``jit_compile=True`` function, TensorFlow's own
gradient of a while loop stacks the loop's intermediates in TensorLists that cross the XLA/TF
boundary, which XLA rejects; a custom gradient whose backward recomputes avoids that (measured
on TF 2.21).

A *prologue* (``Region.prologue``): ops that compute tensors the region reads whole from much
smaller ones (an attention's keys and values, [L, H, K], projected from the layer's input, [L, D]).
``forward`` computes them once before its loop, once its sliced inputs exist (:func:`_in_order`)
and in the layout its einsums read (:func:`relaid_prologue`); ``backward`` computes them again
from its inputs instead of keeping the forward's (in a conditional, so that XLA can neither merge
the two computations nor run the second before the upstream gradient exists: :func:`_in_order`),
and differentiates through them after its loop.
The program then holds the small inputs from the forward to the backward, not the large tensors
(a Transformer's training step: [L, 128] per attention instead of two [L, 8, 128]).  The
recomputation is exact: the same ops on the same values.

Small constant inputs (axes, shapes, scalars) are re-created inside the loop body instead of
captured, so shape inference in the body sees their values and the body keeps static shapes.

A region whose split axis is known only at run time (``Region.dynamic``: a ``None`` in the
function's ``input_signature``, a batch from ``tf.data``) is planned at a nominal length
(:mod:`grappler_ext.shapes`) and built on the length ``n`` read from its sliced inputs' shapes: the
loop runs ``ceil(n / c)`` slices of ``c`` rows, each cut with its indices past the end clamped
(:func:`~.slicing.clamped_slice`), so every slice has a static shape and there is no remainder
slice.  The rows past ``n`` of the last slice are masked out: the roots' partials see them as the
reduction's identity (:mod:`.mechanism`), joined results are cut to ``n``, and the gradient they
receive is zero.  XLA compiles the function for each concrete ``n`` and resolves ``n``, the trip
count and the masks' bounds then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from grappler_ext import folding, shapes
from grappler_ext.splitter import replay, whole_at_run
from grappler_ext.splitter.combiners import Combiner, RunSpec, accumulated, write_slice
from grappler_ext.splitter.rules import clone_op
from grappler_ext.splitter.scaling import Scaling
from grappler_ext.splitter.slicing import (
    UNIT,
    Factor,
    axis_length,
    clamped_slice,
    dynamic_slice,
    factored_slice,
    join_slices,
    valid_rows,
)

__all__ = ["Region", "build_split", "forward_program", "fused_program", "external_inputs", "fusable", "as_built"]

_INLINE_CONSTANT_MAX_ELEMENTS = 1024  # constants this small are re-created in the body, not captured


@dataclasses.dataclass
class Region:
    """What the splitter computes slice by slice.

    Attributes:
      ops: the region's ops in topological order (the root excluded).
      input_axes: for each op, the axis each input is read sliced along, ``None`` for "whole".
      rebuild: for each op, ``fn(op, new_inputs, chunk, offset) -> new outputs`` (its split rule's
        :meth:`~grappler_ext.splitter.rules.Propagation.build`).
      sliced_inputs: tensors from outside the region read sliced: ``{tensor.ref(): axis}``.
      whole_inputs: tensors from outside the region read whole (``tensor.ref()``s); a tensor may be
        read both ways (``x @ x^T`` split by rows reads ``x`` sliced and whole).
      length: the split axis' length.
      root_partial: ``fn(lookup, chunk, offset) -> partials`` builds the root's partial result of one slice;
        ``lookup(tensor, whole=False)`` gives the slice's (or the whole) version of an original tensor.
      prologue: ops, in topological order, computing some of ``whole_inputs`` from other tensors
        (see the module docstring); the loop then reads those ops' inputs instead, and every
        reader of their outputs is in the region or the prologue.
      dynamic: the split axis' length is known only at run time; ``length`` is the nominal length
        it was planned at (see the module docstring).
      factors: for ops (and sliced inputs' refs) reached through a reshape, where the split axis lies
        in their axis (:class:`~.slicing.Factor`: a batch row of [4, 512, E] is 512 rows of the
        [2048, E] it was reshaped from; a sequence row, 4 rows 512 apart).  The whole axis where absent.
      written_into: concat roots whose joined result is written, slice by slice, into the buffer of
        one of the sliced inputs: ``{root op: input}`` (a variable's new value into its old one, see
        :func:`.analysis.written_into`); the loop reads that input's slices from the buffer it writes.
      scaled: for a region whose slices have other dimensions known only at run time (a padded
        batch's size beside its length), how its rows grow with them (:class:`~.scaling.Scaling`):
        the loop's chunks are planned at nominal sizes and scaled to the run's, never below
        ``least_chunk`` (a top-k's k).  Such a region is ``dynamic``.
      inputs_of: ops that read other tensors than their own inputs: ``{op: [tensor, ...]}`` (an
        attention computed by a loop of its own inside each slice reads that loop's inputs:
        :mod:`.nested_loop`).
    """

    ops: list[tf.Operation]
    input_axes: dict[tf.Operation, tuple]
    rebuild: dict[tf.Operation, Callable]
    sliced_inputs: dict
    whole_inputs: set
    length: int
    root_partial: Callable[..., list[tf.Tensor]]
    prologue: list[tf.Operation] = dataclasses.field(default_factory=list)
    dynamic: bool = False
    factors: dict = dataclasses.field(default_factory=dict)
    written_into: dict = dataclasses.field(default_factory=dict)
    scaled: Scaling | None = None
    least_chunk: int = 1
    inputs_of: dict = dataclasses.field(default_factory=dict)
    relaid: dict | None = dataclasses.field(default=None, repr=False, compare=False)   # relaid_prologue's, once


def as_built(region: Region, inputs_of: dict) -> Region:
    """``region`` with its ops (roots and prologue too) reading ``inputs_of[op]``: the inputs they read
    when its loop was built (installing the loop folded the shape readers among them, whose values the
    region's slices compute for themselves: :func:`.mechanism.install`)."""
    return dataclasses.replace(region, inputs_of=inputs_of)


def _inline_constant(t: tf.Tensor):
    if not t.shape.is_fully_defined() or t.shape.num_elements() > _INLINE_CONSTANT_MAX_ELEMENTS:
        return None
    return folding.static_value(t)


def _prologue_outputs(region: Region) -> set:
    return {o.ref() for op in region.prologue for o in op.outputs}


def _batch_first(op: tf.Operation, index: int) -> tuple[int, ...] | None:
    """The permutation that puts operand ``index`` of a two-operand ``Einsum`` in the order XLA's dot
    reads it without a copy (its batch axes first, in place, the other two after, in order); ``None``
    if that is its order already or the equation is not of that form."""
    equation = op.get_attr("equation").decode().replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    operands, out = equation.split("->")
    operands = operands.split(",")
    if len(operands) != 2:
        return None
    mine, other = operands[index], operands[1 - index]
    batch = [c for c in mine if c in other and c in out]
    rest = [c for c in mine if c not in batch]
    if len(rest) != 2 or [c for c in out if c in batch] != batch:
        return None
    perm = tuple(mine.index(c) for c in batch + rest)
    return None if perm == tuple(range(len(mine))) else perm


def _inverse(perm: tuple[int, ...]) -> list[int]:
    return [perm.index(k) for k in range(len(perm))]


def relaid_prologue(region: Region) -> dict:
    """``{prologue output ref: permutation}`` for the prologue's outputs read by the region only through
    einsums that all want the same batch-first order (an attention's keys and values, [B, S, N, H],
    read as [B, N, S, H]).  The prologue hands them over in that order and the loop's body turns them
    back, a transpose XLA folds into the dots: otherwise XLA copies each into that order for the loop,
    beside the prologue's own (twelve [8, 2048, 8, 128] copies in a batch-8 Transformer's last loop)."""
    if region.relaid is None:
        # Decided once, from the region's inputs as they are when its loop is built: the forward, the
        # gradient rebuilt later and the slice builder must agree on it.
        op_inputs, outputs = region_inputs(region), _prologue_outputs(region)
        wanted: dict = {}
        for op in region.ops:
            for i, t in enumerate(op_inputs[op]):
                if t.ref() in outputs:
                    wanted.setdefault(t.ref(), set()).add(_batch_first(op, i) if op.type == "Einsum" else None)
        region.relaid = {ref: perms.pop() for ref, perms in wanted.items() if len(perms) == 1 and None not in perms}
    return region.relaid


def external_inputs(region: Region) -> list[tf.Tensor]:
    """The tensors the region reads from outside, each once: the sliced inputs, then those read
    whole (the prologue's inputs instead of what it computes); small constants read whole are
    inlined."""
    derived = _prologue_outputs(region)
    whole = (region.whole_inputs - set(region.sliced_inputs) - derived) | {
        t.ref() for op in region.prologue for t in region.inputs_of.get(op, op.inputs) if t.ref() not in derived}
    out = []
    for ref in list(region.sliced_inputs) + sorted(whole - set(region.sliced_inputs), key=lambda r: r.deref().name):
        t = ref.deref()
        if ref not in region.sliced_inputs and _inline_constant(t) is not None:
            continue
        out.append(t)
    return out


def run_prologue(region: Region, external: Sequence[tf.Tensor], values: Sequence[tf.Tensor]) -> dict:
    """The prologue's ops rebuilt on ``values`` (standing for ``external``): ``{original.ref(): new}``
    for each of their outputs."""
    env = {t.ref(): v for t, v in zip(external, values)}
    derived: dict = {}
    for op in region.prologue:
        inputs = [_whole_value(t, {**env, **derived}, "the prologue's inputs")
                  for t in region.inputs_of.get(op, op.inputs)]
        for old, new in zip(op.outputs, clone_op(op, inputs)):
            derived[old.ref()] = new
    return derived


def _whole_value(t: tf.Tensor, env: dict, what: str) -> tf.Tensor:
    """``t``'s stand-in in ``env``, else its value as a small constant inlined; else a ``KeyError``."""
    if t.ref() in env:
        return env[t.ref()]
    value = _inline_constant(t)
    if value is None:
        raise KeyError(f"tensor {t.name} is not among {what}")
    return tf.constant(value, dtype=t.dtype)


def region_inputs(region: Region) -> dict:
    """The inputs of the region's ops as they are now: ``{op: [tensor, ...]}``."""
    return {op: list(region.inputs_of.get(op, op.inputs)) for op in region.ops}


def _slice_builder(region: Region, external: Sequence[tf.Tensor], op_inputs: dict | None = None):
    """``build(values, offset, chunk) -> (partials, sliced)``: one slice of the region.

    ``values`` stand for ``external`` (the originals, or identities of them under a gradient tape);
    ``sliced`` are the slices of the inputs read sliced, in ``external`` order (``None`` where an
    input is only read whole), cut from ``sliced_from`` if given (default ``values``): the backward
    cuts them from other identities, so that the gradient of an input read both ways (``x x^T``,
    K(Z, Z) split by columns) through ``values`` is its whole reads' part only.  ``op_inputs``: the
    region's ops' inputs as read earlier (:func:`region_inputs`), for a builder made later.
    """
    # The region's ops are read as they are now: a later split may rewire these (dead) ops' inputs
    # to its own outputs, and this builder runs again when the gradients are rebuilt.
    op_inputs = op_inputs or region_inputs(region)
    refs = [t.ref() for t in external]
    written = {root: (refs.index(t.ref()), region.sliced_inputs[t.ref()])
               for root, t in region.written_into.items() if root in op_inputs}

    relaid = relaid_prologue(region)

    def build(values, offset, chunk, derived=None, sliced_from=None, length=None, relayout=False):
        split_env: dict = {}
        whole_env = {t.ref(): v for t, v in zip(external, values)}
        # (``relayout``: the prologue's outputs came in the order relaid_prologue gives; turned back here)
        whole_env.update({ref: tf.transpose(v, _inverse(relaid[ref])) if relayout and ref in relaid else v
                          for ref, v in (derived or {}).items()})
        sliced: list = []
        cut = dynamic_slice if length is None else clamped_slice
        factors = run_factors(region)           # (their run-time sizes read once a slice, not once an op)
        for t, v in zip(external, values if sliced_from is None else sliced_from):
            axis = region.sliced_inputs.get(t.ref())
            factor = factors.get(t.ref(), UNIT)
            piece = None if axis is None else factored_slice(v, axis, offset, chunk, factor, cut)
            sliced.append(piece)
            if piece is not None:
                split_env[t.ref()] = piece

        def lookup(t: tf.Tensor, whole: bool = False) -> tf.Tensor:
            if whole:
                return _whole_value(t, whole_env, "the region's whole inputs")
            if t.ref() in split_env:
                return split_env[t.ref()]
            raise KeyError(f"tensor {t.name} is not among the region's sliced inputs")

        for op in region.ops:
            inputs = [lookup(t, whole=a is None) for t, a in zip(op_inputs[op], region.input_axes[op])]
            factor = factors.get(op, UNIT)
            # (a rebuild that needs its offset is only ever the whole axis: analysis.grow)
            for old, new in zip(op.outputs, region.rebuild[op](op, inputs, factor.rows(chunk), offset * factor.inner)):
                split_env[old.ref()] = new
            if op in written:
                # A result written in place that the region reads on (Adam's new moment, in the weight's
                # update): read back from the buffer as written, the very update combiners.InPlace makes
                # (XLA merges the two).  Read from the value, XLA would recompute it from the buffer's
                # old slice after the write, and copy the whole buffer to keep that slice.
                k, axis = written[op]
                buffer = (values if sliced_from is None else sliced_from)[k]
                split_env[op.outputs[0].ref()] = dynamic_slice(
                    write_slice(buffer, split_env[op.outputs[0].ref()], axis, offset), axis, offset, chunk)
        valid = None if length is None else valid_rows(offset, chunk, length)
        return region.root_partial(lookup, chunk, offset, valid), sliced

    return build


def run_length(region: Region, external: Sequence[tf.Tensor], values: Sequence[tf.Tensor]) -> tf.Tensor | None:
    """The split axis' length read from the sliced inputs' shapes (``values`` standing for
    ``external``) for a region whose length is known only at run time, else ``None``.  The longest,
    should one broadcast a single row (each slice reads its own rows clamped)."""
    if not region.dynamic:
        return None
    if region.scaled is not None:
        # Read from the function's inputs (the shapes of values computed in the program, a loop's
        # outputs, are not always compile-time constants to XLA where the function is called by
        # another); a static axis (a loop with run-time sizes beside it) as itself.
        found = region.scaled.run_length()
        return tf.constant(region.length, tf.int32) if found is None else found
    # (an input holding the split axis as a factor of its axis: that axis' length over the factor's)
    lengths = []
    for t, v in zip(external, values):
        if t.ref() in region.sliced_inputs:
            n, factor = axis_length(v, region.sliced_inputs[t.ref()]), run_factor(region, t.ref())
            lengths.append(n if factor.unit else n // factor.rows(1))
    return lengths[0] if len(lengths) == 1 else tf.reduce_max(tf.stack(lengths))


def run_factor(region: Region, key) -> Factor:
    """Where the split axis lies in the axis of the region's op or sliced input ``key``, with its
    sizes as the function runs (:meth:`~.slicing.Factor.at_run`)."""
    return region.factors.get(key, UNIT).at_run(region.scaled.table if region.scaled is not None else None)


def run_factors(region: Region) -> dict:
    """:func:`run_factor` of every op and sliced input the region holds at a factor."""
    return {key: run_factor(region, key) for key in region.factors}


def _scaled(region: Region, length, chunks: Sequence[int], specs):
    """For a region with :attr:`Region.scaled`: ``chunks`` scaled to the run's sizes and ``specs``
    bound to them (:class:`~.combiners.RunSpec`); else both as they are."""
    if region.scaled is None:
        return list(chunks), specs
    specs = [s.bound(region.scaled.dims(s.source, s.unit_axes)) if isinstance(s, RunSpec) else s for s in specs]
    chunk = region.scaled.chunk(chunks[0], length, region.least_chunk)
    # (the gradient's chunk as much smaller than the forward's as it was planned)
    scaled = [chunk] + [tf.maximum(tf.cast(tf.floor(tf.cast(chunk, tf.float64) * (c / chunks[0])), tf.int32),
                                   region.least_chunk) for c in chunks[1:]]
    whole = whole_at_run.fits()
    if whole is not None and length is not None:
        # The program as written fits at the run's sizes: one step (.whole_at_run), forward and gradient.
        most = tf.maximum(tf.cast(length, tf.int32), region.least_chunk)
        scaled = [tf.where(whole, most, c) for c in scaled]
    return scaled, specs


def _extent(region: Region, length, chunk: int):
    """``(steps, tail)`` of the loop over ``region`` in chunks of ``chunk``: static ints, or for a
    run-time ``length``, ``ceil(length / chunk)`` slices and no remainder."""
    if length is None:
        return region.length // chunk, region.length % chunk
    return (length + (chunk - 1)) // chunk, 0


def _with_carried(values, combiner: Combiner, carry) -> list:
    """``values`` with the inputs a step reads from the carry (:meth:`Combiner.carried_inputs`) replaced."""
    values = list(values)
    for k, buffer in combiner.carried_inputs(carry).items():
        values[k] = buffer
    return values


def _loop(build, values, combiner: Combiner, partial_specs, steps: int, chunk: int, *, after: Sequence, tail: int):
    carry0 = _made_after(combiner.initial(partial_specs, steps, values, tail), values, after)

    def body(i, *carry):
        offset = i * chunk
        partials, _ = build(_with_carried(values, combiner, carry), offset, chunk)
        return (i + 1, *combiner.step(list(carry), partials, i, offset))

    result = tf.while_loop(lambda i, *carry: i < steps, body, (tf.constant(0), *carry0),
                           maximum_iterations=steps)
    return result[0], list(result[1:])


def _made_after(carry: list, values: Sequence, after: Sequence) -> list:
    """``carry`` with its new buffers (a joined output's, a sum's zero: not one of the loop's inputs
    ``values``) made only once ``after`` (the prologue's outputs) exist (:func:`_zero_after` added).
    XLA makes a buffer of a constant (a zero) at the program's start otherwise, held through every
    prologue before the loop (two cross-attention layers' forward: 6.8 MB, 4.1 MB made after;
    ``test_fused.py``)."""
    if not after:
        return carry
    anchor = _opaque_true(list(after))
    inputs = {v.ref() for v in values if isinstance(v, tf.Tensor)}

    def late(c):
        if not isinstance(c, tf.Tensor) or c.ref() in inputs or not (c.dtype.is_floating or c.dtype.is_integer):
            return c
        return c + _zero_after(anchor, c.dtype)

    return [late(c) for c in carry]


def forward_program(region: Region, planned: int, combiner: Combiner, partial_specs: Sequence[tf.TensorSpec]):
    """``(external, forward)``: the tensors the region reads from outside, and ``forward(*values)``
    building the loop over slices of ``values`` (standing for ``external``) in the default graph.

    ``forward`` reads nothing else of the region's graph, so it can be traced on its own (the
    splitter compiles it to measure what a slice costs).
    """
    external = external_inputs(region)
    build = _slice_builder(region, external)

    def forward(*values, chunks_out: list | None = None, backward_chunk: int | None = None):
        # After the sliced inputs exist: XLA would otherwise compute a cross-attention's keys and
        # values (from the encoder's output) for every layer at once, long before their loops.
        derived = _in_order(region, external, values, [v for t, v in zip(external, values)
                                                       if t.ref() in region.sliced_inputs] or values, relayout=True)
        length = run_length(region, external, values)
        (chunk, back), specs = _scaled(region, length, (planned, backward_chunk or planned), partial_specs)
        if chunks_out is not None:
            chunks_out.append(back)                # the gradient loop's, scaled alike
        steps, tail = _extent(region, length, chunk)
        folding = combiner if length is None else combiner.at_length(length, chunk)

        def step(vals, offset, size):
            return build(vals, offset, size, derived, length=length, relayout=True)

        count, carry = _loop(step, values, folding, specs, steps, chunk, after=list(derived.values()), tail=tail)
        # The remainder's offset is read from the loop's counter (steps * chunk all the same): the
        # data dependence keeps XLA's scheduler from computing the remainder slice before the loop
        # and holding its tensors while the loop runs (measured: two slices' worth at the peak).
        tail_partials = step(_with_carried(values, folding, carry), count * chunk, tail)[0] if tail else None
        return folding.finish(carry, tail_partials, steps * chunk)

    return external, forward


def _roles(region: Region, external: Sequence[tf.Tensor]) -> tuple[list, list, list]:
    """For each external input: whether it is differentiable (floating or complex), the axis it is
    read sliced along (``None``: not sliced), and whether it is read whole."""
    return ([t.dtype.is_floating or t.dtype.is_complex for t in external],
            [region.sliced_inputs.get(t.ref()) for t in external],
            [t.ref() in region.whole_inputs for t in external])


def build_split(region: Region, chunk: int, combiner: Combiner, partial_specs: Sequence[tf.TensorSpec],
                differentiable: bool = True, backward_chunk: int | None = None,
                fused: int | None = None, values: Sequence[tf.Tensor] | None = None,
                asked: Sequence[bool] | None = None) -> list[tf.Tensor]:
    """Build the loop computing ``region`` in chunks of ``chunk``; returns the combined outputs.

    Must be called with the region's graph as default.  ``partial_specs`` are the shapes and dtypes
    of one full slice's partial results (what ``combiner.init`` needs).  The backward recomputes
    in chunks of ``backward_chunk`` (default ``chunk``): a slice's gradient holds several tensors
    of the slice's size at once, so it needs smaller chunks to fit the same limit.

    ``fused``: the index of the one output the gradients flow through, a scalar whose combiner
    passes each slice a fixed share of its upstream gradient (:func:`fusable`); the loop then
    computes each slice's gradients as it computes the slice (:func:`_fused_forward`), and the
    backward only scales them: one pass over the slices instead of two.

    ``values``: what the loop reads, standing for the region's external inputs (:func:`external_inputs`,
    in order); by default those tensors themselves.  A loop built inside another's slice reads that
    slice's tensors (:mod:`.nested_loop`).

    ``asked``: for each external input, whether a gradient inside the function asks for its gradient
    (:func:`grappler_ext.gradients.wanted`); a fused loop computes only those as it goes (a MoCo
    loss' negative queue, a frozen layer's weights: a [128, 65536] sum carried through the loop
    for nothing), the others by a loop of their own that is built only where a later tape reads them.
    """
    backward_chunk = backward_chunk or chunk
    external, forward = forward_program(region, chunk, combiner, partial_specs)
    build = _slice_builder(region, external)
    values = list(external if values is None else values)

    floating, axes, read_whole = _roles(region, external)
    if not differentiable or not any(floating):
        return forward(*values)

    if fused is not None:
        own = _asked(region, floating, asked)
        rest = [f and not o for f, o in zip(floating, own)]

        def fused_totals(values):
            return _fused_forward(region, build, external, axes, read_whole, values, combiner, partial_specs,
                                  chunk, own, fused)

        @tf.custom_gradient
        def fused_region(*values):
            outputs, totals = fused_totals(values)
            totals = _held(totals, values, lambda again: fused_totals(again)[1])
            home = tf.compat.v1.get_default_graph()

            def grad(*upstream):
                u = upstream[fused]
                if u is None:
                    return [None] * len(totals)
                u = tf.reshape(tf.convert_to_tensor(u), [])
                got = [None if g is None else g * tf.cast(u, g.dtype) for g in totals]
                if any(rest) and tf.compat.v1.get_default_graph() is not home:
                    # A tape outside the function (its backward is another graph) asking for what no
                    # gradient inside did: a loop of their own.
                    others = (_backward_with_prologue if region.prologue else _backward)(
                        region, build, external, axes, read_whole, values, outputs, upstream, combiner, chunk, rest)
                    got = [o if r else g for g, o, r in zip(got, others, rest)]
                return got

            return outputs, grad

        return list(fused_region(*values))

    @tf.custom_gradient
    def split_region(*values):
        scaled: list = []                        # the gradient's chunk, scaled to the run's sizes
        outputs = forward(*values, chunks_out=scaled, backward_chunk=backward_chunk)

        def grad(*upstream):
            if region.prologue:
                return _backward_with_prologue(region, build, external, axes, read_whole, values, outputs,
                                               upstream, combiner, scaled[0], floating)
            return _backward(region, build, external, axes, read_whole, values, outputs, upstream, combiner,
                             scaled[0], floating)

        return outputs, replay.once(grad, region)

    return list(split_region(*values))


def _held(totals: Sequence, values: Sequence[tf.Tensor], again: Callable[[list], Sequence]) -> list:
    """``totals`` (the gradients a fused loop computed as it went, for the gradients inside the function
    to read), differentiable again by a loop built anew: where something differentiates what they
    computed (a tape outside the function differentiating a gradient the function returns: a gradient
    penalty), their gradient is that of ``again(values)`` (the loop built again where it is asked
    for), not TensorFlow's gradient of the loop that computed them.  From a tape outside the function
    that one would stack the loop's intermediates in TensorLists crossing the XLA/TF boundary from the
    forward program to the backward one, which XLA rejects ("Support for TensorList crossing the
    XLA/TF boundary is not implemented").  The loop built again is differentiated by TensorFlow, its
    intermediates stacked within the backward program: that second order is not split."""
    present = [t for t in totals if t is not None]
    if not present:
        return list(totals)

    @tf.custom_gradient
    def held(*vals):
        def grad(*upstream):
            fresh = [t for t in again(list(vals)) if t is not None]
            pairs = [(f, u) for f, u in zip(fresh, upstream) if u is not None]
            if not pairs:
                return [None] * len(vals)
            return tf.gradients([f for f, _ in pairs], list(vals), grad_ys=[u for _, u in pairs])

        return [tf.identity(t) for t in present], grad

    out = iter(held(*values))
    return [None if t is None else next(out) for t in totals]


def _backward(region, build, external, axes, read_whole, values, outputs, upstream, combiner, chunk, floating,
              wait_for=()):
    """Gradients of the external inputs, recomputing each slice under a local tape.

    An input read sliced gets its slices' gradients joined along its axis; one read whole gets
    the sum over slices; one read both ways gets both, added.
    """
    upstream = [None if u is None else tf.convert_to_tensor(u) for u in upstream]
    n = len(external)
    length = run_length(region, external, values)
    steps, tail = _extent(region, length, chunk)
    if length is not None:
        combiner = combiner.at_length(length, chunk)

    def slice_grads(offset, size):
        _, sliced_grads, whole_grads = _slice_gradients(
            lambda inner, sliced_from: build(inner, offset, size, sliced_from=sliced_from, length=length),
            values, floating, [w and f for w, f in zip(read_whole, floating)],
            lambda partials: combiner.slice_upstream(upstream, outputs, partials, offset, size))
        return sliced_grads, whole_grads

    # Only floating inputs have gradients (a boolean mask read whole has none).
    axes = [a if f else None for a, f in zip(axes, floating)]
    read_whole = [w and f for w, f in zip(read_whole, floating)]
    # Carry: a TensorArray per input read sliced (joined after the loop), a sum per input read whole.
    carry0 = [_slices_array(t, a, chunk, steps, run_factor(region, t.ref())) for t, a in zip(external, axes)
              if a is not None]
    carry0 += _zero_sums(values, read_whole, [u for u in upstream if u is not None] + list(wait_for))

    def body(i, *carry):
        sliced_grads, whole_grads = slice_grads(i * chunk, chunk)
        it = iter(carry)
        new = [next(it).write(i, g) for g in sliced_grads if g is not None]
        new += [_added(next(it), g) for g in whole_grads if g is not None]
        return (i + 1, *new)

    count, *carried = tf.while_loop(lambda i, *c: i < steps, body, (tf.constant(0), *carry0),
                                    maximum_iterations=steps)
    # After the loop, as in the forward: the remainder's offset depends on the loop's counter.
    tail_sliced, tail_whole = slice_grads(count * chunk, tail) if tail else ([None] * n, [None] * n)
    arrays = sum(a is not None for a in axes)
    return _inputs_gradients(region, external, values, axes, read_whole, length, carried[:arrays],
                             carried[arrays:], tail_sliced, tail_whole)


def _zero_sums(values, read_whole, after) -> list[tf.Tensor]:
    """A zero of each of ``values`` read whole (where ``read_whole``), the start of its gradient's sum
    over slices, that XLA cannot create before ``after`` exist.  A zero of a static shape (or of one
    XLA knows when it compiles) is a constant to XLA: it allocates it at the program's start and
    holds it to the end (24 of [L, 8, 128] in a Transformer).  ``after``: the upstream gradients, and
    a prologue's recomputed outputs (a loss's upstream, a mean's 1 / count, exists long before its
    backward runs; they only then).  Waiting for every input read whole as well cost a small step
    0.3 MB more (XLA's schedule moved)."""
    whole = [v for v, w in zip(values, read_whole) if w]
    anchor = _opaque_true(list(after) or [v for v in values if v.dtype.is_floating])
    # (a half type's sum in float32, as XLA sums the unsplit gradient's reduction: combiners.accumulated)
    return [tf.fill(v.shape if v.shape.is_fully_defined() else tf.shape(v),
                    _zero_after(anchor, accumulated(v.dtype)))
            for v in whole]        # (v's shape, not its original's: a prologue's output is relaid)


def _added(total: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """A slice's gradient ``g`` added to the running ``total`` (of :func:`_zero_sums`'s type)."""
    return total + tf.cast(g, total.dtype)


def _inputs_gradients(region, external, values, axes, read_whole, length, arrays, sums, tail_sliced,
                      tail_whole) -> list:
    """Each input's gradient from a gradient loop's carry: an input read sliced gets its slices'
    gradients (``arrays``, then the remainder's) joined along its axis, cut to its own length where
    that is known only at run time; one read whole the sum over slices (``sums``, then the
    remainder's); one read both ways both, added.  ``None`` for an input no slice differentiates (not
    floating, or only a prologue reads it: see :func:`_backward_with_prologue`)."""
    arrays, sums = iter(arrays), iter(sums)
    out = []
    for k, (a, w) in enumerate(zip(axes, read_whole)):
        parts = []
        if a is not None:
            parts.append(join_slices(next(arrays), a, tail_sliced[k],
                                     None if length is None else axis_length(values[k], a),
                                     run_factor(region, external[k].ref()).outer))
        if w:
            total = next(sums)
            total = total if tail_whole[k] is None else _added(total, tail_whole[k])
            parts.append(tf.cast(total, values[k].dtype))
        out.append(None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1])
    return out


def _carried_through_prologue(region, external, values, keys, grads, floating, own, relayout=False) -> list:
    """``own`` (the inputs' gradients) with the gradients ``grads`` of the prologue's outputs ``keys``
    (as :func:`_in_order` handed them over: relaid where ``relayout``) carried back to the inputs
    ``values`` it reads, added.

    The prologue is computed again for it and differentiated inside conditionals of its own that
    wait for ``grads`` (as :func:`_in_order`'s), one output after the other: each conditional waits
    for the one before, so that XLA holds one output's gradient in the layouts its matrix products
    read (a transposed [B * L, N * H] copy and another of its transpose) at a time, not every
    output's at once (twelve [8, 2048, 8, 128] tensors in a Transformer's last loop).
    Differentiated through :func:`_in_order`'s conditional instead, TensorFlow would make a zero
    tensor of each output of it that has no gradient (XLA creates such a constant at the program's
    start and holds it to the end), and an intermediate its gradient reads (a ``tanh``'s output, a
    run-time shape) would have to leave the conditional, which XLA cannot do for tensors of run-time
    sizes."""
    carried = [(ref, tf.convert_to_tensor(g)) for ref, g in zip(keys, grads) if g is not None]
    sources = [k for k in range(len(values)) if floating[k]]
    if not carried or not sources:
        return own
    relaid = relaid_prologue(region) if relayout else {}
    after = [g for _, g in carried]
    for ref, g in carried:
        connected: list = []

        def branch(ref=ref, g=g, connected=connected):
            derived = run_prologue(region, external, values)
            out = tf.transpose(derived[ref], relaid[ref]) if ref in relaid else derived[ref]
            # Each input's own share, the others held fixed: an input computed from another outside
            # the region (a decoder layer's input from the embedding through earlier loops) must not
            # carry the other's gradient back through those loops too (counted twice, the loops'
            # backward built a second time, its tensors held with the first's).
            xs = [values[k] for k in sources]
            more = tf.gradients([out], xs, grad_ys=[g], stop_gradients=xs)
            connected[:] = [m is not None for m in more]
            return [tf.convert_to_tensor(m) for m in more if m is not None] or [tf.zeros([])]

        found = tf.cond(_opaque_true(after), branch, branch)
        after = list(found)
        found = iter(found)
        for k, c in zip(sources, connected):
            if c:
                m = next(found)
                shapes.shaped_as(m, values[k])
                own[k] = m if own[k] is None else own[k] + m
    return own


def fusable(combiner: Combiner, partial_specs: Sequence[tf.TensorSpec], free: Sequence[bool] = ()) -> int | None:
    """The output a fused loop (:func:`_fused_forward`) differentiates, or ``None`` where it cannot:
    exactly one floating output, a scalar, whose combiner hands each slice a share of the upstream
    gradient fixed before the backward runs (a sum's or a mean's: :attr:`Combiner.linear_upstream`).
    Then the gradient of every input is the upstream scalar times the sum over slices of each
    slice's gradient for an upstream of one, which the forward loop can compute.  Outputs ``free``
    says carry no gradient (:func:`grappler_ext.gradients.carries_gradient`: an accuracy beside the
    loss) are computed alongside; their upstream is never read."""
    if not combiner.linear_upstream:
        return None
    free = list(free) + [False] * (len(partial_specs) - len(free))
    floating = [i for i, s in enumerate(partial_specs)
                if (s.dtype.is_floating or s.dtype.is_complex) and not free[i]]
    if len(floating) != 1 or partial_specs[floating[0]].shape.num_elements() != 1:
        return None
    return floating[0]


def _asked(region: Region, floating: Sequence[bool], asked: Sequence[bool] | None) -> list[bool]:
    """The inputs a fused loop differentiates as it goes: the floating ones a gradient inside asks for
    (``asked``, see :func:`build_split`), every floating one where that is not known or the slices
    have run-time sizes."""
    return list(floating) if asked is None or region.scaled else [f and a for f, a in zip(floating, asked)]


def fused_program(region: Region, chunk: int, combiner: Combiner, partial_specs: Sequence[tf.TensorSpec],
                  free: Sequence[bool] = (), asked: Sequence[bool] | None = None):
    """``(external, fused)``: as :func:`forward_program`, for the loop that computes its gradients as
    it goes (:func:`fusable`, ``free`` as there: a Keras accuracy beside its loss; ``asked`` as in
    :func:`build_split`); ``fused(*values)`` returns the outputs, then the inputs' gradients (so that
    a compile of it alone keeps them)."""
    external = external_inputs(region)
    build = _slice_builder(region, external)
    floating, axes, read_whole = _roles(region, external)
    floating = _asked(region, floating, asked)
    target = fusable(combiner, partial_specs, free)
    if target is None:
        raise ValueError("the loop cannot compute its gradients as it goes")

    def fused(*values):
        outputs, totals = _fused_forward(region, build, external, axes, read_whole, values, combiner, partial_specs,
                                         chunk, floating, target)
        return list(outputs) + [g for g in totals if g is not None]

    return external, fused


def _fused_forward(region, build, external, axes, read_whole, values, combiner, partial_specs, chunk, floating,
                   target):
    """The region's outputs and, for each external input, the gradient of output ``target`` (a
    scalar) for an upstream gradient of one: each slice computed and differentiated in the same
    step of one loop (what a hand-written gradient accumulation does), instead of a forward loop
    and a backward loop that computes every slice again.

    Gradients of inputs read sliced are written slice by slice and joined; those of inputs read
    whole (and of the prologue's outputs, carried through the prologue after the loop) are summed.
    """
    values = list(values)
    n = len(external)
    derived = _in_order(region, external, values, [v for t, v in zip(external, values)
                                                   if t.ref() in region.sliced_inputs] or values, relayout=True)
    # The prologue's outputs as inputs read whole (as in _backward_with_prologue), their gradients
    # carried back through it after the loop: its large outputs are not held for the backward.
    keys = [ref for ref in derived if ref in region.whole_inputs]
    inputs = list(external) + [ref.deref() for ref in keys]
    values_in = values + [derived[ref] for ref in keys]
    floating_in = list(floating) + [derived[ref].dtype.is_floating for ref in keys]
    axes = [a if f else None for a, f in zip(list(axes) + [None] * len(keys), floating_in)]
    read_whole = [w and f for w, f in zip(list(read_whole) + [True] * len(keys), floating_in)]
    length = run_length(region, external, values)
    (chunk,), partial_specs = _scaled(region, length, (chunk,), partial_specs)   # (the run's, where scaled)
    steps, tail = _extent(region, length, chunk)
    folding = combiner if length is None else combiner.at_length(length, chunk)
    unit = [tf.ones(s.shape, s.dtype) if i == target else None for i, s in enumerate(partial_specs)]

    def slice_step(offset, size):
        return _slice_gradients(
            lambda inner, sliced_from: build(inner[:n], offset, size, {**derived, **dict(zip(keys, inner[n:]))},
                                             sliced_from=sliced_from[:n], length=length, relayout=True),
            values_in, [a is not None for a in axes], read_whole,
            lambda partials: folding.slice_upstream(unit, None, partials, offset, size))

    fold0 = folding.init(partial_specs, steps)
    arrays0 = [_slices_array(t, a, chunk, steps, run_factor(region, t.ref())) for t, a in zip(inputs, axes)
               if a is not None]
    sums0 = _zero_sums(values_in, read_whole, [derived[ref] for ref in keys])
    counts = (len(fold0), len(arrays0))

    def body(i, *carry):
        fold, arrays, sums = (list(carry[:counts[0]]), list(carry[counts[0]:sum(counts)]),
                              list(carry[sum(counts):]))
        offset = i * chunk
        partials, sliced_grads, whole_grads = slice_step(offset, chunk)
        fold = folding.step(fold, partials, i, offset)
        it = iter(arrays)
        arrays = [next(it).write(i, g) for g in sliced_grads if g is not None]
        sums = [_added(s, g) for s, g in zip(sums, [g for g in whole_grads if g is not None])]
        return (i + 1, *fold, *arrays, *sums)

    count, *carried = tf.while_loop(lambda i, *c: i < steps, body, (tf.constant(0), *fold0, *arrays0, *sums0),
                                    maximum_iterations=steps)
    # The remainder after the loop, its offset read from the loop's counter (as in forward_program).
    if tail:
        tail_partials, tail_sliced, tail_whole = slice_step(count * chunk, tail)
    else:
        tail_partials, tail_sliced, tail_whole = None, [None] * len(inputs), [None] * len(inputs)
    outputs = folding.finish(list(carried[:counts[0]]), tail_partials, steps * chunk)
    totals = _inputs_gradients(region, inputs, values_in, axes, read_whole, length,
                               carried[counts[0]:sum(counts)], carried[sum(counts):], tail_sliced, tail_whole)
    return outputs, _carried_through_prologue(region, external, values, keys, totals[n:], floating, totals[:n],
                                              relayout=True)


def _slice_gradients(run, values, sliced_ok, whole_ok, upstream_of, sliced_values=None):
    """One slice built and differentiated in the current graph (a loop's body).

    ``run(inner, sliced_from) -> (partials, sliced)`` builds the slice on identities of ``values``,
    its slices cut from identities of their own (``sliced_from``): tf.gradients with respect to
    ``inner`` would otherwise add the slices' part again to an input read both ways.  The slices are
    cut from ``sliced_values`` where given (not ``None``): a tiled loop's block reads its queries
    whole cut to the block's rows, and its keys sliced from all the rows.
    ``upstream_of(partials)`` gives each partial's upstream gradient (``None``: none).  Returns
    ``(partials, sliced_grads, whole_grads)``: the gradients of the slices where ``sliced_ok`` and
    of the inputs read whole where ``whole_ok``; zeros where unconnected, ``None`` where not asked
    for.  Symbolic gradients: a GradientTape would not record here, because TensorFlow stops every
    tape while it runs a gradient function."""
    inner = [tf.identity(v) for v in values]
    sources = values if sliced_values is None else [v if s is None else s for v, s in zip(values, sliced_values)]
    partials, sliced = run(inner, [tf.identity(v) for v in sources])
    ups = upstream_of(partials)
    targets = [p for p, u in zip(partials, ups) if u is not None]
    ups = [u for u in ups if u is not None]
    take = [s is not None and ok for s, ok in zip(sliced, sliced_ok)]
    sources = [s for s, t in zip(sliced, take) if t] + [v for v, ok in zip(inner, whole_ok) if ok]
    grads = tf.gradients(targets, sources, grad_ys=ups) if targets else [None] * len(sources)
    grads = [tf.zeros_like(src) if g is None else tf.convert_to_tensor(g) for g, src in zip(grads, sources)]
    it = iter(grads)
    return (partials, [next(it) if t else None for t in take], [next(it) if ok else None for ok in whole_ok])


def _slices_array(t: tf.Tensor, axis: int, chunk, steps, factor: Factor = UNIT) -> tf.TensorArray:
    """The ``TensorArray`` of ``steps`` slices of ``t``'s gradient along ``axis`` (where the split
    axis is ``factor`` of it); declared to the nominal sizes' table (its stack counts as ``t``:
    :func:`grappler_ext.shapes.declare_stacked`)."""
    array = tf.TensorArray(t.dtype, size=steps, infer_shape=True,
                           element_shape=_slice_shape(t, axis, chunk, factor))
    shapes.declare_stacked(array, t)
    return array


def _slice_shape(t: tf.Tensor, axis: int, chunk, factor: Factor = UNIT) -> tf.TensorShape:
    """The shape of ``t``'s slices of ``chunk`` along ``axis``, as far as it is known statically: in
    that axis, ``factor.outer`` runs of ``chunk * factor.inner`` rows (a [1, N * N] input reshaped to
    [1, N, N] and split along its rows: slices of [1, chunk * N]).  A gradient's TensorArray declares
    it: DTensor's SPMD expansion refuses a TensorList whose element shape is unranked."""
    dims = t.shape.as_list() if t.shape.rank is not None else None
    if dims is None:
        return tf.TensorShape(None)
    rows = [tf.get_static_value(v) if tf.is_tensor(v) else v for v in (chunk, factor.outer, factor.inner)]
    dims[axis] = None if any(v is None for v in rows) else int(rows[0] * rows[1] * rows[2])
    return tf.TensorShape(dims)


def _zero_after(anchor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A zero of ``dtype`` XLA computes only once ``anchor`` (:func:`_opaque_true`) exists, and never
    folds to a constant: ``0 * x`` is not 0 for every float ``x`` (the boolean anchor is never NaN)."""
    return tf.cast(anchor, dtype) * 0


def _opaque_true(tensors: Sequence) -> tf.Tensor:
    """A boolean scalar, true unless the first element of one of ``tensors`` is NaN, that XLA cannot
    fold to a constant: what reads it waits for every one of them.  (Waiting for the first alone let
    XLA compute a decoder's cross-attention keys and values, whose loop's first sliced input is the
    function's own token ids, for every layer at the program's start: three layers' [B, L, H, K]
    keys and values held at once.)  An ``IndexedSlices`` gradient is read through its values, never
    made dense."""
    dense = [t.values if isinstance(t, tf.IndexedSlices) else tf.convert_to_tensor(t) for t in tensors]
    dense = [t for t in dense if t.dtype.is_floating or t.dtype.is_integer or t.dtype == tf.bool] or dense[:1]
    anchors = [tf.reshape(t, [-1])[:1] for t in dense]
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.equal(a, a)) for a in anchors]))


def _in_order(region, external, values, after, relayout: bool = False) -> dict:
    """The prologue's outputs computed from ``values`` once ``after`` exist, in a form XLA keeps
    apart from any other computation of them: ``{original.ref(): tensor}``.

    XLA's CSE merges identical computations within a computation, so the backward's recomputation
    would become the forward's tensors, held until then (an ``XlaOptimizationBarrier`` does not stop
    it: XLA:CPU expands barriers before CSE); and its scheduler may compute a prologue whose inputs
    exist early long before its loop runs.  CSE does not reach into a conditional's branches, nor
    does a conditional run before its predicate: the prologue is a ``tf.cond`` whose two branches
    are the same ops, on a predicate read from ``after``.  Either branch gives the same values, so
    the predicate's value cannot change them.  With ``relayout``, outputs :func:`relaid_prologue` names
    come in its order (the slice builder then takes ``relayout=True``).
    """
    # Only what the loop reads (not a [B, L, N, H] projection before its bias): nothing is
    # differentiated through this conditional (_carried_through_prologue computes its own).
    keys = [o.ref() for op in region.prologue for o in op.outputs if o.ref() in region.whole_inputs]
    if not keys:
        return {}

    relaid = relaid_prologue(region) if relayout else {}

    def branch():
        derived = run_prologue(region, external, values)
        return [tf.transpose(derived[k], relaid[k]) if k in relaid else derived[k] for k in keys]

    outs = tf.cond(_opaque_true(after), branch, branch)
    for k, o in zip(keys, outs):
        shapes.shaped_as(o, k.deref(), relaid.get(k))
    return dict(zip(keys, outs))


def _backward_with_prologue(region, build, external, axes, read_whole, values, outputs, upstream, combiner,
                            chunk, floating):
    """:func:`_backward` for a region with a prologue: the prologue's outputs recomputed from the
    inputs (:func:`_in_order`), the loop's gradients taken with them as inputs read whole, then
    carried through the prologue to its inputs and added to the loop's own."""
    n = len(external)
    values = list(values)
    # Recomputed once the upstream gradients exist (the backward needs them then, not before).
    derived = _in_order(region, external, values, [u for u in upstream if u is not None] or values, relayout=True)
    keys = [ref for ref in derived if ref in region.whole_inputs]
    inner_external = list(external) + [ref.deref() for ref in keys]
    inner_values = values + [derived[ref] for ref in keys]

    def inner_build(vals, offset, size, sliced_from=None, length=None):
        return build(vals[:n], offset, size, dict(zip(keys, vals[n:])),
                     sliced_from=None if sliced_from is None else sliced_from[:n], length=length, relayout=True)

    extra_floating = [ref.deref().dtype.is_floating for ref in keys]
    grads = _backward(region, inner_build, inner_external, list(axes) + [None] * len(keys),
                      list(read_whole) + [True] * len(keys), inner_values, outputs, upstream, combiner,
                      chunk, list(floating) + extra_floating, wait_for=[derived[ref] for ref in keys])
    return _carried_through_prologue(region, external, values, keys, grads[n:], floating, grads[:n], relayout=True)
