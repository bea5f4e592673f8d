"""Slices along one axis, and slices joined back: the two halves every split loop is made of.

    dynamic_slice(t, axis, offset, c)   =  t[.., offset:offset + c, ..]       (static shape, offset a tensor)
    join_slices(stacked slices, axis)   =  concat(slices, axis)               (one transpose and a reshape)

The loops (:mod:`.loop`) cut their inputs with the first; the combiners (:mod:`.combiners`) join
their outputs with the second and route a concatenated output's gradient back to its slices with
the first.  Nothing here knows about regions or plans.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["dynamic_slice", "join_slices"]


def dynamic_slice(t: tf.Tensor, axis: int, offset, size: int) -> tf.Tensor:
    """``t[.., offset:offset + size, ..]`` along ``axis``, with a static result shape."""
    shape = t.shape.as_list()
    begin = tf.one_hot(axis, len(shape), on_value=tf.cast(offset, tf.int32), off_value=0, dtype=tf.int32)
    sizes = list(shape)
    sizes[axis] = size
    return tf.slice(t, begin, sizes)


def join_slices(array: tf.TensorArray, axis: int, tail: tf.Tensor | None) -> tf.Tensor:
    """Join the slices written to ``array`` (each ``[.., c, ..]``, ``c`` at ``axis``) and ``tail``.

    ``stack`` gives ``[S, .., c, ..]``; moving ``S`` next to the split axis and merging the two
    axes gives the slices in order along ``axis``; the remainder slice is appended.
    """
    stacked = array.stack()                                             # [S, d0, .., c, ..]
    shape = stacked.shape.as_list()
    rank = len(shape) - 1
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank + 1))
    moved = tf.transpose(stacked, perm) if axis else stacked             # [d0, .., S, c, ..]
    out = tf.reshape(moved, shape[1:axis + 1] + [shape[0] * shape[axis + 1]] + shape[axis + 2:])
    return out if tail is None else tf.concat([out, tail], axis=axis)
