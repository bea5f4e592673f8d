"""A loop's backward built once, and copied each time it is asked for again.

The splitter differentiates the function's recorded gradients again after each loop it installs
(:func:`grappler_ext.gradients.rebuild`), and ``tf.gradients`` then calls the custom gradient of
every loop installed so far: without this, each call traced that loop's backward anew (its
recomputing ``while`` body, its remainder slice, its prologue's recomputation), so the ``k``-th
loop of a plan had its backward traced ``n - k + 1`` times.  In a Transformer's training step of 18
loops over two plans, that was a quarter of the rewrite's time (105 s of 410 s at L = 2048), and 488
of its 720 functions (the traced bodies).  A copy still adds the backward's ops outside its loops
to the graph each time, all dead but the last (what TensorFlow is given leaves them out).

It was also wrong where the slices draw again (``Options.redraw_random``): a backward traced during
a later loop's rebuild keyed its draws on that loop's seed, not its own forward's, so the
recomputed dropout masks were not the forward's.

:func:`once` wraps a custom gradient's backward builder: its first call in a graph builds it and
records the ops it made; a later call in the same graph, with upstream gradients of the same
kinds, copies those ops (:func:`grappler_ext.graph_edit.copy_ops`: the loops' bodies referenced,
not traced again) onto the new upstream gradients.  The copy computes what a new trace would,
with the draws of the first (its own loop's seed).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import tensorflow as tf

from grappler_ext import graph_edit, shapes

__all__ = ["once", "owner"]

# Each op a backward built or copied here, by the ``owner`` its :func:`once` was given (a loop's region):
# the splitter counts a gradient loop's body by the plan of the loop it differentiates, whichever
# rebuild of the function's gradients made the copy.
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def owner(op: tf.Operation):
    """The ``owner`` of the :func:`once` whose backward made ``op`` (built or copied), else ``None``."""
    return _OWNERS.get(op)


@dataclasses.dataclass
class _Built:
    graph: object
    upstream: tuple            # the first call's upstream gradients (tensors or None)
    ops: list                  # the ops that call made in the graph, in creation order, as made
    results: list              # what it returned


def _kind(u) -> tuple | None:
    return None if u is None else (u.dtype, tuple(u.shape.as_list()) if u.shape.rank is not None else None)


def _replayable(upstream) -> bool:
    return all(u is None or isinstance(u, tf.Tensor) for u in upstream)


def once(build: Callable[..., list], owner_=None) -> Callable[..., list]:
    """``build`` (a custom gradient's backward: upstream gradients in, input gradients out) built
    once per graph and upstream kinds, copied after; the ops either makes are ``owner_``'s (:func:`owner`)."""
    built: dict = {}                                    # (graph id, upstream kinds) -> _Built

    def grad(*upstream):
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        try:
            if not _replayable(upstream):
                return build(*upstream)
            key = (id(graph), tuple(_kind(u) for u in upstream))
            first = built.get(key)
            if first is None or first.graph is not graph:
                results = build(*upstream)
                made = graph_edit.snapshot(graph.get_operations()[before:])
                built[key] = _Built(graph, upstream, made, list(results))
                return results
            mapping = {old.ref(): new for old, new in zip(first.upstream, upstream) if old is not None}
            graph_edit.copy_ops(first.ops, mapping)
            # (the copies' sizes as the originals', where planning reads run-time sizes: not inferred again)
            shapes.copied((old.deref(), new) for old, new in mapping.items())
            return [_mapped(r, mapping) for r in first.results]
        finally:
            if owner_ is not None:
                for op in graph.get_operations()[before:]:
                    _OWNERS[op] = owner_

    return grad


def _mapped(result, mapping: dict):
    if result is None:
        return None
    if isinstance(result, tf.IndexedSlices):
        return tf.IndexedSlices(*(None if c is None else mapping.get(c.ref(), c)
                                  for c in (result.values, result.indices, result.dense_shape)))
    return mapping.get(result.ref(), result)
