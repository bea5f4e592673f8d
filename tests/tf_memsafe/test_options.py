"""Options: the frozen dataclass, enable()/disable(), and thread-local nestable scopes."""

import dataclasses
import threading

import pytest

import tf_memsafe
from tf_memsafe.config import Options, make_options


class TestOptionsDataclass:
    def test_defaults(self):
        opts = Options()
        assert opts.memory_limit_bytes is None and opts.memory_limit_fraction == 0.8
        assert opts.disabled_passes == frozenset()
        assert not opts.rewrite_non_jit and not opts.strict

    def test_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            Options().strict = True

    def test_limit_forms_are_exclusive(self):
        opts = make_options(memory_limit="4GB")
        assert (opts.memory_limit_bytes, opts.memory_limit_fraction) == (4 * 10**9, None)
        opts = make_options(opts, memory_limit="50%")
        assert (opts.memory_limit_bytes, opts.memory_limit_fraction) == (None, 0.5)
        opts = make_options(opts, memory_limit_bytes=123)
        assert (opts.memory_limit_bytes, opts.memory_limit_fraction) == (123, None)
        assert opts.resolve_memory_limit_bytes(10**12) == 123
        assert make_options(memory_limit="50%").resolve_memory_limit_bytes(1000) == 500

    @pytest.mark.parametrize("kwargs, error", [
        (dict(memory_limit="4 gigs"), ValueError),
        (dict(memory_limit_bytes=0), ValueError),
        (dict(memory_limit_bytes=True), ValueError),
        (dict(memory_limit_fraction=1.5), ValueError),
        (dict(max_fixed_point_iterations=0), ValueError),
        (dict(memory_limit="1GB", memory_limit_bytes=5), TypeError),
        (dict(no_such_option=1), TypeError),
        (dict(disabled_passes=3), TypeError),
    ])
    def test_bad_values(self, kwargs, error):
        with pytest.raises(error):
            make_options(**kwargs)

    def test_disabled_passes_accepts_a_name_or_names(self):
        assert make_options(disabled_passes="a").disabled_passes == frozenset({"a"})
        assert make_options(disabled_passes=["a", "b", "a"]).disabled_passes == frozenset({"a", "b"})


class TestEnable:
    def test_enable_sets_global_options_and_disable_restores_defaults(self):
        assert not tf_memsafe.is_enabled()
        opts = tf_memsafe.enable("1GB", strict=True)
        assert tf_memsafe.is_enabled()
        assert opts.memory_limit_bytes == 10**9 and opts.strict
        assert tf_memsafe.get_options().memory_limit_bytes == 10**9
        tf_memsafe.disable()
        assert not tf_memsafe.is_enabled()
        assert tf_memsafe.get_options().memory_limit_bytes is None

    def test_bad_limit_names_accepted_forms_and_changes_nothing(self):
        with pytest.raises(ValueError, match="GiB"):
            tf_memsafe.enable("4 gigs")
        assert not tf_memsafe.is_enabled()

    def test_enable_twice_replaces_options(self):
        tf_memsafe.enable("1GB")
        tf_memsafe.enable("2GB")
        assert tf_memsafe.get_options().memory_limit_bytes == 2 * 10**9
        assert tf_memsafe.is_enabled()


class TestScopes:
    def test_nesting_and_restore(self):
        tf_memsafe.enable("1GB")
        with tf_memsafe.options(memory_limit="2GB") as outer:
            assert outer.memory_limit_bytes == 2 * 10**9
            with tf_memsafe.options(strict=True, memory_limit="50%"):
                inner = tf_memsafe.get_options()
                assert inner.strict and inner.memory_limit_fraction == 0.5 and inner.memory_limit_bytes is None
            assert tf_memsafe.get_options() == outer
        assert tf_memsafe.get_options().memory_limit_bytes == 10**9

    def test_restored_after_exception(self):
        before = tf_memsafe.get_options()
        with pytest.raises(KeyError):
            with tf_memsafe.options(strict=True):
                raise KeyError("x")
        assert tf_memsafe.get_options() == before

    def test_bad_option_raises_at_the_with_line(self):
        before = tf_memsafe.get_options()
        with pytest.raises(ValueError):
            with tf_memsafe.options(memory_limit=-1):
                pytest.fail("body must not run")
        assert tf_memsafe.get_options() == before

    def test_scopes_are_thread_local(self):
        seen = {}
        entered, release = threading.Event(), threading.Event()

        def other_thread():
            entered.wait(5)
            seen["other"] = tf_memsafe.get_options().strict
            release.set()

        t = threading.Thread(target=other_thread)
        t.start()
        with tf_memsafe.options(strict=True):
            entered.set()
            release.wait(5)
            seen["this"] = tf_memsafe.get_options().strict
        t.join(5)
        assert seen == {"this": True, "other": False}

    def test_threads_see_global_enable(self):
        tf_memsafe.enable("3GB")
        out = []
        t = threading.Thread(target=lambda: out.append(tf_memsafe.get_options().memory_limit_bytes))
        t.start()
        t.join(5)
        assert out == [3 * 10**9]
