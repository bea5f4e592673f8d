"""Declarative tree patterns over TensorFlow graph tensors, with captures and failure reasons.

A pattern describes the producer tree of one ``tf.Tensor``; :func:`match` either returns a
:class:`Match` (captures, matched ops) or a falsy :class:`NoMatch` whose ``reason`` is one line
saying where and why the pattern did not fire, so ``explain()`` can report it. Passes use this
instead of hand-walking ``op.inputs[0].op.inputs[1].op`` (style guide, section 5; the models are
XLA's ``pattern_matcher.h``, TVM's ``dpl/pattern.py`` and Inductor's ``FailedMatch``).

Worked example: the squared distance ``Sum(Square(Sub(x, y)), axis)``, however it was spelled::

    x, y = Any("x", where=is_floating()), Any("y")
    diff2 = OneOf(
        Op("Square", Op("Sub", x, y)),                      # tf.square(x - y)
        Op("Pow", Op("Sub", x, y), Const(value=2)),         # (x - y) ** 2 traces to Pow, not Square
        Op("SquaredDifference", x, y),                      # tf.math.squared_difference(x, y)
    )
    pat = Op("Sum", diff2, Const("axis"), name="sum")
    m = match(pat, tensor)
    if m:
        m["x"], m["y"], m.const_values["axis"], m.ops   # ops: [Sum, Square, Sub] (root first)
    else:
        m.reason   # e.g. "`Sum` input 0: no alternative matched: (1) expected Square, found Mul ..."

Semantics:

- ``Op(types, *inputs)`` matches output ``output`` of an op whose type is in the ``|``-separated
  ``types`` (``"*"``: any type) and whose inputs match ``inputs`` positionally; the input count
  must be equal unless ``rest=True``. ``commutative=True`` (binary ops) also tries the swapped
  order. ``exclusive=True`` marks an interior op whose outputs may only be consumed by ops of the
  match (checked once the whole match is found; a graph output also counts as outside use).
- A ``name`` captures the tensor; a name seen twice must bind the identical tensor.
- ``where=`` takes a predicate ``tensor -> bool`` or a list of them; failure reasons name it by
  its ``description`` attribute or ``__name__`` (the helpers :func:`has_rank` etc. carry one).
- Matching backtracks fully: every alternative of :class:`OneOf` and both orders of a
  commutative op are tried, in order, until the whole pattern (exclusivity included) holds;
  the first complete match found is returned. Captures of abandoned branches are discarded.
- The reported failure is the deepest one reached (most of the pattern matched); an
  exclusivity failure of an otherwise complete match outranks every structural one.

Caveats: ``Const`` uses ``tensor_util.constant_value``, which sees ``Const`` ops and what it can
fold (``Shape`` of a fully known shape, ``Pack`` of constants, ...), but not large eager
constants that ``tf.function`` captured as ``Placeholder`` inputs. Control dependencies are
ignored. Matching adds no ops; its one side effect is ``constant_value`` recording a folded
tensor as unfeedable (``graph.prevent_feeding``), which does not matter for traced functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

__all__ = [
    "Any",
    "Const",
    "Match",
    "NoMatch",
    "OneOf",
    "Op",
    "Pattern",
    "Predicate",
    "find_all",
    "has_dtype",
    "has_rank",
    "is_floating",
    "match",
    "shape_like",
    "static_shape",
]

TensorPredicate = Callable[[tf.Tensor], bool]
Where = TensorPredicate | Sequence[TensorPredicate] | None  # where= argument

# An exclusivity failure happens only after the whole structure matched, so it outranks any
# structural failure however deep.
_EXCLUSIVE_DEPTH = 1 << 30


# --------------------------------------------------------------------------------------------
# Predicates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Predicate:
    """A tensor predicate with a readable ``description`` used in failure reasons."""

    fn: TensorPredicate
    description: str

    def __call__(self, t: tf.Tensor) -> bool:
        return bool(self.fn(t))

    def __repr__(self) -> str:
        return self.description


def has_rank(rank: int) -> Predicate:
    """The tensor's static rank is known and equals ``rank``."""
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"has_rank: rank must be a non-negative int, got {rank!r}")
    return Predicate(lambda t: t.shape.rank == rank, f"has_rank({rank})")


