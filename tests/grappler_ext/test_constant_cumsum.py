"""constant_cumsum: a running sum of a fill becomes a broadcast index, bit for bit, and only then.

Bytes and work, worked out for the Keras 3 causal mask at L = 2048: two [1, 2048, 2048] int32 scans
(16 MiB each) that XLA folds at compile time with a window of 2048 per element (~8.6e9 additions;
a layer's first call 60 s, experiments/compile_time.py) become two [2048] index vectors broadcast
into the comparison (8 KiB each, folded or fused in milliseconds).  The result's bytes do not change;
its compile time does.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.constant_cumsum import ConstantCumsum, exact_float_bound, float_refusal, running_index
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import format_graph
from tf_memsafe import hook


def pipeline():
    return hook.use_pipeline(Pipeline([ConstantCumsum()]))


def records(action=None):
    return [r for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "constant_cumsum" and (action is None or r.action == action)]


def traced(fn, *specs, rewrite=True):
    """The graph of ``fn`` traced with the pass (or without it)."""
    if not rewrite:
        return tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph
    tf_memsafe.enable("1GB", strict=True, rewrite_non_jit=True)
    with pipeline():
        return tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph


def run_both(fn, *args, jit=True, signature=None):
    """``fn(*args)`` as traced and as rewritten (a fresh trace each), as NumPy arrays."""
    def call(f):
        return tf.nest.map_structure(lambda t: t.numpy(), f(*args))

    expected = call(tf.function(fn, jit_compile=jit, input_signature=signature))
    tf_memsafe.enable("1GB", strict=True, rewrite_non_jit=True)
    with pipeline():
        got = call(tf.function(fn, jit_compile=jit, input_signature=signature))
    tf_memsafe.disable()
    return got, expected


class TestRunningIndex:
    """The pure rule: the multiplier of each position is what ``cumsum(ones)`` gives there."""

    @pytest.mark.parametrize("exclusive", [False, True])
    @pytest.mark.parametrize("reverse", [False, True])
    @pytest.mark.parametrize("n", [0, 1, 2, 9])
    def test_against_numpy(self, n, exclusive, reverse):
        ones = np.ones(n, np.int64)
        inclusive = np.cumsum(ones[::-1])[::-1] if reverse else np.cumsum(ones)
        expected = inclusive - 1 if exclusive else inclusive
        np.testing.assert_array_equal(running_index(n, exclusive, reverse), expected)

    def test_float_bounds(self):
        assert exact_float_bound(tf.float32) == 2 ** 24 and exact_float_bound(tf.float64) == 2 ** 53
        assert exact_float_bound(tf.float16) == 2 ** 11 and exact_float_bound(tf.bfloat16) == 2 ** 8
        assert exact_float_bound(tf.complex64) is None

    @pytest.mark.parametrize("dtype, value, n, exclusive, refused", [
        (tf.float32, 1.0, 2 ** 24, False, None),
        (tf.float32, 1.0, 2 ** 24 + 1, False, "not all exact in float32"),
        (tf.float32, -3.0, 1000, True, None),
        (tf.float16, 1.0, 4096, False, "4096 x |1.0| > 2^11"),
        (tf.float64, 0.1, 10, False, "not an integer"),
        (tf.float32, 1.0, None, False, "known only at run time"),
        (tf.float32, np.inf, None, False, None),
        (tf.float32, np.nan, 5, False, None),
        (tf.float32, np.inf, 5, True, "first element is 0"),
        (tf.complex64, 1.0, 5, False, "neither an integer nor a real floating-point type"),
    ])
    def test_float_refusal(self, dtype, value, n, exclusive, refused):
        got = float_refusal(dtype, np.array(value, dtype.as_numpy_dtype), n, exclusive)
        assert got is None if refused is None else refused in got


FILLS = {
    "ones": lambda dims, dtype: tf.ones(dims, dtype),
    "fill": lambda dims, dtype: tf.fill(dims, tf.constant(-3, dtype)),
    "broadcast": lambda dims, dtype: tf.broadcast_to(tf.constant([2], dtype), dims),
}


@pytest.mark.parametrize("fill", sorted(FILLS))
@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.float32, tf.float64])
@pytest.mark.parametrize("axis", [0, -2])
@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_bit_identical(fill, dtype, axis, flags):
    """Every fill, dtype, axis and flag: the rewritten function returns the very bits of the scan."""
    exclusive, reverse = flags

    def fn(x):
        filled = FILLS[fill]([40, 30, 28], dtype)   # 33,600 elements: tf.ones makes a Fill
        return tf.cumsum(filled, axis=axis, exclusive=exclusive, reverse=reverse) + x

    x = tf.zeros([], dtype)
    got, expected = run_both(fn, x)
    assert [r.action for r in records()] == ["rewritten"]
    np.testing.assert_array_equal(got, expected)


def test_int8_overflow_wraps_as_the_scan_does():
    """300 ones summed in int8 wrap past 127: k * 1 cast to int8 wraps the same way (without XLA,
    which has no int8 cumsum)."""
    fn = lambda x: tf.cumsum(tf.ones([300, 5], tf.int8), axis=0) + x
    got, expected = run_both(fn, tf.zeros([], tf.int8), jit=False)
    assert expected.min() < 0
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("jit", [True, False])
def test_run_time_dims_from_tf_shape(jit):
    """A mask built from ``tf.shape`` of a ``None``-length input (a padded tf.data batch): the index is
    built from the same dims at run time, exact at every length."""
    def causal(x):
        n = tf.shape(x)[1]
        ones = tf.ones([1, n, n], tf.int32)
        mask = tf.greater_equal(tf.cumsum(ones, axis=-2), tf.cumsum(ones, axis=-1))
        return tf.where(mask, x[:, :, None], 0.0)

    signature = [tf.TensorSpec([None, None], tf.float32)]
    plain = tf.function(causal, jit_compile=jit, input_signature=signature)
    plain.get_concrete_function()   # traced before tf_memsafe is enabled
    tf_memsafe.enable("1GB", strict=True, rewrite_non_jit=True)
    with pipeline():
        rewritten = tf.function(causal, jit_compile=jit, input_signature=signature)
        rewritten.get_concrete_function()
    for n in (0, 1, 6, 33):
        x = tf.reshape(tf.range(3 * n, dtype=tf.float32), [3, n])
        np.testing.assert_array_equal(rewritten(x), plain(x))
    assert [r.action for r in records()] == ["rewritten"] * 2


def test_ones_like_takes_the_shape_of_its_input():
    fn = lambda x: tf.cumsum(tf.ones_like(x, tf.int32), axis=1, reverse=True)
    x = tf.zeros([4, 50, 6])
    got, expected = run_both(lambda x: fn(tf.cast(x, tf.int32)), x)
    np.testing.assert_array_equal(got, expected)
    assert [r.action for r in records()] == ["rewritten"]


def test_structure_the_scan_is_gone():
    """Keras 3's causal mask: two scans of one [1, 64, 48] fill become two broadcast index vectors."""
    def mask(q):
        ones = tf.ones([1, 64, 48], tf.int32)
        return tf.greater_equal(tf.cumsum(ones, axis=-2), tf.cumsum(ones, axis=-1)), q

    g = traced(mask, tf.TensorSpec([3]))
    text = format_graph(g)
    assert "Cumsum" not in text and "Fill" not in text
    assert text.count("Range") == 2 and text.count("BroadcastTo i32[1,64,48]") == 2
    assert [r.reason for r in records()] == [
        "running sum of a int32[1x64x48] fill of 1 along axis 1 as a broadcast index: no scan for XLA to fold "
        "at compile time",
        "running sum of a int32[1x64x48] fill of 1 along axis 2 as a broadcast index: no scan for XLA to fold "
        "at compile time"]
    assert all(r.bytes_before == 64 * 48 * 4 for r in records())


