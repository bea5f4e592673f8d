"""splitter: compute a region too large for the limit one slice at a time, and combine exactly.

    top_k(-D(x, y))  with D: [N, M]   =>   while i < N / C:  out[iC:(i+1)C] = top_k(-D(x[iC:(i+1)C], y))

When the memory model (:mod:`grappler_ext.memory_model`) predicts that the program exceeds
``Options.memory_limit_bytes``, the pass takes the largest tensor the program materialises and
looks, among the ops it feeds (``Tuning.root_depth`` ops deep; ``root_depth_wide`` if none of those
meets the limit: SGPR's predictive density is 14 ops after K(Z, X*)), for a *root*: an op whose
result is small but whose operands are large.  For each way of splitting the root it grows a
*region* backwards with the split-axis rules of :mod:`.rules`, asks the policy (:mod:`.policy`,
:func:`.chunk_plan.plan_chunks`) for the largest chunk that fits, and builds the loop with
:mod:`.loop`:

=====================  ==============================================  =======================
root                   split                                           combiner
=====================  ==============================================  =======================
any op with a rule     an axis of its output (rows of a top-k, a       ``concat``
                       matmul, an elementwise result)
``Sum``/``Mean``/...   a reduced axis                                   ``sum``/``mean``/``max``..
``ArgMax``/``ArgMin``  the reduced axis                                 running arg (first index)
``TopKV2``             the top-k axis (needs chunks of at least k)      running top-k merge (each
                                                                       slice's own top-k through
                                                                       its blocks' maxima:
                                                                       :mod:`~grappler_ext.blocked_top_k`)
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
reductions (see :mod:`.combiners`).  The loop has a static trip count, so XLA
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
With gradients inside, a slice also takes at most ``Tuning.slice_share`` of the limit: the activations
held for the backward, and XLA's layout copies of them, are more than the model counts.

Prologues: a tensor the region reads whole that a few ops compute from much smaller ones
(``Tuning.prologue_share`` of its bytes at most, counting nothing for inputs the region reads anyway:
an attention's keys and values, [L, 8, 128], projected from the layer's input, [L, 128]) is computed
by the loop itself, before its slices, and with gradients inside again in its gradient
(:mod:`.loop`), so the program holds the small inputs from the forward to the backward instead (a
Transformer's training step at L = 8192 under 2 GB: 3.45 GiB with the projections held, 1.01 GB
without).  Without gradients, the prologue still runs only once its loop's sliced inputs exist, in
the layout the loop's matrix products read: XLA otherwise computes every decoder layer's
cross-attention keys and values at once, from the encoder's output, and holds a transposed copy of
each (the tutorial's Transformer at batch 8, L = 4096: 3.09 GB by XLA's figure, 1.90 GB with
prologues).  Only ops whose every reader is the region, the prologue or the gradients being
rebuilt, stateless, with static shapes and results of at most a slice's share of the limit (or the
largest input the region slices, where that is more) are taken (:func:`.analysis.prologue`).

Gradients as it goes (with gradients inside): where the region's one floating output is a scalar
combined by a sum or a mean (the loss itself: a mean of squared errors, a kernel regression's, an
InfoNCE loss) and a recorded gradient differentiates what is computed from it, the loop computes
each slice's gradients in the same step as the slice, for an upstream gradient of one, and sums
them (those of inputs read sliced are written and joined); the backward only multiplies them by
the upstream scalar.  That is one pass over the slices, as a hand-written gradient accumulation
makes, instead of a forward loop and a backward loop that computes every slice again
(:func:`.loop.fusable`; ``LoopPlan.fused``).  Where a slice's share of the upstream gradient needs
the whole result (a max, a softmax normaliser, an output that keeps the split axis) or nothing
differentiates the output, the loop keeps its recomputing gradient.

Programs checked with XLA (``Options.check_programs``): the model schedules the program in one
topological order, while XLA's scheduler may interleave independent branches (a Transformer's
encoder and decoder self-attention: the model counts one score tensor's worth of temporaries at a
time, XLA held four).  A program the model puts within the limit but above ``Tuning.check_from`` of it is
compiled whole (a copy, never run) before it is left alone; if XLA's figure is over the limit, the
program is split against the limit scaled by the model's share of that figure.  Likewise when the
model puts a program within the limit after some of its large tensors were split: if XLA's figure
says otherwise, every large tensor left is split too (a Transformer's training step at L = 2048:
six of its twelve attentions split by the model's count, 2.02 GB by XLA's; all twelve, 1.04 GB).
The program as split is compiled too, unless it was within the limit at that check, far below it
by the model's count, or its one loop was sized by compiling it as the whole program; if XLA's
figure is over the limit, the edits are undone (the journal of :mod:`grappler_ext.graph_edit`,
gradient records included) and the program is split again against the planning limit scaled by
limit / figure (``Tuning.replan_margin``, ``replans``), which gives smaller chunks where the loops are
what is over; a plan no better than the best so far returns to the best, and the user is warned.

Gradient loops grown into the room left (``Options.check_programs``): a gradient loop plans beside
what the model's schedule of the program as written holds while the gradients run, and that count
is the least sure of all (the gradient of a Matern32 kernel's [M, M] part: 800 MB by the model
beside SGPR's loop at M = 2000, the whole program 434 MB by XLA's figure).  When a gradient loop is
starved by it (``Tuning.starved_steps``), the program as split is compiled (never run) and, if XLA's
figure leaves room under the limit (less ``Tuning.replan_margin``), the program is split again with that
room given to the starved gradient loops, their forward plans unchanged, and compiled again: kept
if within the limit, otherwise the first plan is built again.  A starved loop that computes its
gradients as it goes is instead built again in its place, every other loop as it stands, and the
growth undone where the program grown is over the limit: no plan is made again.

Chunk sizes from XLA's figure (``Options.calibrate_chunks``): the memory model plans first, with
margins; then the loop is compiled alone (never run) at two chunk sizes, and the difference of the
two "Total bytes used" is what a row really costs.  Where the loop is all the program holds (no
gradients inside, no other large tensor, the rest a few per cent of the limit: a kNN search, a
kernel sum), the chunk is taken up to ``Tuning.whole_program_margin`` of the limit and checked by
compiling at that chunk, as a person sizing the loop by hand would; elsewhere the measured bytes a
row keep a margin for what XLA packs around the loop.  A loop whose chunk is scaled to the run's
sizes (:mod:`.scaling`) is compiled alone at the nominal sizes, and its bytes a row there are
scaled as the model's were; one computing its gradients as it goes over such sizes keeps the model's.

Attention in tiles: an attention split along its keys whose query rows pass through the region's
ops unchanged runs over query blocks x key blocks, each block folding only the key blocks that hold
an unmasked score (a causal mask's tiles above the diagonal are skipped, in the forward and in the
FlashAttention-2 backward); :mod:`.masked_tiles` proves which tiles are masked, and the ranking
prefers such a loop where it computes at most ``Tuning.tiled_share`` of its tiles.

What it does not do (yet): dynamic shapes (the static tensors beside them are split when they
alone are over the limit); plan all regions jointly (each plans against the program as it was,
assuming the other large tensors will be split: :func:`.analysis.needed_now` checks the result after each
rewrite); model the layout copies XLA makes of a loop's whole inputs for the dots in its body.

Pipeline position: after the rewrites that make regions cheaper (``pairwise_distance`` turns
an [N, M, D] broadcast into an [N, M] matmul, ``unrolled_reduction`` an L1 distance's into a sum of
[N, M] terms; the splitter then only has [N, M] to slice), and before ``blocked_top_k``, which
takes the top-k's it leaves whole.
Programs are checked and loops sized with XLA's figures only when the pass is given a
:class:`~grappler_ext.measure.Measurer` (``tf_memsafe`` gives its own); without one, the memory model decides.

The package, stage by stage (decisions travel as values: :mod:`.outcome`):

==================  ==========================================================================
module              what it holds
==================  ==========================================================================
``driver``          the pass: one ``_Run`` per graph (its state), the replanning and the warnings
``analysis``        roots, regions grown from them and why they stop, prologues (no mutation)
``policy``          chunk sizes, candidate ranking, chunks from measured figures (pure)
``tuning``          the margins, one frozen ``Tuning`` passed in
``mechanism``       a plan built into a loop and installed in place of its roots
``loop``            the ``tf.while_loop`` over slices and its recomputing gradient
``combiners``       how partial results of slices fold into the outputs, exactly
``tiling``          an attention's query x key tiles: where the query rows lie, tile sizes (pure)
``masked_tiles``    which tiles of an attention's scores are proven masked (intervals, no mutation)
``tiled_loop``      the loops over an attention's tiles, masked ones skipped, and their gradient
``replay``          a loop's gradient built once in a graph, copied when it is asked for again
``slicing``         a slice along an axis, and slices joined back
``rules``           how a split axis passes through each op type (the rule table)
``chunk_plan``      the largest chunk under a budget (pure)
``nominal``         the sizes a program with run-time dimensions is planned at
``scaling``         a loop's chunk scaled to the run-time sizes (a padded batch's), resolved by XLA
``lengths``         where an axis' run-time length comes from (the inputs, or a tensor it leads to)
``outcome``         record codes (``Code``) and the frozen ``LoopPlan`` of each loop
==================  ==========================================================================
"""

from grappler_ext.measure import Figure, Measurer
from grappler_ext.splitter.driver import Splitter
from grappler_ext.splitter.outcome import CANNOT_SPLIT, Code, LoopPlan, RootSplit, Sizing
from grappler_ext.splitter.tuning import DEFAULT_TUNING, Tuning

__all__ = ["Splitter", "Measurer", "Figure", "Code", "CANNOT_SPLIT", "LoopPlan", "RootSplit", "Sizing", "Tuning",
           "DEFAULT_TUNING"]
