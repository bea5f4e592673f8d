"""chain_order: the cheapest parenthesisation of a matrix chain, as a pure function of shapes.

    A0 A1 ... A(n-1),  Ai: [B.., d[i], d[i+1]]  =>  the order with the fewest FLOPs

No TensorFlow here: :mod:`grappler_ext.matrix_chain` reads the shapes off the graph, asks
:func:`choose_order` and builds what it answers.  This module is the policy; that one the mechanism
(style guide, section 7).

Orders.  A :data:`Tree` is a leaf index ``i`` (the matrix ``Ai``) or a pair ``(left, right)`` of
trees over adjacent runs of leaves, e.g. ``((0, 1), 2)`` is ``(A0 A1) A2``.  :func:`format_tree`
prints it as ``((0 1) 2)``.

Costs, for the ``B`` batch elements shared by every factor (``batch`` is their product, 1 for plain
matrices) and ``itemsize`` bytes per element:

* FLOPs: a product ``[B.., m, k] x [B.., k, n]`` costs ``2 B m k n`` (one multiply and one add per
  term).  Textbooks count scalar multiplications, ``m k n``: half of this; the factor 2 changes no
  comparison.  ``d = [10, 100, 5, 50]``: ``(A0 A1) A2`` costs 2 (5000 + 2500) = 15,000 FLOPs,
  ``A0 (A1 A2)`` 2 (25,000 + 50,000) = 150,000.
* intermediate bytes: every product but the last one is an intermediate, ``B m n itemsize`` bytes.
  The last product is ``[B.., d[0], d[n]]`` in every order, and the leaves are inputs, so neither
  counts.  ``peak_intermediate_bytes`` is the largest intermediate, ``total_intermediate_bytes``
  their sum.

Which memory figure, and why the peak.  XLA frees an intermediate as soon as its one consumer has
run, so the intermediates of a chain are seldom alive together and their sum overstates what the
order costs; the largest one must exist whole, so it is a lower bound of the order's live bytes and
the term that decides whether the program fits (the ``[N, N]`` in ``(K K) v``).  The peak is the
memory figure of every rule below; the sum is reported, never optimised.

The dynamic programme (the classic interval recurrence, O(n^3)) minimises the key
``(flops, peak_intermediate_bytes)`` lexicographically: fewest FLOPs, then, among orders with equal
FLOPs, the smallest largest intermediate; then the first split from the left.  The recurrence is
exact for this key: for a split ``k`` of the run ``i..j``, FLOPs add and the peak is
``max(peak(i..k), peak(k+1..j), bytes of the two sub-products)``, so the best order of the run with
that split combines the best orders of its halves.  (A third key, the sum, would break this: with a
max, a half may trade a higher peak for a smaller sum.)

An optional cap, ``max_intermediate_bytes``, forbids every run whose product is larger than the cap
from being an intermediate; the recurrence stays exact because a run's product has the same size in
every order.

The reorder rule (:func:`choose_order`), given the order the program wrote:

1. ``best`` is the order with the fewest FLOPs among those whose largest intermediate is no larger
   than the written order's (the capped programme; the written order is one of them, so it exists);
2. reorder if and only if ``best`` needs at most ``1 / FLOP_MARGIN`` of the written order's FLOPs
   (:data:`FLOP_MARGIN` = 1.5: a third fewer at least).

So a proposed reorder never raises the largest intermediate, and an order with equal FLOPs is never
proposed, even with smaller intermediates: rounding would change for no proven compute gain.  The
margin is that proof: the pass runs whether or not the program fits its limit (issue 29: a program
within its limit is left as traced unless a rewrite saves time), and a few percent fewer FLOPs can
be lost to kernels that are less efficient on the new shapes.  When
the unconstrained optimum is cheaper but would need a larger intermediate, the decision says so.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

__all__ = ["Tree", "FLOP_MARGIN", "Plan", "Decision", "left_to_right", "right_to_left", "leaves", "format_tree",
           "cost_of", "optimal_order", "choose_order"]

Tree = int | tuple["Tree", "Tree"]  # a leaf index, or (left, right)

FLOP_MARGIN = 1.5   # a reorder must divide the written order's FLOPs by at least this much


@dataclasses.dataclass(frozen=True)
class Plan:
    """One order of one chain and what it costs.

    Attributes:
      tree: the parenthesisation (see the module docstring).
      dims: ``d``: matrix ``i`` is ``[d[i], d[i+1]]``.
      batch: the product of the batch dimensions every factor shares.
      itemsize: bytes per element.
      flops: ``2 B m k n`` summed over the products.
      peak_intermediate_bytes: the largest intermediate product (0 with fewer than 3 factors).
      total_intermediate_bytes: the sum of the intermediate products.
    """

    tree: Tree
    dims: tuple[int, ...]
    batch: int
    itemsize: int
    flops: int
    peak_intermediate_bytes: int
    total_intermediate_bytes: int

    @property
    def num_factors(self) -> int:
        return len(self.dims) - 1

    def __str__(self) -> str:
        return (f"{format_tree(self.tree)}: {self.flops:,} FLOPs, largest intermediate "
                f"{self.peak_intermediate_bytes:,} B")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`choose_order` concluded about a written order.

    Attributes:
      current: the order the program wrote, costed.
      best: the fewest-FLOP order whose largest intermediate is no larger than ``current``'s.
      unconstrained: the fewest-FLOP order with no cap on intermediates.
      reorder: ``best.flops < current.flops``.
      reason: one line for a person.
    """

    current: Plan
    best: Plan
    unconstrained: Plan
    reorder: bool
    reason: str


