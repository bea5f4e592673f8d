"""Hostile inputs, as a new user would give them: each gets a clear error, one clear warning, or an
exact result -- never a crash inside TensorFlow, never a program silently over its limit.

Sizes: a [3000, 2000] distance or kernel matrix is 24 MB in float32 (12 MB in float16), against
limits of 4 MB; the naive programs need 5-20x the limit.
"""

import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import Code, Splitter
from tf_memsafe import hook, xla_flags
from tf_memsafe.memory import XlaMeasurer

RNG = np.random.default_rng(0)


def sq_dist(x, y):
    return tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)       # [N, M]


def knn(x, y):
    return tf.math.top_k(-sq_dist(x, y), k=5).indices                         # [N, 5]


def splitter_records(mark):
    return [r for rep in hook.reports_since(mark) for r in rep.records if r.pass_name == "splitter"]


def ours(caught):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "tf_memsafe" in str(w.message)]


def run_enabled(fn, *args, limit="4MB", **options):
    """``fn`` traced and run under ``limit``: (result, XLA's footprint as rewritten, the trace's records,
    the trace's warnings of ours).  (The footprint traces ``fn`` again: its warnings are not counted.)"""
    tf_memsafe.enable(limit, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mark = hook.report_mark()
        got = tf.function(fn, jit_compile=True)(*args)
        records = splitter_records(mark)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        footprint = tf_memsafe.memory_footprint(fn, *args)
    tf_memsafe.disable()
    return got, footprint, records, ours(caught)


class TestLimits:
    @pytest.mark.parametrize("bad", ["4 gigs", -1, 0, "GB", float("nan"), True, "150%", None, "-5MB"])
    def test_a_limit_that_is_not_one_is_refused_with_the_accepted_forms(self, bad):
        with pytest.raises((ValueError, TypeError), match="memory limit|memory_limit"):
            tf_memsafe.enable(bad)
        assert not tf_memsafe.is_enabled()

    def test_an_impossible_limit_gives_the_best_effort_one_warning_and_the_exact_result(self):
        """1 kB for a kNN whose inputs alone are 60 kB: the best it can do, said once."""
        x, y = tf.constant(RNG.standard_normal((3000, 3)), tf.float32), tf.constant(RNG.standard_normal((2000, 3)),
                                                                                    tf.float32)
        expected = tf.function(knn, jit_compile=True)(x, y)
        got, footprint, records, said = run_enabled(knn, x, y, limit=1000)
        assert len(said) == 1 and "It will run as well as it can" in said[0], said
        # (its arguments, 60 kB, and its results: no rewrite inside the program can help, and it says so)
        assert "arguments and results alone are 0.1 MB" in said[0] and "no rewrite inside it" in said[0], said
        assert any(r.code == Code.BEST_EFFORT for r in records)
        assert footprint < tf_memsafe.memory_footprint(knn, x, y, rewrite=False) / 10
        assert np.mean(got.numpy() == expected.numpy()) > 0.99

    def test_a_lower_limit_never_gives_a_larger_program(self):
        """Best effort is monotonic: logsumexp of minus the squared distances of [3000, 3] and [3000, 3]
        (a 36 MB matrix, 72 MB naive) from a limit it meets down to limits it cannot (the inputs alone
        are 72 kB): the footprint never grows as the limit shrinks."""
        def lse(x, y):
            return tf.reduce_logsumexp(-sq_dist(x, y), axis=1)

        specs = (tf.TensorSpec([3000, 3]), tf.TensorSpec([3000, 3]))
        footprints = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)           # the best efforts' warnings
            for limit in (5 * 10**6, 2 * 10**6, 500_000, 200_000, 50_000, 10_000):
                with tf_memsafe.options(memory_limit=limit):
                    tf_memsafe.enable(limit)
                    footprints.append(tf_memsafe.memory_footprint(lse, *specs))
                    tf_memsafe.disable()
        assert footprints == sorted(footprints, reverse=True), footprints
        assert footprints[-1] < 200_000


