"""What the splitter decided, as values: a code per record and, for a loop, a frozen plan.

Code that needs to know what happened reads ``record.code`` (a :class:`Code`) and ``record.plan``
(a :class:`LoopPlan`); ``record.reason`` is the same decision rendered for people, from these
values, by the functions here.  Nothing reads the text back.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Code", "CANNOT_SPLIT", "Why", "Redrawable", "RootSplit", "Sizing", "BestEffort", "LoopPlan", "Tiles",
           "NestedKeys", "Growth", "Whole", "CannotFit", "megabytes", "loops", "loop_chunks", "worst", "cause"]


def loops(n: int) -> str:
    """"1 loop", "3 loops"."""
    return f"{n} loop{'s' if n > 1 else ''}"


def loop_chunks(result) -> list[tuple[int, int]]:
    """The chunks (forward, backward) of the loops a plan's records (a ``PassResult``) built, in order."""
    return [(r.plan.chunk, r.plan.backward_chunk) for r in result.records if isinstance(r.plan, LoopPlan)]


def built_alike(result) -> tuple:
    """What decides the program a plan's records (a ``PassResult``) built: its loops' plans, less
    the counts and figures that sized them.  Two plans alike build the same program."""
    return tuple(dataclasses.replace(r.plan, predicted_bytes=0, sizing=Sizing.MODEL, sizing_detail="",
                                     bytes_per_row=None, loop_figure_bytes=None)
                 for r in result.records if isinstance(r.plan, LoopPlan))


def megabytes(n: int | None) -> str:
    """``n`` bytes for a person: "12.3 MB" (``None``: "an unknown amount")."""
    return "an unknown amount" if n is None else f"{n / 1e6:,.1f} MB"


def worst(records):
    """The largest record (by its bytes before) of what a plan could not split or split only as a best
    effort, or ``None``."""
    failed = [r for r in records if r.code in CANNOT_SPLIT or r.code == Code.BEST_EFFORT]
    return max(failed, key=lambda r: r.bytes_before or 0, default=None)


_NAMED = 4          # the other tensors a warning names


def cause(record, records=()) -> str:
    """What a warning says of the ``record`` :func:`worst` gives: "the splitter cannot split ..." or
    "the splitter could only reduce it: ...".  Where ``records`` hold other large tensors that no
    region could split, how many and how much they hold with it: a tensor of a tenth of the limit
    does not put a program over it alone (an SVGP step, 4.5 MB under 4 MB: four [M, M] tensors of
    320 kB around a ``Cholesky``, and the warning named one)."""
    if record.code == Code.BEST_EFFORT:
        return f"the splitter could only reduce it: {record.reason}"
    said = f"the splitter {record.reason[0].lower()}{record.reason[1:]}"
    seen, others = set(record.ops), []
    for r in sorted(records, key=lambda r: -(r.bytes_before or 0)):
        if r.code in CANNOT_SPLIT and r.bytes_before and r.ops and not seen & set(r.ops):
            seen |= set(r.ops)
            others.append(r)
    if not others:
        return said
    names = ", ".join(f"`{r.ops[0]}`" for r in others[:_NAMED])
    more = f" and {len(others) - _NAMED} more" if len(others) > _NAMED else ""
    total = (record.bytes_before or 0) + sum(r.bytes_before for r in others)
    s = "s" if len(others) > 1 else ""
    return (f"{said}; nor can it split {len(others)} other large tensor{s} ({names}{more}): "
            f"{megabytes(total)} with that one")


