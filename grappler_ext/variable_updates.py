"""Variable updates as values: a variable's writes in a traced function made assignments of its new value.

A training step writes its variables with ``AssignSubVariableOp`` (Keras' SGD: ``w.assign_sub(lr * g)``),
``AssignAddVariableOp`` (Adam's moments) and ``AssignVariableOp``, and reads a variable again after
writing it (Adam's step reads the moments it has just written).  A tensor goes in, a side effect
comes out: no region can take such a write in.  :func:`as_values` makes every ``AssignAdd``/``AssignSub``
an ``AssignVariableOp`` of the new value as a tensor (``read + delta``, ``read - delta``) and has the
reads after a write read that tensor (store-to-load forwarding).  The update is then dataflow from
the variable's first read to one assignment per write, which the splitter can compute slice by
slice along an axis of the variable, writing each slice into the variable's own buffer (XLA aliases
a variable's new value with its old one: measured on TF 2.21, ``w.assign(w * 2)`` of a [4096, 4096]
float32 is 64 MiB in all).

A graph cannot drop an op, and a stateful op that nothing reads still runs in a compiled function
(measured: an ``AssignAddVariableOp`` left unreachable by a graph transform ran under
``jit_compile=True``, before the read it had no edge to).  So each rewritten write stays where it
was, made a no-op -- its delta a zero fill -- and runs after the new assignment (a control edge):
whatever order the runtime picks, the variable ends with the new value.

Only variables the function touches in a straight line are rewritten: every reader of the resource a
read or a write (not a loop, a call, a gather, a fused optimizer kernel), the writes ordered with
the reads by the control edges TensorFlow's automatic control dependencies add, and a read before
the first ``AssignAdd``/``AssignSub``.  Every edit is journaled (:mod:`grappler_ext.graph_edit`).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from grappler_ext import graph_edit, graph_query

__all__ = ["WRITES", "Update", "candidates", "as_values", "through_identities", "variable_name"]

READ = "ReadVariableOp"
ASSIGN = "AssignVariableOp"
WRITES = frozenset({ASSIGN, "AssignAddVariableOp", "AssignSubVariableOp"})


@dataclasses.dataclass(frozen=True)
class Update:
    """A variable whose writes are assignments of values now.

    ``resource``: the variable's handle in the graph; ``assigns``: the assignments, in order, each
    writing a tensor (its ``inputs[1]``)."""

    resource: tf.Tensor
    assigns: tuple


def _chain(resource: tf.Tensor, order_index: dict) -> list[tf.Operation] | None:
    """The live reads and writes of ``resource`` in order, or ``None`` where they are not a straight
    line this module can rewrite."""
    ops = [c for c in resource.consumers() if c in order_index]
    if not ops or any(op.type != READ and op.type not in WRITES for op in ops) \
            or any(op.inputs[0] is not resource for op in ops):
        return None
    ops.sort(key=order_index.get)
    if not any(op.type in WRITES - {ASSIGN} for op in ops) and not any(
            op.type == READ and any(w.type in WRITES for w in ops[:i]) for i, op in enumerate(ops)):
        return None                         # nothing to rewrite: no relative write, no read after a write
    # Each op must come after the previous write and, if a write, after every op since then: else
    # the order found is not the one the function runs in.
    last_write, since = None, []
    for op in ops:
        if last_write is not None and not _after(op, last_write):
            return None
        if op.type in WRITES:
            if any(not _after(op, p) for p in since):
                return None
            last_write, since = op, []
        since.append(op)
    if ops[0].type not in (READ, ASSIGN):
        return None                         # a relative write before any read
    return ops


def _after(op: tf.Operation, earlier: tf.Operation) -> bool:
    """Whether ``op`` depends on ``earlier``: a direct control edge (what automatic control
    dependencies add), else any path of data or control edges."""
    return earlier in op.control_inputs or earlier in graph_query.ancestor_ops(
        [t.op for t in op.inputs] + list(op.control_inputs))


def candidates(graph, order_index: dict, min_bytes: int = 0) -> list[tuple[tf.Tensor, list[tf.Operation]]]:
    """The variables :func:`as_values` would rewrite, with their reads and writes in order: those of
    at least ``min_bytes`` (``order_index``: the live ops' positions in a topological order)."""
    out = []
    for op in graph.get_operations():
        if op.type != "Placeholder" or op.outputs[0].dtype != tf.resource:
            continue
        resource = op.outputs[0]
        chain = _chain(resource, order_index)
        if chain is None:
            continue
        value = next((w.inputs[1] for w in chain if w.type in WRITES), None)
        if value is None or value.shape.num_elements() is None \
                or value.shape.num_elements() * value.dtype.size < min_bytes:
            continue
        out.append((resource, chain))
    return out


def as_values(graph, scope: str, found: list[tuple[tf.Tensor, list[tf.Operation]]]) -> list[Update]:
    """Rewrite the variables ``found`` (see :func:`candidates`) in ``graph``: every relative write an
    assignment of the new value, the reads after a write reading that value.  Journaled."""
    updates = []
    for resource, chain in found:
        current: tf.Tensor | None = None
        assigns = []
        for op in chain:
            if op.type == READ:
                if current is None:
                    current = op.outputs[0]
                else:
                    graph_edit.replace_uses(op.outputs[0], current)
                continue
            delta = op.inputs[1]
            if op.type == ASSIGN:
                current = delta
                assigns.append(op)
                continue
            with graph_edit.building(graph, scope), tf.control_dependencies(op.control_inputs):
                new = (tf.math.add if op.type == "AssignAddVariableOp" else tf.math.subtract)(current, delta)
                assign = tf.raw_ops.AssignVariableOp(resource=resource, value=new)
                zero = tf.fill(tf.shape(delta) if not delta.shape.is_fully_defined() else delta.shape.as_list(),
                               tf.constant(0, delta.dtype))
            graph_edit.rewire_input(op, 1, zero)
            _run_after(op, assign)
            current = new
            assigns.append(assign)
        if assigns:
            updates.append(Update(resource, tuple(assigns)))
    return updates


def _run_after(op: tf.Operation, first: tf.Operation) -> None:
    """Give ``op`` a control edge from ``first`` (journaled)."""
    before = list(op.control_inputs)
    op._add_control_input(first)  # noqa: SLF001 - TensorFlow's one API for it

    def undo(op=op, before=before):
        op._remove_all_control_inputs()  # noqa: SLF001
        op._add_control_inputs(before)  # noqa: SLF001

    graph_edit.on_undo(undo)


def through_identities(graph, updates: list[Update], protected: set) -> int:
    """Have the readers of the ``IdentityN`` ops the updates' values are computed through read those
    ops' inputs instead; return how many ops were passed over.  Keras 3's optimizers pass the
    gradients through one (``tf.custom_gradient``'s ``IdentityN``) whose outputs go to different
    variables' updates: a region along one weight's axis could not take it in.  Ops among
    ``protected`` (what a recorded gradient differentiates) keep theirs: there the ``IdentityN``
    carries a custom gradient.  Journaled."""
    passed = [op for op in graph_query.ancestors([a.inputs[1] for u in updates for a in u.assigns])
              if op.type == "IdentityN" and op not in protected]
    for op in sorted(passed, key=lambda o: o.name):
        for out, into in zip(op.outputs, op.inputs):
            graph_edit.replace_uses(out, into)
    return len(passed)


def variable_name(graph, resource: tf.Tensor) -> str:
    """The name of the variable whose handle ``resource`` is in ``graph`` (``dense/kernel``), for people;
    the handle's own name where the graph does not say."""
    names = {id(v.handle): v.name for v in getattr(graph, "variables", ())}
    for external, internal in getattr(graph, "captures", ()):
        if internal is resource and id(external) in names:
            return names[id(external)].removesuffix(":0")
    return resource.op.name
