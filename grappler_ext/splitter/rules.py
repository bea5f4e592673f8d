"""splitter.rules: how a split axis passes through one op, one rule per TF op type.

    out_k[.., s:s+c, ..]  =  op(x_0 sliced or whole, x_1 sliced or whole, ..)[k]

where "sliced" means ``x_i[.., s:s+c, ..]`` along an axis of ``x_i`` that the rule names, with the
same static chunk ``c`` and dynamic offset ``s`` as the output.  The splitter computes a large region
of a graph one slice at a time inside a ``tf.while_loop``: from the region's root it walks up,
asking :func:`propagate` for every op which slice of each input yields the wanted slice of the
output, and rebuilds the op on those slices inside the loop body.

When a rule applies (each rule states its maths in a comment above its branches):

* elementwise ops, unary and n-ary with numpy broadcasting (an operand broadcast along the split
  axis, or too short to have it, is used whole), and the elementwise gradients TF emits;
* contractions when the split axis is a free index: a row of ``a @ b`` needs a row of ``a`` and all
  of ``b``; a batch axis splits both operands unless one broadcasts there; ``Einsum`` maps the output
  letter to the operands' letters; triangular and general solves split columns of the right-hand
  side and batch axes;
* reductions, softmax, top-k and cumulative ops along *other* axes than the split axis; fused
  batch norms and their gradients along their channels (and, in inference, along any axis);
* layout ops that keep the split axis whole and in order: transpose, reshape (the axis kept, or
  as a factor of an axis on the other side: :func:`factor_axis`), expand/squeeze, strided and
  plain slices taking the axis whole with stride 1, concat, pad, tile, broadcast, gather,
  pack/unpack, split, one-hot, reverse.

Rebuilding: most ops are re-created as they were on the sliced inputs (:func:`clone_op`); ops that
carry a full size in an attribute or constant input (``Reshape``, ``BroadcastTo``, ``Fill``,
``Slice``, ``EnsureShape``; ``StridedSlice`` and ``Squeeze`` whose masks and dims must be made
explicit) get a ``rebuild`` that writes the chunk ``c`` there instead.  Nothing needs the offset
``s``: a rule never shifts an index.

Why it is safe: every rule is an identity of array algebra -- the rebuilt op computes exactly the
elements of the wanted slice, with the same operations on the same values, and reduces along
every reduced axis in the same order.  Integer, boolean and layout results are bitwise equal.
Floating elementwise kernels may differ by a few ulps (measured on TF 2.21 CPU: 1 for exp, log,
sin, pow, add_n; up to 4 for elu, selu, sigmoid, acos): Eigen rounds the elements of a vector
packet and of the scalar tail differently, and slicing moves elements between the two.
Contractions (``MatMul``, ``Einsum``, solves) on a smaller operand may be blocked differently by
the kernel: rounding differences as well.  NaN and infinities stay where they were; nothing is
reassociated.

What it refuses (a falsy :class:`Refusal` with a one-line reason, never a guess):

* an op type without a rule: "cannot split through `MatrixDeterminant`: no rule" (determinants,
  QR, SVD and eigen-decompositions have none on purpose: every output element depends on the whole
  matrix); ``Cholesky`` and ``MatrixInverse`` split along batch axes only, for the same reason;
* stateful ops (random, variables, prints, asserts): run once per slice they would draw new
  numbers, print or check ``n`` times.  Random draws (dropout's mask) are the exception the user
  may allow (``Options.redraw_random``): each slice then draws its own values with a stateless
  generator keyed by a seed drawn once per call, the op and the slice's offset (:class:`Reseed`),
  so that a slice's gradient recomputes the very values its forward drew;
* the split axis reduced, normalised, sorted, accumulated, concatenated, padded, tiled, gathered,
  stacked or split along, or spread by a reshape over two axes of its input;
* dynamic shapes, and axes, permutations, shapes or slice bounds that are not constants;
* leaves (:func:`leaf_kind`: constants, inputs, variable reads, ranges): the splitter slices their
  output directly instead of splitting through them.  ``Fill``, ``ZerosLike`` and ``OnesLike``
  are not leaves but have rules: rebuilt per chunk, they never exist at full size.

Position: an analysis used by the splitter (no graph is changed here); :func:`clone_op` and the
``rebuild`` callables build ops in the current default graph, inside the splitter's loop body.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from grappler_ext import blocked_linalg, blocked_top_k, folding, graph_edit, loop_convolutions, op_types, shapes
from grappler_ext.op_types import CONVOLUTIONS, HELD_OPS, LOOP_TYPES, RESERVE_SPACES, reserve_space
from grappler_ext.splitter.outcome import Code, Redrawable
from grappler_ext.splitter.slicing import UNIT, Factor

__all__ = [
    "Propagation",
    "Refusal",
    "RULES",
    "LEAF_KINDS",
    "STATEFUL_TYPES",
    "RANDOM_DRAWS",
    "KEYED_DRAWS",
    "redrawn",
    "Reseed",
    "is_stateful",
    "propagate",
    "clone_op",
    "leaf_kind",
    "rule",
    "factor_axis",
    "image_axes",
    "windows_overlap",
    "batch_blocks_factor",
]

Rebuild = Callable[[tf.Operation, Sequence[tf.Tensor], int], list[tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class Propagation:
    """How to compute one slice of an op's output from slices of its inputs.

    Attributes:
      input_axes: one per op input: the axis of that input to slice with the same ``[s : s+c]``,
        or ``None`` when the input is used whole.
      output_axes: one per op output: the axis along which the rebuilt op's output is the
        corresponding slice of the original output (``None``: it is the whole original output).
      rebuild: ``rebuild(op, new_inputs, chunk) -> outputs``, called inside the target graph's
        default context; ``None`` means :func:`clone_op`.
      rebuild_at: for ops whose slice depends on where it starts (a band of a matrix, a range):
        ``rebuild_at(op, new_inputs, chunk, offset) -> outputs`` with the slice's dynamic offset;
        when set it is used instead of ``rebuild``.
      input_factors: ``None`` (every sliced input holds the split axis as the output does), or one
        per input: where the split axis lies in that input's axis (:class:`~.slicing.Factor`), given
        where it lies in the output's (the ``factor`` :func:`propagate` was called with) -- a
        reshape's ``[4, 512, E] <- [2048, E]`` split along the batch: ``Factor(1, 512)`` (rows
        ``[s, s + c)`` are rows ``[512 s, 512 (s + c))`` of the input), along the sequence:
        ``Factor(4, 1)``.  ``None`` for an input: as the output.  The chunk and offset a rebuild
        receives are always in its own output's rows.
    """

    input_axes: tuple[int | None, ...]
    output_axes: tuple[int | None, ...]
    rebuild: Rebuild | None = None
    rebuild_at: Callable[..., list[tf.Tensor]] | None = None
    input_factors: tuple | None = None

    def factor(self, index: int, output: Factor = UNIT) -> Factor:
        """Where the split axis lies in input ``index``'s axis, ``output`` where it lies in the
        output's (see :attr:`input_factors`)."""
        found = None if self.input_factors is None else self.input_factors[index]
        return output if found is None else found

    def build(self, op: tf.Operation, new_inputs: Sequence[tf.Tensor], chunk: int, offset=None) -> list[tf.Tensor]:
        """The op rebuilt on ``new_inputs`` (sliced per :attr:`input_axes`) for the slice at ``offset``."""
        if self.rebuild_at is not None:
            if offset is None:
                raise ValueError(f"`{op.type}`'s slice depends on its offset: pass offset")
            return self.rebuild_at(op, new_inputs, chunk, offset)
        if self.rebuild is None:
            return clone_op(op, new_inputs)
        return self.rebuild(op, new_inputs, chunk)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why the split axis cannot pass through an op; always falsy.  ``draw``: the op is a random
    draw that ``Options.redraw_random`` would let a loop draw again slice by slice."""

    reason: str
    draw: bool = False

    def __bool__(self) -> bool:
        return False


Rule = Callable[[tf.Operation, int, int], "Propagation | Refusal"]

# Op type -> rule(op, output_index, axis).  Rules are called only with fully defined static
# shapes on every input and output, a valid output index and 0 <= axis < rank of that output.
RULES: dict[str, Rule] = {}


def rule(*op_types: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule of each of ``op_types``."""

    def register(fn: Rule) -> Rule:
        for t in op_types:
            if t in RULES:
                raise ValueError(f"two split rules for `{t}`")
            RULES[t] = fn
        return fn

    return register


# Ops whose output the splitter slices directly (they start the region's data flow) instead of
# splitting through them:
#   constant       a literal: slice it;
#   input          a function parameter (or captured tensor): slice it;
#   variable read  reading a variable is fine to slice, but the read is not moved into the loop;
#   range          a 1-D arithmetic progression, small next to what it indexes: slice it.
# Fill, ZerosLike and OnesLike are deliberately not leaves: a leaf's whole output becomes a loop
# input, a full-size buffer; their rules rebuild them per chunk from a scalar (Fill) or from the
# chunk of their input (which XLA does not even read), so no full-size buffer exists.
LEAF_KINDS: dict[str, str] = {
    "Const": "constant",
    "Placeholder": "input",
    "ReadVariableOp": "variable read",
    "Range": "range",
    "LinSpace": "range",
}

# Refused even if TF's registry did not mark them stateful: re-running them per slice draws new
# random numbers, prints or checks n times, or touches a variable n times.
STATEFUL_TYPES = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "RandomShuffle",
    "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial", "ParameterizedTruncatedNormal",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "StatefulRandomBinomial",
    "VarHandleOp", "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceGather", "VariableV2", "Assign", "AssignAdd", "AssignSub",
    "Print", "PrintV2", "Assert", "CheckNumerics", "CheckNumericsV2",
    "StatefulPartitionedCall",
})


