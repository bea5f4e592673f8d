"""Memory, measured: XLA's own figure for a compiled program, and the runtime peak.

:func:`memory_footprint` compiles -- never runs -- the function with XLA and reads "Total bytes
used" from the memory-usage report of XLA's buffer assignment: the bytes the compiled program
needs for its parameters, outputs, constants and temporaries.  That figure is deterministic,
which makes it the project's yardstick in tests, benchmarks and reports.

A program that captures a variable not initialized yet (one created in the very trace the hook is
measuring, such as a Keras optimizer's slots at its first step) is refused with a
``MeasurementError`` before XLA is asked, never tried: XLA's failure there prints a C++ stack trace
to the process's stderr (the user's terminal) before the error reaches Python.

:func:`peak_memory` runs the function and reads TensorFlow's allocator statistics for the device;
on the CPU the allocator rounds regions up, so it is an upper bound of XLA's figure.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import inspect
import os
import re
from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from grappler_ext import graph_query, shapes
from grappler_ext.program_digest import called_functions, program_fingerprint
from tf_memsafe import _tf_internals, hook, keyed_draws, xla_flags
from tf_memsafe.errors import TfMemsafeError

__all__ = ["memory_footprint", "compiled_bytes", "graph_bytes", "tape_footprint", "TapeFootprint", "peak_memory",
           "MeasurementError", "XlaMeasurer"]

_TOTAL_RE = re.compile(r"^Total bytes used:\s*(\d+)", re.MULTILINE)
_REPORT_GLOB = "*after_optimizations-memory-usage-report.txt"


class MeasurementError(TfMemsafeError):
    """XLA did not produce the report a measurement needs (the message says why and what to do)."""


def _fresh_function(fn) -> tf.types.experimental.PolymorphicFunction:
    """A new ``tf.function(jit_compile=True)`` of the same Python function, so it is traced anew.

    The user's function keeps its own trace cache untouched; the copy is traced under the options
    in force now (or with the hook suspended, for "before" figures).
    """
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        python_fn = fn.python_function
        signature = fn.input_signature
        autograph = getattr(fn, "_autograph", True)  # keep the user's choice; TF has no public getter
    elif callable(fn):
        python_fn, signature, autograph = fn, None, True
    else:
        raise TypeError(f"memory_footprint needs a tf.function or a callable, got {type(fn).__name__}")
    return tf.function(python_fn, jit_compile=True, input_signature=signature, autograph=autograph)


def _with_defaults(copy, args, kwargs) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the Python function's defaults filled in, by keyword.

    TensorFlow 2.21's ``experimental_get_compiler_ir`` does not apply defaults of the Python
    signature ("missing a required argument"); binding them here sidesteps that.
    """
    try:
        bound = inspect.signature(copy.python_function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    bound.apply_defaults()
    return tuple(bound.args), dict(bound.kwargs)


def _require_concrete_specs(fn, args, kwargs) -> None:
    """Raise ``MeasurementError`` where an argument is a ``TensorSpec`` with a dimension known only at run
    time: XLA compiles a program for each concrete shape, so there is no one figure to give (XLA's
    bridge would refuse it with "Only support static input shape", naming its own placeholders)."""
    for spec in tf.nest.flatten((args, kwargs)):
        if isinstance(spec, tf.TensorSpec) and not spec.shape.is_fully_defined():
            name = getattr(getattr(fn, "python_function", fn), "__name__", "the function")
            raise MeasurementError(
                f"`{name}` is measured for {spec}, whose shape is known only at run time: XLA compiles a "
                "program for each concrete shape. Pass a tensor, or a TensorSpec with every dimension known "
                "(the shape to measure at).")


def _require_initialized_variables(captured, what: str) -> None:
    """Raise ``MeasurementError`` unless every resource in ``captured`` is an initialized variable.

    Decided from the handles, before XLA is asked: given a variable not initialized yet (one created
    while the function being rewritten is traced, such as a Keras optimizer's slots at its first
    step), XLA's ``GetCompilerIr`` fails a ``RET_CHECK`` in ``PrepareXlaCompilerArgs`` that prints a
    C++ stack trace to the process's stderr before the error reaches Python.
    """
    handles = [t for t in captured if getattr(t, "dtype", None) == tf.resource]
    if not handles:
        return
    with tf.init_scope():
        for handle in handles:
            if tf.is_symbolic_tensor(handle):
                raise MeasurementError(f"{what} captures {handle.name} of an enclosing graph: it cannot be "
                                       "compiled on its own")
            if not bool(tf.raw_ops.VarIsInitializedOp(resource=handle)):
                raise MeasurementError(f"{what} captures a resource that is not an initialized variable (yet): "
                                       "XLA cannot compile it before the variable is initialized")


def _module_token(function_name) -> str:
    """What XLA's module name holds of a TensorFlow function's name: ``__inference_<lambda>_7``
    compiles to the module ``a_inference__lambda__7__`` (measured on TF 2.21)."""
    name = function_name.decode() if isinstance(function_name, bytes) else str(function_name)
    return re.sub(r"[^A-Za-z0-9]", "_", name).strip("_") + "__"


def _measuring(sizing_only: bool = False):
    """A block whose programs are compiled to be measured, never run: XLA dumps their reports, and on
    XLA:CPU (no GPU visible, so they compile for the CPU) generates their code at LLVM's level 0;
    ``sizing_only`` (a loop alone, to size its chunk), without XLA:CPU's fusion emitters too."""
    cpu = not tf.config.list_logical_devices("GPU")
    return xla_flags.dump_for_one_compile(fast_codegen=cpu, sizing_only=sizing_only and cpu)


def _read_total_bytes(folder: str, function_name=None) -> int:
    """The "Total bytes used" of the programs XLA dumped into ``folder``: those of the function named
    ``function_name``, if given and found.  Another thread's compile can land in the folder while it
    is set (``XLA_FLAGS`` is the process's), and must not count."""
    reports = sorted(glob.glob(os.path.join(folder, _REPORT_GLOB)))
    if not reports:
        raise MeasurementError(
            "XLA wrote no memory-usage report: XLA read XLA_FLAGS before tf_memsafe was imported, so it "
            "ignores the dump directory. Import tf_memsafe before the first XLA compile, or start the "
            f"process with XLA_FLAGS='{xla_flags.RESET_FLAG}'.")
    if function_name is not None:
        token = _module_token(function_name)
        reports = [p for p in reports if token in os.path.basename(p)] or reports
    totals = []
    for path in reports:
        with open(path, encoding="utf-8") as f:
            found = _TOTAL_RE.search(f.read())
        if found is None:
            raise MeasurementError(f"no 'Total bytes used' line in XLA's report {os.path.basename(path)}")
        totals.append(int(found.group(1)))
    return sum(totals)


def _keyed_figure(graph, definition: graph_pb2.GraphDef, shapes_at=None) -> int | None:
    """XLA's figure for ``graph`` (its ``definition``; traced at static shapes, or compiled at
    ``shapes_at`` as :func:`graph_bytes` takes them) compiled as a copy whose stateful draws are
    stateless (:mod:`tf_memsafe.keyed_draws`), where it has such draws and such a copy can be built;
    else ``None``, and the program is compiled as it is."""
    if not keyed_draws.draws_from_xla_generator(definition):
        return None
    try:
        return graph_bytes(graph, shapes_at)
    except MeasurementError:      # (an input of a handle type: a variable passed as an argument)
        return None


def memory_footprint(fn, *args, rewrite: bool = True, **kwargs) -> int:
    """Bytes XLA's buffer assignment gives the compiled program of ``fn`` on these arguments.

    Args:
      fn: a ``tf.function`` (its Python function is re-traced with ``jit_compile=True``) or a plain
        callable.
      *args, **kwargs: the arguments to compile for (tensors, variables or ``tf.TensorSpec``s).
      rewrite: with ``True`` (default), the figure with tf_memsafe's current options applied when
        tf_memsafe is enabled; with ``False``, the program exactly as the user wrote it ("before").

    The function is compiled, not run.  It is traced afresh each call (the user's own trace cache
    is not touched) and can be called any number of times, for different functions, anywhere in a
    program.  A program XLA splits into several modules reports their sum; one traced alike before
    (:func:`program_fingerprint`, names aside) is not compiled again.  A program with stateful
    random draws is compiled as a copy that takes nothing from XLA's generator, so that measuring it
    does not change what the programs compiled after it draw (:mod:`tf_memsafe.keyed_draws`).
    """
    copy = _fresh_function(fn)
    _require_concrete_specs(fn, args, kwargs)
    args, kwargs = _with_defaults(copy, args, kwargs)
    def suspend():
        return contextlib.nullcontext() if rewrite else hook.suspended()

    with suspend(), _tf_internals.traced_as_called():       # (its control flow as a call builds it)
        concrete = copy.get_concrete_function(*args, **kwargs)
        _require_initialized_variables(concrete.captured_inputs, f"{getattr(fn, '__name__', fn)!r}")
    if any(not t.shape.is_fully_defined() for t in concrete.inputs if t.dtype not in (tf.resource, tf.variant)):
        # An input_signature with dimensions known only at run time: the trace (rewritten as such)
        # compiled for these arguments' shapes, as TensorFlow compiles it when it is called with
        # them -- called from a function traced at those shapes, itself left as it is.
        outer = tf.function(lambda *a, **k: copy(*a, **k), jit_compile=True, autograph=False)
        with hook.suspended(), _tf_internals.traced_as_called():
            called = outer.get_concrete_function(*args, **kwargs)
            definition = called.graph.as_graph_def()
            figure = _keyed_figure(called.graph, definition)
            return figure if figure is not None else _remembered(outer, called, definition, args, kwargs)
    definition = concrete.graph.as_graph_def()
    figure = _keyed_figure(concrete.graph, definition)
    return figure if figure is not None else _remembered(copy, concrete, definition, args, kwargs, suspend)


_FIGURES: collections.OrderedDict[str, int] = collections.OrderedDict()   # program fingerprint -> figure
_FIGURES_KEPT = 4096


def _remembered(fn, concrete, definition: graph_pb2.GraphDef, args=(), kwargs=None,
                within=contextlib.nullcontext, sizing_only: bool = False) -> int:
    """XLA's figure for ``fn`` compiled on ``args`` and ``kwargs`` (``concrete``: its trace there, whose
    program is ``definition``): remembered if a program traced alike was measured before
    (:func:`program_fingerprint`, its captured inputs' shapes, and the user's ``XLA_FLAGS``, which
    may change how XLA lays it out), else compiled (never run; inside ``within()``; ``sizing_only``:
    see :func:`compiled_bytes`) and remembered (the last ``_FIGURES_KEPT``)."""
    key = (program_fingerprint(definition) + repr(
        [(t.dtype.name, tuple(t.shape.as_list())) for t in concrete.captured_inputs])
        + xla_flags.user_value() + ("/sizing" if sizing_only else ""))
    if key in _FIGURES:
        _FIGURES.move_to_end(key)
        return _FIGURES[key]
    with within(), _measuring(sizing_only) as folder:
        fn.experimental_get_compiler_ir(*args, **(kwargs or {}))(stage="optimized_hlo")
        figure = _read_total_bytes(folder, concrete.name)
    _FIGURES[key] = figure
    while len(_FIGURES) > _FIGURES_KEPT:
        _FIGURES.popitem(last=False)
    return figure


def compiled_bytes(fn: tf.types.experimental.PolymorphicFunction, *specs: tf.TensorSpec,
                   sizing_only: bool = False) -> int:
    """XLA's "Total bytes used" for ``fn`` (a ``tf.function(jit_compile=True)``) compiled for ``specs``,
    traced with tf_memsafe's hook suspended: the figure of exactly the program ``fn`` builds.
    ``sizing_only``: a loop alone, measured to size its chunk (the program as split is measured
    after, as it runs), compiled on XLA:CPU without its fusion emitters, in about half the time
    (:mod:`tf_memsafe.xla_flags`).

    Compiled, never run.  The splitter measures its loops with it (through :class:`XlaMeasurer`).
    A program traced alike before (:func:`program_fingerprint`: the same loop of another layer, or
    planned again) is not compiled again: its figure is remembered (the last ``_FIGURES_KEPT``).
    Raises ``MeasurementError``, without asking XLA, when ``fn`` captures a variable that is not
    initialized yet.  A program with stateful random draws is measured as a copy keyed by constants
    (:func:`graph_bytes`, :mod:`tf_memsafe.keyed_draws`).
    """
    with hook.suspended():
        with _tf_internals.traced_as_called():
            concrete = fn.get_concrete_function(*specs)
        _require_initialized_variables(concrete.captured_inputs, f"`{concrete.name}`")
        definition = concrete.graph.as_graph_def()
        if keyed_draws.draws_from_xla_generator(definition):    # measured as a copy that does not
            return graph_bytes(concrete.graph, [spec.shape for spec in specs], sizing_only=sizing_only)
        return _remembered(fn, concrete, definition, specs, sizing_only=sizing_only)


def live_definition(graph) -> graph_pb2.GraphDef:
    """``graph``'s definition with only the nodes TensorFlow's function runtime keeps
    (:func:`grappler_ext.graph_query.kept_ops`: what its outputs, control outputs and stateful ops
    need) and the functions they call, directly or through other functions.

    A rewritten graph holds every op a pass built and abandoned (a plan undone, a gradient
    differentiated again), unreachable: a Transformer's training step split at L = 2048 has about
    21,000 live ops of 254,000, and 116 functions of 720.  A copy compiled to be measured must not
    carry them: measured, XLA's compile of that step's copy took 118 s with them and 35 s without
    (the same figure), beside copying and fingerprinting them."""
    whole = graph.as_graph_def()
    live = {op.name for op in graph_query.kept_ops(graph)}
    library = {f.signature.name: f for f in whole.library.function}
    nodes = [n for n in whole.node if n.name in live]
    called = called_functions(nodes, library)
    definition = graph_pb2.GraphDef(versions=whole.versions)
    definition.node.extend(nodes)
    definition.library.function.extend(library[name] for name in sorted(called))
    called_names = set(called)
    definition.library.gradient.extend(g for g in whole.library.gradient if g.function_name in called_names)
    return definition


def graph_bytes(graph, shapes_at: Sequence[Sequence[int]] | None = None, sizing_only: bool = False) -> int:
    """XLA's "Total bytes used" for a function's graph as it stands now (a ``FuncGraph`` being traced),
    or, given ``shapes_at`` (one shape per argument, in order), for the program XLA compiles when the
    function runs with arguments of those shapes.

    A copy of the graph is compiled -- never run -- as a function of its own: the graph's inputs
    become the copy's arguments (static shapes needed), its captured tensors (variables' handles,
    constants) are captured again, its outputs are returned, and its stateful ops (variable updates)
    are kept by the copy's automatic control dependencies, so the copy is the program XLA will
    compile for the original, its stateful random draws aside: the copy draws the same shapes with
    stateless ops keyed by constants, so that compiling it takes nothing from XLA's generator
    (:mod:`tf_memsafe.keyed_draws`).  The splitter checks with it what its memory model cannot see (how
    XLA's scheduler interleaves independent branches).  Raises ``MeasurementError``, without asking
    XLA, when the graph has no outputs, an input without a static shape, or captures a variable not
    initialized yet (one created in this very trace, such as a Keras optimizer's slots at its first
    step: it is initialized only after the trace).  ``sizing_only``: see :func:`compiled_bytes` (a loop
    alone with draws, measured as such a copy).
    """
    fn, specs = _program_copy(graph, shapes_at)
    with tf.init_scope():
        return compiled_bytes(fn, *specs, sizing_only=sizing_only)


def graph_bytes_later(graph) -> Callable[[], int]:
    """:func:`graph_bytes` of ``graph`` as it stands now, compiled when the result is called: the
    graph may change in between (the splitter weighs a plan over the limit against the program as
    written without undoing the plan and building it again).  Raises as :func:`graph_bytes` would
    where the graph cannot be copied (no outputs, an input without a static shape)."""
    fn, specs = _program_copy(graph, None)

    def figure() -> int:
        with tf.init_scope():
            return compiled_bytes(fn, *specs)
    return figure


def _program_copy(graph, shapes_at):
    """The function :func:`graph_bytes` compiles for ``graph`` as it stands, and the specs to compile it for."""
    outputs = [t for t in getattr(graph, "outputs", []) if t is not None]
    if not outputs:
        raise MeasurementError(f"`{graph.name}` has no outputs to compile")
    captured = {internal.name: external for external, internal in graph.captures}
    arguments = [t for t in graph.inputs if t.name not in captured]
    if any(t.dtype in (tf.resource, tf.variant) for t in arguments):
        raise MeasurementError(f"`{graph.name}` has an input of a handle type")
    if shapes_at is not None:
        if len(shapes_at) != len(arguments):
            raise MeasurementError(f"`{graph.name}` has {len(arguments)} arguments, {len(shapes_at)} shapes given")
        specs = [tf.TensorSpec(shape, t.dtype) for shape, t in zip(shapes_at, arguments)]
    # Dimensions known only at run time are compiled at the nominal size the splitter plans at.
    elif any(not shapes.is_static(t) for t in arguments):
        raise MeasurementError(f"`{graph.name}` has an input without a static shape")
    else:
        specs = [shapes.concrete_spec(t) for t in arguments]
    _require_initialized_variables(captured.values(), f"`{graph.name}`")
    definition = keyed_draws.keyed(live_definition(graph))     # compiled, it draws from no generator of XLA's
    replaced = {t.op.name for t in graph.inputs}
    kept = [n for n in definition.node if n.name not in replaced]             # the inputs are mapped
    del definition.node[:]
    definition.node.extend(kept)
    for node in definition.node:
        node.attr.pop("_class", None)      # colocation with the inputs' nodes, which the copy has not

    def copy(*values):
        here = tf.compat.v1.get_default_graph()
        # (an argument nothing reads, a target the loss ignores, is in no node's inputs: not mapped)
        mapping = {t.name: v for t, v in zip(arguments, values) if t.consumers()}
        mapping.update({name: here.capture(external) for name, external in captured.items()})
        return tf.graph_util.import_graph_def(definition, input_map=mapping, name="",
                                              return_elements=[t.name for t in outputs])

    return tf.function(copy, jit_compile=True, autograph=False), specs


class XlaMeasurer:
    """XLA's figures for the splitter and the pipeline's guard (:class:`grappler_ext.measure.Measurer`):
    programs compiled with tf_memsafe's hook suspended, never run, their "Total bytes used" read from
    XLA's report."""

    def program_bytes(self, graph) -> int:
        return graph_bytes(graph)

    def program_bytes_later(self, graph) -> Callable[[], int]:
        return graph_bytes_later(graph)

    def function_bytes(self, fn, specs) -> int:
        return compiled_bytes(fn, *specs, sizing_only=True)    # (a loop alone, to size its chunk)

    def __repr__(self) -> str:
        return "XlaMeasurer()"


@dataclasses.dataclass(frozen=True)
class TapeFootprint:
    """XLA's figures for the two programs a jit function compiles to under a ``GradientTape``.

    Attributes:
      forward: bytes of the forward program (the outputs plus the side outputs the backward reads).
      backward: bytes of the backward program (output gradients and side outputs in, input
        gradients out).
    """

    forward: int
    backward: int

    @property
    def total(self) -> int:
        """Their sum: both programs' buffers, as if neither freed anything before the other ran.

        The side outputs are counted in both (they are the forward's outputs and the backward's
        parameters), so this bounds what the pair needs from above.
        """
        return self.forward + self.backward

    def __str__(self) -> str:
        from tf_memsafe.units import format_bytes

        return (f"forward {format_bytes(self.forward)} + backward {format_bytes(self.backward)} "
                f"= {format_bytes(self.total)}")


def tape_footprint(fn, *args, rewrite: bool = True, **kwargs) -> TapeFootprint:
    """XLA's figures for ``fn`` called under a ``tf.GradientTape`` outside it: forward and backward.

    With the tape outside a ``jit_compile=True`` function, TensorFlow runs two XLA programs: a
    forward that also returns the intermediates the gradient needs, and a backward that reads them.
    This builds the same pair TensorFlow builds for a single non-persistent tape (gradients with
    respect to every input and captured variable) and compiles each -- neither is run.  Arguments
    and ``rewrite`` are as in :func:`memory_footprint`.  A persistent tape or nested tapes make
    TensorFlow build a higher-order pair, which keeps more side outputs; it is not measured here.

    One case runs the function: a backward whose XLA program needs an input's *value* at compile
    time (XLA's "must be a compile-time constant", e.g. the shape a diagonal's gradient rebuilds;
    GPflow's SGPR loss has one) cannot be compiled from shapes.  Then ``fn`` is run once under a
    tape, with zeros for ``tf.TensorSpec`` arguments, and the two programs XLA compiled for that
    call are measured (its stateful random draws, run, take from XLA's generator as any call does;
    compiled only, a program with such draws is measured as a copy keyed by constants, as in
    :func:`memory_footprint`).
    """
    copy = _fresh_function(fn)
    args, kwargs = _with_defaults(copy, args, kwargs)
    suspend = contextlib.nullcontext() if rewrite else hook.suspended()
    with suspend, _tf_internals.traced_as_called():
        concrete = copy.get_concrete_function(*args, **kwargs)
        flat_args = _tf_internals.flat_compile_args(concrete, args, kwargs)
    try:
        return pair_figures(concrete, flat_args, getattr(fn, "__name__", fn))
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        if "compile-time constant" not in str(e):
            raise
        return _tape_footprint_by_running(fn, args, kwargs, rewrite)


def pair_figures(concrete, flat_args, name) -> TapeFootprint:
    """XLA's figures for the forward and backward programs TensorFlow builds for ``concrete`` (a traced
    function) under one tape outside it, compiled for ``flat_args`` (its own inputs: tensors or specs),
    neither run.  Raises where the backward takes a resource, or XLA cannot compile one from shapes."""
    with hook.suspended(), _tf_internals.traced_as_called():
        forward, backward = _tf_internals.tape_functions(concrete)
    # The backward reads forward-graph tensors as captures: compile it on specs of all its inputs.
    backward_inputs = backward.graph.inputs
    resources = [t.name for t in backward_inputs if t.dtype == tf.resource]
    if resources:
        raise MeasurementError(f"the backward program of {name!r} takes resource inputs "
                               f"({', '.join(resources)}): its footprint cannot be compiled from shapes alone")
    backward_specs = [tf.TensorSpec(t.shape, t.dtype) for t in backward_inputs]
    sizes = []
    for function, flat, captured in ((forward, flat_args, concrete.captured_inputs), (backward, backward_specs, ())):
        # (a dropout's draw in the forward: measured as a copy that takes nothing from XLA's generator)
        figure = _keyed_figure(function.graph, function.graph.as_graph_def(), [a.shape for a in flat])
        if figure is not None:
            sizes.append(figure)
            continue
        with _measuring() as folder:
            _tf_internals.compile_by_name(function.name, flat, captured)
            sizes.append(_read_total_bytes(folder, function.name))
    return TapeFootprint(*sizes)


def _tape_footprint_by_running(fn, args, kwargs, rewrite: bool) -> TapeFootprint:
    """Run a fresh copy of ``fn`` once under a tape and read the forward and backward programs' figures."""
    copy = _fresh_function(fn)

    def value(a):
        return tf.zeros(a.shape, a.dtype) if isinstance(a, tf.TensorSpec) else a

    args = tf.nest.map_structure(value, args)
    kwargs = tf.nest.map_structure(value, kwargs)
    watched = [t for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t) and t.dtype.is_floating]
    suspend = contextlib.nullcontext() if rewrite else hook.suspended()
    with xla_flags.dump_for_one_compile() as folder, suspend:
        with tf.GradientTape() as tape:
            tape.watch(watched)
            out = copy(*args, **kwargs)
        targets = [t for t in tf.nest.flatten(out) if tf.is_tensor(t) and t.dtype.is_floating]
        tape.gradient(targets, watched + list(tape.watched_variables()))
        figures = {}
        for path in sorted(glob.glob(os.path.join(folder, _REPORT_GLOB))):
            kind = "backward" if "backward" in os.path.basename(path) else "forward"
            with open(path, encoding="utf-8") as f:
                found = _TOTAL_RE.search(f.read())
            if found:
                figures[kind] = figures.get(kind, 0) + int(found.group(1))
    if set(figures) != {"forward", "backward"}:
        raise MeasurementError(f"running {getattr(fn, '__name__', fn)!r} under a tape compiled "
                               f"{sorted(figures) or 'no'} programs, not a forward and a backward")
    return TapeFootprint(figures["forward"], figures["backward"])


def peak_memory(fn, *args, device: str | None = None, **kwargs) -> int:
    """Run ``fn(*args, **kwargs)`` once and return the device allocator's peak bytes during the call.

    The peak counts everything allocated on ``device`` (default: ``"GPU:0"`` when a GPU is visible,
    else ``"CPU:0"``) during the call, including the arguments' copies and the outputs.  On the CPU
    the allocator rounds up, so this is an upper bound of :func:`memory_footprint`.
    """
    if device is None:
        device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as e:
        raise MeasurementError(
            f"TensorFlow keeps no allocator statistics for {device} in this process ({e}): on a CPU it keeps "
            "them for its BFC allocator, its default only where oneDNN is on; start the process with "
            "TF_CPU_ALLOCATOR_USE_BFC=true, or use memory_footprint (XLA's figure, nothing run)") from e
    before = tf.config.experimental.get_memory_info(device)["current"]
    result = fn(*args, **kwargs)
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)  # wait for it
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    del result
    return max(0, peak - before)