class Code(str, enum.Enum):
    """Why a splitter record was written.  A ``str`` enum: equal to its value after a JSON round trip."""

    # The program as a whole, left alone.
    NO_LIMIT = "no_limit"                    # no memory limit in bytes
    DYNAMIC_SHAPES = "dynamic_shapes"        # dynamic shapes: left alone, or only the static tensors split
    WITHIN_LIMIT = "within_limit"            # the model (and XLA's figure, where asked) puts it within
    NO_ESTIMATE = "no_estimate"              # the model cannot estimate it; nothing is over on its own
    # Notes on how a plan was made.
    PLANNED_LOWER = "planned_lower"          # XLA's figure for the program as written is over: a lower limit
    OVER_BY_XLA = "over_by_xla"              # the model cannot estimate it; XLA's figure is over: split it
    GRADIENTS_AS_TRACED = "gradients_as_traced"  # gradients inside cannot be rebuilt: they hold the region
    CHECKED_OVER = "checked_over"            # within by the model after a split, over by XLA's: split the rest
    CHECKED_WITHIN = "checked_within"        # over by the model's count, within by XLA's figure
    REPLANNED = "replanned"                  # the split program over by XLA's figure: planned again, lower
    REPLAN_NO_BETTER = "replan_no_better"    # planning lower did not help: the best plan again
    STILL_OVER = "still_over"                # over by XLA's figure as split, nothing left to split
    LARGE_JOINS_ALLOWED = "large_joins_allowed"  # the limit cannot be met: large joined results allowed, smaller
    OTHER_SIZES = "other_sizes"              # ... run-time sizes: loops along those not split first, smaller
    BEST_EFFORTS_GO_ON = "best_efforts_go_on"    # before a best effort: XLA's figure as split so far is over
    BEST_EFFORTS_STOPPED = "best_efforts_stopped"  # ... within: the plan stops, the tensors left whole
    BEST_EFFORTS_IN_VAIN = "best_efforts_in_vain"  # ... over, and not below the program as written: the plan stops
    GROWN = "grown"                          # starved gradient loops grown into the room XLA's figure left
    NOT_GROWN = "not_grown"                  # ... or not, and why
    SEARCH_STOPPED = "search_stopped"        # the run's time for planning again spent: the plan so far stands
    OUTGROWS = "outgrows"                    # within at the nominal sizes, but tensors left outgrow the inputs: split
    NO_SMALLER = "no_smaller"                # over the limit as split, and no smaller than as written: undone
    # A large tensor not split (the "cannot split" records: :data:`CANNOT_SPLIT`).
    NO_ROOT = "no_root"                      # no op downstream reduces it or has a split rule
    REFUSED_OP = "refused_op"                # the region stops at an op a rule refuses (no rule, stateful, ...)
    RANDOM_DRAW = "random_draw"              # ... a random draw, which Options.redraw_random lets a loop draw again
    REGION_STOPS = "region_stops"            # the region stops before it (an input, read whole or elsewhere)
    REGION_CONFLICT = "region_conflict"      # wanted along two axes, lengths differ, roots read each other
    SPARSE_LOOKUP = "sparse_lookup"          # an embedding lookup, whose recorded gradient is IndexedSlices
    SHARDED_AXIS = "sharded_axis"            # it would slice an axis a device mesh shards (DTensor)
    DYNAMIC_AXIS = "dynamic_axis"            # a run-time length it cannot plan: other axes dynamic, lengths
                                             # that may differ, no nominal size
    JOINED_TOO_LARGE = "joined_too_large"    # the loop's joined result is over half the limit
    SAVES_TOO_LITTLE = "saves_too_little"    # nearly all the region holds is its joined result
    NO_PLAN = "no_plan"                      # no chunk fits, and a best effort would not halve the program
    TOP_K_TOO_SMALL = "top_k_too_small"      # no chunk holds k rows
    FITS_WHOLE = "fits_whole"                # the planner's count says its region fits whole
    BUILD_FAILED = "build_failed"            # building the loop raised (a combiner with no gradient rule on
                                             # floating outputs, ...): the graph is as it was
    # An attention not computed by key blocks inside a loop over its rows (:mod:`.nesting`; not a record).
    NO_PROLOGUE = "no_prologue"              # the loop computes nothing whole before it: nothing to project by block
    # Loops built.
    SPLIT = "split"                          # a loop within the limit by the plan
    BEST_EFFORT = "best_effort"              # a loop, but the limit cannot be met (warned)


