"""blocked_top_k: a top-k over a long axis as a top-k over blocks' maxima, then over the chosen blocks.

    top_k(x, k)   x: [.., n]   =>   m = max of each block of B along the axis (XLA's total order)  [.., n / B]
                                    b = sort(top_k(m, k).indices)                                    [.., k]
                                    v, j = top_k(x at the k blocks b, in order, k)                   [.., k B]
                                    indices = (b B + position in the block)[j]

Why: XLA:CPU's ``TopK`` on float32 is a runtime call that copies each row into (value, index) pairs and
partially sorts them, about 1 ns an element; on other dtypes (float64, bfloat16, float16, integers) it is a
full sort of each row, 10-40x slower still.  The block maxima are one fused, vectorised reduction over
the row (0.1 ns an element), and the two top-k's left are over ``n / B`` and ``k B`` elements.  Measured on
TF 2.21 XLA:CPU, 2 cores, the median of 5 calls of the op alone at B = 16: float32 [200, 100000], k = 10:
0.23x the time of ``tf.math.top_k``; [4000, 4096], k = 10: 0.59x; k = 100 at n = 4096 (n / kB = 2.6):
1.36x, so it is not used there; float64 and bfloat16: 0.04-0.4x.  The brute-force k-nearest-neighbour
search, whose time is mostly this top-k (``experiments/knn.py``), is where it counts.

When it applies (:func:`refusal` says why not, for the record):

* ``TopKV2`` with a constant ``k >= 1`` and a static last axis ``n`` (the leading axes may be known
  only at run time);
* a real floating or an integer dtype;
* ``n >= ratio * k * B``, ``ratio`` 16 for float32 (its fast runtime call) and 4 for the sorted dtypes:
  below that the blocks chosen are most of the row (measured above);
* the program stays within its limit by the memory model with the block maxima added (``n / B`` of the
  input: 1/16, and the ``k B`` candidates): otherwise the pass leaves the op and says so.

Why it is exact, ties and NaN included (values and indices equal to ``tf.math.top_k``'s as XLA
computes it, bit for bit): XLA's ``TopK`` orders floats by their total order (-NaN < -inf < .. < -0.0 <
+0.0 < .. < +inf < +NaN, NaNs by payload) and breaks ties by the lower index.  The block maxima are
taken in that same order, exactly: each element's bits as a signed integer, with the magnitude bits
flipped for negative values, is monotone in the total order, and the maximum of those integers mapped
back (the map is its own inverse) is the block's greatest element itself.  An element outside the
chosen blocks is beaten by each chosen block's maximum: strictly where that maximum is greater, and by
index where it is equal (a tie between blocks' maxima goes to the lower block, which holds the lower
indices).  So the k best elements all lie in the chosen blocks; those are read in the order of their
indices, so that the last top-k breaks ties as the whole one does.  A last block shorter than ``B`` has
the maximum of what it holds, and its candidates past ``n`` read as the least value, which lose every
tie (their indices are the highest).  ``sorted=False`` asks for no order: the result is sorted anyway.

Gradients: the values are a gather of ``x`` followed by a top-k, both differentiable; the keys are
integers, read only for the indices.  A gradient recorded inside the function reads the op's indices,
which it then reads from the new op (the same values).

The splitter (:mod:`grappler_ext.splitter`) uses :func:`top_k` for each slice's top-k where a
top-k's axis is split into chunks (a kNN search over more points than fit): :func:`rebuilt` clones the
op where :func:`refusal` says no for the slice's own length.

Pipeline position: last, after the splitter, on the top-k's it left in the program (a top-k that fits);
before it, the splitter would no longer see a ``TopKV2`` root to split the points along.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext import gradients, graph_edit, memory_model
from grappler_ext.graph_query import live_ops
from grappler_ext.op_types import nbytes
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import register_pass

__all__ = ["BlockedTopK", "BLOCK", "refusal", "top_k", "rebuilt", "order_keys"]

BLOCK = 16
# n / (k B) from which the blocked form is faster, by dtype (measured: see the module docstring).
_RATIO_FAST = 16           # float32: XLA:CPU's TopK runtime call
_RATIO_SORTED = 4          # every other dtype: XLA sorts each row
# What the pipeline lets a pass that saves time add to a program: the splitter's ``model_trust``.
_TRUST = 0.8
_KEY_DTYPES = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}
_INTEGERS = (tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64)


def refusal(n: int | None, k: int | None, dtype: tf.DType, block: int = BLOCK) -> str | None:
    """Why a top-k of ``k`` over ``n`` elements of ``dtype`` is left as it is (``None``: blocked)."""
    if k is None:
        return "its k is not a constant"
    if n is None:
        return "its axis' length is known only at run time"
    if dtype.base_dtype not in _KEY_DTYPES and dtype.base_dtype not in _INTEGERS:
        return f"{dtype.name} has no order the blocks can keep"
    ratio = _RATIO_FAST if dtype.base_dtype == tf.float32 else _RATIO_SORTED
    if k < 1 or n < ratio * k * block:
        return (f"{n} elements are under {ratio} x k x {block} = {ratio * k * block} for k = {k}: the chosen blocks "
                "would be most of the row, and one top-k is as fast")
    return None


def order_keys(x: tf.Tensor) -> tf.Tensor:
    """Signed integers in the order of ``x``'s values (floats: their total order, NaNs included);
    integers are their own keys."""
    key = _KEY_DTYPES.get(x.dtype.base_dtype)
    return x if key is None else _flipped(tf.bitcast(x, key))


def _flipped(bits: tf.Tensor) -> tf.Tensor:
    """Signed integers with their magnitude bits flipped where negative: a float's bits to its key,
    and a key back to the bits."""
    width = bits.dtype.size * 8
    magnitude = tf.constant(2 ** (width - 1) - 1, bits.dtype)
    flip = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, width - 1), magnitude)
    return tf.bitwise.bitwise_xor(bits, flip)


def _least(dtype: tf.DType):
    """The value every other is at least in the order ``top_k`` uses (for floats: -NaN, all bits set)."""
    key = _KEY_DTYPES.get(dtype.base_dtype)
    if key is None:
        return tf.constant(dtype.min, dtype)
    return tf.bitcast(tf.constant(-1, key), dtype)


def top_k(x: tf.Tensor, k: int, block: int = BLOCK, index_dtype: tf.DType = tf.int32) -> tuple[tf.Tensor, tf.Tensor]:
    """``tf.math.top_k(x, k)`` along the last axis (static), through the ``block``-wide blocks' maxima."""
    n = int(x.shape[-1])
    lead = x.shape[:-1]
    rows = tf.reshape(x, [-1, n])                                             # [P, n]
    pad = -n % block
    whole = n // block                                                        # blocks of B; one more if pad
    keys = order_keys(rows)
    best = tf.reduce_max(tf.reshape(keys[:, :whole * block], [-1, whole, block]), axis=-1)   # [P, n / B]
    if pad:
        # The short last block's maximum (a slice XLA fuses, where padding the keys was 3x slower).
        best = tf.concat([best, tf.reduce_max(keys[:, whole * block:], axis=-1, keepdims=True)], axis=-1)
    if keys.dtype != rows.dtype:
        best = tf.bitcast(_flipped(best), rows.dtype)                       # each block's greatest element
    _, chosen = tf.math.top_k(best, k)                                        # [P, k]
    chosen = tf.sort(chosen, axis=-1)                                         # in index order: ties as top_k
    where = tf.reshape(chosen[:, :, None] * block + tf.range(block)[None, None], [-1, k * block])
    if pad:
        inside = where < n
        values = tf.gather(rows, tf.minimum(where, n - 1), batch_dims=1)
        values = tf.where(inside, values, _least(rows.dtype))
    else:
        values = tf.gather(rows, where, batch_dims=1)                          # [P, k B]
    top, at = tf.math.top_k(values, k)
    indices = tf.cast(tf.gather(where, at, batch_dims=1), index_dtype)
    if lead.is_fully_defined():
        out_shape = lead.as_list() + [k]
    else:
        out_shape = tf.concat([tf.shape(x)[:-1], [k]], axis=0)
    return tf.reshape(top, out_shape), tf.reshape(indices, out_shape)


