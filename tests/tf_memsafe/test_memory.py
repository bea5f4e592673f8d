"""memory_footprint and peak_memory: XLA's own figure, measured without running, and the runtime peak."""

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import measure
from grappler_ext.pipeline import Pipeline
from tests.fakes import CountingPass
from tf_memsafe import hook, memory, xla_flags

F32 = 4


def add_one(a):
    return a + 1.0


def square_plus(a):
    return a * a + a


def pairwise_sq_dist(x, y):
    return tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)


class TestExactFigures:
    def test_fused_elementwise_is_parameter_plus_output(self):
        """a*a + a fuses into one loop: the program holds the f32[256,256] input and output only."""
        assert tf_memsafe.memory_footprint(square_plus, tf.TensorSpec([256, 256])) == 2 * 256 * 256 * F32

    def test_add_one(self):
        assert tf_memsafe.memory_footprint(add_one, tf.TensorSpec([1000])) == 2 * 1000 * F32

    def test_naive_distance_matrix_is_about_one_and_a_half_gigabytes(self):
        """[20000, 20000] f32 distances = 1.6e9 bytes (1.49 GiB); inputs are 2 x 240 kB."""
        total = tf_memsafe.memory_footprint(pairwise_sq_dist, tf.TensorSpec([20000, 3]), tf.TensorSpec([20000, 3]))
        assert 20000**2 * F32 <= total <= 20000**2 * F32 * 1.01

    def test_tensor_arguments_and_tf_functions(self):
        f = tf.function(square_plus, jit_compile=True)
        x = tf.ones([256, 256])
        assert tf_memsafe.memory_footprint(f, x) == 2 * 256 * 256 * F32
        # The user's function was not traced by the measurement.
        assert f.experimental_get_tracing_count() == 0


def test_repeated_and_interleaved_measurements_agree():
    specs = (tf.TensorSpec([300, 50]), tf.TensorSpec([400, 50]))
    first = [tf_memsafe.memory_footprint(pairwise_sq_dist, *specs),
             tf_memsafe.memory_footprint(square_plus, tf.TensorSpec([64, 64]))]
    again = [tf_memsafe.memory_footprint(square_plus, tf.TensorSpec([64, 64])),
             tf_memsafe.memory_footprint(pairwise_sq_dist, *specs)]
    assert first == again[::-1]
    assert first[0] >= 300 * 400 * 50 * F32  # d = 50: the [n, m, d] broadcast is materialised


def test_rewrite_false_measures_with_the_hook_suspended():
    tf_memsafe.enable("1GB")
    counter = CountingPass()
    with hook.use_pipeline(Pipeline([counter])):
        tf_memsafe.memory_footprint(square_plus, tf.TensorSpec([8]), rewrite=False)
        assert counter.seen == []
        tf_memsafe.memory_footprint(square_plus, tf.TensorSpec([8]))
        assert counter.seen == ["square_plus"]


class TestTapeFootprint:
    """With the tape outside a jit function, TF runs a forward and a backward XLA program.

    f(x, y) = sum(exp(-|x W - y|^2)) over [300, 400] pairs at D = 64: the forward keeps the
    [300, 400, 64] f32 difference (30.7 MB) as a side output for the backward, which reads it.
    """

    W = tf.Variable(tf.ones([64, 64]) * 0.01)

    @staticmethod
    def loss(x, y):
        d = tf.reduce_sum(tf.square(x[:, None] @ TestTapeFootprint.W - y[None]), -1)
        return tf.reduce_sum(tf.exp(-d))

    def test_equals_what_xla_reports_when_the_pair_runs(self):
        f = tf.function(self.loss, jit_compile=True)
        x, y = tf.random.normal([300, 64]), tf.random.normal([400, 64])
        measured = tf_memsafe.tape_footprint(f, x, y)
        with xla_flags.dump_for_one_compile() as folder:
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = f(x, y)
            tape.gradient(out, [x, self.W])
            reports = sorted(glob.glob(os.path.join(folder, "*after_optimizations-memory-usage-report.txt")))
            ran = [int(re.search(r"Total bytes used:\s*(\d+)", open(p).read()).group(1)) for p in reports]
        assert ran == [measured.forward, measured.backward]
        assert measured.total == sum(ran)
        assert measured.forward >= 300 * 400 * 64 * F32 and measured.backward >= 300 * 400 * 64 * F32
        assert str(measured).startswith("forward ") and " = " in str(measured)

    def test_specs_give_the_same_figures_and_rewrite_false_skips_the_hook(self):
        specs = (tf.TensorSpec([30, 64]), tf.TensorSpec([40, 64]))
        tf_memsafe.enable("1GB")
        counter = CountingPass()
        with hook.use_pipeline(Pipeline([counter])):
            before = tf_memsafe.tape_footprint(self.loss, *specs, rewrite=False)
            assert counter.seen == []
            after = tf_memsafe.tape_footprint(self.loss, *specs)
            assert counter.seen == ["loss"]
        assert before == after  # the counting pass changes nothing


