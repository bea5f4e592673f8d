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
    assignment's memory-usage report ("Total bytes used"), which we read and delete.  The command
    line (``python -m tf_memsafe``) sets them for the whole run (:func:`dump_all_compiles`) to
    report each compiled program's figure at exit, unless the user dumps somewhere already (then
    it reads the user's directory and leaves it as it is).

``--xla_tensor_size_threshold=<bytes>``, ``--xla_tensor_split_size=<bytes>``
    only on a TensorFlow build that has the eXLA tensor-splitting pass (a fork some users run),
    and only when :func:`validate` has shown, in a subprocess, that this build knows them.  Set
    by :func:`tf_memsafe.enable` from the user's limit (see :func:`exla_flags_for`), always in
    plain bytes: eXLA's own parser reads ``GiB`` as 2^27 bytes.  Removed by ``disable()``.  A
    user's own value for either flag wins.  On stock TensorFlow they are never set.

Any other flag goes through :func:`set_flags`, which validates it first.

Validation.  A flag is never put in this process's ``XLA_FLAGS`` before a child process has
compiled a one-op program with it (:func:`validate`): an unknown name or a malformed value then
kills the child, not the user's program.  Results are cached per TensorFlow build (version, git
revision and installation path), in memory and in ``$TF_MEMSAFE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/tf_memsafe`` or ``~/.cache/tf_memsafe``), so a flag costs one child (~2 s) once
per machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator

from tf_memsafe.errors import TfMemsafeError

__all__ = [
    "RESET_FLAG", "ensure_reset_flag", "user_flags", "dump_for_one_compile", "flags_lock", "InvalidFlagError",
    "validate", "check", "set_flags", "unset_flags", "exla_available", "exla_flags_for", "EXLA_FLAGS",
    "dump_all_compiles", "memory_reports",
]

ENV = "XLA_FLAGS"
RESET_FLAG = "--xla_flags_reset=true"
flags_lock = threading.RLock()  # XLA_FLAGS is process-wide: one measurement at a time.


# The eXLA fork's tensor-splitting flags (name, and the fraction of the user's limit sent to it).
# A tensor larger than half the limit is split, into chunks of an eighth of it: the split region
# then holds a chunk, its operands' chunks and the combined result within the limit, as in eXLA's
# own examples (split size at most half the threshold).
EXLA_THRESHOLD_FLAG = "--xla_tensor_size_threshold"
EXLA_SPLIT_FLAG = "--xla_tensor_split_size"
EXLA_FLAGS = (EXLA_THRESHOLD_FLAG, EXLA_SPLIT_FLAG)
EXLA_THRESHOLD_FRACTION = 0.5
EXLA_SPLIT_FRACTION = 0.125


class InvalidFlagError(TfMemsafeError, ValueError):
    """An XLA flag this TensorFlow build would reject (the message names it and says why)."""


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


_DUMP_RE = re.compile(r"tf_memsafe_(?:xla|run)_dump_(\d+)_")


def _dump_dir(kind: str) -> str:
    """A fresh private dump directory named with this process's id; stale ones of dead processes
    (killed while measuring, so they could not delete theirs) are removed first."""
    remove_stale_dumps()
    return tempfile.mkdtemp(prefix=f"tf_memsafe_{kind}_dump_{os.getpid()}_")


def remove_stale_dumps(root: str | None = None) -> int:
    """Delete the dump directories in ``root`` (the temp dir) whose process no longer exists."""
    root = root or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        m = _DUMP_RE.match(name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:        # another user's process: alive
        return True
    return True


@contextlib.contextmanager
def dump_for_one_compile() -> Iterator[str]:
    """Make XLA dump the programs compiled inside the block into a fresh directory (yielded).

    The user's own ``--xla_dump_to`` is overridden for the block only (their directory does not get
    the measurement compiles) and restored after; the directory is deleted afterwards.
    """
    with flags_lock:
        previous = os.environ.get(ENV)
        folder = _dump_dir("xla")
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


@contextlib.contextmanager
def dump_all_compiles() -> Iterator[str]:
    """Make XLA dump every program compiled inside the block; yields the directory.

    The user's own ``--xla_dump_to`` is kept and yielded (nothing is deleted there); otherwise a
    private temporary directory is used and deleted afterwards.
    """
    with flags_lock:
        previous = os.environ.get(ENV)
        users = user_flags()
        own = next((f.split("=", 1)[1] for f in users if _flag_name(f) == "--xla_dump_to" and "=" in f), None)
        folder = own or _dump_dir("run")
        extra = [] if own else [f"--xla_dump_to={folder}"]
        if "--xla_dump_hlo_as_text" not in {_flag_name(f) for f in users}:
            extra.append("--xla_dump_hlo_as_text")
        os.environ[ENV] = shlex.join([RESET_FLAG] + users + extra)
    try:
        yield folder
    finally:
        with flags_lock:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
        if not own:
            shutil.rmtree(folder, ignore_errors=True)


_MODULE_RE = re.compile(r"^module_(\d+)\.(.+?)\.\S*after_optimizations-memory-usage-report\.txt$")
_TOTAL_RE = re.compile(r"^Total bytes used:\s*(\d+)", re.MULTILINE)


def memory_reports(folder: str) -> list[tuple[str, int]]:
    """``(module name, "Total bytes used")`` of every memory-usage report in ``folder``, in compile order."""
    found = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        m = _MODULE_RE.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                total = _TOTAL_RE.search(f.read())
        except OSError:
            continue
        if total:
            found.append((int(m.group(1)), m.group(2), int(total.group(1))))
    return [(module, total) for _, module, total in sorted(found)]


# --- Validation in a child process, cached per TensorFlow build -----------------------------------

_PROBE = "import tensorflow as tf; tf.function(lambda a: a + 1.0, jit_compile=True)(tf.ones([2])); print('ok')"
_UNKNOWN_RE = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)$", re.MULTILINE)
_memory_cache: dict[str, str | None] = {}
_ours: set[str] = set()  # names of the flags set_flags() added (never the user's)


