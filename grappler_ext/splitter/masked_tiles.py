"""masked_tiles: which tiles of an attention's score matrix are proven masked, read from the graph computing it.

    tile (i, j) skipped  <=>  every score s in S[.., rows[i], cols[j]] is  d + o  with  o <= -1e4 x max(1, k),
                              d its data part, |d| <= k x (the magnitude of the opaque values it is made of)

When it applies: the splitter computes ``softmax(S) @ V`` in tiles (query blocks ``rows`` x key blocks ``cols``,
an online softmax) and asks which tiles it may skip; ``S`` is the ``Softmax`` op's input, ``[.., Lq, Lk]``,
static.  The ops computing ``S`` are interpreted backwards over intervals, one per tile, all tiles at once: a
number is ``[lo, hi]``, or ``d + [lo, hi]`` with ``d`` a *data part*: a combination of *opaque* values (a
``MatMul``/``Einsum`` output, an input, a variable, a floating op with no rule), whose size is at most ``k``
times theirs (1 for the raw scores, ``1/sqrt(dk)`` scaled, 2 with a bias added; a factor above 1 raises ``k``,
so ``1e9 * (1 - m)`` with ``m`` an input is no mask); a boolean is (may be true, may be false).  Positional
leaves are evaluated over each tile's index ranges: ``Range``, ``Const`` (a precomputed mask, sliced or not),
``Fill``/``ZerosLike``/``OnesLike``, ``MatrixBandPart``, ``Cumsum`` of a splat.  Values flow through ``Add``/
``AddV2``/``Sub``/``Neg``/``Mul``/``RealDiv``/``Maximum``/``Minimum``/``Abs``, ``Cast``, the comparisons,
``LogicalAnd``/``Or``/``Not``, ``Select``/``SelectV2`` (a surely true or surely false condition takes its
branch), identities, and ops moving axes: ``ExpandDims``, ``Squeeze``, ``Reshape`` (an axis kept whole),
``Transpose``, ``BroadcastTo``, ``Slice``/``StridedSlice`` with unit strides (an offset shifts the indices).

Masks proven (tested): causal masks built with ``band_part(ones, -1, 0)`` and added (``s + (1 - m) * -1e9``,
``s - 1e9 * (1 - m)``), ``tf.where(i >= j, s, -inf | -1e9 | fill)`` of ranges, bottom-right causal for
``Lq != Lk``, sliding windows (``|i - j| < w``, band parts), a causal buffer sliced to ``[Lq, Lk]`` (GPT-2);
Keras 3's ``MultiHeadAttention(use_causal_mask=True)`` (cumsums of ones, or their
:mod:`~grappler_ext.constant_cumsum` rewrite; ``band_part`` without dropout), tf_keras' ``MultiHeadAttention``
and ``Attention``; any of those AND an unknown mask (a padding mask: false AND anything is false).

Why skipping is exact: a skipped score is at most ``d - 1e4``, and the row's maximum ``m`` comes from an
unmasked score, so ``exp(s - m)`` is exactly 0 (``exp`` underflows to 0 below -104 in float32, -746 in
float64) unless the data part is over 9000 above ``m``; it is that position's own unmasked score, scaled, or
such scores plus biases.  Processed first, a skipped tile's sums are rescaled later by ``exp(m' - m)`` with
``m' <= d - 1e4``: 0 as well.  TensorFlow's softmax adds exact zeros there, so leaving them out changes no
bit.  A row with no unmasked score (all its tiles skipped) is the caller's business, as is a non-finite
value of ``V`` at a masked key (``0 x inf`` is NaN in the unsplit product).

Soundness: known intervals are rounded outward in the tensor's dtype (integers exactly; an overflow or a
possible NaN gives "anything"); a data part is assumed finite (a NaN score under an additive mask poisons
the unsplit row, not the tiled one) and is defined up to the rounding of the additions that carry it.  Not
handled (nothing is proven): masks read from inputs or variables, multiplicative masking (``s * m``),
``Gather``/``OneHot``/``Tile``-built masks, reshapes merging a query or key axis with another, strides,
float ranges or running sums that do not count exactly, correlations (``x - x`` is not 0 here), and values
past :data:`MAX_VISITS`.

Pipeline position: none; it is an analysis the splitter calls at rewrite time.  It reads the graph and never
changes it, and proves the same tiles before and after :mod:`~grappler_ext.constant_cumsum`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from grappler_ext.constant_cumsum import exact_float_bound, float_refusal, running_index
from grappler_ext.folding import static_value

__all__ = ["MaskedTiles", "THRESHOLD", "MAX_VISITS", "masked_tiles"]

THRESHOLD = 1e4      # a score at least this far below its data part (per unit of its scale) is masked
MAX_VISITS = 64      # (tensor, coordinates) pairs evaluated at most: a mask, not a program

Coord = tuple[int, int] | None     # (axis, shift): the index along ``axis`` is the coordinate + shift; None: none
Coords = tuple[Coord, Coord]       # (query row, key column)
_INF = np.inf


@dataclasses.dataclass(frozen=True)
class MaskedTiles:
    """``skipped[i, j]``: tile ``(rows[i], cols[j])`` is proven masked; every score there is at most its
    data part + ``bound``, or at most ``bound`` where it has none (``bound <= -THRESHOLD``, maybe ``-inf``)."""

    skipped: np.ndarray      # bool [len(rows), len(cols)]
    bound: float


class _Unknown(Exception):
    """A rule can say nothing sound about its value."""


@dataclasses.dataclass(frozen=True)
class _Num:
    """Per tile: every element is ``d + o``, ``o`` in ``[lo, hi]``, ``|d| <= scale x`` the opaque values' size
    (``scale`` 0: no data part, the element is in ``[lo, hi]``; ``inf``: anything)."""

    scale: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Bool:
    """Per tile: whether some element may be true, whether some may be false."""

    true: np.ndarray
    false: np.ndarray


def masked_tiles(scores: tf.Tensor, rows: Sequence[tuple[int, int]],
                 cols: Sequence[tuple[int, int]]) -> MaskedTiles | None:
    """Which tiles of ``scores`` (a graph tensor ``[.., Lq, Lk]``: query axis -2, key axis -1, static shape)
    are proven masked; ``rows[i] = (start, stop)`` of query block ``i`` along axis -2, ``cols[j]`` the same
    along axis -1 (blocks may overlap).  ``None`` when no tile is proven masked or the graph is not understood."""
    shape = scores.shape
    if shape.rank is None or shape.rank < 2 or not shape.is_fully_defined() or not scores.dtype.is_floating:
        return None
    walk = _Walk(_blocks(rows, shape[-2]), _blocks(cols, shape[-1]))
    with np.errstate(all="ignore"):
        value = walk.value(scores, ((shape.rank - 2, 0), (shape.rank - 1, 0)))
        skipped = value.hi <= -THRESHOLD * np.maximum(value.scale, 1.0)
    if not skipped.any():
        return None
    skipped.flags.writeable = False
    return MaskedTiles(skipped, float(value.hi[skipped].max()))


def _blocks(blocks: Sequence[tuple[int, int]], n: int) -> tuple[tuple[int, int], ...]:
    out = tuple((int(s), int(e)) for s, e in blocks)
    if not out or any(not 0 <= s < e <= n for s, e in out):
        raise ValueError(f"blocks must be non-empty (start, stop) ranges within [0, {n}], not {blocks!r}")
    return out


class _Walk:
    """One analysis: the blocks, and the values found so far per (tensor, coordinates)."""

    def __init__(self, rows, cols):
        self.blocks = (rows, cols)
        self.shape = (len(rows), len(cols))
        self.memo: dict[tuple[str, Coords], _Num | _Bool] = {}

    def value(self, t: tf.Tensor, coords: Coords) -> _Num | _Bool:
        key = (t.name, coords)
        if key not in self.memo:
            if len(self.memo) >= MAX_VISITS:
                return self.unknown(t.dtype)
            self.memo[key] = self.unknown(t.dtype)          # (a cycle reads unknown)
            rule = _RULES.get(t.op.type)
            try:
                self.memo[key] = rule(self, t.op, t, coords) if rule else self.opaque(t.dtype)
            except Exception:          # _Unknown, or a rule that cannot read its op: the value is unknown
                pass
        return self.memo[key]

    def unknown(self, dtype: tf.DType) -> _Num | _Bool:
        if dtype.base_dtype == tf.bool:
            return self.truth(True, True)
        return self.num(0.0 if dtype.is_integer else _INF, -_INF, _INF, dtype)

    def opaque(self, dtype: tf.DType) -> _Num | _Bool:
        """A value with no rule: a data part of its own if floating."""
        return self.num(1.0, 0.0, 0.0, dtype) if dtype.is_floating else self.unknown(dtype)

    def truth(self, true, false) -> _Bool:
        return _Bool(np.broadcast_to(true, self.shape), np.broadcast_to(false, self.shape))

    def num(self, scale, lo, hi, dtype: tf.DType) -> _Num:
        """A number per tile: a NaN bound (a possible NaN) or an infinite scale is anything; known bounds
        are rounded outward."""
        scale, lo, hi = (np.broadcast_to(np.asarray(a, float), self.shape) for a in (scale, lo, hi))
        data = scale > 0
        anything = np.isnan(lo) | np.isnan(hi) | (scale == _INF)
        rlo, rhi = _outward(lo, hi, dtype)
        return _Num(np.where(anything & data, _INF, scale), np.where(anything, -_INF, np.where(data, lo, rlo)),
                    np.where(anything, _INF, np.where(data, hi, rhi)))

    def tiles(self, v: np.ndarray, coords: Coords) -> tuple[np.ndarray, np.ndarray]:
        """Per tile, min and max of ``v`` (whose axes carry ``coords``) over the tile's index ranges."""
        kept = [c[0] for c in coords if c is not None]
        w = np.moveaxis(np.asarray(v), kept, list(range(len(kept))))
        w = w.reshape(w.shape[:len(kept)] + (-1,))
        w = w[None] if coords[0] is None else w
        w = w[:, None] if coords[1] is None else w
        if w.size == 0:
            raise _Unknown
        lo, hi = w.min(-1), w.max(-1)                                    # [R, C]
        for axis, (c, blocks) in enumerate(zip(coords, self.blocks)):
            spans = [(0, 1)] * len(blocks) if c is None else [(s + c[1], e + c[1]) for s, e in blocks]
            if any(s < 0 or e > lo.shape[axis] for s, e in spans):
                raise _Unknown
            cuts = [(slice(None),) * axis + (slice(s, e),) for s, e in spans]
            lo = np.stack([lo[cut].min(axis) for cut in cuts], axis)
            hi = np.stack([hi[cut].max(axis) for cut in cuts], axis)
        return lo.astype(np.float64), hi.astype(np.float64)

    def array(self, v: np.ndarray, coords: Coords, dtype: tf.DType) -> _Num | _Bool:
        """The value of a known array ``v`` (a splat: 0-d with no coordinates)."""
        lo, hi = self.tiles(v, coords)
        return self.truth(hi == 1, lo == 0) if dtype.base_dtype == tf.bool else self.num(0.0, lo, hi, dtype)

    def choose(self, true, false, a, b):
        """``a`` where the condition is surely true, ``b`` where surely false, else their join."""
        if type(a) is not type(b):
            raise _Unknown
        only_a, only_b = ~false, ~true & false
        if isinstance(a, _Bool):
            pick = lambda x, y: np.where(only_a, x, np.where(only_b, y, x | y))
            return _Bool(pick(a.true, b.true), pick(a.false, b.false))
        mixed = (a.scale > 0) != (b.scale > 0)               # a data part or none, per element: anything
        pick = lambda x, y, z: np.where(only_a, x, np.where(only_b, y, z))
        return _Num(pick(a.scale, b.scale, np.where(mixed, _INF, np.maximum(a.scale, b.scale))),
                    pick(a.lo, b.lo, np.where(mixed, -_INF, np.minimum(a.lo, b.lo))),
                    pick(a.hi, b.hi, np.where(mixed, _INF, np.maximum(a.hi, b.hi))))