def test_a_graph_with_an_argument_nothing_reads_is_measured():
    """A target the loss ignores is an input of the traced graph that no op reads: the copy compiled
    to measure the graph maps only the arguments read (import_graph_def refuses to map the others)."""
    fn = tf.function(lambda x, unused: tf.reduce_sum(x * 2.0), jit_compile=True)
    graph = fn.get_concrete_function(tf.TensorSpec([100, 100]), tf.TensorSpec([7])).graph
    assert memory.graph_bytes(graph) > 0


def test_a_graph_copied_to_be_measured_later_is_measured_as_it_was():
    """The splitter weighs a plan over the limit against the program as written without undoing the plan
    and building it again: the copy taken before the plan, compiled after it, gives the figure the graph
    had then; a copy that cannot be compiled raises when asked (``grappler_ext.measure`` records why)."""
    fn = tf.function(lambda x: tf.reduce_sum(tf.exp(x[:, None, :] - x[None, :, :])), jit_compile=True)
    graph = fn.get_concrete_function(tf.TensorSpec([300, 8])).graph
    written = memory.graph_bytes(graph)
    later = memory.XlaMeasurer().program_bytes_later(graph)
    with graph.as_default():                                   # the graph changes: its output is [300, 8] smaller
        small = tf.reduce_sum(graph.inputs[0])
    graph.outputs[0] = small
    assert memory.graph_bytes(graph) < written and later() == written
    figure = measure.program_figure_later(memory.XlaMeasurer(), graph)
    assert figure().bytes == memory.graph_bytes(graph)
    dynamic = tf.function(lambda x: x * 2.0, jit_compile=True).get_concrete_function(tf.TensorSpec([None])).graph
    failed = measure.program_figure_later(memory.XlaMeasurer(), dynamic)()
    assert failed.bytes is None and "without a static shape" in failed.failure, failed
    assert measure.program_figure_later(None, graph) is None


def test_peak_memory_bounds_the_footprint_from_above():
    x, y = tf.random.normal([1000, 64]), tf.random.normal([1500, 64])
    f = tf.function(pairwise_sq_dist, jit_compile=True)
    footprint = tf_memsafe.memory_footprint(f, x, y)
    peak = tf_memsafe.peak_memory(f, x, y)
    assert peak >= 1000 * 1500 * F32            # at least the output
    assert peak >= 0.5 * footprint               # the allocator saw the big temporary


def test_the_reset_flag_is_first_and_user_flags_are_kept():
    assert os.environ["XLA_FLAGS"].split()[0] == xla_flags.RESET_FLAG


def _run(code: str, env_flags: str | None, *argv: str):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("XLA_FLAGS", None)
    if env_flags is not None:
        env["XLA_FLAGS"] = env_flags
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], env=env, capture_output=True,
                          text=True, timeout=240)


_USER_DUMP = """
    import json, os, sys, glob
    if sys.argv[1] == "with":
        import tf_memsafe
    import tensorflow as tf

    def listing():
        return sorted(os.listdir(sys.argv[2]))

    print("FLAGS", json.dumps(os.environ["XLA_FLAGS"]))
    tf.function(lambda a: a * 2.0 + 1.0, jit_compile=True)(tf.ones([8]))
    print("FIRST", json.dumps(listing()))
    if sys.argv[1] == "with":
        def measured(a):
            return a * 3.0 + a
        print("MEASURED", tf_memsafe.memory_footprint(measured, tf.TensorSpec([64])))
        tf.function(lambda a: a * 2.0 + 1.0, jit_compile=True)(tf.ones([8]))
        print("SECOND", json.dumps(listing()))
        print("PRIVATE", json.dumps([p for root in tf_memsafe.xla_flags.dump_roots()
                                     for p in glob.glob(os.path.join(root, f"tf_memsafe_*_{os.getpid()}_*"))]))
"""


