"""The splitter pass: for each large tensor, the best region around it, planned, built and checked.

:class:`Splitter` holds what it was built with (a measurer, a tuning) and its searches' decisions
(:class:`.search_budget.SearchMemo`), and can be shared by every thread that traces; each
:meth:`Splitter.run` makes a :class:`_Run` that holds the state of that one run (the memory model's
figures, the loops built so far, the room given to starved gradient loops) and is dropped after it.
The stages it calls: :mod:`.search` (for each large tensor, the regions around it ranked and the
best one built: :mod:`.analysis` grows them, no input sliced along an axis :mod:`.sharding` pins,
:mod:`.policy` sizes and ranks them, :mod:`.mechanism` builds the loop), :mod:`.measure` (XLA's
figures, by the injected measurer) to check the program, and :mod:`.backward_growth` (starved gradient loops
grown into the room XLA's figure leaves).
"""

from __future__ import annotations

import dataclasses
import time

from grappler_ext import gradients, graph_edit, loop_convolutions, memory_model, op_types, shapes
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.measure import Figure, Measurer, program_figure, program_figure_later
from grappler_ext.pass_base import SKIPPED, GraphPass, Motive, PassOptions, PassResult, warn
from grappler_ext.pipeline import register_pass
from grappler_ext.splitter import (
    analysis,
    backward_growth,
    mechanism,
    nominal,
    outcome,
    policy,
    rules,
    search,
    whole_at_run,
)
from grappler_ext.splitter.outcome import CANNOT_SPLIT, Code, Growth, NominalSize, Redrawable
from grappler_ext.splitter.search_budget import SearchBudget, SearchMemo
from grappler_ext.splitter.tuning import DEFAULT_TUNING, Tuning

__all__ = ["Splitter"]
_mb = outcome.megabytes


