"""Static shapes as the analyses read them, with a nominal size for dimensions known only at run time.

A ``tf.function`` traced with ``input_signature=[tf.TensorSpec([None, 3])]`` (or generalised by
``reduce_retracing``, or by Keras' ``fit`` on a ``tf.data`` pipeline whose last batch is short) has
tensors whose first dimension is unknown until XLA compiles the function for a concrete input
(TensorFlow's XLA bridge compiles once per input shape).  The memory model and the splitter's
planning need sizes; the loops the splitter builds do not (they take their trip count from
``tf.shape`` at run time).  So planning reads shapes through this module, under :func:`nominal`:

    with shapes.nominal(4096):
        shapes.dims(x)          # [4096, 3] for x of shape [?, 3]
        shapes.nbytes(x)        # 4096 * 3 * 4

A program with several such dimensions (a padded batch: its size and its length) is read better
with a :class:`Symbols` table (:func:`symbols`): each tensor's dimensions as products of the
function's run-time sizes, found by TensorFlow's own shape inference on the graph with those
sizes set to distinct primes.  Under ``nominal(size, table, values)`` a tensor the table knows
has its dimensions evaluated at ``values`` (a batch at 8, a length at ``size``); the others, and
every tensor without a table, read ``size``:

    table = shapes.symbols(graph, inputs)       # inputs: the function's, with unknown dimensions
    with shapes.nominal(2048, table, {0: 8}):
        shapes.dims(scores)     # [8, 4, 2048, 2048] for scores of shape [?, 4, ?, ?]

Outside :func:`nominal` these are the static shapes as they are.  A tensor of unknown rank is read
through the table where the inference on its copy found its rank (a gradient's sum over the axes a
``BroadcastGradientArgs`` of run-time shapes gives: Keras 3's ``Dense`` on a batch of unknown size);
otherwise it has no dimensions to read.
The setting is per thread and per context (``contextvars``): two threads tracing at once each
plan with their own.  The mechanism (what is built into a graph) never reads the nominal size:
it reads ``t.shape`` itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

__all__ = ["Symbols", "symbols", "nominal", "same_as", "monomials", "symbolic", "nominal_size", "nominal_key",
           "known_shape", "exact_dims", "is_symbolic", "exact_monomial", "describe_exact", "dims", "is_static",
           "num_elements", "nbytes", "dynamic_axes", "concrete_spec", "resolve", "declare_stacked", "copied",
           "shaped_as", "read_once", "sizes_as_constants"]

# A dimension as the table reads it: ``(coefficient, ((symbol, power), ...))``, or ``None`` (not a
# product of the run-time sizes: L - 1, or unknown to the inference).
Monomial = tuple[int, tuple[tuple[int, int], ...]]
# symbol k is read as _PRIMES[k], then as _CHECK[k]: small enough that products of two, times a
# layer's width, stay within the int32 shape arithmetic TensorFlow's inference evaluates (B * L for a
# reshape); a dimension read as the same monomial both times is one (L - 1 is not, nor is a static 1024)
_PRIMES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061, 1063, 1069, 1087, 1091, 1093, 1097)
_CHECK = (1103, 1109, 1117, 1123, 1129, 1151, 1153, 1163, 1171, 1181, 1187, 1193, 1201, 1213, 1217, 1223)
_SHIFT = 16           # a remainder this near a multiple of a prime: a shifted size
# Exact sizes (:func:`exact_dims`): symbol k read as _EXACT[k], primes far above any static size, so
# that products, divisibility and equality of those ints are those of the monomials they stand for
_EXACT = (1099511627791, 1099511627803, 1099511627831, 1099511627873, 1099511627891, 1099511627917, 1099511627933,
          1099511627953, 1099511628029, 1099511628053, 1099511628079, 1099511628119, 1099511628161, 1099511628191,
          1099511628211, 1099511628221)


@dataclasses.dataclass(eq=False)
class Symbols:
    """Each tensor's dimensions (by name) as monomials of the function's run-time sizes.

    Symbol ``k`` stands for the sizes of ``sources[k]``, ``(input, axis)`` pairs: one pair each
    where the program lets them differ (a kNN's queries and points), or every input's axis ``a``
    where it does not (a batch's features and labels, whose sizes its loss requires equal: the
    shape inference rejects distinct ones); then a symbol's size when the function runs is the
    largest of theirs, an upper bound for each.  Tensors made after the table (a loop's outputs)
    are added by :meth:`same_as`."""

    names: dict[str, tuple[Monomial | None, ...]]
    count: int                                         # symbols 0 .. count - 1
    sources: dict[int, list[tuple[tf.Tensor, int]]] = dataclasses.field(default_factory=dict)
    # (graph's id, symbol or monomial) -> (graph, its run-time value made in that graph): a loop's
    # slices read the same few sizes thousands of times, made once in each graph (body, branch)
    made: dict = dataclasses.field(default_factory=dict, repr=False)
    # The ops of the graph when the table was made (``None``: not known; nothing is resolved then).
    born: frozenset | None = dataclasses.field(default=None, repr=False)
    # (size, values) -> {tensor name: its dimensions at those sizes}, for tensors of ops made after the
    # table (a gradient differentiated again, a loop's stacked slices), by :meth:`resolve`
    resolved: dict = dataclasses.field(default_factory=dict, repr=False)
    examined: dict = dataclasses.field(default_factory=dict, repr=False)   # (size, values) -> op names
    # (size, values) -> {a TensorList's handle as reserved (name): its slices' dimensions once stacked}
    lists: dict = dataclasses.field(default_factory=dict, repr=False)

    def axis(self, k: int) -> int:
        """The input axis symbol ``k`` stands for (0: a batch)."""
        return self.sources[k][0][1]

    def run_size(self, k: int) -> tf.Tensor:
        """Symbol ``k``'s size when the function runs (an int32 scalar XLA resolves when it compiles);
        within :func:`sizes_as_constants`, its nominal size."""
        def make():
            if _CONSTANT.get() is not None:
                size, _, values, _ = _NOMINAL.get()
                return tf.constant(values.get(k, size), tf.int32)
            sizes = [tf.shape(t, out_type=tf.int32)[a] for t, a in self.sources[k]]
            return sizes[0] if len(sizes) == 1 else tf.reduce_max(tf.stack(sizes))

        return self.once(("size", k), make)

    def run_value(self, m: Monomial) -> tf.Tensor:
        """The dimension ``m`` is when the function runs (an int32 scalar XLA resolves)."""
        return self.once(("value", m), lambda: tf.convert_to_tensor(_evaluate(m, self.run_size), tf.int32))

    def once(self, key, make) -> tf.Tensor:
        """``make()`` in the default graph, made there once for ``key`` (not under control edges, which
        another reader would inherit): a value of the run-time sizes read by many ops."""
        graph = tf.compat.v1.get_default_graph()
        if getattr(graph, "_control_dependencies_stack", None):
            return make()
        cache = _CONSTANT.get()          # (a program built alone to be measured keeps its own, dropped after)
        cache = self.made if cache is None else cache
        made = cache.get((id(graph), key))
        if made is None or made[0] is not graph:
            made = cache[(id(graph), key)] = (graph, make())
        return made[1]

    def run_exact(self, size: int):
        """An exact size (:func:`exact_dims`) when the function runs: the int itself where it holds no
        run-time size, else an int32 scalar XLA resolves."""
        return size if not is_symbolic(size) else self.run_value(exact_monomial(size))

    def run_shape(self, t: tf.Tensor, unit_axes=()) -> tf.Tensor | None:
        """``t``'s shape when the function runs (size 1 along ``unit_axes``) as an int32 vector XLA
        resolves, or ``None`` where a dimension is not a product of the run-time sizes."""
        known = self.names.get(t.name)
        if known is None:
            return None
        out = []
        for i, (d, m) in enumerate(zip(_statics(t, known), known)):
            if i in unit_axes or d is not None:
                out.append(tf.constant(1 if i in unit_axes else d, tf.int32))
            elif m is None:
                return None
            else:
                out.append(self.run_value(m))
        return tf.stack(out) if out else tf.zeros([0], tf.int32)

    def same_as(self, new: tf.Tensor, old: tf.Tensor) -> None:
        """``new`` has ``old``'s shape (a loop's output in place of the region's root's)."""
        if old.name in self.names and new.shape.rank in (None, old.shape.rank):
            self.names[new.name] = self.names[old.name]

    def copied(self, pairs) -> None:
        """Each ``(old, new)`` tensor pair: ``new`` a copy of ``old`` (a loop's backward copied rather
        than traced again: :mod:`grappler_ext.splitter.replay`), read as ``old`` is, at every size."""
        for old, new in pairs:
            self.same_as(new, old)
            for table in (*self.resolved.values(), *self.lists.values()):
                if old.name in table:
                    table[new.name] = table[old.name]

    def resolve(self, graph, size: int, values: dict[int, int]) -> int:
        """The dimensions, at ``size`` and ``values`` (as :func:`nominal` reads them), of the tensors of
        the ops made in ``graph`` since the table (or since the last call at those sizes) that have
        dimensions TensorFlow could not infer and the table does not know; how many tensors.

        The splitter's rewrites make such ops as they plan: a gradient differentiated again through a
        loop (a ``SelectV2``'s gradient summed to its input's shape, read from ``tf.shape``), a loop's
        slices stacked over its run-time trip count.  Read at the nominal size in every unknown
        dimension, a [B, H, L, L] gradient of 8 heads counts ``size``**4 elements (terabytes at a
        length of 1,000): so TensorFlow's shape inference is run on a copy of those ops alone, each
        tensor they read from elsewhere a placeholder of its dimensions at these sizes, with the small
        computations of their shapes' values (a reshape's target from ``tf.shape``, a trip count, a
        chunk scaled in float64) copied with them (:func:`_inferred_alone`: a loop's carried values
        keep their shapes); a loop's stacked slices count as its builder declared them
        (:func:`declare_stacked`); a dimension still unknown stays so (read as ``size``)."""
        if self.born is None:
            return 0
        key = _sizes_key(size, values)
        seen = self.examined.setdefault(key, set(self.born))
        fresh = [op for op in graph.get_operations() if op.name not in seen]
        if not fresh:
            return 0
        seen.update(op.name for op in fresh)
        found = self.resolved.setdefault(key, {})

        def unresolved(t: tf.Tensor) -> bool:
            return (not t.shape.is_fully_defined() and t.dtype not in (tf.resource, tf.variant)
                    and t.name not in self.names and t.name not in found)

        def dims_of(t: tf.Tensor) -> list[int | None] | None:
            known = self.names.get(t.name)
            if known is not None:
                return [d if d is not None else _evaluate(m, lambda k: values.get(k, size))
                        for d, m in zip(_statics(t, known), known)]
            return list(found[t.name]) if t.name in found else None if t.shape.rank is None else t.shape.as_list()
        # A loop's slices stacked after it ([steps, .., chunk, ..], both known only at run time), as
        # the loop's builder declared them (:func:`declare_stacked`): what it stacks, its handle, is a
        # loop's output, which TensorFlow's inference does not see through.
        for op in fresh:
            if op.type == "TensorListStack" and key in self.lists:
                declared = self.lists[key].get(_reserved(op.inputs[0]).name)
                if declared is not None and op.outputs[0].shape.rank in (None, len(declared)):
                    found[op.outputs[0].name] = declared

        targets = [op for op in fresh if any(unresolved(t) for t in op.outputs)]
        if not targets:
            return 0
        copy, inferred = _inferred_alone(targets, dims_of)
        if copy is None:
            return 0
        done = 0
        for ref, name in inferred.items():
            t, o = ref.deref(), copy.get_tensor_by_name(name if ":" in name else f"{name}:0")
            if not unresolved(t) or o.shape.rank is None or t.shape.rank not in (None, o.shape.rank):
                continue
            found[t.name] = tuple(s if s is not None else d for s, d in zip(_statics(t, o.shape.as_list()),
                                                                           o.shape.as_list()))
            done += 1
        return done


# An integer vector this long or shorter may hold a shape's values (a reshape's target, a sum's axes).
_SMALL = 16


def _shape_value(t: tf.Tensor) -> bool:
    """Whether ``t`` may be read by a shape function for its values, or computed into one: a scalar (a
    chunk scaled to the run's sizes in float64, a predicate choosing it), an integer vector of a few
    elements or of a length inference finds (the axes ``BroadcastGradientArgs`` gives a gradient's sum)."""
    if t.shape.rank == 0:
        return t.dtype.is_integer or t.dtype.is_floating or t.dtype == tf.bool
    return t.dtype in (tf.int32, tf.int64) and t.shape.rank == 1 and (t.shape[0] is None or t.shape[0] <= _SMALL)


def _reserved(handle: tf.Tensor) -> tf.Tensor:
    """The TensorList ``handle`` as it was made: through identities and the loops that carried it."""
    for _ in range(64):
        if handle.op.type in ("Identity", "IdentityN"):
            handle = handle.op.inputs[handle.value_index if handle.op.type == "IdentityN" else 0]
        elif handle.op.type in _LOOPS:
            handle = handle.op.inputs[handle.value_index]
        else:
            break
    return handle


def _calls_function(op: tf.Operation) -> bool:
    """Whether ``op`` calls a function of the graph's library (a loop, a conditional, a call)."""
    return any(a.HasField("func") or len(a.list.func) for a in op.node_def.attr.values())


def _inferred_alone(ops: list[tf.Operation], dims_of) -> tuple[tf.Graph | None, dict]:
    """A graph of the ``ops`` and the small computations they read (:func:`_shape_value`; constants),
    every other tensor they read a placeholder of ``dims_of(t)``'s dimensions (``None``: of unknown
    rank), its shapes inferred by TensorFlow at import, and where each of the ``ops``' outputs is in
    it (tensor -> name); ``(None, {})`` where the inference rejects it.  A loop (``While``) is not
    copied (its body is a function of the graph's library): each value it carries out has the shape
    it carried in (the splitter's loops have no shape invariants), an ``Identity`` of that."""
    def copied(op: tf.Operation) -> bool:
        return not _calls_function(op)

    chosen = {op.name: op for op in ops if copied(op)}
    stack, order = list(chosen.values()), []
    while stack:
        op = stack.pop()
        order.append(op)
        for x in op.inputs:
            p = x.op
            if p.name not in chosen and (p.type == "Const" or _shape_value(x)) and copied(p):
                chosen[p.name] = p
                stack.append(p)
    graph_def, made = graph_pb2.GraphDef(), {}

    def name_of(x: tf.Tensor) -> str:
        if x.op.name in chosen:
            return x.op.name if not x.value_index else f"{x.op.name}:{x.value_index}"
        if x.ref() not in made:
            node = graph_def.node.add(name=f"tf_memsafe_shapes/boundary_{len(made)}")
            made[x.ref()] = node.name
            carried = x.op.inputs[x.value_index] if x.op.type in _LOOPS and x.dtype != tf.variant else None
            if carried is not None:
                node.op = "Identity"
                node.attr["T"].type = x.dtype.as_datatype_enum
                node.input.append(name_of(carried))
            else:
                node.op = "Placeholder"
                node.attr["dtype"].type = x.dtype.as_datatype_enum
                node.attr["shape"].shape.CopyFrom(tf.TensorShape(dims_of(x)).as_proto())
        return made[x.ref()]

    for op in order:
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        node.ClearField("device")
        for attr in ("_output_shapes", "_class"):
            if attr in node.attr:
                del node.attr[attr]
        del node.input[:]
        node.input.extend(name_of(x) for x in op.inputs)
    inferred = {t.ref(): name_of(t) for op in ops for t in op.outputs
                if t.dtype not in (tf.resource, tf.variant) and (op.name in chosen or op.type in _LOOPS)}
    copy = tf.Graph()
    try:
        with copy.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, TypeError, tf.errors.OpError):
        return None, {}
    return copy, inferred


_LOOPS = ("While", "StatelessWhile")


def _monomial(d: int, count: int) -> Monomial | None:
    m = _factored(d, count, _PRIMES)
    # a remainder near a multiple of a prime is a size shifted by a constant (L - 1, 2 L + 1): not a
    # product of them (read so where the inference could be run only once: a static factor that
    # near one is taken for one too, and grows as the fastest)
    if any(min(m[0] % p, p - m[0] % p) < _SHIFT for p in _PRIMES[:count] if m[0] >= p - _SHIFT):
        return None
    return m


def _exactly(d: int, again: int, count: int) -> Monomial | None:
    """The monomial a dimension inferred as ``d`` with the symbols at :data:`_PRIMES` and as
    ``again`` with them at :data:`_CHECK` is, or ``None`` where the two readings differ."""
    first = _factored(d, count, _PRIMES)
    return first if first == _factored(again, count, _CHECK) else None


def _factored(d: int, count: int, primes) -> Monomial:
    powers = []
    for k in range(count):
        e = 0
        while d % primes[k] == 0:
            d //= primes[k]
            e += 1
        if e:
            powers.append((k, e))
    return (d, tuple(powers))


def _as_gather(graph_def, node, op: tf.Operation) -> None:
    """``node`` (a ``ResourceGather`` of ``op``'s) made a ``GatherV2`` from a placeholder holding its
    rows' shape: the copy's handles lose their variables' shapes, a gather's rows do not."""
    rows = op.outputs[0].shape[op.inputs[1].shape.rank:] if op.inputs[1].shape.rank is not None else None
    if rows is None or not rows.is_fully_defined():
        return
    params = graph_def.node.add(name=f"{node.name}/_rows", op="Placeholder")
    params.attr["dtype"].type = node.attr["dtype"].type
    params.attr["shape"].shape.CopyFrom(tf.TensorShape([1]).concatenate(rows).as_proto())
    axis = graph_def.node.add(name=f"{node.name}/_axis", op="Const")
    axis.attr["dtype"].type = tf.int32.as_datatype_enum
    axis.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(0, tf.int32))
    indices, controls = node.input[1], [i for i in node.input if i.startswith("^")]
    tindices = node.attr["Tindices"].type
    node.op = "GatherV2"
    del node.input[:]
    node.input.extend([params.name, indices, axis.name] + controls)
    node.attr.clear()
    node.attr["Tparams"].type = params.attr["dtype"].type
    node.attr["Tindices"].type = tindices
    node.attr["Taxis"].type = tf.int32.as_datatype_enum
    node.attr["batch_dims"].i = 0


