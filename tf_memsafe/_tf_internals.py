"""Every use of TensorFlow internals, in one place, behind a version check.

tf_memsafe rewrites a ``tf.function``'s graph through TensorFlow's function-graph transform list
(``tensorflow.python.eager.polymorphic_function.transform.FUNC_GRAPH_TRANSFORMS``): TensorFlow calls
each registered callable with the freshly traced ``FuncGraph`` before it is turned into a function,
both for ``tf.function`` traces and for every while/cond body graph it builds
(``control_flow_util_v2.create_new_tf_function``), including those it builds later for gradients.

What this module relies on, checked by :func:`check_supported` with a clear error otherwise:

* ``transform.FUNC_GRAPH_TRANSFORMS`` is a list of callables taking the FuncGraph;
* a ``tf.function`` trace reaches the transform from ``tracing_compilation._create_concrete_function``,
  whose local ``tracing_options.attributes`` holds ``_XlaMustCompile`` for ``jit_compile=True``;
  control-flow bodies reach it from ``control_flow_util_v2.create_new_tf_function`` instead;
* ``control_flow_util.GraphOrParentsInXlaContext`` tells whether a graph is traced inside an XLA
  context (a jit function's ``__call__`` enters one; ``get_concrete_function`` does not, which is
  why both signals are read); a trace made inside one builds its control flow for XLA (``If`` and
  ``While`` carry ``_xla_propagate_compile_time_consts``, not ``_lower_using_switch_merge``), so a
  copy traced to be measured is traced inside one too (:func:`traced_as_called`, entering
  ``polymorphic_function.OptionalXlaContext`` as ``__call__`` does), and a compiled function's graph is
  rewritten inside one entered on the graph it was traced from (``FuncGraph.outer_graph``:
  :func:`built_for_xla`), so the loops tf_memsafe builds carry that attribute however it was traced;
* with one non-persistent ``GradientTape`` watching a call, a ``ConcreteFunction`` runs the forward
  and backward functions that ``concrete_function._FirstOrderTapeGradientFunctions`` builds
  (``forward()`` returns the forward ``AtomicFunction``, after which ``_backward`` holds the backward
  ``ConcreteFunction``), and ``context.get_compiler_ir`` compiles a registered function by name
  from argument specs without running it;
* a ``tf.function``'s first trace is made by ``PolymorphicFunction._initialize``, whose local
  ``created_variables`` lists the variables that trace created; where it lists any, TensorFlow traces
  the function again with variable creation disabled and runs only that trace (for ``jit_compile=True``
  the fallback that would run the first one raises instead), so the first trace is never run;
* a ``tf.function`` trace is made by ``tracing_compilation.trace_function(args, kwargs, ...)``, whose
  locals hold the call's arguments (DTensor inputs among them: :func:`call_arguments`);
* ``atomic_function.from_func_graph`` takes the function's body from ``graph.get_operations()``
  (every op, reachable or not: :func:`export_only` has a rewritten graph give only those it keeps);
* every call of a traced function's program, from Python or from a function being traced, goes
  through ``ConcreteFunction._call_flat(self, tensor_inputs, captured_inputs)`` (``tensor_inputs`` in
  the order of the graph's non-captured inputs), and a trace's nested calls happen inside its
  ``_create_concrete_function`` frame (whose ``tracing_options`` say whether XLA compiles it): a
  wrapper checks the shapes each call runs at (:func:`install_call_check`); ``tf.saved_model.save``
  traces inside ``save_context.in_save_context()``;
* ``backprop.GradientTape.gradient(self, target, sources, output_gradients, unconnected_gradients)``
  is the one entry point of tape gradients (Keras optimizers and GPflow's Scipy call it): a wrapper
  around it records, while a function is traced, what each call differentiated.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_memsafe.errors import UnsupportedTensorFlowError

__all__ = [
    "SUPPORTED_TF", "check_supported", "register_transform", "unregister_transform",
    "TraceInfo", "trace_info", "device_memory_bytes", "physical_memory_bytes",
    "tape_functions", "calls_xla_function", "compile_by_name", "flat_compile_args", "install_gradient_recorder",
    "uninstall_gradient_recorder", "call_arguments", "export_only", "install_call_check", "uninstall_call_check",
    "tracing_without_python", "traced_as_called", "built_for_xla",
]

SUPPORTED_TF = ((2, 21),)  # (major, minor) versions whose internals are tested.
XLA_MUST_COMPILE = "_XlaMustCompile"

_TRACE_FRAME = "_create_concrete_function"  # tracing_compilation's function that calls transforms.
_INITIALIZE_FRAME = "_initialize"           # PolymorphicFunction's first trace, which may create variables.


def _tf_version() -> tuple[int, int]:
    major, minor = tf.__version__.split(".")[:2]
    return int(major), int(minor)


def _transform_module():
    try:
        from tensorflow.python.eager.polymorphic_function import transform
    except ImportError as e:  # pragma: no cover - depends on the installed TF
        raise UnsupportedTensorFlowError(
            f"TensorFlow {tf.__version__} has no polymorphic_function.transform module; tf_memsafe "
            f"supports TensorFlow {_supported_str()} (pip install 'tensorflow>=2.21,<2.22')") from e
    return transform


def _supported_str() -> str:
    return ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TF)


def check_supported() -> None:
    """Raise :class:`UnsupportedTensorFlowError` unless this TF has the internals we use."""
    if _tf_version() not in SUPPORTED_TF:
        raise UnsupportedTensorFlowError(
            f"tf_memsafe supports TensorFlow {_supported_str()}, found {tf.__version__}; its graph "
            "hook uses TensorFlow internals that change between releases. Install a supported "
            "TensorFlow, or leave tf_memsafe disabled.")
    transforms = getattr(_transform_module(), "FUNC_GRAPH_TRANSFORMS", None)
    if not isinstance(transforms, list):
        raise UnsupportedTensorFlowError(
            f"TensorFlow {tf.__version__} has no FUNC_GRAPH_TRANSFORMS list; the tf.function hook "
            "cannot be installed")
    from tensorflow.python.eager.polymorphic_function import tracing_compilation
    if not hasattr(tracing_compilation, _TRACE_FRAME):
        raise UnsupportedTensorFlowError(
            f"TensorFlow {tf.__version__}: tracing_compilation.{_TRACE_FRAME} not found; "
            "tf_memsafe cannot tell tf.function traces from control-flow bodies")


def register_transform(fn: Callable[[Any], None]) -> None:
    """Append ``fn`` to TensorFlow's transform list (idempotent)."""
    transforms = _transform_module().FUNC_GRAPH_TRANSFORMS
    if fn not in transforms:
        transforms.append(fn)


