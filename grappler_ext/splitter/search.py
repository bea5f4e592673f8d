"""The splitter's search around one large tensor: the candidate regions, ranked, and the best one built.

For each large tensor the driver (:mod:`.driver`) hands over, :class:`RegionSearch` grows the
regions of the roots downstream of it (:mod:`.analysis`), plans and ranks them (:mod:`.policy`), may
widen the best to where its axis ends or compute its attention by key blocks in each slice
(:mod:`.nesting`), sizes its chunk by XLA's figure for the loop (through the run's measurer) and
builds and installs the loop (:mod:`.mechanism`), recording the plan.  It holds one plan's state
(the run, the memory model's figures, the budget) and reads and writes the run's bookkeeping
(the loops' bytes, the starved gradient loops).
"""

from __future__ import annotations

import collections
import dataclasses

from grappler_ext import gradients, graph_edit, graph_query
from grappler_ext.op_types import LOOP_TYPES, nbytes
from grappler_ext.splitter import (
    analysis,
    loop,
    mechanism,
    nested_loop,
    nesting,
    nominal,
    outcome,
    policy,
    replay,
    rules,
    scaling,
    sharding,
    whole_at_run,
)
from grappler_ext.splitter.chunk_plan import ChunkPlan
from grappler_ext.splitter.outcome import Code, LoopPlan, Redrawable, Sizing, Why

__all__ = ["RegionSearch", "Candidate", "Regrowable"]


