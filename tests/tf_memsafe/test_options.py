"""Options: the frozen dataclass, enable()/disable(), and thread-local nestable scopes."""

import dataclasses
import gc
import pathlib
import threading

import numpy as np
import pytest

import tf_memsafe
from grappler_ext import pipeline
from grappler_ext.pass_base import GraphPass, PassResult, ShardedAxis
from tf_memsafe import config
from tf_memsafe.config import Options, describe_unknown_passes, known_pass_names, make_options


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
        (dict(memory_limit_bytes=True), TypeError),
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
        assert make_options(disabled_passes="splitter").disabled_passes == frozenset({"splitter"})
        assert make_options(disabled_passes=["splitter", "matrix_chain", "splitter"]).disabled_passes == frozenset(
            {"splitter", "matrix_chain"})
        assert Options(disabled_passes=["splitter"]).disabled_passes == frozenset({"splitter"})

    def test_xla_compiled_is_read_from_each_trace_never_given(self):
        # Whether XLA compiles a trace is the hook's to set (random_key builds XLA's form), not an option.
        with pytest.raises(TypeError, match="xla_compiled is not an option"):
            make_options(xla_compiled=False)
        with pytest.raises(TypeError, match="xla_compiled is not an option"):
            tf_memsafe.enable("1GB", xla_compiled=False)
        assert not tf_memsafe.is_enabled()
        assert make_options(xla_compiled=True).xla_compiled      # given back field by field: the default
        assert not dataclasses.replace(Options(), xla_compiled=False).xla_compiled

    def test_sharded_inputs_are_read_from_each_call_never_given(self):
        # The axes a DTensor mesh shards are the hook's to set per trace (dtensor_inputs), not an option.
        sharded = (ShardedAxis("x", 0, "b"),)
        with pytest.raises(TypeError, match="sharded_inputs is not an option"):
            make_options(sharded_inputs=sharded)
        with pytest.raises(TypeError, match="sharded_inputs is not an option"):
            tf_memsafe.enable("1GB", sharded_inputs=sharded)
        assert not tf_memsafe.is_enabled()
        # Options given back field by field (an experiment restoring the caller's) hold the empty default.
        assert make_options(sharded_inputs=()).sharded_inputs == ()
        assert dataclasses.replace(Options(), sharded_inputs=sharded).sharded_inputs == sharded
        with pytest.raises(TypeError, match="sharded_inputs"):
            Options(sharded_inputs=[("x", 0, "b")])


# Issue 27, item 5: each bad value, the field its message must name, and words of what is accepted.
BAD_VALUES = [
    (dict(disabled_passes=["spliter"]), ValueError, "disabled_passes", ["'spliter'", "did you mean 'splitter'",
                                                                        "known passes: ", "matrix_chain"]),
    (dict(disabled_passes=[1]), TypeError, "disabled_passes", ["[1]", "pass name"]),
    (dict(disabled_passes=3), TypeError, "disabled_passes", ["got 3", "pass name"]),
    (dict(strict="no"), TypeError, "strict", ["'no'", "True or False"]),
    (dict(verify=None), TypeError, "verify", ["None", "True or False"]),
    (dict(verify=1), TypeError, "verify", ["got 1", "True or False"]),
    (dict(redraw_random="yes"), TypeError, "redraw_random", ["'yes'", "True or False"]),
    (dict(dump_dir=123), TypeError, "dump_dir", ["123", "None or a folder path"]),
    (dict(dump_dir=""), ValueError, "dump_dir", ["''", "None turns the dumps off"]),
    (dict(max_fixed_point_iterations=True), TypeError, "max_fixed_point_iterations", ["True", "an int >= 1"]),
    (dict(max_fixed_point_iterations=2.0), TypeError, "max_fixed_point_iterations", ["2.0", "an int >= 1"]),
    (dict(max_fixed_point_iterations=0), ValueError, "max_fixed_point_iterations", ["got 0", "an int >= 1"]),
    (dict(memory_limit_bytes="8MB"), TypeError, "memory_limit_bytes", ["'8MB'", "int > 0", "memory_limit='8MB'"]),
    (dict(memory_limit_bytes=True), TypeError, "memory_limit_bytes", ["True", "int > 0"]),
    (dict(memory_limit_bytes=-5), ValueError, "memory_limit_bytes", ["-5", "int > 0"]),
    (dict(memory_limit_fraction="80%"), TypeError, "memory_limit_fraction", ["'80%'", "(0, 1]", "memory_limit='80%'"]),
    (dict(memory_limit_fraction=float("nan")), ValueError, "memory_limit_fraction", ["nan", "(0, 1]"]),
]
BAD_IDS = [f"{next(iter(kw))}={next(iter(kw.values()))!r}" for kw, *_ in BAD_VALUES]


