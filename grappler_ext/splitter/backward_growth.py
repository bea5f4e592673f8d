"""Starved gradient loops grown into the room XLA's figure leaves (the splitter's last step of a plan).

A gradient loop whose forward region was planned by the memory model may be starved: many small
steps (:func:`.policy.starved`).  Once the plan is built and XLA's figure for the program as split is
known, the room it leaves under the limit (less ``Tuning.replan_margin``) is shared among the starved
loops, the plan is built again with it (their forward plans unchanged) and compiled again: kept where
XLA's figure is within the limit, else the first plan is built again from its answers (its figure
known).  Where every starved loop computes its gradients as it goes, each is built again in its place
instead (:meth:`.search.RegionSearch.regrow`), and where the program grown is over the limit the growth
is undone, not the plan: the other loops and their gradients are not built again.  In a function of
run-time sizes, whose every shape is checked before it runs, a growth small against its room is not
compiled whole again at the nominal sizes: its figure is predicted from the loops' own figures
(``Tuning.growth_predicted``) and the program is measured where it runs.  A function of the
driver's run (:class:`.driver._Run`), as :class:`.search.RegionSearch` is: it reads and sets the run's
state (``starved``, ``regrowable``, ``search``, ``grow_room``, ``replayed``, ``pending``).
"""

from __future__ import annotations

from grappler_ext import graph_edit, graph_query
from grappler_ext.measure import Figure
from grappler_ext.pass_base import PassResult
from grappler_ext.splitter import analysis, outcome
from grappler_ext.splitter.outcome import Code, Growth

__all__ = ["grown"]


