"""The companion for XLA's flags: the ``XLA_FLAGS`` environment variable, handled safely.

Facts about XLA in TensorFlow 2.21 this module is built on (measured):

* XLA parses ``XLA_FLAGS`` at its first compile and never again -- unless the value it read first
  contained ``--xla_flags_reset=true``; then it re-reads the variable at every compile.
* An unknown flag in ``XLA_FLAGS`` kills the process at the next compile, uncatchably.

So, at import, tf_memsafe puts ``--xla_flags_reset=true`` in front of the user's own flags (the
user's flags are kept, in order, and win over anything we add).  After that, a measurement can
point ``--xla_dump_to`` at a private temporary directory for the duration of one compile and put
the user's value back afterwards.

Flags tf_memsafe may set, and why:

``--xla_flags_reset=true``
    lets per-compile settings (the dump directory below) take effect after XLA's first compile.
``--xla_dump_to=<private temp dir>``, ``--xla_dump_hlo_as_text``
    only while :func:`tf_memsafe.memory_footprint` compiles: XLA then writes its buffer
    assignment's memory-usage report ("Total bytes used"), which we read and delete.

Only these flags, all present in every XLA that TensorFlow 2.21 ships, are ever set; nothing
from a user string is added to ``XLA_FLAGS``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
import threading
from collections.abc import Iterator

__all__ = ["RESET_FLAG", "ensure_reset_flag", "user_flags", "dump_for_one_compile", "flags_lock"]

ENV = "XLA_FLAGS"
RESET_FLAG = "--xla_flags_reset=true"
flags_lock = threading.RLock()  # XLA_FLAGS is process-wide: one measurement at a time.


def _split(value: str) -> list[str]:
    return shlex.split(value) if value else []


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def user_flags() -> list[str]:
    """The flags in ``XLA_FLAGS`` other than the reset flag we add."""
    return [f for f in _split(os.environ.get(ENV, "")) if f != RESET_FLAG]


def ensure_reset_flag() -> bool:
    """Put ``--xla_flags_reset=true`` first in ``XLA_FLAGS``; return whether it was added now.

    Only effective if XLA has not compiled anything yet in this process (it reads the variable once
    otherwise).  :func:`dump_for_one_compile` detects the late case and says so.
    """
    with flags_lock:
        flags = _split(os.environ.get(ENV, ""))
        if flags and flags[0] == RESET_FLAG:
            return False
        os.environ[ENV] = shlex.join([RESET_FLAG] + [f for f in flags if f != RESET_FLAG])
        return True


@contextlib.contextmanager
def dump_for_one_compile() -> Iterator[str]:
    """Make XLA dump the programs compiled inside the block into a fresh directory (yielded).

    The user's own ``--xla_dump_to`` is overridden for the block only (their directory does not get
    the measurement compiles) and restored after; the directory is deleted afterwards.
    """
    with flags_lock:
        previous = os.environ.get(ENV)
        folder = tempfile.mkdtemp(prefix="tf_memsafe_xla_dump_")
        users = [f for f in user_flags() if _flag_name(f) not in ("--xla_dump_to", "--xla_dump_hlo_as_text")]
        os.environ[ENV] = shlex.join([RESET_FLAG] + users + [f"--xla_dump_to={folder}", "--xla_dump_hlo_as_text"])
        try:
            yield folder
        finally:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
            shutil.rmtree(folder, ignore_errors=True)