class TestOptions:
    @pytest.mark.parametrize("field, value", [("strict", "no"), ("verify", None), ("dump_dir", 123),
                                              ("max_fixed_point_iterations", True), ("memory_limit_bytes", "8MB"),
                                              ("disabled_passes", ["spliter"]), ("redraw_random", 1)])
    def test_a_bad_value_is_refused_naming_the_field(self, field, value):
        with pytest.raises((ValueError, TypeError), match=field):
            if field == "memory_limit_bytes":
                tf_memsafe.options(memory_limit_bytes=value).__enter__()
            else:
                tf_memsafe.enable("8MB", **{field: value})
        assert not tf_memsafe.is_enabled()

    def test_a_misspelt_pass_names_the_known_ones(self):
        with pytest.raises(ValueError, match="splitter"):
            tf_memsafe.enable("8MB", disabled_passes=["spliter"])


@pytest.mark.heavy
def test_the_users_xla_flags_are_kept_byte_for_byte():
    """Values with `.*`, `=` and a quoted path with a space, as XLA itself splits them.

    ``heavy`` (about 5 s, a child process importing TensorFlow; ``python -m tests -m heavy`` runs it).
    By default, tests/tf_memsafe/test_memory.py::test_the_users_dump_flags_work_with_tf_memsafe_as_without_it
    imports tf_memsafe in a child under such a value (`.*`, `=`, a quoted path with a space) and finds
    XLA_FLAGS the user's value byte for byte behind the reset flag; tests/tf_memsafe/test_xla_flags.py
    (``TestTheUsersValueIsKeptByteForByte::test_import_puts_only_the_reset_flag_in_front``) reads
    ``user_value()`` back unchanged after what the import does, and
    (``TestXlaSplitsTheValue::test_each_flag_as_xla_reads_it_and_as_written``) splits such values as XLA does."""
    value = '--xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=a=b --xla_dump_to="/tmp/my dumps"'
    code = ("import os; os.environ['XLA_FLAGS'] = " + repr(value) + "; import tf_memsafe; "
            "from tf_memsafe import xla_flags; print(repr(xla_flags.user_value()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == repr(value)
    assert [f.value for f in xla_flags.parse_flags(value).flags] == [".*", "a=b", "/tmp/my dumps"]


class TestDtypes:
    """The same region in float16, bfloat16, int32 and complex64: split, and equal to the unsplit program."""

    @pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.int32])
    def test_split_and_equal(self, dtype):
        if dtype == tf.int32:
            x, y = (tf.constant(RNG.integers(-50, 50, (n, 3)), tf.int32) for n in (3000, 2000))

            def fn(x, y):
                return tf.reduce_max(tf.reduce_sum(tf.abs(x[:, None, :] - y[None, :, :]), -1), 1)   # [N]
        else:
            x, y = (tf.cast(tf.constant(RNG.standard_normal((n, 3))), dtype) for n in (3000, 2000))

            def fn(x, y):
                return tf.reduce_max(-sq_dist(x, y), 1)                                           # [N]

        expected = tf.function(fn, jit_compile=True)(x, y)
        got, footprint, records, said = run_enabled(fn, x, y)
        assert any(r.code == Code.SPLIT for r in records) and footprint <= 4 * 10**6 and said == []
        np.testing.assert_array_equal(got.numpy(), expected.numpy())          # max: exact in any dtype

    def test_complex64(self):
        x, y = (tf.constant(RNG.standard_normal((n, 3)), tf.float32) for n in (3000, 2000))

        def fn(x, y):
            phase = tf.cast(tf.matmul(x, y, transpose_b=True), tf.complex64)                     # [N, M]
            return tf.reduce_sum(tf.exp(tf.complex(0.0, 1.0) * phase), 1)                       # [N]

        expected = tf.function(fn, jit_compile=True)(x, y)
        got, footprint, records, said = run_enabled(fn, x, y)
        assert any(r.code == Code.SPLIT for r in records) and footprint <= 4 * 10**6 and said == []
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-3)


