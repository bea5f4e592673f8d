"""chain_order: the dynamic programme against brute force, the tie-break and the reorder rule.

No TensorFlow: the cost model is a pure function of shapes.  Brute force here enumerates every
parenthesisation (Catalan(n - 1) of them: 42 for 6 factors) and costs it with its own code, so the
module's recurrence and its costing are both checked against something written independently.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grappler_ext.chain_order import (
    FLOP_MARGIN,
    Plan,
    choose_order,
    cost_of,
    format_tree,
    leaves,
    left_to_right,
    optimal_order,
    right_to_left,
)

PROPERTY = settings(max_examples=150, deadline=None)


def all_orders(i, j):
    """Every parenthesisation of factors i..j, as trees."""
    if i == j:
        return [i]
    return [(a, b) for k in range(i, j) for a in all_orders(i, k) for b in all_orders(k + 1, j)]


def brute_cost(tree, dims, batch=1, itemsize=4):
    """``(flops, sizes of the intermediates)`` of ``tree``, computed from the shapes it produces."""
    sizes = []

    def shape(t, is_root):
        if isinstance(t, int):
            return dims[t], dims[t + 1], 0
        (m, k, f1), (k2, n, f2) = shape(t[0], False), shape(t[1], False)
        assert k == k2
        if not is_root:
            sizes.append(batch * m * n * itemsize)
        return m, n, f1 + f2 + 2 * batch * m * k * n

    return shape(tree, True)[2], sizes


def brute_best(dims, batch=1, itemsize=4, cap=None):
    """The lexicographically smallest ``(flops, peak)`` over every order within ``cap``, or None."""
    keys = []
    for tree in all_orders(0, len(dims) - 2):
        flops, sizes = brute_cost(tree, dims, batch, itemsize)
        if cap is None or all(s <= cap for s in sizes):
            keys.append((flops, max(sizes, default=0)))
    return min(keys, default=None)


chains = st.lists(st.integers(1, 40), min_size=2, max_size=7)  # up to 6 factors
batches = st.integers(1, 3)


class TestTextbookExample:
    """d = [10, 100, 5, 50]: A0 [10, 100], A1 [100, 5], A2 [5, 50].

    ``(A0 A1) A2``: 10*100*5 = 5,000 multiplications for A0 A1 ([10, 5]), then 10*5*50 = 2,500:
    7,500 multiplications, 15,000 FLOPs; the intermediate [10, 5] in float32 is 200 B.
    ``A0 (A1 A2)``: 100*5*50 = 25,000 for A1 A2 ([100, 50]), then 10*100*50 = 50,000: 75,000
    multiplications, 150,000 FLOPs; intermediate [100, 50] = 20,000 B.  Ten times cheaper, 100 times
    smaller: the first order wins.
    """

    dims = [10, 100, 5, 50]

    def test_optimal_order(self):
        plan = optimal_order(self.dims)
        assert plan.tree == ((0, 1), 2)
        assert plan.flops == 2 * 7_500
        assert plan.peak_intermediate_bytes == plan.total_intermediate_bytes == 10 * 5 * 4

    def test_the_other_order(self):
        plan = cost_of(right_to_left(3), self.dims)
        assert plan.flops == 2 * 75_000 and plan.peak_intermediate_bytes == 100 * 50 * 4

    def test_batch_and_itemsize_scale_the_costs(self):
        plan = optimal_order(self.dims, batch=[2, 3], itemsize=8)
        assert plan.tree == ((0, 1), 2)
        assert plan.flops == 6 * 2 * 7_500 and plan.peak_intermediate_bytes == 6 * 10 * 5 * 8
        assert plan.batch == 6 and plan.itemsize == 8


class TestCormenExample:
    """CLRS 15.2: d = [30, 35, 15, 5, 10, 20, 25]; the optimum ((A0 (A1 A2)) ((A3 A4) A5)) costs
    15,125 multiplications: A1 A2 2,625, A0 (A1 A2) 5,250, A3 A4 1,000, (A3 A4) A5 5,000, and the last
    product [30, 5] x [5, 25] 3,750; 30,250 FLOPs."""

    def test_optimal_order(self):
        plan = optimal_order([30, 35, 15, 5, 10, 20, 25])
        assert plan.tree == ((0, (1, 2)), ((3, 4), 5))
        assert plan.flops == 2 * 15_125
        assert format_tree(plan.tree) == "((0 (1 2)) ((3 4) 5))"
        assert format_tree(plan.tree, "ABCDEF") == "((A (B C)) ((D E) F))"


class TestTieBreak:
    """d = [2, 3, 6, 3]: ``(A0 A1) A2`` costs 2 (2*3*6 + 2*6*3) = 144 FLOPs with a [2, 6] intermediate
    (48 B); ``A0 (A1 A2)`` costs 2 (3*6*3 + 2*3*3) = 144 FLOPs with a [3, 3] one (36 B).  Equal FLOPs:
    the smaller intermediate wins.  Mirrored, d = [3, 6, 3, 2], the left order wins."""

    def test_smaller_intermediate_wins(self):
        assert optimal_order([2, 3, 6, 3]).tree == (0, (1, 2))
        assert optimal_order([3, 6, 3, 2]).tree == ((0, 1), 2)
        assert cost_of(((0, 1), 2), [2, 3, 6, 3]).flops == cost_of((0, (1, 2)), [2, 3, 6, 3]).flops == 144

    def test_equal_flops_are_not_a_reason_to_reorder(self):
        decision = choose_order([2, 3, 6, 3], left_to_right(3))
        assert not decision.reorder
        assert decision.best.tree == (0, (1, 2)) and decision.best.flops == decision.current.flops
        assert decision.reason.startswith("already optimal order")

    def test_full_tie_takes_the_first_split(self):
        """All ones: every order costs 2 per product and every intermediate 4 B; the first split
        from the left at every level is ``(0 (1 (2 3)))``."""
        assert optimal_order([1] * 5).tree == right_to_left(4)

    @PROPERTY
    @given(chains, batches)
    def test_peak_is_minimal_among_the_cheapest(self, dims, batch):
        plan = optimal_order(dims, batch=batch)
        assert (plan.flops, plan.peak_intermediate_bytes) == brute_best(dims, batch)


class TestAgainstBruteForce:
    @PROPERTY
    @given(chains, batches)
    def test_fewest_flops(self, dims, batch):
        assert optimal_order(dims, batch=batch).flops == brute_best(dims, batch)[0]

    @PROPERTY
    @given(chains)
    def test_never_worse_than_either_fixed_order(self, dims):
        n = len(dims) - 1
        best = optimal_order(dims).flops
        assert best <= cost_of(left_to_right(n), dims).flops
        assert best <= cost_of(right_to_left(n), dims).flops

    @PROPERTY
    @given(chains, batches, st.data())
    def test_cost_of_agrees_with_brute_force(self, dims, batch, data):
        tree = data.draw(st.sampled_from(all_orders(0, len(dims) - 2)))
        plan = cost_of(tree, dims, batch=batch, itemsize=2)
        flops, sizes = brute_cost(tree, dims, batch, 2)
        assert (plan.flops, plan.peak_intermediate_bytes, plan.total_intermediate_bytes) == (
            flops, max(sizes, default=0), sum(sizes))

    @PROPERTY
    @given(chains, st.integers(0, 6000))
    def test_cap_on_intermediates(self, dims, cap):
        expected = brute_best(dims, cap=cap)
        if expected is None:
            with pytest.raises(ValueError, match="no order"):
                optimal_order(dims, max_intermediate_bytes=cap)
            return
        plan = optimal_order(dims, max_intermediate_bytes=cap)
        assert (plan.flops, plan.peak_intermediate_bytes) == expected
        assert plan.peak_intermediate_bytes <= cap


class TestReorderRule:
    """The rule: reorder iff FLOP_MARGIN times fewer FLOPs without a larger largest intermediate."""

    @PROPERTY
    @given(chains, batches, st.data())
    def test_rule_holds_for_any_written_order(self, dims, batch, data):
        current = data.draw(st.sampled_from(all_orders(0, len(dims) - 2)))
        d = choose_order(dims, current, batch=batch)
        assert d.current == cost_of(current, dims, batch=batch)
        assert d.best.flops <= d.current.flops
        assert d.best.peak_intermediate_bytes <= d.current.peak_intermediate_bytes
        assert d.reorder == (d.best.flops * FLOP_MARGIN <= d.current.flops)
        assert d.unconstrained.flops == brute_best(dims, batch)[0] <= d.best.flops

    def test_a_gain_below_the_margin_is_left_as_written(self):
        """d = [10, 10, 10, 12]: (A0 A1) A2 costs 2 (1,000 + 1,200) = 4,400 FLOPs; A0 (A1 A2)
        2 (1,200 + 1,200) = 4,800.  Written the other way, A0 (A1 A2), the cheaper order saves 8 %:
        below the margin, so the rounding stays as written."""
        d = choose_order([10, 10, 10, 12], (0, (1, 2)))
        assert not d.reorder and (d.current.flops, d.best.flops) == (4_800, 4_400)
        assert d.reason == "((0 1) 2) needs 4,400 FLOPs against 4,800: less than 1.5 x fewer, left as written"

    def test_low_rank_times_vector(self):
        """(A B) v, A [2000, 10], B [10, 2000], v [2000, 1].  Written: A B costs 2*2000*10*2000 =
        80,000,000 FLOPs and is [2000, 2000] = 16 MB in float32, then 2*2000*2000 = 8,000,000.
        Reordered: B v 2*10*2000 = 40,000 ([10, 1], 40 B), then A (B v) 40,000: 80,000 FLOPs."""
        d = choose_order([2000, 10, 2000, 1], left_to_right(3))
        assert d.reorder and d.best.tree == (0, (1, 2))
        assert (d.current.flops, d.best.flops) == (88_000_000, 80_000)
        assert (d.current.peak_intermediate_bytes, d.best.peak_intermediate_bytes) == (16_000_000, 40)
        assert d.reason == ("((0 1) 2) -> (0 (1 2)): 88,000,000 -> 80,000 FLOPs, "
                            "largest intermediate 16,000,000 -> 40 B")

    def test_cheaper_order_with_a_larger_intermediate_is_refused(self):
        """d = [10, 1, 10, 200].  Written (A0 A1) A2: 2 (100 + 20,000) = 40,200 FLOPs, intermediate
        [10, 10] = 400 B.  A0 (A1 A2): 2 (2,000 + 2,000) = 8,000 FLOPs but [1, 200] = 800 B: refused."""
        d = choose_order([10, 1, 10, 200], left_to_right(3))
        assert not d.reorder
        assert d.unconstrained.tree == (0, (1, 2)) and d.unconstrained.flops == 8_000
        assert "larger intermediate (800 > 400 B)" in d.reason

    def test_capped_optimum_between_the_two(self):
        """d = [2, 1, 2, 2, 5], float32; the rule takes a third order, neither written nor unconstrained.

        Written (((A0 A1) A2) A3): A0 A1 2*2*1*2 = 8 FLOPs ([2, 2], 16 B), times A2 16 ([2, 2], 16 B),
        times A3 2*2*2*5 = 40: 64 FLOPs, largest intermediate 16 B.
        Unconstrained (A0 ((A1 A2) A3)): A1 A2 8 ([1, 2], 8 B), times A3 20 ([1, 5], 20 B), A0 times
        that 20: 48 FLOPs, but 20 B > 16 B.
        Capped ((A0 (A1 A2)) A3): A1 A2 8 ([1, 2]), A0 times that 8 ([2, 2], 16 B), times A3 40:
        56 FLOPs within 16 B, cheaper than 64: the best within the cap (not taken: 64 / 56 is below
        FLOP_MARGIN).
        """
        d = choose_order([2, 1, 2, 2, 5], left_to_right(4))
        assert (d.current.flops, d.current.peak_intermediate_bytes) == (64, 16)
        assert (d.unconstrained.tree, d.unconstrained.flops, d.unconstrained.peak_intermediate_bytes) == (
            (0, ((1, 2), 3)), 48, 20)
        assert d.best.tree == ((0, (1, 2)), 3) and not d.reorder
        assert (d.best.flops, d.best.peak_intermediate_bytes) == (56, 16)


class TestTreesAndChecks:
    def test_fixed_orders(self):
        assert left_to_right(4) == (((0, 1), 2), 3)
        assert right_to_left(4) == (0, (1, (2, 3)))
        assert left_to_right(1) == right_to_left(1) == 0
        assert leaves(left_to_right(5)) == leaves(right_to_left(5)) == [0, 1, 2, 3, 4]

    def test_short_chains(self):
        assert optimal_order([3, 4]) == Plan(0, (3, 4), 1, 4, 0, 0, 0)
        plan = optimal_order([3, 4, 5])
        assert plan.tree == (0, 1) and plan.flops == 2 * 60 and plan.peak_intermediate_bytes == 0
        assert not choose_order([3, 4, 5], (0, 1)).reorder

    def test_catalan_count_of_brute_force(self):
        assert [len(all_orders(0, n - 1)) for n in range(1, 7)] == [math.comb(2 * k, k) // (k + 1) for k in range(6)]

    @pytest.mark.parametrize("tree", [(1, 0), ((0, 1), 3), (0, 1, 2), ((0, 1), (2,))])
    def test_tree_must_cover_the_factors_in_order(self, tree):
        with pytest.raises((ValueError, TypeError)):
            cost_of(tree, [2, 3, 4, 5])

    @pytest.mark.parametrize("dims", [[], [3], [3, -1], [3, True]])
    def test_bad_dims(self, dims):
        with pytest.raises((ValueError, TypeError)):
            optimal_order(dims)

    def test_bad_batch_and_itemsize(self):
        with pytest.raises(ValueError):
            optimal_order([2, 3], batch=-1)
        with pytest.raises(ValueError):
            optimal_order([2, 3], itemsize=0)
