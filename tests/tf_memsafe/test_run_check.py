"""A function planned at nominal sizes is checked by XLA's figure at the larger shapes it runs at."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.graph_query import live_ops
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import Splitter, Tuning
from grappler_ext.splitter.outcome import NominalSize
from tests.fakes import FakeMeasurer
from tf_memsafe import _tf_internals, hook, run_check
from tf_memsafe.run_check import ShapeCheck

LIMIT = 16 * 10**6
POINTS = tf.constant(np.random.default_rng(0).random((2000, 3)), tf.float32)


def kernel_sums():
    """Each row's kernel sum against 2,000 points, rows known only at run time: planned at a nominal
    number of rows (about 8,000 under 16 MB) with a loop along them; its input and output are not split,
    so at 10^6 rows XLA's figure is about 32 MB."""

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 3])])
    def sums(x):
        d = tf.reduce_sum((x[:, None, :] - POINTS[None]) ** 2, -1)
        return tf.reduce_sum(tf.exp(-d), 1)

    return sums


def expected(x):
    d = np.sum((x[:, None, :] - POINTS.numpy()[None]) ** 2, -1)
    return np.exp(-d).sum(1)


def said(caught):
    return [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]


def the_report(name="sums"):
    (report,) = [r for r in tf_memsafe.reports() if r.function_name == name]
    return report


def planned_rows(report):
    """The rows the function was planned at (its nominal size)."""
    (plan,) = [r.plan for r in report.records if isinstance(r.plan, NominalSize)]
    ((_, shape),) = plan.inputs
    return shape[0]


