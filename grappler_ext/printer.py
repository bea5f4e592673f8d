"""Golden-text printer for small TensorFlow graphs, in the style of JAX's printed jaxprs.

``format_graph(g)`` prints one line per op, in topological order, with canonical names::

    %0 = Placeholder f64[500,3] ()
    %1 = Placeholder f64[20000,3] ()
    %2 = MatMul{transpose_b=true} f64[500,20000] (%0, %1)
    %3 = Identity f64[500,20000] (%2)
    return %3

- Names: ops are numbered ``%0, %1, ...`` in printed order; output 0 of op ``%3`` is ``%3``,
  output ``i > 0`` is ``%3.i``.  Op names never appear, so the text does not depend on TF's
  name counters.
- Order: the graph's input placeholders in the order of ``graph.inputs``, then a topological sort
  (Kahn's algorithm over data and control edges) that breaks ties by creation order.  Creation
  order alone is not topological: passes rewire inputs with ``op._update_input``, and TF's own
  FuncGraph creates the output ``Identity`` ops before the ``NoOp`` they depend on.
- A line is ``%k = Type{attrs} result (data inputs; ^control inputs)``.  The result is
  ``f32[?,3]`` for one output (``[]`` a scalar, ``?`` an unknown dimension, ``[*]`` an unknown
  rank), ``(f32[10,5], i32[10,5])`` for several, ``()`` for none.
- Attributes are sorted by name and comma-separated without spaces.  Left out: names starting
  with ``_``; type, shape and tensor attributes (the result shows dtype and shape); attributes
  equal to their OpDef default (so ``MatMul{transpose_b=true}``, not all four flags); empty
  strings.  Function attributes print as ``@fn`` (function names carry counters), opaque binary
  strings (serialized protos such as ``config_proto``) as ``<bytes>``.
- ``Const`` lines drop the empty ``()`` and, for at most 8 elements, end with the value:
  ``%1 = Const i32[2] = [0, 1]``; a Const with a control input reads ``Const f32[] (; ^%4) = 2.0``.
- The last line is ``return %5, %6; ^%7`` (outputs; control outputs) for a FuncGraph; a plain
  ``tf.Graph`` has no outputs and no return line.

Only live ops are printed by default: those reachable backwards over data and control edges from
``graph.outputs`` and ``graph.control_outputs``.  Passes leave unreachable ops behind, which TF and
XLA prune; ``include_dead=True`` (and ``graph_fingerprint``) prints every op.

``assert_graph_text`` compares whitespace-insensitively and, on mismatch, raises with the whole
actual text (to paste into the test) and a unified diff.
"""

from __future__ import annotations

import difflib
import json

import numpy as np
import tensorflow as tf

from grappler_ext.graph_query import live_ops, topological_order

__all__ = ["assert_graph_text", "canonical_lines", "format_graph", "graph_fingerprint"]

# Consts with at most this many elements print their value.
MAX_CONST_ELEMENTS = 8
# Strings longer than this are cut, so one attribute cannot swamp a line.
MAX_STRING_CHARS = 64

_DTYPE_SHORT = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "bool",
    "complex64": "c64",
    "complex128": "c128",
    "string": "str",
    "resource": "resource",
    "variant": "variant",
}

# OpDef attr types that the result type already shows, or that are too big to print.
_SKIPPED_ATTR_TYPES = frozenset({"type", "list(type)", "shape", "list(shape)", "tensor", "list(tensor)"})


def format_graph(graph: tf.Graph, *, include_dead: bool = False) -> str:
    """Returns the graph as text, one op a line in topological order (see the module docstring).

    Raises ValueError if the data and control edges among the printed ops form a cycle.
    """
    ops = _ordered_ops(graph, include_dead=include_dead)
    number = {op.name: k for k, op in enumerate(ops)}
    lines = [_format_op(op, k, number) for k, op in enumerate(ops)]
    outputs = getattr(graph, "outputs", None)
    if outputs is not None:
        data = ", ".join(_ref(t, number) for t in outputs if t is not None)
        control = _control_refs(getattr(graph, "control_outputs", []), number)
        lines.append("return" + (" " + data if data else "") + ("; " + control if control else ""))
    return "\n".join(lines) + "\n"


def canonical_lines(text: str) -> list[str]:
    """Whitespace-insensitive normal form: lines stripped, inner runs of whitespace made one space,
    empty lines dropped."""
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def assert_graph_text(graph: tf.Graph, expected: str, **format_kwargs) -> None:
    """Asserts that ``format_graph(graph, **format_kwargs)`` equals ``expected`` up to whitespace.

    On mismatch the AssertionError carries the full actual text and a unified diff.
    """
    actual_text = format_graph(graph, **format_kwargs)
    actual = canonical_lines(actual_text)
    wanted = canonical_lines(expected)
    if actual == wanted:
        return
    diff = "\n".join(difflib.unified_diff(wanted, actual, "expected", "actual", lineterm=""))
    raise AssertionError(f"graph text differs.\n\nActual graph text:\n{actual_text}\nDiff:\n{diff}")


def graph_fingerprint(graph: tf.Graph) -> str:
    """Text of every op, dead ones included: equal fingerprints mean an unchanged graph."""
    return format_graph(graph, include_dead=True)


