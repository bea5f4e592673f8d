"""The companion for XLA's flags: the ``XLA_FLAGS`` environment variable, handled safely.

Facts about XLA in TensorFlow 2.21 this module is built on (measured, and read in XLA's
``xla/parse_flags_from_env.cc`` and ``xla/debug_options_flags.cc``):

* XLA parses ``XLA_FLAGS`` at its first compile and never again -- unless the value it read first
  contained ``--xla_flags_reset=true``; then it re-reads the variable at every compile.
* A re-read parses the variable *over* the values XLA holds: a flag the variable no longer names
  keeps the last value XLA read for it (it is not put back to its default).
* An unknown flag in ``XLA_FLAGS`` kills the process at the next compile, uncatchably.
* XLA splits the value itself, not as a shell would (:func:`parse_flags`): flags are separated by
  spaces, tabs or newlines; a value is taken as written up to the next of them (``=``, ``.*``,
  ``'`` and backslashes included), unless the character after ``=`` is a quote: then the value runs
  to the matching quote, which is removed (backslash escapes the next character inside double
  quotes only).  That is how a value holds spaces: ``--xla_dump_to="/my dumps"``.  Reading stops,
  silently, at the first word that does not start with ``-``: the flags after it are ignored.
* A value that does not start with ``-`` is the name of a file holding the flags.

So tf_memsafe never re-quotes or re-splits what the user wrote: every edit below is made on the
text, and the user's part of the value is kept byte for byte.

At import, tf_memsafe puts ``--xla_flags_reset=true`` and a space in front of the user's value (a
value naming a file is replaced by the file's text, which XLA would have read instead; an
unreadable file is left for XLA to report).  After that, a measurement can point ``--xla_dump_to``
at a private temporary directory for the duration of one compile and put the user's value back.
Since XLA would keep the measurement's dump settings (second fact), the value after a measurement
is the reset flag, then :data:`DUMP_DEFAULTS` (the default value of every flag a measurement may
set), then the user's value: the user's own flags come last and win, as they did before.

Flags tf_memsafe may set, and why:

``--xla_flags_reset=true``
    lets per-compile settings (the dump directory below) take effect after XLA's first compile.
``--xla_backend_optimization_level=0``
    only while the splitter and :func:`tf_memsafe.memory_footprint` compile a program on XLA:CPU
    to read its figure, never to run it (it changes LLVM's code generation, which comes after the
    buffer assignment); put back to XLA's default, 3, after (a user's own value wins, as for the dump
    flags).
``--xla_cpu_use_fusion_emitters=false``
    only while the splitter compiles a loop alone on XLA:CPU to size its chunk (``sizing_only``);
    the program as split is then measured as it will run.  Without its MLIR fusion emitters XLA
    compiles such a loop in about half the time, with the same buffers (measured: the loops the
    splitter's tests size, the same figures; whole training steps within 1 kB of 100 MB).  Put back
    to XLA's default after.
``--xla_dump_to=<private temp dir>``, ``--xla_dump_hlo_as_text``, and empty
``--xla_dump_hlo_module_re`` and ``--xla_dump_hlo_pass_re`` and ``--xla_dump_max_hlo_modules=-1``
    only while :func:`tf_memsafe.memory_footprint` compiles: XLA then writes its buffer
    assignment's memory-usage report ("Total bytes used"), which we read and delete; the user's
    own dump filters, which could hide that report or multiply the files, do not apply to it.  The
    command line (``python -m tf_memsafe``) sets them for the whole run (:func:`dump_all_compiles`)
    to report each compiled program's figure at exit, unless the user dumps somewhere already (then
    it reads the user's directory and leaves the user's dump settings as they are).
:data:`DUMP_DEFAULTS`
    after the first measurement, in front of the user's flags (see above).

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
import dataclasses
import hashlib
import json
import os
import re
import shutil
import string
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator

from tf_memsafe.errors import TfMemsafeError

__all__ = [
    "RESET_FLAG", "DUMP_DEFAULTS", "Flag", "ParsedFlags", "parse_flags", "format_flag", "ensure_reset_flag",
    "user_value", "user_flags", "dump_for_one_compile", "flags_lock", "InvalidFlagError", "validate", "check",
    "set_flags", "unset_flags", "exla_available", "exla_flags_for", "EXLA_FLAGS", "dump_all_compiles",
    "memory_reports", "buffer_assignments", "dump_roots",
]

ENV = "XLA_FLAGS"
RESET_FLAG = "--xla_flags_reset=true"
flags_lock = threading.RLock()  # XLA_FLAGS is process-wide: one measurement at a time.

# The dump flags a measurement sets, with XLA's default values: after a measurement they stand in
# front of the user's flags, so that XLA's re-read puts back what the user did not set.
_DUMP_FLAG_DEFAULTS = (
    ("--xla_dump_to", ""),
    ("--xla_dump_hlo_as_text", "false"),
    ("--xla_dump_hlo_module_re", ""),
    ("--xla_dump_hlo_pass_re", ""),
    ("--xla_dump_max_hlo_modules", "-1"),
)
# LLVM's optimization level for the code XLA generates (XLA's default, 3).  A measurement that is
# compiled and never run may ask for 0 (``fast_codegen``): XLA:CPU's HLO passes and buffer
# assignment come before code generation, so its figure is the same, in less time.
_CODEGEN_FLAG, _CODEGEN_DEFAULT, _CODEGEN_FAST = "--xla_backend_optimization_level", "3", "0"
# XLA:CPU's MLIR fusion emitters (XLA's default: on).  A loop compiled alone only to size its chunk
# may be compiled without them (``sizing_only``): XLA:CPU then skips their fusion wrapping and builds
# no MLIR context per kernel, and its HLO differs only there (scatters expanded, gathers not
# simplified): the same buffers, in about half the compile time.
_EMITTERS_FLAG, _EMITTERS_DEFAULT, _EMITTERS_SIZING = "--xla_cpu_use_fusion_emitters", "true", "false"
# Flags a measurement may change that XLA would keep for later compiles: named at their defaults in
# front of the user's flags inside a block, and after it.
_NAMED_DEFAULTS = " ".join(f"{name}={value}" for name, value in ((_CODEGEN_FLAG, _CODEGEN_DEFAULT),
                                                                (_EMITTERS_FLAG, _EMITTERS_DEFAULT)))
DUMP_DEFAULTS = " ".join([*(f"{name}={value}" for name, value in _DUMP_FLAG_DEFAULTS), _NAMED_DEFAULTS])


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


# --- XLA's own splitting of the value (parse_flags_from_env.cc, ParseArgvFromString) ---------------

_WS = " \t\r\n"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "-_")
_QUOTES = "'\""


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of an ``XLA_FLAGS`` value, as XLA splits it.

    Attributes:
      text: the flag exactly as written, quotes included.
      argv: what XLA's flag parser receives: the quotes around a value removed, escapes applied.
      start, end: where ``text`` lies in the value.
    """

    text: str
    argv: str
    start: int
    end: int

    @property
    def name(self) -> str:
        return self.argv.split("=", 1)[0]

    @property
    def value(self) -> str | None:
        """The value XLA reads (``None`` for a flag written without ``=``)."""
        return self.argv.split("=", 1)[1] if "=" in self.argv else None


