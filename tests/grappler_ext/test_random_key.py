"""random_key: a stateless draw's key and counter made by a 4-word Philox draw, bit for bit the same.

Bytes and work, worked out: the key and counter are 24 bytes either way; what changes is where XLA
computes them.  ``StatelessRandomGetKeyCounter`` lowers to ~300 scalar instructions that XLA:CPU fuses into
the loop generating the bits, once per element (a [8, 8, 108, 512] dropout mask: 829 ms; with the key
made by a separate [4] draw, 9.6 ms: ``experiments/random_key.py``).  The values drawn do not change.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import random_key
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import format_graph
from grappler_ext.random_key import RandomKey, philox_key_counter
from tf_memsafe import hook

SEEDS = [(0, 0), (1, 2), (-1, -7), (2 ** 31 - 1, -2 ** 31), (123456789, 987654321)]
LARGE = [(2 ** 62 + 5, -(2 ** 63)), (-1, 2 ** 40)]


def records(action=None):
    return [r for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "random_key" and (action is None or r.action == action)]


def rewritten_graph(fn, *specs, jit=True):
    """``fn`` traced with the pass alone (``jit``: for XLA, else for TensorFlow's kernels)."""
    tf_memsafe.enable("1GB", strict=True, rewrite_non_jit=not jit)
    try:
        with hook.use_pipeline(Pipeline([RandomKey()])):
            return tf.function(fn, jit_compile=jit).get_concrete_function(*specs).graph
    finally:
        tf_memsafe.disable()


def run_both(fn, *args):
    """``fn(*args)`` as traced and as rewritten (a fresh trace each), as NumPy arrays."""
    def call(f):
        return tf.nest.map_structure(lambda t: t.numpy(), f(*args))

    expected = call(tf.function(fn, jit_compile=True))
    tf_memsafe.enable("1GB", strict=True)
    try:
        with hook.use_pipeline(Pipeline([RandomKey()])):
            got = call(tf.function(fn, jit_compile=True))
    finally:
        tf_memsafe.disable()
    return got, expected


class TestKeyCounter:
    """The rule alone: ``philox_key_counter`` is ``StatelessRandomGetKeyCounter`` where the algorithm is Philox."""

    @pytest.mark.parametrize("dtype, seeds", [(tf.int32, SEEDS), (tf.int64, SEEDS + LARGE)])
    def test_equal_to_the_op_under_xla(self, dtype, seeds):
        def both(seed):
            key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
            return (key, counter), philox_key_counter(seed)

        f = tf.function(both, jit_compile=True)
        for seed in seeds:
            (key, counter), (k, c) = f(tf.constant(seed, dtype))
            np.testing.assert_array_equal(k.numpy(), key.numpy(), err_msg=f"key of seed {seed}")
            np.testing.assert_array_equal(c.numpy(), counter.numpy(), err_msg=f"counter of seed {seed}")

    def test_xla_reads_a_seed_by_its_low_words(self):
        """Why the form is XLA's own: a negative seed keys other draws with XLA and without it."""
        seed = tf.constant([-1, -7], tf.int64)
        xla = tf.function(lambda s: tf.raw_ops.StatelessRandomGetKeyCounter(seed=s), jit_compile=True)(seed)
        kernels = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
        assert xla[0].numpy() != kernels[0].numpy()
        low = tf.constant([2 ** 32 - 1, 2 ** 32 - 7], tf.int64)
        np.testing.assert_array_equal(philox_key_counter(seed)[0], philox_key_counter(low)[0])

    def test_shapes_and_dtypes(self):
        key, counter = philox_key_counter(tf.constant([3, 4], tf.int64))
        assert (key.dtype, key.shape, counter.dtype, counter.shape) == (tf.uint64, [1], tf.uint64, [2])


@pytest.mark.parametrize("draw", ["uniform", "normal", "truncated_normal", "uniform_int", "full_int"])
def test_every_default_draw_bit_identical(draw):
    make = {"uniform": lambda s: tf.random.stateless_uniform([3, 50], s),
            "normal": lambda s: tf.random.stateless_normal([3, 50], s, dtype=tf.float64),
            "truncated_normal": lambda s: tf.random.stateless_truncated_normal([3, 50], s),
            "uniform_int": lambda s: tf.random.stateless_uniform([3, 50], s, minval=-5, maxval=9, dtype=tf.int32),
            "full_int": lambda s: tf.random.stateless_uniform([3, 50], s, minval=None, maxval=None,
                                                              dtype=tf.int64)}[draw]
    seed = tf.constant([17, -3], tf.int32)   # negative: XLA reads its low words
    got, expected = run_both(make, seed)
    np.testing.assert_array_equal(got, expected)
    assert len(records("rewritten")) >= 1


def test_the_key_op_is_gone_and_the_draw_reads_the_philox_words():
    graph = rewritten_graph(lambda s: tf.random.stateless_uniform([64, 64], s), tf.TensorSpec([2], tf.int64))
    live = [op for op in graph.get_operations() if op.type == "StatelessRandomGetKeyCounter"
            and any(c for t in op.outputs for c in t.consumers())]
    assert not live, format_graph(graph)
    draw = next(op for op in graph.get_operations() if op.type == "StatelessRandomUniformV2")
    assert draw.inputs[1].op.name.startswith("tf_memsafe/random_key/")
    (rec,) = records("rewritten")
    assert "`StatelessRandomUniformV2`" in rec.reason and "4-word Philox draw" in rec.reason


@pytest.mark.parametrize("keras", [2, 3])
def test_keras_dropout_in_training_bit_identical(keras):
    """Keras 3's ``Dropout`` draws with ``auto_select``: the same layer, the same seed, the same masks.
    tf_keras' draws with a stateful op (each trace its own values), which the pass leaves: no record."""
    import importlib

    module = importlib.import_module({2: "tf_keras", 3: "keras"}[keras])
    x = tf.reshape(tf.range(6 * 40, dtype=tf.float32), [6, 40])

    def make():
        layer = module.layers.Dropout(0.3, seed=7)
        return lambda x: layer(x, training=True)

    expected = tf.function(make(), jit_compile=True)(x).numpy()
    tf_memsafe.enable("1GB", strict=True)
    try:
        with hook.use_pipeline(Pipeline([RandomKey()])):
            got = tf.function(make(), jit_compile=True)(x).numpy()
    finally:
        tf_memsafe.disable()
    if keras == 3:
        np.testing.assert_array_equal(got, expected)
        assert len(records("rewritten")) == 1
    else:
        assert not records()


def test_fires_within_the_limit_in_the_default_pipeline():
    """A time rewrite: a program far within its limit gets it too."""
    tf_memsafe.enable("1GB", strict=True)
    try:
        tf.function(lambda s: tf.random.stateless_normal([8], s), jit_compile=True)(tf.constant([1, 2]))
    finally:
        tf_memsafe.disable()
    assert len(records("rewritten")) == 1


def test_idempotent():
    graph = rewritten_graph(lambda s: tf.random.stateless_uniform([5], s), tf.TensorSpec([2], tf.int32))
    before = format_graph(graph)
    result = RandomKey().run(graph, tf_memsafe.Options())
    assert not result.records and format_graph(graph) == before


class TestMustNotFire:
    def unchanged(self, fn, *specs, jit=True):
        naive = format_graph(tf.function(fn, jit_compile=jit).get_concrete_function(*specs).graph)
        assert format_graph(rewritten_graph(fn, *specs, jit=jit)) == naive

    @pytest.mark.parametrize("alg", ["philox", "threefry"])
    def test_an_explicit_algorithm_has_no_key_op(self, alg):
        self.unchanged(lambda s: tf.random.stateless_uniform([9], s, alg=alg), tf.TensorSpec([2], tf.int64))
        assert not records()

    def test_stateful_draws(self):
        self.unchanged(lambda x: x + tf.random.uniform([9]), tf.TensorSpec([9]))
        assert not records()

    def test_a_function_tensorflows_kernels_run_is_left_and_says_why(self):
        self.unchanged(lambda s: tf.random.stateless_uniform([9], s), tf.TensorSpec([2], tf.int64), jit=False)
        (rec,) = records("skipped")
        assert "TensorFlow's kernels" in rec.reason

    def test_a_visible_tpu_leaves_the_graph_and_says_why(self, monkeypatch):
        monkeypatch.setattr(random_key, "_tpu_visible", lambda: True)
        self.unchanged(lambda s: tf.random.stateless_uniform([9], s), tf.TensorSpec([2], tf.int64))
        (rec,) = records("skipped")
        assert "TPU" in rec.reason and rec.ops[0].endswith("StatelessRandomGetKeyCounter")


def test_the_memory_model_has_a_rule_for_every_op_it_builds():
    """Else the splitter reads an op of ours it cannot count as its own loops, and plans nothing (a
    Keras 3 ``fit`` on a ``tf.data`` pipeline of unknown batch was left unsplit that way)."""
    from grappler_ext import memory_model

    graph = rewritten_graph(lambda s: tf.random.stateless_uniform([64], s), tf.TensorSpec([2], tf.int64))
    assert len(records("rewritten")) == 1
    estimate, _ = memory_model.analyse(graph)
    assert not estimate.unknown_ops and estimate.peak_bytes is not None