# A large tensor that stays whole because no candidate region around it could be planned (the
# warning names the largest); its record is dropped if a later region took the tensor in after all.
CANNOT_SPLIT = frozenset({Code.NO_ROOT, Code.REFUSED_OP, Code.RANDOM_DRAW, Code.REGION_STOPS, Code.REGION_CONFLICT,
                          Code.DYNAMIC_AXIS, Code.SPARSE_LOOKUP, Code.SHARDED_AXIS, Code.JOINED_TOO_LARGE,
                          Code.SAVES_TOO_LITTLE, Code.NO_PLAN, Code.TOP_K_TOO_SMALL})


@dataclasses.dataclass(frozen=True)
class Why:
    """One reason a candidate failed, as a code and the line a person reads."""

    code: Code
    text: str


@dataclasses.dataclass(frozen=True)
class Redrawable:
    """A tensor no region could split for which a region drawing ``draws`` again slice by slice would
    be planned (``Options.redraw_random``): what the warning may advise (on its skip record's plan).
    ``for_loop``: the tensor is the draw itself, held whole for a loop built before that reads it."""

    draws: tuple[str, ...]
    for_loop: bool = False


@dataclasses.dataclass(frozen=True)
class RootSplit:
    """One root of a loop: the op its region ends in, how slices combine, and the axes it reads.

    ``op_type`` is the type of the op that computes what the root passes on (an output's
    ``Identity`` names the ``MatMul`` before it), as reports name it.
    """

    op: str
    op_type: str
    kind: str                              # "concat", "sum", "mean", "max", ..., "argmax", "top_k", "online_softmax"
    input_axes: tuple[int | None, ...]

    def describe(self, first: bool = True) -> str:
        """"`TopKV2` top_k over input 0 axis 1" (the first root), "`MatMul` sum" (the others)."""
        if not first:
            return f"`{self.op_type}` {self.kind}"
        split = ", ".join(f"input {i} axis {a}" for i, a in enumerate(self.input_axes) if a is not None)
        return f"`{self.op_type}` {self.kind} over {split}"


class Sizing(str, enum.Enum):
    """Where a loop's chunk came from."""

    MODEL = "model"                        # the memory model's count (calibration off, or not tried)
    MODEL_NO_SECOND_SIZE = "model_no_second_size"   # no second chunk size to compare with
    MODEL_MEASURE_FAILED = "model_measure_failed"   # compiling the loop failed (``detail``: the error's type)
    MODEL_NOT_GROWING = "model_not_growing"         # XLA's figure does not grow with the chunk
    MODEL_IMPLAUSIBLE = "model_implausible"         # ... grows by a tiny share of the model's count a row
    MODEL_MEASURED_REFUSED = "model_measured_refused"  # with XLA's figure no plan (``detail``: why)
    LOOP_FIGURE = "loop_figure"            # XLA's figure for the loop alone at two chunks, with a margin
    PROGRAM_FIGURE = "program_figure"      # XLA's figure for the loop, which is the whole program
    NOMINAL_FIGURE = "nominal_figure"      # XLA's figure for the loop alone at the nominal sizes, a row's
                                           # bytes there scaled to the run's sizes (.scaling)


