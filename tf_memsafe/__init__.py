"""tf_memsafe: memory-safe computations for TensorFlow.

    import tf_memsafe
    tf_memsafe.enable(memory_limit="4GB")   # once, before the functions are traced

Every ``tf.function(jit_compile=True)`` traced afterwards is rewritten, before XLA compiles it, so
that its compiled program fits the limit, computing the same values.

Public API:

* :func:`enable`, :func:`disable`, :func:`is_enabled` -- switch the hook on and off;
* :func:`options` -- a thread-local, nestable ``with`` scope overriding options;
* :func:`get_options` and :class:`Options` -- the frozen options in force;
* :func:`parse_memory_limit` -- the limit parser ("4GB", "1.5GiB", "80%", ...);
* :func:`reports` -- what the hook did with each function traced while enabled;
* :func:`explain` and :class:`Report` -- one function measured before and after the rewrites, with
  every pass's records (``print(tf_memsafe.explain(f, x))``);
* :func:`memory_footprint` -- XLA's "Total bytes used" for a function's compiled program, compiled
  but not run; :func:`tape_footprint` -- the forward and backward programs it compiles to under a
  ``GradientTape``, each and their sum; :func:`peak_memory` -- the allocator's peak while running it;
* :func:`relayout` -- DTensor's relayout with no device allocating more than its target shard
  (Rink et al.'s bound); :func:`explain_relayout` and :class:`RelayoutReport` -- its plan;
* errors: :class:`TfMemsafeError`, :class:`RewriteError`, :class:`UnsupportedTensorFlowError`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tf_memsafe import xla_flags as _xla_flags

# Before anything can make XLA read XLA_FLAGS: lets measurements set a dump directory per compile.
_xla_flags.ensure_reset_flag()

from tf_memsafe import config as _config  # noqa: E402
from tf_memsafe import hook as _hook  # noqa: E402
from tf_memsafe.config import Options  # noqa: E402
from tf_memsafe.errors import RewriteError, TfMemsafeError, UnsupportedTensorFlowError  # noqa: E402
from tf_memsafe.hook import TraceCode, TraceReport  # noqa: E402
from tf_memsafe.memory import (  # noqa: E402
    MeasurementError,
    TapeFootprint,
    memory_footprint,
    peak_memory,
    tape_footprint,
)
from tf_memsafe.relayout import explain_relayout, relayout  # noqa: E402
from tf_memsafe.report import RelayoutReport, Report, explain  # noqa: E402
from tf_memsafe.units import MemoryLimit, format_bytes, parse_memory_limit  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "enable", "disable", "is_enabled", "options", "get_options", "Options", "parse_memory_limit",
    "MemoryLimit", "format_bytes", "reports", "TraceReport", "TraceCode", "TfMemsafeError", "RewriteError",
    "UnsupportedTensorFlowError", "memory_footprint", "tape_footprint", "TapeFootprint", "peak_memory",
    "MeasurementError",
    "explain", "Report", "relayout", "explain_relayout", "RelayoutReport",
]

_enable_lock = threading.Lock()


def enable(memory_limit: int | float | str = _config.DEFAULT_MEMORY_LIMIT, **options) -> Options:
    """Rewrite every ``tf.function(jit_compile=True)`` traced from now on to fit ``memory_limit``.

    Args:
      memory_limit: bytes (``4_000_000_000``), a string with a unit (``"4GB"``, ``"512MiB"``,
        ``"1.5GiB"``), or a percentage of the device's memory (``"80%"``, the default: of the GPU's
        memory when the function runs on a GPU, else of physical RAM).
      **options: any field of :class:`Options` (``disabled_passes``, ``rewrite_non_jit``,
        ``strict``, ``verify``, ``max_fixed_point_iterations``, ``dump_dir``, ``exla_flags``).

    Returns:
      The process-wide :class:`Options` now in force (``options()`` scopes still apply on top).

    Raises (here, before anything is enabled, never at a later trace):
      ValueError: the limit is malformed (the message lists the accepted forms); a value out of range;
        ``disabled_passes`` names a pass that does not exist (the message lists the known passes).
      TypeError: an unknown option, or a value of the wrong type: the switches take ``True``/``False``
        only (not ``"no"``, ``None`` or ``1``), ``memory_limit_bytes`` an int (a string such as
        ``"8MB"`` goes to ``memory_limit``); the message names the field, the value and what it accepts.
      UnsupportedTensorFlowError: this TensorFlow's internals are not the tested ones.

    Functions already traced keep their graphs: enable before the first call.  Calling
    ``enable`` again replaces the options.  On a TensorFlow build with the eXLA tensor splitter
    the limit is also passed to it (``exla_flags=False`` prevents that); on stock TensorFlow no
    XLA flag is set.
    """
    opts = _config.make_options(memory_limit=memory_limit, **options)
    with _enable_lock:
        _hook.install()
        _config.set_global(opts)
        _xla_flags.unset_flags(_xla_flags.EXLA_FLAGS)
        if opts.exla_flags and _xla_flags.exla_available():
            _xla_flags.set_flags(_xla_flags.exla_flags_for(_hook.limit_bytes(opts)))
    return opts


def disable() -> None:
    """Stop rewriting newly traced functions and restore the default options.

    Functions traced while enabled keep their rewritten graphs (TensorFlow caches traces).
    """
    with _enable_lock:
        _hook.uninstall()
        _config.set_global(Options())
        _xla_flags.unset_flags(_xla_flags.EXLA_FLAGS)


def is_enabled() -> bool:
    """Whether newly traced functions are rewritten."""
    return _hook.is_installed()


@contextlib.contextmanager
def options(**overrides) -> Iterator[Options]:
    """Override options for traces in this thread inside the ``with`` block.

    Nestable; the previous options come back on exit, also when the block raises.  Accepts the
    same keywords as :func:`enable`, including ``memory_limit``::

        with tf_memsafe.options(memory_limit="256MiB", strict=True):
            f(x)          # traced (and so rewritten) under these options

    A bad value raises at the ``with`` line, as :func:`enable` says, and the block does not run.
    """
    with _config.scoped(**overrides) as opts:
        yield opts


def get_options() -> Options:
    """The options in force in this thread."""
    return _config.current()


def reports() -> list[TraceReport]:
    """What the hook did with each function traced while enabled, oldest first."""
    return _hook.reports()
