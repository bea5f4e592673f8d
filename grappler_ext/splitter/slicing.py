"""Slices along one axis, and slices joined back: the two halves every split loop is made of.

    dynamic_slice(t, axis, offset, c)   =  t[.., offset:offset + c, ..]       (static shape, offset a tensor)
    join_slices(stacked slices, axis)   =  concat(slices, axis)               (one transpose and a reshape)

and where the split axis is a factor of a tensor's axis (:class:`Factor`: ``[B * L, E]`` reshaped from
``[B, L, E]``, split along ``L``), the same two through that factor:

    factored_slice(t, axis, offset, c, f)   =  the rows of t's axis that rows offset:offset + c of the
                                               split axis are (f.outer runs of c * f.inner rows)
    join_slices(.., outer=f.outer)          =  those slices put back in their places

and, for an axis whose length ``n`` is known only at run time (a loop of ``ceil(n / c)`` slices of
``c``, the last one running past ``n``):

    clamped_slice(t, axis, offset, c)   =  t[.., min(offset + i, n - 1), ..] for i < c  (static shape)
    valid_rows(offset, c, n)            =  offset + i < n                       ([c] booleans)
    mask_rows(t, axis, valid, fill)     =  t where valid, else fill

The loops (:mod:`.loop`) cut their inputs with the first; the combiners (:mod:`.combiners`) join
their outputs with the second and route a concatenated output's gradient back to its slices with
the first.  Nothing here knows about regions or plans.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from grappler_ext import shapes

__all__ = ["Factor", "UNIT", "factored_slice", "dynamic_slice", "join_slices", "clamped_slice",
           "valid_rows", "mask_rows", "trimmed", "axis_length"]


@dataclasses.dataclass(frozen=True)
class Factor:
    """Where the split axis lies inside one axis of a tensor, by factors (as XLA's SPMD partitioner
    and Shardy see an axis through a reshape): that axis is ``[outer, n, inner]`` merged, ``n`` the
    split axis' length.  Rows ``[s, s + c)`` of the split axis are, in that axis, ``outer`` runs of
    ``c * inner`` rows starting at ``s * inner``, ``n * inner`` apart.

    ``[4, 512, E]`` split along its batch is ``Factor(1, 512)`` in the ``[2048, E]`` it was reshaped
    from (one contiguous run); split along its sequence, ``Factor(4, 1)`` there (4 runs).  Planned
    with sizes known only at run time (a padded batch's ``[B * L, E]``), ``outer`` and ``inner`` are
    exact sizes (:func:`grappler_ext.shapes.exact_dims`) and :meth:`at_run` gives them when the
    function runs: ints, or scalar tensors XLA resolves when it compiles.
    """

    outer: int = 1
    inner: int = 1

    def __post_init__(self):
        if isinstance(self.outer, int) and isinstance(self.inner, int) and (self.outer < 1 or self.inner < 1):
            raise ValueError(f"a factor's outer and inner sizes are positive, not {self.outer} and {self.inner}")

    @property
    def unit(self) -> bool:
        """Whether the split axis is the tensor's axis itself."""
        return _is_one(self.outer) and _is_one(self.inner)

    @property
    def symbolic(self) -> bool:
        """Whether its sizes are known only when the function runs."""
        return shapes.is_symbolic(self.outer) or shapes.is_symbolic(self.inner)

    def rows(self, chunk):
        """The rows of the tensor's axis that ``chunk`` rows of the split axis are."""
        return self.outer * chunk * self.inner

    def at_run(self, table: shapes.Symbols | None) -> Factor:
        """This factor with its sizes as the function runs (``table``: the run-time sizes it was
        planned with, needed where it is :attr:`symbolic`)."""
        if not self.symbolic:
            return self
        if table is None:
            raise ValueError(f"the factor {self} has sizes known only at run time, and no table of them was given")
        return Factor(table.run_exact(self.outer), table.run_exact(self.inner))

    def __str__(self) -> str:
        if self.unit:
            return "whole axis"
        if self.symbolic:
            return f"[{shapes.describe_exact(self.outer)}, n, {shapes.describe_exact(self.inner)}]"
        return f"[{self.outer}, n, {self.inner}]"


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


UNIT = Factor()


def factored_slice(t: tf.Tensor, axis: int, offset, size, factor: Factor = UNIT, cut=None) -> tf.Tensor:
    """The rows of ``t``'s ``axis`` that rows ``offset .. offset + size - 1`` of the split axis are,
    in order (``factor``: where the split axis lies in ``t``'s axis, with its sizes as the function
    runs: :meth:`Factor.at_run`); ``cut`` slices a whole axis (default :func:`dynamic_slice`).  More
    than one run (``factor.outer > 1``): the axis is viewed as ``[outer, n * inner]``, sliced in its
    second part and merged back."""
    cut = cut or dynamic_slice
    if _is_one(factor.outer):
        return cut(t, axis, offset * factor.inner, size * factor.inner)
    piece = cut(_reshaped(t, axis, 1, [factor.outer, -1]), axis + 1, offset * factor.inner, size * factor.inner)
    return _reshaped(piece, axis, 2, [-1])


def _reshaped(t: tf.Tensor, axis: int, width: int, middle: list) -> tf.Tensor:
    """``t`` with its axes ``axis .. axis + width - 1`` reshaped to ``middle`` (ints, one -1, or
    scalar tensors); its other axes as they are, read when the function runs where they are not static."""
    dims = t.shape.as_list()
    if all(isinstance(m, int) for m in middle) and all(d is not None for d in dims[:axis] + dims[axis + width:]):
        return tf.reshape(t, dims[:axis] + list(middle) + dims[axis + width:])
    run = tf.shape(t, out_type=tf.int32)
    return tf.reshape(t, tf.concat([run[:axis], tf.stack([tf.cast(m, tf.int32) for m in middle]),
                                    run[axis + width:]], 0))


def dynamic_slice(t: tf.Tensor, axis: int, offset, size) -> tf.Tensor:
    """``t[.., offset:offset + size, ..]`` along ``axis``, with a static result shape (but for the
    dimensions known only at run time, and ``size`` if it is a tensor: :mod:`.scaling`)."""
    shape = t.shape.as_list()
    begin = tf.one_hot(axis, len(shape), on_value=tf.cast(offset, tf.int32), off_value=0, dtype=tf.int32)
    sizes = [-1 if d is None else d for d in shape]
    sizes[axis] = size
    if isinstance(size, tf.Tensor):
        sizes = tf.stack([tf.cast(d, tf.int32) for d in sizes])
    return tf.slice(t, begin, sizes)


def join_slices(array: tf.TensorArray, axis: int, tail: tf.Tensor | None, length=None, outer=1) -> tf.Tensor:
    """Join the slices written to ``array`` (each ``[.., c, ..]``, ``c`` at ``axis``) and ``tail``.

    ``stack`` gives ``[S, .., c, ..]``; moving ``S`` next to the split axis and merging the two
    axes gives the slices in order along ``axis``; the remainder slice is appended.  ``length``
    (a scalar tensor): the number of slices is known only at run time, and the joined rows past
    ``length`` (the last slice's, past the end) are cut off.  ``outer``: each slice is that many
    runs of rows (a :class:`Factor`'s, an int or a scalar tensor), joined run by run, each cut to
    ``length / outer`` rows.
    """
    stacked = array.stack()                                             # [S, d0, .., c, ..]
    if not _is_one(outer):
        if tail is not None:
            tail = _reshaped(tail, axis, 1, [outer, -1])
        joined = _join(_reshaped(stacked, axis + 1, 1, [outer, -1]), axis + 1, tail,
                       None if length is None else length // outer)          # [.., outer, n, ..]
        return _reshaped(joined, axis, 2, [-1])
    return _join(stacked, axis, tail, length)


def _join(stacked: tf.Tensor, axis: int, tail: tf.Tensor | None, length) -> tf.Tensor:
    """:func:`join_slices` of the stacked slices ``[S, .., c, ..]``."""
    shape = stacked.shape.as_list()
    rank = len(shape) - 1
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank + 1))
    moved = tf.transpose(stacked, perm) if axis else stacked             # [d0, .., S, c, ..]
    merged = -1 if shape[0] is None or shape[axis + 1] is None else shape[0] * shape[axis + 1]
    target = shape[1:axis + 1] + [merged] + shape[axis + 2:]
    if any(d is None for d in target):
        # Slices whose other dimensions shape inference lost (a gradient's): read when it runs.
        dims = tf.shape(stacked)
        target = tf.stack([dims[i + 1] if d is None else d for i, d in enumerate(shape[1:axis + 1])] + [merged]
                          + [dims[axis + 2 + i] if d is None else d for i, d in enumerate(shape[axis + 2:])])
    out = tf.reshape(moved, target)
    if length is not None:
        out = trimmed(out, axis, length)
    return out if tail is None else tf.concat([out, tail], axis=axis)


