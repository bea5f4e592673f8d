"""The splitter's chunk-size policy: a pure function of sizes, tested without TensorFlow.

A region split along an axis of length ``L`` into chunks of ``c`` needs, by the memory model,

    fixed_bytes + c * bytes_per_unit

where ``fixed_bytes`` is what stays live whatever the chunk (the program's inputs and outputs,
tensors used whole, the combiner's accumulator) and ``bytes_per_unit`` what one unit of the split
axis costs inside the loop body (sliced inputs, the body's intermediates).  The policy:

* the fewest, largest chunks that fit ``budget_bytes`` (speed: each loop step has a fixed cost,
  and big chunks keep XLA's kernels efficient);
* among chunks giving as many slices, equal ones where they divide ``L`` (8 x 512 of 4096, not
  7 x 585 and a remainder of 1);
* a chunk and its remainder together no larger than the largest chunk that fits: the remainder
  slice (``L mod c`` rows) is computed by one more copy of the body after the loop, in the
  program's own computation, where XLA's buffer assignment places its tensors beside what the
  loop's body used rather than over it (measured on TF 2.21, a Transformer's three attentions in
  chunks of 147 of 1024 rows: the 142-row remainders cost 2.4 MB more than 8 steps of 128, on a
  9.4 MB program).  So a divisor of ``L`` (no remainder) or a remainder of a few rows;
* nothing to do when the whole axis fits (``chunk == L``); no plan when even one unit does not fit.

The model's figures are estimates (see :mod:`grappler_ext.memory_model`), so callers pass a
budget with a safety margin already taken off.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ChunkPlan", "NoPlan", "plan_chunks"]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Split an axis of ``length`` into ``steps`` chunks of ``chunk`` and, if ``tail``, one more of ``tail``."""

    length: int
    chunk: int
    predicted_bytes: int

    @property
    def steps(self) -> int:
        """Full chunks, computed in the loop."""
        return self.length // self.chunk

    @property
    def tail(self) -> int:
        """Size of the remainder slice computed after the loop (0: none)."""
        return self.length % self.chunk

    @property
    def splits(self) -> bool:
        return self.chunk < self.length


@dataclasses.dataclass(frozen=True)
class NoPlan:
    """No chunk size fits; ``reason`` is one line with the numbers."""

    reason: str

    def __bool__(self) -> bool:
        return False


def plan_chunks(length: int, bytes_per_unit: float, fixed_bytes: int, budget_bytes: int) -> ChunkPlan | NoPlan:
    """The largest chunk of an axis of ``length`` whose predicted bytes fit ``budget_bytes``.

    Worked example: L = 20000 rows of a [20000, 20000] f32 distance matrix (80 kB per row), 1 MB
    fixed, a 100 MB budget: at most (100e6 - 1e6) / 80e3 = 1237 rows fit.  Chunks of 1237 leave a
    remainder of 208 rows (1237 + 208 > 1237), and so does every chunk down to 1177 (16 steps and
    a remainder of 20000 - 16 c >= 1168); 1176 leaves 8 (17 x 1176 = 19992): the plan is 17 chunks
    of 1176 and a tail of 8 rows.  With an 81 MB budget, 1000 rows fit and divide 20000: exactly 20
    chunks of 1000, no tail.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if bytes_per_unit < 0 or fixed_bytes < 0:
        raise ValueError("bytes_per_unit and fixed_bytes must be >= 0")
    if fixed_bytes + length * bytes_per_unit <= budget_bytes:
        return ChunkPlan(length, length, int(fixed_bytes + length * bytes_per_unit))
    room = budget_bytes - fixed_bytes
    if room < bytes_per_unit or room <= 0:
        return NoPlan(f"even one slice needs {fixed_bytes + bytes_per_unit:.0f} bytes "
                      f"({fixed_bytes} fixed + {bytes_per_unit:.0f} per slice) and the budget is {budget_bytes}")
    largest = min(length, int(room // bytes_per_unit)) if bytes_per_unit > 0 else length
    # The largest chunk whose remainder fits beside it (c = 1 always does; the search is short:
    # a remainder of at most j rows turns up within about sqrt(2 c) sizes below the largest).
    chunk = next(c for c in range(largest, 0, -1) if c + length % c <= largest)
    # As many slices in equal chunks, where they divide the axis (8 x 512 of 4096, not 7 x 585 + 1).
    slices = -(-length // chunk)
    if length % slices == 0:
        chunk = length // slices
    return ChunkPlan(length, chunk, int(fixed_bytes + chunk * bytes_per_unit))
