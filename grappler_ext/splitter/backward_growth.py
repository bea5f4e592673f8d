"""Starved gradient loops grown into the room XLA's figure leaves (the splitter's last step of a plan).

A gradient loop whose forward region was planned by the memory model may be starved: many small
steps (:func:`.policy.starved`).  Once the plan is built and XLA's figure for the program as split is
known, the room it leaves under the limit (less ``Tuning.replan_margin``) is shared among the starved
loops, the plan is built again with it (their forward plans unchanged) and compiled again: kept where
XLA's figure is within the limit, else the first plan is built again from its answers (its figure
known).  A function of the driver's run (:class:`.driver._Run`), as :class:`.search.RegionSearch` is:
it reads and sets the run's state (``starved``, ``grow_room``, ``replayed``, ``pending``).
"""

from __future__ import annotations

from grappler_ext import graph_edit
from grappler_ext.measure import Figure
from grappler_ext.pass_base import PassResult
from grappler_ext.splitter import outcome
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
    loops = ", ".join(map(str, starved.values()))
    if room <= 0:
        # Over the limit by XLA's figure where the model put it within: the model's plan stands
        # (what the splitter could not split has been reported with the model's count).
        tried.skip([], f"gradient loops not grown: the model's plan gave them chunks of {loops}, and XLA's "
                       f"figure for the program as split, {figure.bytes:,} B, leaves no room under the limit less "
                       "its margin", code=Code.NOT_GROWN,
                   plan=Growth(tuple(starved.values()), room, figure.bytes))
        return tried, after, figure.bytes        # (over the limit, or within it by less than the margin)
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
        grown.skip([], f"gradient loops not grown: the model's plan gave them chunks of {loops}, and XLA's "
                       f"figures for them alone gave no larger chunk within the {room:,} B under the limit less "
                       "its margin", code=Code.NOT_GROWN,
                   plan=Growth(tuple(starved.values()), room, figure.bytes, grown_figure.bytes))
        return grown, grown_after, grown_figure.bytes if grown_figure.known else figure.bytes
    if grown_figure.known and grown_figure.bytes <= wanted:
        grown.skip([], f"gradient loops grown: the model's plan gave them chunks of {loops}, and XLA's figure "
                       f"for the program as split was {figure.bytes:,} B, {room:,} B under the limit less its "
                       f"margin; with that room, {grown_figure.bytes:,} B", code=Code.GROWN,
                   plan=Growth(tuple(starved.values()), room, figure.bytes, grown_figure.bytes))
        return grown, grown_after, grown_figure.bytes
    run.replayed = figure               # the first plan again (the same decisions): its figure is known
    try:
        again, after, _ = replan()
    finally:
        run.replayed = None
    shown = (f"{grown_figure.bytes:,} B, over the limit" if grown_figure.known else
             f"not checked with XLA: {grown_figure.failure}" if grown_figure.failure else "")
    again.skip([], f"gradient loops not grown: in the {room:,} B XLA's figure ({figure.bytes:,} B) left under the "
                   f"limit, the program as split was {shown}; planned as the model had it", code=Code.NOT_GROWN,
               plan=Growth(tuple(starved.values()), room, figure.bytes, grown_figure.bytes))
    return again, after, figure.bytes