def _shapes_only(graph):
    """``graph``'s ``GraphDef`` with what the copy's inference cannot see through made explicit: the
    copy's resource handles lose their variables' shapes, so a variable's read becomes a placeholder
    of its value's shape, and an embedding lookup (tf_keras' ``ResourceGather``) a gather from a
    placeholder of the table's row shape."""
    graph_def = graph.as_graph_def()
    for node in list(graph_def.node):
        if node.op == "ResourceGather" and not node.attr["batch_dims"].i:
            _as_gather(graph_def, node, graph.get_operation_by_name(node.name))
        elif node.op == "ReadVariableOp":
            value = graph.get_operation_by_name(node.name).outputs[0]
            node.op, inputs_of = "Placeholder", list(node.input)
            del node.input[:]
            node.input.extend(i for i in inputs_of if i.startswith("^"))
            node.attr.clear()
            node.attr["dtype"].type = value.dtype.as_datatype_enum
            node.attr["shape"].shape.CopyFrom(value.shape.as_proto())
    return graph_def


def _inferred(prepared, inputs: list[tf.Tensor], symbol_of: dict, primes=_PRIMES) -> tf.Graph | None:
    """A copy of the graph ``prepared`` (:func:`_shapes_only`) with each input's unknown axis set to
    its symbol's prime, its shapes inferred by TensorFlow; ``None`` where the inference rejects them."""
    names = {t.op.name: t for t in inputs}
    graph_def = type(prepared)()
    graph_def.CopyFrom(prepared)
    for node in graph_def.node:
        t = names.get(node.name)
        if t is None or "shape" not in node.attr:
            continue
        node.attr["shape"].shape.CopyFrom(tf.TensorShape(
            [primes[symbol_of[t.name, a]] if d is None else d for a, d in enumerate(t.shape.as_list())]).as_proto())
        node.attr.pop("_output_shapes", None)
    copy = tf.Graph()
    try:
        with copy.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, TypeError, tf.errors.OpError):
        return None
    return copy


