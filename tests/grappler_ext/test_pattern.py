"""Tests of grappler_ext.pattern against real traced FuncGraphs (TF op names as traced by TF 2.21)."""

from __future__ import annotations

import collections
import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorflow.python.framework import func_graph

from grappler_ext.pattern import (
    Any,
    Const,
    Match,
    NoMatch,
    OneOf,
    Op,
    Pattern,
    find_all,
    has_dtype,
    has_rank,
    is_floating,
    match,
    shape_like,
    static_shape,
)

F32_4x3 = tf.TensorSpec([4, 3], tf.float32)
F32_3 = tf.TensorSpec([3], tf.float32)


def trace(fn, *specs: tf.TensorSpec) -> tf.Graph:
    return tf.function(fn).get_concrete_function(*specs).graph


def out(graph: tf.Graph, op_name: str, index: int = 0) -> tf.Tensor:
    return graph.get_operation_by_name(op_name).outputs[index]


def sq_dist_pattern(exclusive: bool = False) -> Op:
    """Sum(Square(Sub(x, y)), axis) in its three spellings."""
    x, y = Any("x", where=is_floating()), Any("y")
    diff = Op("Sub", x, y, exclusive=exclusive)
    return Op(
        "Sum",
        OneOf(
            Op("Square", diff, exclusive=exclusive),
            Op("Pow", diff, Const(value=2), exclusive=exclusive),
            Op("SquaredDifference", x, y, exclusive=exclusive),
        ),
        Const("axis"),
        name="sum",
    )


SPELLINGS = {
    "square": (lambda a, b: tf.reduce_sum(tf.square(a[:, None] - b[None]), -1), ["Sum", "Square", "sub"]),
    "pow": (lambda a, b: tf.reduce_sum((a[:, None] - b[None]) ** 2, -1), ["Sum", "pow", "sub"]),
    "squared_difference": (
        lambda a, b: tf.reduce_sum(tf.math.squared_difference(a[:, None], b[None]), -1),
        ["Sum", "SquaredDifference"],
    ),
}


# ------------------------------------------------------------------------------------------------
# Squared distance, alternation, reasons
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_squared_distance_matches_every_spelling(spelling: str) -> None:
    fn, expected_ops = SPELLINGS[spelling]
    g = trace(fn, F32_4x3, F32_4x3)
    m = match(sq_dist_pattern(), out(g, "Sum"))
    assert isinstance(m, Match) and m
    assert [op.name for op in m.ops] == expected_ops  # root first, pre-order
    # x and y are the broadcast slices of the two placeholders, in operand order.
    assert m["x"].op.type == "StridedSlice" and m["x"].op.inputs[0].op.name == "a"
    assert m["y"].op.inputs[0].op.name == "b"
    assert m["sum"] is m.root is out(g, "Sum")
    assert set(m.const_values) == {"axis"} and int(m.const_values["axis"]) == -1


def test_pow_two_traces_to_pow_not_square() -> None:
    """`(a - b) ** 2` is a Pow with a Const exponent 2.0; only `tf.square` gives Square."""
    g = trace(lambda a, b: (a - b) ** 2, F32_3, F32_3)
    types = [op.type for op in g.get_operations()]
    assert "Pow" in types and "Square" not in types
    m = match(Op("Square", Any()), out(g, "pow"))
    assert not m and m.reason == "root: expected Square, found Pow (`pow`)"
    m = match(Op("Pow", Any(), Const("e", value=2)), out(g, "pow"))
    assert m and m.const_values["e"].dtype == np.float32 and m.const_values["e"] == 2.0


def test_wrong_op_type_reason_names_op_and_expectation() -> None:
    g = trace(lambda a, b: tf.reduce_sum(a[:, None] * b[None], -1), F32_4x3, F32_4x3)
    m = match(Op("Sum", Op("Square|Pow", Any(), rest=True), Const()), out(g, "Sum"))
    assert isinstance(m, NoMatch) and not m
    assert m.reason == "`Sum` input 0: expected Square|Pow, found Mul (`mul`)"