# --- order -----------------------------------------------------------------------------------


def _ordered_ops(graph: tf.Graph, *, include_dead: bool) -> list[tf.Operation]:
    """Input placeholders in ``graph.inputs`` order, then a topological order, ties by creation order."""
    if include_dead or getattr(graph, "outputs", None) is None:
        ops = set(graph.get_operations())
    else:
        ops = live_ops(graph)
    return topological_order(graph, ops, first=[t.op for t in getattr(graph, "inputs", [])])


# --- one line --------------------------------------------------------------------------------


def _op_ref(op: tf.Operation, number: dict[str, int]) -> str:
    return f"%{number[op.name]}"


def _control_refs(ops, number: dict[str, int]) -> str:
    """``^%2, ^%7`` sorted by number: TF fills control inputs and control outputs from sets, so
    their stored order changes from one process to the next."""
    return ", ".join(f"^%{k}" for k in sorted({number[op.name] for op in ops}))


def _ref(tensor: tf.Tensor, number: dict[str, int]) -> str:
    base = _op_ref(tensor.op, number)
    return base if tensor.value_index == 0 else f"{base}.{tensor.value_index}"


def _format_type(tensor: tf.Tensor) -> str:
    dtype = tensor.dtype
    name = _DTYPE_SHORT.get(dtype.name, dtype.name)
    shape = tensor.shape
    if shape.rank is None:
        return f"{name}[*]"
    dims = ",".join("?" if d is None else str(d) for d in shape.as_list())
    return f"{name}[{dims}]"


def _format_op(op: tf.Operation, k: int, number: dict[str, int]) -> str:
    outputs = op.outputs
    if len(outputs) == 1:
        result = _format_type(outputs[0])
    else:
        result = "(" + ", ".join(_format_type(t) for t in outputs) + ")"
    attrs = _format_attrs(op)
    data = ", ".join(_ref(t, number) for t in op.inputs)
    control = _control_refs(op.control_inputs, number)
    args = data + ("; " + control if control else "")
    line = f"%{k} = {op.type}{'{' + attrs + '}' if attrs else ''} {result}"
    if op.type != "Const" or args:
        line += f" ({args})"
    if op.type == "Const":
        value = _const_value(op)
        if value is not None:
            line += f" = {value}"
    return line


def _const_value(op: tf.Operation) -> str | None:
    try:
        array = tf.make_ndarray(op.get_attr("value"))
    except (KeyError, TypeError, ValueError):  # a dtype numpy cannot hold (variant): no value
        return None
    if array.size > MAX_CONST_ELEMENTS:
        return None
    return _format_array(array)


def _format_array(array: np.ndarray) -> str:
    """Nested lists like ``tolist()``, but each element in numpy's shortest form for its dtype
    (float32 0.1 prints ``0.1``, not the float64 expansion)."""
    if array.ndim == 0:
        return str(array[()])
    if array.ndim == 1:  # elements, not rows: a string array yields bytes, not 0-d arrays
        return "[" + ", ".join(str(x) for x in array) + "]"
    return "[" + ", ".join(_format_array(row) for row in array) + "]"


# --- attributes ------------------------------------------------------------------------------


def _format_attrs(op: tf.Operation) -> str:
    try:
        declared = {a.name: a for a in op.op_def.attr}
    except (ValueError, tf.errors.OpError):  # no OpDef found: judge attrs by their values alone
        declared = {}
    parts = []
    for name, value in sorted(op.node_def.attr.items()):
        if name.startswith("_"):
            continue
        spec = declared.get(name)
        if spec is not None and (
            spec.type in _SKIPPED_ATTR_TYPES
            or (spec.HasField("default_value") and value == spec.default_value)
        ):
            continue
        text = _format_attr_value(value)
        if text:
            parts.append(f"{name}={text}")
    return ",".join(parts)


def _format_attr_value(value) -> str | None:
    """Text for one AttrValue, or None for the kinds left out (type, shape, tensor)."""
    kind = value.WhichOneof("value")
    if kind == "b":
        return "true" if value.b else "false"
    if kind == "i":
        return str(value.i)
    if kind == "f":
        return format(value.f, "g")
    if kind == "s":
        return _format_string(value.s)
    if kind == "func":
        return "@fn"
    if kind == "placeholder":
        return "$" + value.placeholder
    if kind == "list":
        lst = value.list
        if lst.type or lst.shape or lst.tensor:
            return None
        items = (
            [str(i) for i in lst.i]
            + [format(f, "g") for f in lst.f]
            + ["true" if b else "false" for b in lst.b]
            + [_format_string(s) or '""' for s in lst.s]
            + ["@fn" for _ in lst.func]
        )
        return "[" + ",".join(items) + "]"
    return None  # type, shape, tensor, or unset


def _format_string(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "<bytes>"
    if not text.isprintable():
        return "<bytes>"  # a serialized proto (config_proto): opaque; it records device counts
    if len(text) > MAX_STRING_CHARS:
        text = text[: MAX_STRING_CHARS - 3] + "..."
    if "," in text or " " in text or '"' in text:
        return json.dumps(text)
    return text
