"""``python -m tf_memsafe``: runs a script or module unchanged, then summarises; bad input, one line.

A script's run and a module's each start a Python process (TensorFlow's import costs seconds), so there
are two of them; they also show that ``python -m tf_memsafe`` is ``main()`` and keeps the exit status.
Everything refused before the target starts (``--help``, a missing script, a bad limit, an unknown pass)
is checked by calling ``main()`` in this process: it exits in argument parsing, before anything is
enabled or run, so what it writes and its exit status are the process's.
"""

import os
import re
import subprocess
import sys
import textwrap

import tf_memsafe
from grappler_ext.pipeline import DEFAULT_ORDER
from tf_memsafe.config import known_pass_names

PROG = "python -m tf_memsafe"

SCRIPT = textwrap.dedent("""\
    import sys

    import tensorflow as tf


    @tf.function(jit_compile=True)
    def double_it(x):
        return x * 2.0


    print("result", double_it(tf.constant([1.5])).numpy().tolist())
    print("argv", sys.argv[1:], sys.argv[0].endswith("script.py"))
    print("name", __name__)
""")


def run_cli(*args, cwd, pythonpath=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tf_memsafe", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def run_main(argv, capsys) -> tuple[int, str, str]:
    """``main(argv)`` in this process, which must exit before running anything: its exit status, stdout
    and stderr (a Traceback would be an exception other than SystemExit, failing the test here)."""
    from tf_memsafe.__main__ import main

    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    else:
        raise AssertionError(f"main({argv}) returned instead of exiting")
    out, err = capsys.readouterr()
    return code, out, err


def test_script_runs_unchanged_with_its_args_and_a_summary_follows(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = run_cli("--memory-limit", "4GB", "--explain", "script.py", "a", "--flag", "-m", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "result [3.0]\nargv ['a', '--flag', '-m'] True\nname __main__\n"
    assert "tf_memsafe: 1 function traced" in proc.stderr
    # 4 GB = 3.73 GiB; the product pipeline may or may not rewrite a doubling.  A [1] f32 input and
    # output: the model says 8 B; XLA's figure, measured while the script ran, is 12 B (the constant
    # 2.0 gets a buffer of its own).
    assert re.search(r"^  double_it  (rewritten|unchanged)  limit 3\.73 GiB  model 8 B -> XLA 12 B  "
                     r"passes \d+\.\d\d s  \S", proc.stderr, re.MULTILINE), proc.stderr
    assert "Traceback" not in proc.stderr


def test_module_gets_its_args_and_its_exit_status_is_kept(tmp_path):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "exits_three.py").write_text(
        "import sys\nprint('module', __name__, sys.argv[1:])\nsys.exit(3)\n")
    proc = run_cli("--memory-limit", "512MiB", "-m", "exits_three", "x", "--y", cwd=tmp_path,
                   pythonpath=tmp_path / "mods")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "module __main__ ['x', '--y']\n"
    assert "tf_memsafe: no tf.function was traced while enabled" in proc.stderr
    assert "Traceback" not in proc.stderr


class TestInProcess:
    """Argument handling that exits before anything runs: no process needed."""

    def test_help_documents_the_options(self, capsys):
        code, out, _ = run_main(["--help"], capsys)
        assert code == 0
        for option in ("--memory-limit", "--explain", "--disable-pass", "--strict", "--redraw-random",
                       "--no-measure", "-m MODULE"):
            assert option in out
        assert out.startswith(f"usage: {PROG} [options] script.py [args ...]")
        assert not tf_memsafe.is_enabled()

    def test_missing_script_is_one_line_error(self, tmp_path, monkeypatch, capsys):
        monkeypatch.chdir(tmp_path)
        code, out, err = run_main(["--memory-limit", "4GB", "no_such_script.py"], capsys)
        assert code == 2 and out == ""
        assert err == f"{PROG}: error: can't open file 'no_such_script.py': no such file (see --help)\n"
        assert not tf_memsafe.is_enabled()

    def test_bad_memory_limit_names_the_accepted_forms(self, tmp_path, monkeypatch, capsys):
        monkeypatch.chdir(tmp_path)
        (tmp_path / "script.py").write_text("print('must not run')\n")
        code, out, err = run_main(["--memory-limit", "4 gigs", "script.py"], capsys)
        assert code == 2
        assert out == ""
        (line,) = err.splitlines()
        assert line.startswith(f"{PROG}: error: ")
        assert "invalid memory limit '4 gigs'" in line and "'4GB'" in line and "GiB" in line and "'80%'" in line
        assert not tf_memsafe.is_enabled()

    def test_unknown_pass_is_one_line_error_and_the_script_does_not_run(self, tmp_path, monkeypatch, capsys):
        """Issue 27, item 5: a typo in --disable-pass used to run the splitter anyway, with exit status 0."""
        monkeypatch.chdir(tmp_path)
        (tmp_path / "script.py").write_text("print('must not run')\n")
        code, out, err = run_main(["--memory-limit", "4GB", "--disable-pass", "spliter", "script.py"], capsys)
        assert code == 2
        assert out == ""
        # (in this process, the passes other tests registered are known too: a fresh one knows the
        # product's own, DEFAULT_ORDER)
        known = known_pass_names()
        assert set(DEFAULT_ORDER) <= set(known)
        assert err.splitlines() == [
            f"{PROG}: error: argument --disable-pass: unknown pass 'spliter' (did you mean 'splitter'?); "
            f"known passes: {', '.join(sorted(known))} (see --help)"]
        assert not tf_memsafe.is_enabled()

    def test_unknown_flag_is_one_line_error(self, tmp_path, capsys):
        script = tmp_path / "script.py"
        script.write_text("raise SystemExit('must not run')\n")
        code, _, err = run_main(["--bogus", str(script)], capsys)
        assert code == 2
        assert err == f"{PROG}: error: unrecognized arguments: --bogus (see --help)\n"

    def test_unknown_pass_is_refused_while_parsing(self, tmp_path, capsys):
        script = tmp_path / "script.py"
        script.write_text("raise SystemExit('must not run')\n")
        code, _, err = run_main(["--disable-pass", "splitter", "--disable-pass", "no_such_pass", str(script)], capsys)
        assert code == 2
        assert not tf_memsafe.is_enabled()
        (line,) = err.splitlines()
        assert line.startswith(f"{PROG}: error: argument --disable-pass: unknown pass 'no_such_pass'; known passes: ")
        assert all(name in line for name in DEFAULT_ORDER)

    def test_known_pass_names_are_taken(self):
        from tf_memsafe.__main__ import _parser

        parser, _ = _parser()
        args = parser.parse_args(["--disable-pass", "splitter", "--disable-pass", "matrix_chain", "s.py"])
        assert args.disable_pass == ["splitter", "matrix_chain"]

    def test_split_ends_our_options_at_the_script_or_after_the_module(self):
        from tf_memsafe.__main__ import _parser, _split

        _, takes_value = _parser()
        assert _split(["--memory-limit", "4GB", "s.py", "--strict"], takes_value) == (
            ["--memory-limit", "4GB", "s.py"], ["--strict"])
        assert _split(["--strict", "-m", "pkg.mod", "-m", "x"], takes_value) == (
            ["--strict", "-m", "pkg.mod"], ["-m", "x"])
        assert _split(["--disable-pass", "a.py", "--", "s.py", "b"], takes_value) == (
            ["--disable-pass", "a.py", "--", "s.py"], ["b"])


class TestMeasuredFigures:
    """How XLA's module names map back to the traced functions (no process started)."""

    MODULES = [("a_inference_knn_313__XlaMustCompile_true_", 100), ("a_forward_loss_95__XlaMustCompile_true_", 60),
               ("a_inference___backward_loss_30_96__XlaMustCompile_true_", 70),
               ("a_inference_knn_400__XlaMustCompile_true_", 120), ("cluster_0__XlaCompiledKernel_true_", 5)]

    def test_programs_by_function_and_kind_in_compile_order(self):
        from tf_memsafe.__main__ import _xla_programs

        programs = _xla_programs(self.MODULES)
        assert {k: dict(v) for k, v in programs.items()} == {
            "knn": {"inference": [100, 120]}, "loss": {"forward": [60], "backward": [70]}}

    def test_each_trace_gets_its_own_programs(self):
        from tf_memsafe.__main__ import _measured, _xla_programs
        from tf_memsafe.hook import TraceReport

        programs = _xla_programs(self.MODULES)
        assert _measured(TraceReport("knn", True, "unchanged"), 1, programs) == "XLA 120 B"
        assert _measured(TraceReport("loss", True, "unchanged"), 0, programs) == "XLA fwd 60 B + bwd 70 B"
        assert _measured(TraceReport("other", True, "unchanged"), 0, programs) == "not compiled"

    def test_a_first_trace_traced_again_takes_no_program(self):
        """A first trace that created variables is never compiled: the trace after it gets the first program."""
        from tf_memsafe.__main__ import _summary
        from tf_memsafe.hook import TraceReport

        traces = [TraceReport("knn", True, "skipped", "the first trace, ...", retraced=True),
                  TraceReport("knn", True, "unchanged", "no pass found anything to rewrite"),
                  TraceReport("knn", True, "unchanged", "no pass found anything to rewrite")]
        lines = _summary(traces, False, self.MODULES).splitlines()[1:]
        assert ["never compiled" in line for line in lines] == [True, False, False]
        assert ["XLA 100 B" in lines[1], "XLA 120 B" in lines[2]] == [True, True]

    def test_the_shapes_a_function_was_checked_at_as_it_ran_follow_its_line(self):
        from tf_memsafe.__main__ import _summary
        from tf_memsafe.hook import TraceReport
        from tf_memsafe.run_check import ShapeCheck

        checks = [ShapeCheck(((900, 3),), 900, 1000), ShapeCheck(((2000, 3),), 2000, 1000)]
        traces = [TraceReport("knn", True, "rewritten", memory_limit_bytes=1000, run_checks=checks),
                  TraceReport("other", True, "unchanged", "no pass found anything to rewrite")]
        lines = _summary(traces, False, self.MODULES).splitlines()[1:]
        assert len(lines) == 4 and lines[0].lstrip().startswith("knn") and lines[3].lstrip().startswith("other")
        assert lines[1].strip() == "ran at [900, 3]: 900 B by XLA's figure, within the limit of 1000 B"
        assert lines[2].strip() == "ran at [2,000, 3]: 1.95 KiB by XLA's figure, over the limit of 1000 B"