def test_nan_and_inf_inputs_give_what_the_unsplit_program_gives():
    """Inf and NaN among the points of a kernel sum: NaN and Inf where the unsplit program has them."""
    x = RNG.standard_normal((3000, 3))
    x[7, 1], x[100, 0], x[2999, 2] = np.nan, np.inf, -np.inf
    x, y = tf.constant(x), tf.constant(RNG.standard_normal((2000, 3)))

    def fn(x, y):
        return tf.reduce_sum(tf.exp(-sq_dist(x, y)), 1), tf.reduce_sum(tf.exp(-sq_dist(x, y)), 0)   # [N], [M]

    expected = tf.function(fn, jit_compile=True)(x, y)
    got, footprint, records, said = run_enabled(fn, x, y, limit="16MB")
    assert any(r.code == Code.SPLIT for r in records) and footprint <= 16 * 10**6
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.isnan(g.numpy()), np.isnan(e.numpy()))
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10)


@pytest.mark.parametrize("check_at_run", [True, False])
def test_dynamic_shapes_warn_naming_them_and_what_to_do(check_at_run):
    """An input of unknown rank beside a run-time size: nothing can be planned.  Checked as it runs
    (:mod:`tf_memsafe.run_check`): said at the first shape where XLA's figure is over the limit, naming
    the inputs; otherwise said when traced."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_memsafe.enable("8MB", check_at_run=check_at_run)
        mark = hook.report_mark()
        f = tf.function(knn, jit_compile=True, input_signature=[tf.TensorSpec(None), tf.TensorSpec([None, 3])])
        f.get_concrete_function()
        traced = ours(caught)
        if check_at_run:
            assert traced == []
            f(tf.zeros([100, 3]), tf.zeros([100, 3]))                      # 40 kB of distances: within
            assert ours(caught) == []
            f(tf.zeros([2000, 3]), tf.zeros([2000, 3]))                   # 16 MB of distances: over
    said = ours(caught)
    assert len(said) == 1 and "input_signature" in said[0], said
    (record,) = splitter_records(mark)
    assert record.code == Code.DYNAMIC_SHAPES
    if check_at_run:
        assert "`x:0`, `y:0`" in said[0] and "[2,000, 3], [2,000, 3]" in said[0], said
        assert "checked by XLA's figure at each shape it runs at" in record.reason, record.reason
        (report,) = hook.reports_since(mark)
        assert [c.over for c in report.run_checks] == [False, True]
    else:
        assert "dynamic shapes" in said[0] and "`x:0` of unknown rank, `y:0` dimension 0 of [?, 3]" in said[0], said


def test_two_run_time_sizes_are_split_and_exact():
    """Queries and points of sizes both known only at run time: split (the loop's chunk scaled to the
    sizes of each run), nothing said, equal to the unsplit function at sizes on both sides."""
    tf_memsafe.enable("8MB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mark = hook.report_mark()
        f = tf.function(knn, jit_compile=True, input_signature=[tf.TensorSpec([None, 3])] * 2)
        f.get_concrete_function()
    assert ours(caught) == []
    assert Code.SPLIT in [r.code for r in splitter_records(mark)]
    naive = tf.function(knn, jit_compile=True)
    for n, m in ((3, 10), (4500, 4000), (100, 6000)):
        x, y = (tf.constant(RNG.standard_normal((k, 3)).astype("float32")) for k in (n, m))
        np.testing.assert_array_equal(f(x, y).numpy(), naive(x, y).numpy())


def test_a_dynamic_dimension_is_split_and_exact_at_every_size():
    """The issue's case: k nearest of 4000 points for a batch of queries of any size, 72 MB at 4500
    queries as written, under 8 MB; a trace generalised by ``reduce_retracing`` splits too."""
    y = tf.constant(RNG.standard_normal((4000, 3)).astype("float32"))

    def nearest(x):
        return knn(x, y)

    tf_memsafe.enable("8MB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mark = hook.report_mark()
        signed = tf.function(nearest, jit_compile=True, input_signature=[tf.TensorSpec([None, 3])])
        signed.get_concrete_function()
        general = tf.function(nearest, jit_compile=True, reduce_retracing=True)
        for n in (5, 9):                            # the second shape makes TensorFlow trace [None, 3]
            general(tf.zeros([n, 3]))
    assert ours(caught) == []
    plans = [r.plan for r in splitter_records(mark) if r.code == Code.SPLIT]
    assert len(plans) == 2 and all(p.dynamic for p in plans), [r.reason for r in splitter_records(mark)]
    assert tf_memsafe.memory_footprint(signed, tf.TensorSpec([4500, 3])) <= 8 * 10**6
    tf_memsafe.disable()
    assert tf_memsafe.memory_footprint(signed, tf.TensorSpec([4500, 3]), rewrite=False) > 70 * 10**6
    unsplit = tf.function(nearest, jit_compile=True)
    for n in (0, 1, plans[0].chunk, plans[0].chunk + 1, 4500):
        x = tf.constant(RNG.standard_normal((n, 3)).astype("float32"))
        expected = unsplit(x).numpy()
        np.testing.assert_array_equal(signed(x).numpy(), expected)
        np.testing.assert_array_equal(general(x).numpy(), expected)


def test_sizes_decided_inside_the_program_are_judged_by_xlas_figure():
    """An embedding's sparse Adam update (its rows deduplicated with `Unique`: sizes known only as it
    runs) in a step whose inputs are static: XLA's figure for the program decides, and within the
    limit there is nothing to say."""
    import tf_keras as keras

    emb = tf.Variable(RNG.standard_normal((1000, 64)).astype("float32"))
    opt = keras.optimizers.Adam(0.01)
    opt.build([emb])

    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.gather(emb, ids)))
        opt.apply_gradients([(tape.gradient(loss, emb), emb)])
        return loss

    ids = tf.constant(RNG.integers(0, 1000, 512), tf.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_memsafe.enable("64MB")
        mark = hook.report_mark()
        tf.function(step, jit_compile=True)(ids)
    (record,) = splitter_records(mark)
    assert record.code == Code.DYNAMIC_SHAPES and "within the limit by XLA's figure" in record.reason
    assert ours(caught) == []


def test_a_cholesky_inside_the_region_is_named():
    fn = lambda x: tf.linalg.cholesky(tf.exp(-sq_dist(x, x)) + 1e-3 * tf.eye(2000))     # [2000, 2000]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_memsafe.enable("4MB")
        mark = hook.report_mark()
        tf.function(fn, jit_compile=True).get_concrete_function(tf.TensorSpec([2000, 3]))
    said = ours(caught)
    assert len(said) == 1 and "`Cholesky`" in said[0], said
    assert any(r.code == Code.REFUSED_OP and "Cholesky" in r.reason for r in splitter_records(mark))


@pytest.mark.parametrize("fn, op_type, hint", [
    (lambda x: tf.linalg.slogdet(tf.exp(-sq_dist(x, x)) + tf.eye(2000))[1], "LogMatrixDeterminant", "cholesky"),
    (lambda x: tf.py_function(np.sort, [sq_dist(x, x)], tf.float32), "EagerPyFunc", "runs Python"),
], ids=["slogdet", "py_function"])
def test_an_op_xla_cannot_compile_is_named_and_the_function_left_as_traced(fn, op_type, hint):
    """XLA has no kernel for ``tf.linalg.slogdet`` (nor for a ``tf.py_function``): the function is left
    exactly as traced, with one warning naming the op and what to do, not a memory warning about a
    program XLA cannot compile at all (before: the splitter's "holds 144 MB" advice, and its rewrite
    time, then TensorFlow's own error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_memsafe.enable("4MB")
        mark = hook.report_mark()
        traced = tf.function(fn, jit_compile=True).get_concrete_function(tf.TensorSpec([2000, 3]))
    said = ours(caught)
    assert len(said) == 1 and f"`{op_type}`" in said[0] and hint in said[0] and "exactly as traced" in said[0], said
    [report] = hook.reports_since(mark)
    assert report.status == "skipped" and op_type in report.reason and report.pipeline is None
    assert report.code == hook.TraceCode.NO_XLA_KERNEL and op_type in dict(report.ops), (report.code, report.ops)
    assert op_type in {op.type for op in traced.graph.get_operations()}
    with pytest.raises(tf.errors.InvalidArgumentError, match=op_type):
        traced(tf.zeros([2000, 3]))


def test_a_random_draw_inside_the_region_is_named_with_the_option():
    fn = lambda x, y: tf.math.top_k(tf.random.uniform([3000, 2000]) - sq_dist(x, y), k=3).indices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_memsafe.enable("4MB")
        tf.function(fn, jit_compile=True).get_concrete_function(tf.TensorSpec([3000, 3]), tf.TensorSpec([2000, 3]))
    said = ours(caught)
    assert len(said) == 1 and "RandomUniform" in said[0] and "redraw_random=True" in said[0], said


@pytest.mark.parametrize("counted", [False, True], ids=["branch-without-a-rule", "branches-counted"])
def test_a_program_the_model_cannot_estimate_is_decided_by_xlas_figure(counted):
    """A training step with a conditional: six [1000, 500] f32 activations (2 MB each) held for the
    backward, 12 MB by XLA's figure, no one tensor over the 6 MB limit.  Where the memory model
    cannot count the conditional (a branch with an op it has no rule for, a `Cumsum`; as mixed
    precision's loss scaling holds a sparse update of run-time size), XLA's figure decides; where it
    counts its branches, the model does.  Split, within the limit, equal, either way."""
    x = tf.constant(RNG.standard_normal((1000, 3)), tf.float32)
    ys = [tf.constant(RNG.standard_normal((500, 3)), tf.float32) for _ in range(6)]

    def step(x, s):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.add_n([tf.reduce_sum(tf.tanh(tf.matmul(x, y, transpose_b=True))) for y in ys])
            loss = tf.cond(s > 0, lambda: loss * 2.0, (lambda: loss) if counted else (
                lambda: tf.reduce_sum(tf.math.cumsum(tf.stack([loss, 0.0])))))
        return loss, tape.gradient(loss, x)

    s = tf.constant(1.0)
    expected = tf.function(step, jit_compile=True)(x, s)
    assert tf_memsafe.memory_footprint(step, x, s, rewrite=False) > 10**7
    got, footprint, records, said = run_enabled(step, x, s, limit="6MB")
    assert (Code.OVER_BY_XLA in [r.code for r in records]) != counted and footprint <= 6 * 10**6 and said == []
    for g, e in zip(got, expected):
        # (float32 sums of 3e6 tanh values, reassociated: 4e-5 apart in one run of the suite)
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-4, atol=1e-5 * float(np.abs(e).max()))


