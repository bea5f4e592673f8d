"""The one frozen options object that every pass reads, and how users set it.

Options come from three layers, innermost wins:

1. the defaults of :class:`Options`;
2. the process-wide options given to :func:`tf_memsafe.enable`;
3. ``with tf_memsafe.options(**overrides):`` scopes, thread-local and nestable, restored on exit even
   when the body raises.

Passes receive an ``Options`` instance as an argument and never read globals.  User strings such as
``"4GB"`` are parsed here, once (see :mod:`tf_memsafe.units`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator

from grappler_ext.pass_base import PassOptions
from tf_memsafe.units import MemoryLimit, format_bytes, parse_memory_limit

__all__ = ["Options", "current", "scoped", "set_global", "get_global", "make_options"]

DEFAULT_MEMORY_LIMIT = "80%"


@dataclasses.dataclass(frozen=True)
class Options(PassOptions):
    """What tf_memsafe does to each traced ``tf.function``: the passes' typed options
    (:class:`grappler_ext.pass_base.PassOptions`) and the user-facing ones around them.

    Attributes:
      memory_limit_bytes: the limit on XLA's buffer assignment ("Total bytes used") of each
        compiled program, in bytes; ``None`` when the limit is a fraction of device memory.
      memory_limit_fraction: the limit as a fraction (0, 1] of the memory of the device the
        function runs on (GPU memory on a GPU, physical RAM otherwise); ``None`` when absolute.
      disabled_passes: names of passes not to run (the same names ``explain()`` prints).
      rewrite_non_jit: also rewrite ``tf.function``s compiled without XLA.  Off by default: the
        memory model and the limit are about XLA's buffer assignment.
      strict: raise instead of failing open.  A failing pass or verifier then raises
        :class:`tf_memsafe.errors.RewriteError`; by default the function is left exactly as traced
        and one warning names the pass.  Meant for tests.
      verify: run the graph verifier after every pass (always on in this project's tests).
      max_fixed_point_iterations: cap on repetitions of the whole pipeline while some pass still
        changes the graph; 1 runs every pass once.
      dump_dir: if set, the printed graph before and after each pass is written there.
      calibrate_chunks: before building a loop, compile it on its own with XLA at two chunk sizes
        (never run) and size its chunks from the bytes XLA gives one more row of the split axis,
        instead of from the memory model's count alone (which is kept on the safe side and so
        gives smaller chunks, and slower loops, than the limit allows).  About a second of
        tracing per loop; off: the model's count alone.
      check_programs: when the memory model puts a program within the limit but not far below it,
        compile a copy of it with XLA (never run) before leaving it alone, and split it after all
        if XLA's figure is over the limit (the model cannot see how XLA's scheduler interleaves
        independent branches: a Transformer's encoder and decoder attention measured 2x the
        model's count).  One extra compile of such programs; off: the model's word is final.
      redraw_random: let the splitter move random draws (``tf.random.uniform``, ``normal``,
        ``truncated_normal``: a dropout mask) into its loops, each slice drawing its own values with
        a stateless generator keyed by a seed drawn once per call, the op and the slice's offset, so
        that a slice's gradient sees the very values its forward drew.  The values are other draws of
        the same distribution, not the unsplit program's.  Off by default: a region with a random
        draw in it is not split through it (the record names the op and this option).
      exla_flags: on a TensorFlow build with the eXLA tensor splitter (a fork), let
        :func:`tf_memsafe.enable` pass the limit to it through ``XLA_FLAGS`` (see
        :mod:`tf_memsafe.xla_flags`); whether the build has it is checked once, in a child process.
    """

    memory_limit_bytes: int | None = None
    memory_limit_fraction: float | None = 0.8
    disabled_passes: frozenset[str] = frozenset()
    rewrite_non_jit: bool = False
    strict: bool = False
    verify: bool = False
    max_fixed_point_iterations: int = 4
    dump_dir: str | None = None
    calibrate_chunks: bool = True
    check_programs: bool = True
    redraw_random: bool = False
    exla_flags: bool = True

    def __post_init__(self):
        limit = MemoryLimit(bytes=self.memory_limit_bytes, fraction=self.memory_limit_fraction)
        if limit.bytes is not None and (isinstance(limit.bytes, bool) or limit.bytes <= 0):
            raise ValueError(f"memory_limit_bytes must be a positive int, got {limit.bytes!r}")
        if limit.fraction is not None and not 0 < limit.fraction <= 1:
            raise ValueError(f"memory_limit_fraction must be in (0, 1], got {limit.fraction!r}")
        if isinstance(self.disabled_passes, str) or not isinstance(self.disabled_passes, frozenset):
            raise TypeError("disabled_passes must be a frozenset of pass names; "
                            "pass an iterable of names to tf_memsafe.enable/options")
        if not isinstance(self.max_fixed_point_iterations, int) or self.max_fixed_point_iterations < 1:
            raise ValueError("max_fixed_point_iterations must be an int >= 1, "
                             f"got {self.max_fixed_point_iterations!r}")

    @property
    def memory_limit(self) -> MemoryLimit:
        return MemoryLimit(bytes=self.memory_limit_bytes, fraction=self.memory_limit_fraction)

    def resolve_memory_limit_bytes(self, device_memory_bytes: int) -> int:
        """The limit in bytes on a device with ``device_memory_bytes`` of memory."""
        return self.memory_limit.resolve(device_memory_bytes)

    def describe_limit(self) -> str:
        if self.memory_limit_bytes is not None:
            return format_bytes(self.memory_limit_bytes)
        return str(self.memory_limit)


_FIELDS = {f.name for f in dataclasses.fields(Options)}


def _normalise(overrides: dict) -> dict:
    """Turn user-facing keyword arguments into Options fields (parsing limits and pass names)."""
    out = dict(overrides)
    if "memory_limit" in out:
        if "memory_limit_bytes" in out or "memory_limit_fraction" in out:
            raise TypeError("give memory_limit or memory_limit_bytes/memory_limit_fraction, not both")
        limit = parse_memory_limit(out.pop("memory_limit"))
        out["memory_limit_bytes"], out["memory_limit_fraction"] = limit.bytes, limit.fraction
    elif "memory_limit_bytes" in out and "memory_limit_fraction" not in out:
        out["memory_limit_fraction"] = None
    elif "memory_limit_fraction" in out and "memory_limit_bytes" not in out:
        out["memory_limit_bytes"] = None
    if "disabled_passes" in out:
        names = out["disabled_passes"]
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, Iterable):
            raise TypeError(f"disabled_passes must be an iterable of pass names, got {names!r}")
        out["disabled_passes"] = frozenset(names)
    unknown = sorted(set(out) - _FIELDS)
    if unknown:
        raise TypeError(f"unknown tf_memsafe option(s) {unknown}; known: {sorted(_FIELDS | {'memory_limit'})}")
    return out


def make_options(base: Options | None = None, **overrides) -> Options:
    """``base`` (default: the defaults) with user-facing ``overrides`` applied and validated."""
    return dataclasses.replace(base or Options(), **_normalise(overrides))


_global_lock = threading.Lock()
_global_options = Options()
_local = threading.local()


def set_global(opts: Options) -> None:
    global _global_options
    with _global_lock:
        _global_options = opts


def get_global() -> Options:
    return _global_options


def _stack() -> list[dict]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current() -> Options:
    """The options in force in this thread: global options with this thread's scopes applied."""
    opts = _global_options
    for overrides in _stack():
        opts = dataclasses.replace(opts, **overrides)
    return opts


@contextlib.contextmanager
def scoped(**overrides) -> Iterator[Options]:
    """Apply ``overrides`` in this thread for the duration of the ``with`` block."""
    normalised = _normalise(overrides)
    # Validate eagerly so that a bad option raises at the ``with`` line, not at the next trace.
    opts = dataclasses.replace(current(), **normalised)
    stack = _stack()
    stack.append(normalised)
    depth = len(stack)
    try:
        yield opts
    finally:
        del stack[depth - 1:]