@dataclasses.dataclass(frozen=True)
class BestEffort:
    """The limit cannot be met by a loop: the bytes it still needs (forward) or that stay while its
    backward runs (``by_backward``), and where the region stops, if it stops early (``stop``, and why:
    ``stop_code``), or what the rest of the program holds beside the loop (``beside``), where that alone
    is over the limit."""

    needed_bytes: int
    by_backward: bool = False
    stop: str = ""
    beside: str = ""
    stop_code: Code | None = None

    def render(self) -> str:
        if self.by_backward:
            return (f"best effort, the limit cannot be met by the backward ({self.needed_bytes:,} B stay while it "
                    "runs: the region's inputs and their gradients)")
        stop = f"; {self.beside}" if self.beside else f"; the region stops where {self.stop}" if self.stop else ""
        # (the model's count: XLA's figure for the program as split, recorded after, has the last word)
        return (f"best effort, the limit cannot be met ({self.needed_bytes:,} B needed by the memory model's "
                f"count{stop})")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """An attention's loop in tiles of ``query_block`` rows by ``key_block`` keys, ``skipped`` of
    ``total`` proven masked and not computed (:mod:`.tiling`); its gradient's tiles ``backward``."""

    query_block: int
    key_block: int
    skipped: int
    total: int
    backward: tuple[int, int] | None = None

    def render(self) -> str:
        text = (f"in tiles of {self.query_block} queries x {self.key_block} keys, {self.skipped} of {self.total} "
                "masked and skipped")
        if self.backward is not None and self.backward != (self.query_block, self.key_block):
            text += f" (its gradient in tiles of {self.backward[0]} x {self.backward[1]})"
        return text