def test_root_type_mismatch_and_oneof_reason_lists_alternatives() -> None:
    g = trace(lambda a, b: tf.reduce_sum(a[:, None] * b[None], -1), F32_4x3, F32_4x3)
    assert match(Op("Mean", Any(), Any()), out(g, "Sum")).reason == "root: expected Mean, found Sum (`Sum`)"
    reason = match(sq_dist_pattern(), out(g, "Sum")).reason
    assert reason == (
        "`Sum` input 0: no alternative matched: (1) expected Square, found Mul (`mul`); "
        "(2) expected Pow, found Mul (`mul`); (3) expected SquaredDifference, found Mul (`mul`)"
    )


def test_deepest_failure_is_reported() -> None:
    """`**3`: the Pow alternative gets furthest (down to the exponent), so its reason is shown."""
    g = trace(lambda a, b: tf.reduce_sum((a[:, None] - b[None]) ** 3, -1), F32_4x3, F32_4x3)
    reason = match(sq_dist_pattern(), out(g, "Sum")).reason
    assert "(2) `pow` input 1: expected constant 2, `pow/y:0` is 3.0" in reason
    assert "\n" not in reason


def test_deepest_failure_wins_over_the_first_one() -> None:
    """In order, Square fails at once on `a`; swapped, Square matches and Sub fails one level down."""
    g = trace(lambda a, b: a + tf.square(a * b), F32_3, F32_3)
    pat = Op("AddV2", Op("Square", Op("Sub", Any(), Any())), Any(), commutative=True)
    assert match(pat, out(g, "add")).reason == "`Square` input 0: expected Sub, found Mul (`mul`)"


def test_type_alternation_and_wildcard() -> None:
    def f(a, b3):
        return tf.matmul(a, a, transpose_b=True), tf.matmul(b3, b3, transpose_b=True)

    g = trace(f, F32_4x3, tf.TensorSpec([2, 4, 3], tf.float32))
    mm = Op("MatMul|BatchMatMulV2", Any("l"), Any("r"))
    found = find_all(mm, g)
    assert [m.root.op.type for m in found] == ["MatMul", "BatchMatMulV2"]
    assert all(m["l"] is m["r"] for m in found)
    assert len(find_all(Op("*", Any(), Any()), g)) == 2  # only the two matmuls have 2 inputs
    reason = match(Op("MatMul"), out(g, "MatMul")).reason
    assert reason == "root: `MatMul` (MatMul) has 2 inputs, pattern expects 0"


def test_rest_allows_extra_inputs() -> None:
    g = trace(lambda a: a[:, None], F32_4x3)
    t = out(g, "strided_slice")
    assert match(Op("StridedSlice", Any("x"), rest=True), t)["x"] is out(g, "a")
    assert match(Op("StridedSlice", Any("x")), t).reason == (
        "root: `strided_slice` (StridedSlice) has 4 inputs, pattern expects 1"
    )
    too_many = Op("StridedSlice", *[Any()] * 5, rest=True)
    assert "has 4 inputs, pattern expects at least 5" in match(too_many, t).reason


def test_output_index() -> None:
    g = trace(lambda a: tf.unstack(a, axis=1), F32_4x3)
    unpack = g.get_operation_by_name("unstack")
    assert match(Op("Unpack", Any(), output=1), unpack.outputs[1])
    assert match(Op("Unpack", Any(), output=1), unpack.outputs[2]).reason == (
        "root: expected output 1 of `unstack` (Unpack), found output 2"
    )
    assert len(find_all(Op("Unpack", Any()), g)) == 1  # output=0 by default
    assert len(find_all(Op("Unpack", Any(), output=None), g)) == 3


# ------------------------------------------------------------------------------------------------
# Captures: same tensor, backtracking, commutativity
# ------------------------------------------------------------------------------------------------


def test_same_tensor_constraint() -> None:
    g = trace(lambda x, y: (x - x, x - y), F32_3, F32_3)
    pat = Op("Sub", Any("x"), Any("x"))
    m = match(pat, out(g, "sub"))
    assert m and m["x"] is out(g, "x") and list(m.captures) == ["x"]
    m = match(pat, out(g, "sub_1"))
    assert not m and m.reason == "`sub_1` input 1: expected same tensor as capture x (`x:0`), found `y:0`"