# Random draws ``Options.redraw_random`` lets a loop draw again slice by slice: the stateless
# generator drawing the same distribution.
RANDOM_DRAWS: dict[str, Callable] = {
    "RandomUniform": tf.random.stateless_uniform,
    "RandomStandardNormal": tf.random.stateless_normal,
    "TruncatedNormal": tf.random.stateless_truncated_normal,
}


# Stateless draws keyed by tensors of the program (Keras 3's dropout: a StatelessRandomUniformV2
# keyed from its seed generator's variable): drawn again slice by slice under the same option,
# each slice's key the op's key moved by the op's name and the slice's offset.
KEYED_DRAWS = frozenset({"StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2"})


def redrawn(op: tf.Operation) -> bool:
    """Whether ``op`` is a random draw a split loop draws again by slice (``Options.redraw_random``)."""
    return op.type in RANDOM_DRAWS or op.type in KEYED_DRAWS


def redraw_hint(records, redraw: bool) -> str:
    """For a warning that the limit cannot be met: where ``Options.redraw_random`` is off and a tensor
    no region could split would be planned with it on (its record's plan is a
    :class:`~.outcome.Redrawable`), what turning it on allows (the region through the draw stopped
    there, and its refusal may read as another reason: a draw's sum also feeding a variable's
    update); else nothing.  ``records[0]`` is the one the warning shows: where it is a draw's refusal
    (``Code.RANDOM_DRAW``), or a best effort whose region stops at a draw, which name the option
    themselves, nothing more."""
    effort = getattr(records[0].plan, "best_effort", None) if records else None
    if (redraw or not records or records[0].code == Code.RANDOM_DRAW
            or (effort is not None and effort.stop_code == Code.RANDOM_DRAW)):
        return ""
    draws = redrawable_draws(records)
    if not draws:
        return ""
    held = any(isinstance(r.plan, Redrawable) and r.plan.for_loop and draws[0] in r.plan.draws for r in records)
    return (f"; the random draw `{draws[0]}` is held whole for a loop that reads it" if held else
            f"; a random draw (`{draws[0]}`) stops the regions through it") + f": {REDRAW_ADVICE}"


REDRAW_ADVICE = ("enable tf_memsafe with redraw_random=True to let a loop draw other random numbers of the same "
                 "distribution slice by slice")


def redrawable_draws(records) -> list[str]:
    """The random draws that stopped regions which drawing again slice by slice would let through (the
    :class:`~.outcome.Redrawable` plans of ``records``), each once, sorted."""
    return sorted({name for r in records if isinstance(r.plan, Redrawable) for name in r.plan.draws})


@dataclasses.dataclass
class Reseed:
    """The seed a split region's random draws are drawn again from.

    ``tensor``: [2] int64, drawn once per call of the function by the splitter, outside the loop,
    before it builds it.  A slice's draw is keyed by it, the op's name and the slice's offset: the
    same in the slice's forward and in its gradient's recomputation, another for every slice, op
    and call.  ``None`` while the splitter sizes the loop (compiled, never run): a fixed key.
    """

    tensor: tf.Tensor | None = None


def leaf_kind(op: tf.Operation) -> str | None:
    """What kind of leaf ``op`` is (see :data:`LEAF_KINDS`), or ``None`` if it is not one."""
    return LEAF_KINDS.get(op.type)


def is_stateful(op: tf.Operation) -> bool:
    """Whether ``op`` must keep its place and count (random draws, variable access, prints, asserts)."""
    return op.type in STATEFUL_TYPES or bool(getattr(op, "_is_stateful", False))


# Ops a region computes again where they are read outside it too (:func:`recomputed`): elementwise
# ops; and, where what reads them outside only reduces them, products of small operands (a pairwise
# kernel's or distance's ``x @ y^T``) and a main diagonal's matrix (``tf.eye``).
RECOMPUTED = op_types.UNARY_ELEMENTWISE | op_types.BROADCASTING_ELEMENTWISE
RECOMPUTED_FOR_REDUCTIONS = frozenset({"MatMul", "BatchMatMulV2", "MatrixDiagV3"})


def recomputed(op: tf.Operation, reduced: bool = False, depth: int | None = None) -> bool:
    """Whether a region computes its own slices of ``op``, which something outside it reads too (the op
    itself staying for those readers): an elementwise op of the program's inputs, variables and
    constants, of operands of an eighth its elements or fewer (broadcast), or of such ops (a PCA's
    centred data ``x - mean``, read by the covariance and again by the scores after ``eigh``).  Its
    slices then hold nothing the program does not hold anyway, and draw nothing (a dropout's mask).
    ``reduced``: what reads it outside only reduces it (a loop of its own can then compute it in
    slices too, so that it is never whole): matrix products and a diagonal's matrix may be in the
    chain (t-SNE's Student-t affinities ``1 / (1 + d(Y))``, with ``d`` from ``Y Y^T`` and the diagonal
    zeroed by ``tf.eye``, read by their total and again by the divergence they are normalised in)."""
    depth = (6 if reduced else 4) if depth is None else depth        # (t-SNE's affinities: 6 ops from Y Y^T)
    out = op.outputs[0] if len(op.outputs) == 1 else None
    if (op.type not in RECOMPUTED and not (reduced and op.type in RECOMPUTED_FOR_REDUCTIONS) or out is None
            or is_stateful(op) or op.control_inputs or not out.shape.is_fully_defined()
            or not out.shape.num_elements()):
        return False
    return all((x.shape.is_fully_defined() and x.shape.num_elements() * 8 <= out.shape.num_elements())
               or x.op.type in HELD_OPS or (depth > 0 and recomputed(x.op, reduced, depth - 1)) for x in op.inputs)


def _dynamic_tensor(op: tf.Operation) -> str | None:
    """A description of the first input or output of ``op`` whose shape is not fully defined (an
    opaque reserve space aside)."""
    for kind, tensors in (("input", op.inputs), ("output", op.outputs)):
        for i, t in enumerate(tensors):
            if not t.shape.is_fully_defined() and (op.type, kind, i) not in RESERVE_SPACES:
                return f"{kind} {i} has dynamic shape {t.shape}"
    return None


def propagate(op: tf.Operation, output_index: int, axis: int, reseed: Reseed | None = None,
              factor: Factor = UNIT) -> Propagation | Refusal:
    """How ``op.outputs[output_index]`` split along ``axis`` splits the op's inputs and other outputs.

    ``factor``: where the split axis lies in that output's axis (the whole axis by default).  Only
    a reshape moves it (:attr:`Propagation.input_factors`); every other rule reads its inputs' axes
    as it reads its output's, so they hold the split axis alike.  ``reseed``: random draws
    (:data:`RANDOM_DRAWS`) may be drawn again per slice, keyed by it
    (``Options.redraw_random``); without it they are refused like every stateful op.  Raises
    ``ValueError`` for an output index or axis out of range (a caller's bug); every reason not to
    split is a :class:`Refusal`.
    """
    if op.type not in RULES:
        kind = leaf_kind(op)
        if kind is not None:
            return Refusal(f"`{op.type}` is a leaf ({kind}): slice its output instead of splitting through it")
    if op.type in RANDOM_DRAWS and reseed is not None:
        dynamic = _drawn_dynamic(op)
        if dynamic is not None:
            return Refusal(f"cannot split through `{op.type}` ({op.name}): {dynamic}; only static shapes are split")
        if not 0 <= axis < (op.outputs[0].shape.rank or 0) or output_index != 0:
            raise ValueError(f"no output {output_index} axis {axis} of `{op.name}`")
        return _redraw(op, axis, reseed)
    if op.type in RANDOM_DRAWS:
        return Refusal(f"cannot split through `{op.type}` ({op.name}): a stateful op would run once per slice, "
                       "drawing other random numbers; enable tf_memsafe with redraw_random=True to allow that "
                       "(each slice then draws its own)", draw=True)
    if op.type in KEYED_DRAWS:
        if reseed is None:
            return Refusal(f"cannot split through `{op.type}` ({op.name}): a slice of a random draw is not the draw "
                           "of a slice; enable tf_memsafe with redraw_random=True to allow other draws of the same "
                           "distribution (each slice then draws its own)", draw=True)
        dynamic = _drawn_dynamic(op)
        if dynamic is not None:
            return Refusal(f"cannot split through `{op.type}` ({op.name}): {dynamic}; only static shapes are split")
        if not 0 <= axis < (op.outputs[0].shape.rank or 0) or output_index != 0:
            raise ValueError(f"no output {output_index} axis {axis} of `{op.name}`")
        return _redraw_keyed(op, axis)
    if is_stateful(op):
        return Refusal(f"cannot split through `{op.type}` ({op.name}): a stateful op would run once per slice")
    if op.type in LOOP_TYPES and not graph_edit.is_generated(op):
        return Refusal(f"cannot split through the program's own loop `{op.name}` (a tf.while_loop), which reads "
                       "it whole at every step")
    if op.type not in RULES:
        return Refusal(f"cannot split through `{op.type}`: no rule")
    if not 0 <= output_index < len(op.outputs):
        raise ValueError(f"`{op.name}` has {len(op.outputs)} outputs, no output {output_index}")
    rank = op.outputs[output_index].shape.rank
    if rank is None or not 0 <= axis < rank:
        if rank is None:
            return Refusal(f"cannot split through `{op.type}` ({op.name}): output {output_index} has unknown rank")
        raise ValueError(f"axis {axis} out of range for output {output_index} of `{op.name}` (rank {rank})")
    dynamic = _dynamic_tensor(op)
    # Other dimensions known only at run time are planned at a nominal size, the chunk scaled to
    # the run's (:mod:`.scaling`); outside such planning only the split axis may be one.
    scaled = shapes.nominal_size() is not None
    if dynamic is not None and op.outputs[output_index].shape[axis] is not None and not scaled:
        return Refusal(f"cannot split through `{op.type}` ({op.name}): {dynamic}; only the split axis may be "
                       "dynamic")
    try:
        if op.type in _FACTORED:
            result = RULES[op.type](op, output_index, axis, factor)
        else:
            result = RULES[op.type](op, output_index, axis)
    except (TypeError, ValueError):
        if dynamic is None:
            raise
        # A rule that reads the sizes it needs from static shapes (a Reshape's factors).
        return Refusal(f"cannot split through `{op.type}` ({op.name}): {dynamic}; its rule needs static sizes")
    if result and (len(result.input_axes) != len(op.inputs) or len(result.output_axes) != len(op.outputs)
                   or result.output_axes[output_index] != axis):
        raise AssertionError(f"the split rule of `{op.type}` returned {result} for output {output_index}, "
                             f"axis {axis}")
    if result and dynamic is not None:
        stray = _dynamic_off_axis(op, result, scaled)
        if stray is not None:
            return Refusal(f"cannot split through `{op.type}` ({op.name}): {stray}; only the split axis may be "
                           "dynamic")
    return result


