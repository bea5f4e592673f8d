"""The experiments' shared timing: methods take turns, failures are results, time caps the calls."""

import time

import pytest

from experiments import _methods


def test_methods_take_turns_and_a_failure_is_returned_not_raised():
    log = []

    def method(name, fail_on=None):
        def call():
            log.append(name)
            if len([x for x in log if x == name]) == fail_on:
                raise RuntimeError(f"{name} broke")
            return name.upper()
        return call

    out = _methods.time_interleaved({"a": method("a"), "b": method("b", fail_on=3), "c": method("c")}, repeats=3)
    # Warm-ups first, then rounds of one call each, each round starting one method further on;
    # b fails on its second timed call and sits out after.
    assert log == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a"]
    assert isinstance(out["b"], RuntimeError) and str(out["b"]) == "b broke"
    for name in ("a", "c"):
        seconds, first, result = out[name]
        assert seconds >= 0 and first >= 0 and result == name.upper()


def test_a_method_whose_calls_took_enough_time_sits_out():
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.05)

    def fast():
        calls["fast"] += 1

    _methods.time_interleaved({"slow": slow, "fast": fast}, repeats=5, enough_s=0.08)
    assert calls == {"slow": 1 + 2, "fast": 1 + 5}       # the warm-up, then until 0.08 s (two sleeps)


def test_the_fastest_timed_call_is_kept():
    delays = iter([0.0, 0.2, 0.01, 0.2])          # the warm-up, then three timed calls

    def call():
        time.sleep(next(delays))
        return "done"

    seconds, first, result = _methods.time_calls(call, repeats=3, enough_s=10.0)
    # A slow spell (0.2 s) only ever adds time: the estimate is the 0.01 s call, not the median 0.2 s.
    assert 0.01 <= seconds < 0.1 and first < 0.1 and result == "done"


def test_time_calls_raises_what_its_call_raises():
    def broken():
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        _methods.time_calls(broken, repeats=2)
    seconds, first, result = _methods.time_calls(lambda: 7, repeats=2)
    assert result == 7 and seconds >= 0 and first >= 0
