"""The chunk-size policy, without TensorFlow: fits the budget, the largest chunk whose remainder fits beside it."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grappler_ext.splitter.chunk_plan import ChunkPlan, NoPlan, plan_chunks


def test_worked_examples_of_the_docstring():
    assert plan_chunks(20000, 80e3, 10**6, 100 * 10**6) == ChunkPlan(20000, 1176, 95_080_000)
    plan = plan_chunks(20000, 80e3, 10**6, 100 * 10**6)
    assert (plan.steps, plan.tail) == (17, 8)
    plan = plan_chunks(20000, 80e3, 10**6, 81 * 10**6)
    assert (plan.chunk, plan.steps, plan.tail) == (1000, 20, 0)


def test_fits_whole_means_no_split():
    plan = plan_chunks(100, 10, 50, 10_000)
    assert plan.chunk == 100 and not plan.splits and plan.steps == 1 and plan.tail == 0


def test_impossible_budget_says_why():
    plan = plan_chunks(100, 1000, 5000, 5500)
    assert isinstance(plan, NoPlan) and not plan
    assert "even one slice needs 6000 bytes" in plan.reason


@pytest.mark.parametrize("bad", [dict(length=0), dict(bytes_per_unit=-1), dict(fixed_bytes=-1)])
def test_invalid_sizes(bad):
    args = dict(length=10, bytes_per_unit=1, fixed_bytes=0, budget_bytes=5) | bad
    with pytest.raises(ValueError):
        plan_chunks(**args)


@given(length=st.integers(1, 10**6), per_unit=st.integers(1, 10**6), fixed=st.integers(0, 10**9),
       budget=st.integers(1, 10**10))
def test_plan_fits_with_its_remainder_and_takes_the_largest_such_chunk_or_equal_ones(length, per_unit, fixed, budget):
    plan = plan_chunks(length, per_unit, fixed, budget)
    if not plan:
        assert fixed + per_unit > budget
        return
    assert 1 <= plan.chunk <= length
    assert plan.predicted_bytes == fixed + plan.chunk * per_unit <= budget
    largest = min(length, (budget - fixed) // per_unit)
    assert plan.steps * plan.chunk + plan.tail == length
    assert plan.chunk + plan.tail <= largest                   # the remainder fits beside a chunk
    # The largest such chunk, or, as many slices of it in equal chunks where they divide the axis.
    best = max(c for c in range(1, largest + 1) if c + length % c <= largest)
    slices = -(-length // best)
    assert plan.steps + (1 if plan.tail else 0) == slices
    assert plan.chunk == (length // slices if length % slices == 0 else best)
    fewest = math.ceil(length / largest)
    if largest >= (fewest + 1) ** 2:
        # Then chunks of floor(L / (fewest + 1)) leave under fewest + 1 rows, which fit beside them:
        # at most two iterations more than the fewest possible.
        assert plan.steps + (1 if plan.tail else 0) <= fewest + 2


def test_equal_chunks_where_as_many_slices_divide_the_axis():
    """668 rows of 4096 fit: 7 x 585 leaves 1 row, 8 slices either way, so 8 x 512 (no remainder)."""
    plan = plan_chunks(4096, 374_000, 0, 250_000_000)
    assert (plan.chunk, plan.steps, plan.tail) == (512, 8, 0)
    plan = plan_chunks(20000, 80_000, 10**6, 100 * 10**6)          # no equal split: the module's example
    assert (plan.chunk, plan.steps, plan.tail) == (1176, 17, 8)