def _dynamic_off_axis(op: tf.Operation, prop: Propagation, scaled: bool = False) -> str | None:
    """The first input or output of ``op`` with a dimension unknown until run time other than the
    one ``prop`` splits it along (a tensor read whole must be static), or ``None``; ``scaled``: only
    one of unknown rank (the others' sizes are planned at a nominal size)."""
    for kind, tensors, axes in (("input", op.inputs, prop.input_axes), ("output", op.outputs, prop.output_axes)):
        for i, (t, a) in enumerate(zip(tensors, axes)):
            if (op.type, kind, i) in RESERVE_SPACES:
                continue
            if t.shape.rank is None:
                return f"{kind} {i} has unknown rank"
            if not scaled and any(d is None and j != a for j, d in enumerate(t.shape.as_list())):
                return f"{kind} {i} has dynamic shape {t.shape}" + ("" if a is None else f", split along {a}")
    return None


def _known_at_run(t: tf.Tensor) -> bool:
    """Whether ``t``'s sizes known only at run time are products of the function's input sizes,
    under planning with them (:func:`_sizes` reads them so when the loop is built)."""
    return shapes.nominal_size() is not None and shapes.known_shape(t)


def _drawn_dynamic(op: tf.Operation) -> str | None:
    """Why a random draw of ``op``'s cannot be drawn again by slice for its shapes, or ``None``: its
    shape must be static, or (planned with run-time sizes) a product of them (:func:`_draw_dims`)."""
    dynamic = _dynamic_tensor(op)
    return None if dynamic is None or _known_at_run(op.outputs[0]) else dynamic


def _draw_dims(op: tf.Operation) -> list | None:
    """A draw's dimensions: its constant shape operand, or its static output shape where sizes known
    only at run time are products of them (read when the loop is built: :func:`_sizes`)."""
    shape = _const(op.inputs[0])
    if shape is not None:
        return [int(d) for d in np.asarray(shape).reshape(-1)]
    return op.outputs[0].shape.as_list() if _known_at_run(op.outputs[0]) else None


def _redraw(op: tf.Operation, axis: int, reseed: Reseed) -> Propagation | Refusal:
    """A slice of a random draw along ``axis``, drawn again (not the unsplit draw's slice)."""
    dims = _draw_dims(op)
    if dims is None:
        return _not_constant(op, "shape")
    salt = zlib.crc32(op.name.encode()) & 0x7FFFFFFF
    draw = RANDOM_DRAWS[op.type]

    def rebuild_at(op, inputs, chunk, offset):
        seed = reseed.tensor if reseed.tensor is not None else tf.zeros([2], tf.int64)
        key = seed + tf.stack([tf.constant(salt, tf.int64), tf.cast(offset, tf.int64)])
        # Philox by name: with "auto_select", XLA would derive the key inside every element (random_key).
        return [draw(_sizes(dims, axis, chunk, tf.int32, _operand(inputs, 0), op.outputs[0]), seed=key,
                     dtype=op.get_attr("dtype"), alg="philox")]

    return Propagation((None,), (axis,), rebuild_at=rebuild_at)


def _redraw_keyed(op: tf.Operation, axis: int) -> Propagation | Refusal:
    """A slice of a keyed stateless draw along ``axis``, drawn again with the op's key moved by the
    op's name and the slice's offset (the same in a slice's forward and its gradient's recomputation,
    another for every slice and op; the op's key, from the program, another for every call)."""
    dims = _draw_dims(op)
    if dims is None:
        return _not_constant(op, "shape")
    salt = zlib.crc32(op.name.encode()) & 0x7FFFFFFF

    def rebuild_at(op, inputs, chunk, offset):
        shape, key, counter, alg = inputs
        moved = tf.cast(tf.constant(salt, tf.int64) * (1 << 31) + tf.cast(offset, tf.int64) + 1, key.dtype)
        return _clone(op, [_sizes(dims, axis, chunk, op.inputs[0].dtype, shape, op.outputs[0]), key + moved, counter,
                           alg])

    return Propagation((None,) * len(op.inputs), (axis,), rebuild_at=rebuild_at)


# --- building ----------------------------------------------------------------------------------


def _attr_value(value) -> attr_value_pb2.AttrValue:
    """An ``AttrValue`` for the Python values rebuilds override: int, list of ints, TensorShape."""
    if isinstance(value, tf.TensorShape):
        return attr_value_pb2.AttrValue(shape=value.as_proto())
    if isinstance(value, (list, tuple)):
        return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(i=[int(v) for v in value]))
    return attr_value_pb2.AttrValue(i=int(value))


def _clone(op: tf.Operation, new_inputs: Sequence[tf.Tensor], **overrides) -> list[tf.Tensor]:
    return clone_op(op, new_inputs, {name: _attr_value(value) for name, value in overrides.items()})


def clone_op(op: tf.Operation, new_inputs, attrs: dict | None = None) -> list[tf.Tensor]:
    """:func:`grappler_ext.graph_edit.clone_op`; a convolution made so in a loop's body gets gradients
    XLA:CPU runs fast there (:mod:`grappler_ext.loop_convolutions`)."""
    outputs = graph_edit.clone_op(op, new_inputs, attrs)
    canonical = loop_convolutions.made(outputs[0].op if outputs else None)
    return outputs if canonical is None else canonical


def _with_chunk(dims: Sequence[int | None], axis: int, chunk: int) -> list[int]:
    """``dims`` with ``chunk`` at ``axis`` (the only dimension that may be unknown: the split one)."""
    return [int(chunk) if i == axis else int(d) for i, d in enumerate(dims)]


def _operand(inputs: Sequence[tf.Tensor], index: int) -> tf.Tensor | None:
    """A rebuild's shape operand, where it was given (a rule's test may pass the sliced input alone)."""
    return inputs[index] if index < len(inputs) else None


def _sizes(dims: Sequence[int | None], axis: int, chunk, dtype, operand: tf.Tensor | None = None,
           like: tf.Tensor | None = None) -> tf.Tensor:
    """``dims`` with ``chunk`` at ``axis`` as a rebuilt op's shape operand: a constant where every
    size is static; else stacked when the loop is built, a size known only at run time read from the
    function's input sizes where it is a product of them (``like``: the tensor ``dims`` are of, under
    the nominal sizes' table the loop is built with), else from ``operand`` (the op's own shape
    operand, read whole), and a chunk scaled at run time as it is (:mod:`.scaling`).  XLA resolves it
    when it compiles (sizes read from the function's inputs also inside loops, where a shape computed
    in the program and passed in is not always a compile-time constant to it)."""
    if not isinstance(chunk, tf.Tensor) and all(d is not None for i, d in enumerate(dims) if i != axis):
        return tf.constant(_with_chunk(dims, axis, chunk), dtype=dtype)
    state = shapes.symbolic() if like is not None else None
    known = shapes.monomials(like) if state is not None else None
    parts = []
    for i, d in enumerate(dims):
        if i == axis:
            parts.append(tf.cast(chunk, dtype))
        elif d is not None:
            parts.append(tf.constant(int(d), dtype))
        elif known is not None and known[i] is not None:
            parts.append(tf.cast(state[0].run_value(known[i]), dtype))
        elif operand is None:
            raise ValueError(f"dimension {i} of {list(dims)} is known only at run time, and no operand gives it")
        else:
            parts.append(tf.cast(operand[i], dtype))
    return tf.stack(parts)


# --- helpers the rules read ----------------------------------------------------------------------


def _dims(t: tf.Tensor) -> list[int]:
    return t.shape.as_list()


def _const(t: tf.Tensor) -> np.ndarray | None:
    return folding.static_value(t)


def _const_axes(t: tf.Tensor, rank: int) -> list[int] | None:
    """A constant axis or list of axes, normalised to ``[0, rank)``; ``None`` if not constant."""
    value = _const(t)
    return None if value is None else [int(v) % rank if rank else int(v) for v in value.reshape(-1)]


def _not_constant(op: tf.Operation, what: str) -> Refusal:
    return Refusal(f"`{op.type}` ({op.name}): {what} is not a constant")


def _aligned_axis(op: tf.Operation, index: int, out_dims: list[int], axis: int) -> int | None | Refusal:
    """The axis of input ``index`` that numpy broadcasting aligns with output ``axis``, or ``None``
    when that input is broadcast along it (dim 1, or too short to have the axis)."""
    dims = _dims(op.inputs[index])
    j = axis - (len(out_dims) - len(dims))
    if j < 0:
        return None
    if dims[j] == out_dims[axis]:
        return j
    if dims[j] == 1:
        return None
    return Refusal(f"`{op.type}` ({op.name}): input {index} has {dims[j]} on axis {j} where the output has "
                   f"{out_dims[axis]}")