def axis_length(t: tf.Tensor, axis: int) -> tf.Tensor:
    """``t``'s length along ``axis`` as an int32 scalar (a constant XLA resolves when it compiles)."""
    return tf.shape(t, out_type=tf.int32)[axis]


def trimmed(t: tf.Tensor, axis: int, length) -> tf.Tensor:
    """The first ``length`` rows of ``t`` along ``axis``."""
    rank = t.shape.rank
    # Built by concatenation, which XLA resolves to a constant when it compiles (a scatter into the
    # sizes is not resolved: XLA then keeps the whole bound, silently).
    size = tf.concat([tf.fill([axis], -1), tf.reshape(tf.cast(length, tf.int32), [1]),
                      tf.fill([rank - axis - 1], -1)], 0)
    out = tf.slice(t, tf.zeros([rank], tf.int32), size)
    known = t.shape.as_list()
    known[axis] = None
    out.set_shape(known)                         # the other dimensions as they were
    return out


def clamped_slice(t: tf.Tensor, axis: int, offset, size: int) -> tf.Tensor:
    """Rows ``offset .. offset + size - 1`` of ``t`` along ``axis``, each index past the end read as
    the last row: a static ``[.., size, ..]`` slice whatever ``t``'s length (one row of zeros is read
    if ``t`` is empty: XLA compiles the loop's body even when it never runs)."""
    n = axis_length(t, axis)
    rank = t.shape.rank
    paddings = tf.concat([tf.zeros([axis, 2], tf.int32), tf.reshape(tf.stack([0, tf.maximum(0, 1 - n)]), [1, 2]),
                          tf.zeros([rank - axis - 1, 2], tf.int32)], 0)
    t = tf.pad(t, paddings)                      # no padding at all unless t is empty: XLA drops it
    index = tf.minimum(tf.cast(offset, tf.int32) + tf.range(size), tf.maximum(n, 1) - 1)
    return tf.gather(t, index, axis=axis)


def valid_rows(offset, size: int, length) -> tf.Tensor:
    """``[size]`` booleans: which rows of the slice at ``offset`` are before ``length``."""
    return tf.cast(offset, tf.int32) + tf.range(size) < tf.cast(length, tf.int32)


def mask_rows(t: tf.Tensor, axis: int, valid: tf.Tensor, fill) -> tf.Tensor:
    """``t`` with the rows along ``axis`` that ``valid`` marks false replaced by ``fill``."""
    shape = [1] * t.shape.rank
    shape[axis] = -1
    return tf.where(tf.reshape(valid, shape), t, tf.cast(fill, t.dtype))