@dataclasses.dataclass(frozen=True)
class ParsedFlags:
    """An ``XLA_FLAGS`` value split as XLA splits it: the flags XLA reads, and the text it ignores."""

    text: str
    flags: tuple[Flag, ...]

    @property
    def read_end(self) -> int:
        """Where the last flag XLA reads ends (0 without one); XLA ignores what follows."""
        return self.flags[-1].end if self.flags else 0

    @property
    def ignored(self) -> str:
        """The text after the last flag XLA reads, stripped (empty unless a word stopped XLA's reading)."""
        return self.text[self.read_end:].strip(_WS)


def _skip(text: str, chars: str, at: int) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def parse_flags(text: str) -> ParsedFlags:
    """Split ``text`` into flags exactly as XLA's ``ParseArgvFromString`` does.

    A flag starts with ``-``; its name runs over letters, digits, ``-`` and ``_``.  Followed by ``=``
    and a quote, the value runs to the matching quote (removed; backslash escapes the next character
    in double quotes); otherwise the flag runs to the next space, tab or newline.  Reading stops at
    the first word that does not start with ``-``.
    """
    flags = []
    start = _skip(text, _WS, 0)
    while start < len(text) and text[start] == "-":
        at = start
        while at < len(text) and text[at] in _NAME_CHARS:
            at += 1
        if at + 1 < len(text) and text[at] == "=" and text[at + 1] in _QUOTES:
            equals, quote, at = at, text[at + 1], at + 2
            value = []
            while at < len(text) and text[at] != quote:
                if quote == '"' and text[at] == "\\" and at + 1 < len(text):
                    at += 1
                value.append(text[at])
                at += 1
            end = min(at + 1, len(text))                      # past the closing quote, if any
            flags.append(Flag(text[start:end], text[start:equals + 1] + "".join(value), start, end))
        else:
            end = at
            while end < len(text) and text[end] not in _WS:
                end += 1
            flags.append(Flag(text[start:end], text[start:end], start, end))
        start = _skip(text, _WS, end)
    return ParsedFlags(text, tuple(flags))