# --- trees ------------------------------------------------------------------------------------


def left_to_right(n: int) -> Tree:
    """``(((0 1) 2) ... n-1)``: what ``a @ b @ c`` means in Python."""
    n = _count(n)
    tree: Tree = 0
    for i in range(1, n):
        tree = (tree, i)
    return tree


def right_to_left(n: int) -> Tree:
    """``(0 (1 (... (n-2 n-1))))``."""
    n = _count(n)
    tree: Tree = n - 1
    for i in range(n - 2, -1, -1):
        tree = (i, tree)
    return tree


def leaves(tree: Tree) -> list[int]:
    """The leaf indices of ``tree`` from left to right."""
    if _is_leaf(tree):
        return [tree]
    left, right = _split(tree)
    return leaves(left) + leaves(right)


def format_tree(tree: Tree, names: Sequence[str] | None = None) -> str:
    """``((0 1) 2)``, or with ``names``, ``((A B) C)``."""
    if _is_leaf(tree):
        return str(tree) if names is None else names[tree]
    left, right = _split(tree)
    return f"({format_tree(left, names)} {format_tree(right, names)})"


# --- costs ------------------------------------------------------------------------------------


def cost_of(tree: Tree, dims: Sequence[int], batch: int | Sequence[int] = 1, itemsize: int = 4) -> Plan:
    """``tree`` over the chain ``dims``, costed.  Raises ValueError if ``tree`` is not an order of
    the ``len(dims) - 1`` factors (its leaves must be ``0, 1, ..., n-1`` in this order)."""
    d, b, item = _check_dims(dims), _check_batch(batch), _check_itemsize(itemsize)
    n = len(d) - 1
    if leaves(tree) != list(range(n)):
        raise ValueError(f"tree {format_tree(tree)} is not an order of {n} factors 0..{n - 1}")
    sizes: list[int] = []

    def walk(t: Tree, is_root: bool) -> tuple[int, int, int]:
        """``(first, last, flops)``: ``t`` multiplies factors ``first..last``."""
        if _is_leaf(t):
            return t, t, 0
        left, right = _split(t)
        i, k, flops_left = walk(left, False)
        _, j, flops_right = walk(right, False)
        # [B, d_i, d_k+1] x [B, d_k+1, d_j+1] => [B, d_i, d_j+1]
        flops = flops_left + flops_right + 2 * b * d[i] * d[k + 1] * d[j + 1]
        if not is_root:
            sizes.append(b * d[i] * d[j + 1] * item)
        return i, j, flops

    _, _, flops = walk(tree, True)
    return Plan(tree, d, b, item, flops, max(sizes, default=0), sum(sizes))