@pytest.mark.slow
def test_the_users_dump_flags_work_with_tf_memsafe_as_without_it(tmp_path):
    """Issue 27: with ``.*``, ``=`` and a quoted path with a space in the user's XLA_FLAGS, importing
    tf_memsafe keeps the value byte for byte; XLA dumps the user's compiles into the user's directory
    as it does without tf_memsafe; a measurement still gives its figure, its compile goes to its own
    directory despite the user's module filter, and later compiles dump only where the user said."""
    user_dir = tmp_path / "user dumps"
    user_flags = f'--xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=lambda|x=y --xla_dump_to="{user_dir}"'
    runs = {}
    for mode in ("without", "with"):
        shutil.rmtree(user_dir, ignore_errors=True)
        out = _run(_USER_DUMP, user_flags, mode, str(user_dir))
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = {k: json.loads(v) for k, v in (line.split(" ", 1) for line in out.stdout.splitlines())}
    without, with_ = runs["without"], runs["with"]
    assert without["FLAGS"] == user_flags
    assert with_["FLAGS"] == f"{xla_flags.RESET_FLAG} {user_flags}"

    def kinds(names):  # file names with the module's and the pass's numbers taken out
        return sorted(re.sub(r"\d+", "N", n) for n in names)

    assert len(without["FIRST"]) > 10                      # every pass dumped (.*), as the user asked
    assert kinds(with_["FIRST"]) == kinds(without["FIRST"])
    assert with_["MEASURED"] == 64 * F32 * 2
    assert kinds(set(with_["SECOND"]) - set(with_["FIRST"])) == kinds(with_["FIRST"])  # a later compile, the same
    assert not any("measured" in n for n in with_["SECOND"])  # the measurement's compile went elsewhere
    assert with_["PRIVATE"] == []                          # ... and nothing dumps there any more


def test_a_measurement_leaves_no_dump_setting_behind():
    """XLA keeps the last value it read of a flag; after a measurement the dump flags are back to
    their defaults, so later compiles write nothing into a (deleted) private directory."""
    private = [os.path.join(root, f"tf_memsafe_xla_dump_{os.getpid()}_*") for root in xla_flags.dump_roots()]
    assert tf_memsafe.memory_footprint(add_one, tf.TensorSpec([16])) == 2 * 16 * F32
    tf.function(lambda a: a * 5.0, jit_compile=True)(tf.ones([4]))
    assert [p for pattern in private for p in glob.glob(pattern)] == []


