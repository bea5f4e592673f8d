"""Policy: how large a region's slices are, and which candidate region is best.

    chunk = the largest c with  fixed + c * per_unit  <=  budget        (:func:`.chunk_plan.plan_chunks`)

Pure functions of the memory model's figures, the tuning (:class:`.tuning.Tuning`) and, where the
chunk is sized from XLA's figure, of figures a caller measured: nothing here builds or compiles.

* :func:`plan` counts a region's bytes a unit of the split axis (its materialised tensors, the
  slices it copies, a kernel's scratch) and what stays whatever the chunk (parameters, outputs,
  what the rest of the program holds while the region runs: :func:`background`), and asks for the
  largest chunk under the budget; or says why no split helps (a typed :class:`~.outcome.Why`).
* :func:`rank` orders candidates: plans that meet the limit first, a small joined result, few
  steps, the most bytes freed for the backward; best efforts by what they leave.
* :func:`calibrated` sizes a chunk again from XLA's figure for the loop at two chunk sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import NamedTuple

from grappler_ext.op_types import ARGUMENT_OPS, HELD_OPS, nbytes
from grappler_ext.splitter import chunk_plan, rules
from grappler_ext.splitter.analysis import Grown, joined_bytes, materialised_bytes, top_k
from grappler_ext.splitter.chunk_plan import ChunkPlan
from grappler_ext.splitter.loop import external_inputs
from grappler_ext.splitter.outcome import BestEffort, Code, Sizing, Why
from grappler_ext.splitter.tuning import Tuning

__all__ = ["Beside", "Planned", "Sized", "plan", "rank", "leaves", "reaches_on", "calibrated", "capped",
           "split_anyway", "at_least", "starved", "FusedGrowth", "fused_grown", "nested_plan", "saves_enough"]


@dataclasses.dataclass(frozen=True)
class Beside:
    """What the rest of the program holds, by the memory model of the program as traced.

    Attributes:
      est, info: the model's estimate and per-tensor annotations of the program.
      step_of: each op's step in the model's schedule.
      hoped: tensors expected to be split by their own loops (left out of what the rest holds).
      backward: the gradient ops inside the function (empty without gradients inside).
      room: ``(bytes, chunk)`` given to a starved gradient loop (see the driver's growth), or zeros.
      written: where the model cannot estimate the program (an op without a byte rule), XLA's figure
        for it as written if measured, else the model's lower bound for it; else ``None``.
      asks: whether a gradient inside the function asks for a tensor's gradient
        (:func:`grappler_ext.gradients.wanted`); ``None``: every tensor's.
    """

    est: object
    info: Mapping
    step_of: Mapping[str, int]
    hoped: frozenset
    backward: frozenset
    room: tuple[int, int] = (0, 0)
    written: int | None = None
    asks: Callable[[object], bool] | None = None


@dataclasses.dataclass(frozen=True)
class Planned:
    """A region's plan: the forward's chunks, the backward's chunk, and the bytes a unit costs;
    ``figures``: XLA's figures for its loop measured while planning it, ``((chunk, bytes), ...)``
    (:func:`nested_plan`'s), which :func:`calibrated` reads instead of compiling the loop again."""

    chunks: ChunkPlan
    backward_chunk: int
    per_unit: float
    backward_unit: float
    best_effort: BestEffort | None = None
    figures: tuple[tuple[int, int], ...] = ()
    fused_chunk: int | None = None           # the chunk of a loop computing its gradients as it goes ...
    fused_unit: float | None = None          # ... and the bytes a unit costs it (``None``: backward's)


@dataclasses.dataclass(frozen=True)
class Sized:
    """A plan sized again from XLA's figure for its loop: where the chunk came from, with the figures."""

    chunks: ChunkPlan
    per_unit: float
    sizing: Sizing
    bytes_per_row: float | None = None
    loop_figure_bytes: int | None = None
    detail: str = ""


def steps(grown: Grown, beside: Beside) -> tuple[list[int], list[int]]:
    """The schedule steps of the region's kernels, and of the gradient kernels reading its tensors."""
    step_of = beside.step_of
    forward = [step_of[op.name] for op in grown.included if op.name in step_of]
    readers = {c for op in grown.included for o in op.outputs for c in o.consumers() if c in beside.backward}
    return forward, [step_of[op.name] for op in readers if op.name in step_of]


def background(beside: Beside, at: list[int], grown: Grown, beside_loop: bool = False) -> int:
    """The most pool bytes the rest of the program holds over the schedule steps ``at`` (first to
    last), by the model's schedule: the region's own tensors, and the large tensors still to be
    split, left out; ``beside_loop``: what is held beside the region's loop, which runs as one step,
    so no other op's scratch (a solve scheduled between the region's ops runs before or after it)."""
    if not at:
        return 0
    est = beside.est
    lo, hi = min(at), max(at)
    gone = _gone(beside, grown)
    delta = [0] * (hi - lo + 2)
    for b in est.buffers:
        if b.kind == "parameter" or b.kind == "constant" or b.last_step < lo or b.first_step > hi:
            continue
        # A kernel's scratch goes with its result (a triangular solve's, with the solve's output).
        names = (b.name.removesuffix(" (scratch)") + ":0",) if b.kind == "scratch" else (b.name,) + b.tensors
        if any(n in gone for n in names) or (beside_loop and b.kind == "scratch"):
            delta[max(b.first_step, lo) - lo] -= b.bytes
            delta[min(b.last_step, hi) - lo + 1] += b.bytes
    running, most = 0, 0
    for s in range(lo, hi + 1):
        running += delta[s - lo]
        most = max(most, est.schedule[s].live_bytes + running)
    return most


def _gone(beside: Beside, grown: Grown) -> set:
    """The tensors (names) :func:`background` leaves out: the region's own, and those still to be split."""
    return beside.hoped | {o.name for op in grown.included for o in op.outputs}


def largest_beside(beside: Beside, at: list[int], grown: Grown):
    """The largest buffer :func:`background` counts beside the region's loop over the schedule steps ``at``
    (not a parameter, a constant or scratch), or ``None``."""
    gone = _gone(beside, grown)
    live = [b for b in beside.est.buffers if at and b.kind not in ("parameter", "constant", "scratch")
            and b.first_step <= max(at) and b.last_step >= min(at) and not ({b.name, *b.tensors} & gone)]
    return max(live, key=lambda b: b.bytes, default=None)


def plan(options, grown: Grown, beside: Beside, budget: int, tuning: Tuning,
         measured: float | None = None, large_joins: bool = False,
         measured_backward: float | None = None) -> Planned | Why:
    """The forward plan, the backward's chunk, a best effort and the bytes a unit of the split axis
    costs in the forward and the backward loop's body; or why no split helps.

    ``measured``: the bytes a unit costs the forward loop by XLA's figure (see :func:`calibrated`),
    used instead of the memory model's count.  ``large_joins``: a joined result over half the limit
    is planned (a best effort then) instead of refused -- for programs whose limit cannot be met.
    ``measured_backward``: the bytes a unit costs the gradient loop by XLA's figure (see
    :func:`backward_sized`), instead of ``Tuning.backward_cost_factor`` times the forward's count."""
    est, info = beside.est, beside.info
    region = grown.region
    length = region.length
    folded = {o.root for o in options if o.kind != "concat"}  # roots whose outputs do not scale
    # Kernels' scratch (XLA's blocked triangular solve keeps about one more copy of its
    # right-hand side) scales with the slice like the outputs do.
    scratch = {b.name.removesuffix(" (scratch)"): b.bytes for b in est.buffers if b.kind == "scratch"}
    per_unit = 0.0
    for op in grown.included:
        if op in folded:
            continue
        per_unit += scratch.get(op.name, 0) / length
        for o in op.outputs:
            i = info.get(o.name)
            if i is not None and i.materialised and i.bytes:
                per_unit += i.bytes / length
    # Inputs computed in full before the loop (a variable's read is its parameter, counted already).
    computed_outside = 0
    for ref in region.sliced_inputs:
        t = ref.deref()
        per_unit += nbytes(t) / length                          # the slice copied into the body
        if t.op.type not in ARGUMENT_OPS:
            computed_outside += nbytes(t)
    for ref in region.whole_inputs - set(region.sliced_inputs):
        if ref.deref().op.type not in HELD_OPS:
            computed_outside += nbytes(ref.deref())             # read whole by every slice
    # (a result written into its input's buffer, a variable's new value, takes no bytes of its own)
    root_out = sum(nbytes(t) for o in options if o.root not in region.written_into for t in o.root.outputs)
    joined = joined_bytes(options, region.written_into)
    described = options[0].describe()
    if joined > budget / 2 and not large_joins:
        # Slices joined into a result this large save nothing: what reads the result must be
        # in the loop (SGPR's K(Z, X_test) is read by the solves after it).
        return Why(Code.JOINED_TOO_LARGE, f"{described}: its joined result ({joined:,} B) is over half the limit")
    removed = materialised_bytes(grown.included, info)
    # The largest tensor it computes, a kernel's scratch counted (a solve's copy of its right-hand side).
    roots = {o.root for o in options}
    largest = max([i.bytes for op in grown.included - roots for o in op.outputs
                   if (i := info.get(o.name)) is not None and i.materialised and i.bytes]
                  + [scratch.get(op.name, 0) for op in grown.included], default=0)
    if largest <= root_out and not large_joins:
        # Nothing in it is larger than its result (a projection and its bias add, a matmul split
        # along its contraction): each slice's result, joined or summed, holds what it would free.
        return Why(Code.SAVES_TOO_LITTLE, f"{described}: saves too little (nothing it computes is larger than its "
                                          f"result, {root_out:,} B)")
    # Joining slices along an axis other than the first transposes the stacked slices: one more
    # copy of the result at the end.
    join_cost = joined * (2 if any(o.kind == "concat" and any(o.output_axes) for o in options) else 1)
    if joined and removed - join_cost < tuning.min_tensor_fraction * budget:
        # Nearly all the region holds is its joined result (attention's scores einsum alone, a
        # Transformer's output layer): the loop would write what it was meant to avoid.
        return Why(Code.SAVES_TOO_LITTLE, f"{described}: saves too little (joining its result takes {join_cost:,} B "
                                          f"of the {removed:,} B the region holds)")
    # Parameters, constants, the outputs (the result among them), one more copy of the result
    # while its slices are joined, and what the loop reads that is computed before it; or, if
    # more, what the rest of the program holds while the region runs (its other tensors
    # live then: an attention layer's loop runs beside the activations kept for the backward).
    constant = est.parameter_bytes + est.constant_bytes
    forward_steps, backward_steps = steps(grown, beside)
    others = background(beside, forward_steps, grown, beside_loop=True)
    fixed = constant + max(max(est.output_bytes, root_out) + computed_outside, others + root_out) + root_out
    # Every tensor the model materialises in the region counted at once (not the peak of its
    # schedule: memory_model.bytes_for_chunk on the original program's schedule under-predicted
    # the loop's body by up to 2x in measurements -- logsumexp, attention -- and safety comes first).
    per_unit /= tuning.safety_margin
    backward_unit = (per_unit * tuning.backward_cost_factor if measured_backward is None
                     else measured_backward / tuning.calibration_margin)
    if measured is not None:
        per_unit = measured / tuning.calibration_margin
    limit = budget
    budget = est.parameter_bytes + max(0, budget - est.parameter_bytes) * tuning.pool_margin
    chunks = chunk_plan.plan_chunks(length, per_unit, fixed, budget)
    best_effort = None
    if not chunks:
        stop, rest = grown.stops[0].text if grown.stops else "", ""
        if fixed > budget and 2 * others > fixed and (held := largest_beside(beside, forward_steps, grown)):
            # (what the loop cannot shrink: the rest of the program, not where the region stops)
            rest = (f"the rest of the program holds {others:,} B while it runs, the largest `{held.name}` "
                    f"({held.bytes:,} B)")
        # The limit cannot be met: still shrink the region until it is a small part of what
        # must stay (best_effort_fraction of the fixed bytes), unless that gains nothing.
        chunk = max(1, int(tuning.best_effort_fraction * fixed / per_unit)) if per_unit else length
        predicted = fixed + chunk * per_unit
        # Only where the model says it at least halves the program (its static part, when shapes
        # are dynamic; XLA's figure as written, where an op without a rule leaves the model no count:
        # a GP's `tf.linalg.solve`): a loop has costs of its own.
        whole = est.peak_bytes if est.peak_bytes is not None else (
            beside.written if est.unknown else constant + est.live_peak_bytes)
        if (chunk >= length or per_unit * length <= tuning.best_effort_fraction * fixed
                or whole is None or predicted > whole / 2):
            return Why(Code.NO_PLAN, f"{described}: {chunks.reason}" + (
                f"; the region stops where {stop}" if stop else ""))
        chunks = ChunkPlan(length, chunk, int(predicted))
        best_effort = BestEffort(chunks.predicted_bytes, stop=stop, beside=rest,
                                 stop_code=grown.stops[0].code if grown.stops and not rest else None)
    k = top_k(options)
    chunk = at_least(chunks.chunk, length, k)
    if chunk is None:
        return Why(Code.TOP_K_TOO_SMALL, f"top-k needs chunks of at least k = {k}")
    chunks = ChunkPlan(length, chunk, int(fixed + chunk * per_unit))
    # The backward also holds the gradients of the region's inputs (those a gradient asks for).
    gradients = sum(nbytes(r.deref()) for r in set(region.sliced_inputs) | region.whole_inputs
                    if beside.asks is None or beside.asks(r.deref()))
    fixed_backward = max(fixed, constant + background(beside, backward_steps, grown) + root_out) + gradients
    # The room XLA's figure showed the rest leaves (a starved gradient loop grown) taken off what stays.
    reverse = chunk_plan.plan_chunks(length, backward_unit, max(0, fixed_backward - beside.room[0]), budget)
    backward_chunk = at_least(reverse.chunk if reverse else max(1, chunk // int(tuning.backward_cost_factor)),
                              length, k) or chunk
    # A loop computing its gradients as it goes holds a slice's forward tensors and their gradients,
    # counted from the backward as traced (at least the forward's unit, at most the backward loop's),
    # beside what the forward's loop has beside it and the gradients' sums: the region's backward is
    # the loop's (not the original backward's steps, which held the region's gradients).
    # The backward loop's unit instead: with a convolution whose windows overlap (XLA's layouts of it
    # are beyond the model's count: a Keras CNN's loop alone 5.6 times the model's forward slice a row;
    # a Vision Transformer's patches, windows side by side, 0.7 times); and for a chunk scaled to run
    # sizes that grow its rows, which rests on the model's count at sizes nothing measured (a padded
    # batch's attention along its queries, 9 rows planned at [8, 172], was 1.37 MB at [16, 256] under a
    # limit of 1.08 MB).
    scaled = region.scaled is not None and not region.scaled.steady
    fused_unit = backward_unit if scaled or any(rules.windows_overlap(op) for op in grown.included) else min(
        backward_unit, per_unit + gradient_unit(grown, beside, folded) / tuning.safety_margin)
    as_one = chunk_plan.plan_chunks(length, fused_unit, max(0, fixed + gradients - beside.room[0]), budget)
    fused_chunk = at_least(as_one.chunk if as_one else max(1, int(chunk * per_unit / fused_unit)), length, k) or chunk
    if beside.backward and fixed_backward > limit and best_effort is None:
        # The gradients inside the function run this backward: say the step cannot fit.
        best_effort = BestEffort(fixed_backward, by_backward=True)
    return Planned(chunks, min(backward_chunk, chunk), per_unit, backward_unit, best_effort,
                   fused_chunk=min(fused_chunk, chunk), fused_unit=fused_unit)


def gradient_unit(grown: Grown, beside: Beside, folded) -> float:
    """The bytes a unit of the split axis costs the region's gradients, by the model's count of the
    backward as traced: the materialised tensors shaped as one of the region's own, computed by the
    gradient ops reading the region's tensors and by those reading theirs, as long as they are so
    shaped (a kernel's [L, L, 4] differences, fused into their sum in the forward, are materialised
    by their gradient).  A gradient leaving the region (its inputs') in a shape of the region's own
    is followed on: the count errs large.  0 without gradients inside the function."""
    if not beside.backward:
        return 0.0
    length, info = grown.region.length, beside.info
    ops = [op for op in grown.included if op not in folded]
    shaped = {tuple(o.shape.as_list()) for op in ops for o in op.outputs
              if o.shape.rank and (i := info.get(o.name)) is not None and i.bytes and i.bytes >= length}
    seen, total = set(), 0
    todo = [c for op in ops for o in op.outputs for c in o.consumers() if c in beside.backward]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        outputs = [o for o in op.outputs if o.shape.rank and tuple(o.shape.as_list()) in shaped]
        if not outputs:
            continue
        for o in outputs:
            i = info.get(o.name)
            if i is not None and i.materialised and i.bytes:
                total += i.bytes
            todo.extend(c for c in o.consumers() if c in beside.backward)
    return total / length


def saves_enough(figure: int, written: int, tuning: Tuning) -> bool:
    """Whether a plan XLA's figure puts at ``figure`` (over the limit) saves enough of the program as
    written (``written``) to be worth its loops: at most ``Tuning.over_gain`` of it."""
    return figure < written * tuning.over_gain


def rank(planned: Planned, options, held: int, budget: int, tuning: Tuning, region=None,
         computed: float = 1.0) -> tuple:
    """The key candidates are ordered by (the smallest is best).

    Plans that meet the limit first; among them, those whose chunk holds at every run-time size
    before those whose chunk is scaled to it (``region.scaled``: a loop over a kNN's queries known
    only at run time before one over its points, the queries beside them), and among these the
    slowest to run out as the run's sizes grow (:attr:`~.scaling.Scaling.degree`: a padded batch's
    attention along its queries, not its examples); then those computing a
    share of their work of at most ``Tuning.tiled_share`` (``computed``: an attention in tiles, a
    causal mask's half skipped, before a loop over its rows computing every score), and those
    computing it more than once last (``computed`` over 1: an untiled key split recomputing the
    scores for the gradients inside the function, or one of Keras' attention, which a loop over
    its rows reaches on from); then those whose joined result is small (a region reaching on to a
    reduction, rather than stopping at a large tensor it writes whole: SGPR's K(Z, X) as a concat,
    2 steps, left [M, N] and its copies live where the region through A A^T and A err, 3 steps,
    left none), those writing variables in place (a wide layer's update along its kernel's
    columns; ``region.written_into``), the fewest steps, then the one freeing the most bytes the
    gradients would hold (``held``); then the fewest bytes among those that cannot (a best effort
    is judged by the size of its joined result, then by what it needs, its backward counted); a
    plan that does not split last."""
    chunks = planned.chunks
    count = chunks.steps + (1 if chunks.tail else 0)
    written_into = region.written_into if region is not None else ()
    joined = joined_bytes(options, written_into)
    if planned.best_effort is not None:
        # (a region writing a large result whole leaves what reads it to another loop: a
        # feed-forward block's output joined before the softmax over the sequence that reads it)
        # (what it needs: its loop's count, or what stays while its backward runs, whichever is more)
        needed = max(chunks.predicted_bytes, planned.best_effort.needed_bytes)
        return (not chunks.splits, True, joined > tuning.min_tensor_fraction * budget, needed, count)
    # (a loop writing variables in place holds none of their gradients whole, which a loop over the
    # batch's rows keeps, and the model's count of it misses: first among those within the limit)
    scaled = region.scaled if region is not None else None
    return (not chunks.splits, False, 0 if scaled is None else 1 + scaled.degree,
            (computed > tuning.tiled_share) + (computed > 1),
            joined > tuning.min_tensor_fraction * budget, not written_into, count, -held, chunks.predicted_bytes)


def leaves(grown: Grown, beside: Beside) -> int:
    """The most the rest of the program holds at any step, the region's tensors left out, once the
    other large tensors are split by their own loops (a loop over an attention's queries leaves the
    feed-forward block's [B, L, 4 D] after it where that cannot be split; one over the whole layer,
    none).  Not what the rest holds as traced: a region reaching on to the loss along the batch takes
    in every layer, and no other loop can split what its loop body holds (a Transformer's step at
    batch 8, one example a step at 2.7 GB, where loops along each layer's sequence reach 2.2 GB)."""
    schedule = beside.est.schedule
    if not schedule:
        return 0
    return background(beside, [0, len(schedule) - 1], grown)


def reaches_on(best: Planned, wider: Planned, tuning: Tuning, left: int) -> bool:
    """Whether a region reaching on from ``best``'s along the same axis (taking in all of it) is the
    better plan: one loop where there would be several, each with its own joined result and copies.
    So when it meets the limit; or, when it does not, if it needs at most ``Tuning.reach_on_margin``
    more by the model than ``best`` does or than the rest holds beside ``best`` once the other large
    tensors are split (``left``, :func:`leaves`)."""
    if not wider.chunks.splits:
        return False
    if wider.best_effort is None:
        return True
    return wider.chunks.predicted_bytes <= max(best.chunks.predicted_bytes, left) * (1 + tuning.reach_on_margin)


def rest_beside(grown: Grown, beside: Beside, limit: int, tuning: Tuning) -> int | None:
    """What the rest of the program holds while the region runs, when the region's loop is all the
    program holds (see ``Tuning.whole_program_margin``); else ``None``."""
    if beside.backward:
        return None
    mine = {o.name for op in grown.included for o in op.outputs}
    if not beside.hoped <= mine:
        return None                       # another large tensor: its loop or its whole value
    est = beside.est
    # The program's parameters and constants too, less those the loop reads itself (in its figure).
    read = sum(nbytes(t) for t in external_inputs(grown.region) if t.op.type in ("Placeholder", "Const"))
    rest = (background(beside, steps(grown, beside)[0], grown)
            + max(0, est.parameter_bytes + est.constant_bytes - read))
    return rest if rest <= tuning.min_tensor_fraction * limit else None


def calibrated(options, grown: Grown, chunks: ChunkPlan, beside: Beside, budget: int, tuning: Tuning,
               loop_figure: Callable[[int], int], large_joins: bool = False, model_per_unit: float = 0.0,
               measured: tuple[tuple[int, int], ...] = ()) -> Sized:
    """The plan again, its chunk sized from XLA's figure for the loop (``loop_figure(chunk)``: the
    loop alone compiled at that chunk, never run); or the plan as it was, with why.

    The difference of the figures at the planned chunk and at twice (or half) that, over the
    difference of the chunks, is what one row of the split axis costs the loop, fusion, in-place
    updates and the combiner's carry included.  The memory model's count is kept on the safe side
    (``Tuning.safety_margin``), so this mostly gives larger chunks, and fewer steps, than it did.
    ``measured``: two ``(chunk, figure)`` of this very loop already known (:attr:`Planned.figures`),
    read instead of those two compiles (the fit below still compiles at the chunk it chooses).

    A loop whose chunk is scaled to the run's sizes (:mod:`.scaling`) is compiled alone at the
    nominal sizes it is planned at, and planned there by XLA's bytes a row, which the run's sizes
    scale as they scaled the model's count (never sized to the whole program's margin: that would
    fill the limit at the nominal sizes alone).  ``experiments/padded``'s Keras 3 attention classifier
    at L = 1024, planned at [8, 627]: 165 kB a row, its forward chunk 33 rows where the model's count
    gave 19.
    """
    k = top_k(options)
    length, first = chunks.length, chunks.chunk
    second = 2 * first if 2 * first <= length // 2 else first // 2
    unchanged = Sized(chunks, 0.0, Sizing.MODEL)
    scaled = grown.region.scaled is not None
    if len(measured) == 2 and measured[0][0] != measured[1][0]:
        (first, low), (second, high) = sorted(measured)
        figures = [low, high]
    elif second < k or second == first:
        return dataclasses.replace(unchanged, sizing=Sizing.MODEL_NO_SECOND_SIZE)
    else:
        try:
            figures = [loop_figure(c) for c in (first, second)]
        except Exception as e:  # noqa: BLE001 - the model's plan stands; the record says why
            return dataclasses.replace(unchanged, sizing=Sizing.MODEL_MEASURE_FAILED, detail=type(e).__name__)
    per_row = (figures[1] - figures[0]) / (second - first)
    if per_row <= 0:
        return dataclasses.replace(unchanged, sizing=Sizing.MODEL_NOT_GROWING)
    if per_row < tuning.calibration_floor * model_per_unit:
        # The loop alone fused what the program will not (kNN's top-k along the points: 2.6 B a row
        # alone, 45.7 kB by the model, 129 MB as the program's loop): the model's plan stands.
        return dataclasses.replace(unchanged, sizing=Sizing.MODEL_IMPLAUSIBLE,
                                   detail=f"{per_row:,.1f} B a row against the memory model's {model_per_unit:,.0f} B")
    # (a scaled loop is sized by its row's bytes: the room the run's sizes leave scales its chunk)
    rest = None if scaled else rest_beside(grown, beside, budget, tuning)
    if rest is not None:
        try:
            fitted = _fitted(length, k, (first, figures[0]), per_row, rest, budget, tuning, loop_figure)
        except Exception:  # noqa: BLE001 - the margins' plan below stands
            fitted = None
        if fitted is not None:
            return fitted
    again = plan(options, grown, beside, budget, tuning, measured=per_row, large_joins=large_joins)
    if isinstance(again, Why):
        return dataclasses.replace(unchanged, sizing=Sizing.MODEL_MEASURED_REFUSED, detail=again.text)
    new = again.chunks
    if not new.splits:
        # XLA's figure says the region fits whole, while the program does not.
        new = split_anyway(new, again.per_unit)
    return Sized(new, again.per_unit, Sizing.NOMINAL_FIGURE if scaled else Sizing.LOOP_FIGURE, bytes_per_row=per_row)


def backward_sized(options, grown: Grown, chunks: ChunkPlan, backward_chunk: int, beside: Beside, budget: int,
                   tuning: Tuning, gradient_figure: Callable[[int], int],
                   per_row: float | None = None) -> tuple[int, float, float] | None:
    """The gradient loop's chunk from XLA's figures for the loop and its gradient alone
    (``gradient_figure(chunk)``, both loops in chunks of ``chunk``, never run) at ``backward_chunk`` and
    twice it, its bytes a row there and the unit planned with (the row over ``Tuning.calibration_margin``);
    ``None`` where the model's chunk stands: a loop of fewer gradient steps than
    ``Tuning.backward_sizing_steps``, or whose gradient chunk is over half the forward's ``chunks``
    (little to gain for two compiles), or where the figures do not say.

    The model plans a gradient step at ``Tuning.backward_cost_factor`` times its count of a forward
    slice, an upper bound that XLA's fusion of the recomputed slice and its gradient rarely reaches (a
    mixed-precision Keras 3 attention classifier's step on padded batches: 137 kB a row by XLA, about
    a tenth of the model's 1.44 MB): a gradient loop of many small steps, each rewriting the gradients of what
    the loop reads whole.  Here the row is XLA's, the rest of the plan the model's
    (:func:`plan` with ``measured_backward``; ``per_row``: the forward's row by XLA's figure, where it
    sized the forward), as a forward loop is calibrated (:func:`calibrated`).  A row XLA puts above
    the model's count gives a smaller chunk: the figure is believed both ways.
    """
    length = chunks.length
    if -(-length // backward_chunk) < tuning.backward_sizing_steps or 2 * backward_chunk > chunks.chunk:
        return None
    first, second = backward_chunk, 2 * backward_chunk
    try:
        low, high = gradient_figure(first), gradient_figure(second)
    except Exception:  # noqa: BLE001 - the model's chunk stands
        return None
    row = (high - low) / (second - first)
    if row <= 0:
        return None
    again = plan(options, grown, beside, budget, tuning, measured=per_row, measured_backward=row)
    if isinstance(again, Why) or again.best_effort is not None:
        return None
    sized = min(again.backward_chunk, chunks.chunk)
    return (sized, row, again.backward_unit) if sized != backward_chunk else None


def nested_plan(options, grown: Grown, beside: Beside, budget: int, tuning: Tuning, unnested: Planned,
                loop_figure: Callable[[int], int]) -> Planned | None:
    """The plan of a loop whose attention is computed over key blocks in each slice
    (:mod:`.nested_loop`), its bytes a row from XLA's figures for the loop alone at two chunks
    (``loop_figure``: the memory model counts a slice's scores over every key, which the slice then
    never holds), if it is better than the plan without (``unnested``, a best effort): within the
    limit, or needing less; else ``None``."""
    length = grown.region.length
    first = max(1, length // 16)
    if 2 * first > length // 2:
        return None
    try:
        low, high = (loop_figure(c) for c in (first, 2 * first))
    except Exception:  # noqa: BLE001 - the plan without nesting stands
        return None
    per_row = (high - low) / first
    planned = plan(options, grown, beside, budget, tuning, measured=per_row) if per_row > 0 else None
    if not isinstance(planned, Planned) or (planned.best_effort is not None and planned.chunks.predicted_bytes
                                            >= unnested.chunks.predicted_bytes):
        return None
    return dataclasses.replace(planned, figures=((first, low), (2 * first, high)))


def _fitted(length: int, k: int, measured: tuple[int, int], per_row: float, rest: int, limit: int, tuning: Tuning,
            loop_figure: Callable[[int], int]) -> Sized | None:
    """The largest chunk whose loop, by XLA's figure, fits ``Tuning.whole_program_margin`` of the
    limit beside ``rest``: the straight line through the measured ``(chunk, bytes)`` to the target,
    then compiled at that chunk, and the line steepened through that figure until it fits (three
    tries).  ``None``: the conservative plan stands."""
    target = int(limit * tuning.whole_program_margin) - rest
    chunk_at, figure_at = measured
    intercept = max(0, figure_at - int(per_row * chunk_at))
    slope = per_row
    for _ in range(3):
        chunks = chunk_plan.plan_chunks(length, slope, intercept, target)
        chunk = at_least(chunks.chunk, length, k) if chunks and chunks.splits else None
        if chunk is None:
            return None
        figure = loop_figure(chunk)
        if figure <= target:
            return Sized(ChunkPlan(length, chunk, figure + rest), per_row, Sizing.PROGRAM_FIGURE,
                         bytes_per_row=per_row, loop_figure_bytes=figure)
        # Over (a remainder slice, a layout copy): the line through the intercept and this figure.
        slope = max(1.05 * slope, (figure - intercept) / chunk)
    return None


def capped(chunks: ChunkPlan, per_unit: float, budget: int, tuning: Tuning) -> ChunkPlan:
    """``chunks`` with slices of at most ``Tuning.slice_share`` of the budget, by the bytes a unit costs."""
    length, cap = chunks.length, tuning.slice_share * budget
    if per_unit <= 0 or chunks.chunk * per_unit <= cap:
        return chunks
    smaller = chunk_plan.plan_chunks(length, per_unit, 0, int(cap))
    chunk = smaller.chunk if smaller else 1
    return ChunkPlan(length, chunk, int(chunks.predicted_bytes - (chunks.chunk - chunk) * per_unit))


def split_anyway(whole: ChunkPlan, per_unit: float) -> ChunkPlan:
    """The plan for a region that fits the limit whole but is split all the same (the program as a
    whole does not fit, or the gradients would hold the region's tensors): two steps at least.
    XLA inlines a loop of one step, and then merges the forward's copy of the body with the
    backward's (CSE), holding its tensors all the same."""
    length, chunk = whole.length, whole.length // 2
    return ChunkPlan(length, chunk, int(whole.predicted_bytes - (length - chunk) * per_unit))


def without_tail(chunks: ChunkPlan, per_unit: float) -> ChunkPlan:
    """``chunks`` with the largest chunk that divides the length, if one is at least half as large: a
    loop writing variables in place (:class:`~.combiners.InPlace`) then has no remainder slice after
    it.  XLA would fuse the remainder's update of a moment with its use in the weight's update, read
    the moment's old slice after writing it, and so copy both moments whole (measured: Adam on a
    [2048, 16384] kernel, 2 x 128 MiB more)."""
    length, chunk = chunks.length, chunks.chunk
    if not length % chunk:
        return chunks
    divisor = next((d for d in range(chunk, chunk // 2, -1) if length % d == 0), None)
    if divisor is None:
        return chunks
    return ChunkPlan(length, divisor, int(chunks.predicted_bytes - (chunk - divisor) * per_unit))


def at_least(chunk: int, length: int, k: int) -> int | None:
    """``chunk`` or the next smaller size whose slices (the remainder too) hold at least ``k``."""
    while chunk > k and 0 < length % chunk < k:
        chunk -= 1
    return chunk if chunk >= k else None


def starved(chunks: ChunkPlan, backward_chunk: int, tuning: Tuning, fused: int | None = None) -> bool:
    """Whether a gradient loop in chunks of ``backward_chunk`` is starved: many steps, each a small
    part of its forward's (each step rewrites the gradients of the inputs the loop reads whole).
    ``fused``: the forward's chunk of a loop that computes its gradients as it goes in chunks of
    ``backward_chunk`` (each step a slice's forward and backward: small products on a CPU); starved
    from ``Tuning.fused_starved_steps`` steps whatever gave it that chunk (the model's backward plan,
    or the share of the budget a slice may take, :func:`capped`)."""
    backward_steps = -(-chunks.length // backward_chunk)
    if fused is not None:
        return backward_steps >= tuning.fused_starved_steps
    return (backward_steps >= tuning.starved_steps
            and backward_chunk * tuning.backward_cost_factor < chunks.chunk)


class FusedGrowth(NamedTuple):
    """A fused loop's grown ``chunk`` (:func:`fused_grown`) and ``added``: XLA's figure for the loop
    alone at it less at the chunk it had, both measured."""

    chunk: int
    added: int


def fused_grown(room: tuple[int, int], length: int, k: int, tuning: Tuning,
                loop_figure: Callable[[int], int], tries: int = 3) -> FusedGrowth | None:
    """The chunk of a loop computing its gradients as it goes, grown into ``room`` (bytes XLA's figure
    for the program as split left under the limit, and the chunk the loop had then), by XLA's figures
    for the loop alone (``loop_figure``); two steps at least.  Its bytes a row are read from two chunks,
    the loop's and twice it, or 2 and 4 where the loop's is 1: XLA drops a dimension of size 1 and lays
    out a slice of one row its own way (a Keras CNN's step along its batch, alone at 1, 2, 3 and 4
    examples: 66.7, 96.1, 93.3 and 120.5 MB; 29 MB "a row" from 1 to 2, 12 MB from 2 to 4).  The chunk
    they give for ``Tuning.growth_aim`` of the room (less ``Tuning.calibration_margin``) is kept where
    the loop alone at it takes at most the room more than at its own chunk; else the line through the
    largest chunk measured within the room and the one over it gives the next (``tries`` times), and
    the largest chunk measured within the room is kept if none larger is.  XLA's figure is nearly
    straight in the chunk (a Transformer's attention loop alone: 67.9 kB a row from 32 to 64 rows,
    68.5 kB from 64 to 256), not always (a Keras convnet's loop alone at 4, 6, 8, 12 and 16 rows: 4.8,
    8.0, 8.5, 16.8 and 15.5 MB; a triplet loss' step over 4,096 embeddings at 2, 4, 47, 92 and 182
    rows: 134.6, 134.8, 204.7, 207.1 and 212.7 MB, a step between 4 and 47).  ``None`` where the
    figures do not say (a failed compile, a figure that does not grow) or nothing larger fits; else the
    chunk and what the loop alone takes at it more than at its own (:class:`FusedGrowth`)."""
    extra, chunk = room
    first = max(chunk, 2)
    second = min(2 * first, length // 2)
    if second <= first:
        return None
    allowed = extra * tuning.calibration_margin
    aimed = allowed * tuning.growth_aim
    figures: dict[int, int] = {}

    def fits(c: int) -> bool:
        return c > chunk and at_least(c, length, k) == c and figures[c] - figures[chunk] <= allowed

    good = chunk
    try:
        for c in dict.fromkeys((chunk, first, second)):
            figures[c] = loop_figure(c)
        per_row = (figures[second] - figures[first]) / (second - first)
        if per_row <= 0:
            return None
        good = max((c for c in figures if fits(c)), default=chunk)
        for _ in range(tries):
            # From the largest chunk within the room, along the line, to the aimed share of it.
            grown = at_least(min(good + int((aimed - (figures[good] - figures[chunk])) / per_row), length // 2),
                             length, k)
            if grown is None or grown <= good:
                break
            if grown not in figures:
                figures[grown] = loop_figure(grown)
            if fits(grown):
                return FusedGrowth(grown, figures[grown] - figures[chunk])
            per_row = (figures[grown] - figures[good]) / (grown - good)     # the line up to the one over
            if per_row <= 0:
                break
    except Exception:  # noqa: BLE001 - the largest chunk measured within the room, or the plan, stands
        pass
    return FusedGrowth(good, figures[good] - figures[chunk]) if good > chunk else None


def remat_worthwhile(chunks: ChunkPlan, held: int, budget: int, tuning: Tuning) -> bool:
    """Whether a region that fits whole is split all the same: the gradients inside the function
    would hold its tensors (``held`` bytes) from the forward to the backward."""
    return not chunks.splits and held > tuning.min_tensor_fraction * budget and chunks.length >= 2