def symbols(graph, inputs: list[tf.Tensor]) -> Symbols | None:
    """The :class:`Symbols` of ``graph`` whose run-time sizes are those of ``inputs`` (its own
    inputs' unknown dimensions), or ``None`` where the inference fails (an op whose shape function
    rejects the primes).  TensorFlow's shape inference runs on a copy of the graph (its
    ``GraphDef``) with each symbol's sizes set to a prime of its own; a dimension that comes out as
    a product of them (and a static factor) is read as that monomial."""
    pairs = [(t.name, a) for t in inputs for a in dynamic_axes(t)]
    if not pairs:
        return None
    copy, symbol_of, prepared = None, {}, _shapes_only(graph)
    if len(pairs) <= len(_PRIMES):                      # one symbol each, where the program allows it
        symbol_of = {pair: k for k, pair in enumerate(pairs)}
        copy = _inferred(prepared, inputs, symbol_of)
    if copy is None:                                    # one per axis
        axes = sorted({a for _, a in pairs})
        if len(axes) > len(_PRIMES):
            return None
        symbol_of = {(name, a): axes.index(a) for name, a in pairs}
        copy = _inferred(prepared, inputs, symbol_of)
        if copy is None:
            return None
    count = max(symbol_of.values()) + 1
    by_name = {t.name: t for t in inputs}
    sources: dict = {}
    for (name, a), k in symbol_of.items():
        sources.setdefault(k, []).append((by_name[name], a))
    again = _inferred(prepared, inputs, symbol_of, _CHECK)
    return Symbols(_read(graph, copy, count, again), count, sources,
                   born=frozenset(op.name for op in graph.get_operations()))


