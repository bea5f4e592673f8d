"""Mechanism: a planned region built into the graph as a loop, and its old ops' readers rewired.

    outputs = loop over slices of the region (:mod:`.loop`), folded by the roots' combiners (:mod:`.combiners`)

Given the roots' options (:class:`~.analysis.RootOption`), a grown region and a chunk plan, this
module makes each root's partial result of one slice and the combiner that folds them
(:func:`combined`), builds the loop with its gradient (:func:`build`; an attention's in 2-D tiles where
masked tiles can be skipped, :func:`tiles`), installs it in place of the
roots (:func:`install`: readers rewired, recorded gradients retargeted, static shape readers folded;
:func:`rebuild_gradients`), and builds the loop alone as a function for XLA to measure (:func:`loop_figure`; with its
gradient loop, :func:`gradient_figure`).
Every fallible step runs before the first rewiring.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import blocked_top_k, gradients, graph_edit, shapes, variable_updates
from grappler_ext.graph_query import ancestors, live_ops, topological_order
from grappler_ext.measure import Measurer
from grappler_ext.op_types import LOOP_TYPES, static_shape_reader
from grappler_ext.splitter import analysis, combiners, rules, slicing, tiled_loop, tiling, whole_at_run
from grappler_ext.splitter.analysis import const_axes, shape_reader
from grappler_ext.splitter.chunk_plan import ChunkPlan
from grappler_ext.splitter.loop import Region, build_split, external_inputs, forward_program, fused_program
from grappler_ext.splitter.loop import fusable as loop_fusable
from grappler_ext.splitter.tiling import TilePlan

__all__ = ["combined", "fusable", "tiles", "untiled", "computed_share", "build", "install", "rebuild_gradients",
           "variables_as_values", "written_variables", "loop_figure", "gradient_figure", "call_seed", "new_loops"]


def call_seed() -> tf.Tensor:
    """The [2] int64 seed a loop's random draws key on, drawn anew at every call of the function."""
    return tf.random.uniform([2], maxval=2**62, dtype=tf.int64)


def _spec_with(t: tf.Tensor, axis, chunk: int | None) -> tf.TensorSpec:
    shape = t.shape.as_list()
    if axis is not None:
        shape[axis] = chunk                   # (None: a chunk resolved at run time)
    return tf.TensorSpec(shape, t.dtype)


def _spec_of(t: tf.Tensor, dtype: tf.DType | None = None, unit_axes=()):
    """The spec of a partial result shaped as ``t`` (size 1 along ``unit_axes``): static, or with
    sizes read at run time where ``t``'s are known only then (bound when the loop is built)."""
    dims = t.shape.as_list()
    for axis in unit_axes:
        dims[axis] = 1
    if None in dims:
        return combiners.RunSpec(t, dtype or t.dtype, unit_axes)
    return tf.TensorSpec(dims, dtype or t.dtype)


