"""Editing a traced graph in place, with every change journaled so it can be undone.

A TensorFlow graph cannot drop ops, but it can rewire an op's input (``Operation._update_input``)
and a ``FuncGraph`` can change its outputs.  A pass therefore

1. analyses and plans without touching anything,
2. builds its new ops inside :func:`building` (they are unreachable, so inert, until wired in),
3. wires them in with :func:`replace_uses`, which checks dtype, shape and acyclicity of every
   change *before* the first mutation.

Every mutation goes to the thread's active :class:`Journal` (the pipeline opens one per run), so a
failure anywhere later undoes the run exactly; a pass can also undo its own edits back to a mark
(the splitter plans again when XLA's figure of its first plan is over the limit), and state kept
beside the graph (the gradients recorded inside a function) registers its own undo with
:func:`on_undo`.  Ops built and then abandoned stay in the graph but
are unreachable from its outputs; TensorFlow's function runtime and XLA prune them (measured:
a dead [4000, 4000] matmul adds nothing to XLA's "Total bytes used"), and
:func:`grappler_ext.printer.format_graph` hides them by default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

import tensorflow as tf
from tensorflow.python.ops import handle_data_util

from grappler_ext import graph_query

__all__ = [
    "GENERATED_SCOPE", "Journal", "journaled", "active_journal", "some_journal", "on_undo", "building", "replace_uses",
    "rewire_input", "set_output", "consumers", "EditError", "is_generated", "clone_op", "OpCopy", "snapshot",
    "copy_ops",
]

GENERATED_SCOPE = "tf_memsafe"  # Name scope of every op tf_memsafe builds: marks what we generated.


def is_generated(op_or_name) -> bool:
    """Whether an op (or an op's name) was built by tf_memsafe, under :data:`GENERATED_SCOPE`."""
    name = op_or_name if isinstance(op_or_name, str) else op_or_name.name
    return name.startswith(GENERATED_SCOPE + "/")


class EditError(ValueError):
    """A requested edit is invalid (dtype or shape mismatch, or it would create a cycle)."""


@dataclasses.dataclass
class _InputEdit:
    op: tf.Operation
    index: int
    old: tf.Tensor


@dataclasses.dataclass
class _OutputEdit:
    graph: object
    index: int
    old: tf.Tensor
    old_structured: object


@dataclasses.dataclass
class _CallbackEdit:
    undo: Callable[[], None]


class Journal:
    """The mutations made to graphs in one pipeline run, in order; :meth:`undo` reverts them."""

    def __init__(self):
        self._edits: list = []
        self._version = 0

    def __len__(self) -> int:
        return len(self._edits)

    @property
    def version(self) -> int:
        """A count of every edit recorded and undone: equal versions, the same graph (a length is not:
        edits undone and others made leave it as it was)."""
        return self._version

    def record(self, edit) -> None:
        self._edits.append(edit)
        self._version += 1

    def undo(self, to: int = 0) -> None:
        """Revert the recorded edits, newest first, until ``to`` of them are left (a ``len()`` taken
        earlier: the edits made since; by default all)."""
        while len(self._edits) > to:
            edit = self._edits.pop()
            self._version += 1
            if isinstance(edit, _InputEdit):
                edit.op._update_input(edit.index, edit.old)  # noqa: SLF001 - the one rewiring API
            elif isinstance(edit, _CallbackEdit):
                edit.undo()
            else:
                edit.graph.outputs[edit.index] = edit.old
                edit.graph.structured_outputs = edit.old_structured


_local = threading.local()


@contextlib.contextmanager
def journaled(journal: Journal) -> Iterator[Journal]:
    """Send this thread's edits to ``journal`` for the duration of the block."""
    previous = getattr(_local, "journal", None)
    _local.journal = journal
    try:
        yield journal
    finally:
        _local.journal = previous


def active_journal() -> Journal | None:
    """The journal this thread's edits go to, if any."""
    return getattr(_local, "journal", None)


@contextlib.contextmanager
def some_journal() -> Iterator[Journal]:
    """The journal this thread's edits go to, or, where none is (a pass run outside a pipeline), one of
    the block's own, so that its edits can be undone."""
    journal = active_journal()
    if journal is not None:
        yield journal
        return
    with journaled(Journal()) as own:
        yield own


def _record(edit) -> None:
    journal = active_journal()
    if journal is not None:
        journal.record(edit)


def on_undo(undo: Callable[[], None]) -> None:
    """Journal a change made beside the graph: ``undo()`` reverts it when the journal is undone."""
    _record(_CallbackEdit(undo))


@contextlib.contextmanager
def building(graph, scope: str) -> Iterator[None]:
    """Build new ops in ``graph`` under the name scope ``tf_memsafe/<scope>``."""
    with graph.as_default(), tf.name_scope(f"{GENERATED_SCOPE}/{scope}/"):
        yield


def clone_op(op: tf.Operation, new_inputs, attrs: dict | None = None) -> list[tf.Tensor]:
    """Re-create ``op`` (same type and attributes, no control inputs) on ``new_inputs`` in the
    current default graph, and return its outputs; ``attrs``: ``AttrValue``s that replace the
    original's.  Shape inference runs on the new inputs, and a ``FuncGraph`` captures inputs from
    outer graphs."""
    # Private attributes (colocation, XLA scopes, ...) belong to the original node, not to a copy.
    values = {name: value for name, value in op.node_def.attr.items() if not name.startswith("_")}
    values.update(attrs or {})
    new_op = tf.compat.v1.get_default_graph()._create_op_internal(  # noqa: SLF001 - runs shape inference
        op.type, list(new_inputs), dtypes=[t.dtype for t in op.outputs], attrs=values,
        name=op.name.rsplit("/", 1)[-1])
    return list(new_op.outputs)


@dataclasses.dataclass(frozen=True)
class OpCopy:
    """An op as it was when :func:`snapshot` took it: what it read then (a later edit may rewire it)."""

    op: tf.Operation
    inputs: tuple
    control_inputs: tuple


def snapshot(ops: Sequence[tf.Operation]) -> list[OpCopy]:
    """``ops`` with what each reads now, to be copied later (:func:`copy_ops`)."""
    return [OpCopy(op, tuple(op.inputs), tuple(op.control_inputs)) for op in ops]


def copy_ops(ops: Sequence[OpCopy], mapping: dict) -> dict:
    """Copies of the ops of a :func:`snapshot` (each after the ops it reads: their creation order) in
    the default graph, each reading what its original read when the snapshot was taken, through
    ``mapping`` (``t.ref()`` -> the tensor to read instead), the copies of the snapshot's ops in
    place of their outputs.  ``mapping`` is returned, with each original output's copy added.

    A copy is the op again: its type, every attribute (colocation aside: it names the original's
    neighbours) and its control inputs (mapped alike); its outputs keep the original's static
    shapes and, for handles (a loop's tensor lists), the shapes of what they hold.  A loop or a
    conditional is copied by reference to the same body functions, so a copy costs an op, not a
    trace.  What the originals read is taken from the snapshot, not from the ops now: a later edit
    (a gradient's old result replaced by a new one everywhere) may have rewired them."""
    graph = tf.compat.v1.get_default_graph()
    copied: dict = {}                       # an original op -> its copy (for control inputs)
    for taken in ops:
        op = taken.op
        inputs = [mapping.get(t.ref(), t) for t in taken.inputs]
        control = [copied.get(c, c) for c in taken.control_inputs]
        attrs = {name: value for name, value in op.node_def.attr.items() if name != "_class"}
        with tf.control_dependencies(control):
            new_op = graph._create_op_internal(  # noqa: SLF001 - runs shape inference
                op.type, inputs, dtypes=[t.dtype for t in op.outputs], attrs=attrs,
                name=op.name.rsplit("/", 1)[-1])
        copied[op] = new_op
        for old, new in zip(op.outputs, new_op.outputs):
            new.set_shape(old.shape)
            if old.dtype in (tf.resource, tf.variant):
                handle_data_util.copy_handle_data(old, new)
            mapping[old.ref()] = new
    return mapping


def consumers(tensor: tf.Tensor) -> list[tuple[tf.Operation, int]]:
    """Every ``(op, input_index)`` that reads ``tensor``."""
    out = []
    for op in tensor.consumers():
        out.extend((op, i) for i, t in enumerate(op.inputs) if t is tensor)
    return out


def _check_compatible(old: tf.Tensor, new: tf.Tensor) -> None:
    if old.dtype != new.dtype:
        raise EditError(f"cannot replace `{old.name}` ({old.dtype.name}) by `{new.name}` ({new.dtype.name})")
    # Every static dimension known for ``old`` must be known, and equal, for ``new``: readers were
    # traced against those shapes.
    old_dims = None if old.shape.rank is None else old.shape.as_list()
    new_dims = None if new.shape.rank is None else new.shape.as_list()
    if old_dims is not None and (
        new_dims is None or len(new_dims) != len(old_dims)
        or any(a is not None and a != b for a, b in zip(old_dims, new_dims))
    ):
        raise EditError(f"cannot replace `{old.name}` {old.shape} by `{new.name}` {new.shape}: "
                        "the replacement must have the same static shape")


def rewire_input(op: tf.Operation, index: int, new: tf.Tensor) -> None:
    """Make input ``index`` of ``op`` read ``new`` (journaled)."""
    old = op.inputs[index]
    _check_compatible(old, new)
    _record(_InputEdit(op, index, old))
    op._update_input(index, new)  # noqa: SLF001


def set_output(graph, index: int, new: tf.Tensor) -> None:
    """Make output ``index`` of a FuncGraph ``new`` (journaled), in ``outputs`` and ``structured_outputs``."""
    old = graph.outputs[index]
    _check_compatible(old, new)
    old_structured = graph.structured_outputs
    graph.structured_outputs = tf.nest.map_structure(
        lambda t: new if t is old else t, old_structured)
    graph.outputs[index] = new
    _record(_OutputEdit(graph, index, old, old_structured))


def replace_uses(old: tf.Tensor, new: tf.Tensor, *, graph=None, include_outputs: bool = True,
                 upstream: set | None = None) -> int:
    """Make every reader of ``old`` read ``new`` instead; return how many edges moved.

    Readers that ``new`` itself depends on (typically the ops that compute ``new`` from ``old``)
    keep reading ``old``: rewiring them would make a cycle.  All checks run before any change.
    ``upstream``: ``new``'s ancestors, or a superset of them that no edit since has grown (the
    ancestors of several new tensors, computed once for all of them: rewiring readers that are
    not among them changes no ancestor of theirs).
    """
    if new is old:
        return 0
    _check_compatible(old, new)
    upstream = graph_query.ancestors([new]) if upstream is None else upstream
    edges = [(op, i) for op, i in consumers(old) if op not in upstream]
    graph = graph if graph is not None else old.graph
    output_slots = []
    if include_outputs and hasattr(graph, "outputs"):
        output_slots = [i for i, t in enumerate(graph.outputs) if t is old]
    for op, i in edges:
        _record(_InputEdit(op, i, old))
        op._update_input(i, new)  # noqa: SLF001
    for i in output_slots:
        set_output(graph, i, new)
    return len(edges) + len(output_slots)
