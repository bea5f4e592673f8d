"""The graph verifier the pipeline runs after every pass (XLA's ``HloVerifier`` in spirit).

Checks, on the ops reachable from the graph's outputs:

* well formed: every input of a live op belongs to the same graph, and the live ops are acyclic
  (a bad rewiring can make a cycle, which TensorFlow would only report at run time, or hang);
* the outputs keep their number, dtypes and static shapes from before the pipeline;
* every op tf_memsafe generated has fully known static shapes (the memory model and XLA need them),
  except integer vectors, which are shape arithmetic (``tf.gradients`` builds ``BroadcastGradientArgs``
  and friends, whose lengths it does not infer; XLA folds them).  In a function with inputs of
  run-time sizes, its dimensions may be unknown but not its rank, except in what TensorFlow's own
  gradient functions make (a ``BatchMatMulV2``'s gradient sums over the axes a
  ``BroadcastGradientArgs`` of run-time shapes gives: of unknown rank, as in the gradients TensorFlow
  traced; the memory model reads it through its symbol table, XLA when it compiles).

A failure raises :class:`VerificationError` naming what is wrong; the pipeline adds which pass
ran just before.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from grappler_ext import graph_query
from grappler_ext.graph_edit import is_generated
from grappler_ext.graph_query import VerificationError  # topological_order raises it on a cycle
from grappler_ext.op_types import reserve_space

__all__ = ["VerificationError", "OutputSignature", "verify"]


@dataclasses.dataclass(frozen=True)
class OutputSignature:
    """Dtypes and static shapes of a graph's outputs, taken before any pass runs."""

    dtypes: tuple
    shapes: tuple

    @classmethod
    def of(cls, graph) -> OutputSignature:
        outputs = list(getattr(graph, "outputs", []))
        return cls(tuple(t.dtype for t in outputs), tuple(t.shape for t in outputs))


def _dims(shape: tf.TensorShape):
    return None if shape.rank is None else shape.as_list()


def verify(graph, expected: OutputSignature | None = None) -> None:
    """Raise :class:`VerificationError` if ``graph`` breaks an invariant (see module docstring)."""
    ops = graph_query.live_ops(graph)
    for op in ops:
        for t in op.inputs:
            if t.graph is not graph:
                raise VerificationError(f"`{op.name}` reads `{t.name}` from another graph")
    graph_query.topological_order(graph, ops)
    if expected is not None:
        actual = OutputSignature.of(graph)
        if len(actual.dtypes) != len(expected.dtypes):
            raise VerificationError(
                f"graph has {len(actual.dtypes)} outputs, expected {len(expected.dtypes)}")
        for i, (d0, d1, s0, s1) in enumerate(zip(expected.dtypes, actual.dtypes, expected.shapes,
                                                  actual.shapes)):
            if d0 != d1:
                raise VerificationError(f"output {i} changed dtype: {d0.name} -> {d1.name}")
            if _dims(s0) != _dims(s1):
                raise VerificationError(f"output {i} changed shape: {s0} -> {s1}")
    # A function with inputs of sizes known only at run time gets loops sized by them: their ops'
    # dimensions may be unknown too, but never their rank.
    dynamic = any(not t.shape.is_fully_defined() for t in getattr(graph, "inputs", ())
                  if t.dtype not in (tf.resource, tf.variant))
    for op in ops:
        if not is_generated(op):
            continue
        for t in op.outputs:
            if t.dtype in (tf.resource, tf.variant) or reserve_space(t):
                continue  # (a fused batch norm's reserve space has no static shape, as TF makes it)
            if t.dtype.is_integer and t.shape.rank is not None and t.shape.rank <= 1:
                continue  # shape arithmetic
            if dynamic and (t.shape.rank is not None or _made_by_a_gradient_function(op)):
                continue
            if not t.shape.is_fully_defined():
                raise VerificationError(f"generated op `{op.name}` has unknown static shape {t.shape}")


def _made_by_a_gradient_function(op: tf.Operation) -> bool:
    """Whether ``op`` was made by a registered gradient function (``tf.gradients`` names the scope of
    op ``x``'s gradient ``x_grad``)."""
    return any(part.endswith("_grad") for part in op.name.split("/")[:-1])
