"""The pass pipeline: an ordered, named list of passes, a verifier and an undo journal.

Modelled on XLA's ``HloPassPipeline`` and ``HloPassFix``:

* passes run in order; any of them can be disabled by name (``Options.disabled_passes``);
* the whole list repeats while some pass still changes the graph, up to
  ``Options.max_fixed_point_iterations`` times (1 = run once);
* with ``Options.verify`` the verifier runs after every pass, and a pass that reports "unchanged"
  must not have edited the graph;
* every edit goes to one journal; if a pass raises or the verifier fails, the journal is undone,
  so the graph computes exactly what it computed when traced, and a :class:`RewriteError` names
  the failing pass and the passes before it;
* ``Options.dump_dir`` receives the printed graph before and after each pass;
* a :class:`~grappler_ext.guard.Guard` decides around every pass whose motive is memory: it does
  not run on a program within its limit as traced, and its edits are undone where the program's
  figure rises with them (each with a record in the pass's name saying so).

Passes register themselves with :func:`register_pass`; :data:`DEFAULT_ORDER` fixes where each
one sits.  A pass module states its place and why in its docstring.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import warnings
from collections.abc import Mapping, Sequence

from grappler_ext.graph_edit import Journal, journaled
from grappler_ext.guard import Code as GuardCode
from grappler_ext.guard import Guard, Verdict
from grappler_ext.pass_base import GraphPass, Motive, PassResult, Record, deferred_warnings, pending_warnings, warn
from grappler_ext.verifier import OutputSignature, VerificationError, verify

__all__ = ["Pipeline", "PipelineResult", "PipelineError", "register_pass", "registered_passes",
           "default_pipeline", "DEFAULT_ORDER"]

# The product's pass order.  Rewrites that make patterns cheaper run before the splitter, which
# must see the cheapest form of each region; packed_cholesky before it too, on a kernel matrix's
# factor (coupled whole: nothing the splitter could split); blocked_linalg and blocked_top_k after
# it, on the factorisations, solves and top-k's it left whole (it builds the split ones' slices itself).
DEFAULT_ORDER: tuple[str, ...] = ("random_key", "constant_cumsum", "pairwise_distance", "unrolled_reduction",
                                  "reduce_of_product", "matrix_chain", "packed_cholesky", "splitter", "blocked_linalg",
                                  "blocked_top_k")

_REGISTRY: dict[str, type[GraphPass]] = {}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Class decorator: make a pass known by its ``name`` (one name per pass)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"pass {cls.__qualname__} needs a snake_case `name`, got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"two passes are named {name!r}: {_REGISTRY[name].__qualname__} and {cls.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def registered_passes() -> dict[str, type[GraphPass]]:
    return dict(_REGISTRY)


class PipelineError(Exception):
    """A pass raised or broke the verifier; the graph has been restored.

    Attributes: ``pass_name``, ``previous_passes`` (those that ran before it in this run), ``cause``.
    """

    def __init__(self, pass_name: str, previous_passes: Sequence[str], cause: BaseException):
        before = ", ".join(previous_passes) if previous_passes else "none"
        kind = "broke the verifier" if isinstance(cause, VerificationError) else "failed"
        super().__init__(f"pass '{pass_name}' {kind} (passes before it: {before}): "
                         f"{type(cause).__name__}: {cause}")
        self.pass_name = pass_name
        self.previous_passes = tuple(previous_passes)
        self.cause = cause


@dataclasses.dataclass
class PipelineResult:
    """What one pipeline run did to one graph."""

    results: list[PassResult] = dataclasses.field(default_factory=list)
    iterations: int = 0
    reached_fixed_point: bool = True
    warnings: list[str] = dataclasses.field(default_factory=list)   # the passes' warnings, as given at the end

    @property
    def changed(self) -> bool:
        return any(r.changed for r in self.results)

    @property
    def records(self) -> list[Record]:
        return [rec for r in self.results for rec in r.records]


@dataclasses.dataclass
class _GuardedRun:
    """The guard's state for one pipeline run: its verdict on the program before the first memory
    pass (``judged`` once), and the passes already told that it fits."""

    verdict: Verdict | None = None
    judged: bool = False
    told: set = dataclasses.field(default_factory=set)


class Pipeline:
    """An ordered list of passes run over a graph (see the module docstring)."""

    def __init__(self, passes: Sequence[GraphPass], guard: Guard | None = None):
        names = [p.name for p in passes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pass(es) {dupes} appear twice in the pipeline")
        if guard is not None and not isinstance(guard, Guard):
            raise TypeError(f"guard must be a grappler_ext.guard.Guard, got {type(guard).__name__}")
        self.passes = tuple(passes)
        self.guard = guard or Guard()      # without a measurer: the memory model alone

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def run(self, graph, options) -> PipelineResult:
        """Run the passes on ``graph`` in place; on failure restore it and raise PipelineError."""
        unknown = sorted(set(options.disabled_passes) - set(self.names) - set(_REGISTRY))
        if unknown:
            warnings.warn(f"tf_memsafe: disabled_passes names unknown pass(es) {unknown}; known passes: "
                          f"{sorted(set(self.names) | set(_REGISTRY))}", stacklevel=2)
        active = [p for p in self.passes if p.name not in options.disabled_passes]
        result = PipelineResult()
        signature = OutputSignature.of(graph)
        journal = Journal()
        ran: list[str] = []
        step = 0
        guarded = _GuardedRun()
        # Each pass's warnings from the first run in which it warned (later runs see the program with
        # the rewrites made after it, its own and others': a second warning about the same program),
        # and where they were given: (results so far, pass).
        said: dict[str, list[str]] = {}
        said_by: tuple[int, str] | None = None
        with journaled(journal), deferred_warnings() as pending:
            for _ in range(options.max_fixed_point_iterations):
                result.iterations += 1
                changed = False
                for p in active:
                    step += 1
                    self._dump(graph, options, step, p.name, "before")
                    edits_before = len(journal)
                    said_before = len(pending)
                    try:
                        if p.motive is Motive.MEMORY:
                            pass_result = self._guarded(p, graph, options, journal, guarded)
                        else:
                            pass_result = p.run(graph, options)
                        if not isinstance(pass_result, PassResult):
                            raise TypeError(f"run() returned {type(pass_result).__name__}, not PassResult")
                        if options.verify:
                            if not pass_result.changed and len(journal) != edits_before:
                                raise VerificationError("pass reported no rewrite but edited the graph")
                            verify(graph, signature)
                    except Exception as e:  # noqa: BLE001 - fail open: any pass error is reported
                        journal.undo()
                        raise PipelineError(p.name, ran, e) from e
                    self._dump(graph, options, step, p.name, "after")
                    ran.append(p.name)
                    result.results.append(pass_result)
                    changed |= pass_result.changed
                    if len(pending) > said_before and p.name not in said:
                        said[p.name] = pending[said_before:]
                        said_by = (len(result.results), p.name)
                if not changed:
                    break
            else:
                # Every iteration changed the graph.  With a cap of 1 ("run once") that is the request,
                # not a missed fixed point.
                result.reached_fixed_point = options.max_fixed_point_iterations == 1
            messages = list(dict.fromkeys(m for ms in said.values() for m in ms))
            if messages and said_by is not None:
                messages = self._still_holding(graph, options, result, said_by, messages)
        result.warnings = list(messages)
        for message in messages:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return result

    def _still_holding(self, graph, options, result: PipelineResult, said_by: tuple[int, str],
                       messages: list[str]) -> list[str]:
        """The passes' warnings as they hold when the run ends.  Where a later pass changed the program
        (``blocked_linalg`` after the splitter's best effort), XLA's figure for it decides: within the
        limit, they are withdrawn and a record in the warning pass's name says so; over it, each says
        the program's figure now."""
        after, by = said_by
        later = sorted({r.pass_name for r in result.results[after:] if r.changed})
        limit = getattr(options, "memory_limit_bytes", None)
        if not later or limit is None or not self.guard.measures(options):
            return messages
        figure = self.guard.standing(graph, options).xla
        if not figure.known:
            return messages
        if figure.bytes > limit:
            return [f"{m} (After {', '.join(later)}: {figure.bytes:,} B by XLA's figure.)" for m in messages]
        note = PassResult(by)
        note.skip([], f"its warning withdrawn: after {', '.join(later)}, XLA's figure for the program is "
                      f"{figure.bytes:,} B, within the limit of {limit:,} B", code=GuardCode.WITHDRAWN)
        result.results.append(note)
        return []

    def _guarded(self, p: GraphPass, graph, options, journal: Journal, run: _GuardedRun) -> PassResult:
        """``p.run`` as the guard allows: not on a program within its limit as traced; undone where
        the program's figure rose with it (:mod:`grappler_ext.guard`)."""
        if not run.judged:
            # Judged now where the memory model decides alone; where XLA's figure must, once a pass
            # has changed the program (most find nothing to rewrite: no compile then).
            verdict = self.guard.verdict(graph, options, measure=False)
            if verdict is None or verdict.decided:
                run.verdict, run.judged = verdict, True
        if run.judged and run.verdict is not None and run.verdict.fits:
            return self._fits(p, run)
        measures = self.guard.measures(options)
        before = None if measures else self.guard.standing(graph, options)
        mark = len(journal)
        result = p.run(graph, options)
        if not isinstance(result, PassResult) or not result.changed:
            return result
        if not run.judged:
            # The program as traced judged now, the pass's edits undone; run again if it may.
            journal.undo(to=mark)
            run.verdict, run.judged = self.guard.verdict(graph, options), True
            if run.verdict is not None and run.verdict.fits:
                return self._fits(p, run)
            result = p.run(graph, options)
        after = self.guard.standing(graph, options)
        if measures:
            # XLA's figure before the pass: its edits undone to compile the program as it was.
            journal.undo(to=mark)
            before = self.guard.standing(graph, options)
        worse = self.guard.compare(before, after, options.memory_limit_bytes, p.slower)
        if worse is None:
            # Kept: run again where it was undone to measure (the same graph, the same decisions).
            kept = p.run(graph, options) if measures else result
            self._over_after(p, graph, options, after, kept)
            return kept
        if not measures:
            journal.undo(to=mark)
        undone = PassResult(p.name)
        ops = sorted({name for r in result.rewritten for name in r.ops})
        undone.skip(ops, f"undone: {worse}; {len(result.rewritten)} rewrite(s) by its own count "
                         f"({'; '.join(r.reason for r in result.rewritten)[:300]})", code=GuardCode.ROSE, plan=worse)
        return undone

    @staticmethod
    def _over_after(p: GraphPass, graph, options, after, result: PassResult) -> None:
        """A memory rewrite kept with XLA's figure for the program still over the limit, and no
        warning given yet this run: one now (pending: a later pass may still bring it within, which
        :meth:`_still_holding` checks), so that a program is never over its limit silently."""
        limit = options.memory_limit_bytes
        if limit is None or not after.xla.known or after.xla.bytes <= limit or pending_warnings():
            return
        what = "; ".join(r.reason for r in result.rewritten)
        warn(f"tf_memsafe: `{graph.name}` needs {after.xla.bytes:,} B by XLA's figure after {p.name} ({what}), "
             f"over its limit of {limit:,} B. It will run as well as it can; raise memory_limit to at least "
             f"{after.xla.bytes:,} B.", stacklevel=4)

    @staticmethod
    def _fits(p: GraphPass, run: _GuardedRun) -> PassResult:
        """``p`` left alone on a program within its limit as traced: said once a run."""
        result = PassResult(p.name)
        if p.name not in run.told:
            run.told.add(p.name)
            result.skip([], f"left alone: the program is within its limit as traced ({run.verdict.reason}); "
                            "rewrites made for memory change only programs over it", code=GuardCode.FITS)
        return result

    @staticmethod
    def _dump(graph, options, step: int, pass_name: str, when: str) -> None:
        if not options.dump_dir:
            return
        from grappler_ext.printer import format_graph

        folder = os.path.join(options.dump_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", graph.name))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{step:03d}_{pass_name}_{when}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(format_graph(graph))


def default_pipeline(instances: Mapping[str, GraphPass] | None = None, guard: Guard | None = None) -> Pipeline:
    """The product's pipeline: every pass of :data:`DEFAULT_ORDER`, in that order.

    A pass named ``x`` lives in the module ``grappler_ext.x``; importing it registers it.  Passes are
    built with no arguments, except those given in ``instances`` (by name): the composition root
    hands in the passes it builds with their dependencies (``tf_memsafe`` gives the splitter XLA's
    measurer), and the guard it builds with the same measurer (default: the memory model alone).
    """
    instances = dict(instances or {})
    for name in DEFAULT_ORDER:
        importlib.import_module(f"grappler_ext.{name}")
    missing = [n for n in DEFAULT_ORDER if n not in _REGISTRY]
    if missing:
        raise RuntimeError(f"DEFAULT_ORDER names unregistered pass(es) {missing}")
    unknown = sorted(set(instances) - set(DEFAULT_ORDER))
    if unknown:
        raise ValueError(f"no pass named {unknown} in the default pipeline; its passes: {list(DEFAULT_ORDER)}")
    for name, instance in instances.items():
        if not isinstance(instance, _REGISTRY[name]):
            raise TypeError(f"the pass given for {name!r} is a {type(instance).__name__}, not a "
                            f"{_REGISTRY[name].__name__}")
    return Pipeline([instances.get(n) or _REGISTRY[n]() for n in DEFAULT_ORDER], guard=guard)
