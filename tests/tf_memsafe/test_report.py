"""explain() and Report: the golden table, plain data, and a real measurement through the hook."""

import json
import threading

import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pass_base import Record
from grappler_ext.pipeline import Pipeline
from tests.fakes import ScaleOutputsPass
from tf_memsafe import hook
from tf_memsafe.report import Report, format_records

F32 = 4


def square_plus(a):
    return a * a + a


def unchanged_report() -> Report:
    """A kNN distance matrix, f32[20000, 20000] = 1.6e9 bytes, over a 1 GB limit and left alone."""
    return Report(
        function_name="knn",
        memory_limit_bytes=10**9,
        footprint_before_bytes=1_600_480_012,
        footprint_after_bytes=1_600_480_012,
        status="unchanged",
        reason="no pass found anything to rewrite",
        records=(
            Record("pairwise_distance", "skipped", ("Sum_1", "Square", "sub"), "D = 3 <= 32: already cheap",
                   bytes_before=1_600_000_000),
            Record("split", "skipped", ("MatMul", "Cholesky", "Mul", "Exp", "Add"),
                   "cannot split through `Cholesky`: no rule"),
        ),
    )


def rewritten_report() -> Report:
    """The same matrix rewritten into 80 MiB (a 1024-row chunk of 20000 f32 columns is 78 MiB)."""
    return Report("knn", 10**9, 1_600_480_012, 83_886_080, "rewritten", "", (
        Record("pairwise_distance", "rewritten", ("Sum_1", "sub"), "|x|^2 - 2 x y^T + |y|^2",
               1_600_000_000, 83_886_080),
    ))


class TestGoldenText:
    def test_unchanged_over_the_limit(self):
        assert str(unchanged_report()) == "\n".join([
            "tf_memsafe: knn  (limit 954 MiB)",
            "  footprint  1.49 GiB -> 1.49 GiB   OVER the limit by 573 MiB",
            "  status     unchanged: no pass found anything to rewrite",
            "  pass               action   bytes before -> after  ops                            reason",
            "  pairwise_distance  skipped  1.49 GiB               Sum_1, Square, sub             "
            "D = 3 <= 32: already cheap",
            "  split              skipped  -                      MatMul, Cholesky, Mul +2 more  "
            "cannot split through `Cholesky`: no rule",
        ])

    def test_rewritten_within_the_limit(self):
        assert str(rewritten_report()) == "\n".join([
            "tf_memsafe: knn  (limit 954 MiB)",
            "  footprint  1.49 GiB -> 80 MiB   within the limit (874 MiB to spare)",
            "  status     rewritten: 1 rewrite",
            "  pass               action     bytes before -> after  ops         reason",
            "  pairwise_distance  rewritten  1.49 GiB -> 80 MiB     Sum_1, sub  |x|^2 - 2 x y^T + |y|^2",
        ])

    def test_no_records_and_unknown_after_bytes(self):
        assert format_records([]) == ["(no pass records)"]
        rec = Record("p", "rewritten", (), "r", bytes_before=2048)
        assert format_records([rec])[1] == "p     rewritten  2 KiB -> ?             -    r"

    def test_the_time_line_says_what_was_timed(self):
        report = Report("f", 100, 10, 10, "unchanged", "", (), 0.5, 2.25, 1.5, hook.TraceCode.UNCHANGED)
        assert str(report).splitlines()[3] == ("  time       trace + compile 0.50 s as written, 2.25 s rewritten "
                                               "(the passes 1.50 s); nothing run")
        assert Report.from_dict(json.loads(json.dumps(report.to_dict()))) == report
        assert report.to_dict()["code"] == "unchanged"

    def test_lines_have_no_trailing_spaces(self):
        report = Report("f", 100, 10, 10, "unchanged", "", (Record("p", "skipped", ("a",), ""),))
        assert all(line == line.rstrip() for line in str(report).splitlines())


class TestPlainData:
    def test_json_round_trip(self):
        report = unchanged_report()
        data = json.loads(json.dumps(report.to_dict()))
        assert data == report.to_dict()
        assert data["records"][1]["ops"] == ["MatMul", "Cholesky", "Mul", "Exp", "Add"]
        assert data["within_limit"] is False
        assert Report.from_dict(data) == report

    def test_within_limit(self):
        assert not unchanged_report().within_limit
        assert rewritten_report().within_limit
        assert Report("f", 100, 200, 100, "rewritten").within_limit  # exactly at the limit fits


