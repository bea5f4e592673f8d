"""A digest of a traced program that names do not change.

Two traces of the same Python function differ in names only: a function's uid (``__inference_step_123``,
``while_body_45``), a Keras layer's counter (``dense_3``), an argument's user-specified name.  XLA compiles
neither, so a program traced again, a loop built alike for another layer, or a region planned again
has the same digest (:func:`program_fingerprint`).  ``tf_memsafe.memory`` keys XLA's figures by it; the
splitter keys what a run of its search decided by it (:mod:`grappler_ext.splitter.search_budget`), so
that a program traced again is planned as it was the first time.
"""

from __future__ import annotations

import hashlib

from tensorflow.core.framework import graph_pb2

__all__ = ["called_functions", "graph_fingerprint", "program_fingerprint"]


def called_functions(nodes, library: dict) -> list[str]:
    """The names of the functions of ``library`` that ``nodes`` call, directly or through other
    functions (loop bodies, branches), in the order they are first referred to (each node's
    attributes by name)."""
    called: dict[str, None] = {}

    def visit(nodes) -> None:
        for node in nodes:
            for key in sorted(node.attr):
                value = node.attr[key]
                for name in [value.func.name] + [f.name for f in value.list.func]:
                    if name in library and name not in called:
                        called[name] = None
                        visit(library[name].node_def)

    visit(nodes)
    return list(called)


def _renamed_inputs(inputs, names: dict[str, str]) -> list[str]:
    """``inputs`` (``name``, ``name:1``, ``^name``, in a function ``name:output:0``) with each node's
    name replaced by its new one; an argument of a function (not in ``names``) is kept."""
    out = []
    for text in inputs:
        control = text.startswith("^")
        name, sep, rest = text[control:].partition(":")
        out.append(("^" if control else "") + names.get(name, name) + sep + rest)
    return out


_NAME_ATTRS = ("_gradient_op_type", "_user_specified_name")   # a custom gradient's number, an argument's name


def _nodes_renamed(nodes, names: dict[str, str], functions: dict[str, str]) -> None:
    """``nodes`` (a ``GraphDef``'s or a ``FunctionDef``'s) renamed in place by ``names``, the
    functions they call by ``functions``; what holds the old names besides (colocation, debug info)
    renamed or cleared."""
    for node in nodes:
        node.name = names[node.name]
        for value in node.attr.values():
            if value.func.name in functions:
                value.func.name = functions[value.func.name]
            for called in value.list.func:
                called.name = functions.get(called.name, called.name)
        renamed = _renamed_inputs(node.input, names)
        del node.input[:]
        node.input.extend(renamed)
        node.ClearField("experimental_debug_info")          # (the original names)
        for key in _NAME_ATTRS:                               # names and numbers, not compiled
            if key in node.attr:
                del node.attr[key]
        if "_class" in node.attr:                             # colocation: loc:@name
            located = [b"loc:@" + names.get(v[5:].decode(), v[5:].decode()).encode() if v.startswith(b"loc:@")
                       else v for v in node.attr["_class"].list.s]
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(located)


def _canonical(graph_def: graph_pb2.GraphDef) -> bytes:
    """``graph_def`` and the functions it calls serialized with every node renamed by its place in
    its graph or function (``n0``, ``n1``, ...), every function by the order the graph first refers
    to it (``fn0``, ...; TensorFlow keeps the library sorted by name, numbers included), and each
    function's arguments and results by their place: names do not change the bytes."""
    library = {f.signature.name: f for f in graph_def.library.function}
    functions = {name: f"fn{i}" for i, name in enumerate(called_functions(graph_def.node, library))}
    main = graph_pb2.GraphDef()
    main.CopyFrom(graph_def)
    main.ClearField("library")
    _nodes_renamed(main.node, {node.name: f"n{i}" for i, node in enumerate(main.node)}, functions)
    data = [main.SerializeToString(deterministic=True)]
    for name in functions:
        function = type(library[name])()
        function.CopyFrom(library[name])
        function.signature.name = functions[name]
        # (a loop body's arguments are named after the loop: ``encoder_1_while_placeholder``)
        names = {arg.name: f"a{i}" for i, arg in enumerate(function.signature.input_arg)}
        names.update({node.name: f"n{i}" for i, node in enumerate(function.node_def)})
        for i, arg in enumerate(function.signature.input_arg):
            arg.name = f"a{i}"
        for attrs in function.arg_attr.values():
            for key in _NAME_ATTRS:
                if key in attrs.attr:
                    del attrs.attr[key]
        _nodes_renamed(function.node_def, names, functions)
        for results, args, prefix in ((function.ret, function.signature.output_arg, "r"),
                                      (function.control_ret, None, "c")):
            renamed = {key: _renamed_inputs([value], names)[0] for key, value in results.items()}
            keys = {key: f"{prefix}{i}" for i, key in enumerate(
                [a.name for a in args] if args is not None else sorted(renamed))}
            results.clear()
            for key, value in renamed.items():
                results[keys.get(key, key)] = value
        for i, arg in enumerate(function.signature.output_arg):
            arg.name = f"r{i}"
        control = list(function.signature.control_output)
        del function.signature.control_output[:]
        function.signature.control_output.extend(f"c{i}" for i in range(len(control)))
        data.append(function.SerializeToString(deterministic=True))
    return b"".join(data)


def program_fingerprint(graph_def: graph_pb2.GraphDef) -> str:
    """A digest of a traced program that names do not change (:func:`_canonical`), so that two loops
    built alike (a model's identical layers, whose ops and loop bodies are named after each layer; a
    region planned again) have the same fingerprint.  Names never change what XLA compiles: only its
    instructions' names and metadata."""
    return hashlib.sha256(_canonical(graph_def)).hexdigest()


def graph_fingerprint(graph) -> str:
    """:func:`program_fingerprint` of ``graph`` (a ``tf.Graph``) as it stands, every op included (dead
    ones too), with each op's output shapes: a variable's shape, which a ``GraphDef`` does not hold
    otherwise, changes it."""
    return program_fingerprint(graph.as_graph_def(add_shapes=True))
