"""A call under a ``tf.GradientTape`` outside the function: the two programs it runs, checked once.

With the tape outside a ``jit_compile=True`` function, TensorFlow compiles two programs of its own
making from the trace tf_memsafe rewrote: a forward that also returns what the gradient will read,
and the backward.  Neither passes through the hook (TensorFlow builds them at the call), and the
forward holds more than the function's own program: what the backward reads, kept to the end.  A
function whose own program is within its limit may so run over it (measured: a Gaussian mixture's
negative log-likelihood within 12 MB as traced ran a 19.0 MB forward).

So the first eager call of a function the hook planned under a limit (and did not warn about) that a
tape may record compiles that pair -- both, neither run, as :func:`tf_memsafe.tape_footprint` does --
and where either is over the limit, one warning says so and what to do: take the gradient inside the
function, where the splitter plans the backward too, or raise the limit.  A function is checked at
the first such call only (other shapes, other tapes: not again).
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from grappler_ext.splitter.outcome import megabytes

__all__ = ["TAPE_ATTR", "watch", "on_call"]

# On a traced FuncGraph: the limit its calls under a tape outside it are checked against, until checked.
TAPE_ATTR = "_tf_memsafe_tape_check"


def watch(graph, limit: int) -> None:
    """Have the first call of ``graph``'s function under a tape outside it checked against ``limit``."""
    setattr(graph, TAPE_ATTR, limit)


def on_call(concrete, tensor_inputs) -> None:
    """Check this call of ``concrete`` if it is the first a tape records; warn once where it is over.
    (Every call of a traced function passes here: nothing but an attribute is read until then.)"""
    graph = getattr(concrete, "graph", None)
    limit = getattr(graph, TAPE_ATTR, None)
    if limit is None or not tf.executing_eagerly() or not _recording(concrete, tensor_inputs):
        return
    setattr(graph, TAPE_ATTR, None)                     # (once, whatever comes of it)
    from tf_memsafe.memory import pair_figures  # memory imports the hook, which imports this module

    shown = graph.name.removeprefix("__inference_").rsplit("_", 1)[0] or graph.name
    try:
        pair = pair_figures(concrete, list(tensor_inputs), shown)
    except Exception:  # noqa: BLE001 - a program XLA cannot compile from shapes: not said either way
        return
    if max(pair.forward, pair.backward) <= limit:
        return
    warnings.warn(
        f"tf_memsafe: `{shown}` called under a GradientTape outside it runs a forward of "
        f"{megabytes(pair.forward)} and a backward of {megabytes(pair.backward)} by XLA's figures, over its "
        f"limit of {megabytes(limit)}: TensorFlow's forward keeps what the backward "
        "reads, which tf_memsafe does not plan. Take the gradient inside the function (a tf.GradientTape in it: "
        "the splitter then plans the backward too), or raise memory_limit.", RuntimeWarning, stacklevel=4)


def _recording(concrete, tensor_inputs) -> bool:
    """Whether a tape records this call: TensorFlow's own test, by which it picks the programs to run,
    after it tells the tapes of the variables the function reads (which it does next, itself)."""
    from tensorflow.python.eager import record
    from tensorflow.python.ops import gradients_util, resource_variable_ops

    if not record.could_possibly_record():
        return False
    for v in concrete.graph.variables:
        resource_variable_ops.variable_accessed(v)
    found = gradients_util.PossibleTapeGradientTypes(list(tensor_inputs) + list(concrete.captured_inputs))
    return found != gradients_util.POSSIBLE_GRADIENT_TYPES_NONE
