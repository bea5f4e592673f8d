"""Static shapes as the analyses read them, with a nominal size for dimensions known only at run time.

A ``tf.function`` traced with ``input_signature=[tf.TensorSpec([None, 3])]`` (or generalised by
``reduce_retracing``, or by Keras' ``fit`` on a ``tf.data`` pipeline whose last batch is short) has
tensors whose first dimension is unknown until XLA compiles the function for a concrete input
(TensorFlow's XLA bridge compiles once per input shape).  The memory model and the splitter's
planning need sizes; the loops the splitter builds do not (they take their trip count from
``tf.shape`` at run time).  So planning reads shapes through this module, under :func:`nominal`:

    with shapes.nominal(4096):
        shapes.dims(x)          # [4096, 3] for x of shape [?, 3]
        shapes.nbytes(x)        # 4096 * 3 * 4

Outside :func:`nominal` (and for tensors of unknown rank) these are the static shapes as they are.
The setting is per thread and per context (``contextvars``): two threads tracing at once each
plan with their own.  The mechanism (what is built into a graph) never reads the nominal size:
it reads ``t.shape`` itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import tensorflow as tf

__all__ = ["nominal", "nominal_size", "dims", "is_static", "num_elements", "nbytes", "dynamic_axes",
           "concrete_spec"]

_NOMINAL: contextvars.ContextVar[int | None] = contextvars.ContextVar("grappler_ext_nominal_size", default=None)


@contextlib.contextmanager
def nominal(size: int) -> Iterator[int]:
    """Read every dimension unknown until run time as ``size`` within the block."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"a nominal size must be an int >= 1, got {size!r}")
    token = _NOMINAL.set(size)
    try:
        yield size
    finally:
        _NOMINAL.reset(token)


def nominal_size() -> int | None:
    """The nominal size in effect, or ``None`` outside :func:`nominal`."""
    return _NOMINAL.get()


def dynamic_axes(t: tf.Tensor) -> tuple[int, ...]:
    """The axes of ``t`` whose size is unknown until run time (by its static shape)."""
    if t.shape.rank is None:
        return ()
    return tuple(i for i, d in enumerate(t.shape.as_list()) if d is None)


def dims(t: tf.Tensor) -> list[int | None] | None:
    """``t``'s dimensions, unknown ones read as the nominal size (``None`` outside :func:`nominal`);
    ``None`` for an unknown rank."""
    if t.shape.rank is None:
        return None
    size = _NOMINAL.get()
    return [size if d is None else d for d in t.shape.as_list()]


def is_static(t: tf.Tensor) -> bool:
    """Whether :func:`dims` gives every dimension of ``t``."""
    d = dims(t)
    return d is not None and all(x is not None for x in d)


def num_elements(t: tf.Tensor) -> int | None:
    """Elements of ``t`` by :func:`dims`; ``None`` when a dimension is unknown."""
    d = dims(t)
    return None if d is None or any(x is None for x in d) else math.prod(d)


def nbytes(t: tf.Tensor) -> int:
    """The bytes of ``t``'s value by :func:`dims`; 0 when a dimension is unknown."""
    n = num_elements(t)
    return 0 if n is None else n * t.dtype.size


def concrete_spec(t: tf.Tensor) -> tf.TensorSpec:
    """A ``TensorSpec`` of ``t`` with its unknown dimensions at the nominal size (to compile a
    program for measuring it); its dimensions as they are outside :func:`nominal`."""
    d = dims(t)
    return tf.TensorSpec(d, t.dtype)
