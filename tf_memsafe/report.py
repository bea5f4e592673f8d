"""``explain(fn, *args)``: what tf_memsafe does to one function, and the memory it saves.

:func:`explain` compiles (never runs) ``fn`` twice on the given arguments:

* "before": traced with the hook suspended, the program exactly as written;
* "after": traced afresh under the options in force in this thread, through the hook, which
  leaves a :class:`~tf_memsafe.hook.TraceReport` with every pass's :class:`~grappler_ext.pass_base.Record`.

Both figures are XLA's "Total bytes used" (:func:`tf_memsafe.memory_footprint`).  The user's own
``tf.function`` keeps its trace cache untouched.  If tf_memsafe is not enabled, the hook is
installed for the "after" trace only and uninstalled afterwards; meanwhile :func:`tf_memsafe.enable`
and :func:`tf_memsafe.disable` in other threads wait, and traces other threads make in that window
are rewritten too (the hook is process-wide).

The :class:`Report` is built from the pass records; ``str(report)`` is a table to read at a
glance, ``report.to_dict()`` plain JSON-ready data.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from grappler_ext.pass_base import Record
from tf_memsafe import config, hook
from tf_memsafe.memory import _fresh_function, memory_footprint
from tf_memsafe.relayout_plan import RelayoutPlan
from tf_memsafe.units import format_bytes

__all__ = ["Report", "explain", "format_records", "RelayoutReport"]

# At most this many op names per record in the table; the rest are counted ("+3 more").
MAX_OPS_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class Report:
    """What tf_memsafe did to one function, measured.

    Attributes:
      function_name: the Python function's name.
      memory_limit_bytes: the limit the pipeline used, resolved for the device, in bytes.
      footprint_before_bytes: XLA's "Total bytes used" for the function as written.
      footprint_after_bytes: the same figure with tf_memsafe's rewrites applied.
      status: the hook's status for the trace: ``"rewritten"``, ``"unchanged"``, ``"skipped"`` or
        ``"failed"`` (see :class:`~tf_memsafe.hook.TraceReport`).
      reason: one line saying why, for every status but ``"rewritten"``.
      code: the same as a :class:`~tf_memsafe.hook.TraceCode` (``None``: the hook saw no trace of it).
      records: every pass's records for the trace, in the order the passes ran.
      compile_before_seconds, compile_after_seconds: the time to trace and compile (not run) the
        function as written and with the rewrites (the second includes the passes).
      rewrite_seconds: of that second figure, the time the passes took (with the programs they had
        XLA compile to measure).
    """

    function_name: str
    memory_limit_bytes: int
    footprint_before_bytes: int
    footprint_after_bytes: int
    status: str
    reason: str = ""
    records: tuple[Record, ...] = ()
    compile_before_seconds: float | None = None
    compile_after_seconds: float | None = None
    rewrite_seconds: float | None = None
    code: hook.TraceCode | None = None

    def __post_init__(self):
        object.__setattr__(self, "records", tuple(self.records))

    @property
    def within_limit(self) -> bool:
        """Whether the rewritten program fits the limit."""
        return self.footprint_after_bytes <= self.memory_limit_bytes

    @property
    def rewritten(self) -> list[Record]:
        return [r for r in self.records if r.action == "rewritten"]

    def to_dict(self) -> dict:
        """Plain JSON-serialisable data (``within_limit`` included); :meth:`from_dict` inverts it."""
        out = dataclasses.asdict(self)
        out["records"] = [{**r.to_dict(), "ops": list(r.ops)} for r in self.records]
        out["within_limit"] = self.within_limit
        out["code"] = None if self.code is None else self.code.value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["records"] = tuple(Record(**{**r, "ops": tuple(r["ops"])}) for r in data.get("records", ()))
        if kwargs.get("code") is not None:
            kwargs["code"] = hook.TraceCode(kwargs["code"])
        return cls(**kwargs)

    def __str__(self) -> str:
        before, after = self.footprint_before_bytes, self.footprint_after_bytes
        over = after - self.memory_limit_bytes
        verdict = (f"within the limit ({format_bytes(-over)} to spare)" if over <= 0
                   else f"OVER the limit by {format_bytes(over)}")
        status = self.status + (f": {self.reason}" if self.reason else "")
        if self.status == "rewritten":
            n = len(self.rewritten)
            status += f": {n} rewrite{'' if n == 1 else 's'}"
        lines = [
            f"tf_memsafe: {self.function_name}  (limit {format_bytes(self.memory_limit_bytes)})",
            f"  footprint  {format_bytes(before)} -> {format_bytes(after)}   {verdict}",
            f"  status     {status}",
        ]
        if self.compile_before_seconds is not None and self.compile_after_seconds is not None:
            passes = "" if self.rewrite_seconds is None else f" (the passes {self.rewrite_seconds:.2f} s)"
            lines.append(f"  time       trace + compile {self.compile_before_seconds:.2f} s as written, "
                         f"{self.compile_after_seconds:.2f} s rewritten{passes}; nothing run")
        lines += ["  " + line for line in format_records(self.records)]
        return "\n".join(lines)


def _format_ops(ops: Sequence[str]) -> str:
    if not ops:
        return "-"
    shown = ", ".join(ops[:MAX_OPS_SHOWN])
    return shown + (f" +{len(ops) - MAX_OPS_SHOWN} more" if len(ops) > MAX_OPS_SHOWN else "")


def _format_record_bytes(record: Record) -> str:
    if record.bytes_before is None and record.bytes_after is None:
        return "-"
    if record.action == "skipped" and record.bytes_after is None:  # left alone: nothing "after"
        return format_bytes(record.bytes_before)
    return f"{format_bytes(record.bytes_before)} -> {format_bytes(record.bytes_after)}"


def format_records(records: Sequence[Record]) -> list[str]:
    """The records as an aligned table, a header line first; ``["(no pass records)"]`` if none.

    Columns: pass, action, bytes before -> after ("-" when unknown, "?" for one unknown side, the
    bytes before alone for a skip),
    ops (at most :data:`MAX_OPS_SHOWN` names), reason.  Lines carry no trailing spaces.
    """
    if not records:
        return ["(no pass records)"]
    rows = [("pass", "action", "bytes before -> after", "ops", "reason")]
    rows += [(r.pass_name, r.action, _format_record_bytes(r), _format_ops(r.ops), r.reason) for r in records]
    return align_columns(rows)


def align_columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as lines: every column but the last padded to its widest cell, two spaces
    between columns, no trailing spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows]


def _function_name(fn) -> str:
    python_fn = getattr(fn, "python_function", fn)
    return getattr(python_fn, "__name__", None) or type(python_fn).__name__


def explain(fn, *args, **kwargs) -> Report:
    """Measure ``fn`` on these arguments before and after tf_memsafe's rewrites, and say why.

    Args:
      fn: a ``tf.function`` or a plain callable (traced anew with ``jit_compile=True``).
      *args, **kwargs: the arguments to compile for (tensors, variables or ``tf.TensorSpec``s).

    Returns:
      A :class:`Report`; ``print(report)`` shows the table.

    Works whether or not tf_memsafe is enabled, under the options in force in this thread
    (``with tf_memsafe.options(...)`` applies).  Nothing is run and the user's function is not
    traced.  With ``strict=True`` a failing pass raises :class:`~tf_memsafe.errors.RewriteError`.
    """
    _fresh_function(fn)  # reject a non-callable before compiling anything
    start = time.perf_counter()
    before = memory_footprint(fn, *args, rewrite=False, **kwargs)
    middle = time.perf_counter()
    mark = hook.report_mark()
    with hook.active_in_this_thread():
        after = memory_footprint(fn, *args, rewrite=True, **kwargs)
    end = time.perf_counter()
    # (a first trace that created variables is traced again and never compiled: not the function's)
    traces = [t for t in hook.reports_since(mark) if not t.retraced]
    timed = [t.rewrite_seconds for t in traces if t.rewrite_seconds is not None]
    records = tuple(rec for t in traces for rec in t.records)
    # The function's own trace comes first; functions it calls may add more.
    failed = [t for t in traces if t.status == "failed"]
    if failed:
        status, reason, code = "failed", failed[0].reason, failed[0].code
    elif any(t.status == "rewritten" for t in traces):
        status, reason, code = "rewritten", "", hook.TraceCode.REWRITTEN
    elif traces:
        status, reason, code = traces[0].status, traces[0].reason, traces[0].code
    else:
        status, reason, code = "skipped", "the hook saw no trace of the function", None
    limit = next((t.memory_limit_bytes for t in traces if t.memory_limit_bytes is not None), None)
    if limit is None:
        limit = hook.limit_bytes(config.current())
    return Report(_function_name(fn), limit, before, after, status, reason, records, middle - start, end - middle,
                  sum(timed) if timed else None, code)


def _layout_text(specs) -> str:
    return "(" + ", ".join(a if a is not None else "-" for a in specs) + ")"


def _collective_text(c) -> str:
    if c.source_dim is None:
        return f"{c.kind.value} along {c.axis} (dimension {c.target_dim})"
    if c.target_dim is None:
        return f"{c.kind.value} over {c.axis} (dimension {c.source_dim})"
    return f"{c.kind.value} over {c.axis} (dimension {c.source_dim} -> {c.target_dim})"


@dataclasses.dataclass(frozen=True)
class RelayoutReport:
    """What :func:`tf_memsafe.relayout` does with one tensor and layout: ``print`` it, or
    ``to_dict()``; ``plan`` is the :class:`~tf_memsafe.relayout_plan.RelayoutPlan` itself."""

    plan: RelayoutPlan
    dtype: str

    def to_dict(self) -> dict:
        p = self.plan
        return {"shape": list(p.shape), "dtype": self.dtype,
                "mesh": dict(zip(p.mesh.names, p.mesh.sizes)), "source": list(p.source), "target": list(p.target),
                "collectives": [{"kind": c.kind.value, "axis": c.axis, "source_dim": c.source_dim,
                                 "target_dim": c.target_dim} for c in p.collectives],
                "peak_bytes": p.peak_bytes, "bound_bytes": p.bound_bytes, "received_bytes": p.received_bytes,
                "peak_over_bound": p.peak_over_bound}

    def __str__(self) -> str:
        p = self.plan
        mesh = ", ".join(f"{n}={s}" for n, s in zip(p.mesh.names, p.mesh.sizes))
        head = (f"tf_memsafe.relayout {self.dtype}[{','.join(map(str, p.shape))}] on mesh {mesh}: "
                f"{_layout_text(p.source)} -> {_layout_text(p.target)}")
        if p.identity:
            return head + "\n  the layouts are equal: the tensor is returned as it is"
        kept = sum(a.reuse for a in p.assemblies)
        steps = ", ".join(_collective_text(c) for c in p.collectives)
        lines = [head,
                 f"  amounts to  {steps}",
                 f"  each device builds its shard in one program: {format_bytes(p.target_shard_bytes)} "
                 f"allocated, at most {format_bytes(p.received_bytes)} read from other devices"
                 + (f"; {kept} of {len(p.assemblies)} keep their source shard" if kept else ""),
                 f"  peak        {format_bytes(p.peak_bytes)} per device; bound (the larger shard) "
                 f"{format_bytes(p.bound_bytes)}: {p.peak_over_bound:.2f}x"]
        return "\n".join(lines)
