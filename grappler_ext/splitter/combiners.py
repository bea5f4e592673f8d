"""Combiners: how the results of a region's slices make the region's whole result, exactly.

The splitter computes a region on slices ``[s, s + c)`` of a split axis of length ``L``: a loop of
``L // c`` full slices, then at most one remainder ("tail") slice.  On each slice it runs the
region's *root* op on the sliced operands, giving a *partial* result; a combiner folds the
partials, in slice order, into the root's output:

=============  =====================================================  ===========================
combiner       rule                                                   gradient (tape outside)
=============  =====================================================  ===========================
``concat``     out[.., s:s+c, ..] = root(slice)  (split axis kept)    upstream sliced
``sum``        out = sum_s root(slice)   (Sum; MatMul contracting)    upstream, whole
``mean``       out = sum_s root(slice) * c / L                        upstream * c / L
``max/min``    out = max_s root(slice); the ties counted too, and     ``dy`` to the slice holding a
               where the first maximum is                             unique one; ``dy * t_s / T`` to
                                                                      a slice with ``t_s`` of ``T`` ties
``prod``       out = prod_s root(slice)                               none
``all/any``    out = and/or_s root(slice)                             (boolean)
``arg``        running (value, index + s); strict improvement only,   (integer)
               so ties keep the first index, as ``tf.argmax`` does
``online_``     softmax(S) @ V over slices of the keys: running max,   rescaled upstream (see the
``softmax``    normaliser and rescaled accumulator                    class)
``top_k``      merge [carry, slice] and take top k again; the carry   upstream scattered to the
               comes first, so equal values keep lower indices, as    selected positions
               ``tf.math.top_k`` orders them
=============  =====================================================  ===========================

Numerics: ``concat``, ``max/min``, ``all/any``, ``arg`` and ``top_k`` are exact.  ``sum``,
``mean`` and ``prod`` reassociate a floating-point reduction (the original reduces in XLA's own
order, which is not specified either): results differ by rounding only (a float16 or bfloat16 sum
is carried in float32 and rounded once, as XLA sums it unsplit: :func:`accumulated`), and integer
results are exact (an integer ``mean`` is refused: truncated slice means do not give the truncated mean).
NaN propagates through ``sum``/``mean``/``prod``; ``max``/``min`` of a NaN follow
``tf.maximum``/``tf.minimum``, which on TF 2.21 CPU propagate it without XLA and not under it,
as the unsplit reductions do.  ``arg`` takes each slice's value at its arg index and lets any
number beat a NaN carry, as ``tf.math.argmax`` never picks a NaN (under XLA the unsplit argmax of
a lane with a NaN follows no rule we can match).

Gradients: the splitter wraps each loop in a ``tf.custom_gradient`` whose backward recomputes the
slices; a combiner says what upstream gradient each slice's partial receives
(:meth:`Combiner.slice_upstream`).  ``max``/``min`` of floats use :class:`Extremum`, which also
counts the ties.  ``prod`` would need every slice's zeros counted; it reports
``differentiable = False`` and the splitter uses it only where no floating output needs a
gradient (or refuses with that reason).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from grappler_ext import shapes
from grappler_ext.splitter.slicing import clamped_slice, dynamic_slice, join_slices, mask_rows, valid_rows

__all__ = ["RunSpec", "dims_of", "value_at", "tie_count", "first_at", "nan_propagating", "softmax_partials",
           "accumulated", "Combiner", "Concat", "InPlace", "write_slice", "with_rows", "Sum", "Mean", "Reduce",
           "Extremum", "OnlineSoftmax", "Arg", "TopK", "Group", "combiner_for_reduction",
           "REDUCTION_COMBINERS"]


class RunSpec:
    """A partial result's spec whose dimensions are partly known only at run time: the static
    ``shape`` (``None`` there) of a partial shaped as ``source`` (size 1 along ``unit_axes``), and,
    once the loop is built, its run-time sizes (``run``: a shape tensor XLA resolves when it compiles)."""

    def __init__(self, source: tf.Tensor, dtype: tf.DType, unit_axes=(), run: tf.Tensor | None = None):
        self.source, self.dtype, self.unit_axes, self.run = source, dtype, tuple(unit_axes), run
        dims = source.shape.as_list()
        for axis in self.unit_axes:
            dims[axis] = 1
        self.shape = tf.TensorShape(dims)

    def bound(self, run: tf.Tensor | None) -> RunSpec:
        if run is None:
            raise ValueError(f"the sizes of `{self.source.name}` {self.source.shape} are not products of the "
                             "function's run-time sizes")
        return RunSpec(self.source, self.dtype, self.unit_axes, run)

    def dims(self) -> tf.Tensor:
        if self.run is None:
            raise ValueError(f"a partial of shape {self.shape} whose sizes are read at run time has no sizes bound")
        return self.run


def dims_of(spec) -> tf.TensorShape | tf.Tensor:
    """The shape to make an initial carry of ``spec`` in: static, or read at run time (:class:`RunSpec`)."""
    return spec.dims() if isinstance(spec, RunSpec) else spec.shape


class Combiner(abc.ABC):
    """Folds partial results ``p_0, p_1, ...`` (one list of tensors per slice) into the outputs."""

    name: str = ""
    differentiable: bool = True
    hidden_outputs: int = 0  # outputs after the root's own ones (kept for the gradient)
    # Whether a slice's upstream gradient is a fixed linear function of the outputs' upstream
    # (a sum's, a mean's), reading neither the outputs nor the partials: a loop may then compute
    # each slice's gradients in the forward, for an upstream of one (loop.fusable).
    linear_upstream: bool = False

    @abc.abstractmethod
    def init(self, partial_specs: Sequence[tf.TensorSpec], steps: int) -> list:
        """The loop carry before the first slice (tensors or TensorArrays)."""

    @abc.abstractmethod
    def step(self, carry: list, partials: Sequence[tf.Tensor], index, offset) -> list:
        """Fold the partials of slice ``index`` (starting at ``offset``) into ``carry``."""

    @abc.abstractmethod
    def finish(self, carry: list, tail_partials: Sequence[tf.Tensor] | None, tail_offset: int) -> list[tf.Tensor]:
        """The outputs, from the loop's carry and the tail slice's partials (``None``: no tail)."""

    def initial(self, partial_specs: Sequence[tf.TensorSpec], steps: int, values: Sequence[tf.Tensor],
                tail: int) -> list:
        """The loop carry before the first slice, given the loop's inputs ``values`` (what
        :class:`InPlace` writes into; ``None``: not given) and the rows of the remainder slice after
        the loop (``tail``: a :class:`Concat` leaves room for them); by default :meth:`init`."""
        return self.init(partial_specs, steps)

    def carried_inputs(self, carry: Sequence) -> dict:
        """``{input index: tensor}``: the loop's inputs whose slices a step reads from ``carry``
        instead (the buffers :class:`InPlace` writes into); by default none."""
        return {}

    def slice_upstream(self, upstream: Sequence[tf.Tensor], outputs: Sequence[tf.Tensor],
                       partials: Sequence[tf.Tensor], offset, chunk: int) -> list[tf.Tensor | None]:
        """The gradient each of one slice's partials receives, given the outputs' upstream gradient."""
        raise NotImplementedError(f"the `{self.name}` combiner has no gradient")

    def at_length(self, length: tf.Tensor, chunk=None) -> Combiner:
        """This combiner for a split axis whose length is known only at run time (a scalar tensor):
        ``ceil(length / c)`` slices, the last one's rows past ``length`` masked to the reduction's
        identity by the roots' partials, no remainder slice; ``chunk``: ``c`` where it is not the
        planned one (scaled at run time).  Most need nothing more."""
        return self


class Concat(Combiner):
    """Partials are slices of the outputs along ``axes[i]``: written in order, then joined.

    Where the count of slices and a slice's shape are static (:meth:`initial`), the loop writes
    each slice, and ``finish`` the tail, at its offset into a buffer of the output's shape: the
    buffer is the output, with no copy to join it (a layer's output split along its sequence was
    held twice at the loop's end, the slices and their join), and a tensor the loop can be told to
    make late (:func:`.loop._loop`'s ``after``: XLA makes a buffer of a constant at the program's
    start).  Otherwise (:meth:`init`) each slice goes into a ``TensorArray``, and ``finish`` stacks
    them ([steps, .., c, ..]), moves the steps axis next to the split axis and merges the two, then
    appends the tail.
    """

    name = "concat"

    def __init__(self, axes: Sequence[int], like: Sequence[tf.Tensor] = ()):
        self.axes = tuple(axes)
        self.like = tuple(like)      # the results joined (the roots' outputs): what the slices count as

    def init(self, partial_specs, steps):
        arrays = [tf.TensorArray(s.dtype, size=steps, element_shape=s.shape, infer_shape=True)
                  for s in partial_specs]
        for array, like in zip(arrays, self.like):
            shapes.declare_stacked(array, like)
        return arrays

    def initial(self, partial_specs, steps, values, tail):
        if not (isinstance(steps, int) and isinstance(tail, int)
                and all(s.shape.is_fully_defined() for s in partial_specs)):
            return self.init(partial_specs, steps)
        return [tf.zeros([d * steps + tail if k == self.axes[i] else d for k, d in enumerate(s.shape.as_list())],
                         s.dtype) for i, s in enumerate(partial_specs)]

    def step(self, carry, partials, index, offset):
        return [ta.write(index, p) if isinstance(ta, tf.TensorArray) else write_slice(ta, p, self.axes[i], offset)
                for i, (ta, p) in enumerate(zip(carry, partials))]

    def finish(self, carry, tail_partials, tail_offset):
        out = []
        for i, ta in enumerate(carry):
            tail = None if tail_partials is None else tail_partials[i]
            if isinstance(ta, tf.TensorArray):
                out.append(join_slices(ta, self.axes[i], tail))
            else:                                   # the buffer :meth:`initial` made, with the tail's room
                out.append(ta if tail is None else write_slice(ta, tail, self.axes[i], tail_offset))
        return out

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        return [None if up is None else dynamic_slice(up, self.axes[i], offset, chunk)
                for i, up in enumerate(upstream)]

    def at_length(self, length, chunk=None):
        return _ConcatTo(self.axes, length, self.like)


class InPlace(Concat):
    """:class:`Concat` whose slices are written into the buffer of a loop input instead of joined apart.

    ``sources[i]``: the index, among the loop's inputs, of the input output ``i`` is written into (a
    variable's value before its update, the output its value after: :func:`.analysis.written_into`).
    The carry starts as that input; step ``s`` reads its slice of the input from the carry, where it
    is still the input's own (only slices before ``s`` were written), and writes the slice's result
    over it (``XlaDynamicUpdateSlice``).  XLA updates a loop-carried buffer in place, and a variable's
    new value in the variable's buffer: one copy of the variable in all, where joining held three.
    Static lengths only: the clamped last slice of a run-time length overlaps the one before it.
    """

    name = "in_place"

    def __init__(self, axes: Sequence[int], sources: Sequence[int]):
        super().__init__(axes)
        self.sources = tuple(sources)

    def init(self, partial_specs, steps):
        raise ValueError("a result written in place starts from the input it is written into (initial)")

    def initial(self, partial_specs, steps, values, tail):
        if values is None:
            return self.init(partial_specs, steps)
        return [values[k] for k in self.sources]

    def carried_inputs(self, carry):
        return dict(zip(self.sources, carry))

    def step(self, carry, partials, index, offset):
        return [write_slice(buf, p, self.axes[i], offset) for i, (buf, p) in enumerate(zip(carry, partials))]

    def finish(self, carry, tail_partials, tail_offset):
        if tail_partials is None:
            return list(carry)
        return [write_slice(buf, p, self.axes[i], tail_offset) for i, (buf, p) in enumerate(zip(carry, tail_partials))]

    def at_length(self, length, chunk=None):
        raise ValueError("a result written in place needs a static length")


def with_rows(specs, rows: int, axis: int) -> list[tf.TensorSpec]:
    """``specs`` with ``rows`` along ``axis``: the partials of a block of rows (a tile's query block, an
    attention's rows in one slice of a loop over them)."""
    out = []
    for s in specs:
        shape = s.shape.as_list()
        shape[axis] = rows
        out.append(tf.TensorSpec(shape, s.dtype))
    return out


def write_slice(buffer: tf.Tensor, piece: tf.Tensor, axis: int, offset) -> tf.Tensor:
    """``buffer`` with ``piece`` written over it from ``offset`` along ``axis``."""
    offset = tf.cast(offset, tf.int32)
    zero = tf.constant(0, tf.int32)
    return xla.dynamic_update_slice(buffer, piece, tf.stack([offset if d == axis else zero
                                                             for d in range(buffer.shape.rank)]))


class _ConcatTo(Concat):
    """:class:`Concat` of a run-time ``length``: the joined slices cut to ``length``; a slice's rows
    past it receive no gradient."""

    def __init__(self, axes: Sequence[int], length: tf.Tensor, like: Sequence[tf.Tensor] = ()):
        super().__init__(axes, like)
        self.length = length

    def initial(self, partial_specs, steps, values, tail):
        return self.init(partial_specs, steps)

    def finish(self, carry, tail_partials, tail_offset):
        return [join_slices(ta, self.axes[i], None if tail_partials is None else tail_partials[i], self.length)
                for i, ta in enumerate(carry)]

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        valid = valid_rows(offset, chunk, self.length)
        return [None if up is None else mask_rows(clamped_slice(up, self.axes[i], offset, chunk), self.axes[i],
                                                  valid, 0) for i, up in enumerate(upstream)]

    def at_length(self, length, chunk=None):
        return _ConcatTo(self.axes, length, self.like)


class _Fold(Combiner):
    """A monoid over partials of the outputs' own shapes: ``carry = op(carry, partial)``."""

    def init(self, partial_specs, steps):
        return [self.identity(s) for s in partial_specs]

    def step(self, carry, partials, index, offset):
        return [self.op(c, p) for c, p in zip(carry, partials)]

    def finish(self, carry, tail_partials, tail_offset):
        if tail_partials is not None:
            carry = [self.op(c, p) for c, p in zip(carry, tail_partials)]
        return list(carry)

    @abc.abstractmethod
    def identity(self, spec: tf.TensorSpec) -> tf.Tensor: ...

    @abc.abstractmethod
    def op(self, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor: ...


def accumulated(dtype: tf.DType) -> tf.DType:
    """The type a sum over slices of ``dtype`` is carried in: float32 for half types, as XLA sums a
    reduction of them (TensorFlow's bridge accumulates float16 and bfloat16 in float32), so that a
    sum split into slices rounds as the unsplit one does (each slice's partial, once, and the total)."""
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class Sum(_Fold):
    """sum over the split axis = sum over slices of each slice's sum (also: MatMul contracting);
    carried in :func:`accumulated`'s type, the outputs given in the partials' own."""

    name = "sum"
    linear_upstream = True

    def init(self, partial_specs, steps):
        self.dtypes = [s.dtype for s in partial_specs]
        return super().init(partial_specs, steps)

    def identity(self, spec):
        return tf.zeros(dims_of(spec), accumulated(spec.dtype))

    def op(self, a, b):
        return a + tf.cast(b, a.dtype)

    def finish(self, carry, tail_partials, tail_offset):
        return self._given(super().finish(carry, tail_partials, tail_offset))

    def _given(self, carry):
        """The outputs in the partials' own types (a half type's sum was carried in float32)."""
        return [tf.cast(c, d) for c, d in zip(carry, self.dtypes)]

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        return list(upstream)


class Mean(Sum):
    """mean over L = sum over slices of (slice mean) * c / L, with c the slice's length."""

    name = "mean"

    def __init__(self, length, chunk: int, tail: int):
        self.length, self.chunk, self.tail = length, chunk, tail

    def init(self, partial_specs, steps):
        bad = [s.dtype.name for s in partial_specs if not (s.dtype.is_floating or s.dtype.is_complex)]
        if bad:
            # Truncated slice means cannot give the truncated mean of the whole.
            raise TypeError(f"a split mean of {', '.join(bad)} cannot be combined exactly")
        return super().init(partial_specs, steps)

    @staticmethod
    def _weighted(p, w):
        if isinstance(w, tf.Tensor):   # a run-time length: the ratio in float64, then rounded once
            return p * tf.cast(w, p.dtype)
        return p * tf.constant(w, dtype=p.dtype)  # not tf.cast(w): that rounds w to float32 first

    def at_length(self, length, chunk=None):
        return _MeanOver(length, self.chunk if chunk is None else chunk)

    def step(self, carry, partials, index, offset):
        return [c + self._weighted(tf.cast(p, c.dtype), self.chunk / self.length) for c, p in zip(carry, partials)]

    def finish(self, carry, tail_partials, tail_offset):
        if tail_partials is not None:
            carry = [c + self._weighted(tf.cast(p, c.dtype), self.tail / self.length)
                     for c, p in zip(carry, tail_partials)]
        return self._given(carry)

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        return [None if u is None else self._weighted(u, chunk / self.length) for u in upstream]


class _MeanOver(Mean):
    """:class:`Mean` of a run-time ``length``: each slice's mean weighted by ``c / length`` (the
    masked rows past ``length`` are zeros in the last slice's mean, so ``c`` is right for it too)."""

    def __init__(self, length: tf.Tensor, chunk: int):
        super().__init__(length, chunk, 0)
        self.weight = tf.cast(chunk, tf.float64) / tf.cast(length, tf.float64)

    def step(self, carry, partials, index, offset):
        return [c + self._weighted(tf.cast(p, c.dtype), self.weight) for c, p in zip(carry, partials)]

    def finish(self, carry, tail_partials, tail_offset):
        if tail_partials is not None:
            raise ValueError("a mean over a run-time length has no remainder slice")
        # x 1, or NaN where the length is 0: the mean of nothing, as unsplit.
        one = tf.cast(self.length, tf.float64) / tf.cast(self.length, tf.float64)
        return self._given([c * tf.cast(one, c.dtype) for c in carry])

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        weight = tf.cast(chunk, tf.float64) / tf.cast(self.length, tf.float64)
        return [None if u is None else self._weighted(u, weight) for u in upstream]


class Reduce(_Fold):
    """max, min, prod, all, any: the reduction of the slices' reductions."""

    _OPS = {"max": tf.maximum, "min": tf.minimum, "prod": tf.multiply, "all": tf.logical_and,
            "any": tf.logical_or}

    def __init__(self, kind: str):
        if kind not in self._OPS:
            raise ValueError(f"unknown reduction {kind!r}")
        self.name = kind
        self.differentiable = kind in ("all", "any")  # booleans: nothing to differentiate

    def identity(self, spec):
        dt = spec.dtype
        if self.name == "all":
            return tf.ones(dims_of(spec), tf.bool)
        if self.name == "any":
            return tf.zeros(dims_of(spec), tf.bool)
        if self.name == "prod":
            return tf.ones(dims_of(spec), dt)
        if dt.is_floating:
            value = float("-inf") if self.name == "max" else float("inf")
        else:
            value = dt.min if self.name == "max" else dt.max
        return tf.fill(dims_of(spec), tf.constant(value, dt))

    def op(self, a, b):
        return self._OPS[self.name](a, b)

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        return [None for _ in upstream]


class Extremum(Combiner):
    """max or min with its gradient: partials are (the slice's max, how many elements attain it,
    the first index along the split axis of one that does).

    ``tf.reduce_max``'s gradient splits the upstream equally among all elements equal to the
    maximum, so the split needs the global count ``T`` of ties: the carry keeps ``(m, T, i)``, ``i``
    where ``m`` was first attained.  In the backward, which recomputes each slice (in slices of its
    own size), a unique maximum's upstream goes whole to the slice holding ``i``; with ties, a slice
    attaining ``m`` with ``t`` of them receives ``dy * t / T``, and its own ``reduce_max`` gradient
    divides by ``t``: each tied element gets ``dy / T``, as unsplit.  The position, not the value,
    finds a unique maximum: a slice recomputed in another loop is reduced in another order by XLA,
    and its maximum may differ from ``m`` in the last bit (a row's sum, recomputed in slices of 9
    rows against the forward's 16: no slice equal to ``m``, and every gradient zero).  Exact ties
    (a ReLU's zeros) are equal however they are summed.  ``finish`` returns ``[m, T, i]``; only ``m``
    replaces the root's output.

    NaN propagates, as in TensorFlow's own ``reduce_max``/``reduce_min`` (eager, and NumPy): a
    column with a NaN anywhere is NaN.  XLA:CPU's reductions and ``maximum`` ignore NaNs (measured
    on TF 2.21: ``reduce_max`` under ``jit_compile`` skips them, ``maximum(1, nan)`` is 1), so each
    slice's partial carries the NaN itself (:func:`nan_propagating`) and the fold keeps it.  The
    gradient where the result is NaN is zero here (TensorFlow's is NaN: 0 ties divide 0).
    """

    hidden_outputs = 2

    def __init__(self, kind: str):
        if kind not in ("max", "min"):
            raise ValueError(f"unknown extremum {kind!r}")
        self.name = kind
        self._reduce = Reduce(kind)

    def init(self, partial_specs, steps):
        value_spec, _, at_spec = partial_specs
        return [self._reduce.identity(value_spec), tf.zeros(dims_of(value_spec), value_spec.dtype),
                tf.zeros(dims_of(at_spec), tf.int32)]

    def _fold(self, carry, partials, offset):
        m, c, at = carry
        p, t, local = partials
        best = tf.where(tf.math.is_nan(m) | tf.math.is_nan(p), m + p, self._reduce.op(m, p))   # NaN stays
        zero = tf.zeros_like(c)
        count = tf.where(tf.equal(m, best), c, zero) + tf.where(tf.equal(p, best), t, zero)
        later = p > m if self.name == "max" else p < m            # (strictly: the first index stays)
        return [best, count, tf.where(later, tf.cast(local, tf.int32) + tf.cast(offset, tf.int32), at)]

    def step(self, carry, partials, index, offset):
        return self._fold(carry, partials, offset)

    def finish(self, carry, tail_partials, tail_offset):
        return self._fold(carry, tail_partials, tail_offset) if tail_partials is not None else list(carry)

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        dy = upstream[0]
        if dy is None:
            return [None, None, None]
        m, total, at = outputs
        p, t, _ = partials
        start = tf.cast(offset, tf.int32)
        holds = tf.cast((at >= start) & (at < start + chunk), t.dtype)
        tied = tf.where(tf.equal(p, m), tf.stop_gradient(t) / total, tf.zeros_like(t))
        return [dy * tf.where(tf.equal(total, 1), holds, tied), None, None]


def first_at(x: tf.Tensor, extremum: tf.Tensor, axes, split_axis: int, kind: str) -> tf.Tensor:
    """The first index along ``split_axis`` (one of ``axes``) of an element of ``x`` attaining its max
    (min) over ``axes``, shaped as ``extremum`` (that max, with or without its reduced axes): an
    ``Extremum`` partial, the slice's own index (the combiner adds the slice's offset)."""
    reduce, arg = (tf.reduce_max, tf.argmax) if kind == "max" else (tf.reduce_min, tf.argmin)
    others = [a for a in axes if a != split_axis]
    rows = reduce(x, others, keepdims=True) if others else x
    return tf.stop_gradient(tf.reshape(arg(rows, split_axis, output_type=tf.int32), tf.shape(extremum)))


def nan_propagating(x: tf.Tensor, extremum: tf.Tensor, axes, keepdims: bool) -> tf.Tensor:
    """``extremum`` (``x``'s max or min over ``axes``) NaN wherever ``x`` has a NaN over ``axes``, as
    TensorFlow's reductions give it (XLA's skip NaNs): an ``Extremum`` partial."""
    return tf.where(tf.reduce_any(tf.math.is_nan(x), axes, keepdims=keepdims), tf.cast(np.nan, x.dtype), extremum)


def tie_count(x: tf.Tensor, axes, keepdims: bool, kind: str) -> tf.Tensor:
    """How many elements of ``x`` attain its max (min) over ``axes``: an ``Extremum`` partial."""
    reduce = tf.reduce_max if kind == "max" else tf.reduce_min
    best = reduce(x, axes, keepdims=True)
    return tf.stop_gradient(tf.reduce_sum(tf.cast(tf.equal(x, best), x.dtype), axes, keepdims=keepdims))


class OnlineSoftmax(Combiner):
    """softmax(S) @ V split along the keys: the running max, normaliser and rescaled accumulator.

    Partials of a slice of keys: ``m_s = max(S_s)`` (held constant: softmax does not depend on
    it), ``l_s = sum(exp(S_s - m_s))`` and ``o_s = exp(S_s - m_s) @ V_s``.  Folding rescales to
    the running max ``m``: ``l = l e^(m_old - m) + l_s e^(m_s - m)``, likewise ``o``; the result
    is ``o / l`` (Rabe and Staats 2021; FlashAttention).  ``finish`` returns ``[o / l, m, l]``;
    only the first replaces the root.  Equal to the unsplit product up to rounding (the sums are
    taken in another order).  The gradient: ``o_s`` receives ``dO w_s / l`` and ``l_s`` receives
    ``-sum(dO * O) w_s / l``, with ``w_s = e^(m_s - m)``.
    """

    name = "online_softmax"
    hidden_outputs = 2

    def __init__(self, value_axes: tuple[int, ...] = (-1,)):
        self.value_axes = value_axes        # the output's axes only the values carry (summed in dO . O)

    def init(self, partial_specs, steps):
        m_spec, l_spec, o_spec = partial_specs
        return [tf.fill(dims_of(m_spec), tf.constant(float("-inf"), m_spec.dtype)),
                tf.zeros(dims_of(l_spec), l_spec.dtype),
                tf.zeros(dims_of(o_spec), o_spec.dtype)]

    @staticmethod
    def _fold(carry, partials):
        m, norm, acc = carry
        ms, ls, os_ = partials
        new_m = tf.maximum(m, ms)
        old_w, new_w = tf.exp(m - new_m), tf.exp(ms - new_m)
        return [new_m, norm * old_w + ls * new_w, acc * old_w + os_ * new_w]

    def step(self, carry, partials, index, offset):
        return self._fold(carry, partials)

    def finish(self, carry, tail_partials, tail_offset):
        m, norm, acc = self._fold(carry, tail_partials) if tail_partials is not None else carry
        return [acc / norm, m, norm]

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        d_out = upstream[0]
        if d_out is None:
            return [None, None, None]
        out, m, norm = outputs
        ms = partials[0]
        w = tf.exp(ms - m) / norm                                           # [.., q, 1]
        return [None, -tf.reduce_sum(d_out * out, list(self.value_axes), keepdims=True) * w, d_out * w]


def softmax_partials(scores: tf.Tensor, values_product, to_output=None) -> list[tf.Tensor]:
    """An ``OnlineSoftmax`` slice's partials: ``values_product(e)`` computes ``e @ V_s``; ``to_output``
    moves the row statistics ``[.., q, 1]`` into the output's layout (:func:`statistics_layout`)."""
    to_output = to_output or (lambda t: t)
    m = tf.stop_gradient(tf.reduce_max(scores, -1, keepdims=True))       # [.., q, 1]
    e = tf.exp(scores - m)                                               # [.., q, c]
    return [to_output(m), to_output(tf.reduce_sum(e, -1, keepdims=True)), values_product(e)]


def statistics_layout(probs: str, output: str):
    """``(to_output, value_axes)`` for softmax(S) V written as an ``Einsum`` with labels ``probs`` (the
    keys last) and ``output``: ``to_output`` moves a row statistic ``[.., q, 1]`` of the scores into
    the output's layout, with size 1 along the axes only the values carry (``value_axes``; Keras'
    ``BNTS -> BTNH``: ``[B, N, T, 1] -> [B, T, N, 1]``)."""
    kept = probs[:-1]
    perm = [kept.index(c) for c in output if c in kept]
    value_axes = tuple(i for i, c in enumerate(output) if c not in kept)

    def to_output(t):
        t = tf.transpose(tf.squeeze(t, -1), perm)
        for axis in value_axes:
            t = tf.expand_dims(t, axis)
        return t

    return to_output, value_axes


class Arg(Combiner):
    """Running arg-max / arg-min: partials are (local index, value) of each slice.

    A later slice wins only if strictly better, so among equal values the first (lowest) index
    stays, which is what ``tf.math.argmax``/``argmin`` return.
    """

    differentiable = True  # integer output: no gradient flows

    def __init__(self, kind: str, output_type: tf.DType):
        if kind not in ("max", "min"):
            raise ValueError(f"unknown arg kind {kind!r}")
        self.name = f"arg{kind}"
        self.kind = kind
        self.output_type = output_type

    def init(self, partial_specs, steps):
        index_spec, value_spec = partial_specs
        worst = Reduce(self.kind).identity(value_spec)
        return [tf.zeros(dims_of(index_spec), self.output_type), worst]

    def _better(self, new, old):
        better = new > old if self.kind == "max" else new < old
        if new.dtype.is_floating:  # tf.math.argmax never picks a NaN: a NaN carry loses to any number
            better = tf.logical_or(better, tf.logical_and(tf.math.is_nan(old), tf.logical_not(tf.math.is_nan(new))))
        return better

    def step(self, carry, partials, index, offset):
        best_index, best_value = carry
        local, value = partials
        glob = tf.cast(local, self.output_type) + tf.cast(offset, self.output_type)
        take = self._better(value, best_value)
        # The first slice always sets the carry: a NaN or all-worst slice still yields index 0 + s.
        first = tf.equal(index, 0)
        take = tf.logical_or(take, first)
        return [tf.where(take, glob, best_index), tf.where(take, value, best_value)]

    def finish(self, carry, tail_partials, tail_offset):
        if tail_partials is not None:
            best_index, best_value = carry
            local, value = tail_partials
            glob = tf.cast(local, self.output_type) + tf.cast(tail_offset, self.output_type)
            take = self._better(value, best_value)
            carry = [tf.where(take, glob, best_index), tf.where(take, value, best_value)]
        return [carry[0]]

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        return [None, None]


def value_at(x: tf.Tensor, index: tf.Tensor, axis: int) -> tf.Tensor:
    """``x``'s element at ``index`` along ``axis`` (an arg-max/min result): the value an ``Arg`` partial needs.

    Not ``reduce_max``: that is NaN for a slice holding a NaN, while the arg kernel skips NaNs.
    """
    picked = tf.experimental.numpy.take_along_axis(x, tf.expand_dims(tf.cast(index, tf.int64), axis), axis)
    return tf.squeeze(picked, axis)


class TopK(Combiner):
    """Running top-k along the last axis: partials are (values, local indices) of each slice."""

    name = "top_k"

    def __init__(self, k: int, sorted_: bool = True):
        self.k = k
        self.sorted = sorted_

    def init(self, partial_specs, steps):
        values_spec, index_spec = partial_specs
        worst = Reduce("max").identity(values_spec)
        return [worst, tf.zeros(dims_of(index_spec), index_spec.dtype)]

    def _merge(self, carry_values, carry_indices, values, indices, offset, first):
        glob = indices + tf.cast(offset, indices.dtype)
        both_v = tf.concat([carry_values, values], axis=-1)                # [.., 2k]: carry first
        both_i = tf.concat([carry_indices, glob], axis=-1)                 # [.., 2k]
        top_v, pos = tf.math.top_k(both_v, k=self.k, sorted=True)          # ties: lower position first
        top_i = tf.gather(both_i, pos, batch_dims=both_i.shape.rank - 1)
        # The first slice replaces the initial carry outright (its -inf/min placeholders could
        # otherwise win ties against real values equal to them).
        top_v = tf.where(first, values, top_v)
        top_i = tf.where(first, glob, top_i)
        return top_v, top_i

    def step(self, carry, partials, index, offset):
        cv, ci = carry
        v, i = partials
        return list(self._merge(cv, ci, v, i, offset, tf.equal(index, 0)))

    def finish(self, carry, tail_partials, tail_offset):
        cv, ci = carry
        if tail_partials is not None:
            v, i = tail_partials
            cv, ci = self._merge(cv, ci, v, i, tail_offset, tf.constant(False))
        return [cv, ci]

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        """Values' gradient: each selected element in this slice gets its upstream value."""
        up_values = upstream[0]
        if up_values is None:
            return [None, None]
        indices = outputs[1]                                                  # [.., k] global
        local = indices - tf.cast(offset, indices.dtype)
        inside = tf.logical_and(local >= 0, local < chunk)
        onehot = tf.one_hot(tf.where(inside, local, -1), chunk, dtype=up_values.dtype)  # [.., k, c]
        dense = tf.reduce_sum(onehot * up_values[..., None], axis=-2)         # [.., c]
        # The partial's values are the slice's own top k: route through its indices.
        slice_indices = partials[1]                                           # [.., k] local
        return [tf.gather(dense, slice_indices, batch_dims=dense.shape.rank - 1), None]


class Group(Combiner):
    """Several roots computed in one loop: each part folds its own partials into its own outputs.

    ``parts`` are ``(combiner, number of partials, number of outputs)``; partials, carries,
    outputs and upstream gradients are the parts' lists concatenated in order.
    """

    def __init__(self, parts: Sequence[tuple[Combiner, int, int]]):
        self.parts = list(parts)
        self.name = "+".join(c.name for c, _, _ in self.parts)
        self.differentiable = all(c.differentiable for c, _, _ in self.parts)
        self.linear_upstream = all(c.linear_upstream for c, _, _ in self.parts)
        self._carry_sizes: list[int] | None = None

    @staticmethod
    def _cut(items, sizes):
        out, i = [], 0
        for n in sizes:
            out.append(list(items[i:i + n]))
            i += n
        return out

    def init(self, partial_specs, steps):
        return self._carries(partial_specs, lambda c, specs: c.init(specs, steps))

    def initial(self, partial_specs, steps, values, tail):
        return self._carries(partial_specs, lambda c, specs: c.initial(specs, steps, values, tail))

    def _carries(self, partial_specs, make) -> list:
        """The parts' carries, each ``make(part, its partial specs)``, in order (their sizes kept)."""
        carries = [make(c, specs)
                   for (c, _, _), specs in zip(self.parts, self._cut(partial_specs, [n for _, n, _ in self.parts]))]
        self._carry_sizes = [len(c) for c in carries]
        return [x for c in carries for x in c]

    def carried_inputs(self, carry):
        out: dict = {}
        for (c, _, _), cr in zip(self.parts, self._cut(carry, self._carry_sizes)):
            out.update(c.carried_inputs(cr))
        return out

    def step(self, carry, partials, index, offset):
        out = []
        for (c, _, _), cr, ps in zip(self.parts, self._cut(carry, self._carry_sizes),
                                     self._cut(partials, [n for _, n, _ in self.parts])):
            out += c.step(cr, ps, index, offset)
        return out

    def finish(self, carry, tail_partials, tail_offset):
        tails = (self._cut(tail_partials, [n for _, n, _ in self.parts]) if tail_partials is not None
                 else [None] * len(self.parts))
        out = []
        for (c, _, _), cr, tp in zip(self.parts, self._cut(carry, self._carry_sizes), tails):
            out += c.finish(cr, tp, tail_offset)
        return out

    def at_length(self, length, chunk=None):
        return Group([(c.at_length(length, chunk), n, m) for c, n, m in self.parts])

    def slice_upstream(self, upstream, outputs, partials, offset, chunk):
        sizes_out = [m for _, _, m in self.parts]
        if outputs is None:            # (a fused loop's: a sum's or a mean's share needs no outputs)
            outputs = [None] * sum(sizes_out)
        out = []
        for (c, _, _), up, outs, ps in zip(self.parts, self._cut(upstream, sizes_out), self._cut(outputs, sizes_out),
                                           self._cut(partials, [n for _, n, _ in self.parts])):
            out += c.slice_upstream(up, outs, ps, offset, chunk)
        return out


REDUCTION_COMBINERS = {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min", "Prod": "prod",
                       "All": "all", "Any": "any"}


def combiner_for_reduction(op_type: str, length: int = 0, chunk: int = 0, tail: int = 0) -> Combiner:
    """The combiner of a reduction root over the split axis."""
    kind = REDUCTION_COMBINERS[op_type]
    if kind == "sum":
        return Sum()
    if kind == "mean":
        return Mean(length, chunk, tail)
    return Reduce(kind)