def grown(run, est, info, limit, mark, tried, after, measured):
    """The plan ``tried`` (built since the journal's ``mark``) again with its starved gradient loops
    grown into the room XLA's figure for it leaves under the limit, if that is within the limit;
    else ``tried`` as it was.  Returns the plan's records, the model's bytes and XLA's figure."""
    starved, wanted = run.starved, run.limit
    if not starved or any(r.code == Code.BEST_EFFORT for r in tried.records) or not run.searching():
        return tried, after, measured             # (best efforts: warned then)
    figure = Figure(measured) if measured is not None else run.figure()      # (known: remembered)
    if not figure.known:
        return tried, after, measured
    room = int(wanted * run.tuning.replan_margin) - figure.bytes
    if room <= 0:
        # Over the limit by XLA's figure where the model put it within: the model's plan stands
        # (what the splitter could not split has been reported with the model's count).
        tried.skip([], f"gradient loops not grown: the model's plan gave them chunks of {_chunks(starved)}, and "
                       f"XLA's figure for the program as split, {figure.bytes:,} B, leaves no room under the limit "
                       "less its margin", code=Code.NOT_GROWN,
                   plan=Growth(tuple(starved.values()), room, figure.bytes))
        return tried, after, figure.bytes        # (over the limit, or within it by less than the margin)
    in_place = _in_place(run, tried, after, figure, room)
    if in_place is not None:
        return in_place
    journal, first_warnings = graph_edit.active_journal(), list(run.pending)

    def replan():
        journal.undo(to=mark)
        again = PassResult(run.name)
        planned = run.split_large(est, info, limit, again)
        run.pending = first_warnings        # the first plan's warnings are the ones given
        return (again, *planned)

    run.grow_room = {name: (room // len(starved), chunk) for name, chunk in starved.items()}
    try:
        grown, grown_after, grown_measured = replan()
    finally:
        run.grow_room = {}
    grown_figure = Figure(grown_measured) if grown_measured is not None else run.figure()
    if outcome.loop_chunks(grown) == outcome.loop_chunks(tried):
        # (the loops alone gave no larger chunk for the room, or could not be measured: the same plan)
        _no_larger(grown, starved, room, figure, grown_figure.bytes)
        return grown, grown_after, grown_figure.bytes if grown_figure.known else figure.bytes
    if grown_figure.known and grown_figure.bytes <= wanted:
        _said_grown(grown, starved, room, figure, grown_figure)
        return grown, grown_after, grown_figure.bytes
    run.replayed = figure               # the first plan again (the same decisions): its figure is known
    try:
        again, after, _ = replan()
    finally:
        run.replayed = None
    _said_over(again, starved, room, figure, grown_figure)
    return again, after, figure.bytes


def _in_place(run, tried, after, figure: Figure, room: int):
    """:func:`grown` without planning again, where every starved loop computes its gradients as it goes
    (:class:`.search.Regrowable`): each built again in its place in the room, every other loop as it is
    (the plan again would keep them: their forward plans are unchanged), and the program measured
    again; kept where XLA's figure is within the limit, else undone, back to the plan as it was, whose
    figure is known.  The plan built again took a Transformer's training step half its trace (the tf.data
    step at batch 8: 111 s of 258 s, nine loops and their gradients built again for the loss' loop).

    ``None`` where that cannot be done (a starved loop of another kind, a region whose inputs a later
    loop replaced, a build that failed, or one that would read what the plan left unreachable: nothing
    changed then), for the plan built again."""
    starved, graph = run.starved, run.graph
    stashes = [run.regrowable.get(name) for name in starved]
    if run.search is None or any(s is None for s in stashes):
        return None
    journal = graph_edit.active_journal()
    mark, records, sized, spent = len(journal), list(tried.records), run.program_sized, dict(run.backward_bytes)
    live, existing = graph_query.live_ops(graph), set(graph.get_operations())

    def undone():
        journal.undo(to=mark)
        tried.records[:] = records
        run.program_sized, run.backward_bytes = sized, spent

    run.grow_room, run.grown_by = {name: (room // len(starved), chunk) for name, chunk in starved.items()}, {}
    try:
        grew = []
        for stash in stashes:
            grew.append(run.search.regrow(stash))
            if grew[-1] is None:
                break
    finally:
        run.grow_room = {}
    if None in grew:
        undone()                        # (not built again so: planned again instead)
        return None
    if not any(grew):
        _no_larger(tried, starved, room, figure)
        return tried, after, figure.bytes
    if (graph_query.live_ops(graph) - live) - (set(graph.get_operations()) - existing):
        undone()                        # (it would read what the plan left unreachable: planned again instead)
        return None
    planned = max((r.bytes_after or 0 for r in tried.rewritten), default=0)
    grown_after, bound = analysis.needed_now(graph, planned, run.loop_bytes)
    predicted = _predicted(run, [s.tensor.name for s, g in zip(stashes, grew) if g], figure)
    if predicted is not None:
        run.model_after = None if bound else grown_after
        _said_grown(tried, starved, room, figure, predicted=predicted)
        return tried, grown_after, predicted
    grown_figure = run.figure()
    if grown_figure.known and grown_figure.bytes <= run.limit:
        run.model_after = None if bound else grown_after
        _said_grown(tried, starved, room, figure, grown_figure)
        return tried, grown_after, grown_figure.bytes
    undone()
    _said_over(tried, starved, room, figure, grown_figure)
    return tried, after, figure.bytes


def _predicted(run, grown: list[str], figure: Figure) -> int | None:
    """The program with the loops of ``grown`` grown in place, by XLA's figure before (``figure``) plus
    what XLA's figures for those loops alone at the nominal sizes grew by, where it need not be compiled
    whole again: a function of run-time sizes whose every shape is checked before it runs
    (``PassOptions.checked_at_run``), every grown loop measured alone (sized by its own figures, or by
    the model's count and measured at both chunks), and ``Tuning.growth_predicted`` times their growth
    within the limit less ``Tuning.replan_margin``; else ``None`` (compiled again)."""
    if not run.predicts_growth() or not grown or any(n not in run.grown_by for n in grown):
        return None
    added = sum(run.grown_by[n] for n in grown)
    allowed = int(run.limit * run.tuning.replan_margin)
    if figure.bytes + run.tuning.growth_predicted * max(added, 0) > allowed:
        return None
    return figure.bytes + max(added, 0)


def _chunks(starved) -> str:
    return ", ".join(map(str, starved.values()))


def _no_larger(result, starved, room: int, figure: Figure, after: int | None = None) -> None:
    result.skip([], f"gradient loops not grown: the model's plan gave them chunks of {_chunks(starved)}, and XLA's "
                    f"figures for them alone gave no larger chunk within the {room:,} B under the limit less its "
                    "margin", code=Code.NOT_GROWN, plan=Growth(tuple(starved.values()), room, figure.bytes, after))


def _said_grown(result, starved, room: int, figure: Figure, grown: Figure | None = None,
                predicted: int | None = None) -> None:
    after = (f"{grown.bytes:,} B" if grown is not None else
             f"about {predicted:,} B (XLA's figures for the loops alone grew by {predicted - figure.bytes:,} B; the "
             "program is not compiled again at these sizes: it is checked at each shape it runs at)")
    result.skip([], f"gradient loops grown: the model's plan gave them chunks of {_chunks(starved)}, and XLA's "
                    f"figure for the program as split was {figure.bytes:,} B, {room:,} B under the limit less its "
                    f"margin; with that room, {after}", code=Code.GROWN,
                plan=Growth(tuple(starved.values()), room, figure.bytes, grown.bytes if grown is not None else None,
                            predicted))


def _said_over(result, starved, room: int, figure: Figure, grown: Figure) -> None:
    shown = (f"{grown.bytes:,} B, over the limit" if grown.known else
             f"not checked with XLA: {grown.failure}" if grown.failure else "")
    result.skip([], f"gradient loops not grown: in the {room:,} B XLA's figure ({figure.bytes:,} B) left under the "
                    f"limit, the program as split was {shown}; planned as the model had it", code=Code.NOT_GROWN,
                plan=Growth(tuple(starved.values()), room, figure.bytes, grown.bytes))