def _outward(lo: np.ndarray, hi: np.ndarray, dtype: tf.DType) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi]`` (computed in float64) widened to hold the values ``dtype`` rounds them to."""
    if dtype.is_integer:
        info = np.iinfo(dtype.as_numpy_dtype)
        wraps = (lo < info.min) | (hi > info.max)
        return np.where(wraps, -_INF, lo), np.where(wraps, _INF, hi)
    if not dtype.is_floating or dtype.base_dtype == tf.float64:
        return lo, hi
    kind = dtype.as_numpy_dtype

    def step(v, to):      # inexact in ``dtype``: one more ulp away, whichever way it rounded
        r = v.astype(kind)
        return np.where(r.astype(np.float64) == v, v, np.nextafter(r, np.asarray(to, kind)).astype(np.float64))
    return step(lo, -_INF), step(hi, _INF)


def _full(x: _Num) -> np.ndarray:
    """Tiles where ``x`` may be NaN (its interval is everything)."""
    return (x.lo == -_INF) & (x.hi == _INF)


def _as_num(x: _Num | _Bool) -> _Num:
    if isinstance(x, _Num):
        return x
    return _Num(np.zeros(x.true.shape), np.where(x.false, 0.0, 1.0), np.where(x.true, 1.0, 0.0))


# ---- coordinates through broadcasting and axis moves

def _aligned(coords: Coords, rank: int, x: tf.Tensor) -> Coords:
    """``coords`` of a broadcasting op's output, for its input ``x`` (aligned from the right; a 1 carries none)."""
    if not x.shape.is_fully_defined():
        raise _Unknown
    lead = rank - x.shape.rank
    return tuple(None if c is None or c[0] < lead or x.shape[c[0] - lead] == 1 else (c[0] - lead, c[1])
                 for c in coords)


