"""What a pass is: a name and ``run(graph, options) -> PassResult``.

XLA's ``HloPassInterface::Run`` returns whether the module changed; torch.fx returns
``PassResult(graph, modified)``.  Ours also lists every place a pass rewrote and every place it
looked at and left alone, each a :class:`Record` with the ops involved, bytes before and after and
a one-line reason.  ``tf_memsafe.explain()`` is built from these records; nobody writes a report
by hand.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import enum
import warnings
from collections.abc import Iterator
from typing import ClassVar, Literal

__all__ = ["Record", "PassResult", "GraphPass", "PassOptions", "ShardedAxis", "Motive", "REWRITTEN", "SKIPPED",
           "warn", "deferred_warnings", "pending_warnings"]

# The warnings passes give inside a pipeline's run, given when it ends (``None``: outside one).
_DEFERRED: contextvars.ContextVar[list | None] = contextvars.ContextVar("grappler_ext_deferred_warnings",
                                                                        default=None)


def warn(message: str, stacklevel: int = 2) -> None:
    """A pass's warning to the user (``"tf_memsafe: ..."``): given now, or, inside a pipeline's run
    (:func:`deferred_warnings`), when the run ends, where the pipeline checks that it still holds (a
    later pass may have brought the program within its limit)."""
    pending = _DEFERRED.get()
    if pending is None:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    else:
        pending.append(message)


def pending_warnings() -> list[str]:
    """The warnings collected so far in the pipeline's run (empty outside one)."""
    return list(_DEFERRED.get() or [])


@contextlib.contextmanager
def deferred_warnings() -> Iterator[list[str]]:
    """Collect the passes' warnings (:func:`warn`) given inside the block, in order, instead of giving them."""
    token = _DEFERRED.set([])
    try:
        yield _DEFERRED.get()
    finally:
        _DEFERRED.reset(token)

REWRITTEN: Literal["rewritten"] = "rewritten"
SKIPPED: Literal["skipped"] = "skipped"