def _root_part(option, plan: ChunkPlan, region: Region):
    """``(partial builder, combiner, partial specs, differentiable)`` for one root."""
    root = option.root
    kind = option.kind
    root_inputs = list(region.inputs_of.get(root, root.inputs))    # as now: a later split may rewire the (dead) root
    if kind == "concat":
        def concat_partial(lookup, chunk, offset, valid=None):
            # Rows past a run-time length are cut off when joined (combiners._ConcatTo): no mask.
            ins = [lookup(t, whole=a is None) for t, a in zip(root_inputs, option.input_axes)]
            return option.propagation.build(root, ins, chunk, offset)
        size = None if region.scaled else plan.chunk           # (scaled at run time: .scaling)
        specs = [_spec_with(o, a, size) for o, a in zip(root.outputs, option.output_axes)]
        into = region.written_into.get(root)
        if into is not None:
            source = [t.ref() for t in external_inputs(region)].index(into.ref())
            return concat_partial, combiners.InPlace(option.output_axes, [source]), specs, True
        return concat_partial, combiners.Concat(option.output_axes, root.outputs), specs, True

    extremum = kind in ("max", "min") and root.outputs[0].dtype.is_floating
    if kind == "online_softmax":
        scores, values = option.requests[0][0], root_inputs[1]
        layout = analysis.softmax_einsum(root) if root.type == "Einsum" else None
        to_output, value_axes = (None, (-1,)) if layout is None else combiners.statistics_layout(layout.probs,
                                                                                                 layout.output)

        def softmax_partial(lookup, chunk, offset, valid=None):
            v, s = lookup(values), lookup(scores)
            if valid is not None:      # keys past a run-time length weigh nothing
                s = slicing.mask_rows(s, s.shape.rank - 1, valid, float("-inf"))
            return combiners.softmax_partials(s, lambda e: rules.clone_op(root, [e, v])[0], to_output)

        specs = [_spec_of(root.outputs[0], scores.dtype, value_axes)] * 2 + [_spec_of(root.outputs[0], scores.dtype)]
        return softmax_partial, combiners.OnlineSoftmax(value_axes), specs, True

    def partial(lookup, chunk, offset, valid=None):
        ins = [lookup(t, whole=a is None) for t, a in zip(root_inputs, option.input_axes)]
        if valid is not None:
            # Rows past a run-time length read as the reduction's identity (a matmul's: zeros).
            ins = [x if a is None else slicing.mask_rows(x, a, valid, _identity(kind, x.dtype))
                   for x, a in zip(ins, option.input_axes)]
        outs = blocked_top_k.rebuilt(root, ins) if kind == "top_k" else rules.clone_op(root, ins)
        if kind.startswith("arg"):
            return [outs[0], combiners.value_at(ins[0], outs[0], option.input_axes[0])]
        if extremum:
            axes = const_axes(root.inputs[1], root.inputs[0].shape.rank)
            keep = root.get_attr("keep_dims")
            return [combiners.nan_propagating(ins[0], outs[0], axes, keep),
                    combiners.tie_count(ins[0], axes, keep, kind),
                    combiners.first_at(ins[0], outs[0], axes, option.input_axes[0], kind)]
        return outs

    if extremum:
        combiner = combiners.Extremum(kind)
        specs = [_spec_of(root.outputs[0])] * 2 + [_spec_of(root.outputs[0], tf.int32)]
    elif kind.startswith("arg"):
        combiner = combiners.Arg(kind[3:], root.outputs[0].dtype)
        specs = [_spec_of(root.outputs[0]), _spec_of(root.outputs[0], root.inputs[0].dtype)]
    elif kind == "top_k":
        combiner = combiners.TopK(int(tensor_util.constant_value(root.inputs[1])))
        specs = [_spec_of(o) for o in root.outputs]
    else:
        combiner = (combiners.combiner_for_reduction(root.type, plan.length, plan.chunk, plan.tail)
                    if root.type in combiners.REDUCTION_COMBINERS else combiners.Sum())
        specs = [_spec_of(o) for o in root.outputs]
    if not combiner.differentiable and any(o.dtype.is_floating for o in root.outputs):
        raise NotImplementedError(f"a split `{root.type}` has no gradient rule yet")
    return partial, combiner, specs, combiner.differentiable


def _identity(kind: str, dtype: tf.DType):
    """The value a masked row takes in a reduction of ``kind``: one that changes no result."""
    if kind in ("sum", "mean"):
        return 0
    if kind == "prod":
        return 1
    if kind in ("all", "any"):
        return kind == "all"
    largest = kind in ("max", "argmax", "top_k")
    if dtype.is_floating:
        return float("-inf") if largest else float("inf")
    return dtype.min if largest else dtype.max


