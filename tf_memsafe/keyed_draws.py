"""Programs compiled to be measured draw from none of XLA's generators.

XLA seeds the stateful random draws TensorFlow lowers to its ``rng`` instruction (``RandomUniform``,
``RandomStandardNormal``, ``TruncatedNormal``, ``RandomUniformInt``, ``Multinomial``,
``ParameterizedTruncatedNormal``) when it compiles them, from one generator of the process (XLA's
``RngExpander`` takes a value from it for each one; TensorFlow warns that XLA ignores their seeds).
A program compiled only to be measured takes values from it too, so every program compiled after
it -- the user's own, even one left exactly as written -- draws other numbers than it would have
without tf_memsafe.  Measured on TF 2.21: a ``jit_compile`` function drawing ``tf.random.uniform``
gives the same numbers in every process, and others once another program with a stateful draw has
been compiled to ``optimized_hlo`` first; a tf_keras model with ``Dropout``, seeded with
``keras.utils.set_random_seed``, trained to a first-epoch loss of 0.488 as written and of 0.450
once its step had been measured (left as written, as it could not be split).

So a program is measured as a copy whose stateful draws are the stateless ops of the same
distributions, keyed by constants: the same shapes and types, the same buffers by XLA's figure
(``tests/tf_memsafe/test_keyed_draws.py`` compares them), none of the process's generator.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, types_pb2

__all__ = ["STATEFUL_DRAWS", "draws_from_xla_generator", "keyed"]


@dataclasses.dataclass(frozen=True)
class _Stateless:
    """The stateless op drawing what a stateful one draws: its type, where its key goes among the
    inputs (after ``key_at`` of the stateful op's), the attributes renamed, and whether it is keyed
    the ``V2`` way (key, counter and algorithm) or by a seed."""

    op: str
    key_at: int
    renamed: tuple[tuple[str, str], ...] = ()
    v2: bool = False


# The ``V2`` ops with ThreeFry wherever there is one: the only stateless form XLA:CPU compiles to the
# buffers of the stateful draw's (measured on TF 2.21, a [1000, 1000] draw scaled: 4,000,020 B
# stateful; 4,000,004 B with ThreeFry; 8,000,004 B with Philox, the automatic choice, or the ``V1``
# ops, which hold the draw's bits beside it).
_THREEFRY = 2

STATEFUL_DRAWS: dict[str, _Stateless] = {
    "RandomUniform": _Stateless("StatelessRandomUniformV2", 1, (("T", "Tshape"),), v2=True),
    "RandomStandardNormal": _Stateless("StatelessRandomNormalV2", 1, (("T", "Tshape"),), v2=True),
    "TruncatedNormal": _Stateless("StatelessTruncatedNormalV2", 1, (("T", "Tshape"),), v2=True),
    "RandomUniformInt": _Stateless("StatelessRandomUniformIntV2", 1, (("Tout", "dtype"), ("T", "Tshape")), v2=True),
    "Multinomial": _Stateless("StatelessMultinomial", 2),
    "ParameterizedTruncatedNormal": _Stateless("StatelessParameterizedTruncatedNormal", 1, (("T", "S"),)),
}

_KEY_SUFFIX = "/tf_memsafe_measured_"


def _nodes(definition: graph_pb2.GraphDef):
    """Every node list of ``definition``: its own, then each function's of its library."""
    yield definition.node, False
    for function in definition.library.function:
        yield function.node_def, True


def draws_from_xla_generator(definition: graph_pb2.GraphDef) -> bool:
    """Whether compiling ``definition`` takes values from XLA's generator: a stateful draw in it or
    in a function of its library."""
    return any(node.op in STATEFUL_DRAWS for nodes, _ in _nodes(definition) for node in nodes)


def _constant(name: str, device: str, values: list[int], dtype: tf.DType) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
    node.attr["dtype"].type = dtype.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values, dtype=dtype))
    return node


def _keys(stateless: _Stateless, index: int) -> list[tuple[str, list[int], tf.DType]]:
    """The constants keying the ``index``-th draw made ``stateless``: (name suffix, values, type), in input order."""
    if stateless.v2:
        return [("key", [index], tf.uint64), ("counter", [0, 0], tf.uint64), ("alg", _THREEFRY, tf.int32)]
    return [("seed", [0, index], tf.int32)]     # (XLA registers them for int32 seeds)


def _keyed_node(node: node_def_pb2.NodeDef, key_inputs: list[str]) -> None:
    """``node`` (a stateful draw) made the stateless op of its distribution, keyed by ``key_inputs``."""
    stateless = STATEFUL_DRAWS[node.op]
    node.op = stateless.op
    for old, new in stateless.renamed:
        node.attr[new].CopyFrom(node.attr[old])
        del node.attr[old]
    for name in ("seed", "seed2"):
        node.attr.pop(name, None)
    if not stateless.v2:
        node.attr["Tseed"].CopyFrom(attr_value_pb2.AttrValue(type=types_pb2.DT_INT32))
    for i, key_input in enumerate(key_inputs):
        node.input.insert(stateless.key_at + i, key_input)


def keyed(definition: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """``definition`` with each stateful draw (:data:`STATEFUL_DRAWS`), in it or in its library's
    functions, made the stateless op of the same distribution keyed by constants of its own; the
    same definition where there is none."""
    if not draws_from_xla_generator(definition):
        return definition
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(definition)
    index = 0
    for nodes, in_function in _nodes(copy):
        names = {node.name for node in nodes}
        added = []
        for node in nodes:
            if node.op not in STATEFUL_DRAWS:
                continue
            index += 1
            inputs = []
            for suffix, values, dtype in _keys(STATEFUL_DRAWS[node.op], index):
                name = node.name + _KEY_SUFFIX + suffix
                while name in names:
                    name += "_"
                names.add(name)
                added.append(_constant(name, node.device, values, dtype))
                # A function's nodes name an output by its argument (``key:output:0``), a graph's by index.
                inputs.append(f"{name}:output:0" if in_function else name)
            _keyed_node(node, inputs)
        nodes.extend(added)
    return copy
