"""Measurement behind a protocol: XLA's figure for a program, given by whoever composes the pipeline.

    program_bytes(graph)        XLA's "Total bytes used" for a function's graph as it stands (compiled, never run)
    function_bytes(fn, specs)   the same for ``fn`` (a ``tf.function(jit_compile=True)``) compiled for ``specs``:
                                a loop alone, whose figures size its chunk (``program_bytes`` judges the plan)

``grappler_ext`` does not compile anything itself: ``tf_memsafe`` (the composition root, which owns
``XLA_FLAGS`` and so the reports XLA writes) builds the pipeline with its implementation
(``tf_memsafe.memory.XlaMeasurer``), and tests pass a fake returning chosen figures.  A splitter
built without a measurer plans by the memory model alone, and the pipeline's memory guard
(:mod:`grappler_ext.guard`) then judges by the model alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import tensorflow as tf

from grappler_ext import graph_edit, shapes

__all__ = ["Measurer", "Figure", "program_figure"]


@runtime_checkable
class Measurer(Protocol):
    """XLA's figures for programs, compiled and never run; each may raise where XLA cannot say."""

    def program_bytes(self, graph) -> int:
        """XLA's "Total bytes used" for ``graph`` (a ``FuncGraph``) as it stands now."""

    def function_bytes(self, fn, specs: Sequence[tf.TensorSpec]) -> int:
        """XLA's "Total bytes used" for ``fn`` compiled for ``specs``: a loop built alone to size its
        chunk (:func:`grappler_ext.splitter.mechanism.loop_figure`); the program as split is then judged
        by :meth:`program_bytes`.  A measurer may compile it in a faster mode that keeps its buffers
        (``tf_memsafe``'s compiles it without XLA:CPU's fusion emitters)."""


@dataclasses.dataclass(frozen=True)
class Figure:
    """XLA's figure for a program, or why there is none.

    ``bytes`` is the figure; ``None`` when it was not asked for (no measurer, or
    ``Options.check_programs`` off) or when measuring failed (``failure``: the error, one line).
    """

    bytes: int | None = None
    failure: str = ""

    @property
    def known(self) -> bool:
        return self.bytes is not None

    def over(self, limit: int) -> bool:
        """Known and over ``limit``."""
        return self.bytes is not None and self.bytes > limit

    def note(self) -> str:
        """What a record says of it after the model's count: "; XLA's figure N B", the failure, or nothing."""
        if self.bytes is not None:
            return f"; XLA's figure {self.bytes:,} B"
        return f"; not checked with XLA: {self.failure}" if self.failure else ""


def program_figure_later(measurer: Measurer | None, graph) -> Callable[[], Figure] | None:
    """XLA's figure for ``graph`` as it stands now, compiled when the result is called (the graph may
    change in between), where ``measurer`` can copy a program to compile later
    (``program_bytes_later(graph)``, optional in :class:`Measurer`); else ``None``."""
    later = getattr(measurer, "program_bytes_later", None)
    if later is None:
        return None
    try:
        copy = later(graph)
    except Exception as e:  # noqa: BLE001 - the figure says why, when asked
        failed = _failed(e)
        return lambda: failed

    def figure() -> Figure:
        try:
            return Figure(copy())
        except Exception as e:  # noqa: BLE001 - the model's word stands; the record says why
            return _failed(e)
    return figure


def _failed(e: Exception) -> Figure:
    return Figure(failure=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")


_MEMO = "_grappler_ext_figure"     # on a graph: (measurer, journal, version, nominal size, Figure) of its last measure


def program_figure(measurer: Measurer | None, graph) -> Figure:
    """XLA's figure for ``graph`` as it stands, by ``measurer`` (``Figure()`` without one).

    Within a journaled run (a pipeline's), a graph not edited since it was last measured by the same
    measurer is not compiled again: the pipeline's guard and the splitter both ask for the program
    as traced."""
    if measurer is None:
        return Figure()
    journal = graph_edit.active_journal()
    memo = getattr(graph, _MEMO, None)
    size = shapes.nominal_key()
    if (journal is not None and memo is not None and memo[0] is measurer and memo[1] is journal
            and memo[2] == journal.version and memo[3] == size):
        return memo[4]
    try:
        figure = Figure(measurer.program_bytes(graph))
    except Exception as e:  # noqa: BLE001 - the model's word stands; the record says why
        figure = _failed(e)
    if journal is not None:
        setattr(graph, _MEMO, (measurer, journal, journal.version, size, figure))
    return figure
