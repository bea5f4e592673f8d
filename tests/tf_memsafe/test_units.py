"""The memory-limit parser: every unit pinned, property tests over spellings, every bad form refused."""

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tf_memsafe.units import ACCEPTED_FORMS, MemoryLimit, format_bytes, parse_memory_limit

UNITS = {
    "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50,
}


class TestExamples:
    @pytest.mark.parametrize("text, expected", [
        ("4GB", 4_000_000_000),
        ("512MB", 512_000_000),
        ("1.5GiB", 1_610_612_736),   # eXLA read GiB as 2**27: 201,326,592 would be the bug
        ("256MiB", 268_435_456),
        ("100kB", 100_000),
        ("256 MiB", 268_435_456),
        ("  2 gib ", 2 * 2**30),
        ("4gb", 4_000_000_000),
        ("0.1GB", 100_000_000),      # exact decimal arithmetic, no float rounding
        ("7", 7),
        ("7B", 7),
        (".5KiB", 512),
    ])
    def test_strings(self, text, expected):
        assert parse_memory_limit(text) == MemoryLimit(bytes=expected)

    def test_numbers(self):
        assert parse_memory_limit(4_000_000_000).bytes == 4_000_000_000
        assert parse_memory_limit(4e9).bytes == 4_000_000_000
        assert parse_memory_limit(1).bytes == 1

    @pytest.mark.parametrize("text, fraction", [("80%", 0.8), (" 50 % ", 0.5), ("100%", 1.0), ("0.5%", 0.005)])
    def test_percentages(self, text, fraction):
        limit = parse_memory_limit(text)
        assert limit.bytes is None and limit.fraction == pytest.approx(fraction)
        assert limit.resolve(1000) == int(fraction * 1000)

    @pytest.mark.parametrize("bad", [
        "4 gigs", -1, 0, "GB", float("nan"), True, False, "", " ", "-4GB", "4GBB", "4 G", "1e3GB",
        "0%", "101%", "%", "0B", "0.4B", float("inf"), 0.5, -2.0, None, [4], b"4GB", "4,000MB",
    ])
    def test_rejected_with_accepted_forms(self, bad):
        with pytest.raises(ValueError) as info:
            parse_memory_limit(bad)
        assert ACCEPTED_FORMS in str(info.value)
        assert repr(bad) in str(info.value)


@st.composite
def random_case(draw, text):
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if f else c.lower() for c, f in zip(text, flips))


class TestProperties:
    @given(n=st.integers(min_value=1, max_value=10**6), unit=st.sampled_from(sorted(UNITS)),
           data=st.data(), spaces=st.tuples(*[st.sampled_from(["", " ", "  "])] * 3))
    def test_integer_amounts_any_case_any_spacing(self, n, unit, data, spaces):
        text = f"{spaces[0]}{n}{spaces[1]}{data.draw(random_case(unit))}{spaces[2]}"
        assert parse_memory_limit(text).bytes == n * UNITS[unit]

    @given(whole=st.integers(min_value=0, max_value=9999), frac=st.text("0123456789", min_size=1, max_size=4),
           unit=st.sampled_from(sorted(UNITS)))
    def test_decimal_amounts_round_down_exactly(self, whole, frac, unit):
        exact = Fraction(Decimal(f"{whole}.{frac}")) * UNITS[unit]
        text = f"{whole}.{frac}{unit}"
        if exact < 1:
            with pytest.raises(ValueError):
                parse_memory_limit(text)
        else:
            assert parse_memory_limit(text).bytes == math.floor(exact)

    @given(st.text(max_size=12))
    def test_arbitrary_text_parses_or_raises_value_error(self, text):
        try:
            limit = parse_memory_limit(text)
        except ValueError:
            return
        assert (limit.bytes is not None and limit.bytes >= 1) or 0 < limit.fraction <= 1

    @given(st.integers(min_value=1, max_value=2**62))
    def test_integers_are_bytes(self, n):
        assert parse_memory_limit(n).bytes == n


def test_memory_limit_needs_exactly_one_form():
    with pytest.raises(ValueError):
        MemoryLimit()
    with pytest.raises(ValueError):
        MemoryLimit(bytes=1, fraction=0.5)


@pytest.mark.parametrize("n, text", [(None, "?"), (0, "0 B"), (812, "812 B"), (1024, "1 KiB"),
                                     (1600016, "1.53 MiB"), (2405016028, "2.24 GiB"), (-2048, "-2 KiB"),
                                     (1010 * 2**20, "1010 MiB"), (1023.6 * 2**10, "1024 KiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