def _read(graph, copy: tf.Graph, count: int, again: tf.Graph | None = None) -> dict:
    """The monomials of ``graph``'s tensors of run-time sizes, from ``copy`` (its inferred twin), checked
    against ``again`` (inferred with the symbols at other primes) where it could be made."""
    table: dict = {}
    originals = {op.name: op for op in graph.get_operations()}
    checks = {op.name: op for op in again.get_operations()} if again is not None else {}
    for op in copy.get_operations():
        original, check = originals.get(op.name), checks.get(op.name)
        for i, (o, t) in enumerate(zip(op.outputs, original.outputs if original is not None else ())):
            # (a rank the graph does not know but the copy does: a gradient's sum over the axes a
            # ``BroadcastGradientArgs`` of run-time shapes gives, which the copy's inference evaluates)
            if o.shape.rank is None or t.shape.is_fully_defined() or t.shape.rank not in (None, o.shape.rank):
                continue
            other = check.outputs[i].shape.as_list() if check is not None and check.outputs[i].shape.rank == \
                o.shape.rank else None
            table[t.name] = tuple(
                None if d is None else (d, ()) if s is not None else
                _monomial(d, count) if again is None else
                None if other is None or other[j] is None else _exactly(d, other[j], count)
                for j, (d, s) in enumerate(zip(o.shape.as_list(), _statics(t, o.shape.as_list()))))
    return table