class TestBadValuesAreRefusedWhereTheOptionsAreMade:
    """A bad value raises when the options are made, naming the field, the value and what it accepts."""

    @pytest.mark.parametrize("kwargs, error, field, words", BAD_VALUES, ids=BAD_IDS)
    def test_make_options(self, kwargs, error, field, words):
        with pytest.raises(error) as info:
            make_options(**kwargs)
        message = str(info.value)
        assert message.startswith(field) and "\n" not in message
        for word in words:
            assert word in message

    @pytest.mark.parametrize("kwargs, error, field, words", BAD_VALUES, ids=BAD_IDS)
    def test_options_dataclass(self, kwargs, error, field, words):
        if "memory_limit_bytes" in kwargs:  # the dataclass has no memory_limit: give one limit field only
            kwargs = {**kwargs, "memory_limit_fraction": None}
        with pytest.raises(error, match=f"^{field}"):
            Options(**kwargs)

    @pytest.mark.parametrize("kwargs, error, field, words", BAD_VALUES, ids=BAD_IDS)
    def test_options_scope_raises_at_the_with_line(self, kwargs, error, field, words):
        before = tf_memsafe.get_options()
        with pytest.raises(error, match=f"^{field}"):
            with tf_memsafe.options(**kwargs):
                pytest.fail("body must not run")
        assert tf_memsafe.get_options() == before

    @pytest.mark.parametrize("kwargs, error, field, words", [c for c in BAD_VALUES if "limit" not in c[2]],
                             ids=[i for c, i in zip(BAD_VALUES, BAD_IDS) if "limit" not in c[2]])
    def test_enable_raises_and_enables_nothing(self, kwargs, error, field, words):
        before = tf_memsafe.get_options()
        with pytest.raises(error, match=f"^{field}"):
            tf_memsafe.enable("8MB", **kwargs)
        assert not tf_memsafe.is_enabled()
        assert tf_memsafe.get_options() == before

    def test_a_limit_field_beside_memory_limit_names_both(self):
        with pytest.raises(TypeError, match="not both") as info:
            tf_memsafe.enable(memory_limit_bytes="8MB")
        assert "memory_limit='80%'" in str(info.value) and "memory_limit_bytes='8MB'" in str(info.value)
        assert not tf_memsafe.is_enabled()

    def test_every_field_is_checked(self):
        """A field added to Options or PassOptions without a check fails here."""
        for field in dataclasses.fields(Options):
            with pytest.raises(TypeError, match=f"^{field.name} must be"):
                Options(**{field.name: object()})

    def test_unknown_passes_are_all_named(self):
        with pytest.raises(ValueError, match="unknown passes 'nope', 'spliter'"):
            make_options(disabled_passes=["splitter", "spliter", "nope"])


class TestGoodValues:
    def test_every_product_pass_can_be_disabled(self):
        assert make_options(disabled_passes=pipeline.DEFAULT_ORDER).disabled_passes == frozenset(
            pipeline.DEFAULT_ORDER)
        opts = tf_memsafe.enable("8MB", disabled_passes=["splitter"], strict=False, verify=True,
                                 max_fixed_point_iterations=1, dump_dir=None)
        assert opts.disabled_passes == frozenset({"splitter"}) and opts.verify and opts.memory_limit_bytes == 8 * 10**6

    def test_numbers_and_paths_are_kept_as_the_field_types(self, tmp_path):
        opts = make_options(memory_limit_bytes=np.int64(5), max_fixed_point_iterations=np.int32(2),
                            dump_dir=tmp_path)
        assert opts.memory_limit_bytes == 5 and type(opts.memory_limit_bytes) is int
        assert opts.max_fixed_point_iterations == 2 and type(opts.max_fixed_point_iterations) is int
        assert opts.dump_dir == str(tmp_path) and isinstance(pathlib.Path(opts.dump_dir), pathlib.Path)
        opts = make_options(memory_limit_fraction=np.float32(0.5))
        assert opts.memory_limit_fraction == 0.5 and type(opts.memory_limit_fraction) is float

    @pytest.fixture(autouse=True)
    def _forget_test_names(self, monkeypatch):
        """The names these tests make known stay known only for the test."""
        monkeypatch.setattr(config, "_known_passes", set(config._known_passes))

    def test_a_registered_pass_is_known(self, monkeypatch):
        assert describe_unknown_passes(["plugin_pass"]) is not None
        monkeypatch.setitem(pipeline._REGISTRY, "plugin_pass", GraphPass)
        assert "plugin_pass" in known_pass_names()
        assert make_options(disabled_passes=["plugin_pass"]).disabled_passes == frozenset({"plugin_pass"})

    def test_an_unregistered_pass_class_is_known_and_stays_known(self):
        """A Pipeline runs unregistered passes (a test's, a user's); once accepted, a name stays accepted
        (a scope is re-applied at every trace)."""

        def define():
            class LocalPass(GraphPass):
                name = "local_options_test_pass"

                def run(self, graph, options):
                    return PassResult(self.name)

            return LocalPass

        local = define()                   # held until the name is accepted (a collection could run any time)
        with tf_memsafe.options(disabled_passes=["local_options_test_pass"]):
            del local
            gc.collect()  # the class is gone
            assert tf_memsafe.get_options().disabled_passes == frozenset({"local_options_test_pass"})
        assert make_options(disabled_passes=["local_options_test_pass"])


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