class RegionSearch:
    """One plan's search and build of a loop around each large tensor (the state of the driver's
    ``_Run.split_large``; ``run``: the driver's run, its graph, options, measurer and bookkeeping)."""

    def __init__(self, run, est, info, step_of, order_index, backward, budget, result):
        self.run, self.tuning, self.est, self.info, self.step_of = run, run.tuning, est, info, step_of
        self.order_index, self.backward, self.budget, self.result = order_index, backward, budget, result
        self.graph_outputs = {t.ref() for t in getattr(run.graph, "outputs", [])}
        self.reseed = rules.Reseed() if run.options.redraw_random else None
        self.asks = gradients.wanted(run.graph)     # (the inputs whose gradients a loop computes)
        self.nestable: Candidate | None = None     # the best-ranked best effort whose attention can be nested
        self.found: list[Candidate] = []           # every plan best_root found for the tensor split now
        self.built: set = set()                    # the live ops earlier loops built (analysis.forget_dead)
        # Regions grown, by their options, since the last loop was built (see grown_for)
        self.grown: dict = {}
        self.grown_redrawn: dict = {}              # ... and as grown with redraw_random on (see redrawable)
        self.root_options: dict = {}               # root -> its options, likewise
        self.pinned = None                         # (sharding.pinned_axes, with the graph as it was)
        self.covering = False                      # splitting what outgrows the inputs (see outgrowing)
        # The program as written where the model has no count of it (an op without a rule, not a loop of
        # an earlier split's: that plan stands): XLA's figure if measured, else the model's lower bound
        # (the largest tensor with the inputs and outputs), for best efforts' gain.
        self.written = None if est.peak_bytes is not None or est.dynamic_tensors or analysis.split_before(est) else (
            run.written_figure if run.written_figure is not None else analysis.floor(est, info))

    def beside(self, tensor) -> policy.Beside:
        return policy.Beside(self.est, self.info, self.step_of, frozenset(self.run.hoped), self.backward,
                             self.run.grow_room.get(tensor.name, (0, 0)), self.written, self.asks)

    def split_around(self, tensor) -> set | None:
        """Find the best root downstream of ``tensor`` and split it; the ops removed, or ``None``."""
        run, t, info, reasons, beside = self.run, self.tuning, self.info, [], self.beside(tensor)
        self.nestable, self.found = None, []
        near = analysis.downstream(tensor.op, self.order_index, t.root_depth)
        candidates = [[option] for root in near for option in self.options_of(root)]
        candidates += analysis.together(tensor, self.order_index, self.graph_outputs, self.backward)
        best = self.best_root(candidates, tensor, beside, reasons)
        if best is None or best.planned.best_effort is not None or not best.planned.chunks.splits:
            # No root nearby meets the limit: the region that does may end farther down (SGPR's
            # predictive density reads the test points' kernel matrix 14 ops later).  Only roots
            # whose joined result could be planned at all (see policy.plan): the wider search
            # reaches hundreds of ops in a Transformer's training step.
            seen = set(near)
            far = [[option] for root in analysis.downstream(tensor.op, self.order_index, t.root_depth_wide)
                   if root not in seen for option in self.options_of(root)
                   if analysis.joined_bytes([option]) <= self.budget / 2]
            wider = self.best_root(far, tensor, beside, reasons)
            if wider is not None and (best is None or wider.key < best.key):
                best = wider
        best = self.widest(best)
        if best is not None and best.planned.chunks.splits:
            best = self.reaching_on(best, tensor, beside, reasons)
        if best is not None and best.planned.best_effort is not None and self.nestable is not None:
            # Measured once, where nothing fits: the best region nested if it can be, else the best-ranked one that can.
            own = self.nest_in(best.grown, best.planned)
            best = self.nested(best._replace(nest=own) if own else self.nestable, best, beside) or best
        size = info[tensor.name].bytes
        if best is None:
            why = (min(reasons, key=lambda r: r.code != Code.SHARDED_AXIS) if reasons   # a mesh's axis first
                   else Why(Code.NO_ROOT, "no op downstream reduces it or has a split rule"))
            self.result.skip([tensor.op], f"cannot split `{tensor.op.name}` ({size:,} B): {why.text}",
                             bytes_before=size, code=why.code, plan=self.redrawable(candidates, tensor, beside))
            return None
        options, grown, planned = best.options, best.grown, best.planned
        chunks, backward_chunk = planned.chunks, planned.backward_chunk
        if not chunks.splits:
            # The planner's count says the region fits whole, while the program's estimate does not:
            # say so (the run's warning then names it) rather than leave it silently.
            self.result.skip([tensor.op], f"cannot split `{tensor.op.name}` ({size:,} B) usefully: its region fits "
                                          f"the limit whole by the planner's count ({chunks.predicted_bytes:,} B)",
                             bytes_before=size, code=Code.FITS_WHOLE)
            return None
        if planned.best_effort is not None and run.within_before_best_effort(tensor, size, self.result):
            return None
        fusable = self.backward and mechanism.fusable(run.graph, options, grown.region, chunks.length,
                                                      backward_chunk)
        return self.finish(tensor, best, beside, fusable)

    def finish(self, tensor, best: Candidate, beside: policy.Beside, fusable: bool, again: Regrowable | None = None):
        """:meth:`split_around`'s loop for ``best``, planned: sized (by XLA's figures where they apply),
        built and installed; the ops it removed, or ``None``.  ``again``: the loop built before in its
        place, of which this is the grown one (``None`` too where its gradients' chunk is not larger)."""
        run, t = self.run, self.tuning
        options, grown, planned = best.options, best.grown, best.planned
        chunks, backward_chunk, per_unit = planned.chunks, planned.backward_chunk, planned.per_unit
        sized = policy.Sized(chunks, per_unit, Sizing.MODEL)
        # (a recomputation's two steps stay; a fused loop's chunk is the gradient's, grown by its own figure)
        if run.calibrator is not None and chunks.steps >= 2 and not best.remat and not fusable:
            sized = policy.calibrated(options, grown, chunks, beside, self.budget, t,
                                      lambda c: mechanism.loop_figure(run.calibrator, options, grown.region, c),
                                      large_joins=run.relaxed, model_per_unit=per_unit,
                                      measured=planned.figures)
            if sized.sizing in (Sizing.LOOP_FIGURE, Sizing.NOMINAL_FIGURE, Sizing.PROGRAM_FIGURE):
                chunks, per_unit = sized.chunks, sized.per_unit
                backward_chunk = min(backward_chunk, chunks.chunk)
        # A loop computing its gradients as it goes is planned with them (the fused unit's chunk), not on
        # a device mesh: DTensor runs each device's program with TensorFlow's executor, every op's result
        # a buffer of its own (a training step on batch-sharded inputs, its loop's chunk planned by XLA's
        # materialised tensors, peaked at 19.5 MB a device under a limit of 8.4 MB).
        counted = fusable and planned.fused_chunk is not None and not run.options.sharded_inputs
        if self.backward and not counted:
            # The program holds its forward activations for the gradients, and XLA's layout copies of
            # them, beyond the model's count: a slice takes at most a share of the budget.  (A loop
            # computing its gradients as it goes holds none of its own, and is planned with its gradients.)
            chunks = policy.capped(chunks, per_unit, self.budget, t)
            backward_chunk = min(backward_chunk, chunks.chunk)
        backward_row = None
        if (self.backward and not fusable and not best.remat and run.calibrator is not None and chunks.steps >= 2
                and mechanism.tiles(options, grown.region, chunks, backward_chunk) is None):
            # Its gradient loop by XLA's figures for the loop and its gradient alone, not the model's
            # multiple of a forward slice.
            resized = policy.backward_sized(
                options, grown, chunks, backward_chunk, beside, self.budget, t,
                lambda c: mechanism.gradient_figure(run.calibrator, options, grown.region, c, asks=self.asks),
                per_row=sized.bytes_per_row)
            if resized is not None:
                backward_chunk, backward_row, backward_unit = resized
                best = best._replace(planned=dataclasses.replace(best.planned, backward_unit=backward_unit))
        draws = self.reseed is not None and bool(_drawn_in(grown.region))
        fused = chunks.chunk if fusable else None                       # the forward's chunk
        if counted:
            backward_chunk = min(planned.fused_chunk, chunks.chunk)
        by_figure = None
        if fused and run.calibrator is not None and tensor.name in run.grow_room:    # grown by its own figure
            growth = policy.fused_grown(run.grow_room[tensor.name], chunks.length, analysis.top_k(options), t,
                                        lambda c: mechanism.loop_figure(run.calibrator, options, grown.region, c,
                                                                        fused=True, asks=self.asks))
            if growth is not None:
                by_figure, backward_chunk = growth.chunk, growth.chunk
                run.grown_by[tensor.name] = growth.added
        if again is not None and backward_chunk <= again.backward_chunk:
            return None
        if fused and by_figure is None and again is not None and tensor.name in run.grow_room and run.predicts_growth():
            # Grown by the model's count (a loop over run-time sizes is not sized by its own figures):
            # what XLA's figure for it alone grows by at the nominal sizes, for the program's prediction.
            added = self._grown_alone(options, grown.region, run.grow_room[tensor.name][1], backward_chunk)
            if added is not None:
                run.grown_by[tensor.name] = added
        if (draws and backward_chunk < chunks.chunk) or (fused and backward_chunk != chunks.chunk):
            # A draw keys on its slice's offset, and a fused loop holds a slice's gradient: the gradient's chunks.
            chunks = ChunkPlan(chunks.length, backward_chunk,
                               int(chunks.predicted_bytes - (chunks.chunk - backward_chunk) * per_unit))
        if grown.region.written_into:                    # no remainder slice (see policy.without_tail)
            chunks = policy.without_tail(chunks, per_unit)
        # (a row's bytes as the run's sizes scale the chunk: a fused loop's with its gradients, where the
        # model's count gave its chunk, not XLA's figures for it alone)
        unit = planned.fused_unit if counted else None
        row = unit if unit and by_figure is None else per_unit
        return self.build(tensor, best, chunks, backward_chunk, per_unit, sized, draws, fused, row, unit,
                          backward_row, again=again)

    def build(self, tensor, best, chunks, backward_chunk, per_unit, sized, draws, fused=None,
              row: float | None = None, fused_unit: float | None = None,
              backward_row: float | None = None, again: Regrowable | None = None) -> set | None:
        """The loop of ``best`` in ``chunks`` built and installed; the ops it removed, or ``None``
        (``fused``: the forward's own chunk, where the loop computes the gradients as it goes; ``row``:
        the bytes a row of a loop whose chunk is scaled to the run's sizes costs, if not ``per_unit``;
        ``fused_unit``: a fused loop's bytes a row where its gradients' count planned it, else the
        backward loop's; ``backward_row``: the gradient loop's bytes a row by XLA's figure, where that
        sized its chunk; ``again``: the region's loop built before, which this one replaces, record
        included: :meth:`regrow`)."""
        run, graph, options, grown = self.run, self.run.graph, best.options, best.grown
        roots = [o.root for o in options]
        self.grown, self.root_options, self.grown_redrawn = {}, {}, {}  # (the graph changes: grown anew)
        existing = set(graph.get_operations())
        region_ops = [*roots, *grown.region.ops, *grown.region.prologue]
        reads = {op: list(op.inputs) for op in region_ops}      # (before it is installed)
        dispatch = None
        if grown.region.scaled is not None:     # its chunk from the room the run's sizes leave
            grown.region.scaled.room(self.budget, chunks.predicted_bytes - chunks.chunk * per_unit, row or per_unit)
        try:
            with graph_edit.building(graph, run.name):
                if draws:
                    # One seed a call, outside the loop: its slices' draws, forward and gradient, key on it.
                    self.reseed.tensor = mechanism.call_seed()
                tiled = mechanism.tiles(options, grown.region, chunks, backward_chunk, fused is not None)
                dispatch = whole_at_run.dispatch_for(grown.region) if tiled is None else None
                outputs = mechanism.build(options, grown.region, chunks, backward_chunk, fused is not None, tiled,
                                          dispatch, self.asks)
        except (ValueError, TypeError, KeyError, NotImplementedError) as e:
            self.result.skip(roots, f"building the loop failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                             code=Code.BUILD_FAILED)
            return None
        mechanism.install(graph, run.name, roots, outputs, self.graph_outputs, grown.region.ops,
                          replaced=again and again.outputs)
        # (the prologue too: the region as written reads its ops' outputs, whose gradient would otherwise be
        # a zero XLA cannot fold through their products, computed where the loop runs)
        whole_at_run.forget(again and again.dispatch)
        whole_at_run.record(dispatch, roots, outputs, list(grown.region.ops) + list(grown.region.prologue) + roots)
        made = [op for op in graph.get_operations() if op not in existing]
        forward_loops = [op for op in made if op.type in LOOP_TYPES]
        run.split_sizes |= scaling.loop_sizes(grown.region, run.growth is not None)
        try:
            # (a loop built again: the gradients that read the loop it replaces)
            touched = grown.included if again is None else again.made
            rebuilt = mechanism.rebuild_gradients(graph, run.name, touched, grown.region) if self.backward else 0
        finally:
            # The call's seed is this loop's (its gradient keyed on it too): a later region's loop,
            # compiled alone to size it, draws with a fixed key instead (see rules.Reseed).
            if self.reseed is not None:
                self.reseed.tensor = None
        # What each loop's body holds, for the memory model's view of the program as rewritten.
        joined = sum(nbytes(x) for r in roots for x in r.outputs)      # the result, written as it goes
        room = run.grow_room.get(tensor.name, (0, 0))
        fused_unit = fused_unit or best.planned.backward_unit
        for op in forward_loops:     # a fused loop: a slice and its gradient, and the inputs' gradients
            run.loop_bytes[op.name] = int(chunks.chunk * per_unit) + joined if fused is None else int(max(
                room[1] * fused_unit, chunks.chunk * fused_unit - room[0])) + sum(
                nbytes(r.deref()) for r in set(grown.region.sliced_inputs) | grown.region.whole_inputs)
        backward_loops = mechanism.new_loops(graph, existing | set(forward_loops))
        # Grown into room the model did not see: counted as the rest less that room.
        mine = int(max(room[1] * best.planned.backward_unit, backward_chunk * best.planned.backward_unit - room[0]))
        run.backward_bytes[id(grown.region)] = mine
        for op in backward_loops:
            # (the gradients rebuilt copy every earlier loop's backward too: each counted by its own plan)
            owner = replay.owner(op)
            run.loop_bytes[op.name] = mine if owner is None else run.backward_bytes.get(id(owner), mine)
        gradient_loop = (bool(backward_loops) and backward_chunk < chunks.chunk) or (
            fused is not None and backward_chunk < fused)
        starved = (gradient_loop or fused is not None) and not room[0] and policy.starved(chunks, backward_chunk,
                                                                                         self.tuning, fused)
        if starved:
            run.starved[tensor.name] = backward_chunk
        if sized.sizing == Sizing.PROGRAM_FIGURE and again is None:
            run.program_sized += 1
        plan = LoopPlan(tuple(o.split for o in options), chunks.length, chunks.chunk, backward_chunk,
                        chunks.predicted_bytes, has_gradient_loop=gradient_loop, sizing=sized.sizing,
                        sizing_detail=sized.detail, bytes_per_row=sized.bytes_per_row,
                        loop_figure_bytes=sized.loop_figure_bytes, backward_bytes_per_row=backward_row,
                        best_effort=best.planned.best_effort,
                        rebuilt_gradients=rebuilt, prologue_ops=tuple(op.name for op in grown.region.prologue),
                        dynamic=grown.region.dynamic, fused=fused is not None, tiles=tiled and tiled[0].count(tiled[1]),
                        written_into=mechanism.written_variables(graph, grown.region),
                        nested=best.nest and nested_loop.record(best.nest),
                        redrawn=_drawn_in(grown.region) if draws else ())
        record = self.result.rewrote(roots + grown.region.ops, plan.render(),
                                     bytes_before=analysis.materialised_bytes(grown.included, self.info),
                                     bytes_after=chunks.predicted_bytes,
                                     code=Code.BEST_EFFORT if plan.best_effort is not None else Code.SPLIT, plan=plan)
        at = None if again is None else next((i for i, r in enumerate(self.result.records) if r is again.record), None)
        if at is not None:               # (in the place of the loop it replaces)
            self.result.records[at] = self.result.records.pop()
        elif starved and fused is not None and tiled is None and not grown.region.written_into \
                and not grown.region.inputs_of:
            # What building it again in larger chunks takes (regrow), once XLA's figure says how much room there is.
            run.regrowable[tensor.name] = Regrowable(
                tensor, best, backward_chunk, tuple(outputs), frozenset(made), record, dispatch, reads,
                {op: list(op.inputs) for op in region_ops})
        return grown.included | set(grown.region.prologue)

    def _grown_alone(self, options, region, chunk: int, grown: int) -> int | None:
        """What XLA's figure for the region's fused loop alone at the nominal sizes grows by from ``chunk``
        to ``grown`` (two compiles); ``None`` where either cannot be measured."""
        def figure(c: int) -> int:
            return mechanism.loop_figure(self.run.calibrator, options, region, c, fused=True, asks=self.asks,
                                         at_nominal=True)
        try:
            return figure(grown) - figure(max(chunk, 1))
        except Exception:  # noqa: BLE001 - not predicted then: the program is compiled again
            return None

    def regrow(self, stash: Regrowable) -> bool | None:
        """The starved loop of ``stash`` (one computing its gradients as it goes) built again in its
        place, planned as a plan made again would plan it with the room ``run.grow_room`` holds for it
        (the model's count less that room; XLA's figures for it alone, where they apply:
        :func:`.policy.fused_grown`), its record replaced; every other loop of the plan as it is.
        ``False`` where its gradients' chunk would not grow (nothing built); ``None`` where it cannot be
        built again so (nothing left of the try): a loop built after it replaced one of its region's
        inputs, its region no longer has a plan of its own, or its build failed.

        Its region is read as it was when its loop was built (:func:`.loop.as_built`): installing the
        loop folded the shape readers its ops read."""
        run, best = self.run, stash.best
        if best.beside is None:
            return None
        if any(now is not then for op, installed in stash.installed.items() for now, then in zip(op.inputs, installed)):
            return None
        region = loop.as_built(best.grown.region, stash.reads)
        best = best._replace(grown=dataclasses.replace(best.grown, region=region))
        beside = dataclasses.replace(best.beside, room=run.grow_room.get(stash.tensor.name, (0, 0)))
        planned = policy.plan(best.options, best.grown, beside, self.budget, self.tuning, large_joins=run.relaxed)
        if isinstance(planned, Why) or planned.best_effort is not None:
            return None                     # (another region may be planned: the plan again decides)
        if best.remat or not planned.chunks.splits:          # (as best_root splits it: two steps at least)
            chunks = policy.split_anyway(planned.chunks, planned.per_unit)
            planned = dataclasses.replace(planned, chunks=chunks,
                                          backward_chunk=min(planned.backward_chunk, chunks.chunk),
                                          fused_chunk=planned.fused_chunk and min(planned.fused_chunk, chunks.chunk))
        records = len(self.result.records)
        if self.finish(stash.tensor, best._replace(planned=planned), beside, True, again=stash) is not None:
            return True
        return None if any(r.code == Code.BUILD_FAILED for r in self.result.records[records:]) else False

    def redrawable(self, candidates, tensor, beside: policy.Beside) -> Redrawable | None:
        """Where ``Options.redraw_random`` is off and no region could split ``tensor``, whether one
        of ``candidates`` would be planned with it on, and the draws it would draw again (the warning
        advises the option only then: a draw read by two regions, the normal equations' design
        matrix, stays whole with it too)."""
        def drawn(grown) -> bool:                 # (a region grown so far stopped at a draw)
            return any(w.code == Code.RANDOM_DRAW for w in ([grown] if isinstance(grown, Why) else grown.stops))

        if self.reseed is None and rules.redrawn(tensor.op) and _read_by_loop(tensor):
            # A draw held whole for a loop built before (a Keras dropout's mask of attention scores read
            # by the loss' loop): with the option, the loop's region takes the draw in.
            return Redrawable((tensor.op.name,), for_loop=True)
        if self.reseed is not None or not any(drawn(g) for g in self.grown.values()):
            return None
        kept = self.reseed, self.grown, self.found, self.nestable
        self.reseed, self.grown = rules.Reseed(), self.grown_redrawn
        try:
            best = self.best_root(candidates, tensor, beside, [])
        finally:
            self.reseed, self.grown, self.found, self.nestable = kept
        draws = () if best is None else _drawn_in(best.grown.region)
        return Redrawable(draws) if draws else None

    def nest_in(self, grown, planned) -> nesting.Nest | None:
        """The attention of a best effort's region that can be computed over key blocks in each slice
        (:mod:`.nesting`: nothing measured yet), where the program has no gradients inside."""
        if self.backward or self.run.calibrator is None or planned.best_effort is None:
            return None
        nest = nesting.attention_within(grown, self.graph_outputs, self.order_index)
        return None if isinstance(nest, Why) else nest

    def nested(self, candidate: Candidate, best: Candidate, beside: policy.Beside) -> Candidate | None:
        """``candidate`` with its attention computed over key blocks in each slice (:attr:`Candidate.nest`),
        sized by XLA's figure for its loop, if that plan is better than ``best`` (a best effort); else ``None``."""
        options, nest = candidate.options, candidate.nest
        grown = nested_loop.nested(candidate.grown, nest, nested_loop.key_chunk(nest.keys))
        planned = policy.nested_plan(options, grown, beside, self.budget, self.tuning, best.planned, lambda c: (
            mechanism.loop_figure(self.run.calibrator, options, grown.region, c)))
        return None if planned is None else candidate._replace(grown=grown, planned=planned)

    def reaching_on(self, best: Candidate, tensor, beside: policy.Beside, reasons: list[Why]) -> Candidate:
        """``best``, or the region reaching on from its joined results along the same axis to where
        that axis ends (one loop per encoder layer: :func:`.analysis.reaching_on`), if it takes in
        every op ``best`` does and is the better plan (:func:`.policy.reaches_on`)."""
        further = analysis.reaching_on(best.options, self.order_index, self.graph_outputs, self.backward)
        wider = self.best_root(further, tensor, beside, reasons) if further else None
        if (wider is None or not best.grown.included <= wider.grown.included
                or not policy.reaches_on(best.planned, wider.planned, self.tuning, policy.leaves(best.grown, beside))):
            return best
        return wider

    def best_root(self, candidates, tensor, beside: policy.Beside, reasons: list[Why]) -> Candidate | None:
        """The best plan among ``candidates`` (lists of root options split together) whose region
        takes ``tensor`` in, or ``None``; why the others fail is appended to ``reasons``."""
        t, best = self.tuning, None
        for options in candidates:
            # (a region computing a weight's update takes in the gradients it reads)
            ignored = frozenset() if analysis.updates_from(options, self.order_index, self.backward) else self.backward
            grown = self.grown_for(options, ignored)
            if isinstance(grown, Why):
                reasons.append(grown)
                continue
            if tensor.op not in grown.included:
                if grown.stops:
                    reasons.append(grown.stops[0])
                continue
            # (the gradients a weight's update reads are in its region: no backward is left to plan)
            planning = beside if ignored else dataclasses.replace(beside, backward=ignored)
            planned = policy.plan(options, grown, planning, self.budget, t, large_joins=self.run.relaxed)
            if isinstance(planned, Why):
                reasons.append(planned)
                continue
            held = analysis.held_for_backward(grown, self.info, self.backward,
                                              {o.root for o in options if o.kind == "concat"})
            remat = policy.remat_worthwhile(planned.chunks, held, self.budget, t)
            if remat or (self.covering and not planned.chunks.splits):
                # The region fits whole, but the gradients inside the function hold its tensors from
                # the forward to the backward: a loop recomputes them there instead.  (Or it outgrows
                # the function's inputs: see outgrowing.)
                chunks = policy.split_anyway(planned.chunks, planned.per_unit)
                fused_chunk = planned.fused_chunk and min(planned.fused_chunk, chunks.chunk)
                planned = dataclasses.replace(planned, chunks=chunks, fused_chunk=fused_chunk,
                                              backward_chunk=min(planned.backward_chunk, chunks.chunk))
            # (a plan again after one over the limit: loops along the sizes it split last)
            avoided = bool(self.run.avoid) and bool(
                self.run.avoid & scaling.loop_sizes(grown.region, self.run.growth is not None))
            key = (avoided,) + policy.rank(
                planned, options, held, self.budget, t, grown.region,
                mechanism.computed_share(options, grown.region, planned, self.backward))
            self.found.append(Candidate(key, options, grown, planned, remat, beside=planning))     # (see widest)
            if best is None or key < best.key:
                best = self.found[-1]
            if (self.nestable is None or key < self.nestable.key) and (nest := self.nest_in(grown, planned)):
                self.nestable = Candidate(key, options, grown, planned, remat, nest, planning)  # (see split_around)
        return best

    def outgrowing(self, tensors, done: set, after: int) -> frozenset:
        """Where the program is planned at nominal sizes and is within the limit there: the names of
        the large ``tensors`` not split yet that grow faster than the function's inputs and outputs
        (:func:`.nominal.outgrowing`), noted; each is split too, its region split into two steps at
        least where it fits whole (the loops' chunks are scaled to each run's sizes, so those slices
        keep their bytes where the tensor outgrows the rest).  Empty for a program of static shapes."""
        if self.run.growth is None:
            return frozenset()
        fast = nominal.outgrowing(self.run.graph, [x for x in tensors if x.op not in done and x.op in self.order_index])
        if fast:
            self.covering = True
            loops = outcome.loops(len(self.result.rewritten))
            self.result.skip([], f"within the limit at the nominal sizes with {loops} "
                                 f"(the memory model counts {after:,} B), but {len(fast)} large "
                                 f"tensor{'s' if len(fast) > 1 else ''} left grow{'' if len(fast) > 1 else 's'} faster "
                                 f"with the run-time sizes than the function's inputs and outputs (`{fast[0].name}`, "
                                 f"{self.info[fast[0].name].bytes:,} B, as {nominal.describe_growth(fast[0])}): split "
                                 "too, so that the plan holds beyond the nominal sizes", code=Code.OUTGROWS)
        return frozenset(x.name for x in fast)

    def widest(self, best: Candidate | None) -> Candidate | None:
        """``best``, or where it is a best effort, the plan found for the same tensor that takes in every
        op it does and more, needing at most ``Tuning.reach_on_margin`` more by the model: one loop
        where there would be several (a kernel ridge's predictive mean and variance over the test
        points' kernel rows: the mean's loop alone leaves the rows whole for the variance)."""
        if best is None or best.planned.best_effort is None:
            return best
        wider = [c for c in self.found if c.key[0] == best.key[0] and c.grown.included > best.grown.included
                 and policy.reaches_on(best.planned, c.planned, self.tuning, 0)]
        return max(wider, key=lambda c: (len(c.grown.included), tuple(-k for k in c.key)), default=best)

    def options_of(self, root) -> list:
        """:func:`.analysis.root_options` of ``root``, made once until a loop is built (see :meth:`grown_for`)."""
        found = self.root_options.get(root)
        if found is None:
            found = self.root_options[root] = analysis.root_options(root, self.backward)
        return found

    def grown_for(self, options, ignored: frozenset) -> analysis.Grown | Why:
        """The region ``options`` grow (:func:`.analysis.grow`), with what it writes into and its
        prologue; or why there is none.  The large tensors a plan tries look at many of the same roots
        (those within ``Tuning.root_depth_wide`` ops downstream of each): a Vision Transformer's
        evaluation step at a run-time batch grew 96,000 regions, 1,928 distinct, in the first 2.5
        minutes of its first call (9 minutes when stopped).  Each is grown once until a loop is built
        (:meth:`build` forgets them: the graph has changed).  What else the search adds to the graph
        meanwhile reads the run-time sizes (shape ops, outside the plan's topological order), which no
        region takes in."""
        if not self.grown:
            self.pinned = sharding.pinned_axes(self.run.graph, self.run.options)
        key = (tuple(_option_key(o) for o in options), ignored is self.backward)
        found = self.grown.get(key)
        if found is None:
            found = analysis.grow(options, self.graph_outputs, self.order_index, ignored, self.reseed, self.pinned,
                                  self.built)
            if not isinstance(found, Why):
                t = self.tuning
                found.region.written_into = analysis.written_into(options, found, self.order_index)
                found.region.prologue = analysis.prologue(found, self.order_index, self.graph_outputs, ignored,
                                                          t.slice_share * self.budget, t.prologue_share,
                                                          t.prologue_ops, t.prologue_min_bytes)
            self.grown[key] = found
        return found


def _read_by_loop(t) -> bool:
    """Whether a loop reads ``t``, or it through ops that only pass it on (a gate, a custom gradient's)."""
    return any(reader.type in LOOP_TYPES for x in graph_query.passed_on(t) for reader in x.consumers())


def _drawn_in(region) -> tuple[str, ...]:
    """The random draws among ``region``'s ops that a loop draws again (:func:`.rules.redrawn`), by name."""
    return tuple(sorted(op.name for op in region.ops if rules.redrawn(op)))


def _option_key(option: analysis.RootOption) -> tuple:
    """What decides the region a root option grows: its root, combiner and axes, how its propagation
    slices the root's inputs (not the rebuild functions, made anew with each option) and the tensors it
    grows from instead of the root's inputs."""
    prop = option.propagation
    return (option.root, option.kind, tuple(option.input_axes), tuple(option.output_axes),
            None if prop is None else (prop.input_axes, prop.output_axes, prop.input_factors),
            tuple((t.ref(), a) for t, a in option.requests), tuple(option.absorbed))


@dataclasses.dataclass(frozen=True)
class Regrowable:
    """A starved loop computing its gradients as it goes, as :meth:`RegionSearch.build` built it: what
    building it again in larger chunks takes (:meth:`RegionSearch.regrow`).  ``tensor``: the large
    tensor it split; ``best``: its plan; ``backward_chunk``: its chunk (its gradients'); ``outputs``:
    the loop's results installed, ``made``: the ops its build made, ``record``: its plan's record,
    ``dispatch``: its :class:`.whole_at_run.Dispatch`; ``reads``: the inputs of its region's ops (roots
    and prologue too) when it was built, ``{op: [tensor, ...]}``, and ``installed``: once the loop was
    installed (its shape readers folded)."""

    tensor: object
    best: Candidate
    backward_chunk: int
    outputs: tuple
    made: frozenset
    record: object
    dispatch: object
    reads: dict
    installed: dict


# A root's plan, as RegionSearch.best_root ranks them (the smallest ``key`` is best); ``nest``: its
# attention computed over key blocks in each slice (:mod:`.nesting`), or ``None``; ``beside``: what the
# plan was made beside (:class:`.policy.Beside`).
Candidate = collections.namedtuple("Candidate", "key options grown planned remat nest beside", defaults=(None, None))
