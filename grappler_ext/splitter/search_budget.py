"""How long one run of the splitter may search for a better plan than the one it built.

    may go on  <=>  elapsed <= max(Tuning.search_floor_s, Tuning.search_budget x longest whole compile)

The first call of a function is its trace, the splitter's search and XLA's compile of the result.
The search plans again against lower limits, along other sizes, with large joins, grows gradient
loops, and asks XLA for the program's figure before best efforts: each a compile of the whole
program, about the naive first call.  A Keras 3 translation Transformer's mixed-precision step
(12.6 s a compile) searched 523 s through 23 compiles and nine plans to end 0.8 % below its first
plan, over the limit either way.  So the search stops once it has taken a few such compiles; the
plan built by then stands, measured, and warned about if over.

A plan is sometimes built again (undone to try another way, then wanted after all): it is built
with the answers it got the first time (:meth:`SearchBudget.replay`), so that it is the same plan,
whose figures are known.  So planning another way costs a plan and, where it is not kept, the first
built again: it is started only where the budget leaves time for both, at the last plan's duration
(:meth:`SearchBudget.affords_another_plan`).  A Keras ViT's step on batches of run-time size took
about 30 s a plan: its first call spent 55 s on a plan along other sizes that was not kept, and the
first built again.

The clock makes the search depend on the machine and on what else it runs: the same program traced
again (``tf_memsafe.memory_footprint`` traces a function afresh; Keras traces a step again) could be
planned another way, so that the program measured or explained is not the one that runs.  So each
answer the clock gave is logged (:attr:`SearchBudget.decisions`), and a run of a program traced alike
before (:func:`grappler_ext.program_digest.graph_fingerprint`, with the same options) is given those
answers again in order (:meth:`SearchBudget.recall`): it takes the same path, to the same plan, its figures
remembered.  Past the answers recorded (a path that differs after all), the clock answers again.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from grappler_ext.program_digest import graph_fingerprint
from grappler_ext.splitter.tuning import Tuning

__all__ = ["Decision", "SearchBudget", "SearchMemo"]

Decision = tuple[bool, str | None]    # the clock's answer, and why it stopped the search (said once)


class SearchBudget:
    """One run's search budget: the time since it started, the longest compile of a whole program it
    measured, and the answers it gave while the plan being built was built."""

    def __init__(self, tuning: Tuning, on_stop: Callable[[str], None], memo: SearchMemo | None = None):
        self.tuning, self.on_stop, self.memo = tuning, on_stop, memo
        self.started, self.longest_compile = time.perf_counter(), 0.0
        self.stopped = False
        self.decisions: list[Decision] = []        # every answer of the clock's (or recorded), in order
        self._recorded: list[Decision] = []        # a search of the program before: its answers, given again
        self._searches: list[tuple[str, int]] = []  # each search's program and options: its key, first decision
        self.last_plan_s = 0.0                     # how long the last plan took to build
        self.log: list[bool] = []                  # the answers while the current plan was built
        self._replaying: list[bool] | None = None

    def recall(self, graph, options) -> None:
        """A search of ``graph`` (as traced, before the search changes it) with ``options`` starts: the
        answers a search of a program traced alike with those options gave before (in the memo), given
        again in order before the clock is asked."""
        if self.memo is None:
            return
        key = self.memo.key(graph, options)
        self._searches.append((key, len(self.decisions)))
        self._recorded = list(self.memo.recorded(key) or ())

    def remember(self) -> None:
        """The run is over: its searches' decisions go to the memo."""
        if self.memo is not None:
            self.memo.remember(self.searches())

    def searches(self) -> list[tuple[str, tuple[Decision, ...]]]:
        """Each search of the run (a plan at nominal sizes, then at the shapes as traced where that split
        nothing): its key, and what the budget decided in it."""
        ends = [start for _, start in self._searches[1:]] + [len(self.decisions)]
        return [(key, tuple(self.decisions[start:end])) for (key, start), end in zip(self._searches, ends)]

    def compiled(self, seconds: float) -> None:
        """A whole program's figure took ``seconds`` to measure."""
        self.longest_compile = max(self.longest_compile, seconds)

    def allows(self) -> bool:
        """Whether the run may still search; the first time it may not, ``on_stop`` gets why."""
        if self._replaying is not None:
            return self._replaying.pop(0) if self._replaying else False
        answer = self._within()
        self.log.append(answer)
        return answer

    def affords_another_plan(self) -> bool:
        """Whether the run may plan again another way: :meth:`allows`, and the budget leaves time for a
        plan as long as the last one built and for the first built again (where the other is not kept);
        the first time it does not, ``on_stop`` gets why, and the search stops."""
        if not self.allows():
            return False
        return self._decided(self._time_for_another_plan)

    def _time_for_another_plan(self) -> Decision:
        elapsed, budget = time.perf_counter() - self.started, self._budget()
        if elapsed + 2 * self.last_plan_s <= budget:
            return True, None
        return False, (f"searched for a plan for {elapsed:.0f} s of its budget of {budget:.0f} s: planning again "
                       f"another way would take about {2 * self.last_plan_s:.0f} s more (a plan took "
                       f"{self.last_plan_s:.0f} s, and the first is built again where the other is not smaller), "
                       "so the plan built stands, searched no further")

    def _budget(self) -> float:
        return max(self.tuning.search_floor_s, self.tuning.search_budget * self.longest_compile)

    def _within(self) -> bool:
        if self.stopped:
            return False
        return self._decided(self._time_left)

    def _time_left(self) -> Decision:
        t, elapsed = self.tuning, time.perf_counter() - self.started
        budget = self._budget()
        if elapsed <= budget:
            return True, None
        return False, (f"searched for a plan for {elapsed:.0f} s, over its budget of {budget:.0f} s "
                       f"({t.search_budget:g} x the longest compile of the program asked of XLA, "
                       f"{self.longest_compile:.1f} s, and at least {t.search_floor_s:g} s): the plan built so "
                       "far stands, searched no further (no plan again, no gradient loop grown)")

    def _decided(self, clock: Callable[[], Decision]) -> bool:
        """The recorded run's next answer, else the ``clock``'s; logged; a "no" stops the search, said."""
        answer, why = self._recorded.pop(0) if self._recorded else clock()
        self.decisions.append((answer, why))
        if not answer:
            self.stopped = True
            self.on_stop(why or "the search stopped")
        return answer

    @contextlib.contextmanager
    def replay(self, answers: list[bool] | None) -> Iterator[list[bool]]:
        """Within: a plan built, its answers logged into the list yielded; or, given ``answers`` (a plan
        built before), those answers given again in order."""
        saved, start = (self.log, self._replaying), time.perf_counter()
        self.log, self._replaying = [], None if answers is None else list(answers)
        try:
            yield self.log if answers is None else list(answers)
        finally:
            self.log, self._replaying = saved
            self.last_plan_s = time.perf_counter() - start


class SearchMemo:
    """What searches decided (:attr:`SearchBudget.decisions`), by the program and options they searched:
    the latest :attr:`KEPT`.  Shared by the threads that trace."""

    KEPT = 256

    def __init__(self):
        self._decided: collections.OrderedDict[str, tuple[Decision, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(graph, options) -> str:
        """A search's program (``graph`` as traced: its digest, names aside, shapes included) and options."""
        return graph_fingerprint(graph) + repr(options)

    def recorded(self, key: str) -> tuple[Decision, ...] | None:
        with self._lock:
            return self._decided.get(key)

    def remember(self, searches: list[tuple[str, tuple[Decision, ...]]]) -> None:
        with self._lock:
            for key, decisions in searches:
                self._decided[key] = decisions
                self._decided.move_to_end(key)
            while len(self._decided) > self.KEPT:
                self._decided.popitem(last=False)
