"""Gradients taken inside a traced function: what was differentiated, and how to do it again.

With a ``GradientTape`` inside a ``tf.function``, the gradient ops are already in the graph the
passes see, and they read the large forward tensors (the [M, N] kernel matrix, attention
probabilities): splitting only the forward would leave those tensors alive for the backward and
save nothing.  So tf_memsafe records each ``tape.gradient`` call made while a function is traced
(its targets, sources, output gradients and results; see ``tf_memsafe.hook``), and a pass that
rewrites the forward can

1. ignore the recorded backward ops when it decides what reads a forward tensor
   (:func:`backward_ops`), and
2. after rewriting, differentiate the rewritten forward again in the same graph with
   ``tf.gradients`` and rewire every reader of the old gradients to the new ones
   (:func:`rebuild`); the old backward ops, and with them the old forward tensors, become dead.
   Both changes to the records are journaled (:func:`grappler_ext.graph_edit.on_undo`): undoing a
   pass's edits restores what the records name.

The rewritten forward's own gradients (the splitter's ``custom_gradient`` loops) then compute the
backward slice by slice.  A result may be a dense tensor, ``None`` (an unconnected source) or
``IndexedSlices`` (an embedding lookup's gradient, which Keras' optimizers apply as a sparse
update): the new slices replace the old component by component (values, indices, dense shape),
so the sparse update reads them unchanged.  Anything else (a ``RaggedTensor``...) cannot be
rebuilt; such a function keeps its backward as traced (:func:`rebuildable` says so first, before
any edit).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterable

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import gradients_util

from grappler_ext import graph_edit, graph_query

__all__ = ["GRADIENTS_ATTR", "GradientRecord", "records", "backward_ops", "rebuildable", "differentiated", "retarget",
           "rebuild", "carries_gradient", "wanted"]

# Attribute of a FuncGraph holding its list of GradientRecord (set while the function is traced).
GRADIENTS_ATTR = "_tf_memsafe_gradients"


@dataclasses.dataclass
class GradientRecord:
    """One ``tape.gradient(target, sources, output_gradients)`` call inside a traced function.

    Attributes:
      targets: the flat target tensors.
      sources: the flat sources (tensors or resource variables).
      output_gradients: the flat output gradients, or ``None``.
      unconnected: ``tf.UnconnectedGradients`` value used by the call.
      results: the flat results, as the call returned them (``None`` where unconnected).
    """

    targets: list
    sources: list
    output_gradients: list | None
    unconnected: object
    results: list


def _components(r) -> list:
    """The graph tensors a result is made of (an ``IndexedSlices``' values, indices, dense shape)."""
    if isinstance(r, tf.IndexedSlices):
        return [r.values, r.indices] + ([r.dense_shape] if r.dense_shape is not None else [])
    return [r] if isinstance(r, tf.Tensor) else []


def records(graph) -> list[GradientRecord]:
    return list(getattr(graph, GRADIENTS_ATTR, ()) or ())


def _in_graph(t) -> bool:
    """A symbolic tensor of a graph (a variable's eager handle, captured from outside, is not)."""
    try:
        return isinstance(t, tf.Tensor) and t.op is not None
    except AttributeError:
        return False


def _source_tensors(record: GradientRecord) -> list[tf.Tensor]:
    """The sources that are graph tensors (variables are read through ops the targets depend on)."""
    return [s for s in record.sources if _in_graph(s)]


def backward_ops(graph) -> set[tf.Operation]:
    """The ops that only the recorded gradients computed: ancestors of their results that are not
    ancestors of what was differentiated (targets, sources, output gradients)."""
    out: set[tf.Operation] = set()
    for record in records(graph):
        results = [t for r in record.results for t in _components(r) if _in_graph(t)]
        if not results:
            continue
        upstream = [g for g in record.output_gradients or [] if _in_graph(g)]
        forward = record.targets + _source_tensors(record) + upstream
        out |= graph_query.ancestors(results) - graph_query.ancestors(forward)
    return out


def rebuildable(graph) -> tuple[bool, str]:
    """Whether every record can be differentiated again (and why not)."""
    for record in records(graph):
        for r in record.results:
            if r is not None and not isinstance(r, (tf.Tensor, tf.IndexedSlices)):
                return False, f"a gradient inside the function is a {type(r).__name__}, which cannot be rebuilt"
        if any(not isinstance(t, tf.Tensor) for t in record.targets):
            return False, "a gradient inside the function has a target that is not a tensor"
    return True, ""


def differentiated(graph, ops: Iterable[tf.Operation]) -> bool:
    """Whether a gradient recorded inside the function differentiates a target computed from one of
    ``ops`` (so that the gradient of their outputs is certainly taken in this graph)."""
    ops = set(ops)
    for record in records(graph):
        if not any(_components(r) for r in record.results):
            continue
        if graph_query.ancestors([t for t in record.targets if _in_graph(t)]) & ops:
            return True
    return False


def _backpropagatable(t: tf.Tensor) -> bool:
    """Whether TensorFlow's gradients flow through ``t`` at all (its ``_IsBackpropagatable``)."""
    return t.dtype.is_floating or t.dtype.is_complex or t.dtype in (tf.resource, tf.variant)


def carries_gradient(t: tf.Tensor) -> bool:
    """Whether a gradient of ``t`` can reach the function's inputs or variables: a path from one to
    ``t`` through floating tensors and ops with a gradient.  ``False`` proves ``t``'s gradient zero
    whatever differentiates it (an accuracy: an ``argmax``'s integers compared with the labels,
    counted as floats).  An op without a registered gradient function is taken to have one (as
    ``tf.gradients`` would fail on it)."""
    return _reaches(t, lambda x: x.dtype in (tf.resource, tf.variant) or x.op.type == "Placeholder")


def _handle(source):
    """The resource handle a variable source is read through (a Keras 3 variable's, its value's)."""
    handle = getattr(source, "handle", None)
    return handle if handle is not None else getattr(getattr(source, "value", None), "handle", None)


def wanted(graph):
    """``asks(t)``: whether a gradient recorded inside ``graph`` asks for ``t``'s gradient, that is
    whether ``t`` is computed from one of its sources (a tensor, or the captured handle a variable is
    read through) through tensors and ops gradients flow through.  A MoCo loss' negative queue and a
    frozen layer's weights are read by the loss but asked for by no gradient.  Every tensor is asked
    for where nothing is recorded (a tape outside the function decides) or a source is not found."""
    recorded = records(graph)
    captured = {id(external): internal for external, internal in getattr(graph, "captures", ())}
    anchors = set()
    for record in recorded:
        for source in record.sources:
            found = source if _in_graph(source) else captured.get(id(_handle(source)))
            if found is None:
                return lambda t: True
            anchors.add(found.ref())
    if not recorded:
        return lambda t: True
    known: dict = {}

    def asks(t: tf.Tensor) -> bool:
        if t.ref() not in known:
            known[t.ref()] = _reaches(t, lambda x: x.ref() in anchors)
        return known[t.ref()]

    return asks


def _reaches(t: tf.Tensor, found) -> bool:
    """Whether a path of tensors gradients flow through (by ops with a gradient) leads to ``t`` from
    a tensor ``found(x)`` is true of."""
    stack, seen = [t], set()
    while stack:
        x = stack.pop()
        if x.ref() in seen or not _backpropagatable(x):
            continue
        if found(x):
            return True
        seen.add(x.ref())
        try:
            if ops._gradient_registry.lookup(x.op.type) is None:   # noqa: SLF001 - NotDifferentiable
                continue
        except LookupError:
            pass
        stack.extend(x.op.inputs)
    return False


def retarget(graph, old: tf.Tensor, new: tf.Tensor) -> None:
    """A pass replaced ``old`` by ``new``: records that differentiate ``old`` now differentiate ``new``."""
    for record in records(graph):
        if any(t is old for t in record.targets):
            before = record.targets
            record.targets = [new if t is old else t for t in before]
            graph_edit.on_undo(lambda record=record, before=before: setattr(record, "targets", before))


# The ops ``tf.gradients`` need not reach from its sources while :func:`rebuild` runs (per context):
# the backward each earlier rebuild left dead.  TensorFlow marks every op reachable from the sources
# (``_MarkReachedOps``, through each tensor's consumers) before it keeps those the targets read: a
# dead op reads forward tensors, so it was visited, though no target reads it (it is dead).  A
# training step's plan of 11 loops left 42,000 dead ops beside 16,000 live ones; each rebuild walked
# all of them.  Leaving them out changes nothing TensorFlow builds.
_DEAD: contextvars.ContextVar[frozenset] = contextvars.ContextVar("grappler_ext_dead_ops", default=frozenset())
_CONSUMERS = getattr(gradients_util, "_Consumers", None)


def _live_consumers(t, func_graphs):
    found = _CONSUMERS(t, func_graphs)
    dead = _DEAD.get()
    return [op for op in found if op not in dead] if dead else found


if _CONSUMERS is not None:
    gradients_util._Consumers = _live_consumers      # noqa: SLF001 - a pass-through outside rebuild()


@contextlib.contextmanager
def _without_dead(graph, targets):
    """``tf.gradients`` of ``targets`` in ``graph`` not walking its dead ops (:data:`_DEAD`) within the
    block: those neither live nor read by ``targets`` (a loss only its gradient stands for is not
    live, and the ops between it and the sources are all it reads)."""
    if _CONSUMERS is None:
        yield
        return
    kept = graph_query.live_ops(graph) | graph_query.ancestors([t for t in targets if _in_graph(t)])
    token = _DEAD.set(frozenset(op for op in graph.get_operations() if op not in kept))
    try:
        yield
    finally:
        _DEAD.reset(token)


def rebuild(graph, scope: str, touched: Iterable[tf.Operation], inside: Iterable[tf.Operation] = ()) -> int:
    """Differentiate again every record whose backward read an op of ``touched``; return how many.
    A record whose results only ops of ``inside`` read (a rewrite took them in: a region computing
    the variables' updates) is left: nothing would read its new results.

    Must be called after the forward was rewired; builds under ``tf_memsafe/<scope>`` and
    replaces every use of each old result with the new one (dtype and shape checked).
    """
    touched, inside = set(touched), set(inside)
    live = graph_query.live_ops(graph) if inside else set()
    done = 0
    for record in records(graph):
        results = [t for r in record.results for t in _components(r)]
        if not results or (inside and all(c in inside or c not in live for t in results for c in t.consumers())):
            continue
        backward = graph_query.ancestors(results)
        if not backward & touched:
            continue
        with graph_edit.building(graph, scope), _without_dead(graph, record.targets):
            new = tf.gradients(record.targets, record.sources, grad_ys=record.output_gradients,
                               unconnected_gradients=record.unconnected)
            # Each new result takes the old one's form: slices where the old was slices (a dense
            # gradient of an embedding is the slices' scatter, which the old readers did not read).
            new = [_like(old, fresh) for old, fresh in zip(record.results, new)]
        # Their ancestors once for all of them (not once a result: a Transformer's step has hundreds).
        upstream = graph_query.ancestors([f for fresh in new if fresh is not None for f in _components(fresh)])
        for i, (old, fresh) in enumerate(zip(record.results, new)):
            if fresh is None or old is None:
                continue
            for o, f in zip(_components(old), _components(fresh)):
                graph_edit.replace_uses(o, f, upstream=upstream)
            record.results[i] = fresh
            graph_edit.on_undo(lambda results=record.results, i=i, old=old: results.__setitem__(i, old))
        done += 1
    return done


def _like(old, fresh):
    """``fresh`` in the form of ``old``: a dense tensor, or ``IndexedSlices`` with the same components.

    An embedding's gradient (``IndexedSlices``: a row a lookup, the ids as indices) is dense once
    the lookup is computed in a loop (a Keras model's step on batches of a size known only at run
    time, split along the batch).  It is then given back on the old indices, the ids looked up: the
    first lookup of each id holds the dense gradient's row, the others zeros.  Its readers sum the
    rows of an id (an optimizer's deduplication), which gives the row itself, and update the rows
    looked up and only those, as before: Keras' Adam updates a sparse gradient's rows alone, and
    rows of every id would move the moments of rows not looked up (measured: another loss after
    two steps, where SGD's was bit for bit)."""
    if fresh is None or old is None:
        return fresh
    if isinstance(old, tf.IndexedSlices):
        if isinstance(fresh, tf.IndexedSlices):
            return fresh
        dense = tf.convert_to_tensor(fresh)
        ids = old.indices
        at = tf.range(tf.shape(ids, out_type=ids.dtype)[0])
        first = tf.math.unsorted_segment_min(at, ids, tf.shape(dense, out_type=ids.dtype)[0])
        keep = tf.reshape(tf.equal(tf.gather(first, ids), at), [-1] + [1] * (dense.shape.rank - 1))
        rows = tf.gather(dense, ids)
        return tf.IndexedSlices(tf.where(keep, rows, tf.zeros_like(rows)), ids, old.dense_shape)
    return tf.convert_to_tensor(fresh)