def _commutative_graph() -> tuple[tf.Graph, tf.Tensor]:
    def f(v, w, k):
        m = v * w  # mul
        u = m * k  # mul_1
        return u + m  # add = AddV2(mul_1, mul)

    g = trace(f, F32_3, F32_3, F32_3)
    return g, out(g, "add")


def test_commutative_backtracks_captures_of_the_first_order() -> None:
    """In order, x binds `mul_1` and the Mul pattern then needs x again at `v`; swapped, x = `mul`."""
    g, add = _commutative_graph()
    inner = Op("Mul", Any("x"), Any("k"))
    plain = match(Op("AddV2", Any("x"), inner), add)
    assert not plain
    assert plain.reason == "`mul` input 0: expected same tensor as capture x (`mul_1:0`), found `v:0`"
    m = match(Op("AddV2", Any("x"), inner, commutative=True), add)
    assert m and m["x"] is out(g, "mul") and m["k"] is out(g, "k")
    assert [op.name for op in m.ops] == ["add", "mul_1"]


def test_oneof_backtracks_when_a_later_sibling_fails() -> None:
    """The first alternative fits input 0 locally but binds x wrongly; the second is then tried."""
    g = trace(lambda a: tf.square(a) - a, F32_3)
    pat = Op("Sub", OneOf(Any("x"), Op("Square", Any("x")), name="lhs"), Any("x"))
    m = match(pat, out(g, "sub"))
    assert m and m["x"] is out(g, "a") and m["lhs"] is out(g, "Square")
    assert [op.name for op in m.ops] == ["sub", "Square"]


_EXPRS = {
    "a": lambda a, b: a,
    "b": lambda a, b: b,
    "a*b": lambda a, b: a * b,
    "b*a": lambda a, b: b * a,
    "a-b": lambda a, b: a - b,
    "square(a)": lambda a, b: tf.square(a),
    "a*a": lambda a, b: a * a,
    "square(a-b)": lambda a, b: tf.square(a - b),
}


@functools.cache
def _sum_grid() -> dict[tuple[str, str], tf.Tensor]:
    """One graph holding p + q for every ordered pair of expressions, p and q shared."""
    grid: dict[tuple[str, str], tf.Tensor] = {}

    def f(a, b):
        exprs = {k: e(a, b) for k, e in _EXPRS.items()}
        for p, q in itertools.product(exprs, repeat=2):
            grid[p, q] = tf.raw_ops.AddV2(x=exprs[p], y=exprs[q])
        return tf.add_n(list(grid.values()))

    trace(f, F32_3, F32_3)
    return grid


_LEAF_PATTERNS = [Any(), Any("x"), Any("y"), Op("Placeholder"), Op("Placeholder", name="x")]
# Operand patterns shaped like the grid's expressions, so that matches (and asymmetric ones) are common.
_SHAPED_PATTERNS = [
    Op("Mul", Any("x"), Any("y")),
    Op("Mul", Any("x"), Any("x")),
    Op("Sub", Any("x"), Any("y")),
    Op("Square", Any("x")),
    Op("Square", Op("Sub", Any("x"), Any())),
]


def _check_commutative(p: str, q: str, lhs: Pattern, rhs: Pattern) -> tuple[bool, bool]:
    """Asserts the two properties; returns whether the plain pattern matched p+q and q+p."""
    grid = _sum_grid()
    comm = Op("AddV2", lhs, rhs, commutative=True)
    plain = Op("AddV2", lhs, rhs)
    pq, qp = grid[p, q], grid[q, p]
    in_order, swapped = bool(match(plain, pq)), bool(match(plain, qp))
    assert bool(match(comm, pq)) == bool(match(comm, qp)), (p, q, comm)  # a + b ~ b + a
    assert bool(match(comm, pq)) == (in_order or swapped), (p, q, comm)  # either order, nothing more
    return in_order, swapped