def test_idempotent():
    fn = lambda x: tf.cumsum(tf.ones([100, 20], tf.int32), axis=1, exclusive=True) + x
    g = traced(fn, tf.TensorSpec([], tf.int32))
    once = format_graph(g)
    assert not Pipeline([ConstantCumsum()]).run(g, tf_memsafe.get_options()).changed
    assert format_graph(g) == once


class TestMustNotFire:
    def unchanged(self, fn, *specs):
        """Trace ``fn`` with the pass; the graph is exactly what tracing without it gives."""
        plain = format_graph(traced(fn, *specs, rewrite=False))
        assert format_graph(traced(fn, *specs)) == plain
        assert records("rewritten") == []
        return records()

    def test_a_running_sum_of_data_is_left_alone_without_a_record(self):
        assert self.unchanged(lambda x: tf.cumsum(x, axis=0), tf.TensorSpec([40, 30])) == []

    def test_a_non_integer_float_fill(self):
        (rec,) = self.unchanged(lambda x: tf.cumsum(tf.fill([40, 30], 0.1), 0) + x, tf.TensorSpec([]))
        assert "not an integer" in rec.reason and rec.action == "skipped"

    def test_a_float16_sum_past_its_exact_integers(self):
        (rec,) = self.unchanged(lambda x: tf.cumsum(tf.ones([4096, 2], tf.float16), 0) + x,
                                tf.TensorSpec([], tf.float16))
        assert "4096 x |1.0| > 2^11" in rec.reason

    def test_a_float_sum_over_a_run_time_length(self):
        fn = lambda x: tf.cumsum(tf.ones([tf.shape(x)[0], 30]), 0) + x[:, None]
        (rec,) = self.unchanged(fn, tf.TensorSpec([None]))
        assert "known only at run time" in rec.reason

    def test_a_fill_of_a_run_time_value(self):
        (rec,) = self.unchanged(lambda v: tf.cumsum(tf.fill([40, 30], v), 0), tf.TensorSpec([], tf.int32))
        assert "is not a constant" in rec.reason

    def test_a_small_constant_is_not_a_fill(self):
        """``tf.ones`` of fewer than 1000 elements is a ``Const``: XLA folds its scan quickly."""
        assert self.unchanged(lambda x: tf.cumsum(tf.ones([10, 10], tf.int32), 0) + x,
                              tf.TensorSpec([], tf.int32)) == []

    def test_cumprod_of_a_fill(self):
        assert self.unchanged(lambda x: tf.math.cumprod(tf.fill([40, 30], 2), 0) + x,
                              tf.TensorSpec([], tf.int32)) == []


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_keras_causal_attention_exact_and_without_a_scan(keras):
    """Keras 3's MultiHeadAttention(use_causal_mask=True) with dropout (the explicit-scores path: without
    dropout it calls the backend's fused attention, which masks with ``band_part``) and tf_keras' dense
    Attention(causal) build their masks with cumsums of ones: rewritten, the output is unchanged."""
    if keras == "keras3":
        import keras as k

        layer = k.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1, dtype="float64")
        fn = lambda q: layer(q, q, use_causal_mask=True, training=False)
    else:
        import tf_keras as k

        layer = k.layers.Attention(dtype="float64")
        fn = lambda q: layer([q, q], use_causal_mask=True)
    q = tf.constant(np.random.default_rng(0).standard_normal((2, 40, 16)))
    fn(q)   # build the layer's weights eagerly
    got, expected = run_both(fn, q)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert [r.action for r in records()] == ["rewritten", "rewritten"]


