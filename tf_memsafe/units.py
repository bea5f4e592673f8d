"""Memory sizes as users write them, parsed once at the edge.

``parse_memory_limit`` accepts

* a positive integer number of bytes (``4_000_000_000``), or a positive finite float that is a whole
  number of bytes (``4e9``);
* a string ``"<number><unit>"`` (spaces allowed around and between, unit suffix case-insensitive):
  decimal units are powers of ten (``B``, ``kB``, ``MB``, ``GB``, ``TB``, ``PB``), binary units are
  powers of two (``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``); a bare number string means bytes;
* a percentage of the device's memory, ``"80%"`` (``0 < p <= 100``), resolved later against the
  memory of the device the function runs on.

Fractional results are rounded down to whole bytes: ``"1.5GiB"`` is 1,610,612,736 bytes exactly
(eXLA's parser read ``GiB`` as 2**27; the tests pin every unit).  Anything else -- ``"4 gigs"``,
``-1``, ``0``, ``"GB"``, ``nan``, ``True`` -- raises ``ValueError`` listing the accepted forms.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

__all__ = ["MemoryLimit", "parse_memory_limit", "format_bytes", "ACCEPTED_FORMS"]

_DECIMAL = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_UNITS = {**_DECIMAL, **_BINARY}

# A number (no sign, no exponent: "1e3GB" is more likely a typo than an intent) and an optional unit.
_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*%\s*$")

ACCEPTED_FORMS = (
    "a positive number of bytes (4000000000); a string with a decimal unit (B, kB, MB, GB, TB, PB: "
    "powers of 10) or a binary unit (KiB, MiB, GiB, TiB, PiB: powers of 2), e.g. '4GB', '512MB', "
    "'1.5GiB', '256 MiB', '100kB'; or a percentage of the device's memory, e.g. '80%'"
)


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """A parsed memory limit: an absolute number of bytes, or a fraction of a device's memory."""

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self):
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("MemoryLimit needs exactly one of bytes and fraction")

    def resolve(self, device_memory_bytes: int) -> int:
        """The limit in bytes for a device that has ``device_memory_bytes`` of memory."""
        if self.bytes is not None:
            return self.bytes
        return max(1, int(self.fraction * device_memory_bytes))

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{self.fraction * 100:g}% of device memory"


def _reject(value) -> ValueError:
    return ValueError(f"invalid memory limit {value!r}: expected {ACCEPTED_FORMS}")


def parse_memory_limit(value) -> MemoryLimit:
    """Parse a user's memory limit (see the module docstring); raise ``ValueError`` otherwise."""
    if isinstance(value, MemoryLimit):
        return value
    # bool is an int subclass: True is not "1 byte".
    if isinstance(value, bool):
        raise _reject(value)
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise _reject(value)
        return MemoryLimit(bytes=int(value))
    if isinstance(value, numbers.Real):
        value_f = float(value)
        if not math.isfinite(value_f) or value_f < 1 or value_f != math.floor(value_f):
            raise _reject(value)
        return MemoryLimit(bytes=int(value_f))
    if not isinstance(value, str):
        raise _reject(value)

    percent = _PERCENT_RE.match(value)
    if percent:
        p = float(percent.group("num"))
        if not 0 < p <= 100:
            raise _reject(value)
        return MemoryLimit(fraction=p / 100)

    size = _SIZE_RE.match(value)
    if not size:
        raise _reject(value)
    unit = size.group("unit").lower() or "b"
    if unit not in _UNITS:
        raise _reject(value)
    # Exact arithmetic on the decimal digits: float(1.5) * 2**30 is exact, but 0.1 * 10**9 is not.
    whole, _, frac = size.group("num").partition(".")
    numerator = int((whole or "0") + frac)
    n_bytes = numerator * _UNITS[unit] // 10 ** len(frac)
    if n_bytes < 1:
        raise _reject(value)
    return MemoryLimit(bytes=n_bytes)


def format_bytes(n: int | float | None) -> str:
    """Bytes for people: binary units, three significant digits (``1.49 GiB``, ``1010 MiB``, ``812 B``)."""
    if n is None:
        return "?"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale  # in [1, 1024): three significant digits, never an exponent
            return f"{sign}{value:.0f} {unit}" if value >= 100 else f"{sign}{value:.3g} {unit}"
    return f"{sign}{int(n)} B"
