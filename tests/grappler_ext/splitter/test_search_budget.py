"""A run's search budget (:mod:`grappler_ext.splitter.search_budget`), on a clock of its own."""

from __future__ import annotations

import pytest
import tensorflow as tf

from grappler_ext.splitter import search_budget
from grappler_ext.splitter.search_budget import SearchBudget, SearchMemo
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
    """A search of a program said yes, then stopped: the same program searched again with the same
    options is given the same answers in order and says the same reason, whatever the clock says now
    (within the budget); each logged.  Another program, or other options: the clock answers.  A search
    that recorded fewer answers than one asks for: the clock answers the rest."""
    memo, said = SearchMemo(), []
    program, other = tf.Graph(), tf.Graph()
    with program.as_default():
        tf.constant(1.0)
    with other.as_default():
        tf.constant(2.0)

    def searched(graph, options, answers, now=0.0):
        """A search of ``graph`` starting at ``now``: its answers to ``allows`` at 0 s, then at 11 s."""
        clock.now = now
        budget = SearchBudget(Tuning(search_floor_s=10.0), said.append, memo)
        budget.recall(graph, options)
        got = []
        for at in answers:
            clock.now = at
            got.append(budget.allows())
        budget.remember()
        return got, budget

    assert searched(program, "options", [0.0, 11.0])[0] == [True, False] and len(said) == 1
    got, again = searched(program, "options", [0.0, 0.0, 0.0])
    assert got == [True, False, False] and said[1] == said[0] and again.stopped
    assert searched(other, "options", [0.0, 0.0])[0] == [True, True]
    assert searched(program, "others", [0.0, 0.0])[0] == [True, True]
    memo.remember([(key, ((True, None),)) for key, _ in again.searches()])       # (one answer recorded)
    got, short = searched(program, "options", [11.0, 11.0])
    assert got == [True, False] and [answer for answer, _ in short.decisions] == [True, False]