def _moved(coords: Coords, to_input: Callable[[int], Coord]) -> Coords:
    """``coords`` through an axis move: ``to_input(axis)`` is the input axis and its offset (None: size 1)."""
    def one(c):
        m = None if c is None else to_input(c[0])
        return None if m is None else (m[0], m[1] + c[1])
    return tuple(one(c) for c in coords)


def _static(t: tf.Tensor) -> np.ndarray:
    v = static_value(t)
    if v is None:
        raise _Unknown
    return v


def _through(index: int, to_input: Callable[[tf.Operation, tf.Tensor], Callable[[int], Coord]]):
    return lambda walk, op, t, coords: walk.value(op.inputs[index], _moved(coords, to_input(op, t)))


def _expand_dims(op, t):
    d = int(_static(op.inputs[1])) % t.shape.rank
    return lambda a: None if a == d else (a - (a > d), 0)


def _squeeze(op, t):
    shape = op.inputs[0].shape
    dims = {d % shape.rank for d in op.get_attr("squeeze_dims")} or {k for k in range(shape.rank) if shape[k] == 1}
    kept = [k for k in range(shape.rank) if k not in dims]
    return lambda a: (kept[a], 0)


def _reshape(op, t):
    out, inn = t.shape.as_list(), op.inputs[0].shape.as_list()

    def to_input(a):      # the input axis of the same length with the same elements after it: the same axis
        for b in range(len(inn)):
            if inn[b] == out[a] and math.prod(inn[b + 1:]) == math.prod(out[a + 1:]):
                return b, 0
        if out[a] == 1:
            return None
        raise _Unknown
    return to_input


