"""splitter: compute a region too large for the limit one slice at a time, and combine exactly.

    top_k(-D(x, y))  with D: [N, M]   =>   while i < N / C:  out[iC:(i+1)C] = top_k(-D(x[iC:(i+1)C], y))

When the memory model (:mod:`grappler_ext.memory_model`) predicts that the program exceeds
``Options.memory_limit_bytes``, the pass takes the largest tensor the program materialises and
looks, among the ops it feeds (8 ops deep; 32 if none of those meets the limit: SGPR's predictive
density is 14 ops after K(Z, X*)), for a *root*: an op whose result is small but whose operands are
large.  For each way of splitting the root it grows a *region* backwards with the split-axis
rules of :mod:`grappler_ext.split_rules`, asks the policy :func:`grappler_ext.chunk_plan.plan_chunks`
for the largest chunk that fits, and builds the loop with :mod:`grappler_ext.split_loop`:

=====================  ==============================================  =======================
root                   split                                           combiner
=====================  ==============================================  =======================
any op with a rule     an axis of its output (rows of a top-k, a       ``concat``
                       matmul, an elementwise result)
``Sum``/``Mean``/...   a reduced axis                                   ``sum``/``mean``/``max``..
``ArgMax``/``ArgMin``  the reduced axis                                 running arg (first index)
``TopKV2``             the top-k axis (needs chunks of at least k)      running top-k merge
``MatMul``/batched     the contracting axis                             ``sum``
=====================  ==============================================  =======================

A region holds the ops that carry the split axis down from the root and whose every reader is in
the region; it stops at graph inputs, variable reads and constants (sliced there), at ops read
whole by the region or read by anything outside it (their full value exists anyway, so they are
sliced, not recomputed), at stateful ops (never moved into a loop: random draws, variable
writes, prints and asserts keep their place and count; random draws only with
``Options.redraw_random``, each slice drawing its own values keyed by a seed drawn once per call,
the forward's chunks then also the gradient's so that a slice's recomputation draws what its
forward drew), and at ops with no rule (the record names them: "cannot split through `Cholesky`:
no rule").

Why it is safe: each slice computes exactly the rows the original computes for it, with the same
ops; the combiners are exact except that ``sum``, ``mean`` and ``prod`` reassociate floating-point
reductions (see :mod:`grappler_ext.combiners`).  The loop has a static trip count, so XLA
compiles it; its gradient is a ``tf.custom_gradient`` that recomputes slices (a tape outside the
function works, under ``jit_compile`` or not).  ``max``/``min``/``prod`` roots over the split
axis have no gradient rule yet: the pass uses them only when the root's outputs are not floating,
otherwise it skips with that reason.

Planning beside the rest of the program: a region's chunk is chosen for what the limit leaves
beside the tensors the rest of the program holds while the region runs (the memory model's
schedule, less the region's own tensors and the large tensors still to be split).  With gradients
taken inside the function, a region that fits whole may still be what the program cannot afford:
the gradients hold its tensors from the forward to the backward (a Transformer's training step
holds every layer's attention scores).  Such a region is split into two steps at least: its
rebuilt gradient recomputes the tensors instead of holding them (rematerialisation), and
candidates are ranked by the bytes that frees, less the inputs the loop's gradient must keep.
With gradients inside, a slice also takes at most ``SLICE_SHARE`` of the limit: the activations
held for the backward, and XLA's layout copies of them, are more than the model counts.

Prologues (with gradients inside): a tensor the region reads whole that a few ops compute from much
smaller ones (``PROLOGUE_SHARE`` of its bytes at most: an attention's keys and values, [L, 8, 128],
projected from the layer's input, [L, 128]) is computed by the loop itself, before its slices, and
again in its gradient (:mod:`grappler_ext.split_loop`), so the program holds the small inputs from
the forward to the backward instead (a Transformer's training step at L = 8192 under 2 GB: 3.45 GiB
with the projections held, 1.01 GB without).  Only ops whose every reader is the region, the
prologue or the gradients being rebuilt, stateless, with static shapes and results of at most a
slice's share of the limit, are taken (:func:`_prologue`).

Programs checked with XLA (``Options.check_programs``): the model schedules the program in one
topological order, while XLA's scheduler may interleave independent branches (a Transformer's
encoder and decoder self-attention: the model counts one score tensor's worth of temporaries at a
time, XLA held four).  A program the model puts within the limit but above ``CHECK_FROM`` of it is
compiled whole (a copy, never run) before it is left alone; if XLA's figure is over the limit, the
program is split against the limit scaled by the model's share of that figure.  Likewise when the
model puts a program within the limit after some of its large tensors were split: if XLA's figure
says otherwise, every large tensor left is split too (a Transformer's training step at L = 2048:
six of its twelve attentions split by the model's count, 2.02 GB by XLA's; all twelve, 1.04 GB).
The program as split is compiled too, unless it was within the limit at that check, far below it
by the model's count, or its one loop was sized by compiling it as the whole program; if XLA's
figure is over the limit, the edits are undone (the journal of :mod:`grappler_ext.graph_edit`,
gradient records included) and the program is split again against the planning limit scaled by
limit / figure (``REPLAN_MARGIN``, ``REPLANS``), which gives smaller chunks where the loops are
what is over; a plan no better than the best so far returns to the best, and the user is warned.

Gradient loops grown into the room left (``Options.check_programs``): a gradient loop plans beside
what the model's schedule of the program as written holds while the gradients run, and that count
is the least sure of all (the gradient of a Matern32 kernel's [M, M] part: 800 MB by the model
beside SGPR's loop at M = 2000, the whole program 434 MB by XLA's figure).  When a gradient loop is
starved by it (``STARVED_STEPS``), the program as split is compiled (never run) and, if XLA's
figure leaves room under the limit (less ``REPLAN_MARGIN``), the program is split again with that
room given to the starved gradient loops, their forward plans unchanged, and compiled again: kept
if within the limit, otherwise the first plan is built again.

Chunk sizes from XLA's figure (``Options.calibrate_chunks``): the memory model plans first, with
margins; then the loop is compiled alone (never run) at two chunk sizes, and the difference of the
two "Total bytes used" is what a row really costs.  Where the loop is all the program holds (no
gradients inside, no other large tensor, the rest a few per cent of the limit: a kNN search, a
kernel sum), the chunk is taken up to ``WHOLE_PROGRAM_MARGIN`` of the limit and checked by
compiling at that chunk, as a person sizing the loop by hand would; elsewhere the measured bytes a
row keep a margin for what XLA packs around the loop.

What it does not do (yet): dynamic shapes (the static tensors beside them are split when they
alone are over the limit); plan all regions jointly (each plans against the program as it was,
assuming the other large tensors will be split: :func:`_needed_now` checks the result after each
rewrite); model the layout copies XLA makes of a loop's whole inputs for the dots in its body.

Pipeline position: last, after the rewrites that make regions cheaper (``pairwise_distance`` turns
an [N, M, D] broadcast into an [N, M] matmul; the splitter then only has [N, M] to slice).
"""

from __future__ import annotations

import dataclasses
import heapq
import typing
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import combiners, folding, gradients, graph_edit, memory_model, split_rules
from grappler_ext.chunk_plan import ChunkPlan, plan_chunks
from grappler_ext.pass_base import SKIPPED, GraphPass, PassResult
from grappler_ext.pipeline import register_pass
from grappler_ext.split_loop import Region, build_split, external_inputs, forward_program
from grappler_ext.verifier import live_ops, topological_order

__all__ = ["Splitter", "SAFETY_MARGIN", "BACKWARD_COST_FACTOR", "WHOLE_PROGRAM_MARGIN", "REPLAN_MARGIN", "REPLANS",
           "SLICE_SHARE", "STARVED_STEPS"]

