"""The tf.function hook: which traces it rewrites, re-entrancy, idempotence, fail-open, strict."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import format_graph
from tests.fakes import CountingPass, FailingPass, LoopBuildingPass, ScaleOutputsPass
from tf_memsafe import _tf_internals, hook
from tf_memsafe.errors import RewriteError, UnsupportedTensorFlowError


def statuses():
    return [(r.function_name, r.status) for r in tf_memsafe.reports()]


def loop_and_cond(x):
    """A user function with its own while loop and cond: their bodies must not be rewritten alone."""
    _, y = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2.0), (0, x), maximum_iterations=3)
    return tf.cond(tf.reduce_sum(x) > 0, lambda: y + 1.0, lambda: y - 1.0)


X = tf.constant([0.5, 1.0, 2.0])


def creates_a_variable(jit: bool = True):
    """A function ``f`` that makes a variable at its first trace, as a Keras optimizer makes its slots."""
    state = []

    @tf.function(jit_compile=jit)
    def f(x):
        if not state:
            state.append(tf.Variable(2.0))
        return tf.sin(x) * state[0]

    return f


class TestWhichTracesAreRewritten:
    def test_jit_function_is_rewritten_and_computes_the_rewrite(self):
        tf_memsafe.enable("1GB")
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(10.0)])):
            f = tf.function(lambda x: tf.sin(x), jit_compile=True)
            np.testing.assert_allclose(f(X), 10 * np.sin(X.numpy()), rtol=1e-6)
        (report,) = tf_memsafe.reports()
        assert report.status == "rewritten" and report.xla_compiled and report.code == hook.TraceCode.REWRITTEN
        assert report.memory_limit_bytes == 10**9
        assert [r.pass_name for r in report.records] == ["scale_outputs"]
        assert isinstance(report.rewrite_seconds, float) and report.rewrite_seconds >= 0

    def test_non_jit_function_is_left_alone_by_default(self):
        tf_memsafe.enable("1GB")
        counter = CountingPass()
        with hook.use_pipeline(Pipeline([counter])):
            f = tf.function(lambda x: tf.sin(x))
            f(X)
        assert counter.seen == []
        (report,) = tf_memsafe.reports()
        assert report.status == "skipped" and "jit_compile" in report.reason and report.code == hook.TraceCode.NOT_XLA

    def test_a_function_not_compiled_with_xla_is_said_once_an_enable(self):
        """Keras 3's ``jit_compile="auto"`` is off on CPUs: a user's ``fit`` would run as written, the
        limit silently not holding.  One warning names the function and the fix; then none, until the
        next ``enable``; none for a function XLA compiles, nor with ``rewrite_non_jit``."""
        def said(fn, *args):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn(*args)
            return [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]

        tf_memsafe.enable("1GB")
        with hook.use_pipeline(Pipeline([CountingPass()])):
            assert said(tf.function(lambda x: tf.sin(x), jit_compile=True), X) == []
            # nor for the functions tf.data traces (Keras 3's array adapter shuffles with a map's)
            assert said(lambda: list(tf.data.Dataset.range(4).map(lambda i: i * 2))) == []
            # a plain function calling a jit one (Keras 3's fit runs its jit step so), in a loop or not
            step = tf.function(lambda x: tf.sin(x) + 1, jit_compile=True)
            assert said(tf.function(lambda x: tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, step(a)),
                                                             (0, x))[1]), X) == []
            # ... and its report does not ask for rewrite_non_jit, which would not rewrite the step
            outer = [r for r in tf_memsafe.reports() if not r.xla_compiled][-1]
            assert outer.reason.endswith("the XLA-compiled functions it calls are rewritten on their own"), outer
            assert outer.code == hook.TraceCode.CALLS_XLA
            (first,) = said(tf.function(lambda x: tf.cos(x)), X)
            assert "`<lambda>` is not compiled with XLA" in first and "jit_compile=True" in first
            assert "rewrite_non_jit=True" in first
            assert said(tf.function(lambda x: tf.tan(x)), X) == []
            tf_memsafe.enable("1GB")
            assert len(said(tf.function(lambda x: tf.exp(x)), X)) == 1
            tf_memsafe.enable("1GB", rewrite_non_jit=True)
            assert said(tf.function(lambda x: tf.exp(x)), X) == []

    def test_non_jit_function_is_rewritten_with_rewrite_non_jit(self):
        tf_memsafe.enable("1GB", rewrite_non_jit=True)
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(3.0)])):
            f = tf.function(lambda x: tf.sin(x))
            np.testing.assert_allclose(f(X), 3 * np.sin(X.numpy()), rtol=1e-6)
        assert statuses() == [("<lambda>", "rewritten")]

    def test_get_concrete_function_of_a_jit_function_counts_as_xla(self):
        tf_memsafe.enable("1GB")
        counter = CountingPass()
        with hook.use_pipeline(Pipeline([counter])):
            f = tf.function(lambda x: tf.sin(x), jit_compile=True)
            f.get_concrete_function(tf.TensorSpec([5]))
        assert len(counter.seen) == 1
        assert tf_memsafe.reports()[0].xla_compiled

    def test_plain_function_called_from_a_jit_function_is_in_xla_context(self):
        tf_memsafe.enable("1GB")
        counter = CountingPass()
        inner = tf.function(lambda x: tf.sin(x))
        outer = tf.function(lambda x: inner(x) * 2.0, jit_compile=True)
        with hook.use_pipeline(Pipeline([counter])):
            outer(X)
        assert sorted(r.xla_compiled for r in tf_memsafe.reports()) == [True, True]

    def test_a_first_trace_that_creates_variables_is_not_rewritten(self):
        """TensorFlow traces such a function again without creating them and runs only that trace."""
        tf_memsafe.enable("1GB")
        counter = CountingPass()
        f = creates_a_variable()
        with hook.use_pipeline(Pipeline([counter])):
            np.testing.assert_allclose(f(X), 2 * np.sin(X.numpy()), rtol=1e-6)
            f(X + 1.0)
        # (TensorFlow's own `initialize_variables`, traced between them, is not the function's)
        assert counter.seen.count("f") == 1
        first, second = [r for r in tf_memsafe.reports() if r.function_name == "f"]
        assert first.retraced and first.status == "skipped" and "created the function's variables" in first.reason
        assert first.code == hook.TraceCode.RETRACED
        assert not second.retraced and second.status == "unchanged" and second.code == hook.TraceCode.UNCHANGED

    def test_a_first_trace_that_creates_variables_runs_rewritten(self):
        """The trace TensorFlow runs is the rewritten one, called or asked for as a concrete function."""
        tf_memsafe.enable("1GB")
        f = creates_a_variable()
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(10.0, once=False)])), \
                tf_memsafe.options(max_fixed_point_iterations=1):
            np.testing.assert_allclose(f(X), 20 * np.sin(X.numpy()), rtol=1e-6)
            np.testing.assert_allclose(f.get_concrete_function(X)(X), 20 * np.sin(X.numpy()), rtol=1e-6)
        assert [r.retraced for r in tf_memsafe.reports() if r.function_name == "f"] == [True, False]

    @pytest.mark.parametrize("jit", [True, False])
    def test_a_first_trace_that_creates_no_variables_is_rewritten(self, jit):
        """Without variables created, TensorFlow runs the first trace itself (and a function not jit
        compiled may run a first trace that created some where their initialisation cannot be lifted)."""
        tf_memsafe.enable("1GB", rewrite_non_jit=True)
        v = tf.Variable(2.0)
        counter = CountingPass()
        with hook.use_pipeline(Pipeline([counter])):
            tf.function(lambda x: tf.sin(x) * v, jit_compile=jit)(X)      # reads one, creates none
            creates_a_variable(jit)(X)
        assert counter.seen.count("<lambda>") == 1
        assert counter.seen.count("f") == (1 if jit else 2)
        assert [r.retraced for r in tf_memsafe.reports() if r.function_name == "f"] == (
            [True, False] if jit else [False, False])

    def test_disabled_hook_sees_nothing(self):
        counter = CountingPass()
        with hook.use_pipeline(Pipeline([counter])):
            tf.function(lambda x: tf.sin(x), jit_compile=True)(X)
        assert counter.seen == [] and tf_memsafe.reports() == []

    def test_traces_made_while_enabled_keep_their_rewrite_after_disable(self):
        tf_memsafe.enable("1GB")
        f = tf.function(lambda x: tf.sin(x), jit_compile=True)
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(2.0)])):
            f(X)
        tf_memsafe.disable()
        np.testing.assert_allclose(f(X), 2 * np.sin(X.numpy()), rtol=1e-6)


class TestControlFlowAndReentrancy:
    def test_user_loops_and_conds_are_not_rewritten_on_their_own(self):
        tf_memsafe.enable("1GB")
        counter = CountingPass()
        f = tf.function(loop_and_cond, jit_compile=True)
        with hook.use_pipeline(Pipeline([counter])):
            result = f(X)
        assert counter.seen == ["loop_and_cond"]
        np.testing.assert_allclose(result, 8 * X.numpy() + 1, rtol=1e-6)

    def test_loops_built_by_a_pass_do_not_re_enter_the_pipeline(self):
        tf_memsafe.enable("1GB")
        looping = LoopBuildingPass()
        counter = CountingPass()
        f = tf.function(loop_and_cond, jit_compile=True)
        with hook.use_pipeline(Pipeline([looping, counter])):
            result = f(X)
        # The pipeline ran to a fixed point on the one function graph: iteration 1 rewrote,
        # iteration 2 found the loop already there.  The loop's own bodies were never rewritten.
        assert counter.seen == ["loop_and_cond", "loop_and_cond"]
        np.testing.assert_allclose(result, 8 * X.numpy() + 1, rtol=1e-6)
        (report,) = tf_memsafe.reports()
        assert report.status == "rewritten"

    def test_pipeline_is_idempotent_on_a_function_with_control_flow(self):
        def traced_text(pipeline):
            f = tf.function(loop_and_cond, jit_compile=True)
            with hook.use_pipeline(pipeline):
                return format_graph(f.get_concrete_function(tf.TensorSpec([3])).graph)

        tf_memsafe.enable("1GB")
        once = traced_text(Pipeline([LoopBuildingPass()]))
        # Running the pipeline twice over the same graph gives the same graph as running it once.
        twice_pass = LoopBuildingPass()
        f = tf.function(loop_and_cond, jit_compile=True)
        with hook.use_pipeline(Pipeline([twice_pass])):
            g = f.get_concrete_function(tf.TensorSpec([3])).graph
        Pipeline([LoopBuildingPass()]).run(g, tf_memsafe.get_options())
        assert format_graph(g) == once
        assert "While" in once

    @pytest.mark.parametrize("traced_by", ["call", "get_concrete_function"])
    def test_loops_a_pass_builds_are_built_as_xla_compiles_them(self, traced_by):
        """However the function was traced, a loop a pass builds in it carries the attribute a call's
        trace gives it (XLA then takes its loop-invariant sizes as constants), and the context that
        says so is gone once the pipeline has run."""
        tf_memsafe.enable("1GB")
        f = tf.function(lambda x: x * 2.0, jit_compile=True)
        with hook.use_pipeline(Pipeline([LoopBuildingPass()])):
            if traced_by == "call":
                f(X)
            graph = f.get_concrete_function(X).graph
        loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
        assert loops and all(op.get_attr("_xla_propagate_compile_time_consts") for op in loops)
        assert tf.compat.v1.get_default_graph()._get_control_flow_context() is None

    def test_gradient_through_a_rewritten_function_with_tape_outside(self):
        tf_memsafe.enable("1GB")
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(5.0)])):
            f = tf.function(lambda x: tf.reduce_sum(tf.sin(x)), jit_compile=True)
            v = tf.Variable(X)
            with tf.GradientTape() as tape:
                loss = f(v)
            grad = tape.gradient(loss, v)
        np.testing.assert_allclose(loss, 5 * np.sum(np.sin(X.numpy())), rtol=1e-6)
        np.testing.assert_allclose(grad, 5 * np.cos(X.numpy()), rtol=1e-6)


class TestFailOpen:
    def test_failing_pass_leaves_the_function_as_traced_and_warns_once(self):
        tf_memsafe.enable("1GB")
        f = tf.function(lambda x: tf.sin(x) * 2.0, jit_compile=True)
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(7.0), FailingPass()])):
            with pytest.warns(RuntimeWarning, match=r"left `<lambda>` exactly as traced.*'failing'") as rec:
                result = f(X)
        assert len([w for w in rec if "tf_memsafe" in str(w.message)]) == 1
        np.testing.assert_allclose(result, 2 * np.sin(X.numpy()), rtol=1e-6)
        (report,) = tf_memsafe.reports()
        assert report.status == "failed" and "deliberate failure" in report.reason
        assert report.code == hook.TraceCode.PASS_FAILED

    @pytest.mark.parametrize("failure", ["unmatched", "raised"])
    def test_dtensor_inputs_not_matched_leave_the_function_as_traced_with_its_code(self, monkeypatch, failure):
        """Where the DTensor inputs of a trace cannot be matched to its graph's inputs (their mesh's
        axes unknown), the function is left as traced: one warning, the code ``dtensor_unmatched``."""
        from tf_memsafe import dtensor_inputs

        def unmatched(graph):
            if failure == "raised":
                raise ValueError("a layout this test made up")
            return None

        monkeypatch.setattr(dtensor_inputs, "sharded_inputs", unmatched)
        tf_memsafe.enable("1GB")
        with hook.use_pipeline(Pipeline([CountingPass()])), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = tf.function(lambda x: tf.sin(x) * 2.0, jit_compile=True).get_concrete_function(X)
        said = [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]
        (report,) = [r for r in tf_memsafe.reports() if r.xla_compiled]
        assert report.status == "skipped" and report.code == hook.TraceCode.DTENSOR_UNMATCHED, report
        assert len(said) == 1 and "could not be matched" in said[0] and "exactly as traced" in said[0], said
        assert ("a layout this test made up" in report.reason) == (failure == "raised")
        assert report.pipeline is None and "Mul" in {op.type for op in traced.graph.get_operations()}

    def test_a_program_left_over_its_limit_by_a_failing_pass_is_said_to_be(self):
        """Nothing rewritten, nothing measured: the warning says what the memory model counts as traced
        against the limit, and what to do about it as well as about the failure."""
        tf_memsafe.enable("100kB")
        f = tf.function(lambda x: tf.reduce_sum(x[:, None] * x[None, :]), jit_compile=True)   # [1000, 1000]
        with hook.use_pipeline(Pipeline([FailingPass()])):
            with pytest.warns(RuntimeWarning) as rec:
                f(tf.ones([1000]))
        (said,) = [str(w.message) for w in rec if "tf_memsafe" in str(w.message)]
        assert "exactly as traced" in said, said
        assert "needs about 4.0 MB by the memory model, over its limit of 0.1 MB" in said, said
        assert "raise memory_limit" in said and "disabled_passes=['failing']" in said and "report it" in said

    def test_strict_raises_naming_the_pass(self):
        tf_memsafe.enable("1GB", strict=True)
        f = tf.function(lambda x: tf.sin(x), jit_compile=True)
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(), FailingPass()])):
            with pytest.raises(RewriteError) as info:
                f(X)
        assert info.value.pass_name == "failing"
        assert info.value.previous_passes == ("scale_outputs",)

    def test_strict_in_a_scope(self):
        tf_memsafe.enable("1GB")
        f = tf.function(lambda x: tf.sin(x), jit_compile=True)
        with hook.use_pipeline(Pipeline([FailingPass()])), tf_memsafe.options(strict=True):
            with pytest.raises(RewriteError):
                f(X)


class TestEnableLeavesResultsUnchanged:
    """``tf_memsafe.enable("1GB")`` with the product's pipeline changes no function's results."""

    @pytest.mark.parametrize("jit", [True, False])
    def test_functions(self, jit):
        fns = [
            lambda x: tf.reduce_sum(tf.square(x[:, None] - x[None, :]), -1),
            lambda x: tf.math.top_k(-tf.abs(x[:, None] - x[None, :]), k=2).indices,
            loop_and_cond,
            lambda x: tf.linalg.matmul(x[:, None], x[None, :]) @ tf.ones([3, 2]),
        ]
        expected = [tf.function(fn, jit_compile=jit)(X).numpy() for fn in fns]
        tf_memsafe.enable("1GB")
        got = [tf.function(fn, jit_compile=jit)(X).numpy() for fn in fns]
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(e, g)
        assert len(tf_memsafe.reports()) == len(fns)


class TestInternals:
    def test_unsupported_version_is_a_clear_error(self, monkeypatch):
        monkeypatch.setattr(tf, "__version__", "2.99.0")
        with pytest.raises(UnsupportedTensorFlowError, match=r"supports TensorFlow 2\.21, found 2\.99\.0"):
            tf_memsafe.enable("1GB")
        assert not tf_memsafe.is_enabled()

    def test_registration_is_idempotent_and_removable(self):
        from tensorflow.python.eager.polymorphic_function import transform

        tf_memsafe.enable("1GB")
        tf_memsafe.enable("2GB")
        assert transform.FUNC_GRAPH_TRANSFORMS.count(hook.transform) == 1
        tf_memsafe.disable()
        assert hook.transform not in transform.FUNC_GRAPH_TRANSFORMS

    def test_percentage_limit_resolves_against_physical_memory_on_cpu(self):
        tf_memsafe.enable("50%")
        with hook.use_pipeline(Pipeline([CountingPass()])):
            tf.function(lambda x: x + 1.0, jit_compile=True)(X)
        (report,) = tf_memsafe.reports()
        assert report.memory_limit_bytes == int(0.5 * _tf_internals.physical_memory_bytes())
