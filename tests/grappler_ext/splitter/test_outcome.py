"""splitter.outcome and driver: decisions as values, rendered for people; one run's state per run.

The thread test traces two functions at the same time under two limits (16 MB and 4 MB) through
one shared pipeline, as the hook does: each trace gets the plan it gets alone.
"""

import json
import threading

import numpy as np
import tensorflow as tf

import tf_memsafe
from grappler_ext.pass_base import PassResult, Record
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import CANNOT_SPLIT, Code, LoopPlan, RootSplit, Sizing, Splitter
from grappler_ext.splitter.outcome import BestEffort
from tf_memsafe import hook
from tf_memsafe.memory import XlaMeasurer
from tf_memsafe.report import Report


def loop_plan(**overrides):
    fields = dict(roots=(RootSplit("TopKV2", "TopKV2", "top_k", (1, None)), RootSplit("Sum", "Sum", "sum", (0, None))),
                  length=20000, chunk=520, backward_chunk=520, predicted_bytes=10**6)
    return LoopPlan(**{**fields, **overrides})


class TestLoopPlan:
    def test_rendered_from_its_values(self):
        plan = loop_plan(backward_chunk=100, has_gradient_loop=True, sizing=Sizing.LOOP_FIGURE, bytes_per_row=4096.4,
                         rebuilt_gradients=2, prologue_ops=("k", "v"))
        assert (plan.steps, plan.tail, plan.backward_steps, plan.backward_tail) == (38, 240, 200, 0)
        assert plan.split_input == (0, 1)
        assert plan.render() == ("`TopKV2` top_k over input 0 axis 1 and `Sum` sum: 38 x 520 + 240 of 20000; chunk "
                                 "from XLA's figure for the loop (4,096 B a row); its gradient 200 x 100; 2 gradients "
                                 "inside the function rebuilt; 2 ops before it recomputed in the gradient")

    def test_where_the_chunk_came_from_and_a_best_effort(self):
        failed = loop_plan(sizing=Sizing.MODEL_MEASURE_FAILED, sizing_detail="MeasurementError",
                           best_effort=BestEffort(3 * 10**6, stop="`x` is an input"))
        assert failed.render().endswith("; chunk from the memory model (measuring the loop failed: MeasurementError); "
                                        "best effort, the limit cannot be met (3,000,000 B needed; the region stops "
                                        "where `x` is an input)")
        whole = loop_plan(sizing=Sizing.PROGRAM_FIGURE, bytes_per_row=10.0, loop_figure_bytes=123_456)
        assert "which is the program (123,456 B at this chunk, 10 B a row)" in whole.render()

    def test_a_record_round_trips_through_json_with_its_code_and_plan(self):
        result = PassResult("splitter")
        result.rewrote(["a"], loop_plan().render(), 10, 5, code=Code.SPLIT, plan=loop_plan())
        data = json.loads(json.dumps(result.records[0].to_dict()))
        assert data["code"] == "split" and data["plan"]["chunk"] == 520
        again = Record(**{**data, "ops": tuple(data["ops"])})
        assert again.code == Code.SPLIT                       # a str enum equals its value


def test_the_cannot_split_codes_are_those_of_a_large_tensor_left_whole():
    assert Code.SPLIT not in CANNOT_SPLIT and Code.FITS_WHOLE not in CANNOT_SPLIT
    assert {Code.NO_ROOT, Code.REFUSED_OP, Code.NO_PLAN} <= CANNOT_SPLIT


def test_a_report_keeps_the_plan_as_data():
    rec = Record("splitter", "rewritten", ("a",), loop_plan().render(), 10, 5, Code.SPLIT, loop_plan())
    report = Report("f", 100, 10, 5, "rewritten", "", (rec,))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["records"][0]["plan"]["length"] == 20000
    assert Report.from_dict(data).records[0].code == Code.SPLIT


def sq_dist(x, y):
    return tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)


def knn(x, y):
    return tf.math.top_k(-sq_dist(x, y), k=5).indices


def test_two_threads_tracing_at_once_under_two_limits_each_get_their_own_plan():
    """One pipeline, shared as the hook shares it; kNN of 4000 x 4000 points (a 64 MB distance
    matrix) under 16 MB and, in another thread at the same moment, under 4 MB."""
    x = tf.constant(np.random.default_rng(0).standard_normal((4000, 3)), tf.float32)
    y = tf.constant(np.random.default_rng(1).standard_normal((4000, 3)), tf.float32)
    expected = tf.function(knn, jit_compile=True)(x, y).numpy()
    shared = Pipeline([Splitter(XlaMeasurer())])

    def trace(limit):
        with hook.active_in_this_thread(), tf_memsafe.options(memory_limit=limit, strict=True):
            fn = tf.function(knn, jit_compile=True)
            fn.get_concrete_function(x, y)
            return fn, fn(x, y).numpy()

    def plans(mark):
        out = {}
        for rep in hook.reports_since(mark):
            (split,) = [r for r in rep.records if r.code == Code.SPLIT]
            out[rep.memory_limit_bytes] = split.plan
        return out

    with hook.use_pipeline(shared):
        mark = hook.report_mark()
        alone = {limit: trace(limit)[1] for limit in (16 * 10**6, 4 * 10**6)}
        expected_plans = plans(mark)
        mark = hook.report_mark()
        barrier, results, errors = threading.Barrier(2), {}, []

        def worker(limit):
            try:
                barrier.wait()
                results[limit] = trace(limit)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(limit,)) for limit in (16 * 10**6, 4 * 10**6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        together = plans(mark)
    assert together == expected_plans and together[16 * 10**6].chunk > together[4 * 10**6].chunk
    for limit, (_, got) in results.items():
        assert np.mean(got == expected) > 0.99 and np.mean(alone[limit] == expected) > 0.99
        with hook.use_pipeline(shared), tf_memsafe.options(memory_limit=limit):
            with hook.active_in_this_thread():
                assert tf_memsafe.memory_footprint(knn, x, y) <= limit