# The memory model is an estimate (its ratio to XLA's figure stays in [0.7, 1.1] over the test
# workloads): a slice's modelled bytes are divided by this before planning.  The fixed part
# (parameters, outputs, the combined result) is known exactly and gets no margin.
SAFETY_MARGIN = 0.7
# XLA packs every temporary of a program into one pool, with gaps where lifetimes interleave: the
# pool measured up to 1.3x the bytes live at its peak (an attention training step's loops).  The
# limit less the parameters is planned at this fraction.
POOL_MARGIN = 0.8
# The model's estimate is 0.75-1.02x XLA's figure on its test workloads, and 0.85x on SGPR with
# M = 2000 inducing points (897 MB estimated, 1.05 GB measured, under a 1 GB limit): a program is
# left alone as "already within the limit" only when its estimate is within this share of it.
MODEL_TRUST = 0.8
# A loop's chunk sized from XLA's own figure for it (compiled alone at two chunk sizes: the bytes
# one more row of the split axis costs) still runs beside the rest of the program, which XLA's
# buffer assignment packs around it less tightly than the loop alone (measured: a Transformer's
# three attention loops needed 1.22x the bytes their standalone figures predicted): the measured
# bytes a row are divided by this.
CALIBRATION_MARGIN = 0.7
# A loop that is all the program holds (no gradients inside, no other large tensor, the rest under
# MIN_TENSOR_FRACTION of the limit: a kNN search, a kernel sum) is sized like a person sizing it by
# hand: XLA's figure for the loop at the chosen chunk, plus the rest by the model, within this share
# of the limit, checked by compiling at that chunk (the figure and the program's differ only by the
# rest, which is small).
WHOLE_PROGRAM_MARGIN = 0.95
# A program the model puts within MODEL_TRUST of the limit but above this share of it is compiled
# whole (``Options.check_programs``) before it is left alone: the model's schedule is one
# topological order, while XLA's scheduler may interleave independent branches (a Transformer's
# encoder and decoder self-attention: 2.2 GB measured for the model's 1.1 GB).
CHECK_FROM = 0.3
# A program whose split, by XLA's figure, is still over the limit is split again against the planning
# limit scaled by limit / figure and by this margin, at most REPLANS times.
REPLAN_MARGIN = 0.95
REPLANS = 2
# With gradients inside the function, a loop's slice takes at most this share of the budget: the
# program holds its forward activations for the backward, and XLA keeps layout copies of them the
# model does not count (a Transformer's training step at L = 4096: 69 tensors of [L, 8, 128] live at
# XLA's peak where the model counts 48), so the rest beside a loop is more than planned.  A
# Transformer's training step at L = 4096 under 2 GB, its attention loops in halves of 2048 rows
# (537 MB a slice by XLA's figure), was 2.08 GB; in quarters of 1024 rows, 2.00-2.06 GB (traced
# twice, in different programs around it); in eighths of 512 rows, 1.98 GB.
SLICE_SHARE = 0.125
# A tensor smaller than this fraction of the limit is not worth a loop of its own.
MIN_TENSOR_FRACTION = 0.05
_REDUCTIONS = frozenset(combiners.REDUCTION_COMBINERS)
_ARG = {"ArgMax": "max", "ArgMin": "min"}
_MATMULS = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3"})
# A slice's gradient holds several slice-sized tensors at once (the slice's values recomputed, the
# upstream gradient of each op, the gradients of its operands): measured 4.7x the forward slice's
# bytes for a kernel matrix-vector product.  The backward loop plans with this factor.
BACKWARD_COST_FACTOR = 5.0
# A gradient loop of at least this many steps, its chunk under 1 / BACKWARD_COST_FACTOR of its
# forward's, is starved: the model's count of what the rest of the program holds while the
# gradients run left it little room, and each step rewrites the gradients of the inputs the loop
# reads whole (SGPR at M = 2000, N = 1e6: a [2000, 2000] gradient of the Cholesky factor, 32 MB, for
# every 8 rows of data; 125,000 steps took 1400 s where the forward's 554 took a third of that).
# XLA's figure for the program as split says how much room there really is (see _grown_backward).
STARVED_STEPS = 256
# When even the bytes that must stay exceed the limit, a region is still cut until its slice is
# this fraction of them (beyond that, smaller slices only cost steps), and a warning says so.
BEST_EFFORT_FRACTION = 0.1
_MAX_ROOT_DEPTH = 8  # how many ops downstream of the large tensor roots are looked for
_MAX_ROOT_DEPTH_WIDE = 32  # ... when none of those meets the limit
# A prologue (see the module docstring) replaces a tensor read whole by inputs at most this share of its bytes, and
# takes at most PROLOGUE_OPS ops to get there (an attention's keys: einsum and bias, 1/8).
PROLOGUE_SHARE = 0.5
PROLOGUE_OPS = 8
PROLOGUE_MIN_BYTES = 1 << 16      # smaller tensors read whole are not worth recomputing
_LOOP_TYPES = ("While", "StatelessWhile")
_BRANCH_TYPES = ("If", "StatelessIf")
# Ops a prologue does not copy: loops, calls and branches (their bodies are functions of the graph).
_NOT_CLONED = frozenset(_LOOP_TYPES + _BRANCH_TYPES + ("PartitionedCall", "StatefulPartitionedCall", "Case",
                                                       "StatelessCase"))
# Ops that only pass a value on: a record names the op before them.
_PASS_THROUGH = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot", "Reshape", "Squeeze", "ExpandDims"})