def combined(options, region: Region, plan: ChunkPlan):
    """``(combiner, partial specs, differentiable, outputs per root)`` of the roots together;
    sets ``region.root_partial``."""
    parts = [_root_part(o, plan, region) for o in options]
    partial_fns = [p[0] for p in parts]
    region.root_partial = lambda lookup, chunk, offset, valid=None: [
        x for fn in partial_fns for x in fn(lookup, chunk, offset, valid)]
    # Some combiners return more (a tie count, a normaliser): each part's outputs are the root's,
    # then the combiner's hidden ones.
    counts = [len(o.root.outputs) + c.hidden_outputs for (_, c, _, _), o in zip(parts, options)]
    if len(parts) == 1:
        _, combiner, specs, differentiable = parts[0]
    else:
        combiner = combiners.Group([(c, len(sp), n) for (_, c, sp, _), n in zip(parts, counts)])
        specs = [x for _, _, sp, _ in parts for x in sp]
        differentiable = all(p[3] for p in parts)
    return combiner, specs, differentiable, counts


def fusable(graph, options, region: Region, length: int, chunk: int) -> bool:
    """Whether the loop for ``region`` computes its gradients as it goes, in chunks of ``chunk``
    (one pass over the slices instead of two): its one floating output is a scalar combined by a sum
    or a mean (:func:`.loop.fusable`), and a gradient recorded inside the function differentiates
    what is computed from it (else those gradients would only cost time)."""
    combiner, specs, differentiable, _ = combined(options, region, ChunkPlan(length, chunk, 0))
    free = gradient_free(options)
    # The combiner first: the recorded gradients' ancestors are most of the graph.
    return (differentiable and loop_fusable(combiner, specs, _per_partial(free, combiner, specs)) is not None
            and gradients.differentiated(graph, [o.root for o, f in zip(options, free) if not f]))


def gradient_free(options) -> list[bool]:
    """For each root, whether none of its outputs carries a gradient to the function's inputs or
    variables (:func:`grappler_ext.gradients.carries_gradient`: a metric beside the loss).  The
    loop's own gradient for an input that carries it (the metric's hits as floats) may then leave
    the root's share out: it ends at ops without a gradient."""
    return [not any(gradients.carries_gradient(t) for t in o.root.outputs) for o in options]


def _per_partial(free: list[bool], combiner, specs) -> list[bool]:
    """A root's flag for each of its partial results, in the loop's order."""
    if isinstance(combiner, combiners.Group):
        return [f for f, (_, n, _) in zip(free, combiner.parts) for _ in range(n)]
    return [free[0]] * len(specs)


def tiles(options, region: Region, plan: ChunkPlan, backward_chunk: int,
          fused: bool = False) -> tuple[TilePlan, TilePlan] | None:
    """The 2-D tiles, forward's and gradient's, for an attention split along its keys (masked tiles
    skipped: :mod:`.tiling`), each no larger than its loop's slices, or ``None`` (:func:`untiled`
    says why)."""
    tiled = untiled(options, region, plan, backward_chunk, fused)
    return None if isinstance(tiled, str) else tiled


