"""Mechanism: an outer region whose attention is computed, in each slice, by a loop over blocks of its keys.

Given a grown region and a :class:`~.nesting.Nest` in it, :func:`nested` returns the region as the
outer loop then computes it: the attention's key region taken out of its ops and its prologue, and
the attention's root rebuilt, in each slice, as that region's own loop (:func:`.loop.build_split`
on the slice's tensors: the query rows' projections of the slice, the input and the weights whole)
in blocks of :func:`key_chunk` keys.  The inner loop's combiner is the online softmax's
(:class:`~.combiners.OnlineSoftmax`), its partials shaped as the slice's rows; its gradient is its
own (the inner loop's backward over the key blocks), which the outer loop's gradient differentiates
through like any op of a slice.  Exact: the same ops on the same values, combined as the unsplit
softmax.
"""

from __future__ import annotations

import dataclasses

from grappler_ext.splitter import mechanism
from grappler_ext.splitter.analysis import Grown
from grappler_ext.splitter.chunk_plan import ChunkPlan
from grappler_ext.splitter.combiners import with_rows
from grappler_ext.splitter.loop import build_split, external_inputs
from grappler_ext.splitter.nesting import Nest
from grappler_ext.splitter.outcome import NestedKeys

__all__ = ["nested", "key_chunk", "record"]

MIN_KEY_CHUNK = 64       # keys of a block at least (smaller ones cost more in loop steps than they save)


def key_chunk(keys: int) -> int:
    """The inner loop's block of keys (pure): the largest divisor of ``keys`` from :data:`MIN_KEY_CHUNK`
    to an eighth of them (no remainder block); else :data:`MIN_KEY_CHUNK` keys, or half of them if
    that is fewer."""
    want = max(MIN_KEY_CHUNK, keys // 8)
    divisors = [d for d in range(MIN_KEY_CHUNK, min(want, keys) + 1) if keys % d == 0]
    return divisors[-1] if divisors else max(1, min(want, keys // 2))


def _attention_in_blocks(nest: Nest, chunk_of_keys: int, rows_axis: int):
    """The outer slice's rebuild of the attention's root: its key region's loop, in blocks of
    ``chunk_of_keys``, on the slice's tensors (``chunk`` query rows along ``rows_axis`` of its output)."""
    region, option = nest.inner.region, nest.option
    plan = ChunkPlan(region.length, chunk_of_keys, 0)
    outputs = len(option.root.outputs)

    def rebuild(op, inputs, chunk, offset):
        combiner, specs, differentiable, _ = mechanism.combined([option], region, plan)
        got = build_split(region, chunk_of_keys, combiner, with_rows(specs, chunk, rows_axis),
                          differentiable=differentiable, values=inputs)
        return got[:outputs]

    return rebuild


def nested(grown: Grown, nest: Nest, chunk_of_keys: int) -> Grown:
    """``grown`` with ``nest``'s attention computed in each slice by a loop over ``chunk_of_keys`` keys at
    a time: its key region's ops and the prologue's ops it takes in left out, its root rebuilt as that
    loop on the tensors its key region reads (the slice's where the outer loop computes them, else
    whole).  ``grown`` itself is left as it was."""
    outer, inner = grown.region, nest.inner
    root = nest.option.root
    taken = inner.included - {root}
    ops = [op for op in outer.ops if op not in taken]
    prologue = [op for op in outer.prologue if op not in nest.moved]
    produced = {o.ref(): (op, k) for op in ops for k, o in enumerate(op.outputs)}
    reads = external_inputs(inner.region)

    def outer_axis(t):
        op, k = produced[t.ref()]
        prop = getattr(outer.rebuild[op], "__self__", None)
        return prop.output_axes[k] if prop is not None and prop.output_axes[k] is not None else 0

    theirs = nest.computed
    whole = {ref for ref in outer.whole_inputs if ref not in theirs} | {
        t.ref() for t in reads if t.ref() not in produced}
    sliced = {ref: axis for ref, axis in outer.sliced_inputs.items() if ref not in theirs}
    prop = outer.rebuild[root].__self__              # (nesting.attention_within: it has its rows' axis)
    input_axes = {**outer.input_axes, root: tuple(outer_axis(t) if t.ref() in produced else None for t in reads)}
    rebuild = {**outer.rebuild, root: _attention_in_blocks(nest, chunk_of_keys, prop.output_axes[0])}
    region = dataclasses.replace(outer, ops=ops, input_axes=input_axes, rebuild=rebuild, whole_inputs=whole,
                                 sliced_inputs=sliced, prologue=prologue, inputs_of={**outer.inputs_of, root: reads},
                                 relaid=None)
    return Grown(region, grown.included, grown.stops)


def record(nest: Nest) -> NestedKeys:
    """What a loop's record says of its attention computed by key blocks (:func:`nested`'s blocks)."""
    return NestedKeys(nest.option.root.name, key_chunk(nest.keys), nest.keys, len(nest.moved))