def test_two_threads_tracing_at_once_under_two_limits_each_get_their_own_plan():
    """One pipeline, shared as the hook shares it; kNN of 4000 x 4000 points (a 64 MB distance
    matrix) under 16 MB and, in another thread at the same moment, under 4 MB: each trace gets the
    plan it gets alone, and runs within its limit."""
    x = tf.constant(RNG.standard_normal((4000, 3)), tf.float32)
    y = tf.constant(RNG.standard_normal((4000, 3)), tf.float32)
    expected = tf.function(knn, jit_compile=True)(x, y).numpy()
    shared = Pipeline([Splitter(XlaMeasurer())])
    limits = (16 * 10**6, 4 * 10**6)

    def trace(limit):
        with hook.active_in_this_thread(), tf_memsafe.options(memory_limit=limit, strict=True):
            return tf.function(knn, jit_compile=True)(x, y).numpy()

    def plans(mark):
        return {rep.memory_limit_bytes: next(r.plan for r in rep.records if r.code == Code.SPLIT)
                for rep in hook.reports_since(mark)}

    with hook.use_pipeline(shared):
        mark = hook.report_mark()
        alone = {limit: trace(limit) for limit in limits}
        expected_plans = plans(mark)
        mark = hook.report_mark()
        barrier, results, errors = threading.Barrier(2), {}, []

        def worker(limit):
            try:
                barrier.wait()
                results[limit] = trace(limit)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(limit,)) for limit in limits]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        together = plans(mark)
        assert together == expected_plans and together[limits[0]].chunk > together[limits[1]].chunk
        for limit in limits:
            assert np.mean(results[limit] == expected) > 0.99 and np.mean(alone[limit] == expected) > 0.99
            with tf_memsafe.options(memory_limit=limit), hook.active_in_this_thread():
                assert tf_memsafe.memory_footprint(knn, x, y) <= limit