def test_commutative_is_symmetric_on_every_curated_case() -> None:
    operands = _LEAF_PATTERNS + _SHAPED_PATTERNS
    outcomes = collections.Counter(
        _check_commutative(p, q, lhs, rhs)
        for p, q in itertools.product(_EXPRS, repeat=2)
        for lhs, rhs in itertools.product(operands, repeat=2)
    )
    # Not vacuous: some cases match in only one order, so swapping is really exercised.
    assert outcomes[True, False] > 0 and outcomes[False, True] > 0 and outcomes[True, True] > 0


_operand_patterns = st.recursive(
    st.sampled_from(_LEAF_PATTERNS + _SHAPED_PATTERNS),
    lambda sub: st.one_of(
        st.builds(lambda a, b: Op("Mul", a, b), sub, sub),
        st.builds(lambda a, b: Op("Sub", a, b), sub, sub),
        st.builds(lambda s: Op("Square", s), sub),
    ),
    max_leaves=4,
)


@settings(max_examples=100, deadline=None)
@given(
    p=st.sampled_from(sorted(_EXPRS)),
    q=st.sampled_from(sorted(_EXPRS)),
    lhs=_operand_patterns,
    rhs=_operand_patterns,
)
def test_commutative_is_symmetric_on_random_deeper_patterns(p: str, q: str, lhs: Op, rhs: Op) -> None:
    _check_commutative(p, q, lhs, rhs)


def test_commutative_property_is_not_vacuous() -> None:
    """The grid above contains both matching and non-matching cases for a swapped pattern."""
    grid = _sum_grid()
    pat = Op("AddV2", Op("Square", Any("x")), Any("x"), commutative=True)
    assert match(pat, grid["a", "square(a)"]) and match(pat, grid["square(a)", "a"])
    assert not match(Op("AddV2", Op("Square", Any("x")), Any("x")), grid["a", "square(a)"])
    assert not match(pat, grid["b", "square(a)"])


# ------------------------------------------------------------------------------------------------
# Exclusive interior ops
# ------------------------------------------------------------------------------------------------


def test_exclusive_interior_without_extra_consumer_matches() -> None:
    g = trace(lambda a, b: tf.reduce_sum(tf.square(a[:, None] - b[None]), -1), F32_4x3, F32_4x3)
    m = match(sq_dist_pattern(exclusive=True), out(g, "Sum"))
    assert m and [op.name for op in m.ops] == ["Sum", "Square", "sub"]
    # The root op is exempt: Sum feeds the Identity outside the pattern, also when marked exclusive.
    root_exclusive = Op("Sum", Op("Square", Any(), exclusive=True), Const(), exclusive=True)
    assert match(root_exclusive, out(g, "Sum"))


def test_exclusive_interior_with_extra_consumer_fails_with_reason() -> None:
    def f(a, b):
        d = a[:, None] - b[None]
        return tf.reduce_sum(tf.square(d), -1), d * 2.0

    g = trace(f, F32_4x3, F32_4x3)
    m = match(sq_dist_pattern(exclusive=True), out(g, "Sum"))
    assert not m and m.reason == "`sub` (Sub) has a consumer outside the pattern: `mul`"
    assert m.outside_use                              # what a caller reads instead of the text
    assert match(sq_dist_pattern(exclusive=False), out(g, "Sum"))
    assert not match(Op("Mean", Any(), Any()), out(g, "Sum")).outside_use


def test_ignored_consumers_do_not_break_exclusivity() -> None:
    """A caller that rebuilds some readers (recorded gradients) names them in ``ignore``."""
    def f(a, b):
        d = a[:, None] - b[None]
        return tf.reduce_sum(tf.square(d), -1), d * 2.0

    g = trace(f, F32_4x3, F32_4x3)
    mul = g.get_operation_by_name("mul")
    assert match(sq_dist_pattern(exclusive=True), out(g, "Sum"), ignore={mul})
    assert not match(sq_dist_pattern(exclusive=True), out(g, "Sum"), ignore=set())