_NOMINAL: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("grappler_ext_nominal_size", default=None)


# The sizes made while a program of the graph's pieces is built alone to be measured at the nominal sizes
_CONSTANT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("grappler_ext_sizes_as_constants",
                                                                        default=None)


@contextlib.contextmanager
def sizes_as_constants() -> Iterator[None]:
    """Within: the run-time sizes a table gives (:meth:`Symbols.run_size`) are the nominal sizes in
    effect, as constants, not read from the function's inputs: a loop of the program built alone, as a
    function of its own inputs, to be compiled at those sizes (the function's inputs are not its)."""
    token = _CONSTANT.set(None if _NOMINAL.get() is None else {})
    try:
        yield
    finally:
        _CONSTANT.reset(token)


def _sizes_key(size: int, values: dict[int, int]) -> tuple:
    """The key of what a table resolves at ``size`` and ``values`` (:meth:`Symbols.resolve`)."""
    return (size, tuple(sorted(values.items())))


@contextlib.contextmanager
def nominal(size: int, table: Symbols | None = None, values: dict[int, int] | None = None) -> Iterator[int]:
    """Read every dimension unknown until run time as ``size`` within the block; with a ``table``,
    the dimensions it knows as their monomials at ``values`` (symbol -> size; ``size`` for the
    symbols not given)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"a nominal size must be an int >= 1, got {size!r}")
    values = {k: int(v) for k, v in (values or {}).items()}
    token = _NOMINAL.set((size, table, values, _sizes_key(size, values)))
    try:
        yield size
    finally:
        _NOMINAL.reset(token)


def same_as(new: tf.Tensor, old: tf.Tensor) -> None:
    """Read ``new`` as ``old`` under the nominal sizes in effect (a loop's output in place of the
    root it replaces: :meth:`Symbols.same_as`)."""
    state = _NOMINAL.get()
    if state is not None and state[1] is not None:
        state[1].same_as(new, old)


def monomials(t: tf.Tensor) -> tuple[Monomial | None, ...] | None:
    """``t``'s dimensions as the table of the nominal sizes in effect reads them, or ``None`` (no
    table, or ``t`` not in it)."""
    state = _NOMINAL.get()
    return state[1].names.get(t.name) if state is not None and state[1] is not None else None


def known_shape(t: tf.Tensor) -> bool:
    """Whether ``t``'s shape is static, or known as products of the run-time sizes under the table
    of the nominal sizes in effect (:meth:`Symbols.run_shape` gives it when the function runs)."""
    if t.shape.is_fully_defined():
        return True
    known = monomials(t)
    return known is not None and all(m is not None or d is not None for m, d in zip(known, _statics(t, known)))


def symbolic() -> tuple[Symbols, int, dict[int, int]] | None:
    """``(table, size, values)`` of the nominal sizes in effect, where they have a table; else ``None``."""
    state = _NOMINAL.get()
    return None if state is None or state[1] is None else (state[1], state[0], state[2])


def nominal_size() -> int | None:
    """The nominal size in effect, or ``None`` outside :func:`nominal`."""
    state = _NOMINAL.get()
    return None if state is None else state[0]


def nominal_key() -> tuple | None:
    """What the nominal sizes in effect read every tensor as (a memo's key), or ``None``."""
    state = _NOMINAL.get()
    if state is None:
        return None
    size, table, values, key = state
    return (size, id(table), len(table.names) if table is not None else 0, key[1],
            len(table.resolved.get(key, ())) if table is not None else 0)


def copied(pairs) -> None:
    """Each ``(old, new)`` tensor pair: ``new`` a copy of ``old``, read as ``old`` under the table of
    the nominal sizes in effect (:meth:`Symbols.copied`)."""
    state = _NOMINAL.get()
    if state is not None and state[1] is not None:
        state[1].copied(pairs)


def shaped_as(new: tf.Tensor, like: tf.Tensor, perm: Sequence[int] | None = None) -> None:
    """Under nominal sizes with a table: ``new`` (a rewrite's tensor TensorFlow's inference cannot see
    through: a conditional's output) has ``like``'s dimensions (permuted by ``perm``), where the table
    knows them; read so at every size it knows them at."""
    state = _NOMINAL.get()
    if state is None or state[1] is None or new.name == like.name:
        return
    table, key = state[1], state[3]
    # (a conditional's result is an ``Identity`` of its op's output: both are read)
    both = [new]
    while both[-1].op.type == "Identity" and both[-1].op.inputs[0].op.type in ("Identity", "If", "StatelessIf"):
        both.append(both[-1].op.inputs[0])

    def order(seq) -> tuple:
        return tuple(seq) if perm is None else tuple(seq[p] for p in perm)

    for _ in range(64):                  # (through identities: a custom gradient's of its inputs)
        known = table.names.get(like.name)
        resolved = None if known is not None else table.resolved.get(key, {}).get(like.name)
        if known is not None or resolved is not None or like.op.type != "Identity":
            break
        like = like.op.inputs[0]
    if known is None and (resolved is None or None in resolved):
        return
    for t in both:
        if known is not None and t.shape.rank in (None, len(known)):
            table.names[t.name] = order(known)
        elif resolved is not None and t.shape.rank in (None, len(resolved)):
            table.resolved[key][t.name] = order(resolved)


def declare_stacked(array: tf.TensorArray, like: tf.Tensor) -> None:
    """Under nominal sizes with a table: the slices a loop writes to ``array`` (as made, before the
    loop) are slices of a tensor shaped as ``like`` (the result they are joined into, or the input
    whose gradient they are), each of ``array``'s element shape where it is static and of ``like``'s
    dimensions where not (a chunk known only at run time: one slice the whole); once stacked they
    count as ``ceil(like's elements / a slice's)`` slices, for :meth:`Symbols.resolve`."""
    state = _NOMINAL.get()
    if state is None or state[1] is None:
        return
    d, element = dims(like), array.element_shape
    if d is None or None in d or element.rank != len(d):
        return
    slice_dims = [e if e is not None else x for e, x in zip(element.as_list(), d)]
    steps = -(-math.prod(d) // max(1, math.prod(slice_dims)))
    state[1].lists.setdefault(state[3], {})[array.flow.name] = (steps, *slice_dims)


def resolve(graph) -> int:
    """Under the nominal sizes in effect, with a table: the dimensions of the tensors of ops made
    since the table was (:meth:`Symbols.resolve`), read by :func:`dims` from then on; how many."""
    state = _NOMINAL.get()
    if state is None or state[1] is None:
        return 0
    size, table, values, _ = state
    return table.resolve(graph, size, values)


def _statics(t: tf.Tensor, like) -> list[int | None]:
    """``t``'s static dimensions; for a tensor of unknown rank, one ``None`` for each of ``like``'s
    (its dimensions as the table's copy found them: monomials, or the copy's own shape)."""
    return t.shape.as_list() if t.shape.rank is not None else [None] * len(like)


def _evaluate(m: Monomial | None, size_of):
    """``m`` with each symbol ``k`` read as ``size_of(k)`` (an int, or a run-time tensor); ``None`` for ``None``."""
    if m is None:
        return None
    coefficient, powers = m
    out = coefficient
    for k, e in powers:
        out *= size_of(k) ** e
    return out


def exact_dims(t: tf.Tensor) -> list[int | None] | None:
    """``t``'s dimensions as exact sizes under the table of the nominal sizes in effect: a static
    size as itself, a product of run-time sizes as that product with each symbol read as a prime of
    its own far above any static size (so that ``a * b``, ``a % b == 0``, ``a // b`` and ``a == b``
    of such ints are those of the monomials: a reshape's factors through [B * L, E] -> [B, L, E]);
    ``None`` for a dimension that is neither.  The static shape outside such planning; ``None`` for
    an unknown rank the table does not know."""
    known = monomials(t)
    if t.shape.rank is None and known is None:
        return None
    return [d if d is not None else _evaluate(known[i], _EXACT.__getitem__) if known is not None else None
            for i, d in enumerate(_statics(t, known))]


def is_symbolic(size: int) -> bool:
    """Whether an exact size (:func:`exact_dims`) holds a run-time size."""
    return any(size % p == 0 for p in _EXACT)


def exact_monomial(size: int) -> Monomial:
    """The monomial an exact size (:func:`exact_dims`) stands for."""
    return _factored(size, len(_EXACT), _EXACT)


def describe_exact(size: int) -> str:
    """An exact size for people: ``4``, ``s0``, ``64*s0*s1``."""
    coefficient, powers = exact_monomial(size)
    parts = ([str(coefficient)] if coefficient != 1 or not powers else []) + [
        f"s{k}" if e == 1 else f"s{k}^{e}" for k, e in powers]
    return "*".join(parts)


def dynamic_axes(t: tf.Tensor) -> tuple[int, ...]:
    """The axes of ``t`` whose size is unknown until run time (by its static shape)."""
    if t.shape.rank is None:
        return ()
    return tuple(i for i, d in enumerate(t.shape.as_list()) if d is None)


# Within :func:`read_once`: id(tensor) -> (tensor, its dims as a tuple, or None).
_READ: contextvars.ContextVar[dict | None] = contextvars.ContextVar("grappler_ext_dims_read", default=None)


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within the block each tensor's :func:`dims` are worked out once: for an analysis, which reads
    a graph it does not edit (the memory model asks for each tensor's bytes five times or more)."""
    token = _READ.set({})
    try:
        yield
    finally:
        _READ.reset(token)


def dims(t: tf.Tensor) -> list[int | None] | None:
    """``t``'s dimensions, unknown ones read as the nominal size (``None`` outside :func:`nominal`);
    ``None`` for an unknown rank (outside :func:`nominal`, or where its table does not know it)."""
    read = _READ.get()
    if read is None:
        return _dims(t)
    entry = read.get(id(t))
    if entry is None or entry[0] is not t:
        d = _dims(t)
        entry = read[id(t)] = (t, None if d is None else tuple(d))
    return None if entry[1] is None else list(entry[1])


def _dims(t: tf.Tensor) -> list[int | None] | None:
    state = _NOMINAL.get()
    if state is None:
        return None if t.shape.rank is None else t.shape.as_list()
    size, table, values, key = state
    known = table.names.get(t.name) if table is not None else None
    resolved = None
    if known is None and table is not None and table.resolved and not t.shape.is_fully_defined():
        resolved = table.resolved.get(key, {}).get(t.name)
    if t.shape.rank is None and known is None and resolved is None:
        return None
    out = []
    for i, d in enumerate(_statics(t, known if resolved is None else resolved)):
        if d is None:
            d = (_evaluate(known[i], lambda k: values.get(k, size)) if known is not None else
                 resolved[i] if resolved is not None else None)
            d = size if d is None else d
        out.append(d)
    return out


def is_static(t: tf.Tensor) -> bool:
    """Whether :func:`dims` gives every dimension of ``t``."""
    d = dims(t)
    return d is not None and all(x is not None for x in d)


def num_elements(t: tf.Tensor) -> int | None:
    """Elements of ``t`` by :func:`dims`; ``None`` when a dimension is unknown."""
    d = dims(t)
    return None if d is None or any(x is None for x in d) else math.prod(d)


def nbytes(t: tf.Tensor) -> int:
    """The bytes of ``t``'s value by :func:`dims`; 0 when a dimension is unknown."""
    n = num_elements(t)
    return 0 if n is None else n * t.dtype.size


def concrete_spec(t: tf.Tensor) -> tf.TensorSpec:
    """A ``TensorSpec`` of ``t`` with its unknown dimensions at the nominal size (to compile a
    program for measuring it); its dimensions as they are outside :func:`nominal`."""
    d = dims(t)
    return tf.TensorSpec(d, t.dtype)