class TestCalledFromPython:
    def test_a_shape_beyond_the_plan_is_measured_and_said_once_over_the_limit(self):
        tf_memsafe.enable(LIMIT)
        sums = kernel_sums()
        rng = np.random.default_rng(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            small = rng.random((100, 3), dtype=np.float32)
            np.testing.assert_allclose(sums(small), expected(small), rtol=1e-5)
            report = the_report()
            rows = planned_rows(report)
            assert report.run_checks == [] and said(caught) == []           # within the plan: not compiled
            within = rng.random((rows + 1000, 3), dtype=np.float32)
            sums(within)
            assert len(report.run_checks) == 1 and not report.run_checks[0].over and said(caught) == []
            sums(within[:rows + 500])                                         # smaller than one checked
            assert len(report.run_checks) == 1
            large = rng.random((1_000_000, 3), dtype=np.float32)
            np.testing.assert_allclose(sums(large)[:1000], expected(large[:1000]), rtol=1e-5)
            larger = rng.random((1_200_000, 3), dtype=np.float32)
            sums(larger)
        (message,) = said(caught)
        check = report.run_checks[-1]
        assert check.shapes == ((1_000_000, 3),) and check.over and len(report.run_checks) == 2
        # the figure is XLA's for the program that ran at that shape
        assert check.bytes == tf_memsafe.memory_footprint(sums, tf.zeros([1_000_000, 3]))
        assert check.bytes > LIMIT
        assert "`sums`" in message and "[1,000,000, 3]" in message and "over the limit" in message
        assert "drop_remainder=True" in message and "memory_limit" in message

    def test_off_with_check_at_run_false(self):
        tf_memsafe.enable(LIMIT, check_at_run=False)
        sums = kernel_sums()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sums(tf.zeros([1_000_000, 3]))
        assert the_report().run_checks == [] and said(caught) == []

    def test_not_checked_once_tf_memsafe_is_disabled(self):
        tf_memsafe.enable(LIMIT)
        sums = kernel_sums()
        sums(tf.zeros([10, 3]))
        tf_memsafe.disable()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sums(tf.zeros([1_000_000, 3]))
        assert the_report().run_checks == [] and said(caught) == []


class TestCalledFromATracedFunction:
    def test_a_plain_function_checks_each_steps_shapes_before_the_step(self):
        """Keras' fit calls its jit-compiled step from a plain tf.function that takes the batch from a
        tf.data iterator: the shapes are known only as each step runs."""
        tf_memsafe.enable(LIMIT)
        sums = kernel_sums()

        @tf.function
        def step(iterator):
            return sums(next(iterator))

        rng = np.random.default_rng(2)
        data = rng.random((1_003_000, 3), dtype=np.float32)
        batches = (tf.data.Dataset.from_tensor_slices(data[:3000]).batch(1000)
                   .concatenate(tf.data.Dataset.from_tensor_slices(data[3000:]).batch(1_000_000)))
        iterator = iter(batches)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = [step(iterator) for _ in range(3)]
            assert said(caught) == [] and the_report().run_checks == []
            outputs.append(step(iterator))
        np.testing.assert_allclose(np.concatenate([o[:1000] for o in outputs]),
                                   expected(np.concatenate([data[:3000], data[3000:4000]])), rtol=1e-5)
        (message,) = said(caught)
        (check,) = the_report().run_checks
        assert check.shapes == ((1_000_000, 3),) and check.over
        assert "`sums`" in message
        assert [r.function_name for r in tf_memsafe.reports()] == ["sums", "step"]

    def test_nothing_is_added_inside_a_function_xla_compiles(self):
        """Called from a jit-compiled function, it is part of that function's program (which XLA
        compiles whole, and cannot run Python in)."""
        tf_memsafe.enable(LIMIT)
        sums = kernel_sums()

        @tf.function(jit_compile=True)
        def twice(x):
            return 2.0 * sums(x)

        x = np.random.default_rng(3).random((50, 3), dtype=np.float32)
        np.testing.assert_allclose(twice(x), 2 * expected(x), rtol=1e-5)
        graph = twice.get_concrete_function(tf.TensorSpec([50, 3])).graph
        assert not [op for op in graph.get_operations() if op.type in ("EagerPyFunc", "PyFunc")]
        assert not _tf_internals.tracing_without_python()


    def test_a_function_traced_to_be_saved_is_given_no_python(self, tmp_path):
        """A SavedModel is loaded where there is no Python function to call: what calls the function is
        saved as traced, and runs once loaded."""
        from tensorflow.python.tools import saved_model_utils

        tf_memsafe.enable(LIMIT)
        module = tf.Module()
        module.sums = kernel_sums()
        module.doubled = tf.function(lambda x: 2.0 * module.sums(x), input_signature=[tf.TensorSpec([None, 3])])
        tf.saved_model.save(module, str(tmp_path))
        tf_memsafe.disable()
        saved = saved_model_utils.get_meta_graph_def(str(tmp_path), "serve").graph_def
        assert "EagerPyFunc" not in {n.op for f in saved.library.function for n in f.node_def}
        loaded = tf.saved_model.load(str(tmp_path))
        x = np.random.default_rng(4).random((20, 3), dtype=np.float32)
        np.testing.assert_allclose(loaded.doubled(x), 2 * expected(x), rtol=1e-5)


class TestWhatIsWatched:
    def test_a_function_the_passes_warned_about_is_not_checked_again(self):
        """Over the limit at its nominal sizes already: the warning given then stands."""
        tf_memsafe.enable(20_000)           # less than the 2,000 points themselves
        sums = kernel_sums()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sums(tf.zeros([10, 3]))
            before = len(said(caught))
            sums(tf.zeros([1_000_000, 3]))
        assert before >= 1 and len(said(caught)) == before
        assert the_report().run_checks == []

    @pytest.mark.parametrize("check_at_run", [True, False], ids=["checked_at_run", "off"])
    def test_a_plan_over_the_limit_at_its_nominal_sizes_is_said_at_a_shape_that_is(self, check_at_run):
        """XLA's figure for the plan at its nominal rows over the limit (faked: twice it as split, three
        times as written), rows the splitter chose: not said when traced where each shape is checked as
        it runs (recorded; the plan judges no shape): 100 rows are checked, within, nothing said; 10^6
        rows are said over.  Off, the plan's warning is given when traced."""
        def figure(graph):
            split = any(op.type in ("While", "StatelessWhile") for op in live_ops(graph))
            return 2 * LIMIT if split else 3 * LIMIT

        # (the plan checked by XLA's figure however small the model's count, its loop sized by the model)
        tf_memsafe.enable(LIMIT, check_at_run=check_at_run, calibrate_chunks=False)
        checked = Splitter(FakeMeasurer(program=figure), tuning=Tuning(check_from=0.001))
        sums = kernel_sums()
        with warnings.catch_warnings(record=True) as caught, hook.use_pipeline(Pipeline([checked])):
            warnings.simplefilter("always")
            small = np.random.default_rng(2).random((100, 3), dtype=np.float32)
            np.testing.assert_allclose(sums(small), expected(small), rtol=1e-5)
            at_trace = said(caught)
            report = the_report()
            (plan,) = [r.plan for r in report.records if isinstance(r.plan, NominalSize)]
            if not check_at_run:
                assert len(at_trace) == 1 and "needs 32.0 MB by XLA's figure as split" in at_trace[0], at_trace
                assert plan.within and report.run_checks == []
                return
            assert at_trace == [] and not plan.within, at_trace
            assert any(r.reason.startswith("not said when traced, checked at each shape it runs at: at ")
                       and "needs 32.0 MB by XLA's figure as split" in r.reason for r in report.records)
            ((check,),) = [report.run_checks]
            assert check.shapes == ((100, 3),) and not check.over
            sums(tf.zeros([1_000_000, 3]))
        (message,) = said(caught)
        assert "(over the limit there, not said then), and runs at [1,000,000, 3]" in message, message

    @pytest.mark.parametrize("redraw", [False, True], ids=["draw_kept", "redraw_random"])
    def test_a_random_draw_that_stops_every_region_is_said_with_the_option_that_splits_it(self, redraw):
        """Kernel sums weighted by a stateless draw of their shape: no region goes through the draw, so
        nothing is split, and 2 x 10^4 rows are over the limit (their [20,000, 2,000] kernel is 160 MB).
        The warning advises ``redraw_random`` first (static shapes would be planned alike, stopped by the
        draw); with the option on, the loop draws the weights again by slice, and 2 x 10^4 rows are within
        the limit."""
        tf_memsafe.enable(LIMIT, redraw_random=redraw)

        @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 3])])
        def sums(x):
            d = tf.reduce_sum((x[:, None, :] - POINTS[None]) ** 2, -1)
            return tf.reduce_sum(tf.exp(-d) * tf.random.stateless_uniform(tf.shape(d), seed=[1, 2]), 1)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sums(tf.zeros([20_000, 3]))
        if redraw:
            assert said(caught) == [] and not the_report().run_checks[0].over, said(caught)
            return
        (message,) = said(caught)
        assert "nothing in it was split; it runs at [20,000, 3]" in message, message
        assert ("A random draw (`stateless_random_uniform/StatelessRandomUniformV2`) stops the regions through it: "
                "enable tf_memsafe with redraw_random=True" in message), message
        assert "Otherwise, give the function the shapes it runs at" in message, message

    def test_static_shapes_are_not_watched(self):
        tf_memsafe.enable(LIMIT)

        @tf.function(jit_compile=True)
        def sums(x):
            return tf.reduce_sum(tf.exp(-tf.reduce_sum((x[:, None, :] - POINTS[None]) ** 2, -1)), 1)

        sums(tf.zeros([20_000, 3]))
        assert not hasattr(sums.get_concrete_function(tf.TensorSpec([20_000, 3])).graph, run_check.WATCH_ATTR)


class TestCovered:
    @pytest.mark.parametrize("shape, covered", [
        ((100, 3), True), ((8000, 3), True), ((8001, 3), True), ((9001, 3), False), ((10, 4), False)])
    def test_a_shape_no_larger_than_one_judged_is_covered(self, shape, covered):
        graph = kernel_sums().get_concrete_function().graph
        w = run_check.Watch(graph, {graph.inputs[0].name: (8000, 3)}, LIMIT, [], lambda graph, shapes: 0)
        w._judged.append(((9000, 3),))
        assert w.covered((shape,)) is covered

    def test_a_check_renders_for_people(self):
        assert ShapeCheck(((8, 1024),), 3 * 2**20, 2**20).render() == (
            "at [8, 1,024]: 3 MiB by XLA's figure, over the limit of 1 MiB")
        assert "not measured (why)" in ShapeCheck(((8,),), None, 1, "why").render()
