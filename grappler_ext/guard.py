"""guard: a rewrite made for memory runs only over the limit, and stays only if the figure does not rise.

    fits as traced         ->  the pass does not run:  "left alone: ... within the limit as traced"
    figure after > before  ->  the pass's edits undone: "undone: XLA's figure rose from .. to .."
    a slower pass's figure over the limit and not ``SLOWER_GAIN`` below before  ->  undone too

The algebraic passes that exist to save bytes (``reduce_of_product``, ``pairwise_distance``: their
``motive`` is :attr:`~grappler_ext.pass_base.Motive.MEMORY`) judge by their own count of the tensor
they remove.  That count is not the program's: XLA:CPU already fuses a reduction of a dot into one
kernel with no product buffer (measured on TF 2.21: ``sum(A @ B @ Aᵀ)`` at [4000, 300] is 4.92 MiB,
its inputs, as written and as rewritten, while the pass counted 61 MiB -> 3.5 KiB), and the new form
can hold more than the old (issue 29 measured +57 %).  A memory tool must never raise the
footprint, and must leave a program that fits exactly as traced.  So the pipeline asks this guard,
around every pass whose motive is memory:

* **may it run?**  (:meth:`Guard.verdict`, once per pipeline run, on the program before the first
  such pass)  Not where the program is within the limit: by the memory model, when it counts at
  most ``trust`` of the limit; where it counts more than ``check_from`` of the limit (or cannot
  count), XLA's figure decides if there is a measurer.  These are the splitter's own margins
  (``grappler_ext.splitter.Tuning``), so the two never disagree on what fits.  Without a limit
  (``memory_limit_bytes=None``) nothing is judged and the passes run.
* **is it kept?**  (:meth:`Guard.compare`)  With a measurer, the program is compiled after the
  pass and again before it (the pipeline undoes the pass's edits to measure, and runs it again to
  keep it: passes are deterministic, and nothing is compiled when the pass changed nothing); a
  figure that rose undoes it.  Without one (or where XLA cannot say), the memory model's counts
  before and after decide the same way.  A pass whose rewrite costs run time (``GraphPass.slower``:
  ``blocked_linalg``'s Cholesky is about 3x the FLOPs) is also undone where the program stays over
  its limit and its figure is not ``SLOWER_GAIN`` below the figure before (a GP's predictive mean and
  variance with TFP at 2,500 x 3,000 points: 292.7 -> 285.2 MB under 96.5 MB, at 1.75x the time).

The pipeline writes the records (in the pass's name, with :class:`Code`), so ``explain()`` says
why a rewrite that could have fired did not.  Passes that cut FLOPs (``matrix_chain``), compile
time (``constant_cumsum``) or measured time (``unrolled_reduction``, ``random_key``, ``blocked_top_k``, which keeps
within the limit by its own count) are not guarded: they pay off within the limit too.  The splitter
judges its own plans.
"""

from __future__ import annotations

import dataclasses
import enum

from grappler_ext import memory_model
from grappler_ext.measure import Figure, Measurer, program_figure

__all__ = ["Code", "Guard", "Verdict", "Standing", "Rise", "SLOWER_GAIN"]

# A slower pass kept over the limit must bring the figure to at most this share of before: the
# splitter's own rule for a plan that stays over (``Tuning.over_gain``).
SLOWER_GAIN = 0.9


class Code(enum.Enum):
    """What the guard decided, on the records it makes."""

    FITS = "fits_as_traced"          # within the limit as traced: memory rewrites left alone
    ROSE = "figure_rose"             # the program's figure rose with the rewrite: undone
    WITHDRAWN = "warning_withdrawn"  # a pass's warning no longer holds: a later pass brought it within


@dataclasses.dataclass(frozen=True)
class Standing:
    """A program's figures at one point: the memory model's count (``None`` where it cannot count)
    and XLA's figure (``Figure()`` where not asked)."""

    model: int | None
    xla: Figure = Figure()


