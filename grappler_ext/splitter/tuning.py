"""The splitter's margins and limits: one frozen, documented object, passed in (never a module global).

Every number here is a policy knob backed by a measurement (cited with it).  The splitter reads
them from the :class:`Tuning` it was built with; tests and experiments build a pass with other
values (``Splitter(tuning=Tuning(root_depth_wide=8))``) instead of patching modules.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Tuning", "DEFAULT_TUNING"]


# factors, not fractions
_AT_LEAST_ONE = frozenset({"backward_cost_factor", "dynamic_over", "search_budget", "growth_predicted"})
_SECONDS = frozenset({"search_floor_s"})                                               # durations, >= 0
_MAY_BE_ZERO = frozenset({"whole_at_run"})                             # fractions whose 0 turns a rule off


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The splitter's tuning.  Fractions are of the limit (or of the bytes named), in (0, 1].

    Attributes:
      safety_margin: a slice's bytes by the memory model are divided by this before planning: the
        model is an estimate (its ratio to XLA's figure stays in [0.7, 1.1] over the test
        workloads).  The fixed part (parameters, outputs, the combined result) is known exactly and
        gets no margin.
      pool_margin: the limit less the parameters is planned at this fraction: XLA packs every
        temporary of a program into one pool, with gaps where lifetimes interleave (the pool
        measured up to 1.3x the bytes live at its peak in an attention training step's loops).
      model_trust: a program is left alone as "already within the limit" only when the model's
        estimate is within this share of it (the model is 0.75-1.02x XLA's figure on its test
        workloads, 0.85x on SGPR with M = 2000: 897 MB estimated, 1.05 GB measured).
      calibration_margin: a loop's bytes a row measured by compiling it alone are divided by this:
        XLA packs the rest of the program around the loop less tightly than the loop alone (a
        Transformer's three attention loops needed 1.22x their standalone figures).
      calibration_floor: a loop's bytes a row measured alone under this share of the memory model's
        count are not believed (XLA fused the loop alone in a way the program does not: kNN's top-k along
        the points, 2.6 B a row alone against 45.7 kB by the model, 129 MB as the program's loop; rows of
        the queries measure 70 % of the model's count).
      whole_program_margin: a loop that is all the program holds (no gradients inside, no other
        large tensor, the rest under ``min_tensor_fraction`` of the limit: a kNN search, a kernel
        sum) is sized from XLA's figure for it, up to this share of the limit, and checked by
        compiling at that chunk, as a person sizing the loop by hand would.
      check_from: a program the model puts within ``model_trust`` of the limit but above this share
        of it is compiled whole before it is left alone (XLA's scheduler may interleave independent
        branches: a Transformer's encoder and decoder self-attention, 2.2 GB for the model's 1.1 GB).
      replan_margin: a split program over the limit by XLA's figure is planned again against the
        planning limit scaled by limit / figure and by this margin ...
      replans: ... at most this many times.
      slice_share: with gradients inside the function, a loop's slice takes at most this share of
        the budget (the program holds its forward activations for the backward, and XLA's layout
        copies of them: a Transformer's training step at L = 4096 under 2 GB was 2.08 GB in halves
        of 2048 rows, 1.98 GB in eighths of 512).
      min_tensor_fraction: a tensor smaller than this share of the limit is not worth a loop.
      backward_cost_factor: a slice's gradient holds about this many slice-sized tensors at once
        (measured 4.7x the forward slice's bytes for a kernel matrix-vector product): the backward
        loop plans with this factor.
      starved_steps: a gradient loop of at least this many steps, its chunk under
        1 / ``backward_cost_factor`` of its forward's, is starved (SGPR at M = 2000, N = 1e6: 8 rows a
        step, 125,000 steps); XLA's figure for the program as split says how much room there is.
      backward_sizing_steps: a gradient loop of at least this many steps, its chunk at most half its
        forward's, is sized by XLA's figures for the loop and its gradient alone at two chunks
        (:func:`~.policy.backward_sized`) instead of ``backward_cost_factor`` times the model's count of
        the forward: each step rewrites the gradients of what the loop reads whole (a mixed-precision
        Keras 3 text classifier's step on padded batches, its gradient in 153 steps of 6 rows: 3.2x the
        naive step; in the forward's 27 rows, XLA's 137 kB a row, 1.2x).  Fewer steps gain little for
        two compiles and a fuller limit (``experiments/padded``'s tf_keras step, 25 steps of 26 rows:
        in 11 of 57 it was 13 % slower, 5 MB larger and its first call 3 s longer).
      fused_starved_steps: a loop computing its gradients as it goes (``LoopPlan.fused``) is starved
        from this many steps, whatever gave it its chunk: the model's backward plan, smaller than its
        forward's (an attention's training step at L = 4000 under 1/10 of its footprint: 200 steps of 20
        rows took 1.5x the step as written, 24 of 169 rows 1.0x), or the share of the budget a slice may
        take (a Keras CNN's ``fit`` along its batch under 1/4 of its footprint: chunks of one example).
      growth_aim: a starved gradient loop grown by XLA's figures for it alone (:func:`~.policy.fused_grown`)
        aims at this share of its room: the figure is nearly straight in the chunk, not exactly (a
        Transformer's attention loop alone: 67.9 kB a row from 32 to 64 rows, 68.5 kB beyond; aimed at
        the whole room, 217 rows took 0.5 % more than it, and a compile more to find a chunk that fits).
      growth_predicted: a function of run-time sizes whose starved loops were grown so (built again in
        place, :func:`~.backward_growth.grown`) is not compiled whole again at its nominal sizes where XLA's
        figure before the growth plus this many times what the loops alone grew by (both measured) is
        within the limit less ``replan_margin``: each shape it runs at is checked by XLA's figure before it
        runs (``PassOptions.checked_at_run``), which the nominal sizes are then not taken for.  A loop's
        buffers are live while it runs, so the program grows by at most that much where XLA schedules
        the rest as before (the tf.data Transformer step at batch 8: 505 -> 542 MB, the loss' loop from
        2 rows to 36); the second compile of the whole step was a quarter of its trace (53 of 203 s).
      best_effort_fraction: when even the bytes that must stay exceed the limit, a region is still
        cut until its slice is this share of them (beyond that, smaller slices only cost steps).
      root_depth: how many ops downstream of a large tensor roots are looked for ...
      root_depth_wide: ... and how many when none of those meets the limit (SGPR's predictive
        density is 14 ops after K(Z, X*)).
      reach_on_margin: a region reaching on along the same axis past another's joined result (the
        whole layer past its attention) that cannot meet the limit is taken if it needs at most this
        share more by the model than the other, or than what the other leaves: one loop instead of
        several ...
      prologue_share: a prologue replaces a tensor read whole by inputs of at most this share of
        its bytes (an attention's keys: einsum and bias, 1/8) ...
      prologue_ops: ... in at most this many ops ...
      prologue_min_bytes: ... and only for tensors at least this large.
      other_sizes_gain: a program with dimensions known only at run time, over the limit as planned, is
        planned again with loops along the run-time sizes its loops did not split along first (a loop
        over an attention's queries holds its 8x-wide keys and values whole, one over the batch
        does not); that plan is kept where it is within the limit, or at most this share of the
        first's figure (a kernel regression's step: 4.23 MB against 4.38 MB, both over 4 MB, kept
        the first).
      dynamic_over: a program with dimensions known only at run time (a ``None`` in its
        ``input_signature``) is planned at the nominal size where what grows with them is this many
        times the limit: large enough that a loop is planned for each tensor that grows, small
        enough that what cannot be split (the inputs themselves) does not crowd the plan out ...
      dynamic_io_share: ... and, while what grows stays over half the limit there, at most where the
        function's inputs and outputs with run-time dimensions take this share of it (a Vision
        Transformer's evaluation grows about four times its inputs and logits: at 4 x the limit those
        alone were the limit, and every plan was a best effort).
      whole_at_run: a program with dimensions known only at run time runs as written (its loops give
        way to their regions: :mod:`.whole_at_run`) where the memory model's count of the program as
        written, at the sizes it runs at, is within this share of the limit (a Transformer's padded-batch
        training step at L = 256, 1.0 GiB of 2 GB, was split all the same, 2.6x slower).  Nothing
        compiles the program at those sizes before it runs, so the share is the model's worst measured
        ratio to XLA's figure, 0.75 (model_trust's 0.8 is checked by compiling); 0: never.
      best_effort_checks: before a best effort, once loops are built, XLA's figure for the program as
        split so far is asked (a compile of the whole program): within the limit, the plan stops there.
        After a figure over the limit, the next is asked only once the model's count, scaled by its
        ratio to that figure, is within the limit; at most this many a plan (0: never).  The model's
        count of a split program runs over XLA's (3x for a padded Transformer step planned at its nominal
        sizes), and each best effort is a loop, a gradient rebuild and a slower step more.
      over_gain: a plan XLA's figure puts over the limit is kept only where that figure is at most this
        share of the program as written's (else the program is left as written: its loops would slow
        every step for little); and once a best effort is built, XLA's figure for the program as split so
        far at or above this share of it stops the best efforts (MobileNetV2's training step at batch 32
        under a quarter of its 419 MB: its first best effort gave 417.5 MB, six more 454 MB, 80 s of
        compiles for a plan then undone).
      tiled_share: an attention computed in tiles whose loop computes at most this share of them (the
        rest masked and skipped) is preferred to a loop computing every score (a causal training
        step at L = 4000 under 1/10 of its footprint: 36 ms in tiles, 44 % skipped, against 67 ms for
        the loop over its rows computing its gradients as it goes).
      search_budget: once a run of the splitter has taken this many times the longest compile of a
        whole program it asked XLA for (and at least ``search_floor_s``), it searches no further: no
        plan again against a lower limit, along other sizes or with large joins, no gradient loop
        grown, no figure asked before a best effort; the plan built so far stands, measured (and warned
        about if over).  The first call of a function is its trace, this search and XLA's compile: the
        run's own compile is about the naive first call, so the search is kept to a few of those (a
        Keras 3 translation Transformer's mixed-precision step, 12.6 s a compile, searched 523 s through
        23 compiles and nine plans to end 0.8 % below its first plan, over the limit either way).
      search_floor_s: ... seconds a run may always search (programs that compile in a second or two are
        cheap to plan again).
    """

    safety_margin: float = 0.7
    pool_margin: float = 0.8
    model_trust: float = 0.8
    calibration_margin: float = 0.7
    calibration_floor: float = 0.02
    whole_program_margin: float = 0.95
    check_from: float = 0.3
    replan_margin: float = 0.95
    replans: int = 2
    slice_share: float = 0.125
    min_tensor_fraction: float = 0.05
    backward_cost_factor: float = 5.0
    starved_steps: int = 256
    backward_sizing_steps: int = 64
    fused_starved_steps: int = 32
    growth_aim: float = 0.95
    growth_predicted: float = 2.0
    best_effort_fraction: float = 0.1
    root_depth: int = 8
    root_depth_wide: int = 32
    reach_on_margin: float = 0.1
    prologue_share: float = 0.5
    prologue_ops: int = 8
    prologue_min_bytes: int = 1 << 16
    dynamic_over: float = 4.0
    dynamic_io_share: float = 0.25
    tiled_share: float = 0.65
    whole_at_run: float = 0.75
    best_effort_checks: int = 3
    over_gain: float = 0.9
    other_sizes_gain: float = 0.8
    search_budget: float = 4.0
    search_floor_s: float = 60.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    value >= 1 if f.name in _AT_LEAST_ONE else value >= 0 if f.name in _SECONDS
                    else 0 <= value <= 1 if f.name in _MAY_BE_ZERO else 0 < value <= 1)
                accepted = (">= 1" if f.name in _AT_LEAST_ONE else ">= 0" if f.name in _SECONDS
                            else "in [0, 1]" if f.name in _MAY_BE_ZERO else "in (0, 1]")
            else:
                zero = f.name in ("replans", "best_effort_checks")
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= (0 if zero else 1)
                accepted = "an int >= 0" if zero else "an int >= 1"
            if not ok:
                raise ValueError(f"Tuning.{f.name} must be {accepted}, got {value!r}")


DEFAULT_TUNING = Tuning()
