"""A run's search budget (:mod:`grappler_ext.splitter.search_budget`), on a clock of its own."""

from __future__ import annotations

import pytest

from grappler_ext.splitter import search_budget
from grappler_ext.splitter.search_budget import SearchBudget
from grappler_ext.splitter.tuning import Tuning


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(search_budget.time, "perf_counter", c)
    return c


def test_another_plan_is_started_only_with_time_for_it_and_for_the_first_built_again(clock):
    """10 s of budget: after a plan of 3 s, another (3 s, and the first again: 6 s) fits; after one of
    4 s at 7 s, it does not: said once, and the search stops."""
    said = []
    budget = SearchBudget(Tuning(search_floor_s=10.0), said.append)
    with budget.replay(None):
        clock.now = 3.0
    assert budget.last_plan_s == 3.0 and budget.affords_another_plan() and said == []
    with budget.replay(None):
        clock.now = 7.0
    assert not budget.affords_another_plan() and not budget.allows()
    (why,) = said
    assert why.startswith("searched for a plan for 7 s of its budget of 10 s: planning again another way would "
                          "take about 8 s more (a plan took 4 s"), why


def test_the_budget_is_its_floor_or_a_multiple_of_the_longest_compile(clock):
    said = []
    budget = SearchBudget(Tuning(search_floor_s=10.0, search_budget=4.0), said.append)
    budget.compiled(5.0)                                  # 4 x 5 s = 20 s
    clock.now = 19.0
    assert budget.allows()
    clock.now = 21.0
    assert not budget.allows() and not budget.allows() and len(said) == 1


def test_a_search_recalled_gives_its_answers_again_then_asks_the_clock(clock):
    """A search of the program before said yes, then stopped: recalled, the same answers in order and the
    same reason said, whatever the clock says now (within the budget); each logged.  A search that
    recorded fewer answers than this one asks for: the clock answers the rest."""
    first_said, again_said = [], []
    first = SearchBudget(Tuning(search_floor_s=10.0), first_said.append)
    first.recall(None)
    assert first.allows()
    clock.now = 11.0
    assert not first.allows() and len(first_said) == 1
    assert [answer for answer, _ in first.decisions] == [True, False]

    clock.now = 0.0
    again = SearchBudget(Tuning(search_floor_s=10.0), again_said.append)
    again.recall(tuple(first.decisions))
    assert again.allows() and not again.allows() and not again.allows()
    assert again_said == first_said and again.decisions == first.decisions and again.stopped

    clock.now = 0.0
    short = SearchBudget(Tuning(search_floor_s=10.0), again_said.append)
    short.recall(((True, None),))
    assert short.allows() and short.affords_another_plan()   # (the clock's: within, and time for a plan)
    clock.now = 11.0
    assert not short.allows() and [answer for answer, _ in short.decisions] == [True, True, True, False]
