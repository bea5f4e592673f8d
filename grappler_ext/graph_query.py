"""Graph traversal: which ops are live, in what order they can run, and what they depend on.

Rule: everything here only reads a graph; nothing mutates it (edits go through
:mod:`grappler_ext.graph_edit`).

* :func:`live_ops`: the ops reachable backwards from the graph's outputs and control outputs;
* :func:`kept_ops`: those and the ops TensorFlow's function runtime keeps beside them (stateful
  ones and what they read);
* :func:`topological_order`: ops in a topological order, ties broken by creation order; a cycle
  raises :class:`VerificationError` (which :mod:`grappler_ext.verifier` exports as its own);
* :func:`ancestors`: the ops some tensors depend on, through data and control edges.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import tensorflow as tf

from grappler_ext.op_types import PASS_THROUGH

__all__ = ["VerificationError", "live_ops", "kept_ops", "topological_order", "ancestors", "ancestor_ops", "returned"]


class VerificationError(AssertionError):
    """The graph broke an invariant."""


def _roots(graph) -> list[tf.Operation]:
    roots = [t.op for t in getattr(graph, "outputs", []) if t is not None]
    roots += list(getattr(graph, "control_outputs", []))
    return roots


def live_ops(graph) -> set[tf.Operation]:
    """The ops reachable backwards from the graph's outputs and control outputs.

    A graph without ``outputs`` (a plain ``tf.Graph``) is all live.
    """
    if not hasattr(graph, "outputs"):
        return set(graph.get_operations())
    seen: set[tf.Operation] = set()
    stack = _roots(graph)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def kept_ops(graph, ops: Iterable[tf.Operation] | None = None) -> set[tf.Operation]:
    """The ops of ``graph`` (a ``FuncGraph``; ``ops``: its ops, by default ``graph.get_operations()``)
    that TensorFlow keeps when it makes it a function and prunes its body (``PruneFunctionBody``):
    those reachable backwards from its outputs, its control outputs, and every stateful op (a draw,
    a variable's write), reachable or not -- a stateful op nothing reads still runs.  What a pass
    built and abandoned is not among them, unless stateful."""
    ops = graph.get_operations() if ops is None else ops
    roots = _roots(graph) + [op for op in ops
                             if op._is_stateful and op.type != "Placeholder"]  # noqa: SLF001 - the op def's flag
    return ancestor_ops(roots)


def _predecessors(op: tf.Operation) -> set[tf.Operation]:
    return {t.op for t in op.inputs} | set(op.control_inputs)


def topological_order(graph, ops=None, first=()) -> list[tf.Operation]:
    """``ops`` (default: live ops) in a topological order, ties broken by creation order.

    ``first``: ops without predecessors to emit before all others, in the given order (the
    printer puts the function's input placeholders first).  Creation order alone is not
    topological once passes have rewired inputs.  Raises :class:`VerificationError` on a cycle,
    naming the ops on it or after it.
    """
    ops = live_ops(graph) if ops is None else set(ops)
    created = {op: i for i, op in enumerate(graph.get_operations())}
    order = [op for op in dict.fromkeys(first) if op in ops and not _predecessors(op)]
    emitted = set(order)
    indegree = {op: 0 for op in ops if op not in emitted}
    users: dict = {op: [] for op in ops}
    for op in indegree:
        for p in _predecessors(op):
            if p in indegree:
                indegree[op] += 1
                users[p].append(op)
    ready = [(created.get(op, -1), id(op), op) for op, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    while ready:
        _, _, op = heapq.heappop(ready)
        order.append(op)
        for u in users[op]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, (created.get(u, -1), id(u), u))
    if len(order) != len(ops):
        stuck = sorted((op for op, d in indegree.items() if d > 0), key=lambda o: created.get(o, -1))
        raise VerificationError(f"graph has a cycle; ops on it or after it: "
                                f"{', '.join(f'{op.name} ({op.type})' for op in stuck)}")
    return order


def ancestors(tensors: Iterable[tf.Tensor], stop: set | None = None) -> set[tf.Operation]:
    """The ops that ``tensors`` depend on (data and control edges), themselves included."""
    return ancestor_ops([t.op for t in tensors], stop)


def ancestor_ops(ops: Iterable[tf.Operation], stop: set | None = None) -> set[tf.Operation]:
    """The ops that ``ops`` depend on (data and control edges), themselves included (an op without
    outputs too: an assignment, a ``NoOp``)."""
    seen: set[tf.Operation] = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op in seen or (stop and op in stop):
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def returned(t: tf.Tensor, graph_outputs: set) -> bool:
    """Whether the function whose outputs' refs are ``graph_outputs`` returns ``t``, or it through ops
    that only pass it on: its whole value is made."""
    return any(x.ref() in graph_outputs for x in passed_on(t))


def passed_on(t: tf.Tensor) -> list[tf.Tensor]:
    """``t`` and what ops that only pass a value on (:data:`~grappler_ext.op_types.PASS_THROUGH`: an
    identity, a custom gradient's ``IdentityN``, a reshape) make of it, through any number of them."""
    found, stack, seen = [], [t], set()
    while stack:
        x = stack.pop()
        if x.ref() in seen:
            continue
        seen.add(x.ref())
        found.append(x)
        stack.extend(c.outputs[_slot(c, x) if c.type == "IdentityN" else 0]
                     for c in x.consumers() if c.type in PASS_THROUGH and c.outputs)
    return found


def _slot(op: tf.Operation, t: tf.Tensor) -> int:
    """Which input of ``op`` is ``t`` (by identity: a tensor's ``==`` builds an op)."""
    return next(i for i, x in enumerate(op.inputs) if x is t)