def format_flag(name: str, value: str) -> str:
    """``name=value`` as XLA reads it back: plain, or in double quotes when the value needs them."""
    if not any(c in _WS for c in value) and not value.startswith(tuple(_QUOTES)):
        return f"{name}={value}"
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{name}="{escaped}"'


def _insert(text: str, at: int, flags: list[str]) -> str:
    """``flags`` put into ``text`` at ``at``, separated by single spaces, nothing else changed."""
    before, after = text[:at], text[at:]
    joined = " ".join(flags)
    if before and before[-1] not in _WS:
        joined = " " + joined
    if after and after[0] not in _WS:
        joined += " "
    return before + joined + after


def _remove(text: str, flag: Flag) -> str:
    """``text`` without ``flag`` and one space beside it."""
    start, end = flag.start, flag.end
    if start > 0 and text[start - 1] in _WS:
        start -= 1
    elif end < len(text) and text[end] in _WS:
        end += 1
    return text[:start] + text[end:]


# --- tf_memsafe's prefix and the user's value -------------------------------------------------------

def _split_ours(value: str) -> tuple[str, str]:
    """``(tf_memsafe's prefix, the user's value)`` of an ``XLA_FLAGS`` value.

    The prefix is the reset flag, followed by :data:`DUMP_DEFAULTS` after a measurement (by the
    defaults of the code generation flags a measurement may change, inside one), and one separating
    whitespace character; the user's value is the rest, byte for byte.
    """
    for prefix in (f"{RESET_FLAG} {DUMP_DEFAULTS}", f"{RESET_FLAG} {_NAMED_DEFAULTS}", RESET_FLAG):
        if value.startswith(prefix) and (len(value) == len(prefix) or value[len(prefix)] in _WS):
            return prefix, value[len(prefix) + 1:]
    return "", value


def _join(prefix: str, users: str) -> str:
    return f"{prefix} {users}" if prefix and users else prefix or users


def user_value() -> str:
    """The user's part of ``XLA_FLAGS``, byte for byte: everything after tf_memsafe's prefix."""
    return _split_ours(os.environ.get(ENV, ""))[1]


def user_flags() -> list[str]:
    """The flags XLA reads from the user's part of ``XLA_FLAGS``, each exactly as written."""
    return [f.text for f in parse_flags(user_value()).flags]


def ensure_reset_flag() -> bool:
    """Put ``--xla_flags_reset=true`` first in ``XLA_FLAGS``; return whether it was added now.

    The user's value follows it byte for byte (a value naming a flags file: the file's text).  Only
    effective if XLA has not compiled anything yet in this process (it reads the variable once
    otherwise); :func:`tf_memsafe.memory_footprint` detects the late case and says so.
    """
    with flags_lock:
        value = os.environ.get(ENV, "")
        if _split_ours(value)[0]:
            return False
        if value.strip(_WS) and not value.lstrip(_WS).startswith("-"):   # XLA reads a file of flags
            try:
                with open(value, encoding="utf-8", errors="surrogateescape") as f:
                    value = f.read()
            except OSError:  # XLA stops the process at its first compile, as without tf_memsafe
                return False
            if "\0" in value:
                return False
        os.environ[ENV] = _join(RESET_FLAG, value)
        return True