def _k_of(op: tf.Operation) -> int | None:
    value = tensor_util.constant_value(op.inputs[1])
    return None if value is None else int(value)


def _index_dtype(op: tf.Operation) -> tf.DType:
    try:
        return tf.as_dtype(op.get_attr("index_type"))
    except ValueError:
        return tf.int32


def _decide(op: tf.Operation, x: tf.Tensor) -> tuple[int | None, str | None]:
    """``TopKV2`` ``op`` on ``x``: its ``k`` and :func:`refusal`'s answer at ``x``'s length."""
    k = _k_of(op)
    return k, refusal(x.shape[-1] if x.shape.rank else None, k, x.dtype)


def rebuilt(op: tf.Operation, inputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``TopKV2`` ``op`` on ``inputs``: blocked where :func:`refusal` allows at the inputs' length,
    else cloned."""
    k, why = _decide(op, inputs[0])
    if why is not None:
        return graph_edit.clone_op(op, inputs)
    return list(top_k(inputs[0], k, index_dtype=_index_dtype(op)))


@register_pass
class BlockedTopK(GraphPass):
    name = "blocked_top_k"
    motive = Motive.TIME

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        live = live_ops(graph)
        found = [op for op in graph.get_operations()
                 if op.type == "TopKV2" and op in live and not graph_edit.is_generated(op)]
        if not found:
            return result
        limit = getattr(options, "memory_limit_bytes", None)
        room = None
        if limit is not None:
            estimate, _ = memory_model.analyse(graph)
            room = None if estimate.peak_bytes is None else int(_TRUST * limit) - estimate.peak_bytes
        for op in found:
            x = op.inputs[0]
            k, why = _decide(op, x)
            if why is not None:
                result.skip([op], f"a top-k left as it is: {why}", bytes_before=nbytes(x))
                continue
            extra = self._extra_bytes(x, k)
            if limit is not None and (room is None or extra > room):
                shown = "cannot count the program" if room is None else f"leaves {max(room, 0):,} B"
                result.skip([op], f"its block maxima would need {extra:,} B more, and the memory model {shown} "
                                  f"under {_TRUST:g} of the limit", bytes_before=nbytes(x))
                continue
            if room is not None:
                room -= extra
            self._rewrite(graph, op, x, k, result)
        return result

    @staticmethod
    def _extra_bytes(x: tf.Tensor, k: int) -> int:
        """The blocked form's tensors beside the input: the block maxima and the candidates."""
        rows = int(np.prod(x.shape.as_list()[:-1] or [1])) if x.shape[:-1].is_fully_defined() else None
        if rows is None:
            return 0
        n = int(x.shape[-1])
        return rows * ((n + BLOCK - 1) // BLOCK * 2 + k * BLOCK) * x.dtype.size

    def _rewrite(self, graph, op: tf.Operation, x: tf.Tensor, k: int, result: PassResult) -> None:
        with graph_edit.building(graph, self.name):
            values, indices = top_k(x, k, index_dtype=_index_dtype(op))
            values.set_shape(op.outputs[0].shape)
            indices.set_shape(op.outputs[1].shape)
        for old, new in zip(op.outputs, (values, indices)):
            graph_edit.replace_uses(old, new)
            gradients.retarget(graph, old, new)
        shown = "x".join("?" if d is None else str(d) for d in x.shape.as_list())
        result.rewrote([op.name], f"top-{k} of {x.dtype.name}[{shown}] through the maxima of blocks of {BLOCK}: "
                                  f"one reduction over the row, then top-k's over {-(-int(x.shape[-1]) // BLOCK)} "
                                  f"block maxima and {k * BLOCK} candidates", bytes_before=nbytes(x),
                       bytes_after=nbytes(x))
