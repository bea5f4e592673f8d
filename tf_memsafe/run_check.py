"""Each shape a function with run-time sizes runs at, checked by XLA's figure when it first runs there.

A function whose inputs have dimensions known only at run time (a ``None`` in its ``input_signature``,
Keras' ``fit`` on ``tf.data`` batches) is planned at one nominal size (``grappler_ext.splitter.nominal``)
and judged there, or left as traced where no plan split it.  XLA compiles it again for every concrete
shape it runs at, and at sizes larger than the nominal ones what no loop splits (the inputs, a batch's
logits kept whole by a loop along the sequence) grows past the limit: keras.io's miniature GPT under
256 MB was planned at a batch of 4 and compiled at the run's batch of 8 to 281 MB, with nothing said.
So every call of such a function goes through :func:`on_call` (TensorFlow's
``ConcreteFunction._call_flat``, see :func:`tf_memsafe._tf_internals.install_call_check`):

* called from Python, its arguments' shapes are read and checked before it runs;
* called from a function being traced that TensorFlow runs op by op (Keras' ``fit`` runs its
  jit-compiled step so), an op that runs Python (``tf.py_function``) is given the arguments' shapes and
  the call waits for it, so each step's shapes are checked before the step runs;
* called from a function XLA compiles, nothing: it is part of that function's program, judged with it.

A shape is checked only where some dimension is larger than every shape judged before (the nominal
ones, if planned, and those checked at earlier calls): a program does not grow when its sizes shrink.  The check
compiles the rewritten program at that shape, never runs it (:func:`tf_memsafe.memory.graph_bytes`),
once per shape.  Over the limit, one warning names the function, the shape, XLA's figure and what to
do; the function is not checked again after it.  Each check is kept on the function's
:class:`~tf_memsafe.hook.TraceReport` (``run_checks``) for ``explain()`` and the command line.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from grappler_ext.splitter import nominal, rules
from tf_memsafe import _tf_internals
from tf_memsafe.units import format_bytes

__all__ = ["ShapeCheck", "Watch", "WATCH_ATTR", "watch", "on_call"]

WATCH_ATTR = "_tf_memsafe_run_watch"   # on the traced FuncGraph: its Watch


@dataclasses.dataclass(frozen=True)
class ShapeCheck:
    """One shape a watched function ran at: its run-time inputs' ``shapes`` (in the watch's order), XLA's
    figure for the program at them (``None`` where it could not be measured: ``problem`` says why), and
    the ``limit`` it was judged against."""

    shapes: tuple[tuple[int, ...], ...]
    bytes: int | None
    limit: int
    problem: str = ""

    @property
    def over(self) -> bool:
        return self.bytes is not None and self.bytes > self.limit

    def render(self) -> str:
        at = ", ".join(_shape(s) for s in self.shapes)
        if self.bytes is None:
            return f"at {at}: not measured ({self.problem})"
        return (f"at {at}: {format_bytes(self.bytes)} by XLA's figure, {'over' if self.over else 'within'} the limit "
                f"of {format_bytes(self.limit)}")


def _shape(dims) -> str:
    return "[" + ", ".join(f"{d:,}" for d in dims) + "]"


class Watch:
    """What is checked when a function with inputs of run-time sizes runs: ``graph`` (its trace, as
    rewritten), ``names`` and ``positions`` of those inputs among its arguments, the shapes they were
    ``planned`` at (``None``: no plan split it), the ``limit``, where to keep the checks (``checks``,
    shared with the function's report), and how to measure (``measure(graph, shapes)``: XLA's figure
    for the graph's program at those argument shapes, :func:`tf_memsafe.memory.graph_bytes`)."""

    def __init__(self, graph, planned: dict[str, tuple[int, ...]], limit: int, checks: list[ShapeCheck],
                 measure: Callable[[Any, list], int], planned_within: bool = True, no_smaller_plan: bool = False,
                 draws: tuple[str, ...] = (), planned_measured: bool = True):
        self._measure_bytes = measure
        self.draws = draws                           # random draws that stopped regions redraw_random would split
        self.no_smaller_plan = no_smaller_plan       # the splitter's plan, no smaller than as written, undone
        captured = {internal.name for _, internal in graph.captures}
        arguments = [t for t in graph.inputs if t.name not in captured]
        self._graph = weakref.ref(graph)
        self.name = graph.name
        dynamic = {t.name for t in nominal.dynamic_inputs(graph)}
        self.positions = tuple(i for i, t in enumerate(arguments) if t.name in dynamic)
        self.names = tuple(arguments[i].name for i in self.positions)
        # (a handle's shape, which graph_bytes refuses anyway, may be of unknown rank)
        self.static = [t.shape.as_list() if t.shape.rank is not None and t.name not in dynamic else None
                       for t in arguments]
        self.planned = tuple(planned[n] for n in self.names) if all(n in planned for n in self.names) else None
        self.limit = limit
        self.checks = checks
        self.warned = False
        self.planned_within = planned_within         # (a plan over the limit there judges no shape)
        # (nor one whose program was not compiled whole there: its growth predicted, grappler_ext's Growth)
        judged = self.planned and planned_within and planned_measured
        self._judged: list[tuple[tuple[int, ...], ...]] = [self.planned] if judged else []
        self._lock = threading.Lock()

    def covered(self, shapes: tuple[tuple[int, ...], ...]) -> bool:
        """Whether no dimension of ``shapes`` is larger than those of a shape judged before."""
        return any(all(len(s) == len(j) and all(a <= b for a, b in zip(s, j)) for s, j in zip(shapes, judged))
                   for judged in self._judged)

    def check(self, shapes: tuple[tuple[int, ...], ...]) -> ShapeCheck | None:
        """Measure the program at ``shapes`` unless covered (or said over already); warn once where it is over."""
        with self._lock:
            if self.warned or self.covered(shapes):
                return None
            self._judged.append(shapes)
            graph = self._graph()
            if graph is None:
                return None
            result = self._measure(graph, shapes)
            self.checks.append(result)
            if result.over:
                self.warned = True
                warnings.warn(self._over_message(result), RuntimeWarning, stacklevel=2)
            return result

    def _measure(self, graph, shapes) -> ShapeCheck:
        at = list(self.static)
        for position, shape in zip(self.positions, shapes):
            at[position] = list(shape)
        try:
            return ShapeCheck(shapes, self._measure_bytes(graph, at), self.limit)
        except Exception as e:  # noqa: BLE001 - a check must never break the user's call
            return ShapeCheck(shapes, None, self.limit, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

    def _over_message(self, result: ShapeCheck) -> str:
        ran = ", ".join(_shape(s) for s in result.shapes)
        if self.planned:
            planned = ", ".join(f"`{n}` {_shape(s)}" for n, s in zip(self.names, self.planned))
            over = "" if self.planned_within else " (over the limit there, not said then)"
            what = f"was planned with its sizes known only at run time at {planned}{over}, and runs at {ran}"
            fix = "so that it is planned there"
        else:
            inputs = ", ".join(f"`{n}`" for n in self.names)
            what = (f"has inputs with sizes known only at run time ({inputs}), and nothing in it was split"
                    + (" (the splitter's plan for it, at sizes of its choosing, was no smaller than the program "
                       "as written there, so it runs as written)" if self.no_smaller_plan else "")
                    + f"; it runs at {ran}")
            fix = "so that it can be planned and split"
        if self.no_smaller_plan:
            # (shapes given would be planned alike: what helps is a smaller call or a larger limit)
            advice = "Raise memory_limit, or call it on less at a time (smaller batches)."
        else:
            advice = ("Give the function the shapes it runs at (an input_signature with static shapes; tf.data's "
                      f"batch(..., drop_remainder=True) or padded_batch with padded_shapes) {fix}, or raise "
                      "memory_limit.")
        if self.draws:
            # (a draw kept whole stops the regions through it, at any shapes: what helps first is the option)
            advice = (f"A random draw (`{self.draws[0]}`) stops the regions through it: {rules.REDRAW_ADVICE}. "
                      f"Otherwise, {advice[0].lower()}{advice[1:]}")
        return (f"tf_memsafe: `{self.name}` {what}: there XLA's figure for it is {format_bytes(result.bytes)}, over "
                f"the limit of {format_bytes(self.limit)}. {advice} Said once for this function; its later "
                "shapes are not checked.")


def watch(graph, planned: dict[str, tuple[int, ...]], limit: int, checks: list[ShapeCheck],
          measure: Callable[[Any, list], int], planned_within: bool = True,
          no_smaller_plan: bool = False, draws: tuple[str, ...] = (), planned_measured: bool = True) -> Watch | None:
    """Have ``graph``'s calls checked (:func:`on_call`), beyond the shapes ``planned`` (by input name)
    where they name every input of run-time sizes and the plan was within the limit there
    (``planned_within``) by XLA's figure for the program as it runs (``planned_measured``); ``None``
    where it has none.  ``no_smaller_plan``: the splitter undid its plan, no smaller than the program as
    written; ``draws``: random draws that stopped regions which ``redraw_random`` would let through
    (each said where a shape is over)."""
    w = Watch(graph, planned, limit, checks, measure, planned_within, no_smaller_plan, draws, planned_measured)
    if not w.positions:
        return None
    setattr(graph, WATCH_ATTR, w)
    return w


def on_call(concrete, tensor_inputs):
    """The check of one call of ``concrete`` (see the module docstring); returns the inputs to call it with."""
    w = getattr(getattr(concrete, "graph", None), WATCH_ATTR, None)
    if w is None or w.warned:
        return tensor_inputs
    dynamic = [tensor_inputs[i] for i in w.positions]
    if tf.executing_eagerly():
        shapes = tuple(tuple(int(d) for d in t.shape) for t in dynamic)
        w.check(shapes)
        return tensor_inputs
    if _tf_internals.tracing_without_python():
        return tensor_inputs

    def check(*dims):
        w.check(tuple(tuple(int(d) for d in t.numpy()) for t in dims))
        return True

    done = tf.py_function(check, [tf.shape(t) for t in dynamic], Tout=tf.bool, name="tf_memsafe_run_check")
    inputs = list(tensor_inputs)
    with tf.control_dependencies([done]):
        for i in w.positions:
            inputs[i] = tf.identity(inputs[i])
    return inputs