def test_exclusive_interior_returned_from_function_fails() -> None:
    g = trace(lambda a, b: (tf.reduce_sum(tf.square(a - b), -1), a - b), F32_4x3, F32_4x3)
    assert match(sq_dist_pattern(exclusive=True), out(g, "Sum"))  # the second a - b is another op

    def f(a, b):
        d = a - b
        return tf.reduce_sum(tf.square(d), -1), d

    g = trace(f, F32_4x3, F32_4x3)
    reason = match(sq_dist_pattern(exclusive=True), out(g, "Sum")).reason
    assert reason == "`sub` (Sub) has a consumer outside the pattern: `Identity_1`"


def test_exclusive_graph_output_without_consumer_fails() -> None:
    g = func_graph.FuncGraph("raw")
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [3], name="a")
        d = a - a
        s = tf.square(d)
    g.outputs = [s, d]
    reason = match(Op("Square", Op("Sub", Any(), Any(), exclusive=True)), s).reason
    assert reason == "`sub` (Sub) output 0 is a graph output"


def test_shared_interior_op_is_listed_once_and_stays_exclusive() -> None:
    """s + s: both operands match the same Square op; it appears once in ops and is still exclusive."""

    def f(a):
        s = tf.square(a)
        return s + s

    g = trace(f, F32_3)
    sq = Op("Square", Any("x"), name="s", exclusive=True)
    m = match(Op("AddV2", sq, sq), out(g, "add"))
    assert m and [op.name for op in m.ops] == ["add", "Square"] and m["s"] is out(g, "Square")


def test_exclusivity_failure_backtracks_into_another_alternative() -> None:
    def f(a):
        d = a - a
        return tf.square(d), d + 1.0

    g = trace(f, F32_3)
    pat = Op("Square", OneOf(Op("Sub", Any("p"), Any("p"), exclusive=True), Any("other")))
    m = match(pat, out(g, "Square"))
    assert m and "p" not in m and m["other"] is out(g, "sub")
    assert [op.name for op in m.ops] == ["Square"]


# ------------------------------------------------------------------------------------------------
# where= predicates
# ------------------------------------------------------------------------------------------------


def test_where_rank_failure_names_the_predicate() -> None:
    g = trace(lambda a, b: tf.reduce_sum(tf.square(a[:, None] - b[None]), -1), F32_4x3, F32_4x3)
    pat = Op("Sum", Op("Square", Op("Sub", Any(), Any(), where=has_rank(2))), Const())
    assert match(pat, out(g, "Sum")).reason == "`Square` input 0: `sub:0` (float32[4,4,3]) fails has_rank(2)"
    assert match(Op("Sum", Op("Square", Op("Sub", Any(), Any(), where=has_rank(3))), Const()), out(g, "Sum"))


def test_where_dtype_and_custom_predicates() -> None:
    g = trace(lambda a, b: a - b, F32_3, F32_3)
    sub = out(g, "sub")
    assert match(Op("Sub", Any(), Any(), where=has_dtype("float64", tf.float16)), sub).reason == (
        "root: `sub:0` (float32[3]) fails has_dtype(float64, float16)"
    )
    assert match(Op("Sub", Any(), Any(), where=has_dtype("float32")), sub)

    def is_huge(t: tf.Tensor) -> bool:
        return t.shape.num_elements() > 10**6

    class Described:
        description = "lives on TPU"

        def __call__(self, t: tf.Tensor) -> bool:
            return False

    preds = [is_floating(), static_shape(), is_huge]
    reason = match(Op("Sub", Any(), Any(where=preds)), sub).reason
    assert reason == "`sub` input 1: `b:0` (float32[3]) fails is_huge"
    assert match(Any(where=Described()), sub).reason == "root: `sub:0` (float32[3]) fails lives on TPU"


def test_shape_predicates_on_partial_shapes() -> None:
    g = trace(lambda a, i: (a * 2.0, i), tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([2], tf.int32))
    t, i = out(g, "mul"), out(g, "i")
    assert shape_like(None, 3)(t) and not shape_like(4, 3)(t) and not shape_like(None)(t)
    assert has_rank(2)(t) and not static_shape()(t) and static_shape()(i)
    assert is_floating()(t) and not is_floating()(i)
    assert "fails shape_like(4, 3)" in match(Any(where=shape_like(4, 3)), t).reason
    assert "(float32[?,3])" in match(Any(where=static_shape()), t).reason