def _transpose(op, t):
    perm = [int(p) % t.shape.rank for p in _static(op.inputs[1])]
    return lambda a: (perm[a], 0)


def _slice(op, t):
    begin = [int(b) for b in _static(op.inputs[1])]
    return lambda a: (a, begin[a])


def _strided_slice(op, t):
    """Output axis -> (input axis, begin) for unit strides; a new axis carries none, a shrunk one is dropped."""
    begin, strides = _static(op.inputs[1]), _static(op.inputs[3])
    shape = op.inputs[0].shape.as_list()
    bits = {k: op.get_attr(k) for k in ("begin_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    spec: list[Coord] = []
    k_in = 0
    for k in range(len(begin)):
        if bits["ellipsis_mask"] >> k & 1:
            after = sum(1 for k2 in range(k + 1, len(begin)) if not bits["new_axis_mask"] >> k2 & 1)
            spec += [(k_in + e, 0) for e in range(len(shape) - k_in - after)]
            k_in = len(shape) - after
        elif bits["new_axis_mask"] >> k & 1:
            spec.append(None)
        elif bits["shrink_axis_mask"] >> k & 1:
            k_in += 1
        elif strides[k] != 1 or k_in >= len(shape) or shape[k_in] is None:
            raise _Unknown
        else:
            b = 0 if bits["begin_mask"] >> k & 1 else int(begin[k])
            spec.append((k_in, b + shape[k_in] if b < 0 else b))
            k_in += 1
    spec += [(k, 0) for k in range(k_in, len(shape))]
    if len(spec) != t.shape.rank:
        raise _Unknown
    return lambda a: spec[a]


def _broadcast_to(walk, op, t, coords):
    return walk.value(op.inputs[0], _aligned(coords, t.shape.rank, op.inputs[0]))


def _operands(walk, op, t, coords) -> list[_Num | _Bool]:
    return [walk.value(x, _aligned(coords, t.shape.rank, x)) for x in op.inputs]


# ---- positional leaves

def _const(walk, op, t, coords):
    proto = op.get_attr("value")
    if not proto.tensor_content:          # values listed, the last one repeated: one value is a splat
        scalar = type(proto)()
        scalar.CopyFrom(proto)
        scalar.ClearField("tensor_shape")
        try:
            return walk.array(tensor_util.MakeNdarray(scalar), (None, None), t.dtype)
        except ValueError:
            pass
    return walk.array(tensor_util.MakeNdarray(proto), coords, t.dtype)


def _fill(walk, op, t, coords):
    return walk.array(_static(op.inputs[1]).reshape(()), (None, None), t.dtype)


def _like(value):
    return lambda walk, op, t, coords: walk.array(np.array(value), (None, None), t.dtype)


def _along(coords: Coords, axis: int) -> Coords:
    """``coords`` of a tensor that varies along ``axis`` only, for its 1-D profile."""
    return tuple(None if c is None or c[0] != axis else (0, c[1]) for c in coords)


def _exact(t: tf.Tensor, line: np.ndarray) -> np.ndarray:
    """``line`` if ``t``'s dtype holds its every value and step exactly (integers past 2^p do not), else unknown."""
    bound = exact_float_bound(t.dtype) or 0
    if not np.all(line == np.round(line)) or np.abs(line).max(initial=0) > bound:
        raise _Unknown
    return line


def _range(walk, op, t, coords):
    start, delta = (float(_static(op.inputs[k])) for k in (0, 2))
    line = start + delta * np.arange(t.shape[0])
    return walk.array(_exact(t, line) if t.dtype.is_floating else line, _along(coords, 0), t.dtype)


def _cumsum(walk, op, t, coords):
    """A running sum of a splat ``v``: ``v * k`` with ``k`` the running index (:mod:`..constant_cumsum`)."""
    axis = int(_static(op.inputs[1])) % t.shape.rank
    n = t.shape[axis]
    x = walk.value(op.inputs[0], (None, None))
    if not isinstance(x, _Num) or x.scale.any() or x.lo[0, 0] != x.hi[0, 0] or not np.isfinite(x.lo[0, 0]):
        raise _Unknown
    v = x.lo[0, 0]
    exclusive, reverse = bool(op.get_attr("exclusive")), bool(op.get_attr("reverse"))
    if t.dtype.is_floating and float_refusal(t.dtype, np.array(v), n, exclusive):
        raise _Unknown
    return walk.array(running_index(n, exclusive, reverse) * v, _along(coords, axis), t.dtype)


def _band_part(walk, op, t, coords):
    """Element (r, c) of the last two axes kept where r - c <= num_lower and c - r <= num_upper (< 0: all)."""
    lower, upper = (int(_static(op.inputs[k])) for k in (1, 2))
    rank = t.shape.rank
    rlo, rhi = walk.tiles(np.arange(t.shape[-2]), _along(coords, rank - 2))
    clo, chi = walk.tiles(np.arange(t.shape[-1]), _along(coords, rank - 1))
    inside = ((lower < 0) | (rhi - clo <= lower)) & ((upper < 0) | (chi - rlo <= upper))       # every element
    outside = ((lower >= 0) & (rlo - chi > lower)) | ((upper >= 0) & (clo - rhi > upper))     # none
    zero = walk.array(np.array(0), (None, None), t.dtype)
    return walk.choose(~outside, ~inside, walk.value(op.inputs[0], coords), zero)


# ---- arithmetic: known intervals exactly, then rounded outward; data parts carried with their scale

def _finite(x: _Num) -> np.ndarray:
    return np.isfinite(x.lo) & np.isfinite(x.hi)


def _product(x: _Num, y: _Num, divide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x * y`` or ``x / y`` per tile as (scale, lo, hi): (d + o) * c = d c + o c, |d c| <= |d| max|c|."""
    corners = np.stack([(np.divide if divide else np.multiply)(a, b) for a in (x.lo, x.hi) for b in (y.lo, y.hi)])
    lo, hi = corners.min(0), corners.max(0)
    sure = lambda v: (v.scale == 0) & _finite(v) & ((v.lo > 0) | (v.hi < 0))       # known, finite, not 0
    size = lambda v: np.maximum(np.abs(v.lo), np.abs(v.hi))
    if divide:
        ok = sure(y)
        return np.where(ok, x.scale / np.minimum(np.abs(y.lo), np.abs(y.hi)), _INF), lo, hi
    known = (x.scale == 0) & (y.scale == 0)
    nan = ((x.lo <= 0) & (x.hi >= 0) & ~_finite(y)) | ((y.lo <= 0) & (y.hi >= 0) & ~_finite(x))    # 0 x inf
    zero = lambda v: (v.scale == 0) & (v.lo == 0) & (v.hi == 0)
    zeroed = ((x.scale > 0) & zero(y) & _finite(x)) | ((y.scale > 0) & zero(x) & _finite(y))    # d x 0 = 0
    pure = (x.scale > 0) & (y.scale > 0) & (x.lo == 0) & (x.hi == 0) & (y.lo == 0) & (y.hi == 0)
    scale = np.select([known | zeroed, (x.scale > 0) & sure(y), (y.scale > 0) & sure(x), pure],
                      [0.0, x.scale * size(y), y.scale * size(x), x.scale * y.scale], _INF)   # d1 d2: as a MatMul
    lo = np.select([known & nan, zeroed | pure], [np.nan, 0.0], lo)
    hi = np.select([known & nan, zeroed | pure], [np.nan, 0.0], hi)
    return scale, lo, hi


def _add(walk, op, t, coords):
    x, y = (_as_num(v) for v in _operands(walk, op, t, coords))
    if op.type == "Sub":
        y = _Num(y.scale, -y.hi, -y.lo)
    return walk.num(x.scale + y.scale, x.lo + y.lo, x.hi + y.hi, t.dtype)


def _neg(walk, op, t, coords):
    x = _as_num(walk.value(op.inputs[0], coords))
    return walk.num(x.scale, -x.hi, -x.lo, t.dtype)


def _mul(walk, op, t, coords):
    if op.type == "RealDiv" and not t.dtype.is_floating:
        raise _Unknown
    x, y = (_as_num(v) for v in _operands(walk, op, t, coords))
    return walk.num(*_product(x, y, divide=op.type == "RealDiv"), t.dtype)


def _extreme(walk, op, t, coords):
    """Of known values, per bound; of data parts, one of them + [-inf, f(hi)]; min(data, known) <= known."""
    x, y = (_as_num(v) for v in _operands(walk, op, t, coords))
    f = np.maximum if op.type == "Maximum" else np.minimum
    both, mixed = (x.scale > 0) & (y.scale > 0), (x.scale > 0) != (y.scale > 0)
    scale = np.where(both, np.maximum(x.scale, y.scale), np.where(mixed & (f is np.maximum), _INF, 0.0))
    lo = np.where(_full(x) | _full(y), np.nan, np.where(both | mixed, -_INF, f(x.lo, y.lo)))
    hi = np.where(mixed, _INF if f is np.maximum else np.where(x.scale > 0, y.hi, x.hi), f(x.hi, y.hi))
    return walk.num(scale, lo, hi, t.dtype)


def _abs(walk, op, t, coords):
    x = _as_num(walk.value(op.inputs[0], coords))
    if x.scale.any():
        raise _Unknown
    lo = np.where(x.lo >= 0, x.lo, np.where(x.hi <= 0, -x.hi, 0.0))
    return walk.num(0.0, np.where(_full(x), np.nan, lo), np.maximum(-x.lo, x.hi), t.dtype)


def _cast(walk, op, t, coords):
    x = _as_num(walk.value(op.inputs[0], coords))
    src, dst = op.inputs[0].dtype.base_dtype, t.dtype.base_dtype
    data = x.scale > 0
    if dst == tf.bool:        # x != 0 (NaN is true)
        return walk.truth(data | ~((x.lo == 0) & (x.hi == 0)), data | ((x.lo <= 0) & (x.hi >= 0)))
    if dst.is_integer and src.is_floating:        # truncation; out of range: anything
        lo, hi = np.trunc(x.lo), np.trunc(x.hi)
        bad = data | ~np.isfinite(lo) | ~np.isfinite(hi)
        return walk.num(0.0, np.where(bad, -_INF, lo), np.where(bad, _INF, hi), dst)
    if not (dst.is_integer or dst.is_floating) or src.is_complex:
        raise _Unknown
    return walk.num(x.scale, x.lo, x.hi, dst)


# ---- booleans

def _compare(walk, op, t, coords):
    x, y = (_as_num(v) for v in _operands(walk, op, t, coords))
    kind = op.type
    if kind in ("Less", "LessEqual"):
        x, y, kind = y, x, "Greater" + kind[4:]
    nan, data = _full(x) | _full(y), (x.scale > 0) | (y.scale > 0)
    if kind == "Greater":
        true, false = x.hi > y.lo, (x.lo <= y.hi) | nan
    elif kind == "GreaterEqual":
        true, false = x.hi >= y.lo, (x.lo < y.hi) | nan
    else:
        overlap = np.maximum(x.lo, y.lo) <= np.minimum(x.hi, y.hi)
        same = (x.lo == x.hi) & (y.lo == y.hi) & (x.lo == y.lo)
        true, false = (overlap, ~same) if kind == "Equal" else (~same, overlap)
    return walk.truth(true | data, false | data)


def _logical(walk, op, t, coords):
    values = _operands(walk, op, t, coords)
    if op.type == "LogicalNot":
        return walk.truth(values[0].false, values[0].true)
    x, y = values
    if op.type == "LogicalAnd":
        return walk.truth(x.true & y.true, x.false | y.false)
    return walk.truth(x.true | y.true, x.false & y.false)


def _select(walk, op, t, coords):
    cond = op.inputs[0]
    if op.type == "Select" and cond.shape.rank == 1 and t.shape.rank > 1:     # a condition per row of axis 0
        c = walk.value(cond, _along(coords, 0))
    else:
        c = walk.value(cond, _aligned(coords, t.shape.rank, cond))
    a, b = (walk.value(x, _aligned(coords, t.shape.rank, x)) for x in op.inputs[1:])
    return walk.choose(c.true, c.false, a, b)


def _identity(walk, op, t, coords):
    return walk.value(op.inputs[0], coords)


_RULES: dict[str, Callable[[_Walk, tf.Operation, tf.Tensor, Coords], _Num | _Bool]] = {
    "Const": _const, "Fill": _fill, "ZerosLike": _like(0), "OnesLike": _like(1), "Range": _range,
    "Cumsum": _cumsum, "MatrixBandPart": _band_part,
    "ExpandDims": _through(0, _expand_dims), "Squeeze": _through(0, _squeeze), "Reshape": _through(0, _reshape),
    "Transpose": _through(0, _transpose), "Slice": _through(0, _slice),
    "StridedSlice": _through(0, _strided_slice), "BroadcastTo": _broadcast_to,
    **dict.fromkeys(["Identity", "StopGradient", "Snapshot", "PreventGradient", "EnsureShape", "CheckNumerics"],
                    _identity),
    **dict.fromkeys(["Add", "AddV2", "Sub"], _add), "Neg": _neg, "Mul": _mul, "RealDiv": _mul,
    "Maximum": _extreme, "Minimum": _extreme, "Abs": _abs, "Cast": _cast,
    **dict.fromkeys(["Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual"], _compare),
    **dict.fromkeys(["LogicalAnd", "LogicalOr", "LogicalNot"], _logical),
    "Select": _select, "SelectV2": _select,
}