@dataclasses.dataclass(frozen=True)
class NestedKeys:
    """An attention computed in each slice by a loop of its own over blocks of its keys, its keys and
    values projected there (:mod:`.nesting`): its root, the block and the keys, and how many ops
    the loop no longer computes whole before it."""

    root: str
    key_block: int
    keys: int
    moved: int

    def render(self) -> str:
        blocks = f"{self.keys // self.key_block} x {self.key_block}" + (
            f" + {self.keys % self.key_block}" if self.keys % self.key_block else "")
        return (f"`{self.root}` computed in each slice over its keys in blocks ({blocks} of {self.keys}), its keys and "
                f"values projected there ({self.moved} ops no longer computed whole before the loop)")


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """A loop the splitter built: its roots, the split axis' length and the forward's and the
    gradient loop's chunks, what sized them, and what else it does.

    Attributes:
      roots: the roots split together, the first one's split axis is the loop's.
      length: the split axis' length.
      chunk: the forward loop's chunk (``steps`` full chunks, then a remainder of ``tail``).
      backward_chunk: the gradient loop's chunk (the gradients recompute slices in their own loop).
      has_gradient_loop: whether a gradient loop of its own was built (gradients inside the function).
      sizing, sizing_detail, bytes_per_row, loop_figure_bytes: where the chunk came from (see
        :class:`Sizing`); XLA's bytes a row and its figure for the loop at this chunk, when measured.
      backward_bytes_per_row: XLA's bytes a row of the gradient loop, where they sized its chunk
        (the loop and its gradient compiled alone at two chunks: :func:`.policy.backward_sized`).
      best_effort: set when the limit cannot be met (see :class:`BestEffort`).
      rebuilt_gradients: gradients taken inside the function rebuilt through the loop.
      prologue_ops: ops before the loop that it computes first, once its sliced inputs exist (and
        again in its gradient).
      predicted_bytes: the planner's count of the program while the loop runs.
      dynamic: the split axis' length is known only at run time: ``length`` is the nominal size the
        loop was planned at (:mod:`grappler_ext.shapes`), and the loop runs ``ceil(n / chunk)`` slices
        of ``chunk``, the last one's rows past ``n`` masked out (no remainder slice).
      fused: the loop computes each slice's gradients as it computes the slice (gradients inside the
        function, one scalar output combined by a sum or a mean): one pass over the slices, no
        gradient loop; ``chunk`` is then the gradient's.
      written_into: the variables whose new values the loop writes, slice by slice, into their own
        buffers (a wide layer's update along its kernel's columns).
      tiles: an attention's loop in 2-D tiles, its masked tiles skipped (:class:`Tiles`).
      nested: an attention computed in each slice by a loop over its keys (:class:`NestedKeys`).
      redrawn: the random draws the loop draws again slice by slice (``Options.redraw_random``):
        other numbers of the same distribution than the program as written draws.
    """

    roots: tuple[RootSplit, ...]
    length: int
    chunk: int
    backward_chunk: int
    predicted_bytes: int
    has_gradient_loop: bool = False
    sizing: Sizing = Sizing.MODEL
    sizing_detail: str = ""
    bytes_per_row: float | None = None
    loop_figure_bytes: int | None = None
    backward_bytes_per_row: float | None = None
    best_effort: BestEffort | None = None
    rebuilt_gradients: int = 0
    prologue_ops: tuple[str, ...] = ()
    dynamic: bool = False
    fused: bool = False
    written_into: tuple[str, ...] = ()
    tiles: Tiles | None = None
    nested: NestedKeys | None = None
    redrawn: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        return -(-self.length // self.chunk) if self.dynamic else self.length // self.chunk

    @property
    def tail(self) -> int:
        return 0 if self.dynamic else self.length % self.chunk

    @property
    def backward_steps(self) -> int:
        return -(-self.length // self.backward_chunk) if self.dynamic else self.length // self.backward_chunk

    @property
    def backward_tail(self) -> int:
        return 0 if self.dynamic else self.length % self.backward_chunk

    @property
    def split_input(self) -> tuple[int, int]:
        """``(input index, axis)`` the first root reads sliced (its first split input)."""
        return next((i, a) for i, a in enumerate(self.roots[0].input_axes) if a is not None)

    def describe(self) -> str:
        """The roots and their combiners, e.g. "`Sum` sum over input 0 axis 0 and `MatMul` sum"."""
        return " and ".join(r.describe(first=i == 0) for i, r in enumerate(self.roots))

    def render(self) -> str:
        """The record's one line: roots, steps x chunk (+ tail) of length, and what sized it."""
        if self.dynamic:
            text = (f"{self.describe()}: chunks of {self.chunk} of a length n known at run time, ceil(n / "
                    f"{self.chunk}) steps (planned at n = {self.length:,})")
        else:
            text = f"{self.describe()}: {self.steps} x {self.chunk}" + (f" + {self.tail}" if self.tail else "")
            text += f" of {self.length}"
        text += self._sizing_text()
        measured = self.backward_bytes_per_row is not None
        if (self.has_gradient_loop or measured) and self.backward_chunk < self.chunk:
            text += (f"; its gradient in chunks of {self.backward_chunk}" if self.dynamic else
                     f"; its gradient {self.backward_steps} x {self.backward_chunk}" + (
                         f" + {self.backward_tail}" if self.backward_tail else ""))
        elif measured:
            text += "; its gradient in the same chunks"
        if measured:
            there = " at the nominal sizes" if self.dynamic else ""
            text += (f" (by XLA's figure for the loop and its gradient alone{there}: "
                     f"{self.backward_bytes_per_row:,.0f} B a row)")
        if self.fused:
            text += "; its gradients computed in the same loop"
        if self.written_into:
            shown, s = ", ".join(f"`{name}`" for name in self.written_into), "s" if len(self.written_into) > 1 else ""
            text += f"; the new value{s} of {shown} written into the variable{s} slice by slice"
        if self.tiles is not None:
            text += f"; {self.tiles.render()}"
        if self.nested is not None:
            text += f"; {self.nested.render()}"
        if self.rebuilt_gradients:
            n = self.rebuilt_gradients
            text += f"; {n} gradient{'s' if n > 1 else ''} inside the function rebuilt"
        if self.prologue_ops:
            n = len(self.prologue_ops)
            gradient = self.rebuilt_gradients or self.has_gradient_loop or self.fused
            again = " and again in the gradient" if gradient else ""
            text += f"; {n} op{'s' if n > 1 else ''} before it computed in its prologue{again}"
        if self.redrawn:
            shown, s = ", ".join(f"`{name}`" for name in self.redrawn), "s" if len(self.redrawn) > 1 else ""
            text += (f"; the random draw{s} {shown} drawn again slice by slice (redraw_random=True): other numbers "
                     "of the same distribution than the program as written")
        if self.best_effort is not None:
            text += f"; {self.best_effort.render()}"
        return text

    def _sizing_text(self) -> str:
        s = self.sizing
        if s == Sizing.MODEL:
            return ""
        if s == Sizing.LOOP_FIGURE:
            return f"; chunk from XLA's figure for the loop ({self.bytes_per_row:,.0f} B a row)"
        if s == Sizing.NOMINAL_FIGURE:
            return (f"; chunk from XLA's figure for the loop at the nominal sizes ({self.bytes_per_row:,.0f} B a row "
                    "there), scaled to the sizes it runs at")
        if s == Sizing.PROGRAM_FIGURE:
            return (f"; chunk from XLA's figure for the loop, which is the program ({self.loop_figure_bytes:,} B at "
                    f"this chunk, {self.bytes_per_row:,.0f} B a row)")
        why = {Sizing.MODEL_NO_SECOND_SIZE: "no second chunk size to compare with",
               Sizing.MODEL_MEASURE_FAILED: f"measuring the loop failed: {self.sizing_detail}",
               Sizing.MODEL_NOT_GROWING: "XLA's figure does not grow with the chunk",
               Sizing.MODEL_IMPLAUSIBLE: f"XLA's figure for the loop alone grows by {self.sizing_detail}, which "
                                         "the program will not keep to",
               Sizing.MODEL_MEASURED_REFUSED: f"with XLA's figure: {self.sizing_detail}"}[s]
        return f"; chunk from the memory model ({why})"


@dataclasses.dataclass(frozen=True)
class Growth:
    """Starved gradient loops grown (or not) into the room XLA's figure left (``Code.GROWN`` or
    ``NOT_GROWN`` records): their chunks by the model's plan, the room, and XLA's figures for the
    program as split before and after (``None``: not measured); ``predicted_after``: the program grown,
    not compiled again, as XLA's figure before plus what its figures for the loops alone grew by
    (``Tuning.growth_predicted``)."""

    starved_chunks: tuple[int, ...]
    room_bytes: int
    figure_before: int
    figure_after: int | None = None
    predicted_after: int | None = None


@dataclasses.dataclass(frozen=True)
class NominalSize:
    """The size a program's run-time dimensions were planned at (the ``Code.DYNAMIC_SHAPES`` record of a
    nominal plan): ``size``, and ``grown_to``, where what grows with them is ``Tuning.dynamic_over`` x the
    limit; ``size`` is smaller where the function's inputs and outputs would take over
    ``Tuning.dynamic_io_share`` of the limit there.  ``inputs``: the shapes the function's inputs with
    run-time dimensions were planned at, by name (the program was judged there: a run at larger
    sizes is the caller's to check).  ``within``: whether the plan met the limit there; a plan over it
    is not judged at any size (the caller checks every size it runs at: ``PassOptions.checked_at_run``,
    where the plan's warning is not given, its sizes being the splitter's, not the run's).
    ``measured``: whether XLA's figure there is of the program as it runs; not where its growth was
    predicted (:class:`Growth`), and then it is not judged at any size either."""

    size: int
    grown_to: int
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    within: bool = True
    measured: bool = True

    @property
    def for_io(self) -> bool:
        """Whether the size was made smaller to leave room beside the inputs and outputs."""
        return self.size < self.grown_to


@dataclasses.dataclass(frozen=True)
class Whole:
    """An op no rewrite splits the matrices of (:data:`~grappler_ext.op_types.WHOLE_MATRICES`): its
    name and the function a person calls for it, its matrix's shape, and the bytes it holds whole at
    once, its inputs and results of those among the program's arguments and results left out (a lower
    bound: XLA's solver takes its own scratch beside them)."""

    op: str
    function: str
    shape: tuple[int, ...]
    bytes: int

    def render(self) -> str:
        return (f"`{self.op}` ({self.function}) holds {megabytes(self.bytes)} whole at once "
                f"({list(self.shape)} matrices), which no rewrite splits")


@dataclasses.dataclass(frozen=True)
class CannotFit:
    """The one warning of a run whose limit cannot be met: the program, what it needs (``needed``
    bytes, ``by``: "about" or "at least" by the model's count, or "XLA" by its figure as written), as split
    (the model's count and XLA's figure, where known), the limit planned against (``limit``, the
    user's ``wanted`` where it was scaled) and what the splitter said of the record that could not
    be helped (``what``); ``arguments`` and ``results``: the bytes of the program's arguments (its
    variables' values among them) and results, which no rewrite changes (0: not counted); ``split``:
    whether anything was split; ``whole``: the op holding the most bytes no rewrite splits, if any."""

    program: str
    needed: int | None
    by: str
    after: int | None
    figure: int | None
    limit: int
    wanted: int
    what: str
    arguments: int = 0
    results: int = 0
    split: bool = True                  # whether anything was split (else XLA's figure is the program's as written)
    whole: Whole | None = None

    @property
    def floor(self) -> int:
        """What the program holds whatever is rewritten inside it."""
        return self.arguments + self.results + (self.whole.bytes if self.whole is not None else 0)

    def render(self) -> str:
        mb = megabytes
        xla = f"{mb(self.figure)} by XLA's figure" if self.figure is not None else ""
        # (the model's count as split, named so where the program's need is XLA's figure as written)
        model = " by the memory model" if self.by == "XLA" else ""
        then = (f" ({mb(self.after)}{model} as split{', ' + xla if xla else ''})" if self.after is not None
                else f" ({xla} as {'split' if self.split else 'written'})" if xla else "")
        # (the user's limit first; the one planned against, in the model's units, after it)
        scaled = ("" if self.limit == self.wanted else f" (planned against {mb(self.limit)}: the memory model counts "
                  f"this program {self.limit / self.wanted:.2f}x XLA's figure)")
        need = (f"needs {mb(self.needed)} by XLA's figure as written" if self.by == "XLA"
                else f"needs {self.by} {mb(self.needed)} by the memory model")
        parts = f"arguments and variables {mb(self.arguments)}, results {mb(self.results)}"
        if self.whole is not None and self.floor > self.wanted:
            # (what the splitter said of its regions is beside the point: this op alone is over)
            io = (f"; with the arguments and results ({parts}), {mb(self.floor)}"
                  if self.floor >= 1.05 * self.whole.bytes else "")
            return (f"`{self.program}` {need}{then}, over its limit of {mb(self.wanted)}{scaled}: "
                    f"{self.whole.render()}{io}. No rewrite inside it can bring it under. It will run as well as it "
                    f"can; raise memory_limit well above {mb(self.floor)} (XLA's solver needs scratch beside it), or "
                    "compute that op on smaller matrices.")
        head = f"`{self.program}` {need}{then}, over its limit of {mb(self.wanted)}{scaled}, and {self.what}."
        io = self.arguments + self.results
        if io > self.wanted:
            return (f"{head} Its arguments and results alone are {mb(io)} ({parts}), over the limit: no "
                    f"rewrite inside it can bring it under. It will run as well as it can; raise memory_limit above "
                    f"{mb(io)}, or have it take or return less (smaller batches, results in parts).")
        tight = (f" Its arguments and results alone are {mb(io)} ({parts}), leaving "
                 f"{mb(self.wanted - io)} for everything else." if io >= self.wanted / 2 else "")
        return (f"{head}{tight} It will run as well as it can; raise memory_limit, or rewrite that op's input in "
                "smaller pieces.")