def has_dtype(*dtypes: tf.DType | str) -> Predicate:
    """The tensor's dtype is one of ``dtypes`` (``tf.DType`` or names such as ``"float32"``)."""
    if not dtypes:
        raise ValueError("has_dtype: give at least one dtype")
    wanted = tuple(tf.as_dtype(d) for d in dtypes)
    names = ", ".join(d.name for d in wanted)
    return Predicate(lambda t: t.dtype.base_dtype in wanted, f"has_dtype({names})")


def is_floating() -> Predicate:
    """The tensor's dtype is a floating-point type (half, bfloat16, float32, float64, ...)."""
    return Predicate(lambda t: t.dtype.is_floating, "is_floating()")


def static_shape() -> Predicate:
    """The tensor's static shape is fully known (rank and every dimension)."""
    return Predicate(lambda t: t.shape.is_fully_defined(), "static_shape()")


def shape_like(*dims: int | None) -> Predicate:
    """The static rank is ``len(dims)`` and each int in ``dims`` equals the known dimension.

    ``None`` accepts any dimension, known or not; an int never matches an unknown dimension.
    """
    for d in dims:
        if d is not None and (not isinstance(d, int) or d < 0):
            raise ValueError(f"shape_like: dimensions must be non-negative ints or None, got {d!r}")

    def check(t: tf.Tensor) -> bool:
        if t.shape.rank != len(dims):
            return False
        return all(want is None or have == want for want, have in zip(dims, t.shape.as_list()))

    return Predicate(check, f"shape_like({', '.join(repr(d) for d in dims)})")


def _predicate_name(pred: TensorPredicate) -> str:
    return getattr(pred, "description", None) or getattr(pred, "__name__", None) or repr(pred)


def _normalize_where(where: Where) -> tuple[TensorPredicate, ...]:
    if where is None:
        return ()
    preds = tuple(where) if isinstance(where, (list, tuple)) else (where,)
    for p in preds:
        if not callable(p):
            raise TypeError(f"where= takes callables tensor -> bool, got {p!r}")
    return preds


# --------------------------------------------------------------------------------------------
# Patterns
# --------------------------------------------------------------------------------------------


class Pattern:
    """Base class of all patterns: an optional capture ``name`` and ``where`` predicates."""

    name: str | None
    where: tuple[TensorPredicate, ...]

    def _attrs_repr(self) -> list[str]:
        out = []
        if self.name is not None:
            out.append(f"name={self.name!r}")
        if self.where:
            out.append(f"where=[{', '.join(_predicate_name(p) for p in self.where)}]")
        return out


def _check_pattern(p: object, what: str) -> Pattern:
    if not isinstance(p, Pattern):
        raise TypeError(f"{what} must be a Pattern (Op, Any, Const, OneOf), got {p!r}")
    return p


class Op(Pattern):
    """Output ``output`` of an op whose type is in ``types`` and whose inputs match ``inputs``.

    Args:
        types: ``|``-separated op types, e.g. ``"MatMul|BatchMatMulV2"``; ``"*"`` for any type.
        *inputs: sub-patterns for ``op.inputs[i]``, positionally.
        name: capture name for the matched tensor.
        where: predicate(s) on the matched tensor.
        commutative: for binary patterns, also try the inputs in swapped order.
        exclusive: every consumer of every output of this op must be an op of the match.
        output: required output index, or ``None`` for any output.
        rest: allow the op to have more inputs than ``inputs`` (the extra ones are ignored).
    """

    def __init__(
        self,
        types: str,
        *inputs: Pattern,
        name: str | None = None,
        where: Where = None,
        commutative: bool = False,
        exclusive: bool = False,
        output: int | None = 0,
        rest: bool = False,
    ) -> None:
        alternatives = tuple(s.strip() for s in types.split("|"))
        if not types or not all(alternatives):
            raise ValueError(f"Op: empty op type in {types!r}")
        if commutative and len(inputs) != 2:
            raise ValueError(
                f"Op({types!r}): commutative=True needs exactly 2 input patterns, got {len(inputs)}"
            )
        if output is not None and (not isinstance(output, int) or output < 0):
            raise ValueError(f"Op({types!r}): output must be a non-negative int or None, got {output!r}")
        self.types_text = "|".join(alternatives)
        self.types: frozenset[str] | None = None if "*" in alternatives else frozenset(alternatives)
        self.inputs: tuple[Pattern, ...] = tuple(_check_pattern(p, f"Op({types!r}) input") for p in inputs)
        self.name = name
        self.where = _normalize_where(where)
        self.commutative = commutative
        self.exclusive = exclusive
        self.output = output
        self.rest = rest

    def accepts_type(self, op_type: str) -> bool:
        """Whether ``op_type`` is one of this pattern's op types."""
        return self.types is None or op_type in self.types

    def __repr__(self) -> str:
        args = [repr(self.types_text), *map(repr, self.inputs), *self._attrs_repr()]
        for flag in ("commutative", "exclusive", "rest"):
            if getattr(self, flag):
                args.append(f"{flag}=True")
        if self.output != 0:
            args.append(f"output={self.output!r}")
        return f"Op({', '.join(args)})"