def _broadcast(op: tf.Operation, axis: int, inputs: Sequence[int]) -> tuple | Refusal:
    """Per op input: the aligned axis for the inputs listed in ``inputs``, ``None`` for the rest."""
    out_dims = _dims(op.outputs[0])
    axes: list[int | None] = [None] * len(op.inputs)
    for i in inputs:
        a = _aligned_axis(op, i, out_dims, axis)
        if isinstance(a, Refusal):
            return a
        axes[i] = a
    return tuple(axes)


# --- elementwise --------------------------------------------------------------------------------

_UNARY = tuple(sorted(op_types.UNARY_ELEMENTWISE))


# out[.., s:s+c, ..] = f(x[.., s:s+c, ..])
@rule(*_UNARY)
def _unary(op, output_index, axis):
    return Propagation((axis,), (axis,))


# out[.., s:s+c, ..] = ensure_shape(x[.., s:s+c, ..], shape with c on the axis)
@rule("EnsureShape")
def _ensure_shape(op, output_index, axis):
    def rebuild(op, inputs, chunk):
        shape = tf.TensorShape(op.get_attr("shape"))
        if shape.rank is not None:
            dims = shape.as_list()
            dims[axis] = chunk if isinstance(chunk, int) else None
            shape = tf.TensorShape(dims)
        return _clone(op, inputs, shape=shape)

    return Propagation((axis,), (axis,), rebuild)


_BROADCASTING = tuple(sorted(op_types.BROADCASTING_ELEMENTWISE))


# out[.., s:s+c, ..] = f(x[.., s:s+c, ..], y)        y broadcast along the axis (dim 1, or missing)
# out[.., s:s+c, ..] = f(x[.., s:s+c, ..], y[.., s:s+c, ..])   y aligned with the axis (numpy rules)
@rule(*_BROADCASTING)
def _broadcasting(op, output_index, axis):
    axes = _broadcast(op, axis, range(len(op.inputs)))
    return axes if isinstance(axes, Refusal) else Propagation(axes, (axis,))


# Select (v1): t and e have the output's shape; cond is either that too, a scalar, or a vector
# picking whole rows (axis 0).
#   out[s:s+c] = select(cond[s:s+c], t[s:s+c], e[s:s+c])          cond a row vector, axis 0
#   out[.., s:s+c, ..] = select(cond, t[.., s:s+c, ..], e[..])   cond a row vector, other axes
@rule("Select")
def _select(op, output_index, axis):
    cond, t = op.inputs[0], op.inputs[1]
    if cond.shape.rank == 1 and t.shape.rank > 1:
        return Propagation((0 if axis == 0 else None, axis, axis), (axis,))
    if cond.shape.rank == 0:
        return Propagation((None, axis, axis), (axis,))
    return Propagation((axis, axis, axis), (axis,))


# out[.., s:s+c] = value[.., s:s+c] + bias[s:s+c]            the channel axis (last; 1 for NCHW)
# out[.., s:s+c, ..] = value[.., s:s+c, ..] + bias           any other axis
@rule("BiasAdd", "BiasAddV1")
def _bias_add(op, output_index, axis):
    rank = op.outputs[0].shape.rank
    nchw = op.type == "BiasAdd" and op.get_attr("data_format") == b"NCHW"
    channel = 1 if nchw else rank - 1
    return Propagation((axis, 0 if axis == channel else None), (axis,))


# BiasAddGrad(g)[s:s+c] = BiasAddGrad(g[.., s:s+c])      the channel axis (NCHW: axis 1); a bias's
# gradient, split with the bias (a wide layer's update column block by column block)
@rule("BiasAddGrad")
def _bias_add_grad(op, output_index, axis):
    rank = op.inputs[0].shape.rank
    channel = 1 if op.get_attr("data_format") == b"NCHW" else rank - 1
    return Propagation((channel,), (axis,))


# --- contractions ---------------------------------------------------------------------------------


# (a @ b)[s:s+c, :] = a[s:s+c, :] @ b        (a^T @ b)[s:s+c, :] = (a[:, s:s+c])^T @ b
# (a @ b)[:, s:s+c] = a @ b[:, s:s+c]        (a @ b^T)[:, s:s+c] = a @ (b[s:s+c, :])^T
@rule("MatMul")
def _matmul(op, output_index, axis):
    if axis == 0:
        return Propagation((1 if op.get_attr("transpose_a") else 0, None), (axis,))
    return Propagation((None, 0 if op.get_attr("transpose_b") else 1), (axis,))


# (x @ y)[.., s:s+c, :] = x[.., s:s+c, :] @ y            rows: x only (adj_x: x's last axis)
# (x @ y)[.., :, s:s+c] = x @ y[.., :, s:s+c]            columns: y only (adj_y: y's row axis)
# (x @ y)[s:s+c, ..] = x[s:s+c, ..] @ y[s:s+c, ..]       batch: both, unless one broadcasts there
@rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(op, output_index, axis):
    rank = op.outputs[0].shape.rank
    rx, ry = op.inputs[0].shape.rank, op.inputs[1].shape.rank
    if axis == rank - 2:
        return Propagation((rx - 1 if op.get_attr("adj_x") else rx - 2, None), (axis,))
    if axis == rank - 1:
        return Propagation((None, ry - 2 if op.get_attr("adj_y") else ry - 1), (axis,))
    axes = _broadcast(op, axis, (0, 1))
    return axes if isinstance(axes, Refusal) else Propagation(axes, (axis,))


# einsum("ij,jk->ik", a, b)[s:s+c, :] = einsum("ij,jk->ik", a[s:s+c, :], b): the output letter
# at the axis is a free index; each operand holding it is sliced there, the others used whole.
@rule("Einsum")
def _einsum(op, output_index, axis):
    equation = op.get_attr("equation").decode().replace(" ", "")
    if "." in equation:
        return Refusal(f"`Einsum` equation {equation!r} has an ellipsis: not split")
    lhs, _, out = equation.partition("->")  # TF's Einsum op always has an explicit output
    operands = lhs.split(",")
    if len(operands) != len(op.inputs) or len(out) != op.outputs[0].shape.rank:
        return Refusal(f"`Einsum` equation {equation!r} does not match its operands' ranks")
    letter = out[axis]
    size = _dims(op.outputs[0])[axis]
    axes = []
    for i, term in enumerate(operands):
        if term.count(letter) > 1:
            return Refusal(f"`Einsum` {equation!r} takes a diagonal over {letter!r}, the split axis")
        if letter not in term:
            axes.append(None)
            continue
        j = term.index(letter)
        if _dims(op.inputs[i])[j] != size:
            return Refusal(f"`Einsum` {equation!r} broadcasts operand {i} along {letter!r}: not split")
        axes.append(j)
    return Propagation(tuple(axes), (axis,))


# solve(A, B)[.., :, s:s+c] = solve(A, B[.., :, s:s+c])     columns of the right-hand side are
#                                                           solved independently (lower, adjoint alike)
# solve(A, B)[s:s+c, ..] = solve(A[s:s+c, ..], B[s:s+c, ..])  batch axes, unless broadcast
# The row axis couples every row of the solution: refused.  A triangular solve against a large
# matrix read whole is rebuilt blocked (grappler_ext.blocked_linalg: XLA's own expansion hoists
# masked copies and slices of the matrix out of the loop, about 1.75 of it).
@rule("MatrixTriangularSolve", "MatrixSolve")
def _solve(op, output_index, axis):
    rank = op.outputs[0].shape.rank
    if axis == rank - 1:
        return Propagation((None, op.inputs[1].shape.rank - 1), (axis,), rebuild=_blocked_solve)
    if axis == rank - 2:
        return Refusal(f"`{op.type}` couples the rows (axis {axis}) of its solution: not split")
    axes = _broadcast(op, axis, (0, 1))
    return axes if isinstance(axes, Refusal) else Propagation(axes, (axis,))


# cholesky(x)[s:s+c, ..] = cholesky(x[s:s+c, ..])    batch axes: each matrix is factored (inverted)
# on its own.  An entry of the factor or inverse depends on the whole matrix: its two axes are refused.
@rule("Cholesky", "MatrixInverse")
def _per_matrix(op, output_index, axis):
    rank = op.outputs[0].shape.rank
    if axis >= rank - 2:
        return Refusal(f"`{op.type}` couples every entry of its matrix (axis {axis}): only its batch axes are split")
    return Propagation((axis,), (axis,))


# Diagonal ops, batch axes: diag_part(x)[s:s+c, ..] = diag_part(x[s:s+c, ..]).
# A matrix's rows (columns alike) of the main diagonal d (k = 0, ``tf.eye``, ``tf.linalg.diag(d)``):
#     diag(d)[.., s:s+c, :] = where(s + r == j, d[.., s + r], pad)
# a compare of indices offset by s, d read whole (the self-pair masks of a SimCLR loss or an N-body
# step: ``tf.where(tf.eye(n) > 0, 0, x)``).  Other diagonals, and diag_part's axis, are refused.
@rule("MatrixDiagPartV3", "MatrixDiagV3", "MatrixDiagPart", "MatrixDiag")
def _matrix_diag(op, output_index, axis):
    batch = op.outputs[0].shape.rank - 2 if op.type in ("MatrixDiagV3", "MatrixDiag") else \
        op.inputs[0].shape.rank - 2
    if axis < batch:
        return Propagation((axis,) + (None,) * (len(op.inputs) - 1), (axis,))
    k = _const(op.inputs[1]) if op.type == "MatrixDiagV3" else 0 if op.type == "MatrixDiag" else None
    if not _main_diagonal(op, k):
        return Refusal(f"axis {axis} is a diagonal axis of `{op.type}`: only batch axes, and the rows or columns "
                       "of a main diagonal's matrix, are split")
    return _diagonal_slices(op, axis, (None,) * len(op.inputs), lambda o, ins: (ins[0], tf.cast(
        ins[4] if o.type == "MatrixDiagV3" else tf.zeros([], ins[0].dtype), ins[0].dtype)))