# ------------------------------------------------------------------------------------------------
# Const
# ------------------------------------------------------------------------------------------------


def test_const_value_is_broadcasting_agnostic_but_not_shape_blind() -> None:
    def f(a):
        return a * tf.constant([[2.0]]), a * tf.constant([2.0, 2.0, 2.0]), a * tf.constant(float("nan"))

    g = trace(f, F32_3)
    scalar_2 = Op("Mul", Any(), Const("c", value=2))
    m = match(scalar_2, out(g, "mul"))
    assert m and m.const_values["c"].shape == (1, 1) and m["c"] is m.root.op.inputs[1]
    assert match(scalar_2, out(g, "mul_1")).reason == (
        "`mul_1` input 1: expected constant 2, `Const_1:0` is [2., 2., 2.]"
    )
    assert match(Op("Mul", Any(), Const(value=[2, 2, 2])), out(g, "mul_1"))
    assert match(Op("Mul", Any(), Const(value=np.nan)), out(g, "mul_2"))


def test_const_folds_what_constant_value_folds() -> None:
    g = trace(lambda a: tf.reshape(a, tf.raw_ops.Pack(values=[tf.constant(3), tf.constant(4)])), F32_4x3)
    shape = out(g, "Reshape").op.inputs[1]
    assert shape.op.type == "Pack"
    m = match(Op("Reshape", Any("x"), Const("shape")), out(g, "Reshape"))
    assert m and np.array_equal(m.const_values["shape"], [3, 4]) and m["shape"] is shape
    m = match(Op("Reshape", Const(), Any()), out(g, "Reshape"))
    assert m.reason == "`Reshape` input 0: expected a constant, `a:0` (Placeholder) is not statically known"


# ------------------------------------------------------------------------------------------------
# find_all, API details
# ------------------------------------------------------------------------------------------------


def test_find_all_counts_and_order() -> None:
    def f(a, b):
        s1 = tf.reduce_sum(tf.math.squared_difference(a[:, None], b[None]), -1)
        s2 = tf.reduce_sum((a - b) ** 2, -1)
        s3 = tf.reduce_sum(a * b, -1)
        s4 = tf.reduce_sum(tf.square(b[:, None] - a[None]), 1)
        return s1, s2, s3, s4

    g = trace(f, F32_4x3, F32_4x3)
    found = find_all(sq_dist_pattern(), g)
    assert [m.root.op.name for m in found] == ["Sum", "Sum_1", "Sum_3"]
    assert [int(m.const_values["axis"]) for m in found] == [-1, -1, 1]
    subs = find_all(Op("Sub", Any(), Any()), g)
    assert len(subs) == 2
    restricted = find_all(sq_dist_pattern(), g, ops=[g.get_operation_by_name("Sum_3")])
    assert [m.root.op.name for m in restricted] == ["Sum_3"]
    assert find_all(Any("t"), g, ops=[g.get_operation_by_name("a")])[0]["t"] is out(g, "a")


def test_match_and_nomatch_api() -> None:
    g = trace(lambda a: a - a, F32_3)
    m = match(Op("Sub", Any("x"), Any("x"), name="d"), out(g, "sub"))
    assert bool(m) is True and m["d"] is out(g, "sub") and "x" in m
    with pytest.raises(KeyError):
        m["nope"]
    nm = match(Op("Add", Any(), Any()), out(g, "sub"))
    assert bool(nm) is False and isinstance(nm.reason, str) and nm.reason


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="commutative"):
        Op("AddV2", Any(), commutative=True)
    with pytest.raises(ValueError, match="empty op type"):
        Op("MatMul|")
    with pytest.raises(TypeError, match="must be a Pattern"):
        Op("Sub", "x", Any())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callables"):
        Any(where=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        has_rank(-1)
    with pytest.raises(TypeError):
        has_dtype("float33")