@dataclasses.dataclass(frozen=True)
class Rise:
    """A program's figures before and after a rewrite that raised them: the plan of the record that
    undoes it.  ``by_xla``: XLA's figures decided (both known); else the memory model's counts."""

    before: Standing
    after: Standing
    by_xla: bool
    short_of: float | None = None       # a slower pass's: the share of before it had to come under

    def __str__(self) -> str:
        if self.short_of is not None:
            by = "XLA's figure" if self.by_xla else "the memory model's count"
            first, then = ((self.before.xla.bytes, self.after.xla.bytes) if self.by_xla
                           else (self.before.model, self.after.model))
            return (f"{by} for the program went from {first:,} B to {then:,} B, over the limit and not "
                    f"{1 - self.short_of:.0%} lower, for a rewrite that costs run time")
        if self.by_xla:
            counted = ("" if self.before.model is None or self.after.model is None else
                       f" (the memory model counted {self.before.model:,} -> {self.after.model:,} B)")
            return (f"XLA's figure for the program rose from {self.before.xla.bytes:,} B to "
                    f"{self.after.xla.bytes:,} B{counted}")
        return f"the memory model's count of the program rose from {self.before.model:,} B to {self.after.model:,} B"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether memory rewrites may run on a program: ``fits`` (they may not) and the one-line why;
    ``decided`` false: the memory model alone cannot say, and XLA was not asked (see
    :meth:`Guard.verdict`)."""

    fits: bool
    reason: str
    decided: bool = True


class Guard:
    """The pipeline's memory guard (see the module docstring).

    Args:
      measurer: XLA's figures (``tf_memsafe`` gives its own); ``None``: the memory model alone.
      trust: the model's count at or below ``trust`` x the limit is taken as within it ...
      check_from: ... without compiling, when it is also below ``check_from`` x the limit.
    """

    def __init__(self, measurer: Measurer | None = None, trust: float = 0.8, check_from: float = 0.3):
        if not 0 < check_from <= trust <= 1:
            raise ValueError(f"need 0 < check_from <= trust <= 1, got check_from={check_from}, trust={trust}")
        self.measurer = measurer
        self.trust = trust
        self.check_from = check_from

    def _checker(self, options) -> Measurer | None:
        return self.measurer if options.check_programs else None

    @staticmethod
    def model_bytes(graph) -> int | None:
        """The memory model's count of ``graph`` (``None`` where an op has no rule or a shape is
        known only at run time)."""
        est, _ = memory_model.analyse(graph)
        return None if est.dynamic_tensors else est.peak_bytes

    def verdict(self, graph, options, measure: bool = True) -> Verdict | None:
        """Whether ``graph`` fits its limit as it stands; ``None`` where nothing can be judged (no
        limit; no count from the model and no figure from XLA).  ``measure`` false: where XLA's
        figure would decide, an undecided verdict instead of a compile."""
        limit = options.memory_limit_bytes
        if limit is None:
            return None
        model = self.model_bytes(graph)
        if model is not None and model > self.trust * limit:
            return Verdict(False, f"the memory model counts {model:,} B, over {self.trust:g} x the limit of "
                                  f"{limit:,} B")
        checker = self._checker(options)
        if model is not None and (model < self.check_from * limit or checker is None):
            return Verdict(True, f"about {model:,} B of {limit:,} B by the memory model")
        if not measure:
            return Verdict(False, "XLA's figure decides", decided=False)
        figure = program_figure(checker, graph)
        if not figure.known:
            if model is None:
                return None
            return Verdict(True, f"about {model:,} B of {limit:,} B by the memory model{figure.note()}")
        counted = "" if model is None else f" (the memory model: {model:,} B)"
        if figure.bytes > limit:
            return Verdict(False, f"XLA's figure is {figure.bytes:,} B, over the limit of {limit:,} B{counted}")
        return Verdict(True, f"XLA's figure is {figure.bytes:,} B of {limit:,} B{counted}")

    def measures(self, options) -> bool:
        """Whether :meth:`standing` compiles (so the pipeline must undo a pass to measure before it)."""
        return self._checker(options) is not None

    def standing(self, graph, options) -> Standing:
        """``graph``'s figures as it stands: the model's count, and XLA's where it measures."""
        return Standing(self.model_bytes(graph), program_figure(self._checker(options), graph))

    @staticmethod
    def compare(before: Standing, after: Standing, limit: int | None = None, slower: bool = False) -> Rise | None:
        """How the program is worse after than before, or ``None`` where it is not: XLA's figures
        where both are known, else the model's where both are.  ``slower``: the rewrite costs run
        time, and is worse too where the program stays over ``limit`` not ``SLOWER_GAIN`` below before."""
        if before.xla.known and after.xla.known:
            pair, by_xla = (before.xla.bytes, after.xla.bytes), True
        elif before.model is not None and after.model is not None:
            pair, by_xla = (before.model, after.model), False
        else:
            return None
        if pair[1] > pair[0]:
            return Rise(before, after, by_xla)
        if slower and limit is not None and pair[1] > limit and pair[1] > SLOWER_GAIN * pair[0]:
            return Rise(before, after, by_xla, short_of=SLOWER_GAIN)
        return None