def _mb(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{n / 1e6:,.1f} MB"


def _nbytes(t: tf.Tensor) -> int:
    return t.shape.num_elements() * t.dtype.size if t.shape.is_fully_defined() else 0


def _const_axes(t: tf.Tensor, rank: int) -> list[int] | None:
    value = folding.static_value(t)
    if value is None:
        return None
    return sorted({int(a) % rank for a in np.asarray(value).reshape(-1)})


@dataclasses.dataclass
class _Option:
    """One way to split a root: the axis each root input is read along, and how partials combine."""

    root: tf.Operation
    kind: str                           # "concat", "sum", "mean", "max", ..., "argmax", "top_k"
    input_axes: tuple[int | None, ...]
    output_axes: tuple[int | None, ...] = ()
    propagation: split_rules.Propagation | None = None
    # online_softmax: the region is grown from these (tensor, axis) instead of the root's inputs,
    # and these ops (the Softmax) are computed inside the root's partial.
    requests: tuple = ()
    absorbed: tuple = ()

    def describe(self) -> str:
        """One line: the op the region ends in, the combiner and the split axis."""
        split = ", ".join(f"input {i} axis {a}" for i, a in enumerate(self.input_axes) if a is not None)
        return f"`{_computed(self.root).type}` {self.kind} over {split}"


def _root_options(root: tf.Operation) -> list[_Option]:
    options = []
    out0 = root.outputs[0] if root.outputs else None
    if out0 is not None and out0.shape.rank:
        for axis in range(out0.shape.rank):
            prop = split_rules.propagate(root, 0, axis)
            if prop:
                options.append(_Option(root, "concat", prop.input_axes, prop.output_axes, prop))
    if not root.inputs or not root.inputs[0].shape.is_fully_defined():
        return options
    rank = root.inputs[0].shape.rank
    if root.type in _REDUCTIONS or root.type in _ARG:
        axes = _const_axes(root.inputs[1], rank)
        kind = _ARG.get(root.type)
        if root.type == "Mean" and not root.outputs[0].dtype.is_floating:
            axes = ()  # truncated slice means do not give the truncated mean of the whole
        for a in axes or ():
            options.append(_Option(root, f"arg{kind}" if kind else combiners.REDUCTION_COMBINERS[root.type],
                                   (a, None)))
    elif root.type == "TopKV2":
        options.append(_Option(root, "top_k", (rank - 1, None)))
    elif root.type in _MATMULS and len(root.inputs) == 2:
        b_rank = root.inputs[1].shape.rank
        if root.type == "MatMul":
            ta, tb = root.get_attr("transpose_a"), root.get_attr("transpose_b")
        else:
            ta, tb = root.get_attr("adj_x"), root.get_attr("adj_y")
        a_axis = rank - 2 if ta else rank - 1
        b_axis = b_rank - 1 if tb else b_rank - 2
        options.append(_Option(root, "sum", (a_axis, b_axis)))
        probs = root.inputs[0]
        # softmax(S) @ V over slices of the keys: S's last axis is the contracting axis.
        if (probs.op.type == "Softmax" and not ta and probs.consumers() == [root]
                and probs.dtype.is_floating and probs.op.inputs[0].shape.is_fully_defined()):
            options.append(_Option(root, "online_softmax", (a_axis, b_axis),
                                   requests=((probs.op.inputs[0], rank - 1), (root.inputs[1], b_axis)),
                                   absorbed=(probs.op,)))
    return options


class _Candidate(typing.NamedTuple):
    """A root's plan, as :meth:`Splitter._best_root` ranks them (the smallest ``key`` is best)."""

    key: tuple
    options: list
    grown: _Grown
    plan: ChunkPlan
    backward_chunk: int
    best_effort: str
    per_unit: float
    backward_unit: float
    remat: bool


@dataclasses.dataclass
class _Grown:
    region: Region
    included: set
    stops: list[str]


def _grow(options: list[_Option], graph_outputs: set, order_index: dict,
          ignored: frozenset = frozenset(), reseed: split_rules.Reseed | None = None) -> _Grown | str:
    """The region for ``options`` (one or more roots split together): ops carrying the split axis
    whose readers are all in the region; random draws in it drawn again by slice, keyed by
    ``reseed``, if given (``Options.redraw_random``)."""
    roots = {o.root for o in options} | {op for o in options for op in o.absorbed}
    requests: dict = {}            # (op, output index) -> set of axes it is read sliced along
    whole: set = set()             # tensor refs read whole
    heap: list = []
    queued: set = set()
    included: set = set(roots)
    input_axes: dict = {}
    rebuild: dict = {}
    sliced_inputs: dict = {}
    stops: list[str] = []
    length = None

    def request(t: tf.Tensor, axis: int | None):
        if axis is None:
            whole.add(t.ref())
            return
        requests.setdefault((t.op, t.value_index), set()).add(axis)
        if t.op not in queued:
            queued.add(t.op)
            heapq.heappush(heap, (-order_index.get(t.op, -1), id(t.op), t.op))

    for option in options:
        for t, a in option.requests or zip(option.root.inputs, option.input_axes):
            request(t, a)
    while heap:
        _, _, op = heapq.heappop(heap)
        wanted = {k: axes for (o, k), axes in requests.items() if o is op}
        for k, axes in wanted.items():
            if len(axes) > 1:
                return f"`{op.name}` output {k} is needed along axes {sorted(axes)}"
            axis = next(iter(axes))
            dim = op.outputs[k].shape[axis]
            if length is None:
                length = dim
            elif dim != length:
                return f"`{op.name}` has length {dim} along the split axis, not {length}"
        reason = _outside_reason(op, wanted, whole, included | ignored, graph_outputs, order_index)
        prop = None
        if reason is None:
            k0, axes0 = next(iter(wanted.items()))
            prop = split_rules.propagate(op, k0, next(iter(axes0)), reseed)
            if not prop:
                reason = prop.reason
            elif any(prop.output_axes[k] != next(iter(axes)) for k, axes in wanted.items()):
                reason = f"`{op.type}` splits its outputs along other axes"
        if reason is not None:
            for k, axes in wanted.items():
                sliced_inputs[op.outputs[k].ref()] = next(iter(axes))
            big = max(_nbytes(op.outputs[k]) for k in wanted)
            stops.append((big, reason))
            continue
        included.add(op)
        input_axes[op] = prop.input_axes
        rebuild[op] = prop.build
        for t, a in zip(op.inputs, prop.input_axes):
            request(t, a)
    if length is None:
        return "no input of the root carries the split axis"
    if len(options) > 1:
        # Roots split together must not read each other's results (logsumexp's Sum reads the
        # whole row max): the loop would need what it computes.
        upstream = graph_edit.ancestors([t for op in included for t in op.inputs])
        needed = [o.root for o in options if o.root in upstream]
        if needed:
            return f"the roots read each other's results (`{needed[0].name}`)"
    ops = sorted(included - roots, key=lambda o: order_index[o])
    region = Region(ops=ops, input_axes=input_axes, rebuild=rebuild, sliced_inputs=sliced_inputs,
                    whole_inputs=whole, length=length, root_partial=None)
    stops.sort(key=lambda s: -s[0])
    return _Grown(region, included, [r for _, r in stops])


def _outside_reason(op, wanted, whole, included, graph_outputs, live) -> str | None:
    """Why ``op`` stays outside the region (its outputs are then sliced), or ``None``.  Readers
    not in ``live`` (dead ops: a tape's gradient for a constant divisor) do not count."""
    kind = split_rules.leaf_kind(op)
    if kind is not None:
        article = "an" if kind[0] in "aeiou" else "a"
        return f"`{op.name}` is {article} {kind}"
    if any(o.ref() in whole for o in op.outputs):
        return f"`{op.name}` is also read whole"
    if op.control_inputs or any(c not in included for c in op._control_outputs):
        return f"`{op.name}` has control dependencies"
    for o in op.outputs:
        if o.ref() in graph_outputs:
            return f"`{op.name}` is an output of the function"
        if any(c not in included and c in live and not _static_shape_reader(c) for c in o.consumers()):
            return f"`{op.name}` is also read outside the region"
    return None


_SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _static_shape_reader(op: tf.Operation) -> bool:
    """``Shape``-like ops of static shapes read no values (TF's own ops insert them, e.g.
    ``reduce_logsumexp``): they do not keep a tensor out of a region; the splitter replaces them
    with their constant value when it rewrites (:func:`_fold_shape_readers`)."""
    return op.type in _SHAPE_READERS and all(t.shape.is_fully_defined() for t in op.inputs)


def _fold_shape_readers(ops) -> None:
    """Replace the static ``Shape``-like readers of ``ops``' outputs by constants."""
    for op in ops:
        for o in op.outputs:
            for reader in list(o.consumers()):
                if not _static_shape_reader(reader):
                    continue
                for out in reader.outputs:
                    value = tensor_util.constant_value(out)
                    if value is not None and out.consumers():
                        graph_edit.replace_uses(out, tf.constant(value, dtype=out.dtype))


@register_pass
class Splitter(GraphPass):
    name = "splitter"

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        self._loop_bytes: dict[str, int] = {}
        self._grow_room: dict[str, tuple[int, int]] = {}    # see _grown_backward
        self._room = (0, 0)
        self._calibrate = getattr(options, "calibrate_chunks", False)
        self._redraw = getattr(options, "redraw_random", False)
        limit = options.memory_limit_bytes
        if limit is None:
            result.skip([], "no memory limit in bytes")
            return result
        est, info = memory_model.analyse(graph)
        if est.dynamic_tensors:
            shown = ", ".join(f"`{n}`" for n in est.dynamic_tensors[:3])
            shown = f"dynamic shapes ({shown}{', ...' if len(est.dynamic_tensors) > 3 else ''})"
            # The static tensors alone (the dynamic ones counted as empty) give a lower bound.
            at_least = max(_floor(est, info), 0 if est.unknown_ops else
                           est.parameter_bytes + est.constant_bytes + est.live_peak_bytes)
            if at_least <= limit:
                result.skip([], f"{shown}: left alone; give the tf.function an input_signature with static "
                                "shapes to split it")
                return result
            # Static tensors over the limit (attention scores beside the dynamic-size sparse update
            # of an embedding) are split; the dynamic ops stay as they are.
            result.skip([], f"{shown}: left as they are; the rest needs at least {at_least:,} B, so the static "
                            "tensors over the limit are split")
        elif est.peak_bytes is not None and est.peak_bytes <= limit * MODEL_TRUST:
            figure = self._program_figure(graph, options) if est.peak_bytes >= CHECK_FROM * limit else ""
            if isinstance(figure, str) or figure <= limit:
                measured = f"; XLA's figure {figure:,} B" if isinstance(figure, int) else figure
                result.skip([], f"already within the limit: about {est.peak_bytes:,} B of {limit:,} B "
                                f"(memory model{measured})")
                return result
            # XLA's scheduler holds more at once than the model's schedule (independent branches
            # interleaved): plan against a limit scaled by the model's share of XLA's figure.
            planning = int(limit * est.peak_bytes / figure)
            result.skip([], f"the memory model's {est.peak_bytes:,} B is within the limit, but XLA's figure for "
                            f"the program as written is {figure:,} B: planned against {planning:,} B "
                            f"(the limit x {est.peak_bytes / figure:.2f})")
            limit = planning
        if est.peak_bytes is None and not est.dynamic_tensors:
            # No estimate (an op without a byte rule): split only what is over the limit on its own
            # terms -- the parameters, the outputs and the largest tensor together -- never a
            # program that may well fit.
            floor = _floor(est, info)
            if floor <= limit:
                ours = all(graph_edit.is_generated(name) for name in est.unknown_ops)
                why = "its loops are already split" if ours and est.unknown_ops else \
                    f"the memory model cannot estimate it ({est.reason})"
                result.skip([], f"{why}; the largest tensor left with the inputs and outputs, {floor:,} B, is "
                                f"within the limit of {limit:,} B")
                return result
        if graph_edit.active_journal() is None:
            # Run outside a pipeline: the pass keeps a journal of its own, to plan again.
            with graph_edit.journaled(graph_edit.Journal()):
                return self._split(graph, options, est, info, limit, result)
        return self._split(graph, options, est, info, limit, result)

    def _split(self, graph, options, est, info, limit, result) -> PassResult:
        """Split the large tensors planning against ``limit``; while XLA's figure for the program as
        split is over the user's limit, undo and plan again against a lower one (``REPLANS`` times
        at most), keeping the best plan."""
        journal = graph_edit.active_journal()
        wanted = options.memory_limit_bytes
        best = None                 # (XLA's figure, the planning limit) of the best plan measured
        for attempt in range(REPLANS + 1):
            mark = len(journal)
            tried = PassResult(self.name)
            after, measured = self._split_large(graph, options, est, info, limit, tried)
            if measured is None or measured <= wanted:
                break
            if best is not None and measured >= best[0]:
                # Smaller chunks did not help (what is over is not in a loop): the best plan again.
                journal.undo(to=mark)
                result.skip([], f"planned against {limit:,} B, XLA's figure is {measured:,} B, no better: "
                                f"planned against {best[1]:,} B again")
                limit = best[1]
                tried = PassResult(self.name)
                after, measured = self._split_large(graph, options, est, info, limit, tried)
                break
            best = (measured, limit)
            if attempt == REPLANS:
                break
            # XLA packs the loops beside the rest of the program less tightly than the model counts:
            # the planning limit scaled by the share XLA's figure is over.
            lower = int(limit * wanted / measured * REPLAN_MARGIN)
            journal.undo(to=mark)
            result.skip([], f"planned against {limit:,} B, with {_loops(tried)} XLA's figure is {measured:,} B, "
                            f"over the limit of {wanted:,} B: planned again against {lower:,} B")
            limit = lower
        if measured is None or measured <= wanted:
            tried, after, measured = self._grown_backward(graph, options, est, info, limit, mark, tried,
                                                          after, measured)
        result.records += tried.records
        if measured is not None and measured > wanted:
            result.skip([], f"XLA's figure as split is {measured:,} B, over the limit of {wanted:,} B, with "
                            "nothing left to split")
            warnings.warn(
                f"tf_memsafe: `{graph.name}` needs {_mb(measured)} by XLA's figure as split, over its limit of "
                f"{_mb(wanted)} (the memory model counts {_mb(after)}); nothing left in it can be split "
                "usefully. It will run as well as it can; raise memory_limit.", RuntimeWarning, stacklevel=3)
        return result

    def _grown_backward(self, graph, options, est, info, limit, mark, tried, after, measured):
        """The plan ``tried`` (built since the journal's ``mark``) again with its starved gradient loops
        grown into the room XLA's figure for it leaves under the limit, if that is within the limit;
        else ``tried`` as it was.  Returns the plan's records, the model's bytes and XLA's figure."""
        starved, wanted = self._starved, options.memory_limit_bytes
        if not starved or _best_effort(tried):
            return tried, after, measured
        figure = measured if measured is not None else self._program_figure(graph, options)
        if not isinstance(figure, int):
            return tried, after, measured
        room = int(wanted * REPLAN_MARGIN) - figure
        loops = ", ".join(map(str, starved.values()))
        if room <= 0:
            # Over the limit by XLA's figure where the model put it within: the model's plan stands
            # (what the splitter could not split has been reported with the model's count).
            tried.skip([], f"gradient loops not grown: the model's plan gave them chunks of {loops}, and XLA's "
                           f"figure for the program as split, {figure:,} B, leaves no room under the limit less its "
                           "margin")
            return tried, after, measured
        journal = graph_edit.active_journal()

        def replan():
            journal.undo(to=mark)
            again = PassResult(self.name)
            with warnings.catch_warnings():        # the first plan's warnings were given
                warnings.simplefilter("ignore", RuntimeWarning)
                return (again, *self._split_large(graph, options, est, info, limit, again))

        self._grow_room = {name: (room // len(starved), chunk) for name, chunk in starved.items()}
        try:
            grown, grown_after, grown_measured = replan()
        finally:
            self._grow_room = {}
        grown_figure = grown_measured if grown_measured is not None else self._program_figure(graph, options)
        if isinstance(grown_figure, int) and grown_figure <= wanted:
            grown.skip([], f"gradient loops grown: the model's plan gave them chunks of {loops}, and XLA's figure "
                           f"for the program as split was {figure:,} B, {room:,} B under the limit less its "
                           f"margin; with that room, {grown_figure:,} B")
            return grown, grown_after, grown_figure
        again, after, _ = replan()
        shown = f"{grown_figure:,} B, over the limit" if isinstance(grown_figure, int) else grown_figure.lstrip("; ")
        again.skip([], f"gradient loops not grown: in the {room:,} B XLA's figure ({figure:,} B) left under the "
                       f"limit, the program as split was {shown}; planned as the model had it")
        return again, after, figure

    def _split_large(self, graph, options, est, info, limit, result) -> tuple[int | None, int | None]:
        """One plan: split the program's large tensors, largest first, planning against ``limit``;
        warn if the model says the limit cannot be met.  Returns the model's bytes as split (``None``:
        nothing split) and XLA's figure for the program as split, where it was worth measuring and
        not measured within the limit already (``None`` otherwise)."""
        self._loop_bytes: dict[str, int] = {}
        self._program_sized = 0      # loops sized by compiling them as the whole program (_fitted)
        self._starved: dict[str, int] = {}   # large tensor -> its starved gradient loop's chunk
        live = live_ops(graph)
        # Gradients taken inside the function read the forward tensors; they are differentiated
        # again after a split (grappler_ext.gradients), so their ops do not hold a region back.
        backward: frozenset = frozenset()
        if gradients.records(graph):
            can, why = gradients.rebuildable(graph)
            if can:
                backward = frozenset(gradients.backward_ops(graph) & live)
            else:
                result.skip([], f"gradients inside the function stay as traced: {why}")
        order = topological_order(graph, live)
        order_index = {op: i for i, op in enumerate(order)}
        graph_outputs = {t.ref() for t in getattr(graph, "outputs", [])}
        budget = limit
        # Large materialised tensors, largest first; each gets at most one loop.
        large = sorted((t for op in order if not graph_edit.is_generated(op)
                        and op.type not in ("Placeholder", "Const") and op not in backward
                        for t in op.outputs
                        if (i := info.get(t.name)) is not None and i.materialised and i.bytes
                        and i.bytes > MIN_TENSOR_FRACTION * limit),
                       key=lambda t: -info[t.name].bytes)
        done: set = set()
        after = None          # the model's bytes after the latest rewrite (the graph changes only there)
        trust_model = True    # stop once the model puts the program within the limit
        checked = False       # XLA's figure for the program as split measured, within the limit
        # Each region plans beside what the rest of the program holds while it runs, counting the large
        # tensors not yet tried as split too (their own regions will plan beside this one's loop).
        self._step_of = {step.op: i for i, step in enumerate(est.schedule)}
        # Large gradient tensors go with them: the gradients are rebuilt through the loops.
        self._hoped = {t.name for t in large} | {
            t.name for op in backward for t in op.outputs
            if (i := info.get(t.name)) is not None and i.materialised and i.bytes
            and i.bytes > MIN_TENSOR_FRACTION * limit}
        for tensor in large:
            if tensor.op in done:
                continue
            outcome = self._split_around(graph, tensor, info, est, order_index, graph_outputs, budget, result,
                                         backward)
            if outcome is None:
                self._hoped.discard(tensor.name)
            else:
                done |= outcome
                after = _needed_now(graph, result, self._loop_bytes)
                if after <= limit * MODEL_TRUST and trust_model:      # as a program left alone must
                    # Checked with XLA like a program left alone; if over, the model's word is not
                    # taken again: every large tensor left is split.
                    figure = self._program_figure(graph, options) if after >= CHECK_FROM * limit else ""
                    if not isinstance(figure, int) or figure <= options.memory_limit_bytes:
                        checked = isinstance(figure, int)
                        break
                    trust_model = False
                    result.skip([], f"with {_loops(result)} the memory model counts {after:,} B, but XLA's figure is "
                                    f"{figure:,} B, over the limit: the large tensors left are split too")
        # A tensor no root of its own could split may still have been split by a later, larger
        # region (SGPR's test-point solves, inside the predictive mean's loop): no record then.
        done_names = {op.name for op in done}
        result.records = [r for r in result.records if not (
            r.action == SKIPPED and r.ops and r.reason.startswith("cannot split") and set(r.ops) <= done_names)]
        failed = [r for r in result.records if (r.reason.startswith("cannot split") and "usefully" not in r.reason)
                  or "best effort" in r.reason]
        worst = max(failed, key=lambda r: r.bytes_before or 0) if failed else None
        needed = est.peak_bytes if est.peak_bytes is not None else (worst.bytes_before if worst else None)
        if worst is not None and after is not None and after <= limit:
            worst = None       # what was split took the rest with it
        if worst is not None and needed is not None and needed > limit:
            # The model's count of a program this far from it is the least sure (a Transformer's
            # training step at L = 16384: 4.7 GB as split by the model, 1.9 GB by XLA): XLA's figure
            # has the last word before the user is warned.
            figure = self._program_figure(graph, options)
            if isinstance(figure, int) and figure <= options.memory_limit_bytes:
                result.skip([], f"the memory model counts {_mb(after)} as split, over the limit, but XLA's figure "
                                f"is {figure:,} B: within it")
                return after, None
            how = "needs about" if est.peak_bytes is not None else "needs at least"
            scaled = ("" if limit == options.memory_limit_bytes else
                      f" (the limit of {_mb(options.memory_limit_bytes)} scaled to the model's count by XLA's figure)")
            xla = f"{_mb(figure)} by XLA's figure" if isinstance(figure, int) else ""
            then = f" ({_mb(after)} as split{', ' + xla if xla else ''})" if after is not None else (
                f" ({xla} as split)" if xla else "")
            what = (f"the splitter {worst.reason[0].lower()}{worst.reason[1:]}" if worst.action == "skipped"
                    else f"the splitter could only reduce it: {worst.reason}")
            warnings.warn(
                f"tf_memsafe: `{graph.name}` {how} {_mb(needed)} by the memory model{then}, over its limit of "
                f"{_mb(limit)}{scaled}, and {what}. It will run as well as it can; raise memory_limit, or rewrite "
                "that op's input in smaller pieces.", RuntimeWarning, stacklevel=4)
            return after, None
        if after is None or checked or (trust_model and after < CHECK_FROM * limit) or (
                self._program_sized and self._program_sized == len(result.rewritten)):
            # Nothing split, measured within the limit already, far below it by the model's count, or
            # every loop sized by compiling it as the whole program.
            return after, None
        figure = self._program_figure(graph, options)
        return after, figure if isinstance(figure, int) else None

    @staticmethod
    def _program_figure(graph, options) -> int | str:
        """XLA's figure for the whole program as it stands (compiled, never run), or why it was not
        measured ("" with ``Options.check_programs`` off)."""
        if not getattr(options, "check_programs", False):
            return ""
        try:
            from tf_memsafe import memory  # tf_memsafe owns XLA_FLAGS, and so the measurement
            return memory.graph_bytes(graph)
        except Exception as e:  # noqa: BLE001 - the model's word stands; the record says why
            return f"; not checked with XLA: {type(e).__name__}: {str(e).splitlines()[0][:120]}"

    def _split_around(self, graph, tensor, info, est, order_index, graph_outputs, budget, result, backward):
        """Find the best root downstream of ``tensor`` and split it; the ops removed, or ``None``."""
        reasons: list[str] = []
        # (bytes, chunk): the room its starved gradient loop was given, and its chunk before.
        self._room = self._grow_room.get(tensor.name, (0, 0))
        near = _downstream(tensor.op, order_index, _MAX_ROOT_DEPTH)
        candidates = [[option] for root in near for option in _root_options(root)]
        # Several readers reducing the same axis of the tensor (SGPR's A A^T and A err): one loop.
        for axis in range(tensor.shape.rank or 0):
            together = _forward_roots(tensor, axis, order_index, graph_outputs, backward)
            if isinstance(together, list) and len(together) > 1:
                candidates.append(together)
        reseed = split_rules.Reseed() if self._redraw else None
        best = self._best_root(candidates, tensor, info, est, order_index, graph_outputs, budget, backward,
                               reseed, reasons)
        if best is None or best.best_effort or not best.plan.splits:
            # No root nearby meets the limit: the region that does may end farther down (SGPR's
            # predictive density reads the test points' kernel matrix 14 ops later).
            # Only roots whose joined result could be planned at all (see _plan): the wider search
            # reaches hundreds of ops in a Transformer's training step.
            seen = set(near)
            far = [[option] for root in _downstream(tensor.op, order_index, _MAX_ROOT_DEPTH_WIDE)
                   if root not in seen for option in _root_options(root)
                   if _joined_bytes([option]) <= budget / 2]
            wider = self._best_root(far, tensor, info, est, order_index, graph_outputs, budget, backward,
                                    reseed, reasons)
            if wider is not None and (best is None or wider.key < best.key):
                best = wider
        if best is None:
            why = reasons[0] if reasons else "no op downstream reduces it or has a split rule"
            result.skip([tensor.op], f"cannot split `{tensor.op.name}` ({info[tensor.name].bytes:,} B): {why}",
                        bytes_before=info[tensor.name].bytes)
            return None
        _, options, grown, plan, backward_chunk, best_effort, per_unit, backward_unit, remat = best
        if not plan.splits:
            # The planner's count says the region fits whole, while the program's estimate does not:
            # say so (the run's warning then names it) rather than leave it silently.
            result.skip([tensor.op], f"cannot split `{tensor.op.name}` ({info[tensor.name].bytes:,} B) usefully: its "
                                     f"region fits the limit whole by the planner's count ({plan.predicted_bytes:,} B)",
                        bytes_before=info[tensor.name].bytes)
            return None
        measured = ""
        if self._calibrate and plan.steps >= 2 and not remat:   # a recomputation's two steps stay
            calibrated = self._calibrated(options, grown, plan, info, est, budget, backward)
            if isinstance(calibrated, str):
                measured = f"; {calibrated}"
            else:
                plan, per_unit, measured = calibrated
                backward_chunk = min(backward_chunk, plan.chunk)
        if backward:
            # The program holds its forward activations for the gradients, and XLA's layout copies of
            # them, beyond the model's count: a slice takes at most a share of the budget.
            plan = _capped(plan, per_unit, budget)
            backward_chunk = min(backward_chunk, plan.chunk)
        draws = reseed is not None and any(op.type in split_rules.RANDOM_DRAWS for op in grown.region.ops)
        if draws and backward_chunk < plan.chunk:
            # A slice's draw keys on its offset: the gradient's slices must be the forward's.
            plan = ChunkPlan(plan.length, backward_chunk,
                             int(plan.predicted_bytes - (plan.chunk - backward_chunk) * per_unit))
        roots = [o.root for o in options]
        existing = set(graph.get_operations())
        try:
            with graph_edit.building(graph, self.name):
                if draws:
                    # One seed a call, outside the loop: its slices' draws, forward and gradient, key on it.
                    reseed.tensor = call_seed()
                outputs = self._build(options, grown.region, plan, backward_chunk)
        except (ValueError, TypeError, KeyError, NotImplementedError) as e:
            result.skip(roots, f"building the loop failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            return None
        old_outputs = [t for r in roots for t in r.outputs]
        for old, new in zip(old_outputs, outputs):
            if old.consumers() or old.ref() in graph_outputs:
                graph_edit.replace_uses(old, new)
            gradients.retarget(graph, old, new)
        with graph_edit.building(graph, self.name):
            _fold_shape_readers(grown.region.ops)
        forward_loops = _new_loops(graph, existing)
        rebuilt = gradients.rebuild(graph, self.name, grown.included) if backward else 0
        # What each loop's body holds, for the memory model's view of the program as rewritten.
        joined = sum(_nbytes(t) for r in roots for t in r.outputs)      # the result, written as it goes
        for op in forward_loops:
            self._loop_bytes[op.name] = int(plan.chunk * per_unit) + joined
        backward_loops = _new_loops(graph, existing | set(forward_loops))
        for op in backward_loops:
            # Grown into room the model did not see: counted as the rest less that room.
            self._loop_bytes[op.name] = int(max(self._room[1] * backward_unit,
                                                backward_chunk * backward_unit - self._room[0]))
        backward_steps = -(-plan.length // backward_chunk)
        if backward_loops and backward_chunk < plan.chunk:
            if (backward_steps >= STARVED_STEPS and backward_chunk * BACKWARD_COST_FACTOR < plan.chunk
                    and not self._room[0]):
                self._starved[tensor.name] = backward_chunk
            tail = plan.length % backward_chunk
            gradient_loop = (f"; its gradient {plan.length // backward_chunk} x {backward_chunk}"
                             + (f" + {tail}" if tail else ""))
        else:
            gradient_loop = ""
        region_bytes = _materialised_bytes(grown.included, info)
        prologue = grown.region.prologue
        described = options[0].describe() + "".join(
            f" and `{_computed(o.root).type}` {o.kind}" for o in options[1:])
        result.rewrote(roots + grown.region.ops,
                       f"{described}: {plan.steps} x {plan.chunk}"
                       + (f" + {plan.tail}" if plan.tail else "") + f" of {plan.length}"
                       + measured + gradient_loop
                       + (f"; {rebuilt} gradient{'s' if rebuilt > 1 else ''} inside the function rebuilt"
                          if rebuilt else "")
                       + (f"; {len(prologue)} op{'s' if len(prologue) > 1 else ''} before it recomputed in the "
                          "gradient" if prologue else "")
                       + (f"; {best_effort}" if best_effort else ""),
                       bytes_before=region_bytes, bytes_after=plan.predicted_bytes)
        return grown.included | set(prologue)

    def _best_root(self, candidates, tensor, info, est, order_index, graph_outputs, budget, backward, reseed,
                   reasons: list[str]) -> _Candidate | None:
        """The best plan among ``candidates`` (lists of root options split together) whose region
        takes ``tensor`` in, or ``None``; why the others fail is appended to ``reasons``."""
        best = None
        for options in candidates:
            grown = _grow(options, graph_outputs, order_index, backward, reseed)
            if isinstance(grown, str):
                reasons.append(grown)
                continue
            if tensor.op not in grown.included:
                if grown.stops:
                    reasons.append(grown.stops[0])
                continue
            if backward:
                grown.region.prologue = _prologue(grown, order_index, graph_outputs, backward, budget)
            planned = self._plan(options, grown, info, est, budget, backward)
            if isinstance(planned, str):
                reasons.append(planned)
                continue
            plan, backward_chunk, best_effort, per_unit, backward_unit = planned
            held = _held_for_backward(grown, info, backward, {o.root for o in options if o.kind == "concat"})
            remat = not plan.splits and held > MIN_TENSOR_FRACTION * budget and plan.length >= 2
            if remat:
                # The region fits whole, but the gradients inside the function hold its tensors from
                # the forward to the backward: a loop recomputes them there instead.
                plan = _split_anyway(plan, per_unit)
                backward_chunk = min(backward_chunk, plan.chunk)
            # Plans that meet the limit first; among them, those whose joined result is small (a
            # region reaching on to a reduction, rather than stopping at a large tensor it writes
            # whole: SGPR's K(Z, X) as a concat, 2 steps, left [M, N] and its copies live where the
            # region through A A^T and A err, 3 steps, left none), the fewest steps, then the one
            # freeing the most bytes the gradients would hold; then the fewest bytes among those
            # that cannot (a best effort is judged by what it leaves); a plan that does not split last.
            steps = plan.steps + (1 if plan.tail else 0)
            joined = _joined_bytes(options)
            key = ((not plan.splits, True, plan.predicted_bytes, steps) if best_effort
                   else (not plan.splits, False, joined > MIN_TENSOR_FRACTION * budget, steps, -held,
                         plan.predicted_bytes))
            if best is None or key < best.key:
                best = _Candidate(key, options, grown, plan, backward_chunk, best_effort, per_unit, backward_unit,
                                  remat)
        return best

    def _plan(self, options, grown, info, est, budget, backward,
              measured: float | None = None) -> tuple[ChunkPlan, int, str, float, float] | str:
        """The forward plan, the backward's chunk, a best-effort note and the bytes a unit of the split
        axis costs in the forward and the backward loop's body; or why no split helps.

        ``measured``: the bytes a unit costs the forward loop by XLA's figure (see
        :meth:`_calibrated`), used instead of the memory model's count."""
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
        computed_outside = 0                                        # inputs computed in full before the loop
        for ref in region.sliced_inputs:
            t = ref.deref()
            per_unit += _nbytes(t) / length                         # the slice copied into the body
            if t.op.type != "Placeholder":
                computed_outside += _nbytes(t)
        for ref in region.whole_inputs - set(region.sliced_inputs):
            if ref.deref().op.type not in ("Placeholder", "Const"):
                computed_outside += _nbytes(ref.deref())            # read whole by every slice
        root_out = sum(_nbytes(t) for o in options for t in o.root.outputs)
        joined = _joined_bytes(options)
        if joined > budget / 2:
            # Slices joined into a result this large save nothing: what reads the result must be
            # in the loop (SGPR's K(Z, X_test) is read by the solves after it).
            return f"{options[0].describe()}: its joined result ({joined:,} B) is over half the limit"
        removed = _materialised_bytes(grown.included, info)
        # Joining slices along an axis other than the first transposes the stacked slices: one more
        # copy of the result at the end.
        join_cost = joined * (2 if any(o.kind == "concat" and any(o.output_axes) for o in options) else 1)
        if joined and removed - join_cost < MIN_TENSOR_FRACTION * budget:
            # Nearly all the region holds is its joined result (attention's scores einsum alone, a
            # Transformer's output layer): the loop would write what it was meant to avoid.
            return (f"{options[0].describe()}: saves too little (joining its result takes {join_cost:,} B of "
                    f"the {removed:,} B the region holds)")
        # Parameters, constants, the outputs (the result among them), one more copy of the result
        # while its slices are joined, and what the loop reads that is computed before it; or, if
        # more, what the rest of the program holds while the region runs (its other tensors
        # live then: an attention layer's loop runs beside the activations kept for the backward).
        constant = est.parameter_bytes + est.constant_bytes
        forward_steps, backward_steps = self._steps(grown, backward)
        others = self._background(est, forward_steps, grown)
        fixed = constant + max(max(est.output_bytes, root_out) + computed_outside, others + root_out) + root_out
        # Every tensor the model materialises in the region counted at once (not the peak of its
        # schedule: memory_model.bytes_for_chunk on the original program's schedule under-predicted
        # the loop's body by up to 2x in measurements -- logsumexp, attention -- and safety comes first).
        per_unit /= SAFETY_MARGIN
        backward_unit = per_unit * BACKWARD_COST_FACTOR
        if measured is not None:
            per_unit = measured / CALIBRATION_MARGIN
        limit = budget
        budget = est.parameter_bytes + max(0, budget - est.parameter_bytes) * POOL_MARGIN
        plan = plan_chunks(length, per_unit, fixed, budget)
        best_effort = ""
        if not plan:
            stop = f"; the region stops where {grown.stops[0]}" if grown.stops else ""
            # The limit cannot be met: still shrink the region until it is a small part of what
            # must stay (BEST_EFFORT_FRACTION of the fixed bytes), unless that gains nothing.
            chunk = max(1, int(BEST_EFFORT_FRACTION * fixed / per_unit)) if per_unit else length
            predicted = fixed + chunk * per_unit
            # Only where the model says it at least halves the program (its static part, when shapes
            # are dynamic): a loop has costs of its own.
            whole = est.peak_bytes if est.peak_bytes is not None else (
                None if est.unknown_ops else constant + est.live_peak_bytes)
            if (chunk >= length or per_unit * length <= BEST_EFFORT_FRACTION * fixed
                    or whole is None or predicted > whole / 2):
                return f"{options[0].describe()}: {plan.reason}{stop}"
            plan = ChunkPlan(length, chunk, int(predicted))
            best_effort = f"best effort, the limit cannot be met ({plan.predicted_bytes:,} B needed{stop})"
        k = _top_k(options)
        chunk = _at_least(plan.chunk, length, k)
        if chunk is None:
            return f"top-k needs chunks of at least k = {k}"
        plan = ChunkPlan(length, chunk, int(fixed + chunk * per_unit))
        # The backward also holds the gradients of the region's inputs.
        fixed_backward = (max(fixed, constant + self._background(est, backward_steps, grown) + root_out)
                          + sum(_nbytes(r.deref()) for r in set(region.sliced_inputs) | region.whole_inputs))
        # The room XLA's figure showed the rest leaves (see _grown_backward) taken off what stays.
        reverse = plan_chunks(length, backward_unit, max(0, fixed_backward - self._room[0]), budget)
        backward_chunk = _at_least(reverse.chunk if reverse else max(1, chunk // int(BACKWARD_COST_FACTOR)),
                                   length, k) or chunk
        if backward and fixed_backward > limit and not best_effort:
            # The gradients inside the function run this backward: say the step cannot fit.
            best_effort = (f"best effort, the limit cannot be met by the backward ({fixed_backward:,} B stay "
                           "while it runs: the region's inputs and their gradients)")
        return plan, min(backward_chunk, chunk), best_effort, per_unit, backward_unit

    def _calibrated(self, options, grown, plan, info, est, budget, backward) -> tuple[ChunkPlan, float, str] | str:
        """The plan again, its chunk sized from XLA's figure for the loop; or why it stays as planned.

        The forward loop is built on its own (a ``tf.function`` of the region's inputs) at the
        planned chunk and at twice (or half) that, and compiled -- never run -- with XLA: the
        difference of the two "Total bytes used" over the difference of the chunks is what one row
        of the split axis costs the loop, fusion, in-place updates and the combiner's carry
        included.  The memory model's count is kept on the safe side (``SAFETY_MARGIN``), so this
        mostly gives larger chunks, and fewer steps, than it did.
        """
        k = _top_k(options)
        length, first = plan.length, plan.chunk
        second = 2 * first if 2 * first <= length // 2 else first // 2
        if second < k or second == first:
            return "chunk from the memory model (no second chunk size to compare with)"
        try:
            from tf_memsafe import memory  # tf_memsafe owns XLA_FLAGS, and so the measurement
            figures = [self._loop_figure(memory, options, grown.region, ChunkPlan(length, c, 0))
                       for c in (first, second)]
        except Exception as e:  # noqa: BLE001 - the model's plan stands; the record says why
            return f"chunk from the memory model (measuring the loop failed: {type(e).__name__})"
        per_row = (figures[1] - figures[0]) / (second - first)
        if per_row <= 0:
            return "chunk from the memory model (XLA's figure does not grow with the chunk)"
        rest = self._rest_beside(grown, est, budget, backward)
        if rest is not None:
            try:
                fitted = self._fitted(memory, options, grown.region, k, (first, figures[0]), per_row, rest, budget)
            except Exception:  # noqa: BLE001 - the margins' plan below stands
                fitted = None
            if fitted is not None:
                self._program_sized += 1
                return fitted
        planned = self._plan(options, grown, info, est, budget, backward, measured=per_row)
        if isinstance(planned, str):
            return f"chunk from the memory model (with XLA's figure: {planned})"
        again, _, _, per_unit, _ = planned
        if not again.splits:
            # XLA's figure says the region fits whole, while the program does not.
            again = _split_anyway(again, per_unit)
        return again, per_unit, f"; chunk from XLA's figure for the loop ({per_row:,.0f} B a row)"

    def _rest_beside(self, grown, est, limit, backward) -> int | None:
        """What the rest of the program holds while the region runs, when the region's loop is all
        the program holds (see ``WHOLE_PROGRAM_MARGIN``); else ``None``."""
        if backward:
            return None
        mine = {o.name for op in grown.included for o in op.outputs}
        if not self._hoped <= mine:
            return None                       # another large tensor: its loop or its whole value
        # The program's parameters and constants too, less those the loop reads itself (in its figure).
        read = sum(_nbytes(t) for t in external_inputs(grown.region) if t.op.type in ("Placeholder", "Const"))
        rest = (self._background(est, self._steps(grown, backward)[0], grown)
                + max(0, est.parameter_bytes + est.constant_bytes - read))
        return rest if rest <= MIN_TENSOR_FRACTION * limit else None

    def _fitted(self, memory, options, region, k, measured, per_row, rest, limit) -> tuple | None:
        """The largest chunk whose loop, by XLA's figure, fits ``WHOLE_PROGRAM_MARGIN`` of the limit
        beside ``rest``: the straight line through the measured ``(chunk, bytes)`` to the target,
        then compiled at that chunk, and the line steepened through that figure until it fits (three
        tries).  ``None``: the conservative plan stands."""
        target = int(limit * WHOLE_PROGRAM_MARGIN) - rest
        length = region.length
        chunk_at, figure_at = measured
        intercept = max(0, figure_at - int(per_row * chunk_at))
        slope = per_row
        for _ in range(3):
            plan = plan_chunks(length, slope, intercept, target)
            chunk = _at_least(plan.chunk, length, k) if plan and plan.splits else None
            if chunk is None:
                return None
            figure = self._loop_figure(memory, options, region, ChunkPlan(length, chunk, 0))
            if figure <= target:
                return (ChunkPlan(length, chunk, figure + rest), per_row,
                        f"; chunk from XLA's figure for the loop, which is the program "
                        f"({figure:,} B at this chunk, {per_row:,.0f} B a row)")
            # Over (a remainder slice, a layout copy): the line through the intercept and this figure.
            slope = max(1.05 * slope, (figure - intercept) / chunk)
        return None

    @staticmethod
    def _loop_figure(memory, options, region, plan) -> int:
        """XLA's "Total bytes used" for the region's forward loop alone, in chunks of ``plan.chunk``."""
        combiner, specs, _, _ = Splitter._combined(options, region, plan)
        external, forward = forward_program(region, plan.chunk, combiner, specs)
        if any(not t.shape.is_fully_defined() or t.dtype in (tf.resource, tf.variant) for t in external):
            raise ValueError("an input without a static shape or of a handle type")
        fn = tf.function(lambda *values: forward(*values), jit_compile=True, autograph=False)
        with tf.init_scope():
            return memory.compiled_bytes(fn, *[tf.TensorSpec(t.shape, t.dtype) for t in external])

    def _steps(self, grown, backward) -> tuple[list[int], list[int]]:
        """The schedule steps of the region's kernels, and of the gradient kernels reading its tensors."""
        forward = [self._step_of[op.name] for op in grown.included if op.name in self._step_of]
        readers = {c for op in grown.included for o in op.outputs for c in o.consumers() if c in backward}
        return forward, [self._step_of[op.name] for op in readers if op.name in self._step_of]

    def _background(self, est, steps: list[int], grown) -> int:
        """The most pool bytes the rest of the program holds over ``steps`` (first to last), by the
        model's schedule: the region's own tensors, and the large tensors still to be split, left
        out."""
        if not steps:
            return 0
        lo, hi = min(steps), max(steps)
        gone = self._hoped | {o.name for op in grown.included for o in op.outputs}
        delta = [0] * (hi - lo + 2)
        for b in est.buffers:
            if b.kind == "parameter" or b.kind == "constant" or b.last_step < lo or b.first_step > hi:
                continue
            # A kernel's scratch goes with its result (a triangular solve's, with the solve's output).
            names = (b.name.removesuffix(" (scratch)") + ":0",) if b.kind == "scratch" else (b.name,) + b.tensors
            if any(n in gone for n in names):
                delta[max(b.first_step, lo) - lo] -= b.bytes
                delta[min(b.last_step, hi) - lo + 1] += b.bytes
        running, most = 0, 0
        for s in range(lo, hi + 1):
            running += delta[s - lo]
            most = max(most, est.schedule[s].live_bytes + running)
        return most

    def _build(self, options, region, plan, backward_chunk):
        combiner, specs, differentiable, counts = self._combined(options, region, plan)
        outputs = build_split(region, plan.chunk, combiner, specs, differentiable=differentiable,
                              backward_chunk=backward_chunk)
        visible, i = [], 0
        for o, n in zip(options, counts):
            visible += outputs[i:i + len(o.root.outputs)]
            i += n
        return visible

    @staticmethod
    def _combined(options, region, plan):
        """``(combiner, partial specs, differentiable, outputs per root)`` of the roots together;
        sets ``region.root_partial``."""
        parts = [Splitter._root_part(o, plan) for o in options]
        partial_fns = [p[0] for p in parts]
        region.root_partial = lambda lookup, chunk, offset: [
            x for fn in partial_fns for x in fn(lookup, chunk, offset)]
        # Some combiners return more (a tie count, a normaliser): each part's outputs are the root's,
        # then the combiner's hidden ones.
        counts = [len(o.root.outputs) + c.hidden_outputs for (_, c, _, _), o in zip(parts, options)]
        if len(parts) == 1:
            _, combiner, specs, differentiable = parts[0]
        else:
            combiner = combiners.Group([(c, len(sp), n) for (_, c, sp, _), n in zip(parts, counts)])
            specs = [x for _, _, sp, _ in parts for x in sp]
            differentiable = all(p[3] for p in parts)
        return combiner, specs, differentiable, counts

    @staticmethod
    def _root_part(option, plan):
        """``(partial builder, combiner, partial specs, differentiable)`` for one root."""
        root = option.root
        kind = option.kind
        root_inputs = list(root.inputs)    # as now: a later split may rewire the (dead) root
        if kind == "concat":
            def concat_partial(lookup, chunk, offset):
                ins = [lookup(t, whole=a is None) for t, a in zip(root_inputs, option.input_axes)]
                return option.propagation.build(root, ins, chunk, offset)
            specs = [_spec_with(o, a, plan.chunk) for o, a in zip(root.outputs, option.output_axes)]
            return concat_partial, combiners.Concat(option.output_axes), specs, True

        extremum = kind in ("max", "min") and root.outputs[0].dtype.is_floating
        if kind == "online_softmax":
            scores, values = option.requests[0][0], root_inputs[1]

            def softmax_partial(lookup, chunk, offset):
                v = lookup(values)
                return combiners.softmax_partials(lookup(scores), lambda e: split_rules.clone_op(root, [e, v])[0])

            keep = scores.shape.as_list()[:-1] + [1]
            specs = [tf.TensorSpec(keep, scores.dtype)] * 2 + [tf.TensorSpec(root.outputs[0].shape, scores.dtype)]
            return softmax_partial, combiners.OnlineSoftmax(), specs, True

        def partial(lookup, chunk, offset):
            ins = [lookup(t, whole=a is None) for t, a in zip(root_inputs, option.input_axes)]
            outs = split_rules.clone_op(root, ins)
            if kind.startswith("arg"):
                return [outs[0], combiners.value_at(ins[0], outs[0], option.input_axes[0])]
            if extremum:
                axes = _const_axes(root.inputs[1], root.inputs[0].shape.rank)
                return [outs[0], combiners.tie_count(ins[0], axes, root.get_attr("keep_dims"), kind)]
            return outs

        if extremum:
            combiner = combiners.Extremum(kind)
            specs = [tf.TensorSpec(root.outputs[0].shape, root.outputs[0].dtype)] * 2
        elif kind.startswith("arg"):
            combiner = combiners.Arg(kind[3:], root.outputs[0].dtype)
            specs = [tf.TensorSpec(root.outputs[0].shape, root.outputs[0].dtype),
                     tf.TensorSpec(root.outputs[0].shape, root.inputs[0].dtype)]
        elif kind == "top_k":
            combiner = combiners.TopK(int(tensor_util.constant_value(root.inputs[1])))
            specs = [tf.TensorSpec(o.shape, o.dtype) for o in root.outputs]
        else:
            combiner = (combiners.combiner_for_reduction(root.type, plan.length, plan.chunk, plan.tail)
                        if root.type in _REDUCTIONS else combiners.Sum())
            specs = [tf.TensorSpec(o.shape, o.dtype) for o in root.outputs]
        if not combiner.differentiable and any(o.dtype.is_floating for o in root.outputs):
            raise NotImplementedError(f"a split `{root.type}` has no gradient rule yet")
        return partial, combiner, specs, combiner.differentiable


def _new_loops(graph, existing: set) -> list[tf.Operation]:
    return [op for op in graph.get_operations() if op.type in _LOOP_TYPES and op not in existing]


def _needed_now(graph, result: PassResult, loop_bytes: dict) -> int:
    """The bytes the program as rewritten so far needs by the memory model, each of the splitter's
    loops counted as a kernel whose scratch is its body's planned bytes.  Where that cannot be
    estimated (an op without a rule; the dynamic shapes of a sparse update): the most of the static
    part (a lower bound) and every loop's plan."""
    def body(op, ctx):
        return loop_bytes.get(op.name, 0)

    loop = memory_model.Rule(memory_model.Kind.LIBRARY, scratch=body)
    # The conditionals a prologue's recomputation sits in (split_loop._in_order): their outputs.
    branch = memory_model.Rule(memory_model.Kind.LIBRARY)
    after, info = memory_model.analyse(graph, {**memory_model.RULES, **dict.fromkeys(_LOOP_TYPES, loop),
                                               **dict.fromkeys(_BRANCH_TYPES, branch)})
    planned = max((r.bytes_after or 0 for r in result.rewritten), default=0)
    if after.peak_bytes is not None:
        return after.peak_bytes
    known = 0 if after.unknown_ops else after.parameter_bytes + after.constant_bytes + after.live_peak_bytes
    return max(planned, known, _floor(after, info))


def _best_effort(result: PassResult) -> bool:
    """Whether a plan says the limit cannot be met (its warning is given then)."""
    return any("best effort" in r.reason for r in result.records)


def _floor(est, info) -> int:
    """Parameters, constants, outputs and the largest materialised tensor: what no loop removes."""
    biggest = max((i.bytes for i in info.values() if i.materialised and i.bytes), default=0)
    return est.parameter_bytes + est.constant_bytes + est.output_bytes + biggest


def _materialised_bytes(ops, info, where=lambda t: True) -> int:
    """Bytes of the outputs of ``ops`` that the memory model gives buffers (those ``where`` accepts)."""
    return sum(i.bytes for op in ops for o in op.outputs
               if where(o) and (i := info.get(o.name)) is not None and i.materialised and i.bytes)


def _held_for_backward(grown, info, backward, joined) -> int:
    """Bytes that splitting the region stops holding from the forward to the backward: its tensors
    (and its prologue's) that gradients inside the function read (the loop's gradient recomputes
    them instead), less the inputs the loop's gradient keeps for that and nothing else did (an
    attention mask computed before a loop over heads, read whole by every slice).  ``joined``: the
    roots whose slices the loop joins into their whole result, still held (a loop over heads joins
    an attention's [L, H, K] output; one over queries through the output projection, [L, D]).
    Zero without gradients inside."""
    if not backward:
        return 0
    freed = _materialised_bytes(grown.included - joined, info, lambda o: any(c in backward for c in o.consumers()))
    freed += _materialised_bytes(grown.region.prologue, info, lambda o: any(c in backward for c in o.consumers()))
    kept = sum(_nbytes(t) for t in external_inputs(grown.region)
               if t.op.type not in ("Placeholder", "Const") and t.dtype not in (tf.resource, tf.variant)
               and not any(c in backward for c in t.consumers()))
    return freed - kept


def _computed(op: tf.Operation) -> tf.Operation:
    """The op that computes what ``op`` passes on (an output's ``Identity``), for the reports."""
    while op.type in _PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op


def _loops(result: PassResult) -> str:
    """"1 loop", "3 loops": the loops ``result`` has built so far."""
    n = len(result.rewritten)
    return f"{n} loop{'s' if n > 1 else ''}"


def _capped(plan: ChunkPlan, per_unit: float, budget: int) -> ChunkPlan:
    """``plan`` with slices of at most ``SLICE_SHARE`` of the budget, by the bytes a unit costs."""
    length, cap = plan.length, SLICE_SHARE * budget
    if per_unit <= 0 or plan.chunk * per_unit <= cap:
        return plan
    smaller = plan_chunks(length, per_unit, 0, int(cap))
    chunk = smaller.chunk if smaller else 1
    return ChunkPlan(length, chunk, int(plan.predicted_bytes - (plan.chunk - chunk) * per_unit))


def _split_anyway(whole: ChunkPlan, per_unit: float) -> ChunkPlan:
    """The plan for a region that fits the limit whole but is split all the same (the program as a
    whole does not fit, or the gradients would hold the region's tensors): two steps at least.
    XLA inlines a loop of one step, and then merges the forward's copy of the body with the
    backward's (CSE), holding its tensors all the same."""
    length, chunk = whole.length, whole.length // 2
    return ChunkPlan(length, chunk, int(whole.predicted_bytes - (length - chunk) * per_unit))


def _top_k(options) -> int:
    """The largest k of the region's top-k roots (a slice must hold at least k rows); 1 without one."""
    return max([int(tensor_util.constant_value(o.root.inputs[1])) for o in options if o.kind == "top_k"] or [1])


def _at_least(chunk: int, length: int, k: int) -> int | None:
    """``chunk`` or the next smaller size whose slices (the remainder too) hold at least ``k``."""
    while chunk > k and 0 < length % chunk < k:
        chunk -= 1
    return chunk if chunk >= k else None


def _spec_with(t: tf.Tensor, axis, chunk: int) -> tf.TensorSpec:
    shape = t.shape.as_list()
    if axis is not None:
        shape[axis] = chunk
    return tf.TensorSpec(shape, t.dtype)


def _forward_roots(tensor: tf.Tensor, axis: int, order_index: dict, graph_outputs: set,
                   ignored: frozenset) -> list[_Option] | str:
    """The roots that end the split of ``axis`` of ``tensor``, following the readers that keep it.

    Every reader of ``tensor`` (and of what carries its axis on) either keeps the axis (it then
    joins the region) or reduces it as a root (``Sum``, a ``MatMul`` contracting it, ...).  A
    tensor downstream that carries the axis and is an output of the function, or is read by an op
    that neither keeps nor reduces the axis, ends the region there: its op is a concatenating root
    (SGPR's predictive mean and variance over the test points, each [N_test, ...]) and all its
    readers read the joined result.  Only ``tensor`` itself cannot end so (with the reason).
    """
    roots: dict = {}
    seen: dict = {}
    stack = [(tensor, axis)]
    while stack:
        t, a = stack.pop()
        if t.ref() in seen:
            if seen[t.ref()] != a:
                return f"`{t.op.name}` would be split along two axes"
            continue
        seen[t.ref()] = a
        found, pushed, stop = {}, [], None
        if t.ref() in graph_outputs:
            stop = f"`{t.op.name}` is an output of the function"
        for reader in set(t.consumers()) if stop is None else ():
            if reader not in order_index or reader in ignored or _static_shape_reader(reader):
                continue
            slots = [j for j, x in enumerate(reader.inputs) if x is t]
            reducing = [o for o in _root_options(reader)
                        if o.kind != "concat" and all(o.input_axes[j] == a for j in slots)]
            if reducing:
                if reader in roots and roots[reader].input_axes != reducing[0].input_axes:
                    stop = f"`{reader.name}` reduces along two axes"
                    break
                found[reader] = reducing[0]
                continue
            kept = None
            for b in range(reader.outputs[0].shape.rank or 0) if reader.outputs else ():
                prop = split_rules.propagate(reader, 0, b)
                if prop and all(prop.input_axes[j] == a for j in slots):
                    kept = prop
                    break
            if kept is None:
                stop = f"`{reader.name}` ({reader.type}) neither keeps nor reduces axis {a} of `{t.op.name}`"
                break
            pushed.extend((o, b) for o, b in zip(reader.outputs, kept.output_axes) if b is not None)
        if stop is None:
            roots.update(found)
            stack.extend(pushed)
            continue
        ends = [o for o in _root_options(t.op) if o.kind == "concat" and o.output_axes[t.value_index] == a]
        if t is tensor or not ends:
            return stop
        if t.op in roots and roots[t.op].output_axes != ends[0].output_axes:
            return f"`{t.op.name}` would be joined along two axes"
        roots[t.op] = ends[0]
    return sorted(roots.values(), key=lambda o: order_index[o.root])


def _prologue(grown: _Grown, order_index: dict, graph_outputs: set, backward: frozenset,
              budget: int) -> list[tf.Operation]:
    """Ops computing tensors the region reads whole from much smaller ones, for the loop to recompute
    in its gradient instead of the program holding them (:class:`~grappler_ext.split_loop.Region`'s
    ``prologue``), in topological order.

    For each floating tensor read whole, the ops above it are taken one at a time (the largest
    input's producer next) while every reader of what they compute is in the region, the prologue
    or the recorded gradients (rebuilt through the loop); the smallest set of inputs reached is
    kept if it is at most ``PROLOGUE_SHARE`` of the tensor's bytes.  A prologue computes its
    tensors whole, in the forward and again in the backward: none may be over a slice's share of
    the budget (``SLICE_SHARE``), or the prologue would hold what the loop is there to slice (an
    attention's probabilities, read whole by a loop over the value's columns).
    """
    cap = SLICE_SHARE * budget
    region = grown.region
    taken: set = set()
    for ref in sorted(region.whole_inputs - set(region.sliced_inputs), key=lambda r: r.deref().name):
        t = ref.deref()
        if not t.dtype.is_floating or t.op in taken or _nbytes(t) < PROLOGUE_MIN_BYTES:
            continue
        ops: list = []
        best, best_bytes = [], _nbytes(t) * PROLOGUE_SHARE
        frontier = {t.ref()}
        while len(ops) < PROLOGUE_OPS:
            inside = grown.included | taken | set(ops)
            candidates = [r.deref() for r in frontier if _prologue_op(r.deref().op, inside, order_index,
                                                                      graph_outputs, backward, cap)]
            if not candidates:
                break
            op = max(candidates, key=_nbytes).op
            ops.append(op)
            frontier = {r for r in frontier if r.deref().op is not op} | {
                x.ref() for x in op.inputs if x.op not in ops}
            cut = sum(_nbytes(r.deref()) for r in frontier)
            if cut <= best_bytes:
                best, best_bytes = list(ops), cut
        taken |= set(best)
    return sorted(taken, key=lambda o: order_index[o])


def _prologue_op(op: tf.Operation, inside: set, order_index: dict, graph_outputs: set, backward: frozenset,
                 cap: float) -> bool:
    """Whether ``op`` can join a prologue whose region and ops so far are ``inside``, none of its
    outputs over ``cap`` bytes."""
    if (op in inside or op not in order_index or split_rules.leaf_kind(op) is not None or op.type in _NOT_CLONED
            or split_rules.is_stateful(op) or op.control_inputs or op._control_outputs  # noqa: SLF001
            or any(t.dtype in (tf.resource, tf.variant) for t in list(op.inputs) + list(op.outputs))
            or not all(t.shape.is_fully_defined() for t in op.outputs) or any(_nbytes(t) > cap for t in op.outputs)):
        return False
    for o in op.outputs:
        if o.ref() in graph_outputs:
            return False
        for c in o.consumers():
            if c in order_index and c not in inside and c not in backward and not _static_shape_reader(c):
                return False
    return True


def call_seed() -> tf.Tensor:
    """The [2] int64 seed a loop's random draws key on, drawn anew at every call of the function."""
    return tf.random.uniform([2], maxval=2**62, dtype=tf.int64)


def _joined_bytes(options) -> int:
    """The bytes of the results the loop of ``options`` joins whole (its concat roots' outputs)."""
    return sum(_nbytes(t) for o in options if o.kind == "concat" for t in o.root.outputs)


def _downstream(op: tf.Operation, order_index: dict, depth: int) -> list[tf.Operation]:
    """Ops reachable from ``op`` through data edges within ``depth`` steps, farthest first."""
    seen, frontier, found = {op}, [op], [op]
    for _ in range(depth):
        nxt = []
        for o in frontier:
            for t in o.outputs:
                for c in t.consumers():
                    if c not in seen and c in order_index:
                        seen.add(c)
                        nxt.append(c)
        found.extend(nxt)
        frontier = nxt
    return sorted(found, key=lambda o: -order_index[o])
