"""The one frozen options object that every pass reads, and how users set it.

Options come from three layers, innermost wins:

1. the defaults of :class:`Options`;
2. the process-wide options given to :func:`tf_memsafe.enable`;
3. ``with tf_memsafe.options(**overrides):`` scopes, thread-local and nestable, restored on exit even
   when the body raises.

Passes receive an ``Options`` instance as an argument and never read globals.  User strings such as
``"4GB"`` are parsed here, once (see :mod:`tf_memsafe.units`).

Every field is checked where the options are made (``Options(...)``, :func:`make_options`, and so
``enable(...)`` and ``options(...)``), never at the next trace: a value of the wrong type raises
``TypeError`` and a value out of range, or a pass name nobody defines, ``ValueError``; the message names
the field, the value given and what the field accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import numbers
import os
import re
import threading
from collections.abc import Iterable, Iterator

from grappler_ext.pass_base import GraphPass, PassOptions, ShardedAxis
from grappler_ext.pipeline import DEFAULT_ORDER, registered_passes
from tf_memsafe.units import MemoryLimit, format_bytes, parse_memory_limit

__all__ = ["Options", "current", "scoped", "set_global", "get_global", "make_options", "known_pass_names",
           "describe_unknown_passes"]

DEFAULT_MEMORY_LIMIT = "80%"


@dataclasses.dataclass(frozen=True)
class Options(PassOptions):
    """What tf_memsafe does to each traced ``tf.function``: the passes' typed options
    (:class:`grappler_ext.pass_base.PassOptions`) and the user-facing ones around them.

    Attributes:
      memory_limit_bytes: the limit on XLA's buffer assignment ("Total bytes used") of each
        compiled program, in bytes: an int > 0 (not a bool, not a string: ``"8MB"`` goes to the
        ``memory_limit`` keyword of ``enable``/``options``, which parses units); ``None`` when the
        limit is a fraction of device memory.  Exactly one of the two limit fields is set.
      memory_limit_fraction: the limit as a fraction (0, 1] of the memory of the device the
        function runs on (GPU memory on a GPU, physical RAM otherwise); ``None`` when absolute.
      disabled_passes: names of passes not to run (the same names ``explain()`` prints): given as one
        name or any iterable of names, kept as a frozenset; every name must be a known pass
        (:func:`known_pass_names`), so a typo is refused instead of leaving the pass on.
      rewrite_non_jit: also rewrite ``tf.function``s compiled without XLA.  Off by default: the
        memory model and the limit are about XLA's buffer assignment.
      strict: raise instead of failing open.  A failing pass or verifier then raises
        :class:`tf_memsafe.errors.RewriteError`; by default the function is left exactly as traced
        and one warning names the pass.  Meant for tests.
      verify: run the graph verifier after every pass (always on in this project's tests).
      max_fixed_point_iterations: cap on repetitions of the whole pipeline while some pass still
        changes the graph; an int >= 1 (1 runs every pass once).
      dump_dir: if set (a folder, ``str`` or ``os.PathLike``, kept as ``str``), the printed graph
        before and after each pass is written there; ``None``: no dumps.
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
        ``truncated_normal``, and the seeded stateless draws of Keras 3's dropout) into its loops,
        each slice drawing its own values with a stateless generator keyed by a seed drawn once per
        call, the op and the slice's offset, so that a slice's gradient sees the very values its
        forward drew.  The values are other draws of the same distribution, not the unsplit
        program's (a seeded draw too: ``keras.utils.set_random_seed`` no longer fixes them), and the
        loop's record names the draws it draws again.  Off by default: a region with a random draw
        in it is not split through it (the record names the op and this option).
      check_at_run: a function whose inputs have dimensions known only at run time (planned at nominal
        sizes, or left as traced where no plan split it) is checked, by XLA's figure for its program at
        the shape it runs at, the first time it runs at a shape larger in some dimension than those
        judged before; one warning if that is over the limit (:mod:`tf_memsafe.run_check`).  One extra
        compile (never run) per such shape; off: a plan is judged at its nominal sizes only, and a
        program no plan split is warned about when traced.
      exla_flags: on a TensorFlow build with the eXLA tensor splitter (a fork), let
        :func:`tf_memsafe.enable` pass the limit to it through ``XLA_FLAGS`` (see
        :mod:`tf_memsafe.xla_flags`); whether the build has it is checked once, in a child process.

    The switches (``rewrite_non_jit``, ``strict``, ``verify``, ``calibrate_chunks``, ``check_programs``,
    ``redraw_random``, ``check_at_run``, ``exla_flags``) take ``True`` or ``False`` only: ``"no"``, ``None``
    or ``1`` are refused rather than read by truthiness.
    """

    # The passes' fields (memory_limit_bytes, disabled_passes, verify, max_fixed_point_iterations,
    # dump_dir, calibrate_chunks, check_programs, redraw_random) and their defaults come from
    # PassOptions; the user-facing ones follow.
    memory_limit_fraction: float | None = 0.8
    rewrite_non_jit: bool = False
    strict: bool = False
    check_at_run: bool = True
    exla_flags: bool = True

    def __post_init__(self):
        # Types first, each field on its own, so that the message names the field that is wrong.
        for name in _SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(_bad(name, value, "True or False"))
        self._set("memory_limit_bytes", _whole_bytes(self.memory_limit_bytes))
        self._set("memory_limit_fraction", _fraction(self.memory_limit_fraction))
        if (self.memory_limit_bytes is None) == (self.memory_limit_fraction is None):
            raise ValueError("give exactly one of memory_limit_bytes and memory_limit_fraction, got "
                             f"memory_limit_bytes={self.memory_limit_bytes!r}, "
                             f"memory_limit_fraction={self.memory_limit_fraction!r}")
        iterations = self.max_fixed_point_iterations
        if isinstance(iterations, bool) or not isinstance(iterations, numbers.Integral):
            raise TypeError(_bad("max_fixed_point_iterations", iterations, "an int >= 1"))
        if iterations < 1:
            raise ValueError(_bad("max_fixed_point_iterations", iterations, "an int >= 1"))
        self._set("max_fixed_point_iterations", int(iterations))
        self._set("dump_dir", _folder(self.dump_dir))
        self._set("disabled_passes", _pass_names(self.disabled_passes))
        sharded = self.sharded_inputs
        if not isinstance(sharded, tuple) or not all(isinstance(s, ShardedAxis) for s in sharded):
            raise TypeError(_bad("sharded_inputs", self.sharded_inputs, "a tuple of ShardedAxis"))
        problem = describe_unknown_passes(self.disabled_passes)
        if problem:
            raise ValueError(f"disabled_passes: {problem}")

    def _set(self, name: str, value) -> None:
        """Store the checked, normalised value (``np.int64(5)`` -> 5, a ``Path`` -> its ``str``)."""
        object.__setattr__(self, name, value)

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


# Fields the hook sets for each trace, never options: their defaults, and where tf_memsafe reads them.
_PER_TRACE = {"sharded_inputs": ((), "each call's DTensor inputs"), "xla_compiled": (True, "each traced function")}
_FIELDS = {f.name for f in dataclasses.fields(Options)} - set(_PER_TRACE)
# The on/off switches, from the annotations (``PassOptions`` and ``Options`` both postpone them, so
# each is the text "bool"): a switch added to either class is checked without a change here.
_SWITCHES = tuple(f.name for f in dataclasses.fields(Options) if f.type == "bool")


def _bad(field: str, value, accepted: str) -> str:
    return f"{field} must be {accepted}, got {value!r}"


def _memory_limit_hint(value) -> str:
    """Where a limit given to the wrong field belongs, if ``memory_limit`` would take it."""
    try:
        parse_memory_limit(value)
    except ValueError:
        return ""
    return f" (a limit such as {value!r} goes to memory_limit={value!r} of enable() or options())"


def _whole_bytes(value) -> int | None:
    accepted = "None or an int > 0 (bytes)"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(_bad("memory_limit_bytes", value, accepted) + _memory_limit_hint(value))
    if value <= 0:
        raise ValueError(_bad("memory_limit_bytes", value, accepted))
    return int(value)


def _fraction(value) -> float | None:
    accepted = "None or a number in (0, 1] (a fraction of the device's memory)"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_bad("memory_limit_fraction", value, accepted) + _memory_limit_hint(value))
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(_bad("memory_limit_fraction", value, accepted))
    return float(value)


def _pass_names(value) -> frozenset[str]:
    """One name, or any iterable of names, as the frozenset the field holds."""
    names = [value] if isinstance(value, str) else value
    if isinstance(names, Iterable):
        names = list(names)
        if all(isinstance(n, str) for n in names):
            return frozenset(names)
    raise TypeError(_bad("disabled_passes", value, "a pass name or an iterable of pass names (str)"))


def _folder(value) -> str | None:
    accepted = "None or a folder path (a non-empty str or os.PathLike)"
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise TypeError(_bad("dump_dir", value, accepted))
    if not path:
        raise ValueError(_bad("dump_dir", value, accepted) + "; None turns the dumps off")
    return path


_PASS_NAME = re.compile(r"[a-z][a-z0-9_]*")  # what register_pass accepts
_known_passes: set[str] = set()
_known_lock = threading.Lock()


def _pass_classes(cls: type = GraphPass) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _pass_classes(sub)


def known_pass_names() -> frozenset[str]:
    """The names ``disabled_passes`` accepts, looked up now: the product's passes
    (:data:`grappler_ext.pipeline.DEFAULT_ORDER`, imported or not), every registered pass, and the
    ``name`` of every other :class:`~grappler_ext.pass_base.GraphPass` class defined in this process
    (a ``Pipeline`` runs unregistered passes too: a test's, a user's own).  A name once known stays
    known, so options accepted once are accepted again when a scope is re-applied at a trace.
    """
    names = set(DEFAULT_ORDER) | set(registered_passes())
    for cls in _pass_classes():
        name = getattr(cls, "name", None)  # an abstract pass, or one named per instance, has none
        if isinstance(name, str) and _PASS_NAME.fullmatch(name):
            names.add(name)
    with _known_lock:
        _known_passes.update(names)
        return frozenset(_known_passes)


def describe_unknown_passes(names: Iterable[str]) -> str | None:
    """One line naming those of ``names`` no pass has, with close matches and the known passes; ``None``
    when every name is known."""
    unknown = sorted(set(names) - _known_passes)  # the common case, every name seen before, costs no scan
    if unknown:
        known = known_pass_names()
        unknown = [n for n in unknown if n not in known]
    if not unknown:
        return None
    guesses = sorted({g for n in unknown for g in difflib.get_close_matches(n, known, n=2)})
    hint = f" (did you mean {', '.join(map(repr, guesses))}?)" if guesses else ""
    label = "unknown pass" if len(unknown) == 1 else "unknown passes"
    return f"{label} {', '.join(map(repr, unknown))}{hint}; known passes: {', '.join(sorted(known))}"


def _normalise(overrides: dict) -> dict:
    """Turn user-facing keyword arguments into Options fields (parsing ``memory_limit``); the fields
    themselves are checked by ``Options``."""
    out = dict(overrides)
    if "memory_limit" in out:
        if "memory_limit_bytes" in out or "memory_limit_fraction" in out:
            given = {k: out[k] for k in ("memory_limit_bytes", "memory_limit_fraction") if k in out}
            raise TypeError(f"give memory_limit or memory_limit_bytes/memory_limit_fraction, not both: got "
                            f"memory_limit={out['memory_limit']!r} (also enable()'s first argument, "
                            f"{DEFAULT_MEMORY_LIMIT!r} when not given) and "
                            + ", ".join(f"{k}={v!r}" for k, v in given.items()))
        limit = parse_memory_limit(out.pop("memory_limit"))
        out["memory_limit_bytes"], out["memory_limit_fraction"] = limit.bytes, limit.fraction
    elif "memory_limit_bytes" in out and "memory_limit_fraction" not in out:
        out["memory_limit_fraction"] = None
    elif "memory_limit_fraction" in out and "memory_limit_bytes" not in out:
        out["memory_limit_bytes"] = None
    for name, (default, source) in _PER_TRACE.items():
        value = out.pop(name, default)           # (an Options' own fields given back hold the default)
        if value != default or type(value) is not type(default):
            raise TypeError(f"{name} is not an option: tf_memsafe reads it from {source}")
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