def optimal_order(dims: Sequence[int], batch: int | Sequence[int] = 1, itemsize: int = 4,
                  max_intermediate_bytes: int | None = None) -> Plan:
    """The order with the fewest FLOPs, ties broken by the smallest largest intermediate, then by
    the first split from the left.

    With ``max_intermediate_bytes``, only orders whose every intermediate fits the cap are
    considered; ValueError if there is none.
    """
    d, b, item = _check_dims(dims), _check_batch(batch), _check_itemsize(itemsize)
    n = len(d) - 1

    def product_bytes(i: int, j: int) -> int:
        return b * d[i] * d[j + 1] * item  # [B, d_i, d_j+1]

    def intermediate_bytes(i: int, j: int) -> int:
        return 0 if i == j else product_bytes(i, j)  # a leaf is an input, not an intermediate

    # best[i, j] = (flops, peak, split k) of the best order of factors i..j, or None if none fits.
    best: dict[tuple[int, int], tuple[int, int, int | None] | None] = {(i, i): (0, 0, None) for i in range(n)}
    for length in range(2, n + 1):
        for i in range(n - length + 1):
            j = i + length - 1
            is_root = length == n
            # A run larger than the cap cannot be an intermediate; the root is the result, exempt.
            if not is_root and max_intermediate_bytes is not None and product_bytes(i, j) > max_intermediate_bytes:
                best[i, j] = None
                continue
            choice = None
            for k in range(i, j):
                left, right = best[i, k], best[k + 1, j]
                if left is None or right is None:
                    continue
                # (A_i..A_k)(A_k+1..A_j): [B, d_i, d_k+1] x [B, d_k+1, d_j+1]
                flops = left[0] + right[0] + 2 * b * d[i] * d[k + 1] * d[j + 1]
                peak = max(left[1], right[1], intermediate_bytes(i, k), intermediate_bytes(k + 1, j))
                if choice is None or (flops, peak) < choice[:2]:  # strict: the first k wins ties
                    choice = (flops, peak, k)
            best[i, j] = choice
    if best[0, n - 1] is None:
        raise ValueError(f"no order of the chain {list(d)} keeps every intermediate within "
                         f"{max_intermediate_bytes:,} bytes")

    def tree(i: int, j: int) -> Tree:
        if i == j:
            return i
        k = best[i, j][2]
        return tree(i, k), tree(k + 1, j)

    plan = cost_of(tree(0, n - 1), d, b, item)
    assert (plan.flops, plan.peak_intermediate_bytes) == best[0, n - 1][:2], "recurrence and costing disagree"
    return plan


def choose_order(dims: Sequence[int], current: Tree, batch: int | Sequence[int] = 1,
                 itemsize: int = 4) -> Decision:
    """Whether to replace the written order ``current`` (the rule in the module docstring)."""
    now = cost_of(current, dims, batch, itemsize)
    unconstrained = optimal_order(dims, batch, itemsize)
    # The written order keeps within its own peak, so the capped programme always has an answer.
    best = optimal_order(dims, batch, itemsize, max_intermediate_bytes=now.peak_intermediate_bytes)
    # Rule: reorder iff FLOP_MARGIN times fewer FLOPs without a larger largest intermediate.
    if best.flops * FLOP_MARGIN <= now.flops:
        reason = (f"{format_tree(now.tree)} -> {format_tree(best.tree)}: {now.flops:,} -> {best.flops:,} FLOPs, "
                  f"largest intermediate {now.peak_intermediate_bytes:,} -> {best.peak_intermediate_bytes:,} B")
        return Decision(now, best, unconstrained, True, reason)
    if best.flops < now.flops:
        reason = (f"{format_tree(best.tree)} needs {best.flops:,} FLOPs against {now.flops:,}: less than "
                  f"{FLOP_MARGIN:g} x fewer, left as written")
        return Decision(now, best, unconstrained, False, reason)
    if unconstrained.flops < now.flops:
        reason = (f"{format_tree(unconstrained.tree)} needs fewer FLOPs ({unconstrained.flops:,} < {now.flops:,}) "
                  f"but a larger intermediate ({unconstrained.peak_intermediate_bytes:,} > "
                  f"{now.peak_intermediate_bytes:,} B); no order within {now.peak_intermediate_bytes:,} B is cheaper")
        return Decision(now, best, unconstrained, False, reason)
    reason = f"already optimal order {format_tree(now.tree)}: {now.flops:,} FLOPs"
    return Decision(now, best, unconstrained, False, reason)


# --- checks -----------------------------------------------------------------------------------


def _is_leaf(tree: Tree) -> bool:
    if isinstance(tree, bool):
        raise TypeError(f"a tree leaf must be an int index, got {tree!r}")
    return isinstance(tree, int)


def _split(tree: Tree) -> tuple[Tree, Tree]:
    if not isinstance(tree, tuple) or len(tree) != 2:
        raise TypeError(f"a tree is a leaf index or a pair (left, right), got {tree!r}")
    return tree


def _count(n: int) -> int:
    n = _nonnegative(n, "n")
    if n < 1:
        raise ValueError("a chain has at least one factor")
    return n


def _nonnegative(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def _check_dims(dims: Sequence[int]) -> tuple[int, ...]:
    d = tuple(_nonnegative(x, "a dimension") for x in dims)
    if len(d) < 2:
        raise ValueError(f"dims needs at least 2 entries (one factor), got {list(d)}")
    return d


def _check_batch(batch: int | Sequence[int]) -> int:
    if isinstance(batch, Sequence):
        return math.prod(_nonnegative(x, "a batch dimension") for x in batch)
    return _nonnegative(batch, "batch")


def _check_itemsize(itemsize: int) -> int:
    item = _nonnegative(itemsize, "itemsize")
    if item < 1:
        raise ValueError("itemsize must be >= 1")
    return item