def test_keras3_causal_attention_in_the_products_pipeline_is_changed_by_this_pass_alone():
    """What experiments/compile_time.py measures, at L = 128 in float32: Keras 3's
    MultiHeadAttention(use_causal_mask=True) with dropout under the whole pipeline and a 4 GB limit:
    constant_cumsum rewrites both running sums and no other pass rewrites anything; with it disabled,
    nothing is rewritten; the output is the program's as written, to the bit, either way."""
    import keras

    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)
    fn = lambda q: layer(q, q, use_causal_mask=True, training=False)
    q = tf.constant(np.random.default_rng(0).standard_normal((2, 128, 16)).astype(np.float32))
    fn(q[:, :4])   # build the layer's weights eagerly
    expected = tf.function(fn, jit_compile=True)(q).numpy()
    for disabled, rewrites in (((), {"constant_cumsum": 2}), (("constant_cumsum",), {})):
        tf_memsafe.enable("4GB", strict=True, disabled_passes=disabled)
        mark = hook.report_mark()
        got = tf.function(fn, jit_compile=True)(q).numpy()
        tf_memsafe.disable()
        passes = [r.pass_name for rep in hook.reports_since(mark) for r in rep.records if r.action == "rewritten"]
        assert {name: passes.count(name) for name in passes} == rewrites, (disabled, passes)
        np.testing.assert_array_equal(got, expected)