@dataclasses.dataclass(frozen=True)
class Record:
    """One place a pass rewrote (``action == "rewritten"``) or left alone (``"skipped"``).

    Attributes:
      pass_name: the pass that wrote the record.
      action: ``"rewritten"`` or ``"skipped"``.
      ops: names of the ops involved (the matched region, or the op to blame).
      reason: one line a person reads ("cannot split through `Cholesky`: no rule").
      bytes_before: bytes of the region before the rewrite, if known.
      bytes_after: bytes after the rewrite, if known.
      code: what was decided, as a value of the pass's own code enum (a ``str`` enum, so it equals its
        value after a JSON round trip); code that needs the decision reads this, never ``reason``.
      plan: the pass's frozen plan behind the record, where it has one (the splitter's loops, and its
        growth of starved gradient loops).
    """

    pass_name: str
    action: Literal["rewritten", "skipped"]
    ops: tuple[str, ...]
    reason: str
    bytes_before: int | None = None
    bytes_after: int | None = None
    code: enum.Enum | str | None = None
    plan: object | None = None

    def __post_init__(self):
        if self.action not in (REWRITTEN, SKIPPED):
            raise ValueError(f"Record.action must be 'rewritten' or 'skipped', got {self.action!r}")
        if "\n" in self.reason:
            raise ValueError("Record.reason must be one line")

    def to_dict(self) -> dict:
        """Plain JSON-ready data: the code as its value, the plan as a dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["code"] = self.code.value if isinstance(self.code, enum.Enum) else self.code
        out["plan"] = dataclasses.asdict(self.plan) if dataclasses.is_dataclass(self.plan) else self.plan
        return out


@dataclasses.dataclass
class PassResult:
    """The outcome of one run of one pass."""

    pass_name: str
    records: list[Record] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(r.action == REWRITTEN for r in self.records)

    @property
    def rewritten(self) -> list[Record]:
        return [r for r in self.records if r.action == REWRITTEN]

    @property
    def skipped(self) -> list[Record]:
        return [r for r in self.records if r.action == SKIPPED]

    def rewrote(self, ops, reason: str, bytes_before: int | None = None,
                bytes_after: int | None = None, code=None, plan=None) -> Record:
        return self._add(REWRITTEN, ops, reason, bytes_before, bytes_after, code, plan)

    def skip(self, ops, reason: str, bytes_before: int | None = None, code=None, plan=None) -> Record:
        return self._add(SKIPPED, ops, reason, bytes_before, None, code, plan)

    def _add(self, action, ops, reason, bytes_before, bytes_after, code, plan) -> Record:
        names = tuple(o if isinstance(o, str) else o.name for o in ops)
        record = Record(self.pass_name, action, names, reason, bytes_before, bytes_after, code, plan)
        self.records.append(record)
        return record


@dataclasses.dataclass(frozen=True)
class ShardedAxis:
    """An axis of one of the function's inputs that a device mesh shards (DTensor): each device holds a
    block of it.  ``placeholder`` names the input's placeholder in the traced graph (for a variable, its
    resource handle's, and the axis is its value's)."""

    placeholder: str
    axis: int
    mesh_axis: str


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """What the passes and the pipeline read, typed: every pass receives one of these (or of a
    subclass: ``tf_memsafe.Options`` adds the user-facing fields) and reads its fields directly.

    Attributes:
      memory_limit_bytes: the limit on XLA's "Total bytes used" of each program, in bytes; ``None``
        (no limit known) makes the memory-driven passes skip.
      disabled_passes: names of passes the pipeline does not run.
      verify: run the verifier after every pass.
      max_fixed_point_iterations: cap on repetitions of the pipeline while a pass changes the graph.
      dump_dir: where the pipeline writes the printed graph before and after each pass, if set.
      calibrate_chunks: let the splitter size loops from XLA's figure for them (with a measurer).
      check_programs: let the splitter check programs with XLA's figure (with a measurer).
      redraw_random: let the splitter draw random values again slice by slice.
      sharded_inputs: the inputs' axes a device mesh shards, for the one trace being rewritten (set by
        the caller that knows the call's arguments, never by users): no loop slices along them.
      xla_compiled: whether XLA compiles the trace being rewritten (set by the caller that knows, never
        by users): where TensorFlow's kernels and XLA's differ, a pass builds the form of the one that runs.
      checked_at_run: the caller checks the program by XLA's figure at each shape it runs at (set by the
        caller that does, never by users): a program with run-time sizes that no plan split is not
        warned about before it runs, where its sizes are not known.
    """

    memory_limit_bytes: int | None = None
    disabled_passes: frozenset[str] = frozenset()
    verify: bool = False
    max_fixed_point_iterations: int = 4
    dump_dir: str | None = None
    calibrate_chunks: bool = True
    check_programs: bool = True
    redraw_random: bool = False
    sharded_inputs: tuple[ShardedAxis, ...] = ()
    xla_compiled: bool = True
    checked_at_run: bool = False


class Motive(enum.Enum):
    """Why a pass rewrites, which decides when the pipeline lets it (:mod:`grappler_ext.guard`)."""

    MEMORY = "memory"      # fewer bytes: runs only on a program over its limit, undone if its figure rises
    FLOPS = "flops"        # fewer FLOPs by a proven margin: runs whatever the limit
    TIME = "time"          # faster by a measured margin, within the limit by its own count: runs whatever the limit
    COMPILE = "compile"    # less work for XLA's compiler (a constant it would fold): runs whatever the limit
    LIMIT = "limit"        # meets the limit and judges its own plans (the splitter)


class GraphPass(abc.ABC):
    """A named graph transformation.

    Subclasses set ``name`` (the same short name as their module, their option and their label in
    ``explain()``) and ``motive`` (:class:`Motive`; by default memory, the guarded kind), and
    implement :meth:`run`.  A pass analyses, plans and builds its new ops first
    and rewires consumers last, only through :mod:`grappler_ext.graph_edit`, whose journal lets the
    pipeline undo the whole run if this or a later pass fails.
    """

    name: ClassVar[str]
    motive: ClassVar[Motive] = Motive.MEMORY
    # A memory rewrite that costs run time (more FLOPs than the program as written): kept only where it
    # brings the program within its limit, or its figure a good share lower (:meth:`Guard.compare`).
    slower: ClassVar[bool] = False

    @abc.abstractmethod
    def run(self, graph, options) -> PassResult:
        """Rewrite ``graph`` in place; say what was done and what was not."""

    def __repr__(self) -> str:
        return f"<pass {self.name}>"