class Any(Pattern):
    """Any tensor. ``Any("x")`` used twice in one pattern requires the identical tensor."""

    def __init__(self, name: str | None = None, where: Where = None) -> None:
        self.name = name
        self.where = _normalize_where(where)

    def __repr__(self) -> str:
        return f"Any({', '.join(self._attrs_repr())})"


class Const(Pattern):
    """A tensor whose value is statically known (``tensor_util.constant_value``).

    ``value`` (optional) must equal the constant elementwise; shapes may differ only by leading
    size-1 dimensions, which broadcasting adds anyway, so ``value=2`` matches a float ``2.0`` of
    shape ``[]`` or ``[1]`` but not ``[2.0, 2.0]``. NaN equals NaN. A named capture also stores
    the numpy value in :attr:`Match.const_values`.
    """

    def __init__(
        self,
        name: str | None = None,
        where: Where = None,
        value: object = None,
    ) -> None:
        self.name = name
        self.where = _normalize_where(where)
        self.value: np.ndarray | None = None if value is None else np.asarray(value)

    def __repr__(self) -> str:
        args = self._attrs_repr()
        if self.value is not None:
            args.append(f"value={_format_value(self.value)}")
        return f"Const({', '.join(args)})"


class OneOf(Pattern):
    """The first of ``patterns`` that matches (later ones are tried if the rest of the match fails)."""

    def __init__(self, *patterns: Pattern, name: str | None = None) -> None:
        if not patterns:
            raise ValueError("OneOf needs at least one pattern")
        self.patterns: tuple[Pattern, ...] = tuple(_check_pattern(p, "OneOf alternative") for p in patterns)
        self.name = name
        self.where = ()

    def __repr__(self) -> str:
        return f"OneOf({', '.join([*map(repr, self.patterns), *self._attrs_repr()])})"


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    """A successful match: truthy; ``m["x"]`` is the tensor captured as ``x``."""

    root: tf.Tensor
    captures: dict[str, tf.Tensor]
    ops: list[tf.Operation]  # every op matched by an Op pattern, root first, no repeats
    const_values: dict[str, np.ndarray] = field(default_factory=dict)  # Const captures only

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, name: str) -> tf.Tensor:
        return self.captures[name]

    def __contains__(self, name: str) -> bool:
        return name in self.captures

    def __repr__(self) -> str:
        caps = ", ".join(f"{k}={v.name}" for k, v in self.captures.items())
        return f"Match(root={self.root.name}, captures={{{caps}}}, ops={[op.name for op in self.ops]})"


@dataclass(frozen=True)
class NoMatch:
    """A failed match: falsy; ``reason`` is one line naming the op and what was expected.
    ``outside_use``: the pattern matched whole, but an ``exclusive`` op of it is read outside it (a
    consumer, or a graph output) -- a caller reads this, never the text."""

    reason: str
    outside_use: bool = False

    def __bool__(self) -> bool:
        return False


# --------------------------------------------------------------------------------------------
# Matcher
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _State:
    """Bindings of one partial match; never mutated, every binding returns a new state."""

    captures: tuple[tuple[str, tf.Tensor], ...] = ()
    const_values: tuple[tuple[str, np.ndarray], ...] = ()
    ops: tuple[tf.Operation, ...] = ()
    exclusive: tuple[tf.Operation, ...] = ()

    def lookup(self, name: str) -> tf.Tensor | None:
        for k, v in self.captures:
            if k == name:
                return v
        return None

    def bind(self, name: str | None, t: tf.Tensor) -> _State:
        if name is None or self.lookup(name) is not None:
            return self
        return _State(self.captures + ((name, t),), self.const_values, self.ops, self.exclusive)

    def bind_value(self, name: str | None, value: np.ndarray) -> _State:
        if name is None or any(k == name for k, _ in self.const_values):
            return self
        return _State(self.captures, self.const_values + ((name, value),), self.ops, self.exclusive)

    def add_op(self, op: tf.Operation, exclusive: bool) -> _State:
        ops = self.ops if any(o is op for o in self.ops) else self.ops + (op,)
        excl = self.exclusive
        if exclusive and not any(o is op for o in excl):
            excl = excl + (op,)
        return _State(self.captures, self.const_values, ops, excl)