def _with_flags_after_users(value: str | None, extra: list[str]) -> str:
    """The reset flag, XLA's defaults for the code generation flags a measurement may change, the
    user's flags (as written) and ``extra`` after them, so that ``extra`` wins.  (The defaults are
    named: XLA would otherwise keep what it read last, a fast measurement's level 0 or its emitters
    off, for the block's compiles; the user's own values, after them, win.)"""
    users = parse_flags(_split_ours(value or "")[1])
    read = users.text[:users.read_end].lstrip(_WS)
    return " ".join([RESET_FLAG, _NAMED_DEFAULTS, *([read] if read else []), *extra])


def _after_measurement(previous: str | None) -> str:
    """``XLA_FLAGS`` after a measurement: the reset flag, the dump flags' defaults, the user's value."""
    return _join(f"{RESET_FLAG} {DUMP_DEFAULTS}", _split_ours(previous or "")[1])


def _measurement_flags(folder: str, fast_codegen: bool = False, sizing_only: bool = False) -> list[str]:
    overrides = {"--xla_dump_to": folder, "--xla_dump_hlo_as_text": "true"}
    flags = [format_flag(name, overrides.get(name, default)) for name, default in _DUMP_FLAG_DEFAULTS]
    return (flags + ([format_flag(_CODEGEN_FLAG, _CODEGEN_FAST)] if fast_codegen else [])
            + ([format_flag(_EMITTERS_FLAG, _EMITTERS_SIZING)] if sizing_only else []))


_DUMP_RE = re.compile(r"tf_memsafe_(?:xla|run)_dump_(\d+)_")


# XLA:CPU dumps every kernel it generates beside the memory-usage report a measurement reads (its
# LLVM IR before and after optimization, its object file, its MLIR at three stages): about 900 files
# for a small Transformer's training step, written and deleted at every measurement.  No XLA flag
# drops them and keeps the report.  On a disk's file system creating them costs a fifth of the
# compile (ext4, measured: 3.3 s against 2.8 s on tmpfs, 2.8 s with no dump at all); in memory, next
# to nothing.  A RAM-backed directory is used where it has this much room, else the temp dir.
_RAM_ROOT = "/dev/shm"
_RAM_ROOT_MIN_FREE = 1 << 30


def dump_roots() -> list[str]:
    """Where private dump directories go, the first used: a RAM-backed directory with room
    (``/dev/shm`` on Linux, at least ``_RAM_ROOT_MIN_FREE`` bytes free and writable), then the temp dir."""
    roots = []
    try:
        if os.path.isdir(_RAM_ROOT) and os.access(_RAM_ROOT, os.W_OK | os.X_OK):
            stat = os.statvfs(_RAM_ROOT)
            if stat.f_bavail * stat.f_frsize >= _RAM_ROOT_MIN_FREE:
                roots.append(_RAM_ROOT)
    except OSError:
        pass
    return [*roots, tempfile.gettempdir()]


def _dump_dir(kind: str, in_memory: bool = True) -> str:
    """A fresh private dump directory named with this process's id, in the first of
    :func:`dump_roots` (``in_memory``) or the temp dir; stale ones of dead processes (killed while
    measuring, so they could not delete theirs) are removed first."""
    roots = dump_roots()
    for root in roots:
        remove_stale_dumps(root)
    return tempfile.mkdtemp(prefix=f"tf_memsafe_{kind}_dump_{os.getpid()}_", dir=roots[0] if in_memory else roots[-1])