def _predicted(result: PassResult) -> bool:
    """Whether the plan's growth was predicted, the program not compiled again (``Growth.predicted_after``)."""
    return any(isinstance(r.plan, Growth) and r.plan.predicted_after is not None for r in result.records)


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
        self.memo = SearchMemo()      # what its runs' searches decided, by program and options

    def run(self, graph, options: PassOptions) -> PassResult:
        with loop_convolutions.for_xla(options.xla_compiled):      # (its loops' convolutions' gradients)
            run = _Run(self, graph, options)
            result = run.run()
        run.budget.remember()
        return result


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
        self.grown_by: dict[str, int] = {}               # ... and what XLA's figure for the loop alone grew by
        # Per plan (reset by split_large).
        self.loop_bytes: dict[str, int] = {}             # a loop's planned body bytes, by its op's name
        self.backward_bytes: dict[int, int] = {}         # a region's gradient loop's planned body bytes, by its id
        self.model_after: int | None = None              # the model's count after the latest loop (not a bound)
        self.best_effort_asks = 0                        # XLA's figures asked before best efforts
        self.model_over_xla: float | None = None         # the model's count over XLA's figure when last asked
        self.within_as_split = self.in_vain = None       # the figure (within; or in vain) that stopped the plan
        self.warned_figure: int | None = None            # XLA's figure for a plan warned it cannot fit
        self.program_sized = 0                           # loops sized by compiling them as the whole program
        self.starved: dict[str, int] = {}                # large tensor -> its starved gradient loop's chunk
        self.regrowable: dict = {}                       # ... and how to build it again in place (search.Regrowable)
        self.search = None                               # the plan's search (search.RegionSearch): loops built again
        self.hoped: set = set()                          # tensors expected to be split by their own loops
        self.relaxed = False                             # regions with a large joined result allowed
        self.avoid: frozenset = frozenset()              # run-time sizes whose loops rank last (see _split)
        self.split_sizes: set = set()                    # run-time sizes the loops built split along
        self.notes = PassResult(self.name)               # records of the run, beside the plan's
        self.pending: list[str] = []                     # the plan's warnings, given when the run ends
        self.entry_over: tuple | None = None   # (bytes as written, over the limit; by what; why)
        self.written_figure: int | None = None           # XLA's figure for the program as written, where asked
        self.growth: nominal.Growth | None = None        # run-time dimensions: how the model's count grows
        self.replayed: Figure | None = None              # a plan built again: its figure, known
        # XLA's figures by the loops built, the journal's length and the nominal sizes (a plan built again:
        # the same program, however its ops are ordered; undone: another length); the plan being made
        self.figures, self.planning = {}, PassResult(self.name)
        self.budget = SearchBudget(self.tuning, lambda why: self.result.skip([], why, code=Code.SEARCH_STOPPED),
                                   splitter.memo)

    def figure(self) -> Figure:
        if self.replayed:
            return self.replayed
        key = (outcome.built_alike(self.planning), len(graph_edit.active_journal() or ()), shapes.nominal_key())
        if key in self.figures:
            return self.figures[key]
        start = time.perf_counter()
        figure = self.figures[key] = program_figure(self.checker, self.graph)
        self.budget.compiled(time.perf_counter() - start)
        return figure

    def predicts_growth(self) -> bool:
        """Whether a starved loop's growth may be predicted rather than the program compiled again
        (:func:`.backward_growth.grown`): planned at nominal sizes, each shape it runs at checked, loops
        measured alone."""
        return self.growth is not None and self.options.checked_at_run and self.calibrator is not None

    def searching(self) -> bool:
        """Whether the run may still search for a better plan (:mod:`.search_budget`)."""
        return self.budget.allows()

    def _build(self, est, info, limit, replay: list[bool] | None = None):
        """:meth:`_planned`, with the answers :meth:`searching` gave while it built (``replay``: a plan
        built before, again, from its answers: its figures are known).  Returns the plan's records, the
        model's bytes as split, XLA's figure and the answers."""
        with self.budget.replay(replay) as answers:
            return (*self._planned(est, info, limit), answers)

    # --- the program as a whole ------------------------------------------------------------------

    def run(self) -> PassResult:
        if self.limit is None:
            self.result.skip([], "no memory limit in bytes", code=Code.NO_LIMIT)
            return self.result
        est, info = memory_model.analyse(self.graph)
        dynamic = bool(est.dynamic_tensors) and bool(nominal.dynamic_inputs(self.graph))
        if dynamic and analysis.split_before(est):
            # The pipeline's next iteration: planned (and warned about) when its loops were built.
            self.result.skip([], "dynamic shapes: its loops are already split, planned at a nominal size",
                             code=Code.DYNAMIC_SHAPES)
            return self.result
        try:
            return (self._run_nominal() if dynamic else None) or self._run(est, info)
        finally:
            for message in dict.fromkeys(self.pending):      # the plan's warnings, each once
                warn(f"tf_memsafe: {message}", stacklevel=3)  # (pointing at the pipeline that ran the pass)

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
        sized = NominalSize(nominal.with_room_for_io(size, self.growth, at.needs, self.limit,
                                                     lambda n: nominal.io_bytes(self.graph, n, at),
                                                     self.tuning.dynamic_io_share), size)
        size = sized.size
        sized = dataclasses.replace(sized, inputs=nominal.planned_shapes(self.graph, size, at))
        grows = f"where what grows with them is {self.tuning.dynamic_over:g} x the limit"
        where = (f"where its inputs and outputs leave the rest {1 - self.tuning.dynamic_io_share:.0%} of the limit "
                 f"(at {sized.grown_to:,}, {grows}, they would take more)" if sized.for_io else grows)
        inputs = nominal.dynamic_inputs(self.graph)
        shown = (", ".join(nominal.dimension(self.graph, t.name) for t in inputs[:3])
                 + (", ..." if len(inputs) > 3 else ""))
        with at.sizes(size):
            est, info = memory_model.analyse(self.graph)
            journal = graph_edit.active_journal()
            mark = len(journal) if journal is not None else None
            peak = whole_at_run.peak_of_program(self.graph, est)      # the program as written, by run-time size
            threshold = self.tuning.whole_at_run * self.limit
            with whole_at_run.active(peak, at.table, threshold):
                result = self._run(est, info)
                dispatched = whole_at_run.dispatch(self.graph, self.name, result) if result.changed else 0
        if not result.changed:
            if journal is not None:
                journal.undo(to=mark)
            self.result, self.notes, self.pending, self.entry_over = (PassResult(self.name), PassResult(self.name),
                                                                      [], None)
            self.written_figure = None
            # (a plan no smaller than as written there, or a draw stopping one: recorded for the run's checks)
            self.result.records += [r for r in result.records
                                    if r.code == Code.NO_SMALLER or isinstance(r.plan, Redrawable)]
            return None
        said = [f"at {at.describe(size)} known only at run time ({shown}): {m}" for m in dict.fromkeys(self.pending)]
        # Sizes of the splitter's choosing (what grows there is Tuning.dynamic_over x the limit), not the
        # run's: where each shape the function runs at is checked by XLA's figure before it runs, a plan
        # over the limit there is said over only at a shape that is (a CNN's step on batches of 32,
        # planned at 746, fits), unless the program as written is over the limit at a size of 1 already.
        over_at_one = peak is not None and whole_at_run.largest_size(peak, at.values, self.limit) == 0
        deferred = bool(said) and self.options.checked_at_run and not over_at_one
        note = result.skip([], f"dynamic shapes ({shown}): planned at {at.describe(size)} known only at run "
                               f"time, {where}; the loops take their lengths from the shapes when the function runs"
                               f"{whole_at_run.note(peak, at, threshold, self.limit, dispatched)}",
                           code=Code.DYNAMIC_SHAPES, plan=dataclasses.replace(sized, within=not deferred,
                                                                              measured=not _predicted(result)))
        result.records[:] = [note] + [r for r in result.records if r is not note]
        if deferred:
            for message in said:
                result.skip([], f"not said when traced, checked at each shape it runs at: {message}",
                            code=Code.DYNAMIC_SHAPES)
            said = []
        self.pending = said
        return result

    def _run(self, est, info) -> PassResult:
        result, limit, t = self.result, self.limit, self.tuning
        # Loops of ours in it: the program was checked (and warned about) when they were built,
        # earlier in this pipeline's run; it is not compiled again to be judged.
        split_before = analysis.split_before(est)
        if est.dynamic_tensors:
            # The function's own inputs first: what the user chose (a None in an input_signature).
            names = [t.name for t in nominal.dynamic_inputs(self.graph)] or list(est.dynamic_tensors)
            shown = ", ".join(nominal.dimension(self.graph, name) for name in names[:3])
            shown = f"dynamic shapes ({shown}{', ...' if len(names) > 3 else ''})"
            # The static tensors alone (the dynamic ones counted as empty) give a lower bound.
            at_least = max(analysis.floor(est, info), 0 if est.unknown else
                           est.parameter_bytes + est.constant_bytes + est.live_peak_bytes)
            # Sizes decided inside the program (a sparse update's rows) leave its inputs static: XLA's
            # figure for it then decides, as for a program the model cannot estimate.
            figure = self.figure() if at_least <= limit and not split_before else Figure()
            if at_least <= limit and split_before:
                result.skip([], f"{shown}: its loops are already split; the static tensors left are within the "
                                "limit", code=Code.DYNAMIC_SHAPES)
                return result
            if at_least <= limit and not figure.over(limit):
                # (over at a size of 1 by the model: its arguments and what does not grow, which no plan at
                # any size made smaller, a Keras step's weights and optimizer slots)
                over_at_one = self.growth is not None and self.growth.within(self.limit) is None
                at_run = not figure.known and self.options.checked_at_run and not over_at_one
                checked = (f"checked by XLA's figure at each shape it runs at"
                           f"{nominal.growth_note(self.growth, self.limit)}; " if at_run else "")
                result.skip([], f"{shown}: left alone, within the limit by XLA's figure ({figure.bytes:,} B)"
                            if figure.known else f"{shown}: left alone{figure.note()}; {checked}give the tf.function "
                            "an input_signature with static shapes to split it", code=Code.DYNAMIC_SHAPES)
                if not figure.known and not at_run and not analysis.creates_variables(self.graph):
                    # Neither can size it before it runs: the user is told, once a trace that will run.
                    self.pending.append(
                        f"`{self.graph.name}` has {shown}: its footprint cannot be checked against the limit of "
                        f"{_mb(limit)} before it runs, and nothing in it is split"
                        f"{nominal.growth_note(self.growth, self.limit)}. " + (
                            f"Raise memory_limit to well above {_mb(self.growth.base_bytes)}." if over_at_one else
                            "Give the tf.function an input_signature with static shapes (or call it on tensors of "
                            "one shape) to let tf_memsafe check and split it."))
                return result
            # Static tensors over the limit (attention scores beside the dynamic-size sparse update
            # of an embedding) are split; the dynamic ops stay as they are.
            over = (f"XLA's figure is {figure.bytes:,} B" if figure.known else
                    f"the rest needs at least {at_least:,} B")
            result.skip([], f"{shown}: left as they are; {over}, so the static tensors over the limit are split",
                        code=Code.DYNAMIC_SHAPES)
            self.entry_over = ((figure.bytes, "by XLA's figure") if figure.known else (
                at_least, "at least, by the memory model's count of its static tensors")) + (f"it has {shown}",)
            self.written_figure = figure.bytes
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
            self.written_figure = figure.bytes
            limit = planning
        if est.peak_bytes is None and not est.dynamic_tensors:
            # No estimate (an op without a byte rule): split only what is over the limit on its own
            # terms -- the parameters, the outputs and the largest tensor together -- never a
            # program that may well fit.
            floor = analysis.floor(est, info)
            ours = bool(est.unknown) and all(graph_edit.is_generated(name) for name, _, _ in est.unknown)
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
                self.written_figure = figure.bytes
        self.budget.recall(self.graph, self.options)      # (a program traced alike before: as it was searched)
        # Run outside a pipeline, the pass keeps a journal of its own, to plan again.
        with graph_edit.some_journal():
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
            stuck = sorted((r for r in result.records if r.code in CANNOT_SPLIT), key=lambda r: -(r.bytes_before or 0))
            what = (f"the splitter {stuck[0].reason[0].lower()}{stuck[0].reason[1:]}" if stuck   # (the largest)
                    else "no tensor in it is large enough for a loop of its own") + rules.redraw_hint(
                stuck, self.options.redraw_random)
            self.pending.append(
                f"`{self.graph.name}` needs {_mb(figure)} {by}, over its limit of {_mb(self.limit)}; "
                f"{why}, and {what}. It will run as well as it can; raise memory_limit, or compute that part in "
                "smaller pieces.")
        return result

    def _split(self, est, info, limit) -> None:
        """Split the large tensors planning against ``limit`` (:meth:`_planned`); where the limit
        cannot be met, plan again in other ways and keep whichever program is smaller, so that a lower
        limit never leaves a larger program than a higher one would (best effort is monotonic): where
        a region was refused only because its joined result is large for the limit, with such regions
        allowed; where the program has run-time sizes, with loops along the sizes its loops did not
        split along ranked first (a loop over an attention's queries, ranked first as its slices grow
        slowest with the length, holds its keys' and values' projections and their gradients whole,
        which at the nominal sizes may be more than the limit where a loop over the batch is not).
        Then record the plan and give its warnings, once."""
        journal = graph_edit.active_journal()
        result, wanted = self.result, self.limit
        mark = len(journal)
        self.as_written = program_figure_later(self.checker, self.graph) if self.written_figure is None else None
        tried, after, measured, answers = self._build(est, info, limit)
        kept: dict = {}
        try:
            for code in (Code.LARGE_JOINS_ALLOWED, Code.OTHER_SIZES):
                if not (self.pending or (measured is not None and measured > wanted)) or not self.searching():
                    break
                if (way := self._another_way(code, tried)) is None:
                    continue
                if not self.budget.affords_another_plan():     # (a plan, and the first again if not kept)
                    break
                change, what, gain = way
                first_warnings = list(self.pending)
                first_bytes, _ = self._size(after, measured)
                journal.undo(to=mark)
                self._set_ways({**kept, **change})
                again, again_after, again_measured, again_answers = self._build(est, info, limit)
                again_bytes, figure = self._size(again_after, again_measured)
                # (smaller; a plan along other sizes by a share, or within the limit the first was over)
                if again_bytes is not None and (first_bytes is None or again_bytes < first_bytes * gain or (
                        gain < 1 and again_bytes <= wanted < first_bytes)):
                    again.skip([], (f"planned as usual, {first_bytes:,} B" if first_bytes is not None else
                                    "planned as usual") + f", the limit was not met: {what}, {again_bytes:,} B",
                               code=code)
                    kept.update(change)
                    tried, after, measured = again, again_after, figure if again_measured is None else again_measured
                    answers = again_answers
                    continue
                journal.undo(to=mark)
                self._set_ways(kept)
                tried, after, measured, _ = self._build(est, info, limit, replay=answers)
                self.pending = first_warnings
            over = measured if measured is not None else self.warned_figure
            if over is not None and over > wanted and tried.changed:     # (a nominal plan: both at its sizes)
                tried, over = self._no_larger_than_written(est, info, limit, mark, tried, over, answers)
                if measured is not None:
                    measured = over
        finally:
            self._set_ways({})
        result.records += self.notes.records + tried.records
        if measured is not None and measured > wanted and not self.pending:
            stopped = self.budget.stopped
            result.skip([], f"XLA's figure as split is {measured:,} B, over the limit of {wanted:,} B, with "
                            + ("the search for another plan stopped (its time spent)" if stopped
                               else "nothing left to split"), code=Code.STILL_OVER)
            self.pending.append(
                f"`{self.graph.name}` needs {_mb(measured)} by XLA's figure as split, over its limit of "
                f"{_mb(wanted)} (the memory model counts {_mb(after)}); "
                + ("the search for a smaller plan stopped once it had taken several times the program's own "
                   "compile (the first call waits for it)" if stopped else "nothing left in it can be split usefully")
                + ". It will run as well as it can; raise memory_limit.")

    def _no_larger_than_written(self, est, info, limit, mark, tried, measured, answers):
        """A plan over the limit by XLA's figure (``measured``) is kept only where it is at most
        ``Tuning.over_gain`` of the program as written by XLA's figure (its copy before the plan compiled
        now, or the plan undone): else it is left as written, recorded and said (a GAN's step under a
        quarter of its 179 MB: seven best efforts, each a loop, to 201 MB).  Returns the records and figure."""
        journal, written = graph_edit.active_journal(), self.written_figure
        if written is None and self.as_written is not None:     # (copied before the plan: compiled now, no undo)
            written = self.written_figure = self.as_written().bytes
        if undone := written is None:
            journal.undo(to=mark)
            written = self.figure().bytes
        if written is not None and not policy.saves_enough(measured, written, self.tuning):
            if not undone:
                journal.undo(to=mark)
            left, less = PassResult(self.name), f"{1 - self.tuning.over_gain:.0%}"
            left.skip([], f"XLA's figure as split, {measured:,} B, is not {less} below as written, {written:,} B: "
                          "left as written", code=Code.NO_SMALLER)
            worst = outcome.worst(tried.records)
            why = f"; {outcome.cause(worst, tried.records)}" if worst else ""
            self.pending = [f"`{self.graph.name}` needs {_mb(written)} by XLA's figure as written, over its limit "
                            f"of {_mb(self.limit)}, and the splitter's best plan for it was not {less} smaller "
                            f"({_mb(measured)}): left as written" + why
                            + ". It will run as well as it can; raise memory_limit."]
            return left, written
        if undone:                       # the plan again, as built (its figures are known)
            warned, (tried, _, measured, _) = self.pending, self._build(est, info, limit, replay=answers)
            self.pending = warned
        return tried, measured

    def _another_way(self, code: Code, tried: PassResult) -> tuple[dict, str, float] | None:
        """How :meth:`_split` plans again after ``tried`` failed (``code``: which way): the run's ways
        changed, what that is, the share of the first's figure it must come under; ``None``: not here."""
        if code == Code.LARGE_JOINS_ALLOWED:
            if not any(r.code == Code.JOINED_TOO_LARGE for r in tried.records):
                return None
            return {"relaxed": True}, "regions whose joined result is large for the limit allowed", 1.0
        if not self.split_sizes or (self.growth is None and any(r.code == Code.BEST_EFFORT for r in tried.records)):
            return None
        # (the sizes the plan kept so far split along: the first's, or the relaxed one's; of a static
        # program whose plan met the limit by the model, its loops' lengths: a Chamfer loss' batch of 2)
        return ({"avoid": frozenset(self.split_sizes)}, "loops along other "
                + ("axes" if self.growth is None else "run-time sizes") + " first", self.tuning.other_sizes_gain)

    def _set_ways(self, ways: dict) -> None:
        """The ways :meth:`_split` may change (``relaxed``, ``avoid``) as a run starts, but for ``ways``."""
        self.relaxed, self.avoid = ways.get("relaxed", False), ways.get("avoid", frozenset())

    def _size(self, after, measured) -> tuple[int | None, int | None]:
        """The program's XLA figure (as measured, else asked now) or the model's ``after``; and the figure."""
        figure = measured if measured is not None else self.figure().bytes
        return (figure if figure is not None else after), figure

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
        # (a plan along other run-time sizes is tried as it comes: a plan of another shape, not smaller chunks)
        replans = 0 if self.avoid else t.replans
        for attempt in range(replans + 1):
            mark = len(journal)
            tried = PassResult(self.name)
            after, measured = self.split_large(est, info, limit, tried)
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
                after, measured = self.split_large(est, info, limit, tried)
                break
            best = (measured, limit)
            if attempt == replans or not self.searching():
                break
            # XLA packs the loops beside the rest of the program less tightly than the model counts:
            # the planning limit scaled by the share XLA's figure is over.
            lower = int(limit * wanted / measured * t.replan_margin)
            journal.undo(to=mark)
            self.notes.skip([], f"planned against {limit:,} B, with {outcome.loops(len(tried.rewritten))} XLA's figure "
                                f"is {measured:,} B, over the limit of {wanted:,} B: planned again against {lower:,} B",
                            code=Code.REPLANNED)
            limit = lower
        if measured is None or measured <= wanted:
            tried, after, measured = backward_growth.grown(self, est, info, limit, mark, tried, after, measured)
        return tried, after, measured

    def split_large(self, est, info, limit, result) -> tuple[int | None, int | None]:
        """One plan: split the program's large tensors, largest first, planning against ``limit``;
        warn if the model says the limit cannot be met.  Returns the model's bytes as split (``None``:
        nothing split) and XLA's figure for the program as split, where it was worth measuring and
        not measured within the limit already (``None`` otherwise)."""
        graph, t, self.planning = self.graph, self.tuning, result
        self.loop_bytes, self.program_sized, self.starved, self.pending, self.regrowable = {}, 0, {}, [], {}
        self.warned_figure = None
        self.backward_bytes, self.best_effort_asks, self.model_over_xla, self.within_as_split = {}, 0, None, None
        self.in_vain = None             # XLA's figure that stopped the best efforts (see within_before_best_effort)
        self.model_after, self.split_sizes = None, set()
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

        literals = {name for b in est.buffers if b.kind == "constant" for name in b.tensors}   # (what XLA folds)

        def large(t_):
            return (i := info.get(t_.name)) is not None and i.materialised and i.bytes \
                and i.bytes > t.min_tensor_fraction * limit and t_.name not in literals

        # Large materialised tensors, largest first; each gets at most one loop.
        tensors = sorted((x for op in order if not graph_edit.is_generated(op)
                          and op.type not in op_types.HELD_OPS and op not in backward
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
        region = self.search = search.RegionSearch(self, est, info, step_of, order_index, backward, limit, result)
        only = None           # within the limit at nominal sizes by the model: the tensors left that outgrow the inputs
        visited: set = set()  # (tensors tried: not again where the tensors left are gone through again, below)
        while True:
            for tensor in tensors:
                if (tensor.op in done or tensor.op not in order_index or tensor.name in visited
                        or (only is not None and tensor.name not in only)):
                    continue
                visited.add(tensor.name)
                removed = region.split_around(tensor)
                if self.within_as_split is not None or self.in_vain:    # XLA's figure: within, or best efforts in vain
                    checked = True
                    break
                if removed is None:
                    self.hoped.discard(tensor.name)
                    continue
                done |= removed
                analysis.forget_dead(order_index, graph, region.built)
                planned = max((r.bytes_after or 0 for r in result.rewritten), default=0)
                after, bound = analysis.needed_now(graph, planned, self.loop_bytes)
                self.model_after = None if bound else after
                if after <= limit * t.model_trust and trust_model and only is None:      # as a program left alone must
                    # Within the limit at nominal sizes with large tensors left that outgrow the inputs: those
                    # are split first, and the program is checked with XLA once (below), not before and after.
                    if only := region.outgrowing(tensors, done, after) or None:
                        continue
                    # Checked with XLA like a program left alone (always where the model's count is only a lower
                    # bound); if over, the model's word is not taken again: every large tensor left is split.
                    figure = self.figure() if after >= t.check_from * limit or bound else Figure()
                    if not figure.over(self.limit):
                        checked = figure.known
                        break
                    trust_model = False
                    result.skip([], f"with {outcome.loops(len(result.rewritten))} the memory model counts {after:,} B, "
                                    f"but XLA's figure is {figure.bytes:,} B, over the limit: the large tensors left "
                                    "are split too", code=Code.CHECKED_OVER)
            else:
                asked = only is not None and (after >= t.check_from * limit or self.model_after is None)
                figure = self.figure() if asked else Figure()
                if figure.over(self.limit):      # (what outgrows the inputs split: the rest too, gone through again)
                    only, trust_model, region.covering = None, False, False
                    result.skip([], f"with {outcome.loops(len(result.rewritten))}, those outgrowing the inputs split, "
                                    f"XLA's figure is {figure.bytes:,} B, over the limit: the large tensors left are "
                                    "split too", code=Code.CHECKED_OVER)
                    continue
                checked = figure.known
            break
        # A tensor no root of its own could split may still have been split by a later, larger
        # region (SGPR's test-point solves, inside the predictive mean's loop): no record then.
        done_names = {op.name for op in done}
        result.records = [r for r in result.records if not (
            r.action == SKIPPED and r.ops and r.code in CANNOT_SPLIT | {Code.FITS_WHOLE} and set(r.ops) <= done_names)]
        worst = outcome.worst(result.records)
        needed = est.peak_bytes if est.peak_bytes is not None else (worst.bytes_before if worst else None)
        if worst is not None and after is not None and after <= limit:
            worst = None       # what was split took the rest with it
        if worst is not None and needed is not None and needed > limit:
            self._warn_cannot_fit(est, worst, needed, after, limit, result)
            return after, None
        if self.in_vain:
            return after, self.in_vain
        if after is None or checked or (trust_model and after < t.check_from * limit) or (
                self.program_sized and self.program_sized == len(result.rewritten)):
            # Nothing split, measured within the limit already, far below it by the model's count, or
            # every loop sized by compiling it as the whole program.
            return after, None
        figure = self.figure()
        if after > limit:
            self._said_within(after, figure, result)
        return after, figure.bytes

    def within_before_best_effort(self, tensor, size: int, result: PassResult) -> bool:
        """Asked before each best effort of a plan: whether the plan stops there, every large tensor left
        as it is (recorded).  Before the first, nothing built, XLA's figure for the program as written is
        taken (a plan ending over the limit is weighed against it: :meth:`_no_larger_than_written`).
        Once loops are built, XLA's figure for the program as split so far: within the limit, the model's
        count notwithstanding, or over it and not ``Tuning.over_gain`` of the program as written, the
        plan stops.  The model's count of a split program runs over XLA's (a padded Transformer step at
        its nominal sizes: 1.9 GB by the model after 11 loops, 630 MB by XLA's figure), and each best
        effort is a loop, a rebuild of the gradients and a slower step more.  Each figure is a compile
        of the whole program: after one over the limit, the next is asked only once the model's count,
        scaled by its ratio to that figure, is within the limit; ``Tuning.best_effort_checks`` at most."""
        t, written = self.tuning, self.written_figure
        if not result.rewritten and written is None and self.replayed is None and self.searching():
            self.written_figure = self.figure().bytes
        if not result.rewritten or self.best_effort_asks >= t.best_effort_checks or (
                self.replayed is None and not self.searching()) or (self.model_over_xla is not None and (
                self.model_after is None or self.model_after / self.model_over_xla > self.limit)):
            return False
        self.best_effort_asks += 1
        if not (figure := self.figure()).known:
            return False
        shown = f"with {outcome.loops(len(result.rewritten))} built, XLA's figure for the program as split is"
        if figure.bytes > self.limit and (written is None or policy.saves_enough(figure.bytes, written, t)):
            self.model_over_xla = (self.model_after / figure.bytes) if self.model_after else None
            result.skip([tensor.op], f"{shown} {figure.bytes:,} B, over the limit: best efforts go on from "
                                     f"`{tensor.op.name}` ({size:,} B)", bytes_before=size,
                        code=Code.BEST_EFFORTS_GO_ON)
            return False
        if figure.bytes > self.limit:           # (to be weighed against the program as written)
            self.in_vain = figure.bytes
            result.skip([tensor.op], f"{shown} {figure.bytes:,} B, over the limit and not {1 - t.over_gain:.0%} below "
                                     f"the program as written ({written:,} B): best efforts stop",
                        bytes_before=size, code=Code.BEST_EFFORTS_IN_VAIN)
            return True
        self.within_as_split = figure
        result.skip([tensor.op], f"{shown} {figure.bytes:,} B, within the limit: `{tensor.op.name}` ({size:,} B) "
                                 "and the large tensors after it are left as they are (the memory model's count "
                                 "could only have split them in best efforts)", bytes_before=size,
                    code=Code.BEST_EFFORTS_STOPPED)
        return True

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
        self.warned_figure = figure.bytes
        what = outcome.cause(worst, result.records) + rules.redraw_hint(
            [worst] + [r for r in result.records if r.code in CANNOT_SPLIT], self.options.redraw_random)
        as_written = est.peak_bytes is None and self.entry_over is not None
        # (what no rewrite changes, by the model's count of the program as traced: not at nominal sizes)
        arguments, results = (0, 0) if self.growth else (est.parameter_bytes, est.output_bytes)
        self.pending.append(outcome.CannotFit(
            self.graph.name, self.entry_over[0] if as_written else needed,
            "XLA" if as_written else "about" if est.peak_bytes is not None else "at least",
            None if self.growth else after, figure.bytes if figure.known else None, limit, self.limit, what,
            arguments=arguments, results=results, split=after is not None,
            whole=None if self.growth else analysis.held_whole(self.graph)).render())