class _Failures:
    """Keeps the deepest failure seen (the first one on ties)."""

    def __init__(self) -> None:
        self.depth = -1
        self.reason = ""

    def add(self, depth: int, reason: str) -> None:
        if depth > self.depth:
            self.depth, self.reason = depth, reason


def _describe(t: tf.Tensor) -> str:
    """``float32[4,?,3]``: dtype and static shape, for failure reasons."""
    if t.shape.rank is None:
        return f"{t.dtype.name}[*]"
    dims = ",".join("?" if d is None else str(d) for d in t.shape.as_list())
    return f"{t.dtype.name}[{dims}]"


def _format_value(v: np.ndarray) -> str:
    """Short one-line rendering of a constant: ``2.0``, ``[1, 2]``, ``[1., 1., ..., 1., 1.]``."""
    v = np.asarray(v)
    if v.ndim == 0:
        return repr(v.item())
    return np.array2string(v, threshold=8, edgeitems=2, separator=", ").replace("\n", "")


def _strip_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def _values_equal(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Elementwise equality, agnostic to leading size-1 dimensions (which broadcasting adds)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if _strip_leading_ones(actual.shape) != _strip_leading_ones(expected.shape):
        return False
    if expected.dtype.kind == "U" and actual.dtype.kind in "OS":  # tf.string folds to bytes
        expected = np.char.encode(expected, "utf-8")
    equal_nan = actual.dtype.kind in "fc" and expected.dtype.kind in "fc"
    return bool(np.array_equal(actual.reshape(expected.shape), expected, equal_nan=equal_nan))


def _strip_loc(reason: str, loc: str) -> str:
    prefix = f"{loc}: "
    return reason.removeprefix(prefix)


class _Matcher:
    """Recursive backtracking matcher: ``_match`` yields every state under which ``p`` matches ``t``."""

    def _match(
        self, p: Pattern, t: tf.Tensor, st: _State, loc: str, depth: int, fails: _Failures
    ) -> Iterator[_State]:
        # "Same tensor as capture x": checked first, it is the cheapest way to prune.
        if p.name is not None:
            bound = st.lookup(p.name)
            if bound is not None and bound is not t:
                fails.add(depth, f"{loc}: expected same tensor as capture {p.name} (`{bound.name}`), "
                                 f"found `{t.name}`")
                return
        if isinstance(p, OneOf):
            yield from self._one_of(p, t, st, loc, depth, fails)
            return
        if isinstance(p, Op) and not self._op_head(p, t, loc, depth, fails):
            return
        value = None
        if isinstance(p, Const):
            value = tensor_util.constant_value(t)
            if value is None:
                fails.add(depth, f"{loc}: expected a constant, `{t.name}` ({t.op.type}) "
                                 "is not statically known")
                return
            if p.value is not None and not _values_equal(value, p.value):
                fails.add(depth, f"{loc}: expected constant {_format_value(p.value)}, "
                                 f"`{t.name}` is {_format_value(value)}")
                return
        for pred in p.where:
            if not pred(t):
                fails.add(depth, f"{loc}: `{t.name}` ({_describe(t)}) fails {_predicate_name(pred)}")
                return
        st = st.bind(p.name, t)
        if isinstance(p, Const):
            yield st.bind_value(p.name, value)
        elif isinstance(p, Any):
            yield st
        elif isinstance(p, Op):
            yield from self._op_inputs(p, t.op, st.add_op(t.op, p.exclusive), depth, fails)
        else:  # pragma: no cover - every Pattern subclass is handled above
            raise TypeError(f"unknown pattern {p!r}")

    def _op_head(self, p: Op, t: tf.Tensor, loc: str, depth: int, fails: _Failures) -> bool:
        """Type, output index and input count of ``t.op``; records the failure if one is off."""
        op = t.op
        if not p.accepts_type(op.type):
            fails.add(depth, f"{loc}: expected {p.types_text}, found {op.type} (`{op.name}`)")
            return False
        if p.output is not None and t.value_index != p.output:
            fails.add(depth, f"{loc}: expected output {p.output} of `{op.name}` ({op.type}), "
                             f"found output {t.value_index}")
            return False
        n, k = len(op.inputs), len(p.inputs)
        if n < k or (n > k and not p.rest):
            at_least = "at least " if p.rest else ""
            fails.add(depth, f"{loc}: `{op.name}` ({op.type}) has {n} inputs, pattern expects {at_least}{k}")
            return False
        return True

    def _op_inputs(
        self, p: Op, op: tf.Operation, st: _State, depth: int, fails: _Failures
    ) -> Iterator[_State]:
        items = [(sub, op.inputs[i], f"`{op.name}` input {i}") for i, sub in enumerate(p.inputs)]
        yield from self._sequence(items, st, depth + 1, fails)
        if p.commutative:
            # Swapped order a + b == b + a: the second input pattern against input 0 and vice versa.
            swapped = [(items[1][0], items[0][1], items[0][2]), (items[0][0], items[1][1], items[1][2])]
            yield from self._sequence(swapped, st, depth + 1, fails)

    def _sequence(
        self, items: list[tuple[Pattern, tf.Tensor, str]], st: _State, depth: int, fails: _Failures
    ) -> Iterator[_State]:
        if not items:
            yield st
            return
        (p, t, loc), rest = items[0], items[1:]
        for st1 in self._match(p, t, st, loc, depth, fails):
            yield from self._sequence(rest, st1, depth, fails)

    def _one_of(
        self, p: OneOf, t: tf.Tensor, st: _State, loc: str, depth: int, fails: _Failures
    ) -> Iterator[_State]:
        alt_fails: list[_Failures] = []
        any_matched = False
        for alt in p.patterns:
            f = _Failures()
            alt_fails.append(f)
            for st1 in self._match(alt, t, st, loc, depth, f):
                any_matched = True
                yield st1.bind(p.name, t)
        if not any_matched:
            parts = "; ".join(f"({i + 1}) {_strip_loc(f.reason, loc)}" for i, f in enumerate(alt_fails))
            fails.add(max(f.depth for f in alt_fails), f"{loc}: no alternative matched: {parts}")


def _exclusivity_violation(st: _State, root_op: tf.Operation, ignore=frozenset()) -> str | None:
    """Reason why an exclusive interior op of a complete match has an outside use, or None.

    The root op is exempt: its consumers are where the match's value goes.  Consumers in
    ``ignore`` do not count (a pass that will rebuild them, e.g. recorded gradients).
    """
    inside = {id(op) for op in st.ops} | {id(op) for op in ignore}
    for op in st.exclusive:
        if op is root_op:
            continue
        graph_outputs = getattr(op.graph, "outputs", None) or ()
        for out in op.outputs:
            for consumer in out.consumers():
                if id(consumer) not in inside:
                    return f"`{op.name}` ({op.type}) has a consumer outside the pattern: `{consumer.name}`"
            if any(g is out for g in graph_outputs):
                return f"`{op.name}` ({op.type}) output {out.value_index} is a graph output"
    return None


def match(pattern: Pattern, tensor: tf.Tensor, ignore: Iterable[tf.Operation] = ()) -> Match | NoMatch:
    """Match ``pattern`` against ``tensor``; a :class:`Match`, or a :class:`NoMatch` with a reason.

    ``ignore``: ops whose reads do not break ``exclusive`` (the caller rebuilds them).
    """
    _check_pattern(pattern, "match: pattern")
    fails = _Failures()
    ignore = frozenset(ignore)
    for st in _Matcher()._match(pattern, tensor, _State(), "root", 0, fails):
        violation = _exclusivity_violation(st, tensor.op, ignore)
        if violation is None:
            return Match(
                root=tensor, captures=dict(st.captures), ops=list(st.ops), const_values=dict(st.const_values)
            )
        fails.add(_EXCLUSIVE_DEPTH, violation)
    return NoMatch(fails.reason, outside_use=fails.depth == _EXCLUSIVE_DEPTH)


def find_all(pattern: Pattern, graph: tf.Graph, ops: Iterable[tf.Operation] | None = None) -> list[Match]:
    """Every match of ``pattern`` rooted at an output of ``ops`` (default: all ops of ``graph``).

    Ops are tried in graph-creation order (or the order given), each output in order. Matches may
    overlap; the caller decides which to use.
    """
    _check_pattern(pattern, "find_all: pattern")
    candidates = graph.get_operations() if ops is None else ops
    found = []
    for op in candidates:
        if isinstance(pattern, Op) and not pattern.accepts_type(op.type):
            continue  # cheap pre-filter; match() would reject it anyway
        for t in op.outputs:
            m = match(pattern, t)
            if m:
                found.append(m)
    return found