def remove_stale_dumps(root: str | None = None) -> int:
    """Delete the dump directories in ``root`` (default: the temp dir) whose process no longer exists."""
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
def dump_for_one_compile(fast_codegen: bool = False, sizing_only: bool = False) -> Iterator[str]:
    """Make XLA dump the programs compiled inside the block into a fresh directory (yielded).

    Inside the block ``XLA_FLAGS`` holds the reset flag, the user's flags as written, then the
    measurement's dump flags (which win): the user's own dump directory and dump filters do not
    apply to the block's compiles.  With ``fast_codegen`` (for programs compiled to be measured and
    never run, on XLA:CPU) the block's code is generated at LLVM's level 0 as well; with
    ``sizing_only`` (a program whose figure is compared only with others measured so, on XLA:CPU)
    without XLA:CPU's fusion emitters too (see the module docstring).  After it,
    ``XLA_FLAGS`` holds the reset flag, :data:`DUMP_DEFAULTS` and the user's value byte for byte;
    the directory is deleted.
    """
    with flags_lock:
        previous = os.environ.get(ENV)
        folder = _dump_dir("xla")
        os.environ[ENV] = _with_flags_after_users(previous, _measurement_flags(folder, fast_codegen, sizing_only))
        try:
            yield folder
        finally:
            os.environ[ENV] = _after_measurement(previous)
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def dump_all_compiles(in_memory: bool = False) -> Iterator[str]:
    """Make XLA dump every program compiled inside the block; yields the directory.

    The user's own ``--xla_dump_to`` is kept and yielded, with the user's other dump settings
    (``--xla_dump_hlo_as_text`` is added unless the user set it; nothing is deleted there);
    otherwise a private temporary directory is used, with the measurement's dump flags, and
    deleted afterwards.  ``XLA_FLAGS`` afterwards is as after :func:`dump_for_one_compile`.

    ``in_memory``: the private directory goes where a measurement's goes (:func:`dump_roots`: in
    memory where there is room), for a block of a few compiles (a test's or a benchmark's run).
    Otherwise it goes to the temp dir: the command line's block is the whole script, which may compile
    many programs, each dumped as about a thousand files on XLA:CPU, kept until the script ends; in
    memory they would take from the memory the script's programs are fitted to.
    """
    with flags_lock:
        previous = os.environ.get(ENV)
        users = parse_flags(_split_ours(previous or "")[1]).flags
        dump_to = [f.value for f in users if f.name == "--xla_dump_to"]
        own = dump_to[-1] if dump_to else None   # XLA keeps the last value of a flag given twice
        if own:
            folder = own
            extra = [] if "--xla_dump_hlo_as_text" in {f.name for f in users} else ["--xla_dump_hlo_as_text"]
        else:
            folder = _dump_dir("run", in_memory)
            extra = _measurement_flags(folder)
        os.environ[ENV] = _with_flags_after_users(previous, extra)
    try:
        yield folder
    finally:
        with flags_lock:
            os.environ[ENV] = _after_measurement(previous)
        if not own:
            shutil.rmtree(folder, ignore_errors=True)


_MODULE_RE = re.compile(r"^module_(\d+)\.(.+?)\.\S*after_optimizations-memory-usage-report\.txt$")
_TOTAL_RE = re.compile(r"^Total bytes used:\s*(\d+)", re.MULTILINE)


def _dumped(folder: str, pattern: re.Pattern, read) -> list[tuple[str, object]]:
    """``(module name, read(text))`` of every file in ``folder`` whose name ``pattern`` matches (its
    groups: the module's number and name), in compile order; a file ``read`` gives ``None`` is left out."""
    found = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        m = pattern.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                value = read(f.read())
        except OSError:
            continue
        if value is not None:
            found.append((int(m.group(1)), m.group(2), value))
    return [(module, value) for _, module, value in sorted(found)]


def memory_reports(folder: str) -> list[tuple[str, int]]:
    """``(module name, "Total bytes used")`` of every memory-usage report in ``folder``, in compile order."""
    def total(text: str) -> int | None:
        m = _TOTAL_RE.search(text)
        return int(m.group(1)) if m else None

    return _dumped(folder, _MODULE_RE, total)


