"""What XLA holds at its program's peak: the buffers live there, largest first, with the TensorFlow ops they came from.

    from experiments.peak_buffers import live_at_peak, render
    print(render(live_at_peak(step, x)))          # step: a tf.function or a plain callable

XLA's buffer assignment (dumped after optimisations) lists the buffers live at the peak of the
program's schedule ("Live ranges at t (peak)") and, for each buffer, the instruction that defines it
with its metadata (the TensorFlow op's type and name).  This reads both for the largest module the
call compiles, as it is compiled under tf_memsafe's options in force (or as written: ``rewrite=False``).
It is how the causes of the Transformer's training-step footprint were found (README, issue 28): a
tensor of a run-time size held from the forward to the backward shows up by name.

Only what XLA's dump says is read; the program is compiled, not run.
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from tf_memsafe import hook, xla_flags

__all__ = ["Live", "Peak", "parse", "live_at_peak", "render"]

_PEAK_RE = re.compile(r"^  Live ranges at (\d+) \(peak\):\n((?:    .*\n?)*)", re.MULTILINE)
_LIVE_RE = re.compile(r"^    (\S+?)\{[^}]*\}: (\d+) bytes", re.MULTILINE)
_DEFINED_RE = re.compile(r"^ from instruction: %(\S+) = (\S+) .*?(?:metadata=\{([^}]*)\})?$", re.MULTILINE)
_TOTAL_RE = re.compile(r"^Total bytes used: (\d+)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Live:
    """One buffer live at the peak: its HLO instruction, bytes and shape, and the TensorFlow op it
    came from (``op_type``/``op_name`` of its metadata; empty where XLA made it: a copy, a loop's tuple)."""

    instruction: str
    bytes: int
    shape: str
    op_type: str
    op_name: str


@dataclasses.dataclass(frozen=True)
class Peak:
    """The module's "Total bytes used", the schedule time of its peak and what is live there."""

    module: str
    total_bytes: int
    time: int
    live: tuple[Live, ...]


def _metadata(text: str | None, key: str) -> str:
    m = re.search(rf'{key}="([^"]*)"', text or "")
    return m.group(1) if m else ""


def parse(text: str, module: str = "") -> Peak | None:
    """The peak of one buffer-assignment dump (``None`` where it has no peak section)."""
    peak = _PEAK_RE.search(text)
    total = _TOTAL_RE.search(text)
    if peak is None or total is None:
        return None
    defined = {m.group(1): (m.group(2), m.group(3)) for m in _DEFINED_RE.finditer(text)}
    live = []
    for name, size in _LIVE_RE.findall(peak.group(2)):
        shape, meta = defined.get(name, ("", None))
        live.append(Live(name, int(size), shape, _metadata(meta, "op_type"), _metadata(meta, "op_name")))
    live.sort(key=lambda b: -b.bytes)
    return Peak(module, int(total.group(1)), int(peak.group(1)), tuple(live))


def live_at_peak(fn, *args, rewrite: bool = True) -> Peak:
    """The peak of the largest module XLA compiles for ``fn(*args)`` (a ``tf.function``'s Python
    function is compiled afresh with ``jit_compile=True``), under tf_memsafe's options in force when
    it is enabled and ``rewrite``; as written otherwise."""
    python = getattr(fn, "python_function", fn)
    # (called through a lambda: a method's defaults, GPflow's ``full_cov=False``, are bound by Python)
    compiled = tf.function(lambda *a: python(*a), jit_compile=True)
    with xla_flags.dump_for_one_compile() as folder:
        if rewrite and tf_memsafe.is_enabled():
            compiled.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
        else:
            with hook.suspended():
                compiled.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
        peaks = [peak for module, text in xla_flags.buffer_assignments(folder)
                 if (peak := parse(text, module)) is not None]
    if not peaks:
        raise RuntimeError("XLA dumped no buffer assignment with a peak for this call")
    return max(peaks, key=lambda p: p.total_bytes)


def render(peak: Peak, top: int = 15) -> str:
    """The peak for people: the module's total, then the ``top`` largest live buffers."""
    lines = [f"{peak.module}: {peak.total_bytes:,} B in all; live at its peak (t = {peak.time}), "
             f"{sum(b.bytes for b in peak.live):,} B:"]
    for b in peak.live[:top]:
        origin = f"{b.op_type + ' ' if b.op_type else ''}`{b.op_name}`" if b.op_name else "(made by XLA)"
        lines.append(f"  {b.bytes:>14,} B  {b.shape:<28} {origin}  [{b.instruction}]")
    if len(peak.live) > top:
        lines.append(f"  ... and {len(peak.live) - top} more ({sum(b.bytes for b in peak.live[top:]):,} B)")
    return "\n".join(lines)