class TestFastCodegen:
    """Programs compiled only to be measured are generated at LLVM's level 0 on XLA:CPU: the same
    figure as at XLA's default level (the buffer assignment comes before code generation), and the
    program the user runs is compiled afresh, at the default level."""

    @staticmethod
    def step(x, w):
        def body(i, acc):
            piece = tf.slice(x, [i * 64, 0], [64, 96])
            return i + 1, acc + tf.reduce_sum(tf.nn.softmax(piece @ w @ tf.transpose(x)), 0)
        return tf.while_loop(lambda i, acc: i < 8, body, (0, tf.zeros([512])))[1]

    def figures(self, fast: bool, monkeypatch) -> list[int]:
        monkeypatch.setattr(memory, "_measuring",
                            lambda sizing_only=False: xla_flags.dump_for_one_compile(fast_codegen=fast))
        specs = (tf.TensorSpec([512, 96]), tf.TensorSpec([96, 96]))
        loop = tf.function(self.step, jit_compile=True, autograph=False)
        return [memory.compiled_bytes(loop, *specs),
                tf_memsafe.memory_footprint(pairwise_sq_dist, tf.TensorSpec([300, 7]), tf.TensorSpec([200, 7])),
                *dataclasses.astuple(tf_memsafe.tape_footprint(TestTapeFootprint.loss, tf.TensorSpec([300, 64]),
                                                               tf.TensorSpec([40, 64])))]

    def test_gives_the_default_levels_figures(self, monkeypatch):
        memory._FIGURES.clear()
        fast = self.figures(True, monkeypatch)
        memory._FIGURES.clear()
        assert fast == self.figures(False, monkeypatch)
        assert fast[1] >= 300 * 200 * F32

    def test_is_what_a_measurement_on_the_cpu_asks_for_and_the_run_compiles_its_own(self):
        asked = []
        real = xla_flags.dump_for_one_compile

        def spy(**kw):
            asked.append(kw)
            return real(**kw)

        f = tf.function(lambda a: tf.reduce_sum(a @ tf.transpose(a)), jit_compile=True)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(xla_flags, "dump_for_one_compile", spy)
            tf_memsafe.memory_footprint(f, tf.TensorSpec([128, 32]))
        assert asked == [{"fast_codegen": True, "sizing_only": False}]
        last = {g.name: g.value for g in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
        assert last["--xla_backend_optimization_level"] == "3"
        with xla_flags.dump_all_compiles(in_memory=True) as folder:
            f(tf.ones([128, 32]))
            assert len(xla_flags.memory_reports(folder)) == 1       # compiled for the run, not reused


class TestSizingOnly:
    """A loop the splitter compiles alone to size its chunk is compiled without XLA:CPU's fusion
    emitters (about half the compile time); what is held against the limit is compiled as it runs."""

    def test_a_loop_alone_has_the_figure_it_has_with_the_emitters(self):
        specs = (tf.TensorSpec([512, 96]), tf.TensorSpec([96, 96]))
        loop = tf.function(TestFastCodegen.step, jit_compile=True, autograph=False)
        memory._FIGURES.clear()
        exact = memory.compiled_bytes(loop, *specs)
        sized = memory.compiled_bytes(loop, *specs, sizing_only=True)     # (not the exact one remembered)
        assert sized == exact >= 64 * 512 * F32

    def test_the_splitters_loops_alone_ask_for_it_and_its_programs_do_not(self, monkeypatch):
        asked = []
        real = xla_flags.dump_for_one_compile

        def spy(**kw):
            asked.append(kw)
            return real(**kw)

        monkeypatch.setattr(xla_flags, "dump_for_one_compile", spy)
        memory._FIGURES.clear()
        measurer = memory.XlaMeasurer()
        f = tf.function(lambda a: tf.reduce_sum(a @ tf.transpose(a)), jit_compile=True)
        measurer.function_bytes(f, [tf.TensorSpec([128, 32])])
        measurer.program_bytes(f.get_concrete_function(tf.TensorSpec([128, 32])).graph)
        assert asked == [{"fast_codegen": True, "sizing_only": True}, {"fast_codegen": True, "sizing_only": False}]
        last = {g.name: g.value for g in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
        assert last["--xla_cpu_use_fusion_emitters"] == "true"


@pytest.mark.slow
def test_measurement_after_xla_already_read_its_flags_is_a_clear_error():
    code = """
        import tensorflow as tf
        tf.function(lambda a: a + 1.0, jit_compile=True)(tf.ones([4]))   # XLA reads XLA_FLAGS now
        import tf_memsafe
        try:
            tf_memsafe.memory_footprint(lambda a: a * 2.0, tf.TensorSpec([4]))
        except tf_memsafe.MeasurementError as e:
            print("ERROR", e)
    """
    out = _run(code, None)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR XLA wrote no memory-usage report" in out.stdout
    assert "Import tf_memsafe before the first XLA compile" in out.stdout


def test_python_defaults_and_keyword_only_arguments():
    """TF 2.21's get_compiler_ir drops Python defaults; the measurement fills them in."""
    def scaled(a, scale=2.0, *, b):
        return a * scale + b

    f = tf.function(scaled, jit_compile=True)
    assert tf_memsafe.memory_footprint(f, tf.ones([64]), b=tf.ones([64])) >= 3 * 64 * F32
    assert tf_memsafe.memory_footprint(f, tf.ones([64]), scale=3.0, b=tf.ones([64])) >= 3 * 64 * F32


def test_a_spec_of_run_time_size_is_refused_naming_it():
    """A function with an input_signature of run-time sizes is measured at the shape it is given; a spec
    with an unknown dimension has no figure (XLA's bridge would say "Only support static input shape"
    of its own placeholders)."""
    f = tf.function(lambda x: tf.reduce_sum(x * x), jit_compile=True, input_signature=[tf.TensorSpec([None, 3])])
    with pytest.raises(tf_memsafe.MeasurementError, match=r"shape=\(None, 3\).*Pass a tensor, or a TensorSpec"):
        tf_memsafe.memory_footprint(f, tf.TensorSpec([None, 3]))
    with pytest.raises(tf_memsafe.MeasurementError, match="known only at run time"):
        tf_memsafe.explain(f, tf.TensorSpec([None, 3]))
    assert tf_memsafe.memory_footprint(f, tf.TensorSpec([10, 3])) >= 120


class TestVariablesNotInitializedYet:
    """Issue 27: a variable created in the trace being measured (a Keras optimizer's slots at its first
    step) is not initialized while the hook measures the graph; XLA's GetCompilerIr would fail a
    RET_CHECK there and print a C++ stack trace to fd 2 before the error reaches Python.  The
    measurement is refused up front instead, and the user's figure comes out clean."""

    def test_refused_before_xla_is_asked(self, capfd):
        from tensorflow.python.ops import resource_variable_ops

        pending = resource_variable_ops.UninitializedVariable(shape=[4], dtype=tf.float32)
        fn = tf.function(lambda a: a + pending.read_value(), jit_compile=True)
        with pytest.raises(tf_memsafe.MeasurementError, match="not an initialized variable"):
            tf_memsafe.memory.compiled_bytes(fn, tf.TensorSpec([4]))
        assert "Begin stack trace" not in capfd.readouterr().err

    @pytest.mark.slow
    def test_a_training_step_prints_no_stack_trace(self):
        code = """
            import tensorflow as tf, tf_memsafe, keras
            tf_memsafe.enable("200KB")          # the program (82 kB) is checked with XLA while traced
            w, steps = tf.Variable(tf.ones([64, 64])), tf.Variable(0.0)
            optimizer = keras.optimizers.Adam()  # its slots are created in the first trace

            @tf.function(jit_compile=True)
            def step(x):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
                optimizer.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
                steps.assign_sub(-1.0)
                return loss

            print("FIGURE", tf_memsafe.memory_footprint(step, tf.ones([32, 64])))
        """
        out = _run(code, None)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Begin stack trace" not in out.stderr and "RET_CHECK" not in out.stderr, out.stderr[-3000:]
        assert int(out.stdout.split("FIGURE ", 1)[1]) >= 64 * 64 * F32 * 3   # weights and Adam's two slots


def test_another_threads_compile_in_the_dump_folder_does_not_count(tmp_path):
    """XLA_FLAGS is the process's: while a measurement's dump folder is set, another thread's compile
    may write its report there too.  Only the measured function's module counts."""
    from tf_memsafe.memory import _read_total_bytes

    for module, total in (("a_inference_knn_123__.5", 1000), ("a_inference_train_step_1234__.9", 50_000)):
        (tmp_path / f"module_0001.{module}.cpu_after_optimizations-memory-usage-report.txt").write_text(
            f"Total bytes used: {total} (1.0KiB)\n")
    assert _read_total_bytes(str(tmp_path), b"__inference_knn_123") == 1000
    assert _read_total_bytes(str(tmp_path), "__inference_train_step_1234") == 50_000
    assert _read_total_bytes(str(tmp_path)) == 51_000              # no name: every program dumped


class TestProgramsMeasuredOnce:
    """A program traced alike again (the same loop of another layer, a region planned again) is not
    compiled again: its fingerprint ignores the names TensorFlow numbers (loop bodies, branches)."""

    @staticmethod
    def loop(rows, scope="layer"):
        def fn(x):
            def body(i, acc):
                piece = tf.slice(x, [i * rows, 0], [rows, 64])
                return i + 1, acc + tf.reduce_sum(tf.exp(piece @ tf.transpose(x)))
            with tf.name_scope(scope):
                return tf.while_loop(lambda i, acc: i < 4096 // rows, body, (0, 0.0))[1]
        return tf.function(fn, jit_compile=True, autograph=False)

    def test_loops_built_alike_have_one_fingerprint_and_others_another(self):
        spec = tf.TensorSpec([4096, 64])
        prints = [memory.program_fingerprint(self.loop(rows).get_concrete_function(spec).graph.as_graph_def())
                  for rows in (256, 256, 512)]
        assert prints[0] == prints[1] != prints[2]

    def test_the_names_of_a_models_layers_do_not_change_it(self):
        """Two layers' loops built alike have their ops named after each layer (``encoder/...``,
        ``encoder_1/...``), in the graph and in the loop's body: one fingerprint, one compile."""
        spec = tf.TensorSpec([4096, 64])
        definitions = [self.loop(256, scope).get_concrete_function(spec).graph.as_graph_def()
                       for scope in ("encoder", "encoder_1")]
        assert {n.name for n in definitions[0].node} != {n.name for n in definitions[1].node}
        assert memory.program_fingerprint(definitions[0]) == memory.program_fingerprint(definitions[1])

    def test_a_program_measured_again_is_not_compiled_again(self, monkeypatch):
        spec = tf.TensorSpec([4096, 64])
        compiles = []
        real = xla_flags.dump_for_one_compile
        monkeypatch.setattr(xla_flags, "dump_for_one_compile", lambda **kw: (compiles.append(1), real(**kw))[1])
        first = memory.compiled_bytes(self.loop(128), spec)
        again = memory.compiled_bytes(self.loop(128), spec)           # another tf.function, built alike
        other = memory.compiled_bytes(self.loop(1024), spec)
        assert first == again and len(compiles) == 2
        assert other > first                                          # [1024, 4096] slices, not [128, 4096]

    def test_a_footprint_asked_again_of_a_program_built_alike_is_not_compiled_again(self, monkeypatch):
        """``memory_footprint`` of a model's step as written, asked again (another layer's alike, the
        same step traced afresh): remembered; at another shape, compiled."""
        monkeypatch.setattr(memory, "_FIGURES", type(memory._FIGURES)())     # (nothing from other tests)
        compiles = []
        real = xla_flags.dump_for_one_compile
        monkeypatch.setattr(xla_flags, "dump_for_one_compile", lambda **kw: (compiles.append(1), real(**kw))[1])
        figures = [tf_memsafe.memory_footprint(self.loop(256, scope), tf.TensorSpec([4096, 64]), rewrite=False)
                   for scope in ("encoder", "encoder_1")]
        wider = tf_memsafe.memory_footprint(self.loop(256), tf.TensorSpec([8192, 64]), rewrite=False)
        assert figures[0] == figures[1] and len(compiles) == 2 and wider > figures[0]

    def test_the_program_measured_is_the_program_a_call_compiles(self, monkeypatch):
        """A jit function's call traces it inside an XLA context, and the splitter builds its loops
        there, after the function's body: built for XLA (``_xla_propagate_compile_time_consts``).
        ``get_concrete_function`` has no such context.  ``memory_footprint`` traces its copy as a
        call does: the program it measures is the call's, fingerprint for fingerprint (before, the
        loops differed, so it measured a program no call ran, and none of the splitter's figures
        from the call were found again)."""
        @tf.function(jit_compile=True)
        def nearest(q, p):
            return tf.argmax(q @ tf.transpose(p), axis=1)      # [2000, 3000] scores, 24 MB

        q, p = tf.random.stateless_normal([2000, 64], [1, 2]), tf.random.stateless_normal([3000, 64], [3, 4])
        tf_memsafe.enable("4MB")
        with tf_memsafe.options(strict=True):
            nearest(q, p)
            call = nearest.get_concrete_function(q, p).graph
            assert any(op.type in ("While", "StatelessWhile") for op in call.get_operations())
            measured = []
            real = memory._remembered
            monkeypatch.setattr(memory, "_remembered", lambda fn, concrete, definition, *rest, **kw: (
                measured.append(memory.program_fingerprint(definition)),
                real(fn, concrete, definition, *rest, **kw))[1])
            tf_memsafe.memory_footprint(nearest, q, p)
        assert measured[-1] == memory.program_fingerprint(call.as_graph_def())