_ASSIGNMENT_RE = re.compile(r"^module_(\d+)\.(.+?)\.\S*after_optimizations-buffer-assignment\.txt$")
_ALLOCATION_RE = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.MULTILINE)


def buffer_assignments(folder: str) -> list[tuple[str, str]]:
    """``(module name, text)`` of every buffer assignment dumped in ``folder`` (after optimisations),
    in compile order."""
    return _dumped(folder, _ASSIGNMENT_RE, lambda text: text)


def allocated_reports(folder: str) -> list[tuple[str, int]]:
    """``(module name, bytes)`` of every buffer assignment in ``folder``, in compile order: what the
    program allocates itself -- its outputs, temporaries and constants -- not counting the parameters
    it is handed (which "Total bytes used" includes)."""
    return [(module, sum(int(size) for size, kind in _ALLOCATION_RE.findall(text) if not kind.startswith("parameter")))
            for module, text in buffer_assignments(folder)]


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
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)


def _named_unknown(stderr: str, pending: list[str]) -> set[str]:
    """The flags of ``pending`` that XLA's "Unknown flags in XLA_FLAGS: ..." line names (as it read them)."""
    unknown = _UNKNOWN_RE.search(stderr)
    if not unknown:
        return set()
    listed = f" {unknown.group(1)} "
    return {f for f in pending if f" {parse_flags(f).flags[0].argv} " in listed}


def _probe_all(flags: list[str]) -> dict[str, str | None]:
    """Each flag mapped to ``None`` (accepted) or the reason this build rejects it."""
    results: dict[str, str | None] = {}
    pending = list(flags)
    while pending:
        done = _probe(pending)
        if done.returncode == 0 and done.stdout.strip().endswith("ok"):
            results.update(dict.fromkeys(pending))
            break
        named = _named_unknown(done.stderr, pending)
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


def _is_one_xla_flag(flag: str) -> bool:
    parsed = parse_flags(flag).flags
    return len(parsed) == 1 and parsed[0].text == flag and flag.startswith("--xla_")


def validate(flags: Iterable[str]) -> dict[str, str | None]:
    """Which of ``flags`` this TensorFlow build's XLA accepts, decided in a child process.

    Each flag is written as in ``XLA_FLAGS`` (a value with spaces in double quotes).  Returns each
    flag mapped to ``None`` if accepted, else a one-line reason.  Flags are judged with their values
    (``--xla_foo=banana`` may be rejected where ``--xla_foo=true`` is not).  Nothing is set in this
    process.
    """
    flags = [str(f) for f in flags]
    for flag in flags:
        if not _is_one_xla_flag(flag):
            raise InvalidFlagError(f"{flag!r} is not one XLA flag: XLA flags look like --xla_<name>[=<value>], "
                                   'a value with spaces in double quotes (--xla_dump_to="/my dumps")')
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
    the user's values win.  The added flags go right after the last flag XLA reads from the user's
    value (where XLA reads them too); nothing else in the value changes.  With the reset flag first
    in ``XLA_FLAGS`` (tf_memsafe's import puts it there), XLA picks them up at its next compile.
    """
    flags = list(flags)
    check(flags)
    with flags_lock:
        prefix, users = _split_ours(os.environ.get(ENV, ""))
        parsed = parse_flags(users)
        present = {f.name for f in parsed.flags}
        added = [f for f in flags if parse_flags(f).flags[0].name not in present]
        if added:
            os.environ[ENV] = _join(prefix, _insert(users, parsed.read_end, added))
            _ours.update(parse_flags(f).flags[0].name for f in added)
        return added


def unset_flags(names: Iterable[str]) -> None:
    """Remove the flags named ``names`` that :func:`set_flags` added; the user's are never touched."""
    with flags_lock:
        drop = {n.split("=", 1)[0] for n in names} & _ours
        if not drop:
            return
        prefix, users = _split_ours(os.environ.get(ENV, ""))
        for flag in reversed(parse_flags(users).flags):
            if flag.name in drop:
                users = _remove(users, flag)
        os.environ[ENV] = _join(prefix, users)
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
