"""Analysis: an attention inside a region, computed over slices of its keys within each of the region's slices.

    region over query rows  ∋  softmax(Q K^T) V,  K = x Wk, V = x Wv (a prologue, read whole)
      =>  each slice's attention over key blocks, K and V of a block projected from x's rows in it

A loop over an encoder layer's query rows reads the attention's keys and values whole: its
prologue projects them from the layer's input before the loop, and every slice holds them (two
[B, L, N, H] at once, beside the input and the output).  Where that is more than the limit leaves
(tf_keras' encoder layer at batch 4, L = 1024, under a sixteenth of its footprint), the attention
is computed in each slice by a loop of its own over blocks of the keys (an ``online_softmax``
region: :class:`~.combiners.OnlineSoftmax`), which projects each block's keys and values from the
input's rows in it: FlashAttention with its projections fused.  The slice then holds one block's
keys and values, never all of them, at the cost of projecting them again for every slice.

:func:`attention_within` finds such an attention in a grown region and its region along the keys
(:func:`.analysis.grow` from its ``online_softmax`` option), or says why there is none.  The key
region must take some of the outer loop's prologue in (else nothing whole is saved), read along the
keys nothing the outer loop computes by slice (an input of the program, a variable, a tensor
computed before the loop), and have static sizes; its ops outside the loop and its prologue (a
padding mask along the keys) are read by its own alone, and its loop computes them by key block.
:mod:`.nested_loop` builds it.
"""

from __future__ import annotations

import dataclasses

from grappler_ext.op_types import nbytes
from grappler_ext.splitter import analysis
from grappler_ext.splitter.analysis import Grown
from grappler_ext.splitter.loop import external_inputs
from grappler_ext.splitter.outcome import Code, Why

__all__ = ["Nest", "attention_within"]


@dataclasses.dataclass(frozen=True)
class Nest:
    """An attention computed over blocks of its keys inside each slice of an outer loop.

    Attributes:
      option: the attention's ``online_softmax`` root option (its root: ``softmax(S) @ V``).
      inner: its region along the keys (:func:`.analysis.grow`), every op it takes in.
      moved: the outer prologue's ops the inner loop computes by key block instead.
      saved: the bytes of the prologue's outputs no longer held whole (the keys and values).
    """

    option: analysis.RootOption
    inner: Grown
    moved: frozenset
    saved: int

    @property
    def keys(self) -> int:
        return self.inner.region.length

    @property
    def computed(self) -> set:
        """The tensors the key region computes (refs): read by its own ops alone, so its loop
        computes them by key block and the outer loop reads none of them."""
        return {o.ref() for op in self.inner.included for o in op.outputs}


def _inner_grown(option, graph_outputs, order_index, ignored) -> Grown | Why:
    grown = analysis.grow([option], graph_outputs, order_index, ignored)
    if isinstance(grown, Why):
        return grown
    region = grown.region
    if region.dynamic or region.factors or region.scaled is not None:
        return Why(Code.NO_PLAN, "its keys have a run-time length or lie in a reshape's factor")
    return grown


def attention_within(grown: Grown, graph_outputs: set, order_index: dict,
                     ignored: frozenset = frozenset()) -> Nest | Why:
    """The attention in ``grown``'s region best computed over key blocks in each slice (the one whose
    key blocks free the most of the prologue), or why none can be."""
    outer = grown.region
    if outer.dynamic or outer.written_into or outer.scaled is not None:
        return Why(Code.NO_PLAN, "the loop has a run-time length or an in-place write")
    if not outer.prologue:
        return Why(Code.NO_PROLOGUE, "the loop computes nothing whole before it: no keys to project by block")
    prologue = set(outer.prologue)
    produced = {o.ref() for op in outer.ops for o in op.outputs}
    best: Nest | Why = Why(Code.NO_PLAN, "no attention in the loop reads its keys from the loop's prologue")
    for op in outer.ops:
        prop = getattr(outer.rebuild[op], "__self__", None)
        if prop is None or prop.output_axes[0] is None:
            continue                 # (its slice's rows: the axis the inner loop's partials hold them along)
        for option in analysis.root_options(op, ignored, through=True):
            if option.kind != "online_softmax":
                continue
            inner = _inner_grown(option, graph_outputs, order_index, ignored)
            if isinstance(inner, Why):
                best = best if isinstance(best, Nest) else inner
                continue
            why = _fits(option.root, inner, produced, outer.factors)
            if why is not None:
                best = best if isinstance(best, Nest) else why
                continue
            moved = frozenset(inner.included & prologue)
            if not moved:
                continue
            kept = [o for p in outer.prologue if p not in moved for o in p.inputs]
            if any(t.op in moved for t in kept):
                continue             # the rest of the prologue reads what would move
            saved = sum(nbytes(o) for p in moved for o in p.outputs if o.ref() in outer.whole_inputs)
            nest = Nest(option, inner, moved, saved)
            if all(ref in nest.computed for ref in outer.sliced_inputs):
                continue             # the loop would slice nothing but what the key region computes
            if saved and (isinstance(best, Why) or saved > best.saved):
                best = nest
    return best


def _fits(root, inner: Grown, produced: set, factors: dict) -> Why | None:
    """Why ``inner`` (the key region of the attention ending at ``root``) cannot run inside each slice
    of the outer loop (whose slices' tensors are ``produced``, some of them at a reshape's ``factors``),
    or ``None``.  Its ops in neither the outer loop nor its prologue (a padding mask along the keys,
    computed before the loop) are read by none but its own (:func:`.analysis.grow`): its loop computes
    them by key block too."""
    if root in factors or any(t.op in factors for t in external_inputs(inner.region) if t.ref() in produced):
        return Why(Code.REGION_CONFLICT, "the attention's query rows lie in a reshape's factor")
    for ref in inner.region.sliced_inputs:
        if ref in produced:
            # Cut along the keys, it would need every query row of a tensor the slice holds rows of.
            return Why(Code.REGION_CONFLICT, f"`{ref.deref().name}` is computed by slice and read along the keys")
    return None
