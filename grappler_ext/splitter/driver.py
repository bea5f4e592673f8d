"""The splitter pass: for each large tensor, the best region around it, planned, built and checked.

:class:`Splitter` holds only what it was built with (a measurer, a tuning) and can be shared by
every thread that traces; each :meth:`Splitter.run` makes a :class:`_Run` that holds the state of
that one run (the memory model's figures, the loops built so far, the room given to starved
gradient loops) and is dropped after it.  The stages it calls: :mod:`.analysis` (roots and
regions; no input sliced along an axis :mod:`.sharding` pins), :mod:`.policy` (chunks and ranking),
:mod:`.measure` (XLA's figures, by the injected measurer), :mod:`.mechanism` (the loop built and installed).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

from grappler_ext import gradients, graph_edit, memory_model
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.measure import Figure, Measurer, program_figure
from grappler_ext.op_types import nbytes
from grappler_ext.pass_base import SKIPPED, GraphPass, Motive, PassOptions, PassResult, warn
from grappler_ext.pipeline import register_pass
from grappler_ext.splitter import analysis, mechanism, nested_loop, nesting, nominal, policy, rules, sharding
from grappler_ext.splitter.chunk_plan import ChunkPlan
from grappler_ext.splitter.outcome import CANNOT_SPLIT, Code, Growth, LoopPlan, Sizing, Why
from grappler_ext.splitter.tuning import DEFAULT_TUNING, Tuning

__all__ = ["Splitter"]


def _mb(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{n / 1e6:,.1f} MB"


def _loops(result: PassResult) -> str:
    """"1 loop", "3 loops": the loops ``result`` has built so far."""
    return f"{len(result.rewritten)} loop{'s' if len(result.rewritten) > 1 else ''}"


@register_pass
class Splitter(GraphPass):
    """Compute regions too large for the limit one slice at a time (see :mod:`grappler_ext.splitter`).

    Args:
      measurer: XLA's figures (:class:`~.measure.Measurer`); ``None`` plans by the memory model alone
        (as with ``Options.check_programs`` and ``calibrate_chunks`` off).
      tuning: the margins and limits (:class:`~.tuning.Tuning`).
    """

    name = "splitter"
    motive = Motive.LIMIT

    def __init__(self, measurer: Measurer | None = None, tuning: Tuning = DEFAULT_TUNING):
        if measurer is not None and not isinstance(measurer, Measurer):
            raise TypeError(f"measurer must have program_bytes(graph) and function_bytes(fn, specs), got {measurer!r}")
        if not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a splitter Tuning, got {type(tuning).__name__}")
        self.measurer, self.tuning = measurer, tuning

    def run(self, graph, options: PassOptions) -> PassResult:
        return _Run(self, graph, options).run()


class _Run:
    """One run of the splitter on one graph: everything it learns and builds on the way."""

    def __init__(self, splitter: Splitter, graph, options: PassOptions):
        self.name = splitter.name
        self.tuning = splitter.tuning
        self.graph = graph
        self.options = options
        self.limit = options.memory_limit_bytes          # the user's limit (plans may use a lower one)
        self.checker = splitter.measurer if options.check_programs else None
        self.calibrator = splitter.measurer if options.calibrate_chunks else None
        self.result = PassResult(self.name)
        self.grow_room: dict[str, tuple[int, int]] = {}  # large tensor -> (bytes, chunk) given to its gradient loop
        # Per plan (reset by _split_large).
        self.loop_bytes: dict[str, int] = {}             # a loop's planned body bytes, by its op's name
        self.program_sized = 0                           # loops sized by compiling them as the whole program
        self.starved: dict[str, int] = {}                # large tensor -> its starved gradient loop's chunk
        self.hoped: set = set()                          # tensors expected to be split by their own loops
        self.relaxed = False                             # regions with a large joined result allowed
        self.notes = PassResult(self.name)               # records of the run, beside the plan's
        self.pending: list[str] = []                     # the plan's warnings, given when the run ends
        self.entry_over: tuple | None = None   # (bytes as written, over the limit; by what; why)
        self.growth: nominal.Growth | None = None        # run-time dimensions: how the model's count grows
        self.replayed: Figure | None = None              # a plan built again: its figure, known

    def figure(self) -> Figure:
        return self.replayed or program_figure(self.checker, self.graph)

    # --- the program as a whole ------------------------------------------------------------------

    def run(self) -> PassResult:
        if self.limit is None:
            self.result.skip([], "no memory limit in bytes", code=Code.NO_LIMIT)
            return self.result
        est, info = memory_model.analyse(self.graph)
        if est.dynamic_tensors and nominal.dynamic_inputs(self.graph):
            if any(graph_edit.is_generated(name) for name in est.unknown_ops):
                # The pipeline's next iteration: planned (and warned about) when its loops were built.
                self.result.skip([], "dynamic shapes: its loops are already split, planned at a nominal size",
                                 code=Code.DYNAMIC_SHAPES)
                return self.result
            planned = self._run_nominal()
            if planned is not None:
                self._warn()
                return planned
        result = self._run(est, info)
        self._warn()
        return result

    def _run_nominal(self) -> PassResult | None:
        """The program planned at a nominal size for its dimensions known only at run time
        (:mod:`grappler_ext.shapes`), its loops taking their lengths from the shapes at run time;
        ``None`` (and the graph as it was) where that splits nothing."""
        at = nominal.Nominal(self.graph)                 # how its run-time sizes are read
        self.growth = nominal.growth(at.needs)
        size = None if self.growth is None else nominal.nominal_size(self.growth, at.needs, self.limit,
                                                                     self.tuning.dynamic_over)
        if size is None:
            return None
        inputs = nominal.dynamic_inputs(self.graph)
        shown = (", ".join(nominal.dimension(self.graph, t.name) for t in inputs[:3])
                 + (", ..." if len(inputs) > 3 else ""))
        with at.sizes(size):
            est, info = memory_model.analyse(self.graph)
            journal = graph_edit.active_journal()
            mark = len(journal) if journal is not None else None
            result = self._run(est, info)
        if not result.changed:
            if journal is not None:
                journal.undo(to=mark)
            self.result, self.notes, self.pending, self.entry_over = (PassResult(self.name), PassResult(self.name),
                                                                      [], None)
            return None
        note = result.skip([], f"dynamic shapes ({shown}): planned at {at.describe(size)} known only at run "
                               f"time, where what grows with them is {self.tuning.dynamic_over:g} x the limit; the "
                               "loops take their lengths from the shapes when the function runs",
                           code=Code.DYNAMIC_SHAPES)
        result.records.remove(note)
        result.records.insert(0, note)
        self.pending = [f"at {at.describe(size)} known only at run time ({shown}): {m}" for m in self.pending]
        return result

    def _run(self, est, info) -> PassResult:
        result, limit, t = self.result, self.limit, self.tuning
        # Loops of ours in it: the program was checked (and warned about) when they were built,
        # earlier in this pipeline's run; it is not compiled again to be judged.
        split_before = any(graph_edit.is_generated(name) for name in est.unknown_ops)
        if est.dynamic_tensors:
            # The function's own inputs first: what the user chose (a None in an input_signature).
            names = [t.name for t in nominal.dynamic_inputs(self.graph)] or list(est.dynamic_tensors)
            shown = ", ".join(nominal.dimension(self.graph, name) for name in names[:3])
            shown = f"dynamic shapes ({shown}{', ...' if len(names) > 3 else ''})"
            # The static tensors alone (the dynamic ones counted as empty) give a lower bound.
            at_least = max(analysis.floor(est, info), 0 if est.unknown_ops else
                           est.parameter_bytes + est.constant_bytes + est.live_peak_bytes)
            # Sizes decided inside the program (a sparse update's rows) leave its inputs static: XLA's
            # figure for it then decides, as for a program the model cannot estimate.
            figure = self.figure() if at_least <= limit and not split_before else Figure()
            if at_least <= limit and split_before:
                result.skip([], f"{shown}: its loops are already split; the static tensors left are within the "
                                "limit", code=Code.DYNAMIC_SHAPES)
                return result
            if at_least <= limit and not figure.over(limit):
                result.skip([], f"{shown}: left alone, within the limit by XLA's figure ({figure.bytes:,} B)"
                            if figure.known else f"{shown}: left alone{figure.note()}; give the tf.function an "
                            "input_signature with static shapes to split it", code=Code.DYNAMIC_SHAPES)
                if not figure.known and not analysis.creates_variables(self.graph):
                    # Neither can size it before it runs: the user is told, once a trace that will run.
                    self.pending.append(
                        f"`{self.graph.name}` has {shown}: its footprint cannot be checked against the limit of "
                        f"{_mb(limit)} before it runs, and nothing in it is split"
                        f"{nominal.growth_note(self.growth, self.limit)}. Give the tf.function an input_signature "
                        "with static shapes (or call it on tensors of one shape) to let tf_memsafe check and split it.")
                return result
            # Static tensors over the limit (attention scores beside the dynamic-size sparse update
            # of an embedding) are split; the dynamic ops stay as they are.
            over = (f"XLA's figure is {figure.bytes:,} B" if figure.known else
                    f"the rest needs at least {at_least:,} B")
            result.skip([], f"{shown}: left as they are; {over}, so the static tensors over the limit are split",
                        code=Code.DYNAMIC_SHAPES)
            self.entry_over = ((figure.bytes, "by XLA's figure") if figure.known else (
                at_least, "at least, by the memory model's count of its static tensors")) + (f"it has {shown}",)
        elif est.peak_bytes is not None and est.peak_bytes <= limit * t.model_trust:
            figure = self.figure() if est.peak_bytes >= t.check_from * limit else Figure()
            if not figure.over(limit):
                result.skip([], f"already within the limit: about {est.peak_bytes:,} B of {limit:,} B "
                                f"(memory model{figure.note()})", code=Code.WITHIN_LIMIT)
                return result
            # XLA's scheduler holds more at once than the model's schedule (independent branches
            # interleaved): plan against a limit scaled by the model's share of XLA's figure.
            planning = int(limit * est.peak_bytes / figure.bytes)
            result.skip([], f"the memory model's {est.peak_bytes:,} B is within the limit, but XLA's figure for "
                            f"the program as written is {figure.bytes:,} B: planned against {planning:,} B "
                            f"(the limit x {est.peak_bytes / figure.bytes:.2f})", code=Code.PLANNED_LOWER)
            self.entry_over = (figure.bytes, "by XLA's figure", f"the memory model counts {_mb(est.peak_bytes)}")
            limit = planning
        if est.peak_bytes is None and not est.dynamic_tensors:
            # No estimate (an op without a byte rule): split only what is over the limit on its own
            # terms -- the parameters, the outputs and the largest tensor together -- never a
            # program that may well fit.
            floor = analysis.floor(est, info)
            ours = bool(est.unknown_ops) and analysis.is_ours(est.unknown_ops)
            # Where the model cannot say (an op without a byte rule: a conditional, ...), XLA's figure
            # decides.
            figure = self.figure() if floor <= limit and not split_before else Figure()
            if floor <= limit and not figure.over(limit):
                why = "its loops are already split" if ours else f"the memory model cannot estimate it ({est.reason})"
                result.skip([], f"{why}; the largest tensor left with the inputs and outputs, {floor:,} B, is "
                                f"within the limit of {limit:,} B{figure.note()}", code=Code.NO_ESTIMATE)
                return result
            if figure.known:
                result.skip([], f"the memory model cannot estimate it ({est.reason}), and XLA's figure for the program "
                                f"as written is {figure.bytes:,} B, over the limit of {limit:,} B: its large tensors "
                                "are split", code=Code.OVER_BY_XLA)
                self.entry_over = (figure.bytes, "by XLA's figure", f"the memory model has no rule for it "
                                   f"({est.reason})")
        # Run outside a pipeline, the pass keeps a journal of its own, to plan again.
        own = graph_edit.journaled(graph_edit.Journal()) if graph_edit.active_journal() is None else \
            contextlib.nullcontext()
        with own:
            # A weight's update as values (a region may compute it slice by slice): kept if a loop is built.
            mark = mechanism.variables_as_values(self.graph, self.name, int(t.min_tensor_fraction * limit))
            if mark is not None:
                est, info = memory_model.analyse(self.graph)
            self._split(est, info, limit)
            if mark is not None and not result.changed:
                graph_edit.active_journal().undo(to=mark)
        if self.entry_over and not result.changed and not self.pending:
            # Over as written, and no loop built nor warning given on the way: never silently.
            figure, by, why = self.entry_over
            stuck = [r for r in result.records if r.code in CANNOT_SPLIT]
            what = (f"the splitter {stuck[0].reason[0].lower()}{stuck[0].reason[1:]}" if stuck
                    else "no tensor in it is large enough for a loop of its own")
            self.pending.append(
                f"`{self.graph.name}` needs {_mb(figure)} {by}, over its limit of {_mb(self.limit)}; "
                f"{why}, and {what}. It will run as well as it can; raise memory_limit, or compute that part in "
                "smaller pieces.")
        return result

    def _warn(self) -> None:
        """The plan's warnings, each once, pointing at the pipeline that ran the pass."""
        for message in dict.fromkeys(self.pending):
            warn(f"tf_memsafe: {message}", stacklevel=4)

    def _split(self, est, info, limit) -> None:
        """Split the large tensors planning against ``limit`` (:meth:`_planned`); where the limit
        cannot be met and a region was refused only because its joined result is large for the
        limit, plan again with such regions allowed and keep whichever program is smaller, so that
        a lower limit never leaves a larger program than a higher one would (best effort is
        monotonic).  Then record the plan and give its warnings, once."""
        journal = graph_edit.active_journal()
        result, wanted = self.result, self.limit
        mark = len(journal)
        tried, after, measured = self._planned(est, info, limit)
        failed = self.pending or (measured is not None and measured > wanted)
        def size(after, measured):
            """XLA's figure for the program as it stands (as measured, else asked now), else the model's."""
            figure = measured if measured is not None else self.figure().bytes
            return (figure if figure is not None else after), figure

        if failed and any(r.code == Code.JOINED_TOO_LARGE for r in tried.records):
            first_warnings = list(self.pending)
            first_bytes, _ = size(after, measured)
            journal.undo(to=mark)
            self.relaxed = True
            tried, after, measured = self._planned(est, info, limit)
            self.relaxed = False
            relaxed_bytes, figure = size(after, measured)
            smaller = relaxed_bytes is not None and (first_bytes is None or relaxed_bytes < first_bytes)
            if smaller:
                tried.skip([], f"the limit cannot be met: regions whose joined result is large for the limit "
                               f"allowed, {relaxed_bytes:,} B" + (f" (planned as usual: {first_bytes:,} B)"
                                                                  if first_bytes is not None else ""),
                           code=Code.LARGE_JOINS_ALLOWED)
                measured = figure if measured is None else measured
            else:
                journal.undo(to=mark)
                tried, after, measured = self._planned(est, info, limit)
                self.pending = first_warnings
        result.records += self.notes.records + tried.records
        if measured is not None and measured > wanted and not self.pending:
            result.skip([], f"XLA's figure as split is {measured:,} B, over the limit of {wanted:,} B, with "
                            "nothing left to split", code=Code.STILL_OVER)
            self.pending.append(
                f"`{self.graph.name}` needs {_mb(measured)} by XLA's figure as split, over its limit of "
                f"{_mb(wanted)} (the memory model counts {_mb(after)}); nothing left in it can be split "
                "usefully. It will run as well as it can; raise memory_limit.")

    def _planned(self, est, info, limit):
        """One plan, checked: the large tensors split against ``limit``; while XLA's figure for the
        program as split is over the user's limit, undone and planned again against a lower one
        (``Tuning.replans`` times at most), keeping the best; starved gradient loops grown.  Returns
        the plan's records, the model's bytes as split and XLA's figure (``None``: not measured);
        notes on the way go to ``self.notes``, warnings to ``self.pending``."""
        journal = graph_edit.active_journal()
        wanted, t = self.limit, self.tuning
        self.notes = PassResult(self.name)
        best = None                 # (XLA's figure, the planning limit) of the best plan measured
        for attempt in range(t.replans + 1):
            mark = len(journal)
            tried = PassResult(self.name)
            after, measured = self._split_large(est, info, limit, tried)
            if best is not None and measured is None:
                # A plan again that split less or warned is judged by XLA's figure like the one
                # before it (a Keras step planned against a lower limit: no loop at all, 54 MB).
                figure = self.figure()
                measured = figure.bytes if figure.known else best[0]
            if measured is None or measured <= wanted:
                break
            if best is not None and measured >= best[0]:
                # Smaller chunks did not help (what is over is not in a loop): the best plan again.
                journal.undo(to=mark)
                self.notes.skip([], f"planned against {limit:,} B, XLA's figure is {measured:,} B, no better: "
                                    f"planned against {best[1]:,} B again", code=Code.REPLAN_NO_BETTER)
                limit = best[1]
                tried = PassResult(self.name)
                after, measured = self._split_large(est, info, limit, tried)
                break
            best = (measured, limit)
            if attempt == t.replans:
                break
            # XLA packs the loops beside the rest of the program less tightly than the model counts:
            # the planning limit scaled by the share XLA's figure is over.
            lower = int(limit * wanted / measured * t.replan_margin)
            journal.undo(to=mark)
            self.notes.skip([], f"planned against {limit:,} B, with {_loops(tried)} XLA's figure is {measured:,} B, "
                                f"over the limit of {wanted:,} B: planned again against {lower:,} B",
                            code=Code.REPLANNED)
            limit = lower
        if measured is None or measured <= wanted:
            tried, after, measured = self._grown_backward(est, info, limit, mark, tried, after, measured)
        return tried, after, measured

    def _grown_backward(self, est, info, limit, mark, tried, after, measured):
        """The plan ``tried`` (built since the journal's ``mark``) again with its starved gradient loops
        grown into the room XLA's figure for it leaves under the limit, if that is within the limit;
        else ``tried`` as it was.  Returns the plan's records, the model's bytes and XLA's figure."""
        starved, wanted = self.starved, self.limit
        if not starved or any(r.code == Code.BEST_EFFORT for r in tried.records):   # (warned then)
            return tried, after, measured
        figure = Figure(measured) if measured is not None else self.figure()
        if not figure.known:
            return tried, after, measured
        room = int(wanted * self.tuning.replan_margin) - figure.bytes
        loops = ", ".join(map(str, starved.values()))
        if room <= 0:
            # Over the limit by XLA's figure where the model put it within: the model's plan stands
            # (what the splitter could not split has been reported with the model's count).
            tried.skip([], f"gradient loops not grown: the model's plan gave them chunks of {loops}, and XLA's "
                           f"figure for the program as split, {figure.bytes:,} B, leaves no room under the limit less "
                           "its margin", code=Code.NOT_GROWN,
                       plan=Growth(tuple(starved.values()), room, figure.bytes))
            return tried, after, measured
        journal = graph_edit.active_journal()

        first_warnings = list(self.pending)

        def replan():
            journal.undo(to=mark)
            again = PassResult(self.name)
            planned = self._split_large(est, info, limit, again)
            self.pending = first_warnings        # the first plan's warnings are the ones given
            return (again, *planned)

        self.grow_room = {name: (room // len(starved), chunk) for name, chunk in starved.items()}
        try:
            grown, grown_after, grown_measured = replan()
        finally:
            self.grow_room = {}
        grown_figure = Figure(grown_measured) if grown_measured is not None else self.figure()
        if grown_figure.known and grown_figure.bytes <= wanted:
            grown.skip([], f"gradient loops grown: the model's plan gave them chunks of {loops}, and XLA's figure "
                           f"for the program as split was {figure.bytes:,} B, {room:,} B under the limit less its "
                           f"margin; with that room, {grown_figure.bytes:,} B", code=Code.GROWN,
                       plan=Growth(tuple(starved.values()), room, figure.bytes, grown_figure.bytes))
            return grown, grown_after, grown_figure.bytes
        self.replayed = figure               # the first plan again (the same decisions): its figure is known
        try:
            again, after, _ = replan()
        finally:
            self.replayed = None
        shown = (f"{grown_figure.bytes:,} B, over the limit" if grown_figure.known else
                 f"not checked with XLA: {grown_figure.failure}" if grown_figure.failure else "")
        again.skip([], f"gradient loops not grown: in the {room:,} B XLA's figure ({figure.bytes:,} B) left under the "
                       f"limit, the program as split was {shown}; planned as the model had it", code=Code.NOT_GROWN,
                   plan=Growth(tuple(starved.values()), room, figure.bytes, grown_figure.bytes))
        return again, after, figure.bytes

    def _split_large(self, est, info, limit, result) -> tuple[int | None, int | None]:
        """One plan: split the program's large tensors, largest first, planning against ``limit``;
        warn if the model says the limit cannot be met.  Returns the model's bytes as split (``None``:
        nothing split) and XLA's figure for the program as split, where it was worth measuring and
        not measured within the limit already (``None`` otherwise)."""
        graph, t = self.graph, self.tuning
        self.loop_bytes, self.program_sized, self.starved, self.pending = {}, 0, {}, []
        live = live_ops(graph)
        # Gradients taken inside the function read the forward tensors; they are differentiated
        # again after a split (grappler_ext.gradients), so their ops do not hold a region back.
        backward: frozenset = frozenset()
        if gradients.records(graph):
            can, why = gradients.rebuildable(graph)
            if can:
                backward = frozenset(gradients.backward_ops(graph) & live)
            else:
                result.skip([], f"gradients inside the function stay as traced: {why}", code=Code.GRADIENTS_AS_TRACED)
        order = topological_order(graph, live)
        order_index = {op: i for i, op in enumerate(order)}

        def large(t_):
            return (i := info.get(t_.name)) is not None and i.materialised and i.bytes \
                and i.bytes > t.min_tensor_fraction * limit

        # Large materialised tensors, largest first; each gets at most one loop.
        tensors = sorted((x for op in order if not graph_edit.is_generated(op)
                          and op.type not in ("Placeholder", "Const", "ReadVariableOp") and op not in backward
                          for x in op.outputs if large(x)), key=lambda x: -info[x.name].bytes)
        done: set = set()
        after = None          # the model's bytes after the latest rewrite (the graph changes only there)
        trust_model = True    # stop once the model puts the program within the limit
        checked = False       # XLA's figure for the program as split measured, within the limit
        # Each region plans beside what the rest of the program holds while it runs, counting the large
        # tensors not yet tried as split too (their own regions will plan beside this one's loop).
        # Large gradient tensors go with them: the gradients are rebuilt through the loops.
        self.hoped = {x.name for x in tensors} | {x.name for op in backward for x in op.outputs if large(x)}
        step_of = {step.op: i for i, step in enumerate(est.schedule)}
        region = _Region(self, est, info, step_of, order_index, backward, limit, result)
        for tensor in tensors:
            if tensor.op in done or tensor.op not in order_index:
                continue
            outcome = region.split_around(tensor)
            if outcome is None:
                self.hoped.discard(tensor.name)
                continue
            done |= outcome
            analysis.forget_dead(order_index, graph)
            planned = max((r.bytes_after or 0 for r in result.rewritten), default=0)
            after, bound = analysis.needed_now(graph, planned, self.loop_bytes)
            if after <= limit * t.model_trust and trust_model:      # as a program left alone must
                # Checked with XLA like a program left alone (always where the model's count is only a
                # lower bound); if over, the model's word is not taken again: every large tensor left is split.
                figure = self.figure() if after >= t.check_from * limit or bound else Figure()
                if not figure.over(self.limit):
                    checked = figure.known
                    break
                trust_model = False
                result.skip([], f"with {_loops(result)} the memory model counts {after:,} B, but XLA's figure is "
                                f"{figure.bytes:,} B, over the limit: the large tensors left are split too",
                            code=Code.CHECKED_OVER)
        # A tensor no root of its own could split may still have been split by a later, larger
        # region (SGPR's test-point solves, inside the predictive mean's loop): no record then.
        done_names = {op.name for op in done}
        result.records = [r for r in result.records if not (
            r.action == SKIPPED and r.ops and r.code in CANNOT_SPLIT | {Code.FITS_WHOLE} and set(r.ops) <= done_names)]
        failed = [r for r in result.records if r.code in CANNOT_SPLIT or r.code == Code.BEST_EFFORT]
        worst = max(failed, key=lambda r: r.bytes_before or 0) if failed else None
        needed = est.peak_bytes if est.peak_bytes is not None else (worst.bytes_before if worst else None)
        if worst is not None and after is not None and after <= limit:
            worst = None       # what was split took the rest with it
        if worst is not None and needed is not None and needed > limit:
            self._warn_cannot_fit(est, worst, needed, after, limit, result)
            return after, None
        if after is None or checked or (trust_model and after < t.check_from * limit) or (
                self.program_sized and self.program_sized == len(result.rewritten)):
            # Nothing split, measured within the limit already, far below it by the model's count, or
            # every loop sized by compiling it as the whole program.
            return after, None
        figure = self.figure()
        if after > limit:
            self._said_within(after, figure, result)
        return after, figure.bytes

    def _said_within(self, after, figure, result) -> bool:
        """Whether XLA's figure puts the program as split within the limit the model's count is over;
        the record saying so (``explain()`` then says why no warning was given)."""
        if within := figure.known and figure.bytes <= self.limit:
            result.skip([], f"the memory model counts {_mb(after)} as split, over the limit, but XLA's figure "
                            f"is {figure.bytes:,} B: within it", code=Code.CHECKED_WITHIN)
        return within

    def _warn_cannot_fit(self, est, worst, needed, after, limit, result) -> None:
        """XLA's figure has the last word; if it is over too (or unknown), one warning (pending until
        the run ends): what the program needs, the limit, and the record that could not be helped."""
        # The model's count of a program this far from it is the least sure (a Transformer's training
        # step at L = 16384: 4.7 GB by the model, 1.9 GB by XLA; at nominal sizes, none: not shown).
        if self._said_within(after, figure := self.figure(), result):
            return
        how = "needs about" if est.peak_bytes is not None else "needs at least"
        scaled = ("" if limit == self.limit else
                  f" (the limit of {_mb(self.limit)} scaled to the model's count by XLA's figure)")
        xla = f"{_mb(figure.bytes)} by XLA's figure" if figure.known else ""
        then = f" ({_mb(after)} as split{', ' + xla if xla else ''})" if after is not None and not self.growth else (
            f" ({xla} as split)" if xla else "")
        what = (f"the splitter {worst.reason[0].lower()}{worst.reason[1:]}" if worst.action == SKIPPED
                else f"the splitter could only reduce it: {worst.reason}")
        need = (f"needs {_mb(self.entry_over[0])} by XLA's figure as written" if est.peak_bytes is None
                and self.entry_over is not None else f"{how} {_mb(needed)} by the memory model")
        self.pending.append(
            f"`{self.graph.name}` {need}{then}, over its limit of "
            f"{_mb(limit)}{scaled}, and {what}. It will run as well as it can; raise memory_limit, or rewrite "
            "that op's input in smaller pieces.")


class _Region:
    """One plan's search and build of a loop around each large tensor (the state of :meth:`_Run._split_large`)."""

    def __init__(self, run: _Run, est, info, step_of, order_index, backward, budget, result):
        self.run, self.tuning, self.est, self.info, self.step_of = run, run.tuning, est, info, step_of
        self.order_index, self.backward, self.budget, self.result = order_index, backward, budget, result
        self.graph_outputs = {t.ref() for t in getattr(run.graph, "outputs", [])}
        self.reseed = rules.Reseed() if run.options.redraw_random else None

    def beside(self, tensor) -> policy.Beside:
        return policy.Beside(self.est, self.info, self.step_of, frozenset(self.run.hoped), self.backward,
                             self.run.grow_room.get(tensor.name, (0, 0)))

    def split_around(self, tensor) -> set | None:
        """Find the best root downstream of ``tensor`` and split it; the ops removed, or ``None``."""
        run, t, info, reasons, beside = self.run, self.tuning, self.info, [], self.beside(tensor)
        near = analysis.downstream(tensor.op, self.order_index, t.root_depth)
        candidates = [[option] for root in near for option in analysis.root_options(root, self.backward)]
        candidates += analysis.together(tensor, self.order_index, self.graph_outputs, self.backward)
        best = self.best_root(candidates, tensor, beside, reasons)
        if best is None or best.planned.best_effort is not None or not best.planned.chunks.splits:
            # No root nearby meets the limit: the region that does may end farther down (SGPR's
            # predictive density reads the test points' kernel matrix 14 ops later).  Only roots
            # whose joined result could be planned at all (see policy.plan): the wider search
            # reaches hundreds of ops in a Transformer's training step.
            seen = set(near)
            far = [[option] for root in analysis.downstream(tensor.op, self.order_index, t.root_depth_wide)
                   if root not in seen for option in analysis.root_options(root, self.backward)
                   if analysis.joined_bytes([option]) <= self.budget / 2]
            wider = self.best_root(far, tensor, beside, reasons)
            if wider is not None and (best is None or wider.key < best.key):
                best = wider
        if best is not None and best.planned.chunks.splits:
            best = self.reaching_on(best, tensor, beside, reasons)
        if best is not None and best.planned.best_effort is not None and not self.backward:
            best = self.nested(best, beside) or best
        size = info[tensor.name].bytes
        if best is None:
            why = (min(reasons, key=lambda r: r.code != Code.SHARDED_AXIS) if reasons   # a mesh's axis first
                   else Why(Code.NO_ROOT, "no op downstream reduces it or has a split rule"))
            self.result.skip([tensor.op], f"cannot split `{tensor.op.name}` ({size:,} B): {why.text}",
                             bytes_before=size, code=why.code)
            return None
        options, grown, planned = best.options, best.grown, best.planned
        chunks, backward_chunk, per_unit = planned.chunks, planned.backward_chunk, planned.per_unit
        if not chunks.splits:
            # The planner's count says the region fits whole, while the program's estimate does not:
            # say so (the run's warning then names it) rather than leave it silently.
            self.result.skip([tensor.op], f"cannot split `{tensor.op.name}` ({size:,} B) usefully: its region fits "
                                          f"the limit whole by the planner's count ({chunks.predicted_bytes:,} B)",
                             bytes_before=size, code=Code.FITS_WHOLE)
            return None
        sized = policy.Sized(chunks, per_unit, Sizing.MODEL)
        fusable = self.backward and mechanism.fusable(run.graph, options, grown.region, chunks.length,
                                                      backward_chunk)
        # (a recomputation's two steps stay; a fused loop's chunk is the gradient's, grown by its own figure)
        if run.calibrator is not None and chunks.steps >= 2 and not best.remat and not fusable:
            sized = policy.calibrated(options, grown, chunks, beside, self.budget, t,
                                      lambda c: mechanism.loop_figure(run.calibrator, options, grown.region, c),
                                      large_joins=run.relaxed, model_per_unit=per_unit)
            if sized.sizing in (Sizing.LOOP_FIGURE, Sizing.PROGRAM_FIGURE):
                chunks, per_unit = sized.chunks, sized.per_unit
                backward_chunk = min(backward_chunk, chunks.chunk)
        if self.backward:
            # The program holds its forward activations for the gradients, and XLA's layout copies of
            # them, beyond the model's count: a slice takes at most a share of the budget.
            chunks = policy.capped(chunks, per_unit, self.budget, t)
            backward_chunk = min(backward_chunk, chunks.chunk)
        draws = self.reseed is not None and any(rules.redrawn(op) for op in grown.region.ops)
        fused = chunks.chunk if fusable else None                       # the forward's chunk
        if fused and run.calibrator is not None and tensor.name in run.grow_room:    # grown by its own figure
            backward_chunk = policy.fused_grown(run.grow_room[tensor.name], chunks.length, analysis.top_k(options), t,
                lambda c: mechanism.loop_figure(run.calibrator, options, grown.region, c, fused=True)) or backward_chunk
        if (draws and backward_chunk < chunks.chunk) or (fused and backward_chunk != chunks.chunk):
            # A draw keys on its slice's offset, and a fused loop holds a slice's gradient: the gradient's chunks.
            chunks = ChunkPlan(chunks.length, backward_chunk,
                               int(chunks.predicted_bytes - (chunks.chunk - backward_chunk) * per_unit))
        if grown.region.written_into:                    # no remainder slice (see policy.without_tail)
            chunks = policy.without_tail(chunks, per_unit)
        return self.build(tensor, best, chunks, backward_chunk, per_unit, sized, draws, fused)

    def build(self, tensor, best, chunks, backward_chunk, per_unit, sized, draws, fused=None) -> set | None:
        """The loop of ``best`` in ``chunks`` built and installed; the ops it removed, or ``None``
        (``fused``: the forward's own chunk, where the loop computes the gradients as it goes)."""
        run, graph, options, grown = self.run, self.run.graph, best.options, best.grown
        roots = [o.root for o in options]
        existing = set(graph.get_operations())
        if grown.region.scaled is not None:     # its chunk from the room the run's sizes leave
            grown.region.scaled.room(self.budget, chunks.predicted_bytes - chunks.chunk * per_unit, per_unit)
        try:
            with graph_edit.building(graph, run.name):
                if draws:
                    # One seed a call, outside the loop: its slices' draws, forward and gradient, key on it.
                    self.reseed.tensor = mechanism.call_seed()
                tiled = mechanism.tiles(options, grown.region, chunks, backward_chunk, fused is not None)
                outputs = mechanism.build(options, grown.region, chunks, backward_chunk, fused is not None, tiled)
        except (ValueError, TypeError, KeyError, NotImplementedError) as e:
            self.result.skip(roots, f"building the loop failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                             code=Code.BUILD_FAILED)
            return None
        mechanism.install(graph, run.name, roots, outputs, self.graph_outputs, grown.region.ops)
        forward_loops = mechanism.new_loops(graph, existing)
        try:
            rebuilt = mechanism.rebuild_gradients(graph, run.name, grown.included, grown.region) if self.backward else 0
        finally:
            # The call's seed is this loop's (its gradient keyed on it too): a later region's loop,
            # compiled alone to size it, draws with a fixed key instead (see rules.Reseed).
            if self.reseed is not None:
                self.reseed.tensor = None
        # What each loop's body holds, for the memory model's view of the program as rewritten.
        joined = sum(nbytes(x) for r in roots for x in r.outputs)      # the result, written as it goes
        room = run.grow_room.get(tensor.name, (0, 0))
        for op in forward_loops:     # a fused loop: a slice and its gradient, and the inputs' gradients
            run.loop_bytes[op.name] = int(chunks.chunk * per_unit) + joined if fused is None else int(max(
                room[1] * best.planned.backward_unit, chunks.chunk * best.planned.backward_unit - room[0])) + sum(
                nbytes(r.deref()) for r in set(grown.region.sliced_inputs) | grown.region.whole_inputs)
        backward_loops = mechanism.new_loops(graph, existing | set(forward_loops))
        for op in backward_loops:
            # Grown into room the model did not see: counted as the rest less that room.
            run.loop_bytes[op.name] = int(max(room[1] * best.planned.backward_unit,
                                              backward_chunk * best.planned.backward_unit - room[0]))
        gradient_loop = (bool(backward_loops) and backward_chunk < chunks.chunk) or (
            fused is not None and backward_chunk < fused)
        if gradient_loop and not room[0] and policy.starved(chunks, backward_chunk, self.tuning, fused):
            run.starved[tensor.name] = backward_chunk
        if sized.sizing == Sizing.PROGRAM_FIGURE:
            run.program_sized += 1
        plan = LoopPlan(tuple(o.split for o in options), chunks.length, chunks.chunk, backward_chunk,
                        chunks.predicted_bytes, has_gradient_loop=gradient_loop, sizing=sized.sizing,
                        sizing_detail=sized.detail, bytes_per_row=sized.bytes_per_row,
                        loop_figure_bytes=sized.loop_figure_bytes, best_effort=best.planned.best_effort,
                        rebuilt_gradients=rebuilt, prologue_ops=tuple(op.name for op in grown.region.prologue),
                        dynamic=grown.region.dynamic, fused=fused is not None, tiles=tiled and tiled[0].count(tiled[1]),
                        written_into=mechanism.written_variables(graph, grown.region))
        self.result.rewrote(roots + grown.region.ops, plan.render(),
                            bytes_before=analysis.materialised_bytes(grown.included, self.info),
                            bytes_after=chunks.predicted_bytes,
                            code=Code.BEST_EFFORT if plan.best_effort is not None else Code.SPLIT, plan=plan)
        return grown.included | set(grown.region.prologue)

    def nested(self, best: _Candidate, beside: policy.Beside) -> _Candidate | None:
        """``best`` with its attention computed over key blocks in each slice (:mod:`.nesting`), where
        that plan, sized by XLA's figure for its loop, is better; else ``None``."""
        nest = nesting.attention_within(best.grown, self.graph_outputs, self.order_index)
        if isinstance(nest, Why) or self.run.calibrator is None:
            return None
        grown = nested_loop.nested(best.grown, nest, nested_loop.key_chunk(nest.keys))
        planned = policy.nested_plan(best.options, grown, beside, self.budget, self.tuning, lambda c: (
            mechanism.loop_figure(self.run.calibrator, best.options, grown.region, c)))
        if isinstance(planned, Why) or (planned.best_effort is not None and planned.chunks.predicted_bytes
                                        >= best.planned.chunks.predicted_bytes):
            return None
        return _Candidate(best.key, best.options, grown, planned, False)

    def reaching_on(self, best: _Candidate, tensor, beside: policy.Beside, reasons: list[Why]) -> _Candidate:
        """``best``, or the region reaching on from its joined results along the same axis to where
        that axis ends (one loop per encoder layer: :func:`.analysis.reaching_on`), if it takes in
        every op ``best`` does and is the better plan (:func:`.policy.reaches_on`)."""
        further = analysis.reaching_on(best.options, self.order_index, self.graph_outputs, self.backward)
        wider = self.best_root(further, tensor, beside, reasons) if further else None
        if (wider is None or not best.grown.included <= wider.grown.included
                or not policy.reaches_on(best.planned, wider.planned, self.tuning, policy.leaves(best.grown, beside))):
            return best
        return wider

    def best_root(self, candidates, tensor, beside: policy.Beside, reasons: list[Why]) -> _Candidate | None:
        """The best plan among ``candidates`` (lists of root options split together) whose region
        takes ``tensor`` in, or ``None``; why the others fail is appended to ``reasons``."""
        t, best = self.tuning, None
        for options in candidates:
            # (a region computing a weight's update takes in the gradients it reads)
            ignored = frozenset() if analysis.updates_from(options, self.order_index, self.backward) else self.backward
            grown = analysis.grow(options, self.graph_outputs, self.order_index, ignored, self.reseed,
                                  sharding.pinned_axes(self.run.graph, self.run.options))
            if isinstance(grown, Why):
                reasons.append(grown)
                continue
            if tensor.op not in grown.included:
                if grown.stops:
                    reasons.append(grown.stops[0])
                continue
            grown.region.written_into = analysis.written_into(options, grown, self.order_index)
            grown.region.prologue = analysis.prologue(grown, self.order_index, self.graph_outputs, ignored,
                                                      t.slice_share * self.budget, t.prologue_share,
                                                      t.prologue_ops, t.prologue_min_bytes)
            # (the gradients a weight's update reads are in its region: no backward is left to plan)
            planned = policy.plan(options, grown, beside if ignored else dataclasses.replace(beside, backward=ignored),
                                  self.budget, t, large_joins=self.run.relaxed)
            if isinstance(planned, Why):
                reasons.append(planned)
                continue
            held = analysis.held_for_backward(grown, self.info, self.backward,
                                              {o.root for o in options if o.kind == "concat"})
            remat = policy.remat_worthwhile(planned.chunks, held, self.budget, t)
            if remat:
                # The region fits whole, but the gradients inside the function hold its tensors from
                # the forward to the backward: a loop recomputes them there instead.
                chunks = policy.split_anyway(planned.chunks, planned.per_unit)
                planned = policy.Planned(chunks, min(planned.backward_chunk, chunks.chunk), planned.per_unit,
                                         planned.backward_unit, planned.best_effort)
            key = policy.rank(planned, options, held, self.budget, t, grown.region,
                              mechanism.computed_share(options, grown.region, planned, self.backward))
            if best is None or key < best.key:
                best = _Candidate(key, options, grown, planned, remat)
        return best


# A root's plan, as _Region.best_root ranks them (the smallest ``key`` is best).
_Candidate = collections.namedtuple("_Candidate", "key options grown planned remat")