def unregister_transform(fn: Callable[[Any], None]) -> None:
    transforms = _transform_module().FUNC_GRAPH_TRANSFORMS
    while fn in transforms:
        transforms.remove(fn)


class TraceInfo:
    """What the transform can learn about the graph it is called with.

    Attributes:
      is_function_trace: the graph is a ``tf.function`` trace (not a while/cond body).
      must_compile: the function has ``jit_compile=True``.
      in_xla_context: the graph or a parent is traced inside an XLA context (e.g. a plain
        ``tf.function`` called from a jit one).
      retraced: the first trace of a ``jit_compile=True`` function that created variables in it:
        TensorFlow traces the function again without creating them and never runs this trace.
      tf_data: a function ``tf.data`` traced for a transformation (a ``map``'s, a shuffle's
        permutation), never the user's computation.
    """

    __slots__ = ("is_function_trace", "must_compile", "in_xla_context", "retraced", "tf_data")

    def __init__(self, is_function_trace: bool, must_compile: bool, in_xla_context: bool,
                 retraced: bool = False, tf_data: bool = False):
        self.is_function_trace = is_function_trace
        self.must_compile = must_compile
        self.in_xla_context = in_xla_context
        self.retraced = retraced
        self.tf_data = tf_data

    @property
    def xla_compiled(self) -> bool:
        return self.must_compile or self.in_xla_context


