"""constant_cumsum: a running sum of a constant-filled tensor as a scaled index, not a scan.

    cumsum(fill(dims, v), d)  =>  broadcast_to(v * k, dims),   k = iota_d + 1

along axis ``d`` of ``n = dims[d]`` elements; ``exclusive=True`` gives ``k = iota_d``,
``reverse=True`` gives ``k = n - iota_d``, both give ``k = n - 1 - iota_d``.

Why: TensorFlow's XLA bridge lowers ``Cumsum`` to a reduce-window whose window is the whole axis.
When its input is a constant, XLA's constant folder evaluates that window element by element at
compile time.  Measured on TF 2.21 XLA:CPU (``experiments/compile_time.py``, run alone), a Keras 3
causal ``MultiHeadAttention`` layer's first call takes 0.26 s at L = 1024 and 61.7 s at L = 2048 as
written, and 0.46 s at L = 2048 with its mask's scans rewritten (tf_keras' ``Attention``: 58.7 s, 0.18 s).
This is exactly the causal mask Keras 3 builds for
``MultiHeadAttention(use_causal_mask=True)`` (with dropout: without it Keras 3 calls the backend's
fused attention, masked by ``band_part``), ``Attention`` and ``GroupedQueryAttention``, and tf_keras
for its dense attention layers: over nine minutes of compile before a Keras 3 decoder at L = 2048
ran once (the issue's measurement).  An index vector broadcast is folded or fused in milliseconds,
and a split region can slice it like any elementwise op.  (Disabling XLA's constant folding,
``--xla_disable_hlo_passes=constant_folding``, also removes the stall, for every program of the
process: not what a pass may decide for a user.)

When it applies:

* ``Cumsum(x, axis)`` with a constant ``axis`` and a static rank, where ``x`` is ``Fill(dims, v)``
  (``tf.ones``/``tf.zeros``/``tf.fill`` of more than 1000 elements), ``BroadcastTo(v, dims)`` of a
  one-element constant, or ``OnesLike``/``ZerosLike`` (whose dims are the shape of their input);
  ``dims`` may be known only at run time (a mask built from ``tf.shape`` of a ``None``-length
  batch), ``v`` must be a constant;
* the ops a gradient recorded inside the function reads are left alone.

Why it is safe:

* integers: the sum of ``k`` copies of ``v`` is ``k * v`` in two's-complement arithmetic, overflow
  included (both wrap modulo 2^bits), so the result is bit-identical;
* floating point: every partial sum ``k * v`` is computed exactly by both forms when ``v`` is an
  integer and ``n * |v| <= 2^p`` (``p`` the significand's bits: 11 for float16, 8 for bfloat16, 24
  for float32, 53 for float64), so the result is bit-identical whatever order XLA sums in.  Other
  values (``v = 0.1``), a run-time ``n`` (whose bound cannot be shown) and complex dtypes are
  skipped with that reason: there the scan's rounding would differ.  ``v`` of NaN or an infinity
  gives NaN or that infinity in both forms; a ``-0.0`` fill gives ``-0.0`` where the scan gives
  ``+0.0`` (equal under ``==``);
* no gradient flows through a constant, so there is nothing to differentiate again.

What it does not handle: ``Cumprod`` and ``CumulativeLogsumexp`` of constants (powers and
logarithms round), running sums of non-constant tensors (nothing is slow there), and constants
captured as function inputs (``Placeholder``), which are not constants to the graph.

Pipeline position: first, before every pass that reads regions: the splitter then sees an index
broadcast that it slices along any axis, where the scan along the split axis couples its rows.
The pass fires whether or not the program fits the limit: it changes compile time, not memory,
and its result is bit-identical.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import gradients, graph_edit
from grappler_ext.graph_query import live_ops
from grappler_ext.op_types import nbytes
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import register_pass

__all__ = ["ConstantCumsum", "exact_float_bound", "float_refusal", "running_index"]

# Bits of the significand (the implicit bit included) of each floating dtype: integers up to
# 2^p are exactly representable, so are their sums and products below that bound.
_SIGNIFICAND_BITS = {tf.float16: 11, tf.bfloat16: 8, tf.float32: 24, tf.float64: 53}
# Ops whose output is one value in every element: (the input holding the dims, the input holding the value).
_FILLS = {"Fill": (0, 1), "BroadcastTo": (1, 0)}
# ... and those whose dims are the shape of their input: the value they fill with.
_LIKES = {"OnesLike": 1, "ZerosLike": 0}


def exact_float_bound(dtype: tf.DType) -> int | None:
    """The largest integer ``m`` such that every integer in ``[-m, m]`` is exact in ``dtype``;
    ``None`` for dtypes this pass does not treat as real floating point."""
    bits = _SIGNIFICAND_BITS.get(dtype.base_dtype)
    return None if bits is None else 2 ** bits


def running_index(n, exclusive: bool, reverse: bool, arange=np.arange):
    """The multiplier ``k`` of each position along the axis (``cumsum(ones(n))`` with the same
    flags).  The pass builds it from ``tf.range`` (``arange``) with ``n`` a tensor; tests check it
    against NumPy."""
    i = arange(n)
    if reverse:
        return n - 1 - i if exclusive else n - i
    return i if exclusive else i + 1


def float_refusal(dtype: tf.DType, value: np.ndarray, n: int | None, exclusive: bool) -> str | None:
    """Why a floating-point running sum of ``n`` copies of ``value`` might not equal ``k * value``
    bit for bit (``None``: it does), as the module docstring works out."""
    bound = exact_float_bound(dtype)
    if bound is None:
        return f"{dtype.name} is neither an integer nor a real floating-point type"
    v = float(value)
    if not np.isfinite(v):
        # inf and NaN propagate alike in both forms, but an exclusive sum starts at 0, where 0 * inf is NaN.
        return f"an exclusive running sum of {v!r}: its first element is 0, not 0 x {v!r}" if exclusive else None
    if v != np.round(v):
        return (f"a {dtype.name} fill of {value.item()!r}, not an integer: the scan's partial sums round "
                "differently from their products")
    if n is None:
        return (f"a {dtype.name} running sum over a length known only at run time: its partial sums cannot be "
                "shown exact")
    if n * abs(v) > bound:
        return (f"{n} x |{value.item()!r}| > 2^{_SIGNIFICAND_BITS[dtype.base_dtype]}: the partial sums are not "
                f"all exact in {dtype.name}")
    return None


def _filled(t: tf.Tensor):
    """What fills ``t`` with one value: ``(source, like, value)``, where ``source`` is the dims tensor
    (``like`` False) or the tensor whose shape the dims are (``like`` True); a reason string where
    ``t`` is a fill whose value cannot be read; ``None`` where ``t`` is not a fill."""
    op = t.op
    if op.type in _LIKES:
        return op.inputs[0], True, np.array(_LIKES[op.type], dtype=t.dtype.as_numpy_dtype)
    if op.type not in _FILLS:
        return None
    dims_at, value_at = _FILLS[op.type]
    value = tensor_util.constant_value(op.inputs[value_at])
    if value is None:
        return f"the fill value of `{op.name}` is not a constant"
    if value.size != 1:
        return f"`{op.name}` broadcasts a {value.size}-element tensor, not one value"
    return op.inputs[dims_at], False, value.reshape(())


@register_pass
class ConstantCumsum(GraphPass):
    name = "constant_cumsum"
    motive = Motive.COMPILE

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)
        backward = gradients.backward_ops(graph)
        for op in list(graph.get_operations()):
            if (op.type != "Cumsum" or op not in live or op in backward
                    or graph_edit.is_generated(op)):
                continue
            filled = _filled(op.inputs[0])
            if isinstance(filled, str):
                result.skip([op], f"a running sum of a fill, but {filled}")
            elif filled is not None:
                self._rewrite(graph, op, *filled, result)
        return result

    def _rewrite(self, graph, op: tf.Operation, source: tf.Tensor, like: bool, value: np.ndarray,
                 result: PassResult) -> None:
        out = op.outputs[0]
        fill = op.inputs[0].op
        ops = [op.name, fill.name]
        rank = out.shape.rank
        axis = tensor_util.constant_value(op.inputs[1])
        if rank is None or axis is None:
            result.skip(ops, "the running sum's rank or axis is not known when the function is traced")
            return
        axis = int(axis) % rank
        dtype = out.dtype
        n_static = out.shape[axis]
        exclusive, reverse = bool(op.get_attr("exclusive")), bool(op.get_attr("reverse"))
        refusal = None if dtype.is_integer else float_refusal(dtype, value, n_static, exclusive)
        if refusal:
            result.skip(ops, refusal, bytes_before=nbytes(out))
            return
        with graph_edit.building(graph, self.name):
            # The dims tensor as the fill read it (the splitter follows shapes read from tf.shape).
            shape = tf.shape(source) if like else source
            n = tf.constant(n_static, shape.dtype) if n_static is not None else shape[axis]
            # k: how many fill values are summed at each position.
            k = running_index(n, exclusive, reverse, arange=lambda n: tf.range(n, dtype=shape.dtype))
            along = tf.cast(k, dtype) * tf.constant(value, dtype)               # [n]
            line = tf.reshape(along, [1] * axis + [-1] + [1] * (rank - axis - 1))
            new = tf.broadcast_to(line, shape)                                  # dims
            new.set_shape(out.shape)
        graph_edit.replace_uses(out, new)
        gradients.retarget(graph, out, new)
        shown = "x".join("?" if d is None else str(d) for d in out.shape.as_list())
        flags = ", ".join(f for f, on in (("exclusive", exclusive), ("reverse", reverse)) if on)
        result.rewrote(ops, f"running sum of a {dtype.name}[{shown}] fill of {value.item()!r} along axis {axis}"
                            f"{f' ({flags})' if flags else ''} as a broadcast index: no scan for XLA to fold "
                            "at compile time", bytes_before=nbytes(out), bytes_after=nbytes(out))