def untiled(options, region: Region, plan: ChunkPlan, backward_chunk: int,
            fused: bool = False) -> tuple[TilePlan, TilePlan] | str:
    """:func:`tiles`' plans, or why the loop is not tiled."""
    if fused or len(options) != 1 or options[0].kind != "online_softmax":
        return "not one attention split along its keys"
    if region.scaled:
        return "its slices have other dimensions known only at run time"
    queries = options[0].requests[0][0].shape[-2]
    combiner, specs, _, _ = combined(options, region, plan)
    plans = {}
    # A tile's gradient holds about twice the forward's tensors a score (the probabilities and their
    # gradient, recomputed), not the untiled gradient's slice of every query row: half the forward's tile.
    chunks = (plan.chunk, min(plan.chunk, max(backward_chunk, plan.chunk // 2)))
    for chunk in dict.fromkeys(chunks):            # planned and checked once where the two are equal
        tiled = tiling.plan(region, options[0], external_inputs(region), queries * chunk)
        why = tiled if isinstance(tiled, str) else tiled_loop.check(region, tiled, combiner, specs)
        if why is not None:
            return why
        plans[chunk] = tiled
    return plans[chunks[0]], plans[chunks[1]]


def computed_share(options, region: Region, planned, backward: frozenset = frozenset()) -> float:
    """The share of its work a loop computes, for the splitter's ranking (:func:`.policy.rank`): an
    attention in tiles the share of its tiles not skipped (about half under a causal mask); 2 for an
    attention split along its keys, untiled, whose softmax the gradients inside the function read
    (its gradient loop computes every score again, where a loop over the rows computing its gradients
    as it goes computes each once), or written as an ``Einsum`` (Keras' attention: a loop over its
    rows reaches on through the rest of the layer, one loop where a key split leaves several); 1
    otherwise."""
    tiled = tiles(options, region, planned.chunks, planned.backward_chunk) if planned.chunks.splits else None
    if tiled is not None:
        return 1 - tiled[0].skipped / tiled[0].total
    softmax = [o for o in options if o.kind == "online_softmax"]
    recomputed = any(c in backward for o in softmax for c in o.absorbed[0].outputs[0].consumers())
    return 2.0 if recomputed or any(o.root.type == "Einsum" for o in softmax) else 1.0


def build(options, region: Region, plan: ChunkPlan, backward_chunk: int, fused: bool = False,
          tiled: tuple[TilePlan, TilePlan] | None = None, dispatch=None, asks=None) -> list[tf.Tensor]:
    """The loop for ``region`` in ``plan``'s chunks (its gradient in ``backward_chunk``), built in
    the default graph: the roots' outputs, in order.  ``fused``: the gradients computed in the same
    loop, in ``plan``'s chunks (where :func:`fusable`), of the inputs ``asks`` says a gradient inside
    asks for (:func:`grappler_ext.gradients.wanted`); ``tiled``: an attention's loop in these tiles
    (:func:`tiles`); ``dispatch``: the loop may give way to the region as written at run time
    (:mod:`.whole_at_run`), and reads its inputs through gates."""
    combiner, specs, differentiable, counts = combined(options, region, plan)
    target = (loop_fusable(combiner, specs, _per_partial(gradient_free(options), combiner, specs))
              if fused and differentiable else None)
    if fused and target is None:
        raise ValueError("the loop cannot compute its gradients as it goes")
    if tiled is not None:
        outputs = tiled_loop.build_tiled(region, *tiled, combiner, specs, differentiable=differentiable)
    else:
        external = external_inputs(region)
        outputs = build_split(region, plan.chunk, combiner, specs, differentiable=differentiable,
                              backward_chunk=backward_chunk, fused=target,
                              values=whole_at_run.loop_values(dispatch, external),
                              asked=None if asks is None else [asks(t) for t in external])
    return _visible(options, counts, outputs)


def _visible(options, counts, outputs: list) -> list:
    """The roots' own outputs among the loop's ``outputs`` (each root's, then its combiner's hidden ones:
    ``counts`` per root, :func:`combined`)."""
    visible, i = [], 0
    for o, n in zip(options, counts):
        visible += outputs[i:i + len(o.root.outputs)]
        i += n
    return visible


def install(graph, scope: str, roots, outputs, graph_outputs: set, region_ops, replaced=None) -> None:
    """The loop's ``outputs`` in place of the ``roots``' (readers rewired, recorded gradients
    retargeted); the region's static shape readers folded.  The gradients inside the function are
    rebuilt through the loop afterwards (:func:`rebuild_gradients`).  ``replaced``: the outputs of
    the region's loop built before, in place of which these are installed (a loop built again)."""
    old_outputs = [t for r in roots for t in r.outputs] if replaced is None else list(replaced)
    for old, new in zip(old_outputs, outputs):
        if old.consumers() or old.ref() in graph_outputs:
            graph_edit.replace_uses(old, new)
        gradients.retarget(graph, old, new)
        shapes.same_as(new, old)
    with graph_edit.building(graph, scope):
        _fold_shape_readers(region_ops)


def rebuild_gradients(graph, scope: str, included, region: Region | None = None) -> int:
    """The gradients inside the function that read the region's ops (``included``) differentiated
    again through its loop; how many were rebuilt.  A region that computes variables' updates takes
    in the gradients it reads: those read by nothing else are not rebuilt (nothing would read them)."""
    inside = included if region is not None and region.written_into else frozenset()
    return gradients.rebuild(graph, scope, included, inside)


def written_variables(graph, region: Region) -> tuple[str, ...]:
    """The names of the variables the loop of ``region`` writes in place, for its plan."""
    return tuple(variable_updates.variable_name(graph, t.op.inputs[0]) for t in region.written_into.values())


def variables_as_values(graph, scope: str, min_bytes: int) -> int | None:
    """The updates of the variables of at least ``min_bytes`` made assignments of values
    (:mod:`grappler_ext.variable_updates`), so that a region can compute a weight's update slice by
    slice; the journal's mark before, or ``None`` where there were none."""
    journal = graph_edit.active_journal()
    if journal is None or not any(op.type in variable_updates.WRITES for op in graph.get_operations()):
        return None                     # (a program that writes no variable: no order to compute)
    live = live_ops(graph)
    order = {op: i for i, op in enumerate(topological_order(graph, live))}
    found = variable_updates.candidates(graph, order, min_bytes)
    if not found:
        return None
    mark = len(journal)
    updates = variable_updates.as_values(graph, scope, found)
    # (what the recorded gradients differentiate keeps its IdentityN: a custom gradient)
    protected = ancestors([t for r in gradients.records(graph) for t in r.targets if isinstance(t, tf.Tensor)])
    variable_updates.through_identities(graph, updates, protected)
    return mark


def _fold_shape_readers(ops) -> None:
    """Replace the ``Shape``-like readers of ``ops``' outputs (:func:`~.analysis.shape_reader`) by what
    they read: constants for static shapes, else the shapes computed from the run-time sizes."""
    state = shapes.symbolic()
    for op in ops:
        for o in op.outputs:
            for reader in list(o.consumers()):
                if not shape_reader(reader):
                    continue
                for out, value in zip(reader.outputs, _shape_values(reader, state[0] if state else None)):
                    if value is not None and out.consumers():
                        graph_edit.replace_uses(out, value)


def _shape_values(reader: tf.Operation, table) -> list:
    """The outputs of a ``Shape``-like op computed from its inputs' shapes (``None`` where it cannot)."""
    if static_shape_reader(reader):
        values = [tensor_util.constant_value(out) for out in reader.outputs]
        return [None if v is None else tf.constant(v, dtype=out.dtype) for v, out in zip(values, reader.outputs)]
    if table is None:
        return [None] * len(reader.outputs)
    dtype = reader.outputs[0].dtype
    if reader.type == "Rank":
        return [tf.constant(reader.inputs[0].shape.rank, dtype)]
    found = [table.run_shape(t) if not t.shape.is_fully_defined() else tf.constant(t.shape.as_list(), tf.int32)
             for t in reader.inputs]
    if any(f is None for f in found):
        return [None] * len(reader.outputs)
    if reader.type == "Size":
        return [tf.cast(tf.reduce_prod(found[0]), dtype)]
    return [tf.cast(f, out.dtype) for f, out in zip(found, reader.outputs)]


def loop_figure(measurer: Measurer, options, region: Region, chunk: int, fused: bool = False, asks=None,
                at_nominal: bool = False) -> int:
    """XLA's "Total bytes used" for the region's forward loop alone, in chunks of ``chunk``: the loop
    built as a function of the region's inputs and compiled by ``measurer`` (never run).  ``fused``:
    the loop that computes its gradients as it goes, with them (those ``asks`` says are asked for).
    ``at_nominal``: a figure for the nominal sizes themselves, never scaled to a run's."""
    # Dimensions known only at run time are compiled at the nominal sizes the plan is made at, read
    # as constants there (its chunk: ``chunk``).  A forward loop whose rows grow with them is measured
    # there too: the bytes a row costs at the nominal sizes, which its chunk is scaled from at the
    # run's (:mod:`.scaling`).  One computing its gradients as it goes is not: it holds a slice's
    # gradients too, beyond what its rows' growth counts.
    scaled = region.scaled
    if fused and scaled and not scaled.steady and not at_nominal:
        raise ValueError("its slices' rows grow with the run-time sizes")
    plan = ChunkPlan(region.length, chunk, 0)
    combiner, specs, _, _ = combined(options, region, plan)
    asked = None if asks is None else [asks(t) for t in external_inputs(region)]
    external, forward = (fused_program(region, plan.chunk, combiner, specs,
                                       _per_partial(gradient_free(options), combiner, specs), asked) if fused
                         else forward_program(region, plan.chunk, combiner, specs))

    def alone(*values):
        with shapes.sizes_as_constants():
            return forward(*values)

    return _measured_alone(measurer, region, alone, external)


def gradient_figure(measurer: Measurer, options, region: Region, chunk: int, asks=None) -> int:
    """XLA's "Total bytes used" for the region's loop and its gradient loop alone, both in chunks of
    ``chunk``: the loop built as a function of the region's inputs and of upstream gradients for its
    floating results, returning the gradients of the inputs ``asks`` says are asked for (all floating
    ones without it), compiled by ``measurer`` (never run).  A gradient step recomputes its slice and
    holds that slice's gradients beside it, more than a forward step at the same chunk: the program's
    figure grows with the chunk by what a row costs the gradient loop."""
    plan = ChunkPlan(region.length, chunk, 0)
    combiner, specs, differentiable, counts = combined(options, region, plan)
    external = external_inputs(region)
    floating = [t.dtype.is_floating for o in options for t in o.root.outputs]
    wanted = [t.dtype.is_floating and (asks is None or asks(t)) for t in external]
    if not differentiable or not any(floating) or not any(wanted):
        raise ValueError("the loop has no gradient to measure")
    results = [t for o in options for t in o.root.outputs if t.dtype.is_floating]
    n = len(external)

    def alone(*args):
        values, upstream = list(args[:n]), list(args[n:])
        with shapes.sizes_as_constants():
            outputs = _visible(options, counts, build_split(region, chunk, combiner, specs, backward_chunk=chunk,
                                                            values=values))
            grads = tf.gradients([o for o, f in zip(outputs, floating) if f],
                                 [v for v, w in zip(values, wanted) if w], grad_ys=upstream)
        return [g for g in grads if g is not None]

    return _measured_alone(measurer, region, alone, external + results)


def _measured_alone(measurer: Measurer, region: Region, alone, tensors) -> int:
    """XLA's figure for ``alone`` (built from the region's tensors, read at the nominal sizes) compiled
    for ``tensors``' shapes by ``measurer``, never run.  A scaled loop's room, from a plan built
    before, would cap the chunk measured: it is set aside meanwhile."""
    if any(not shapes.is_static(t) or t.dtype in (tf.resource, tf.variant) for t in tensors):
        raise ValueError("an input or result without a static shape or of a handle type")
    fn = tf.function(alone, jit_compile=True, autograph=False)
    scaled = region.scaled
    held = scaled.plan if scaled is not None else None
    try:
        if scaled is not None:
            scaled.plan = None
        with tf.init_scope():
            return measurer.function_bytes(fn, [shapes.concrete_spec(t) for t in tensors])
    finally:
        if scaled is not None:
            scaled.plan = held


def new_loops(graph, existing: set) -> list[tf.Operation]:
    """The loops in ``graph`` that are not among ``existing`` ops."""
    return [op for op in graph.get_operations() if op.type in LOOP_TYPES and op not in existing]