# set_diag(x, d)[.., s:s+c, ..] = set_diag(x[.., s:s+c, ..], d[.., s:s+c, ..])     batch axes
# set_diag(x, d)[.., s:s+c, :] = where(s + r == j, d[.., s + r], x[.., s:s+c, :])   rows (columns alike) of
# the main diagonal (k = 0), d read whole: a GP's noise, ``set_diag(K, diag_part(K) + s2)`` (GPflow's own).
@rule("MatrixSetDiagV3")
def _matrix_set_diag(op, output_index, axis):
    batch = op.outputs[0].shape.rank - 2
    if axis < batch:
        return Propagation((axis, axis, None), (axis,))
    if not _main_diagonal(op, _const(op.inputs[2])):
        return Refusal(f"axis {axis} is a diagonal axis of `{op.type}` off the main diagonal: not split")
    return _diagonal_slices(op, axis, (axis, None, None), lambda o, ins: (ins[1], ins[0]))


def _main_diagonal(op, k) -> bool:
    """Whether ``k`` (a diagonal op's constant offset, or ``None``) is the main diagonal's, 0, of a
    matrix whose two axes are static."""
    return k is not None and np.ndim(k) == 0 and int(k) == 0 and None not in _dims(op.outputs[0])[-2:]


def _diagonal_slices(op, axis: int, input_axes, parts) -> Propagation:
    """The split of a main diagonal's matrix along its rows or columns (``axis``): each slice made by
    :func:`_with_diagonal` from ``parts(op, rebuilt inputs) -> (diagonal, fill)``."""
    rows = axis == op.outputs[0].shape.rank - 2
    other = _dims(op.outputs[0])[-1 if rows else -2]
    return Propagation(input_axes, (axis,), rebuild_at=lambda o, ins, c, s: [
        _with_diagonal(*parts(o, ins), c, s, rows, other)])


def _with_diagonal(d, fill, chunk, offset, rows: bool, other: int) -> tf.Tensor:
    """Rows (or columns) ``offset`` to ``offset + chunk`` of a matrix with ``d`` on its main diagonal and
    ``fill`` elsewhere (a scalar, or the slice of the matrix it is set into); ``other``: the matrix's
    size along the axis not split."""
    at = tf.range(chunk, dtype=tf.int64) + tf.cast(offset, tf.int64)                  # the slice's own indices
    length = tf.cast(tf.shape(d)[-1], tf.int64)
    value = tf.gather(d, tf.minimum(at, length - 1), axis=-1)                           # [.., c] (past d: masked)
    equal = at[:, None] == tf.range(other, dtype=tf.int64)[None] if rows else \
        tf.range(other, dtype=tf.int64)[:, None] == at[None]                          # [c, m] or [m, c]
    value = value[..., :, None] if rows else value[..., None, :]
    return tf.where(equal, value, fill)


@rule("MatrixBandPart")
def _matrix_band_part(op, output_index, axis):
    """Batch axes split plainly; a row or column slice keeps the band of its absolute indices."""
    rank = op.outputs[0].shape.rank
    if axis < rank - 2:
        # out[.., s:s+c, :, :] = band_part(x[.., s:s+c, :, :]): the band is per matrix.
        return Propagation((axis, None, None), (axis,))
    # out[s:s+c, :] keeps x[i, j] where (lower < 0 or i - j <= lower) and (upper < 0 or j - i <= upper),
    # with i the row's absolute index s + r (columns likewise): a mask on absolute indices.
    split_rows = axis == rank - 2
    return Propagation((axis, None, None), (axis,),
                       rebuild_at=lambda o, ins, c, s: _band_part_slice(ins, s, split_rows))


def _band_part_slice(new_inputs, offset, split_rows: bool):
    x, lower, upper = new_inputs
    rank = x.shape.rank
    # (sizes known only at run time: read from the slice, whose shape XLA knows when it compiles)
    rows, cols = (x.shape[i] if x.shape[i] is not None else tf.shape(x)[i] for i in (-2, -1))
    r = tf.range(rows, dtype=tf.int64)[:, None]                                  # [R, 1]
    c = tf.range(cols, dtype=tf.int64)[None, :]                                  # [1, C]
    shift = tf.cast(offset, tf.int64)
    if split_rows:
        r = r + shift
    else:
        c = c + shift
    lower = tf.cast(lower, tf.int64)
    upper = tf.cast(upper, tf.int64)
    keep = tf.logical_and(tf.logical_or(lower < 0, r - c <= lower), tf.logical_or(upper < 0, c - r <= upper))
    keep = keep[(tf.newaxis,) * (rank - 2)]                                      # [.., R, C]
    return [tf.where(keep, x, tf.zeros([], x.dtype))]


# --- reductions and normalisations ------------------------------------------------------------------

_REDUCTIONS = ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm")


# sum(x, R)[.., s:s+c, ..] = sum(x[.., s:s+c, ..], R)    the axis kept (not in R); without
# keep_dims, output axis a is the a-th input axis not reduced.
@rule(*_REDUCTIONS, "ArgMax", "ArgMin")
def _reduction(op, output_index, axis):
    rank = op.inputs[0].shape.rank
    reduced = _const_axes(op.inputs[1], rank)
    if reduced is None:
        return _not_constant(op, "the reduction axis")
    keep_dims = op.type not in ("ArgMax", "ArgMin") and op.get_attr("keep_dims")
    if keep_dims:
        if axis in reduced:
            return Refusal(f"axis {axis} is reduced by `{op.type}`")
        in_axis = axis
    else:
        in_axis = [i for i in range(rank) if i not in reduced][axis]
    return Propagation((in_axis, None), (axis,))


# softmax(x)[.., s:s+c, :] = softmax(x[.., s:s+c, :])    any axis but the last, which it normalises
@rule("Softmax", "LogSoftmax")
def _softmax(op, output_index, axis):
    if axis == op.outputs[0].shape.rank - 1:
        return Refusal(f"`{op.type}` normalises over axis {axis}, the split axis")
    return Propagation((axis,), (axis,))