class TestExplain:
    def test_rewritten_function_reports_its_records_and_footprints(self):
        """f32[256, 256] in and out, fused: 512 KiB before; the scaled output fuses in too."""
        with tf_memsafe.options(memory_limit="1GB"), hook.use_pipeline(Pipeline([ScaleOutputsPass(2.0)])):
            report = tf_memsafe.explain(square_plus, tf.TensorSpec([256, 256]))
        assert report.function_name == "square_plus"
        assert report.status == "rewritten" and report.reason == "" and report.code == hook.TraceCode.REWRITTEN
        assert report.memory_limit_bytes == 10**9 and report.within_limit
        assert report.footprint_before_bytes == 2 * 256 * 256 * F32
        assert isinstance(report.footprint_after_bytes, int) and report.footprint_after_bytes > 0
        assert [(r.pass_name, r.action) for r in report.records] == [("scale_outputs", "rewritten")]
        assert "scale_outputs  rewritten" in str(report)
        json.dumps(report.to_dict())
        # Issue 30: the first call's parts, measured (trace + compile each way; the passes' share).
        assert report.compile_before_seconds > 0 and report.compile_after_seconds > 0
        assert 0 <= report.rewrite_seconds <= report.compile_after_seconds
        assert "  time       trace + compile " in str(report)

    def test_tf_function_is_not_traced_and_options_scope_applies(self):
        f = tf.function(square_plus, jit_compile=True)
        with tf_memsafe.options(memory_limit="1KiB", disabled_passes=["scale_outputs"]), \
                hook.use_pipeline(Pipeline([ScaleOutputsPass(2.0)])):
            report = tf_memsafe.explain(f, tf.TensorSpec([256, 256]))
        assert f.experimental_get_tracing_count() == 0
        assert report.status == "unchanged" and report.records == () and report.code == hook.TraceCode.UNCHANGED
        assert report.memory_limit_bytes == 1024 and not report.within_limit
        assert report.footprint_after_bytes == report.footprint_before_bytes

    def test_explain_while_disabled_leaves_tf_memsafe_disabled(self):
        assert not tf_memsafe.is_enabled()
        with hook.use_pipeline(Pipeline([ScaleOutputsPass(2.0)])):
            report = tf_memsafe.explain(square_plus, tf.TensorSpec([8]))
            assert report.status == "rewritten"
            assert not tf_memsafe.is_enabled()
            # And the hook really is off: a new jit function is traced untouched.
            out = tf.function(lambda x: x + 1.0, jit_compile=True)(tf.constant([1.0]))
        assert out.numpy().tolist() == [2.0]
        assert len(tf_memsafe.reports()) == 1  # explain's own trace only

    def test_explain_while_enabled_keeps_the_process_options(self):
        tf_memsafe.enable("2GB")
        report = tf_memsafe.explain(square_plus, tf.TensorSpec([8]))
        assert tf_memsafe.is_enabled() and tf_memsafe.get_options().memory_limit_bytes == 2 * 10**9
        assert report.memory_limit_bytes == 2 * 10**9

    def test_concurrent_explains_from_threads_leave_it_disabled(self):
        errors = []

        def work():
            try:
                tf_memsafe.explain(square_plus, tf.TensorSpec([8]))
            except Exception as e:  # noqa: BLE001 - surfaced by the assert below
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and not tf_memsafe.is_enabled()

    def test_explain_rewrites_only_its_own_thread(self):
        """While one thread explains, another thread's traces are left alone (tf_memsafe is off)."""
        seen = {}

        def other_thread():
            f = tf.function(lambda x: x * 3.0, jit_compile=True)
            seen["other"] = f(tf.constant([1.0])).numpy().tolist()

        with hook.use_pipeline(Pipeline([ScaleOutputsPass(2.0)])), hook.active_in_this_thread():
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            mine = tf.function(lambda x: x * 3.0, jit_compile=True)(tf.constant([1.0])).numpy().tolist()
        assert seen["other"] == [3.0]        # untouched
        assert mine == [6.0]                 # rewritten by the scaling pass
        assert not hook.is_installed()
        assert hook.transform not in __import__(
            "tensorflow.python.eager.polymorphic_function.transform", fromlist=["x"]).FUNC_GRAPH_TRANSFORMS

    def test_not_callable(self):
        with pytest.raises(TypeError, match="callable"):
            tf_memsafe.explain(42)