def traced_as_called():
    """A context in which a ``jit_compile=True`` function traced by ``get_concrete_function`` (or
    ``experimental_get_compiler_ir``) is traced as its call traces it: inside an XLA context, so its
    control flow is built as XLA compiles it when called (a program measured is the program run)."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    return polymorphic_function.OptionalXlaContext(True)


@contextlib.contextmanager
def built_for_xla(graph):
    """A context in which control flow built in ``graph`` (a ``FuncGraph`` XLA compiles, being rewritten)
    is built as XLA compiles it, whether the function was traced by a call or by
    ``get_concrete_function``: an XLA context entered on the graph it was traced from, as ``__call__``
    enters one (nothing where that graph is already inside one).

    Why: a ``While`` built outside one lacks ``_xla_propagate_compile_time_consts``, and XLA then takes
    a loop-invariant size its body needs as a constant (a split loop's chunk, scaled at run time from
    the inputs' shapes) only where TensorFlow's constant folding happens to reach it: measured on TF
    2.21, a loop whose other invariant input is a stateless draw keyed by constants fails to compile
    ("Input 1 to node `while/range` with op Range must be a compile-time constant"), and the same loop
    with the attribute compiles (``tests/tf_memsafe/test_hook.py`` checks the attribute,
    ``tests/grappler_ext/splitter/test_dynamic.py``'s dropout test the compile).  The context is set on
    that graph directly, not entered as :func:`traced_as_called` enters it: that makes the graph the
    default one, and the eager program's graph made default switches TensorFlow to graph mode."""
    from tensorflow.python.ops import control_flow_ops, control_flow_util
    outer = getattr(graph, "outer_graph", None)
    if outer is None or control_flow_util.GraphOrParentsInXlaContext(graph):
        yield
        return
    previous = outer._get_control_flow_context()
    outer._set_control_flow_context(control_flow_ops.XLAControlFlowContext())
    try:
        yield
    finally:
        outer._set_control_flow_context(previous)


def calls_xla_function(graph) -> bool:
    """Whether ``graph``'s function library (a private attribute) holds a function XLA compiles: a plain
    ``tf.function`` calling a jit one (Keras' ``fit`` runs its jit-compiled step so)."""
    for f in getattr(graph, "_functions", {}).values():
        try:
            attr = f.definition.attr.get(XLA_MUST_COMPILE)
        except Exception:  # noqa: BLE001 - a function whose definition cannot be read: not known to be compiled
            continue
        if attr is not None and attr.b:
            return True
    return False


# Op types XLA compiles without a kernel of its own: a function's arguments.
_XLA_ARGUMENTS = frozenset({"Placeholder"})


def op_types(graph) -> dict[str, str]:
    """Every op type in ``graph`` and in the functions of its library (loop bodies, branches, calls:
    a private attribute), each with the name of an op of that type; calls of those functions aside."""
    found: dict[str, str] = {}
    for op in graph.get_operations():
        found.setdefault(op.type, op.name)
    functions = getattr(graph, "_functions", {})
    for f in functions.values():
        try:
            nodes = f.definition.node_def
        except Exception:  # noqa: BLE001 - a function whose definition cannot be read adds nothing
            continue
        for node in nodes:
            found.setdefault(node.op, node.name)
    return {t: name for t, name in found.items() if t not in functions}


def without_xla_kernel(types, device_type: str) -> list[str] | None:
    """The op types among ``types`` that TensorFlow runs on ``device_type`` ("CPU", "GPU") but XLA cannot
    compile there: no kernel of ``XLA_<device>_JIT`` in TensorFlow's kernel registry (``tf.linalg.slogdet``'s
    ``LogMatrixDeterminant``, ``tf.py_function``).  ``None`` where XLA's kernels are not registered yet
    (TensorFlow registers them at its first XLA compile in the process, or its first lowering)."""
    from tensorflow.python.framework import kernels

    def devices(op_type: str) -> set:
        try:
            return {k.device_type for k in kernels.get_registered_kernels_for_op(op_type).kernel}
        except Exception:  # noqa: BLE001 - an op the registry cannot list is not judged
            return set()

    jit = f"XLA_{device_type}_JIT"
    if jit not in devices("MatMul"):
        return None
    return sorted(t for t in types if t not in _XLA_ARGUMENTS and device_type in (d := devices(t)) and jit not in d)


def register_xla_kernels() -> None:
    """Have TensorFlow register XLA's compilation kernels (it does so at the first XLA lowering in the
    process): a one-op function lowered to HLO, never compiled further or run."""
    tf.function(lambda x: x + 1.0, jit_compile=True).experimental_get_compiler_ir(tf.constant(0.0))(stage="hlo")


_TF_DATA_FUNCTION = "_tf_data_function"   # the attribute tf.data's traced transformation functions carry


def trace_info(graph) -> TraceInfo:
    """Inspect the calling TensorFlow frames (read-only) to classify ``graph``."""
    from tensorflow.python.ops import control_flow_util

    attributes = None
    is_function_trace = False
    retraced = False
    frame = sys._getframe(1)
    # Only a few frames separate the transform from its caller; bound the walk anyway.
    for _ in range(12):
        if frame is None:
            break
        if frame.f_code.co_name == _TRACE_FRAME and "tracing_options" in frame.f_locals:
            is_function_trace = True
            attributes = getattr(frame.f_locals["tracing_options"], "attributes", None) or {}
            retraced = _created_variables(frame.f_back)
            break
        frame = frame.f_back
    must_compile = bool(attributes.get(XLA_MUST_COMPILE, False)) if attributes else False
    try:
        in_xla = bool(control_flow_util.GraphOrParentsInXlaContext(graph))
    except Exception:  # noqa: BLE001 - a graph without control-flow context is simply not in one
        in_xla = False
    tf_data = bool(attributes.get(_TF_DATA_FUNCTION, False)) if attributes else False
    return TraceInfo(is_function_trace, must_compile, in_xla, retraced, tf_data)


def _created_variables(frame) -> bool:
    """Whether the trace whose ``_create_concrete_function`` frame is above ``frame`` is the first trace
    of a ``jit_compile=True`` function and created variables (so it will be traced again, see above).
    Only the few frames up to that trace's ``_initialize`` are read, never past another trace."""
    for _ in range(4):
        if frame is None or frame.f_code.co_name == _TRACE_FRAME:
            return False
        if frame.f_code.co_name == _INITIALIZE_FRAME and "created_variables" in frame.f_locals:
            function = frame.f_locals.get("self")
            return bool(frame.f_locals["created_variables"]) and getattr(function, "_jit_compile", None) is True
        frame = frame.f_back
    return False


_CALL_FRAME = "trace_function"  # tracing_compilation's function holding the call's args and kwargs.


def call_arguments() -> tuple[tuple, dict] | None:
    """The ``(args, kwargs)`` of the ``tf.function`` call being traced, read from the calling frames
    (read-only); ``None`` outside such a trace (a while/cond body, ``get_concrete_function`` with specs
    gives the specs)."""
    frame = sys._getframe(1)
    for _ in range(24):
        if frame is None:
            return None
        if frame.f_code.co_name == _CALL_FRAME and "args" in frame.f_locals:
            return tuple(frame.f_locals["args"] or ()), dict(frame.f_locals.get("kwargs") or {})
        frame = frame.f_back
    return None


def export_only(graph, kept: Callable[[Any, list], set]) -> None:
    """Have TensorFlow make ``graph`` (a traced ``FuncGraph``, after the transforms) a function of the
    ops ``kept(graph, ops)`` picks among its ``ops``, asked when TensorFlow reads them.

    ``atomic_function.from_func_graph`` gives ``TF_GraphToFunction`` every op of
    ``graph.get_operations()``: after a rewrite, every op a pass built and abandoned too, which
    TensorFlow's runtime prunes only after its XLA bridge has gone over them (measured: a Transformer
    step split at L = 2048 compiled in 118 s with its 233,000 dead ops, 35 s without, to the same
    figure).  ``kept`` is asked each time, so ops TensorFlow adds later (a forward's extra outputs for
    a tape's gradient) are judged then."""
    ops_of = type(graph).get_operations

    def get_operations():
        ops = ops_of(graph)
        keep = kept(graph, ops)
        return [op for op in ops if op in keep]

    graph.get_operations = get_operations


def physical_memory_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.cache
def device_memory_bytes(device_type: str = "CPU") -> int:
    """Memory of the first device of ``device_type``: the GPU allocator's limit, or physical RAM."""
    if device_type.upper() == "GPU":
        from tensorflow.python.client import device_lib

        for dev in device_lib.list_local_devices():
            if dev.device_type == "GPU":
                return int(dev.memory_limit)
    return physical_memory_bytes()


def tape_functions(concrete_fn) -> tuple[Any, Any]:
    """The ``(forward, backward)`` functions TensorFlow runs for ``concrete_fn`` under one tape.

    ``forward`` takes the inference function's inputs (captures last) and returns its outputs plus
    the side outputs the backward needs; ``backward`` takes the output gradients and those side
    outputs.  Both carry the function's attributes, ``_XlaMustCompile`` included, so each is
    compiled by XLA as its own program.
    """
    from tensorflow.python.eager.polymorphic_function import concrete_function as cf

    # The pair TensorFlow itself makes for an eager call under one tape, from its own cache and put there:
    # making another appends the side outputs to the function's graph again (a later tape call then ran a
    # backward taking every side output twice: 59 MB where 42 MB, a mixture's likelihood).
    key = (False, ())
    functions = concrete_fn._first_order_tape_functions.get(key)
    if functions is None:
        functions = concrete_fn._first_order_tape_functions[key] = cf._FirstOrderTapeGradientFunctions(
            concrete_fn._func_graph, concrete_fn._attrs, concrete_fn._garbage_collector,
            forwardprop_input_indices=(), delayed_rewrite_functions=concrete_fn._delayed_rewrite_functions,
            need_gradients_for_jvps=False)
    forward = functions.forward(inference_args=None, input_tangents=[])
    return forward, functions._backward


def compile_by_name(function_name, flat_args, captured_inputs, stage: str = "optimized_hlo") -> str:
    """Compile the registered function ``function_name`` with XLA for these arguments; never runs it.

    ``flat_args`` are tensors or fully defined ``tf.TensorSpec``s for the function's own inputs;
    ``captured_inputs`` are the eager values of its captures (variables' handles).
    """
    from tensorflow.python.eager import context
    from tensorflow.python.eager.polymorphic_function import compiler_ir

    context.ensure_initialized()
    name = function_name.decode() if isinstance(function_name, bytes) else function_name
    ir = context.context().get_compiler_ir(
        device_name=compiler_ir.maybe_get_device_name(None), platform_name=None, function_name=name,
        flat_args=list(flat_args), captured_inputs=list(captured_inputs), stage=stage)
    return ir.decode("utf-8") if isinstance(ir, bytes) else ir


def flat_compile_args(concrete_fn, args, kwargs) -> list:
    """The flat arguments ``experimental_get_compiler_ir`` would pass for ``args``/``kwargs``."""
    from tensorflow.python.eager.polymorphic_function import function_type_utils

    values = list(args) + list(kwargs.values())
    if values and all(isinstance(v, tf.TensorSpec) for v in values):
        return list(tf.nest.flatten(concrete_fn.structured_input_signature))
    bound = function_type_utils.canonicalize_function_inputs(args, kwargs, concrete_fn.function_type)
    return list(concrete_fn.function_type.unpack_inputs(bound))


_PATCHED: dict[tuple[type, str], Callable] = {}   # (class, method) -> TensorFlow's own method, while wrapped


def _wrap_method(cls: type, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``cls.name`` by ``wrapper(original)`` (idempotent: a method wrapped already stays as it is)."""
    if (cls, name) in _PATCHED:
        return
    original = getattr(cls, name)
    setattr(cls, name, functools.wraps(original)(wrapper(original)))
    _PATCHED[(cls, name)] = original


def _unwrap_method(cls: type, name: str) -> None:
    original = _PATCHED.pop((cls, name), None)
    if original is not None:
        setattr(cls, name, original)


def install_gradient_recorder(record: Callable[..., None]) -> None:
    """Wrap ``GradientTape.gradient`` so that every call also runs
    ``record(target, sources, output_gradients, unconnected_gradients, result)`` (idempotent).

    The wrapper returns exactly what TensorFlow returns; ``record`` failing never breaks the call.
    """
    from tensorflow.python.eager import backprop

    def wrapper(original):
        def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None):
            from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

            unconnected = UnconnectedGradients.NONE if unconnected_gradients is None else unconnected_gradients
            result = original(self, target, sources, output_gradients, unconnected)
            try:
                record(target, sources, output_gradients, unconnected, result)
            except Exception:  # noqa: BLE001 - recording is best effort; the user's gradient stands
                pass
            return result

        return gradient

    _wrap_method(backprop.GradientTape, "gradient", wrapper)


def uninstall_gradient_recorder() -> None:
    from tensorflow.python.eager import backprop

    _unwrap_method(backprop.GradientTape, "gradient")


def install_call_check(check: Callable[[Any, list], list]) -> None:
    """Wrap ``ConcreteFunction._call_flat`` -- where every call of a traced function's program goes, from
    Python or from a function being traced -- so that it calls with ``check(concrete_fn, tensor_inputs)``:
    the inputs themselves, or the same values made to wait for a check (idempotent).  ``check``
    failing never breaks the call."""
    from tensorflow.python.eager.polymorphic_function import concrete_function

    def wrapper(original):
        def _call_flat(self, tensor_inputs, captured_inputs):
            try:
                tensor_inputs = check(self, tensor_inputs)
            except Exception:  # noqa: BLE001 - the check is best effort; the user's call stands
                pass
            return original(self, tensor_inputs, captured_inputs)

        return _call_flat

    _wrap_method(concrete_function.ConcreteFunction, "_call_flat", wrapper)


def uninstall_call_check() -> None:
    from tensorflow.python.eager.polymorphic_function import concrete_function

    _unwrap_method(concrete_function.ConcreteFunction, "_call_flat")


def tracing_without_python() -> bool:
    """Whether a function being traced now cannot be given an op that runs Python: one, at any depth of
    the calling frames, is compiled by XLA (``jit_compile=True``) or is a ``tf.data`` transformation, or
    it is traced to be saved (``tf.saved_model.save``: a loaded program has no Python to call).  (Not the
    graph's XLA context: a jit function's own call enters one.)"""
    from tensorflow.python.saved_model import save_context

    if save_context.in_save_context():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == _TRACE_FRAME and "tracing_options" in frame.f_locals:
            attributes = getattr(frame.f_locals["tracing_options"], "attributes", None) or {}
            if attributes.get(XLA_MUST_COMPILE, False) or attributes.get(_TF_DATA_FUNCTION, False):
                return True
        frame = frame.f_back
    return False