def _build_key() -> str:
    import tensorflow as tf

    ident = f"{tf.__version__}|{tf.version.GIT_VERSION}|{os.path.dirname(tf.__file__)}"
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def _cache_path() -> str:
    root = os.environ.get("TF_MEMSAFE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tf_memsafe")
    return os.path.join(root, f"xla_flags-{_build_key()}.json")


def _load_disk_cache() -> dict[str, str | None]:
    try:
        with open(_cache_path(), encoding="utf-8") as f:
            data = json.load(f)
        return {k: v for k, v in data.items() if isinstance(k, str) and (v is None or isinstance(v, str))}
    except (OSError, ValueError):
        return {}


def _store_disk_cache(results: dict[str, str | None]) -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _load_disk_cache()
        data.update(results)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only home only costs a child process per session
        pass


def _probe(flags: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=shlex.join(flags), TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)


def _probe_all(flags: list[str]) -> dict[str, str | None]:
    """Each flag mapped to ``None`` (accepted) or the reason this build rejects it."""
    results: dict[str, str | None] = {}
    pending = list(flags)
    while pending:
        done = _probe(pending)
        if done.returncode == 0 and done.stdout.strip().endswith("ok"):
            results.update(dict.fromkeys(pending))
            break
        unknown = _UNKNOWN_RE.search(done.stderr)
        named = set(shlex.split(unknown.group(1))) & set(pending) if unknown else set()
        if named:
            for flag in named:
                results[flag] = "unknown to this TensorFlow build's XLA"
            pending = [f for f in pending if f not in named]
        elif len(pending) > 1:  # a value failed to parse: find which, one flag at a time
            for flag in pending:
                results.update(_probe_all([flag]))
            break
        else:
            tail = [line for line in done.stderr.splitlines() if "Check failed" in line or "usage:" in line]
            detail = tail[0].split("] ", 1)[-1] if tail else f"the probe exited with status {done.returncode}"
            results[pending[0]] = f"rejected by XLA's flag parser ({detail.strip()})"
            break
    return results


def validate(flags: Iterable[str]) -> dict[str, str | None]:
    """Which of ``flags`` this TensorFlow build's XLA accepts, decided in a child process.

    Returns each flag mapped to ``None`` if accepted, else a one-line reason.  Flags are judged
    with their values (``--xla_foo=banana`` may be rejected where ``--xla_foo=true`` is not).
    Nothing is set in this process.
    """
    flags = [str(f) for f in flags]
    for flag in flags:
        if not flag.startswith("--xla_") or any(c.isspace() for c in flag):
            raise InvalidFlagError(f"{flag!r} is not an XLA flag: XLA flags look like --xla_<name>[=<value>]")
    with flags_lock:
        if not _memory_cache:
            _memory_cache.update(_load_disk_cache())
        missing = [f for f in dict.fromkeys(flags) if f not in _memory_cache]
        if missing:
            found = _probe_all(missing)
            _memory_cache.update(found)
            _store_disk_cache(found)
        return {f: _memory_cache[f] for f in flags}


def check(flags: Iterable[str]) -> None:
    """Raise :class:`InvalidFlagError` naming every flag of ``flags`` this build rejects."""
    bad = {f: why for f, why in validate(flags).items() if why is not None}
    if bad:
        listed = "; ".join(f"{f}: {why}" for f, why in bad.items())
        raise InvalidFlagError(f"XLA would abort the process on {listed}. Remove the flag, or check its spelling "
                               "and value against this TensorFlow version's XLA (nothing was set)")


def set_flags(flags: Iterable[str]) -> list[str]:
    """Add ``flags`` to ``XLA_FLAGS`` after validating them; return those actually added.

    A flag the user already set (same name, any value) is left as the user set it and not added:
    the user's values win.  With the reset flag first in ``XLA_FLAGS`` (tf_memsafe's import puts it
    there), XLA picks the new flags up at its next compile.
    """
    flags = list(flags)
    check(flags)
    with flags_lock:
        current = _split(os.environ.get(ENV, ""))
        present = {_flag_name(f) for f in current}
        added = [f for f in flags if _flag_name(f) not in present]
        if added:
            os.environ[ENV] = shlex.join(current + added)
            _ours.update(_flag_name(f) for f in added)
        return added


def unset_flags(names: Iterable[str]) -> None:
    """Remove the flags named ``names`` that :func:`set_flags` added; the user's are never touched."""
    with flags_lock:
        drop = {n.split("=", 1)[0] for n in names} & _ours
        if not drop:
            return
        current = _split(os.environ.get(ENV, ""))
        os.environ[ENV] = shlex.join([f for f in current if _flag_name(f) not in drop])
        _ours.difference_update(drop)


def exla_available() -> bool:
    """Whether this TensorFlow build has the eXLA tensor-splitting flags (stock TensorFlow: no)."""
    probes = [f"{name}=1000000" for name in EXLA_FLAGS]
    return all(why is None for why in validate(probes).values())


def exla_flags_for(limit_bytes: int) -> list[str]:
    """The eXLA flags carrying ``limit_bytes``, in plain bytes (eXLA parses ``GiB`` as 2^27)."""
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
    threshold = max(1, int(limit_bytes * EXLA_THRESHOLD_FRACTION))
    split = max(1, int(limit_bytes * EXLA_SPLIT_FRACTION))
    return [f"{EXLA_THRESHOLD_FLAG}={threshold}", f"{EXLA_SPLIT_FLAG}={split}"]