# fused_batch_norm(x, scale, offset, mean, var)[k][.., s:s+c (channel), ..]
#   = fused_batch_norm(x[.., s:s+c, ..], scale[s:s+c], offset[s:s+c], mean[s:s+c], var[s:s+c])[k]
# each channel is normalised by its own statistics (over the other axes, when training), so a
# slice of the channels is the same op on their slices; the [C] outputs (batch mean and variance,
# reserve spaces) slice with them, empty ones ([0]: the statistics of a training step's input) are
# read whole.  tf_keras' LayerNormalization is this op on [1, B * L, D, 1] in NCHW: one channel per
# position, so a loop along the sequence passes it.  In inference, every other axis is elementwise
# too.  The gradient (FusedBatchNormGrad*) slices along the channels alike; its scale and offset
# gradients are sums over the other axes, so only the channels.
@rule("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
def _fused_batch_norm(op, output_index, axis):
    channel = _channel_axis(op)
    if isinstance(channel, Refusal):
        return channel
    if output_index > 0 or axis == channel:
        return _per_channel(op, channel, main_inputs=1, main_outputs=1)
    if op.get_attr("is_training"):
        return Refusal(f"`{op.type}` normalises over axis {axis}, the split axis (training statistics)")
    return Propagation((axis,) + (None,) * (len(op.inputs) - 1),
                       (axis,) + (None,) * (len(op.outputs) - 1))


@rule("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3")
def _fused_batch_norm_grad(op, output_index, axis):
    channel = _channel_axis(op)
    if isinstance(channel, Refusal):
        return channel
    if output_index == 0 and axis != channel:
        return Refusal(f"`{op.type}` sums its scale and offset gradients over axis {axis}, the split axis")
    return _per_channel(op, channel, main_inputs=2, main_outputs=1)


def _channel_axis(op: tf.Operation) -> int | Refusal:
    """The channel axis of a fused batch norm (or its gradient) by its data format."""
    fmt = op.get_attr("data_format")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    if fmt in ("NHWC", "NDHWC"):
        return op.inputs[0].shape.rank - 1
    if fmt in ("NCHW", "NCDHW"):
        return 1
    return Refusal(f"`{op.type}` has data format {fmt!r}: only NHWC, NCHW and their 3-D forms have a rule")


def _per_channel(op: tf.Operation, channel: int, main_inputs: int, main_outputs: int) -> Propagation | Refusal:
    """A fused batch norm's (or its gradient's) slice of the channels: its first ``main_inputs``
    inputs and ``main_outputs`` outputs along ``channel``, the [C] ones along 0, empty ones whole."""
    def axes(tensors, main):
        out = []
        for i, t in enumerate(tensors):
            if i < main:
                out.append(channel)
            elif reserve_space(t) or t.shape.num_elements() == 0:
                out.append(None)
            elif t.shape.rank == 1:
                out.append(0)
            else:
                return None
        return tuple(out)

    input_axes, output_axes = axes(op.inputs, main_inputs), axes(op.outputs, main_outputs)
    if input_axes is None or output_axes is None:
        return Refusal(f"`{op.type}` ({op.name}) has a reserve space that is not one value per channel")
    return Propagation(input_axes, output_axes)


# --- convolutions and pooling ------------------------------------------------------------------
#
# A window slides over the spatial axes only, so a slice of the batch (axis 0 in every data format)
# is the op on the batch's slice, the filter whole.  A convolution's output channel c reads only the
# filter's column c: a slice of the output channels is the op on the filter's slice, the input whole
# (not for depthwise convolutions, whose outputs are input channel x multiplier).  Pooling is per
# channel: a slice of the channels is the op on the input's slice (the window must not span channels).
# A spatial axis is refused: each output row reads a window of input rows, overlapping its neighbours'.
_POOLS = ("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D")


def image_axes(op: tf.Operation, rank: int) -> tuple[int, int] | Refusal:
    """``(batch axis, channel axis)`` of a convolution's or pool's input and output by its data format."""
    fmt = op.get_attr("data_format")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    if fmt in ("NHWC", "NDHWC", "NWC"):
        return 0, rank - 1
    if fmt in ("NCHW", "NCDHW", "NCW"):
        return 0, 1
    return Refusal(f"`{op.type}` ({op.name}) has data format {fmt!r}: no rule")


def windows_overlap(op: tf.Operation) -> bool:
    """Whether ``op`` is a convolution whose windows overlap along a spatial axis (its kernel, dilated,
    wider than its stride there: a CNN's 3 x 3, not a Vision Transformer's patches), or one whose
    kernel, strides or data format are not known."""
    if op.type not in CONVOLUTIONS:
        return False
    rank, kernel = op.inputs[0].shape.rank, op.inputs[1].shape
    axes = image_axes(op, rank) if rank else None
    if not isinstance(axes, tuple) or kernel.rank != rank or None in kernel.as_list()[:-2]:
        return True
    strides, dilations = op.get_attr("strides"), op.get_attr("dilations")
    spatial = [a for a in range(rank) if a not in axes]
    return any((k - 1) * dilations[a] + 1 > strides[a] for k, a in zip(kernel.as_list()[:-2], spatial))


def _spatial(op: tf.Operation, axis: int) -> Refusal:
    return Refusal(f"`{op.type}` ({op.name}) slides a window along axis {axis}, the split axis: each output "
                   "row reads overlapping input rows")


def _window_spans_channels(op: tf.Operation, channel: int) -> bool:
    return any(int(op.get_attr(name)[channel]) != 1 for name in ("ksize", "strides"))


def _convolved(op: tf.Operation, axis: int, by_batch: Callable[[int], Propagation | Refusal],
               by_channel: Callable[[], Propagation | Refusal]) -> Propagation | Refusal:
    """A convolution's (or its input gradient's) rule: ``by_batch(batch axis)``, ``by_channel()`` for the
    output channels (refused for depthwise ones), the spatial axes refused."""
    axes = image_axes(op, op.outputs[0].shape.rank)
    if isinstance(axes, Refusal):
        return axes
    batch, channel = axes
    if axis == batch:
        return by_batch(batch)
    if axis == channel:
        return _depthwise(op, axis) if op.type.startswith("Depthwise") else by_channel()
    return _spatial(op, axis)


# conv(x, W)[s:s+c] = conv(x[s:s+c], W);   conv(x, W)[.., s:s+c] = conv(x, W[.., s:s+c])  (channels last
# in the output and in the filter [.., in, out])
@rule(*sorted(CONVOLUTIONS))
def _convolution(op, output_index, axis):
    return _convolved(op, axis, lambda b: Propagation((b, None), (axis,)),
                      lambda: Propagation((None, op.inputs[1].shape.rank - 1), (axis,)))


def _depthwise(op: tf.Operation, axis: int) -> Refusal:
    return Refusal(f"`{op.type}` ({op.name}) interleaves input channels and their multipliers along axis {axis}, "
                   "the split axis")


def _pooled(op: tf.Operation, axis: int, along: Callable[[int], Propagation | Refusal]) -> Propagation | Refusal:
    """A pool's (or its gradient's) rule: ``along(axis)`` for the batch, and for the channels where the
    window is one channel wide; the spatial axes refused."""
    axes = image_axes(op, op.outputs[0].shape.rank)
    if isinstance(axes, Refusal):
        return axes
    batch, channel = axes
    if axis == batch or (axis == channel and not _window_spans_channels(op, channel)):
        return along(axis)
    return _spatial(op, axis)


# pool(x)[s:s+c] = pool(x[s:s+c])   along the batch, and along the channels when the window is one channel wide
@rule(*_POOLS)
def _pool(op, output_index, axis):
    return _pooled(op, axis, lambda a: Propagation((a,), (a,)))


# max_pool_grad(x, y, dy)[s:s+c] = max_pool_grad(x[s:s+c], y[s:s+c], dy[s:s+c])   (the channels alike)
@rule("MaxPoolGrad", "MaxPool3DGrad")
def _max_pool_grad(op, output_index, axis):
    return _pooled(op, axis, lambda a: Propagation((a, a, a), (a,)))


# The gradients with a shape operand (the input's, the filter's) are rebuilt with the chunk in it:
# conv_backprop_input(S, W, dy)[s:s+c] = conv_backprop_input(S with c at 0, W, dy[s:s+c]), and along the
# input channels the filter's input-channel axis [.., in, out] is sliced;
# conv_backprop_filter(x, S, dy)[.., s:s+c] = conv_backprop_filter(x, S with c last, dy[.., s:s+c]) (output
# channels; the batch is summed over: refused); avg_pool_grad(S, dy)[s:s+c] = avg_pool_grad(S with c, dy[s:s+c]).
def _with_sized(op: tf.Operation, sizes_index: int, axis: int, input_axes: tuple) -> Propagation | Refusal:
    # (the shape operand is the output's shape: where it is computed, a batch known only at run time
    # (Keras' Conv2DTranspose on tf.data batches), its sizes are read as _sizes reads them)
    sizes = _const(op.inputs[sizes_index])
    if sizes is None and op.outputs[0].shape.rank is None:
        return _not_constant(op, "the shape operand")
    dims = _dims(op.outputs[0]) if sizes is None else [int(d) for d in np.asarray(sizes).reshape(-1)]

    def rebuild(op, inputs, chunk):
        inputs = list(inputs)
        inputs[sizes_index] = _sizes(dims, axis, chunk, op.inputs[sizes_index].dtype,
                                     _operand(inputs, sizes_index), op.outputs[0])
        return clone_op(op, inputs)

    return Propagation(input_axes, (axis,), rebuild)


@rule("Conv2DBackpropInput", "Conv3DBackpropInputV2", "DepthwiseConv2dNativeBackpropInput")
def _conv_backprop_input(op, output_index, axis):
    return _convolved(op, axis, lambda b: _with_sized(op, 0, axis, (None, None, b)),
                      lambda: _with_sized(op, 0, axis, (None, op.inputs[1].shape.rank - 2, None)))


@rule("Conv2DBackpropFilter", "Conv3DBackpropFilterV2")
def _conv_backprop_filter(op, output_index, axis):
    axes = image_axes(op, op.inputs[0].shape.rank)
    if isinstance(axes, Refusal):
        return axes
    _, channel = axes
    rank = op.outputs[0].shape.rank
    if axis == rank - 1:
        return _with_sized(op, 1, axis, (None, None, channel))
    if axis == rank - 2:
        return _with_sized(op, 1, axis, (channel, None, None))
    return Refusal(f"`{op.type}` ({op.name}) sums over the batch and the window: its filter's axis {axis} "
                   "cannot be split")


@rule("AvgPoolGrad", "AvgPool3DGrad")
def _avg_pool_grad(op, output_index, axis):
    return _pooled(op, axis, lambda a: _with_sized(op, 0, a, (None, a)))


# xent(logits, labels)[i][s:s+c] = xent(logits[s:s+c], labels[s:s+c])[i]    the loss [B] and its
# backprop [B, C] alike, along the batch only: the classes are normalised over.
@rule("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits")
def _cross_entropy(op, output_index, axis):
    if op.outputs[output_index].shape.rank - 1 == axis and output_index == 1:
        return Refusal(f"`{op.type}` normalises over axis {axis}, the split axis")
    return Propagation((0, 0), (0, 0))


# in_top_k(p, t, k)[s:s+c] = in_top_k(p[s:s+c], t[s:s+c], k)    each row alone (Keras' top-k accuracy).
@rule("InTopKV2")
def _in_top_k(op, output_index, axis):
    return Propagation((0, 0, None), (0,))


# top_k(x, k)[i][.., s:s+c, :] = top_k(x[.., s:s+c, :], k)[i]    values and indices alike; not the
# last axis, which it selects along.  Each slice's top-k is blocked where that is faster.
@rule("TopKV2")
def _top_k(op, output_index, axis):
    if axis == op.outputs[0].shape.rank - 1:
        return Refusal(f"`TopKV2` selects along axis {axis}, the split axis")
    return Propagation((axis, None), (axis, axis), rebuild=_blocked_top_k)


def _blocked_solve(op, inputs, chunk):
    return blocked_linalg.rebuilt_solve(op, inputs)


def _blocked_top_k(op, inputs, chunk):
    return blocked_top_k.rebuilt(op, inputs)


# cumsum(x, d)[.., s:s+c, ..] = cumsum(x[.., s:s+c, ..], d)     for d other than the axis
@rule("Cumsum", "Cumprod", "CumulativeLogsumexp")
def _cumulative(op, output_index, axis):
    along = _const_axes(op.inputs[1], op.inputs[0].shape.rank)
    if along is None:
        return _not_constant(op, "the cumulative axis")
    if axis in along:
        return Refusal(f"`{op.type}` accumulates along axis {axis}, the split axis")
    return Propagation((axis, None), (axis,))


# --- layout -----------------------------------------------------------------------------------------


# bitcast(x, T)[.., s:s+c, ..] = bitcast(x[.., s:s+c, ..], T)   the axes both sides share: a type
# of another size adds or drops the last axis only (Keras 3 emits it for its dtype policies)
@rule("Bitcast")
def _bitcast(op, output_index, axis):
    if axis >= min(op.inputs[0].shape.rank, op.outputs[0].shape.rank):
        return Refusal(f"`Bitcast` makes axis {axis} from the element bytes")
    return Propagation((axis,), (axis,))


# transpose(x, p)[.., s:s+c (axis a), ..] = transpose(x[.., s:s+c (axis p[a]), ..], p)
@rule("Transpose", "ConjugateTranspose")
def _transpose(op, output_index, axis):
    perm = _const_axes(op.inputs[1], op.inputs[0].shape.rank)
    if perm is None:
        return _not_constant(op, "the permutation")
    return Propagation((perm[axis], None), (axis,))


# reshape(x, O)[.., s:s+c (axis a), ..] = reshape(x[.., s:s+c (axis b), ..], O with c at a)
# when prod(O[:a]) = prod(I[:b]) and O[a] = I[b]: both are views of one [P, n, Q] array, sliced
# alike in the middle.  By factors, as XLA's SPMD partitioner reshards through a reshape and
# Shardy's factor rules: a reshape keeps every element's flat index, so the split axis (n rows of
# flat stride g) lies inside input axis b when g is a multiple of b's stride and b's length a
# multiple of n times their ratio: axis b is then [outer, n, inner] merged (a Factor), and the
# rows of a slice are the same flat indices, in the same order, on both sides.  Keras' Dense on
# [B, L, D] reshapes to [B * L, D]: split along the batch, Factor(1, L) there (a contiguous run);
# along the sequence, Factor(B, 1) (B runs).  An axis spread over two input axes ([6, 2] from
# [3, 4]'s 3 and half of 4) is refused, as is a unit axis.  Sizes known only at run time (a padded
# batch's B and L) are read as exact sizes (shapes.exact_dims): the same arithmetic, on products of them.
@rule("Reshape")
def _reshape(op, output_index, axis, factor: Factor = UNIT):
    in_dims, out_dims = _dims(op.inputs[0]), _dims(op.outputs[0])
    # (planned with run-time sizes, the sizes they are products of as exact ints: shapes.exact_dims)
    ins, outs = shapes.exact_dims(op.inputs[0]), shapes.exact_dims(op.outputs[0])

    def rebuild(op, inputs, chunk):
        # The static output shape with c on the axis: any -1 of the shape constant is resolved.
        return [tf.reshape(inputs[0], _sizes(out_dims, axis, chunk, op.inputs[1].dtype, _operand(inputs, 1),
                                             op.outputs[0]))]

    before = math.prod(outs[:axis])
    for b, n in enumerate(ins):
        # A size known only at run time is kept only with the same static sizes after it.
        if math.prod(ins[:b]) == before and n == outs[axis] and (
                n is not None or math.prod(ins[b + 1:]) == math.prod(outs[axis + 1:])):
            return Propagation((b, None), (axis,), rebuild)
    found = factor_axis(ins, outs, axis, factor)
    if found is None:
        where = "" if factor.unit else f" (the split axis at {factor} in it)"
        return Refusal(f"`Reshape` {in_dims} -> {out_dims} does not keep axis {axis} (size {out_dims[axis]}){where} "
                       "within one input axis: it splits it inside")
    b, inner = found
    return Propagation((b, None), (axis,), rebuild, input_factors=(inner, None))


def factor_axis(in_dims, out_dims, axis, factor: Factor) -> tuple[int, Factor] | None:
    """``(b, f)``: the split axis, at ``factor`` in axis ``axis`` of an array shaped ``out_dims``, lies
    in axis ``b`` of the same elements shaped ``in_dims`` (a reshape's input, or its output: the
    relation is symmetric), at ``f``; ``None`` if it lies in no one axis there (or shapes are not
    static, or it has one row)."""
    dims = list(in_dims) + list(out_dims)
    if any(d is None or d == 0 for d in dims) or out_dims[axis] % (factor.outer * factor.inner):
        return None
    n = out_dims[axis] // (factor.outer * factor.inner)
    if n <= 1:
        return None
    stride = factor.inner * math.prod(out_dims[axis + 1:])     # flat distance between rows of the split axis
    for b, d in enumerate(in_dims):
        below = math.prod(in_dims[b + 1:])
        if stride % below == 0 and d % (stride // below * n) == 0:
            return b, Factor(d // (stride // below * n), stride // below)
    return None


# space_to_batch(x, b, P): the output's batch is [prod(b), B] merged, B minor (output row p * B + i
# is block p of input row i), so a slice of x's rows gives those rows of every block, block-major:
# the split batch lies in the output's batch at Factor(prod(b) * outer, inner) where it lies in x's
# at Factor(outer, inner).  batch_to_space is the inverse.  (Keras' dilated Conv1D and Conv2D:
# SpaceToBatchND, the convolution, BatchToSpaceND; a WaveNet's or DeepLab's atrous blocks.)  The
# axes moved into blocks are refused; the channels pass as they are.
@rule("SpaceToBatchND", "BatchToSpaceND")
def _space_and_batch(op, output_index, axis, factor: Factor = UNIT):
    block = _const(op.inputs[1])
    if block is None:
        return _not_constant(op, "the block shape")
    if 1 <= axis <= block.size:
        return Refusal(f"`{op.type}` ({op.name}) moves blocks of axis {axis} into the batch: it is not split")
    if axis > block.size:
        return Propagation((axis, None, None), (axis,))
    inner = batch_blocks_factor(op, factor, to_input=True)
    if inner is None:
        return Refusal(f"`{op.type}` ({op.name}): the split axis lies at {factor} of its batch, not within the "
                       "batch its blocks are moved along")
    return Propagation((0, None, None), (0,), input_factors=(inner, None, None))


def batch_blocks_factor(op: tf.Operation, factor: Factor, to_input: bool = False) -> Factor | None:
    """Where the split axis lies in the batch of a ``SpaceToBatchND``'s or ``BatchToSpaceND``'s output,
    given where it lies in its input's (``factor``); ``to_input``: the other way.  ``None`` where it
    lies in no whole rows of the smaller batch."""
    block = _const(op.inputs[1])
    if block is None:
        return None
    blocks = int(np.prod(block))
    grows = (op.type == "SpaceToBatchND") != to_input        # the result's batch has the blocks in it
    if grows:
        return Factor(factor.outer * blocks, factor.inner)
    if not isinstance(factor.outer, int) or factor.outer % blocks:
        return None
    return Factor(factor.outer // blocks, factor.inner)


# Rules that take the factor the split axis lies at in the output
_FACTORED = {"Reshape", "SpaceToBatchND", "BatchToSpaceND"}


# expand_dims(x, d)[.., s:s+c, ..] = expand_dims(x[.., s:s+c, ..], d)   the axis shifted past d;
# the inserted unit axis itself is refused
@rule("ExpandDims")
def _expand_dims(op, output_index, axis):
    inserted = _const_axes(op.inputs[1], op.outputs[0].shape.rank)
    if inserted is None:
        return _not_constant(op, "the inserted axis")
    if axis == inserted[0]:
        return Refusal(f"axis {axis} is the unit axis `ExpandDims` inserts")
    return Propagation((axis if axis < inserted[0] else axis - 1, None), (axis,))


# squeeze(x, D)[.., s:s+c, ..] = squeeze(x[.., s:s+c, ..], D)   output axis a is the a-th input
# axis not squeezed.  Rebuilt with D explicit: with no dims given, a chunk c = 1 would be squeezed too.
@rule("Squeeze")
def _squeeze(op, output_index, axis):
    dims = _dims(op.inputs[0])
    squeezed = sorted({d % len(dims) for d in op.get_attr("squeeze_dims")}) or \
        [i for i, n in enumerate(dims) if n == 1]
    in_axis = [i for i in range(len(dims)) if i not in squeezed][axis]
    return Propagation((in_axis,), (axis,), lambda op, inputs, chunk: _clone(op, inputs, squeeze_dims=squeezed))


@dataclasses.dataclass(frozen=True)
class _SliceDim:
    """An output axis of a strided slice: the input axis it reads (``None``: a new unit axis) and
    the index of its entry in the sparse spec (``None``: covered by an ellipsis, taken whole)."""

    input_axis: int | None
    entry: int | None


def _strided_slice_dims(op: tf.Operation, n_entries: int) -> list[_SliceDim] | Refusal:
    """The output axes of a ``StridedSlice``, from its sparse spec (as TF's dense-spec expansion)."""
    rank = op.inputs[0].shape.rank
    ellipsis, new_axis, shrink = (op.get_attr(m) for m in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask"))
    entries: list[int | None] = list(range(n_entries))
    if not ellipsis & ((1 << n_entries) - 1):
        entries.append(None)  # an implicit ellipsis at the end takes the remaining axes whole
    elif bin(ellipsis & ((1 << n_entries) - 1)).count("1") > 1:
        return Refusal(f"`StridedSlice` ({op.name}) has several ellipses")
    out: list[_SliceDim] = []
    d = 0  # the next input axis
    for position, i in enumerate(entries):
        if i is None or ellipsis >> i & 1:
            # The ellipsis covers the input axes not claimed by the real (non-new) entries after it.
            after = [j for j in entries[position + 1:] if j is not None and not new_axis >> j & 1]
            while d < rank - len(after):
                out.append(_SliceDim(d, None))
                d += 1
        elif new_axis >> i & 1:
            out.append(_SliceDim(None, i))
        elif shrink >> i & 1:
            d += 1
        else:
            out.append(_SliceDim(d, i))
            d += 1
    if d > rank or len(out) != op.outputs[0].shape.rank:
        return Refusal(f"`StridedSlice` ({op.name}): could not read its slice spec")
    return out


# x[spec][.., s:s+c (axis a), ..] = x[.., s:s+c (axis b), ..][spec']    when the spec takes input
# axis b whole with stride 1 (begin 0, end n, masked or explicit); spec' masks b's begin and end so
# it takes the chunk whole.  A new unit axis, a partial range or a stride on the axis: refused.
@rule("StridedSlice")
def _strided_slice(op, output_index, axis):
    begin, end, strides = (_const(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None:
        return _not_constant(op, "the slice spec (begin, end, strides)")
    dims = _strided_slice_dims(op, len(begin))
    if isinstance(dims, Refusal):
        return dims
    dim = dims[axis]
    if dim.input_axis is None:
        return Refusal(f"axis {axis} is a unit axis that `StridedSlice` inserts")
    no_inputs = (None,) * 3
    if dim.entry is None:
        return Propagation((dim.input_axis,) + no_inputs, (axis,))
    i, n = dim.entry, _dims(op.inputs[0])[dim.input_axis]

    def bound(v: int) -> int:
        return min(max(v + n if v < 0 else v, 0), n)

    lo = 0 if op.get_attr("begin_mask") >> i & 1 else bound(int(begin[i]))
    hi = n if op.get_attr("end_mask") >> i & 1 else bound(int(end[i]))
    if int(strides[i]) != 1 or lo != 0 or hi != n:
        return Refusal(f"`StridedSlice` takes [{lo}:{hi}:{int(strides[i])}] of axis {dim.input_axis} "
                       f"(size {n}), not the whole split axis with stride 1")

    def rebuild(op, inputs, chunk):
        return _clone(op, inputs, begin_mask=op.get_attr("begin_mask") | 1 << i,
                      end_mask=op.get_attr("end_mask") | 1 << i)

    return Propagation((dim.input_axis,) + no_inputs, (axis,), rebuild)


# slice(x, b, z)[.., s:s+c, ..] = slice(x[.., s:s+c, ..], b, z with c at the axis)   when b = 0
# and z = n (or -1) there: the axis taken whole
@rule("Slice")
def _slice(op, output_index, axis):
    begin, size = _const(op.inputs[1]), _const(op.inputs[2])
    if begin is None or size is None:
        return _not_constant(op, "the slice begin or size")
    n = _dims(op.inputs[0])[axis]
    if int(begin[axis]) != 0 or int(size[axis]) not in (-1, n):
        return Refusal(f"`Slice` takes [{int(begin[axis])}, +{int(size[axis])}] of axis {axis} (size {n}), "
                       "not the whole split axis")

    def rebuild(op, inputs, chunk):
        return [tf.slice(inputs[0], inputs[1], _sizes(size, axis, chunk, op.inputs[2].dtype))]

    return Propagation((axis, None, None), (axis,), rebuild)


# concat([x, y], d)[.., s:s+c, ..] = concat([x[.., s:s+c, ..], y[.., s:s+c, ..]], d)   for d other
# than the axis
@rule("ConcatV2")
def _concat(op, output_index, axis):
    along = _const_axes(op.inputs[-1], op.outputs[0].shape.rank)
    if along is None:
        return _not_constant(op, "the concatenation axis")
    if along[0] == axis:
        return Refusal(f"`ConcatV2` concatenates along axis {axis}, the split axis")
    return Propagation((axis,) * (len(op.inputs) - 1) + (None,), (axis,))


# pad(x, P)[.., s:s+c, ..] = pad(x[.., s:s+c, ..], P)   when P pads nothing on the axis
@rule("Pad", "PadV2", "MirrorPad")
def _pad(op, output_index, axis):
    paddings = _const(op.inputs[1])
    if paddings is None:
        return _not_constant(op, "the padding")
    before, after = (int(v) for v in paddings[axis])
    if before or after:
        return Refusal(f"`{op.type}` pads axis {axis}, the split axis, by ({before}, {after})")
    return Propagation((axis,) + (None,) * (len(op.inputs) - 1), (axis,))


# tile(x, m)[.., s:s+c, ..] = tile(x[.., s:s+c, ..], m)   when m = 1 on the axis
# tile(x, m)[.., s:s+c, ..] = tile(x, m with c on the axis)   when x has 1 there (a broadcast: the
#                                                             gradient of a mean, ones tiled)
@rule("Tile")
def _tile(op, output_index, axis):
    multiples = _const(op.inputs[1])
    if multiples is None:
        return _not_constant(op, "the multiples")
    if int(multiples[axis]) != 1 and _dims(op.inputs[0])[axis] == 1:
        times = [int(m) for m in multiples]

        def rebuild(op, inputs, chunk):
            return [tf.tile(inputs[0], _sizes(times, axis, chunk, op.inputs[1].dtype))]

        return Propagation((None, None), (axis,), rebuild)
    if int(multiples[axis]) != 1:
        return Refusal(f"`Tile` repeats axis {axis}, the split axis, {int(multiples[axis])} times")
    return Propagation((axis, None), (axis,))


# broadcast_to(x, O)[.., s:s+c, ..] = broadcast_to(x[.., s:s+c, ..] or x, O with c at the axis)
# x is sliced where aligned with the axis, used whole where broadcast along it
@rule("BroadcastTo")
def _broadcast_to(op, output_index, axis):
    in_axis = _aligned_axis(op, 0, _dims(op.outputs[0]), axis)
    if isinstance(in_axis, Refusal):
        return in_axis
    out_dims = _dims(op.outputs[0])

    def rebuild(op, inputs, chunk):
        return [tf.broadcast_to(inputs[0], _sizes(out_dims, axis, chunk, op.inputs[1].dtype, _operand(inputs, 1),
                                                  op.outputs[0]))]

    return Propagation((in_axis, None), (axis,), rebuild)


# fill(O, v)[.., s:s+c, ..] = fill(O with c at the axis, v)
@rule("Fill")
def _fill(op, output_index, axis):
    out_dims = _dims(op.outputs[0])

    def rebuild(op, inputs, chunk):
        return [tf.fill(_sizes(out_dims, axis, chunk, op.inputs[0].dtype, _operand(inputs, 0), op.outputs[0]),
                        inputs[1])]

    return Propagation((None, None), (axis,), rebuild)


# gather(p, i, g, batch_dims=k) has shape p[:g] + i[k:] + p[g+1:]; its output axis a is
#   a < k:            a batch axis of both:  out[s:s+c] = gather(p[s:s+c], i[s:s+c])
#   k <= a < g:       p's axis a:            out[.., s:s+c, ..] = gather(p[.., s:s+c, ..], i)
#   in the i block:   i's axis a - g + k:    out[.., s:s+c, ..] = gather(p, i[.., s:s+c, ..])
#   after it:         p's axis a - |i| + k + 1
@rule("GatherV2")
def _gather(op, output_index, axis):
    params_rank, indices_rank = op.inputs[0].shape.rank, op.inputs[1].shape.rank
    along = _const_axes(op.inputs[2], params_rank)
    if along is None:
        return _not_constant(op, "the gather axis")
    g = along[0]
    k = op.get_attr("batch_dims")
    k = k + indices_rank if k < 0 else k
    block = indices_rank - k
    if axis < k:
        axes = (axis, axis, None)
    elif axis < g:
        axes = (axis, None, None)
    elif axis < g + block:
        axes = (None, axis - g + k, None)
    else:
        axes = (axis - block + 1, None, None)
    return Propagation(axes, (axis,))


# stack(xs, p)[.., s:s+c, ..] = stack([x[.., s:s+c, ..] for x in xs], p)   the axis shifted past p;
# the stacking axis itself picks inputs by s: refused
@rule("Pack")
def _pack(op, output_index, axis):
    rank = op.outputs[0].shape.rank
    p = op.get_attr("axis") % rank
    if axis == p:
        return Refusal(f"`Pack` stacks along axis {axis}, the split axis")
    return Propagation((axis if axis < p else axis - 1,) * len(op.inputs), (axis,))


# unstack(x, p)[k][.., s:s+c, ..] = unstack(x[.., s:s+c, ..], p)[k]   for every k alike
@rule("Unpack")
def _unpack(op, output_index, axis):
    p = op.get_attr("axis") % op.inputs[0].shape.rank
    return Propagation((axis if axis < p else axis + 1,), (axis,) * len(op.outputs))


# split(x, d)[k][.., s:s+c, ..] = split(x[.., s:s+c, ..], d)[k]   for d other than the axis
@rule("Split", "SplitV")
def _split(op, output_index, axis):
    value, along = (1, 0) if op.type == "Split" else (0, 2)
    d = _const_axes(op.inputs[along], op.inputs[value].shape.rank)
    if d is None:
        return _not_constant(op, "the split axis of the op")
    if d[0] == axis:
        return Refusal(f"`{op.type}` splits along axis {axis}, the split axis")
    axes = [None] * len(op.inputs)
    axes[value] = axis
    return Propagation(tuple(axes), (axis,) * len(op.outputs))


# one_hot(i, depth, axis=h)[.., s:s+c, ..] = one_hot(i[.., s:s+c, ..], depth, axis=h)   the axis
# shifted past h; the depth axis h itself would need s: refused
@rule("OneHot")
def _one_hot(op, output_index, axis):
    h = op.get_attr("axis") % op.outputs[0].shape.rank
    if axis == h:
        return Refusal(f"axis {axis} is the depth axis of `OneHot`")
    return Propagation((axis if axis < h else axis - 1, None, None, None), (axis,))


# reverse(x, R)[.., s:s+c, ..] = reverse(x[.., s:s+c, ..], R)   for the axis not in R
@rule("ReverseV2")
def _reverse(op, output_index, axis):
    reversed_axes = _const_axes(op.inputs[1], op.inputs[0].shape.rank)
    if reversed_axes is None:
        return _not_constant(op, "the list of reversed axes")
    if axis in reversed_axes:
        return Refusal(f"`ReverseV2` reverses axis {axis}, the split axis")
    return Propagation((axis, None), (axis,))
