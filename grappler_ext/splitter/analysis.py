"""Region analysis: which ops can end a loop (roots), how far a region grows from them, and why it stops.

    root r split along a  =>  region(r) = the ops carrying the split axis up from r, every reader inside

Nothing here changes the graph: each function reads ops and returns values (a root's ways of
splitting, a grown region or the reason it cannot be, a prologue, the model's count of the
program as rewritten).  Policy (:mod:`.policy`) ranks and sizes what this finds; mechanism
(:mod:`.mechanism`) builds it.

A region holds the ops that carry the split axis down to the root and whose every reader is in
the region; it stops at graph inputs, variable reads and constants (sliced there), at ops read
whole by the region or read by anything outside it (their full value exists anyway, so they are
sliced, not recomputed), at stateful ops (random draws only with ``Options.redraw_random``), and at
ops with no rule (:mod:`.rules` names them).
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import folding, graph_edit, memory_model, shapes
from grappler_ext.graph_query import ancestors, live_ops, returned
from grappler_ext.op_types import (
    ARG_REDUCTIONS,
    ARGUMENT_OPS,
    BRANCH_TYPES,
    LOOP_TYPES,
    MATMULS,
    NOT_CLONED,
    PASS_THROUGH,
    REDUCTIONS,
    SHAPE_READERS,
    WHOLE_MATRICES,
    nbytes,
    reserve_space,
    static_shape_reader,
)
from grappler_ext.splitter import lengths, rules, scaling, sharding
from grappler_ext.splitter.combiners import REDUCTION_COMBINERS
from grappler_ext.splitter.loop import Region, external_inputs
from grappler_ext.splitter.outcome import Code, RootSplit, Whole, Why
from grappler_ext.splitter.slicing import UNIT, Factor

__all__ = ["RootOption", "root_options", "Grown", "grow", "forward_roots", "together", "reaching_on", "prologue",
           "downstream", "forget_dead", "const_axes", "joined_bytes", "assigned", "updates_variable", "updates_from",
           "written_into", "materialised_bytes", "held_for_backward", "floor", "held_whole", "needed_now", "computed",
           "EinsumLayout", "softmax_einsum", "split_before"]

_ARG = {"ArgMax": "max", "ArgMin": "min"}


def const_axes(t: tf.Tensor, rank: int) -> list[int] | None:
    """The constant axes ``t`` holds, normalised to ``[0, rank)`` and sorted; ``None`` if not constant."""
    value = folding.static_value(t)
    if value is None:
        return None
    return sorted({int(a) % rank for a in np.asarray(value).reshape(-1)})


def computed(op: tf.Operation) -> tf.Operation:
    """The op that computes what ``op`` passes on (an output's ``Identity``), for the reports."""
    while op.type in PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op


@dataclasses.dataclass
class RootOption:
    """One way to split a root: the axis each root input is read along, and how partials combine."""

    root: tf.Operation
    kind: str                           # "concat", "sum", "mean", "max", ..., "argmax", "top_k"
    input_axes: tuple[int | None, ...]
    output_axes: tuple[int | None, ...] = ()
    propagation: rules.Propagation | None = None
    # online_softmax: the region is grown from these (tensor, axis) instead of the root's inputs,
    # and these ops (the Softmax) are computed inside the root's partial.
    requests: tuple = ()
    absorbed: tuple = ()

    @property
    def split(self) -> RootSplit:
        return RootSplit(self.root.name, computed(self.root).type, self.kind, tuple(self.input_axes))

    def describe(self) -> str:
        """One line: the op the region ends in, the combiner and the split axis."""
        return self.split.describe()


def root_options(root: tf.Operation, ignored: frozenset = frozenset(), through: bool = False) -> list[RootOption]:
    """Every way ``root`` can end a loop: an axis of its output (joined), a reduced axis (folded),
    the top-k axis, a matmul's or a convolution's contracting axis, and softmax(S) @ V over slices of the keys (whose
    softmax nothing else reads but the ops in ``ignored``: the gradients inside the function, rebuilt
    through the loop; with ``through``, a softmax read through identities too: :func:`_softmax_read`)."""
    options = []
    out0 = root.outputs[0] if root.outputs else None
    if out0 is not None and out0.shape.rank:
        for axis in range(out0.shape.rank):
            prop = rules.propagate(root, 0, axis)
            if prop:
                options.append(RootOption(root, "concat", prop.input_axes, prop.output_axes, prop))
    if not root.inputs or not shapes.is_static(root.inputs[0]):
        return options
    rank = root.inputs[0].shape.rank
    if root.type in REDUCTIONS or root.type in ARG_REDUCTIONS:
        axes = const_axes(root.inputs[1], rank)
        kind = _ARG.get(root.type)
        if root.type == "Mean" and not root.outputs[0].dtype.is_floating:
            axes = ()  # truncated slice means do not give the truncated mean of the whole
        for a in axes or ():
            options.append(RootOption(root, f"arg{kind}" if kind else REDUCTION_COMBINERS[root.type], (a, None)))
    elif root.type == "TopKV2":
        options.append(RootOption(root, "top_k", (rank - 1, None)))
    elif root.type in MATMULS and root.type != "BatchMatMul" and len(root.inputs) == 2:
        b_rank = root.inputs[1].shape.rank
        if root.type == "MatMul":
            ta, tb = root.get_attr("transpose_a"), root.get_attr("transpose_b")
        else:
            ta, tb = root.get_attr("adj_x"), root.get_attr("adj_y")
        a_axis = rank - 2 if ta else rank - 1
        b_axis = b_rank - 1 if tb else b_rank - 2
        options.append(RootOption(root, "sum", (a_axis, b_axis)))
        probs, absorbed = _softmax_read(root, ignored, through)
        # softmax(S) @ V over slices of the keys: S's last axis is the contracting axis.
        if probs is not None and not ta:
            options.append(RootOption(root, "online_softmax", (a_axis, b_axis),
                                      requests=((probs.op.inputs[0], rank - 1), (root.inputs[1], b_axis)),
                                      absorbed=(probs.op, *absorbed)))
    elif root.type in ("Conv2D", "Conv3D"):
        # conv(x, W) = sum over blocks of input channels of conv(x[.., blk], W[.., blk, :]): the filter's
        # input-channel axis (second last) is contracted with the input's channel axis
        axes = rules.image_axes(root, rank)
        if not isinstance(axes, rules.Refusal):
            options.append(RootOption(root, "sum", (axes[1], root.inputs[1].shape.rank - 2)))
    elif root.type == "Einsum" and len(root.inputs) == 2:
        probs, absorbed = _softmax_read(root, ignored, through)
        layout = softmax_einsum(root)
        if layout is not None and probs is not None:
            v_axis = layout.values.index(layout.probs[-1])
            options.append(RootOption(root, "online_softmax", (rank - 1, v_axis),
                                      requests=((probs.op.inputs[0], rank - 1), (root.inputs[1], v_axis)),
                                      absorbed=(probs.op, *absorbed)))
    return options


def _softmax_read(root: tf.Operation, ignored: frozenset, identities: bool) -> tuple[tf.Tensor | None, tuple]:
    """The ``Softmax`` whose probabilities ``root`` reads as its first operand, directly or (with
    ``identities``) through identities, tf_keras' attention dropout at inference, with those
    identities; ``(None, ())`` unless nothing else reads them (but the ops in ``ignored``) and the
    scores' shape is static.  (Identities are looked through only for an attention computed by key
    blocks within each slice of a loop over its rows, :mod:`.nesting`: a loop over the keys alone
    would change which region tf_keras' layers get.)"""
    t, through = root.inputs[0], []
    while identities and t.op.type == "Identity" and all(c is root or c in through or c in ignored
                                                         for c in t.consumers()):
        through.append(t.op)
        t = t.op.inputs[0]
    readers = {root, *through}
    if (t.op.type != "Softmax" or not t.dtype.is_floating or not shapes.is_static(t.op.inputs[0])
            or not all(c in readers or c in ignored for c in t.consumers())):
        return None, ()
    return t, tuple(through)


@dataclasses.dataclass(frozen=True)
class EinsumLayout:
    """The labels of an ``Einsum`` computing softmax(S) V: the probabilities', the values' and the
    output's (Keras' ``MultiHeadAttention``: ``BNTS,BSNH->BTNH``)."""

    probs: str
    values: str
    output: str


def softmax_einsum(root: tf.Operation) -> EinsumLayout | None:
    """``root``'s labels if it contracts its first operand's last axis (the keys) with its second
    operand and nothing else: every other label of the first operand in the output once, the keys in
    neither the output nor twice; ``None`` otherwise (an ellipsis, a diagonal, a reduced label)."""
    equation = root.get_attr("equation").decode() if isinstance(root.get_attr("equation"), bytes) \
        else root.get_attr("equation")
    inputs, _, output = equation.partition("->")
    operands = inputs.split(",")
    if "." in equation or len(operands) != 2:
        return None
    probs, values = operands
    key = probs[-1:]
    if any(len(set(labels)) != len(labels) for labels in (probs, values, output)):
        return None                                      # a diagonal or a repeated output label
    if not key or key not in values or key in output:
        return None
    if any(c not in output for c in probs[:-1]) or any(c not in output for c in values if c != key):
        return None                                      # a label summed over besides the keys
    if any(c not in probs and c not in values for c in output):
        return None
    return EinsumLayout(probs, values, output)


@dataclasses.dataclass
class Grown:
    """A region grown from its roots: the region, every op it takes in (roots included) and why it
    stopped where it did, largest stopping tensor first."""

    region: Region
    included: set
    stops: list[Why]


def grow(options: list[RootOption], graph_outputs: set, order_index: dict, ignored: frozenset = frozenset(),
         reseed: rules.Reseed | None = None, pinned=None, built: set = frozenset()) -> Grown | Why:
    """The region for ``options`` (one or more roots split together): ops carrying the split axis
    whose readers are all in the region; random draws in it drawn again by slice, keyed by
    ``reseed``, if given (``Options.redraw_random``).  Readers in ``ignored`` (the gradients inside
    the function, rebuilt after a split) do not hold an op back.  No input is sliced along an axis
    ``pinned`` holds (:func:`.sharding.pinned_axes`: a device mesh shards it).  A draw an earlier loop
    reads (of the ops the splits ``built``, see :func:`forget_dead`) is never drawn again."""
    roots = {o.root for o in options} | {op for o in options for op in o.absorbed}
    joined_roots = {o.root: o for o in options if o.kind == "concat" and o.propagation is not None}
    read_in_slice: set = set()     # concat roots the region also reads, slice by slice
    requests: dict = {}            # (op, output index) -> set of axes it is read sliced along
    whole: set = set()             # tensor refs read whole
    heap: list = []
    queued: set = set()
    included: set = set(roots)
    input_axes: dict = {}
    rebuild: dict = {}
    sliced_inputs: dict = {}
    factor_of: dict = {}           # (op, output index) -> where the roots' axis lies in its axis
    stops: list = []
    cloned: set = set()            # ops computed again in the region, kept for readers outside it
    length = _UNSET                # the split axis' length: an int, or None where it is known at run time

    def request(t: tf.Tensor, axis: int | None, factor: Factor = UNIT):
        if axis is None:
            whole.add(t.ref())
            return
        key = (t.op, t.value_index)
        requests.setdefault(key, set()).add(axis)
        factor_of.setdefault(key, set()).add(factor)
        if t.op not in queued:
            queued.add(t.op)
            heapq.heappush(heap, (-order_index.get(t.op, -1), id(t.op), t.op))

    for option in options:
        prop = option.propagation if option.kind == "concat" else None
        for i, (t, a) in enumerate(option.requests or zip(option.root.inputs, option.input_axes)):
            request(t, a, prop.factor(i) if prop is not None else UNIT)
    factors: dict = {}
    while heap:
        _, _, op = heapq.heappop(heap)
        wanted = {k: axes for (o, k), axes in requests.items() if o is op}
        found = set().union(*(factor_of[(op, k)] for k in wanted))
        if len(found) > 1:
            # The split axis at two places in one axis (batch rows and sequence rows of [B * L, E]).
            return Why(Code.REGION_CONFLICT, f"`{op.name}` is needed with the split axis at "
                                             f"{' and at '.join(sorted(map(str, found)))} of its axis")
        factor = found.pop()
        for k, axes in wanted.items():
            if len(axes) > 1:
                return Why(Code.REGION_CONFLICT, f"`{op.name}` output {k} is needed along axes {sorted(axes)}")
            axis = next(iter(axes))
            dim = op.outputs[k].shape[axis]
            if not factor.unit:
                # (sizes known only at run time as exact products of them: shapes.exact_dims)
                dim = shapes.exact_dims(op.outputs[k])[axis]
                if dim is None:
                    return Why(Code.DYNAMIC_AXIS, f"`{op.name}` has a run-time length along the split axis, "
                                                  "reached through a reshape's factor, that is no product of the "
                                                  "function's input sizes")
                if dim % factor.rows(1):
                    return Why(Code.REGION_CONFLICT, f"`{op.name}` has length {op.outputs[k].shape[axis]} along the "
                                                     f"split axis, not a multiple of the factor {factor}'s")
                dim //= factor.rows(1)
                dim = None if shapes.is_symbolic(dim) else dim
            if length is _UNSET:
                length = dim
            elif dim != length:
                return Why(Code.REGION_CONFLICT, f"`{op.name}` has length {_size(dim)} along the split axis, "
                                                 f"not {_size(length)}")
        joined = joined_roots.get(op)
        if joined is not None:
            # A concat root read along its own axis by the region (an optimizer slot's new value, which
            # the weight's update reads): computed in the slice like the region's other ops.
            if any(joined.output_axes[k] != next(iter(axes)) for k, axes in wanted.items()) or not factor.unit:
                return Why(Code.REGION_CONFLICT, f"the roots read each other's results (`{op.name}`)")
            read_in_slice.add(op)
            input_axes[op], rebuild[op] = joined.input_axes, joined.propagation.build
            continue
        stop = _outside(op, wanted, whole, (included - cloned) | ignored, graph_outputs, order_index, cloned, built)
        prop = None
        if stop is None:
            k0, axes0 = next(iter(wanted.items()))
            prop = rules.propagate(op, k0, next(iter(axes0)), reseed, factor)
            if not prop:
                stop = Why(Code.RANDOM_DRAW if prop.draw else Code.REFUSED_OP, prop.reason)
            elif any(prop.output_axes[k] != next(iter(axes)) for k, axes in wanted.items()):
                stop = Why(Code.REFUSED_OP, f"`{op.type}` splits its outputs along other axes")
            elif ignored and _sparse_lookup(op, prop):
                stop = Why(Code.SPARSE_LOOKUP, f"`{op.name}` looks up rows of a variable, whose gradient is "
                                               "sparse (IndexedSlices): in a loop it would be summed dense")
            elif not factor.unit and prop.rebuild_at is not None:
                # Its slice depends on where it starts (a band, a draw keyed by its offset): only
                # along the roots' own rows.
                stop = Why(Code.REFUSED_OP, f"`{op.type}` ({op.name}) is read through a reshape's factor and "
                                            "depends on where its slice starts")
        if stop is not None:
            for k, axes in wanted.items():
                sliced_inputs[op.outputs[k].ref()] = next(iter(axes))
                if not factor.unit:
                    factors[op.outputs[k].ref()] = factor
            stops.append((max(nbytes(op.outputs[k]) for k in wanted), stop))
            continue
        included.add(op)
        input_axes[op] = prop.input_axes
        rebuild[op] = prop.build
        if not factor.unit:
            factors[op] = factor
        for i, (t, a) in enumerate(zip(op.inputs, prop.input_axes)):
            request(t, a, prop.factor(i, factor))
    if length is _UNSET:
        return Why(Code.NO_ROOT, "no input of the root carries the split axis")
    dynamic = length is None
    why = sharding.why_pinned(pinned, sliced_inputs) if pinned else None
    why = why or _dynamic_dims(options, sliced_inputs, whole, dynamic, factors)
    if why is not None:
        return why
    if dynamic:              # its nominal length (a padded batch's at its own nominal size)
        first, axis = _first_whole_axis(sliced_inputs, factors)
        length = shapes.dims(first.deref())[axis] if first is not None else shapes.nominal_size()
    scaled = _scaling(options, included - roots, sliced_inputs, whole, factors, dynamic)
    if isinstance(scaled, Why):
        return scaled
    if len(options) > 1:
        # Roots split together must not read each other's results (logsumexp's Sum reads the
        # whole row max): the loop would need what it computes.
        upstream = ancestors([t for op in included for t in op.inputs])
        needed = [o.root for o in options if o.root in upstream and o.root not in read_in_slice]
        if needed:
            return Why(Code.REGION_CONFLICT, f"the roots read each other's results (`{needed[0].name}`)")
    ops = sorted((included - roots) | read_in_slice, key=lambda o: order_index[o])
    region = Region(ops=ops, input_axes=input_axes, rebuild=rebuild, sliced_inputs=sliced_inputs,
                    whole_inputs=whole, length=length, root_partial=None, dynamic=dynamic or scaled is not None,
                    factors=factors, scaled=scaled, least_chunk=top_k(options))
    stops.sort(key=lambda s: -s[0])
    return Grown(region, included, [why for _, why in stops])


_UNSET = object()


def _size(dim) -> str:
    return "unknown until run time" if dim is None else str(dim)


def _scaling(options, ops, sliced_inputs: dict, whole: set, factors: dict, dynamic: bool):
    """:attr:`Region.scaled` of a region of ``ops``: ``None`` where no tensor a slice computes has a
    dimension besides the split axis known only at run time (and outside planning at nominal
    sizes); else how its rows grow with the run's sizes (:mod:`.scaling`), or why it cannot say."""
    if shapes.nominal_size() is None:
        return None
    tensors = [t for t in [o for op in ops for o in op.outputs] + [ref.deref() for ref in sliced_inputs]
               if t.dtype not in (tf.resource, tf.variant) and not reserve_space(t) and t.shape.rank is not None]
    if not any(len(shapes.dynamic_axes(t)) > int(dynamic) for t in tensors) and not any(
            f.symbolic for f in factors.values()):
        return None
    length = None
    if dynamic:                # the split axis' length, from any input it slices (through factors too)
        found = [_length_of(ref.deref(), a, factors.get(ref, UNIT)) for ref, a in sliced_inputs.items()]
        length = next((m for kind, m, *_ in found if kind == "product"), None)
        if length is None:
            return Why(Code.DYNAMIC_AXIS, "its slices have other dimensions known only at run time, and their "
                                          "sizes could not be read as products of the function's input sizes")
    for option in options:
        for t in option.root.outputs:
            if not t.shape.is_fully_defined() and shapes.monomials(t) is None and not reserve_space(t) and \
                    t.dtype not in (tf.resource, tf.variant):
                return Why(Code.DYNAMIC_AXIS, f"`{t.name}` has dimensions known only at run time that are not "
                                              "products of the function's input sizes")
    held = [ref.deref() for ref in list(sliced_inputs) + list(whole)] + [t for o in options for t in o.root.outputs]
    return scaling.of([t for t in tensors if shapes.dynamic_axes(t)], length, dynamic,
                      [t for t in held if t.dtype not in (tf.resource, tf.variant) and t.shape.rank is not None])


def _first_whole_axis(sliced_inputs: dict, factors: dict):
    """``(ref, axis)`` of the first input the region slices along an axis of its own (not a factor of
    one), or ``(None, None)``."""
    return next(((ref, a) for ref, a in sliced_inputs.items() if ref not in factors), (None, None))


def _dynamic_dims(options, sliced_inputs: dict, whole: set, dynamic: bool, factors: dict) -> Why | None:
    """Why a region with dimensions known only at run time cannot be split, or ``None``.

    Planned at a nominal size (:mod:`grappler_ext.shapes`), every dimension may be one: a loop
    along the split axis takes its length from the sliced inputs' shapes when it runs, and its
    chunk is scaled to the run's other sizes (:mod:`.scaling`).  Outside such planning only the
    split axis may be one.  The sliced inputs' lengths must be one length -- one product of the
    function's run-time sizes, the same tensor, or tensors carrying the axis from the function's
    inputs (a batch of features and its labels), or from one tensor, through ops that keep it.
    """
    scaled = shapes.nominal_size() is not None

    def stray(t: tf.Tensor, axes: set) -> bool:         # a dimension it cannot plan
        return t.dtype not in (tf.resource, tf.variant) and not reserve_space(t) and (
            t.shape.rank is None or (not scaled and bool(set(shapes.dynamic_axes(t)) - axes)))

    for option in options:
        outputs = option.output_axes or (None,) * len(option.root.outputs)
        for t, a in list(zip(option.root.inputs, option.input_axes)) + list(zip(option.root.outputs, outputs)):
            if stray(t, {a}):
                return Why(Code.DYNAMIC_AXIS, f"`{t.name}` has dynamic shape {t.shape}: only the split axis may be "
                                              "dynamic")
    if not dynamic and not any(shapes.dynamic_axes(r.deref()) for r in list(sliced_inputs) + list(whole)):
        return None
    if dynamic and not scaled:
        return Why(Code.DYNAMIC_AXIS, "the split axis is known only at run time, and no nominal size was given "
                                      "to plan it")
    for ref, axis in sliced_inputs.items():
        if stray(ref.deref(), {axis}):
            t = ref.deref()
            return Why(Code.DYNAMIC_AXIS, f"`{t.name}` has dynamic shape {t.shape}, split along {axis}: only the "
                                          "split axis may be dynamic")
    for ref in whole:
        if stray(ref.deref(), set()):
            t = ref.deref()
            return Why(Code.DYNAMIC_AXIS, f"`{t.name}` of dynamic shape {t.shape} is read whole by every slice")
    sources = {_length_of(ref.deref(), axis, factors.get(ref, UNIT)) for ref, axis in sliced_inputs.items()}
    if dynamic and len(sources) > 1:
        shown = ", ".join(sorted(f"`{name}` axis {a}" for name, a in sources)[:3])
        return Why(Code.DYNAMIC_AXIS, f"the sliced inputs' lengths are known only at run time and may differ "
                                      f"({shown})")
    return None


def creates_variables(graph) -> bool:
    """Whether ``graph`` is the trace that creates its function's variables (a Keras optimizer's slots
    at the first step): TensorFlow initializes each under ``cond(VarIsInitializedOp(v), ...)``, then
    runs the lifted initializers and traces the function again without them, and runs that trace
    (checked on TF 2.21 with Keras 3's ``fit``: ``initialize_variables``, then the step traced again,
    which every batch runs).  Nothing said about it would be about a program that runs."""
    return any(c.type in ("If", "StatelessIf") and c.inputs[0] is op.outputs[0]
               for op in graph.get_operations() if op.type == "VarIsInitializedOp" for c in op.outputs[0].consumers())


def _length_of(t: tf.Tensor, axis: int, factor: Factor = UNIT):
    """What the split axis ``t`` holds along ``axis`` (at ``factor`` in it) is as long as: the product
    of the function's run-time sizes it is (:func:`grappler_ext.shapes.symbols`: a Keras ``Dense``'s
    [B * L, E] rows and the [B * L] labels it is compared with; the L of those rows split along the
    sequence), else where its run-time length comes from (:func:`.lengths.length_source`)."""
    exact = shapes.exact_dims(t)
    if exact is not None and exact[axis] is not None and shapes.monomials(t) is not None:
        return ("product", shapes.exact_monomial(exact[axis] // factor.rows(1)))
    if not factor.unit:
        return (t.name, axis)
    return lengths.length_source(t, axis)


def shape_reader(op: tf.Operation) -> bool:
    """A ``Shape``-like op (it reads no values) of tensors whose shapes are static, or products of the
    function's run-time sizes where they are planned with them (:func:`grappler_ext.shapes.known_shape`):
    the loop that replaces what it reads computes its result instead (a Keras ``Dense``'s
    ``tf.shape`` of a padded batch's activations)."""
    return op.type in SHAPE_READERS and all(shapes.known_shape(t) for t in op.inputs)


def _sparse_lookup(op: tf.Operation, prop: rules.Propagation) -> bool:
    """Whether ``op`` gathers rows of a variable's value read whole (an embedding lookup): the gradients
    recorded for that variable are ``IndexedSlices``, which a loop's gradient would accumulate dense, so
    the lookup stays outside the loop and its output is sliced."""
    return (op.type == "GatherV2" and prop.input_axes[0] is None
            and computed(op.inputs[0].op).type == "ReadVariableOp")


def _outside(op, wanted, whole, included, graph_outputs, live, cloned: set, built) -> Why | None:
    """Why ``op`` stays outside the region (its outputs are then sliced), or ``None``; an op read outside
    too that the region computes again (:func:`.rules.recomputed`) is added to ``cloned``.  Readers
    not in ``live`` (dead ops: a tape's gradient for a constant divisor) do not count."""
    if op not in live:
        # Built by an earlier loop of this plan (its rebuilt gradients): not in the order planned on.
        return Why(Code.REGION_STOPS, f"`{op.name}` was built by an earlier split")
    if (kind := rules.leaf_kind(op)) is not None:
        return Why(Code.REGION_STOPS, f"`{op.name}` is {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    if any(o.ref() in whole for o in op.outputs):
        return Why(Code.REGION_STOPS, f"`{op.name}` is also read whole")
    # (a constant made after it, as a square's gradient makes its 2, orders nothing that matters; nor
    # does a computation it waits for, as tf_keras' squared-difference gradient waits for its upstream)
    if any(rules.is_stateful(c) for c in op.control_inputs) or any(
            c not in included and c.type != "Const" for c in op._control_outputs):  # noqa: SLF001
        return Why(Code.REGION_STOPS, f"`{op.name}` has control dependencies")
    for o in op.outputs:
        if o.ref() in graph_outputs:
            return Why(Code.REGION_STOPS, f"`{op.name}` is an output of the function")
        # (an earlier loop reading a draw holds it back: its slices are not drawn again)
        reader = next((c for c in o.consumers() if c not in included and not shape_reader(c) and (
            c in live or (c in built and c.type in LOOP_TYPES and rules.is_stateful(op)))), None)
        # (an op computed again as elementwise ones are, or, where what reads it outside reduces it in
        # a loop of its own, with products in its chain: those readers judged only then)
        if reader is not None and (returned(o, graph_outputs) or not (rules.recomputed(op) or (
                _reduced_elsewhere(o, included, live, cloned) and rules.recomputed(op, reduced=True)))):
            what = f"what an earlier split computed (`{op.name}`)" if graph_edit.is_generated(op) else f"`{op.name}`"
            by = (f"by a loop of an earlier split (`{reader.name}`)" if graph_edit.is_generated(reader) else
                  f"by the program's own loop `{reader.name}`" if reader.type in LOOP_TYPES else
                  f"by `{reader.name}` ({reader.type})")
            return Why(Code.REGION_STOPS, f"{what} is also read outside the region, {by}")
        if reader is not None:
            cloned.add(op)
    return None


def _reduced_elsewhere(t: tf.Tensor, included, live, cloned: set) -> bool:
    """Whether what reads ``t`` outside the region reduces it in a loop of its own, which the region
    reads or which reads the region (a normaliser and what it normalises), or is itself computed again
    by the region (a chain already judged so)."""
    readers = [c for c in t.consumers() if c not in included and not shape_reader(c) and c in live]
    return bool(readers) and (all(c in cloned for c in readers) or (
        _only_reduced(t, included, live) and _linked(t, included, live)))


def _only_reduced(t: tf.Tensor, included, live, depth: int = 8) -> bool:
    """Whether what reads ``t`` outside the region (``included``) reduces it, directly or through
    elementwise ops (a normaliser ``sum(t)``, a divergence ``sum(p * log(t / s))``): a loop of its own
    can then compute ``t`` in slices too, and ``t`` need never be whole."""
    for c in t.consumers():
        if c in included or shape_reader(c) or c not in live or c.type in REDUCTIONS:
            continue
        if depth == 0 or c.type not in rules.RECOMPUTED or len(c.outputs) != 1 or not _only_reduced(
                c.outputs[0], included, live, depth - 1):
            return False
    return True


def _linked(t: tf.Tensor, included, live) -> bool:
    """Whether a reader of ``t`` outside the region (``included``) is a reduction the region reads the
    result of (t-SNE's total of its affinities, which the divergence's region divides by), or reads a
    tensor the region computes (the divergence, outside the total's region, reads the total): each
    needs the other's result, so no one loop computes both."""
    for c in t.consumers():
        if c in included or shape_reader(c) or c not in live:
            continue
        if c.type in REDUCTIONS and any(r in included for o in c.outputs for r in o.consumers()):
            return True
        if any(x is not t and x.op in included for x in c.inputs):
            return True
    return False


# Times forward_roots ends the axis earlier, at a tensor where two of its paths part, and looks again.
_MAX_CUTS = 8


def forward_roots(tensor: tf.Tensor, axis: int, order_index: dict, graph_outputs: set,
                  ignored: frozenset) -> list[RootOption] | str:
    """The roots that end the split of ``axis`` of ``tensor``, following the readers that keep it.

    Every reader of ``tensor`` (and of what carries its axis on) either keeps the axis (it then
    joins the region) or reduces it as a root (``Sum``, a ``MatMul`` contracting it, ...).  A
    tensor downstream that carries the axis and is an output of the function, or is read by an op
    that neither keeps nor reduces the axis, ends the region there: its op is a concatenating root
    (SGPR's predictive mean and variance over the test points, each [N_test, ...]) and all its
    readers read the joined result.  Only ``tensor`` itself cannot end so (with the reason).

    Where two paths from one tensor meet again with the axis at two places (an encoder layer's
    output read by the next layer's queries and keys: their scores hold it along two axes), the
    axis ends at the tensor where they parted, if it can be joined there (one loop per layer).
    """
    cuts: set = set()
    for _ in range(_MAX_CUTS):
        found = _forward_roots(tensor, axis, order_index, graph_outputs, ignored, cuts)
        if not isinstance(found, tuple):
            return found
        reason, parted = found
        if parted is None:
            return reason
        cuts.add(parted)              # (paths never part at a cut again: nothing is followed past one)
    return reason


def _ends(t: tf.Tensor, axis: int) -> list[RootOption]:
    """The options of ``t``'s op that end a split of ``axis`` there, ``t`` joined along it."""
    return [o for o in root_options(t.op) if o.kind == "concat" and o.output_axes[t.value_index] == axis]


def _parted(parent: dict, first, second):
    """The nearest tensor (a ref) on both of the paths ``parent`` leads up from ``first`` and ``second``."""
    path = set()
    while first is not None:
        path.add(first)
        first = parent.get(first)
    while second is not None and second not in path:
        second = parent.get(second)
    return second


def _forward_roots(tensor, axis, order_index, graph_outputs, ignored, cuts: set):
    """:func:`forward_roots` ending the axis at ``cuts`` (refs) too; a failure is a string, or
    ``(reason, ref)`` where two paths meet with the axis at two places (``ref``: where they parted,
    if it could end the axis there)."""
    roots: dict = {}
    seen: dict = {}
    parent: dict = {}                  # a tensor's ref -> the ref of the tensor it was first reached from
    stack = [(tensor, axis, UNIT, None)]
    while stack:
        t, a, factor, came_from = stack.pop()
        if t.ref() in seen:
            if seen[t.ref()] != (a, factor):
                parted = _parted(parent, t.ref(), came_from)
                joinable = parted is not None and parted != tensor.ref() and seen[parted][1].unit and bool(
                    _ends(parted.deref(), seen[parted][0]))
                return f"`{t.op.name}` would be split along two axes", parted if joinable else None
            continue
        seen[t.ref()] = (a, factor)
        parent[t.ref()] = came_from
        found, pushed, stop, assigned = {}, [], None, False
        if t.ref() in graph_outputs:
            stop = f"`{t.op.name}` is an output of the function"
        elif t.ref() in cuts:
            stop = f"`{t.op.name}` is read along the axis at two places further on"
        for reader in sorted(set(t.consumers()), key=lambda op: order_index.get(op, -1)) if stop is None else ():
            if reader not in order_index or reader in ignored or shape_reader(reader):
                continue
            slots = [j for j, x in enumerate(reader.inputs) if x is t]
            if reader.type == "AssignVariableOp" and slots == [1]:
                # A variable's new value (an optimizer's slot, grappler_ext.variable_updates): joined for
                # its assignment, and read slice by slice by what follows (the weight's update).
                assigned = True
                continue
            # A reduction over rows that hold the split axis at a factor ([B * L, E] summed over its
            # rows, the sequence inside) is no root: a root's inputs hold the whole axis.
            reducing = [o for o in root_options(reader) if factor.unit
                        and o.kind != "concat" and all(o.input_axes[j] == a for j in slots)]
            if reducing:
                if reader in roots and roots[reader].input_axes != reducing[0].input_axes:
                    stop = f"`{reader.name}` reduces along two axes"
                    break
                found[reader] = reducing[0]
                continue
            kept = _kept(reader, slots, a, factor)
            if kept is None:
                stop = f"`{reader.name}` ({reader.type}) neither keeps nor reduces axis {a} of `{t.op.name}`"
                break
            prop, out_factor = kept
            pushed.extend((o, b, out_factor, t.ref()) for o, b in zip(reader.outputs, prop.output_axes)
                          if b is not None)
        if stop is None:
            roots.update(found)
            stack.extend(pushed)
            if not assigned:
                continue
            stop = f"`{t.op.name}` is assigned to a variable"
        ends = _ends(t, a)
        if t is tensor or not ends or not factor.unit:
            # (joined results hold the whole axis: [B * L, E] rows cannot end a loop along L)
            return stop
        if t.op in roots and roots[t.op].output_axes != ends[0].output_axes:
            return f"`{t.op.name}` would be joined along two axes"
        roots[t.op] = ends[0]
    return sorted(roots.values(), key=lambda o: order_index[o.root])


def together(tensor: tf.Tensor, order_index: dict, graph_outputs: set, backward: frozenset) -> list[list[RootOption]]:
    """Root sets split with ``tensor`` along each of its axes: several readers reducing the same axis
    (SGPR's A A^T and A err: one loop), and, where gradients are taken inside the function, the roots
    reached through them to the weights' updates (a wide layer split along its kernel's columns, its
    gradient and update computed column block by column block)."""
    out = []
    for axis in range(tensor.shape.rank or 0):
        found = forward_roots(tensor, axis, order_index, graph_outputs, backward)
        if isinstance(found, list) and len(found) > 1:
            out.append(found)
        updating = backward and forward_roots(tensor, axis, order_index, graph_outputs, frozenset())
        if isinstance(updating, list) and updates_variable(updating, order_index):
            out.append(updating)
    return out


def reaching_on(options: list[RootOption], order_index: dict, graph_outputs: set,
                ignored: frozenset) -> list[list[RootOption]]:
    """Root sets ending the axis that ``options``' joined results carry on (:func:`forward_roots`
    from each concat root's output): a loop over an attention's queries reaches on through the
    residual, the layer norms and the feed-forward block to the layer's output.  Empty unless every
    root of ``options`` is joined."""
    further = []
    for option in options:
        if option.kind != "concat":
            return []
        for t, axis in zip(option.root.outputs, option.output_axes):
            if axis is not None:
                found = forward_roots(t, axis, order_index, graph_outputs, ignored)
                if isinstance(found, list) and found and {o.root for o in found} != {option.root}:
                    further.append(found)
    return further


def _kept(reader: tf.Operation, slots: list[int], axis: int, factor) -> tuple[rules.Propagation, object] | None:
    """``(propagation, factor)``: the output axis of ``reader`` that holds the split axis its inputs
    in ``slots`` hold along ``axis`` at ``factor``, and where it lies there; ``None`` if none does."""
    if not reader.outputs:
        return None
    candidates = [(b, factor) for b in range(reader.outputs[0].shape.rank or 0)]
    if reader.type == "Reshape" and slots == [0] and reader.inputs[0].shape.rank is not None and candidates:
        # A reshape keeps flat indices: its output holds the axis where rules.factor_axis finds it
        # (static shapes; else, as any op, along one of its axes whole).
        found = rules.factor_axis(shapes.exact_dims(reader.outputs[0]), shapes.exact_dims(reader.inputs[0]), axis,
                                  factor)
        candidates = [found] if found is not None else candidates if factor.unit else []
    elif reader.type in ("SpaceToBatchND", "BatchToSpaceND") and slots == [0] and axis == 0:
        # Its batch holds the split axis with the blocks moved into it, or out of it.
        moved = rules.batch_blocks_factor(reader, factor)
        candidates = [(0, moved)] if moved is not None else []
    for b, out_factor in candidates:
        prop = rules.propagate(reader, 0, b, factor=out_factor)
        if prop and all(prop.input_axes[j] == axis and prop.factor(j, out_factor) == factor for j in slots):
            return prop, out_factor
    return None


def prologue(grown: Grown, order_index: dict, graph_outputs: set, backward: frozenset, cap: float,
             share: float, most_ops: int, min_bytes: int) -> list[tf.Operation]:
    """Ops computing tensors the region reads whole from much smaller ones, for the loop to compute
    just before its slices and recompute in its gradient instead of the program holding them
    (:class:`~.loop.Region`'s ``prologue``), in topological order.

    For each floating tensor read whole (of at least ``min_bytes``), the ops above it are taken one at
    a time (the largest input's producer next, at most ``most_ops``) while every reader of what they
    compute is in the region, the prologue or the recorded gradients (rebuilt through the loop); the
    smallest set of inputs reached is kept if it is at most ``share`` of the tensor's bytes, inputs
    the region reads anyway counting nothing where the ops compute something new (an encoder layer's
    keys, [B, L, N, H], projected from the very input it slices, [B, L, N * H]; not a reshape or
    slice of it).  A prologue computes its tensors whole, in the forward and again in the backward:
    none may be over ``cap`` bytes (or over the largest input the region slices, where that is
    larger), or the prologue would hold what the loop is there to slice (an attention's
    probabilities, read whole by a loop over the value's columns).
    """
    region = grown.region
    held = set(region.sliced_inputs) | region.whole_inputs   # read by the region anyway: free to recompute from
    cap = max([cap] + [nbytes(r.deref()) or 0 for r in region.sliced_inputs])
    taken: set = set()
    for ref in sorted(region.whole_inputs - set(region.sliced_inputs), key=lambda r: r.deref().name):
        t = ref.deref()
        if not t.dtype.is_floating or t.op in taken or nbytes(t) < min_bytes:
            continue
        ops: list = []
        best, best_bytes = [], nbytes(t) * share
        frontier = {t.ref()}
        while len(ops) < most_ops:
            inside = grown.included | taken | set(ops)
            candidates = [r.deref() for r in frontier
                          if _prologue_op(r.deref().op, inside, order_index, graph_outputs, backward, cap)]
            if not candidates:
                break
            op = max(candidates, key=nbytes).op
            ops.append(op)
            frontier = {r for r in frontier if r.deref().op is not op} | {
                x.ref() for x in op.inputs if x.op not in ops}
            computes = any(o.type not in _VIEWS for o in ops)
            cut = sum(nbytes(r.deref()) for r in frontier if not (computes and r in held))
            if cut <= best_bytes:
                best, best_bytes = list(ops), cut
        taken |= set(best)
    return sorted(taken, key=lambda o: order_index[o])


# Ops that only reshape, cut or reorder their input: a prologue of these alone computes nothing new.
_VIEWS = PASS_THROUGH | {"StridedSlice", "Slice", "Transpose"}


def _prologue_op(op: tf.Operation, inside: set, order_index: dict, graph_outputs: set, backward: frozenset,
                 cap: float) -> bool:
    """Whether ``op`` can join a prologue whose region and ops so far are ``inside``, none of its
    outputs over ``cap`` bytes."""
    if (op in inside or op not in order_index or rules.leaf_kind(op) is not None or op.type in NOT_CLONED
            or rules.is_stateful(op) or op.control_inputs or op._control_outputs  # noqa: SLF001
            or any(t.dtype in (tf.resource, tf.variant) for t in list(op.inputs) + list(op.outputs))
            or not all(shapes.known_shape(t) for t in op.outputs) or any(nbytes(t) > cap for t in op.outputs)):
        # (a prologue is computed whole: its sizes static, or products of the function's run-time sizes)
        return False
    for o in op.outputs:
        if o.ref() in graph_outputs:
            return False
        for c in o.consumers():
            if c in order_index and c not in inside and c not in backward and not static_shape_reader(c):
                return False
    return True


def forget_dead(order_index: dict, graph, built: set) -> None:
    """Ops a split left dead dropped from ``order_index`` (the order later regions are planned on):
    a later region must neither grow through nor end at the ops a loop replaced (an attention's
    scores, still read by its queries' projection, which a later region would otherwise split again).
    The live ops outside it, which the splits built, are added to ``built``: they read what they read."""
    live = live_ops(graph)
    for op in [op for op in order_index if op not in live]:
        del order_index[op]
    built |= {op for op in live if op not in order_index and graph_edit.is_generated(op)}


def downstream(op: tf.Operation, order_index: dict, depth: int) -> list[tf.Operation]:
    """Ops reachable from ``op`` through data edges within ``depth`` steps, farthest first."""
    seen, frontier, found = {op}, [op], [op]
    for _ in range(depth):
        nxt = []
        for o in frontier:
            for t in o.outputs:
                for c in t.consumers():
                    if c not in seen and c in order_index:
                        seen.add(c)
                        nxt.append(c)
        found.extend(nxt)
        frontier = nxt
    return sorted(found, key=lambda o: -order_index[o])


def top_k(options) -> int:
    """The largest k of the region's top-k roots (a slice must hold at least k rows); 1 without one."""
    return max([int(tensor_util.constant_value(o.root.inputs[1])) for o in options if o.kind == "top_k"] or [1])


def joined_bytes(options, written_into=()) -> int:
    """The bytes of the results the loop of ``options`` joins whole (its concat roots' outputs; none
    for those written into an input's buffer, ``written_into``)."""
    return sum(nbytes(t) for o in options if o.kind == "concat" and o.root not in written_into for t in o.root.outputs)


def assigned(t: tf.Tensor, live) -> tf.Tensor | None:
    """The variable ``t`` is assigned to (its resource handle), where a live ``AssignVariableOp`` reads it."""
    return next((c.inputs[0] for c in t.consumers() if c.type == "AssignVariableOp" and c.inputs[1] is t
                 and c in live), None)


def _assigned_values(options, live) -> list[tf.Tensor]:
    """The concat roots' outputs of ``options`` that are a variable's new value (joined, then assigned)."""
    return [o.root.outputs[0] for o in options if o.kind == "concat" and o.root.outputs
            and assigned(o.root.outputs[0], live) is not None]


def updates_variable(options, live) -> bool:
    """Whether a root of ``options`` computes a variable's new value (joined, then assigned)."""
    return bool(_assigned_values(options, live))


def updates_from(options, live, backward: frozenset) -> bool:
    """Whether a root of ``options`` computes a variable's new value from the gradients (an optimizer's
    update: its region takes the gradients in), not from the forward alone (a batch norm's moving
    statistics, whose region leaves the gradients that read its inputs to be rebuilt)."""
    values = _assigned_values(options, live)
    return bool(values) and not backward.isdisjoint(ancestors(values))


def written_into(options, grown: Grown, live) -> dict:
    """``{root: input}``: the concat roots whose joined result can be written into the buffer of a
    sliced input, slice by slice, instead of joined apart: the root's output is a variable's new value
    (:mod:`grappler_ext.variable_updates`) and the input that variable's value before, read along the
    same axis, of the same shape, by nothing outside the region.  Slice ``s`` of the input is then read
    (by step ``s`` only) before it is overwritten, and XLA keeps the new value in the variable's own
    buffer: a [4096, 16384] weight updated column block by column block holds one copy, not three."""
    region = grown.region
    if region.dynamic:
        return {}           # a run-time length's clamped last slice overlaps the one before it
    out: dict = {}
    for o in options:
        if o.kind != "concat" or len(o.root.outputs) != 1:
            continue
        value, axis = o.root.outputs[0], o.output_axes[0]
        resource = assigned(value, live)
        if resource is None:
            continue
        for ref, a in region.sliced_inputs.items():
            t = ref.deref()
            if (t.op.type == "ReadVariableOp" and t.op.inputs[0] is resource and a == axis and t.dtype == value.dtype
                    and t.shape == value.shape and ref not in region.factors and ref not in region.whole_inputs
                    and all(c in grown.included or c not in live for c in t.consumers())
                    and all(v is not t for v in out.values())):
                out[o.root] = t
                break
    return out


def materialised_bytes(ops, info, where=lambda t: True) -> int:
    """Bytes of the outputs of ``ops`` that the memory model gives buffers (those ``where`` accepts)."""
    return sum(i.bytes for op in ops for o in op.outputs
               if where(o) and (i := info.get(o.name)) is not None and i.materialised and i.bytes)


def held_for_backward(grown: Grown, info, backward, joined) -> int:
    """Bytes that splitting the region stops holding from the forward to the backward: its tensors
    (and its prologue's) that gradients inside the function read (the loop's gradient recomputes
    them instead), less the inputs the loop's gradient keeps for that and nothing else did (an
    attention mask computed before a loop over heads, read whole by every slice).  ``joined``: the
    roots whose slices the loop joins into their whole result, still held (a loop over heads joins
    an attention's [L, H, K] output; one over queries through the output projection, [L, D]).
    Zero without gradients inside."""
    if not backward:
        return 0

    def read_backward(o):
        return any(c in backward for c in o.consumers())

    freed = materialised_bytes(grown.included - joined, info, read_backward)
    freed += materialised_bytes(grown.region.prologue, info, read_backward)
    kept = sum(nbytes(t) for t in external_inputs(grown.region)
               if t.op.type not in ("Placeholder", "Const") and t.dtype not in (tf.resource, tf.variant)
               and not read_backward(t))
    return freed - kept


def floor(est, info) -> int:
    """Parameters, constants, outputs and the largest materialised tensor: what no loop removes."""
    biggest = max((i.bytes for i in info.values() if i.materialised and i.bytes), default=0)
    return est.parameter_bytes + est.constant_bytes + est.output_bytes + biggest


def held_whole(graph) -> Whole | None:
    """Of the ops whose matrices no rewrite splits (:data:`~grappler_ext.op_types.WHOLE_MATRICES`),
    the one holding the most bytes at once beyond the program's arguments and results (one matrix's
    worth where the splitter splits the op's batch axes), or ``None``."""
    graph_outputs = {t.ref() for t in getattr(graph, "outputs", [])}

    def held(op):
        _, ins, outs = WHOLE_MATRICES[op.type]
        tensors = [op.inputs[i] for i in ins] + [op.outputs[i] for i in outs]
        if not all(t.shape.is_fully_defined() for t in tensors + [op.inputs[0]]) or op.inputs[0].shape.rank < 2:
            return 0
        batch = int(np.prod(op.inputs[0].shape[:-2])) if op.type in rules.RULES else 1
        return sum(nbytes(t) for t in tensors if t.op.type not in ARGUMENT_OPS
                   and not returned(t, graph_outputs)) // max(batch, 1)

    found = max(((held(op), op) for op in live_ops(graph) if op.type in WHOLE_MATRICES),
                key=lambda h: h[0], default=(0, None))
    if not found[0]:
        return None
    op = found[1]
    return Whole(op.name, WHOLE_MATRICES[op.type][0], tuple(op.inputs[0].shape.as_list()[-2:]), found[0])


def needed_now(graph, planned_bytes: int, loop_bytes: dict) -> tuple[int, bool]:
    """``(bytes, lower_bound)``: the bytes the program as rewritten so far needs by the memory model,
    each of the splitter's loops counted as a kernel whose scratch is its body's planned bytes
    (``loop_bytes``).  Where that cannot be estimated (an op without a rule; the dynamic shapes of a
    sparse update): the most of the static part, ``planned_bytes`` (the loops' plans) and
    :func:`floor`, a lower bound (``lower_bound`` true: only XLA's figure can say it is within)."""
    def body(op, ctx):
        return loop_bytes.get(op.name, 0)

    loop = memory_model.Rule(memory_model.Kind.LIBRARY, scratch=body)
    # The conditionals a prologue's recomputation sits in (loop._in_order): their outputs; the
    # program's own (mixed precision's loss scaling) as the model counts them.
    branches = {kind: _ours_by_outputs(memory_model.RULES[kind]) for kind in BRANCH_TYPES - {"Case", "StatelessCase"}}
    after, info = memory_model.analyse(graph, {**memory_model.RULES, **dict.fromkeys(LOOP_TYPES, loop), **branches})
    if after.peak_bytes is not None:
        return after.peak_bytes, False
    known = 0 if after.unknown else after.parameter_bytes + after.constant_bytes + after.live_peak_bytes
    return max(planned_bytes, known, floor(after, info)), True


def _ours_by_outputs(rule: memory_model.Rule) -> memory_model.Rule:
    """A conditional's byte ``rule``, but a conditional of ours counted by its outputs alone."""
    def ours(op):
        return graph_edit.is_generated(op.name)

    return dataclasses.replace(rule, scratch=lambda op, ctx: 0 if ours(op) else rule.scratch(op, ctx),
                               unknown_when=lambda op: None if ours(op) else rule.unknown_when(op),
                               parameters=lambda op: 0 if ours(op) else rule.parameters(op))


def split_before(est) -> bool:
    """Whether the program ``est`` counts holds loops an earlier split built (ops without a rule)."""
    return any(graph_edit.is_generated(name) for name, _, _ in est.unknown)
