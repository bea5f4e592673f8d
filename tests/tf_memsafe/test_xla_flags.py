"""The XLA-flags companion: XLA's own splitting of the value, the user's flags kept byte for byte,
validation in a child process, eXLA pass-through."""

import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tf_memsafe
from tf_memsafe import xla_flags

GOOD = "--xla_cpu_use_thunk_runtime=true"
UNKNOWN = "--xla_tf_memsafe_no_such_flag=1"
BAD_VALUE = "--xla_cpu_use_thunk_runtime=banana"


@pytest.fixture
def known(monkeypatch):
    """Pretend these flags were validated already (no child process); returns the setter."""
    cache = {}
    monkeypatch.setattr(xla_flags, "_memory_cache", cache)
    monkeypatch.setattr(xla_flags, "_load_disk_cache", lambda: {})
    monkeypatch.setattr(xla_flags, "_store_disk_cache", lambda results: None)
    return lambda *flags: cache.update(dict.fromkeys(flags))


@pytest.fixture
def restore_env():
    saved = os.environ.get("XLA_FLAGS")
    yield
    os.environ["XLA_FLAGS"] = saved
    xla_flags._ours.clear()


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """One real validation of a good flag, an unknown name and a malformed value, from an empty cache:
    its results, the in-memory cache it left and its on-disk cache's folder.  Four children (the batch,
    the batch less the unknown name, then each of the two left alone), shared by the tests below (a
    child process costs seconds: TensorFlow's import and a compile)."""
    folder = tmp_path_factory.mktemp("xla_flags_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TF_MEMSAFE_CACHE_DIR", str(folder))
        memory = {}
        mp.setattr(xla_flags, "_memory_cache", memory)
        found = xla_flags.validate([GOOD, UNKNOWN, BAD_VALUE])
    return found, dict(memory), folder


def test_validation_names_each_rejected_flag_and_why(validated):
    """One batch with a good flag, an unknown name and a malformed value: each judged on its own."""
    found, _, _ = validated
    assert list(found) == [GOOD, UNKNOWN, BAD_VALUE]
    assert found[GOOD] is None
    assert found[UNKNOWN] == "unknown to this TensorFlow build's XLA"
    assert found[BAD_VALUE].startswith("rejected by XLA's flag parser")


def test_results_are_cached_in_memory_and_on_disk(validated, monkeypatch):
    found, memory, folder = validated
    assert any(p.name.startswith("xla_flags-") for p in folder.iterdir())

    def no_child(flags):
        raise AssertionError(f"a cached flag was probed again: {flags}")

    monkeypatch.setattr(xla_flags, "_probe", no_child)
    monkeypatch.setenv("TF_MEMSAFE_CACHE_DIR", str(folder))
    assert memory == found
    monkeypatch.setattr(xla_flags, "_memory_cache", dict(memory))       # the same process: its memory
    assert xla_flags.validate([BAD_VALUE, GOOD]) == {BAD_VALUE: found[BAD_VALUE], GOOD: None}
    monkeypatch.setattr(xla_flags, "_memory_cache", {})  # a new process: only the disk cache remains
    assert xla_flags.validate([UNKNOWN])[UNKNOWN] == "unknown to this TensorFlow build's XLA"
    assert xla_flags.validate([GOOD, BAD_VALUE]) == {GOOD: None, BAD_VALUE: found[BAD_VALUE]}


def test_a_rejected_flag_raises_before_anything_is_set(known, restore_env):
    known(GOOD)                                 # (judged already: no child process)
    xla_flags._memory_cache[UNKNOWN] = "unknown to this TensorFlow build's XLA"
    before = os.environ["XLA_FLAGS"]
    with pytest.raises(xla_flags.InvalidFlagError, match="no_such_flag.*nothing was set"):
        xla_flags.set_flags([GOOD, UNKNOWN])
    assert os.environ["XLA_FLAGS"] == before


@pytest.mark.parametrize("not_a_flag", ["xla_foo=1", "--tf_xla_auto_jit=2", "--xla_a=1 --xla_b=2", " --xla_a=1",
                                        "'--xla_a=.*'"])
def test_strings_that_are_not_one_xla_flag_are_refused_without_a_child(not_a_flag):
    with pytest.raises(xla_flags.InvalidFlagError, match="not one XLA flag"):
        xla_flags.validate([not_a_flag])


def test_a_value_with_spaces_in_double_quotes_is_one_flag(known):
    known('--xla_dump_to="/my dumps"')
    assert xla_flags.validate(['--xla_dump_to="/my dumps"']) == {'--xla_dump_to="/my dumps"': None}


def test_set_flags_keeps_the_users_values_and_unset_removes_only_ours(known, restore_env):
    known("--xla_cpu_enable_fast_math=true", "--xla_cpu_use_thunk_runtime=false")
    os.environ["XLA_FLAGS"] = f"{xla_flags.RESET_FLAG} --xla_cpu_enable_fast_math=false"
    added = xla_flags.set_flags(["--xla_cpu_enable_fast_math=true", "--xla_cpu_use_thunk_runtime=false"])
    assert added == ["--xla_cpu_use_thunk_runtime=false"]
    assert os.environ["XLA_FLAGS"].split() == [
        xla_flags.RESET_FLAG, "--xla_cpu_enable_fast_math=false", "--xla_cpu_use_thunk_runtime=false"]
    xla_flags.unset_flags(["--xla_cpu_enable_fast_math", "--xla_cpu_use_thunk_runtime"])
    assert os.environ["XLA_FLAGS"].split() == [xla_flags.RESET_FLAG, "--xla_cpu_enable_fast_math=false"]


class TestExlaPassThrough:
    """On a build with eXLA's splitter, enable() hands it the limit in plain bytes; never on stock TF."""

    EXLA_PROBES = [f"{name}=1000000" for name in xla_flags.EXLA_FLAGS]

    def test_flags_carry_plain_bytes(self):
        assert xla_flags.exla_flags_for(4 * 2**30) == [
            "--xla_tensor_size_threshold=2147483648", "--xla_tensor_split_size=536870912"]
        with pytest.raises(ValueError):
            xla_flags.exla_flags_for(0)

    def test_enable_sets_them_when_the_build_has_them_and_disable_removes_them(self, known, restore_env):
        known(*self.EXLA_PROBES, *xla_flags.exla_flags_for(10**9), *xla_flags.exla_flags_for(2 * 10**9))
        tf_memsafe.enable("1GB")
        flags = os.environ["XLA_FLAGS"].split()
        assert "--xla_tensor_size_threshold=500000000" in flags and "--xla_tensor_split_size=125000000" in flags
        tf_memsafe.enable("2GB")  # a new limit replaces the old flags
        flags = os.environ["XLA_FLAGS"].split()
        assert "--xla_tensor_size_threshold=1000000000" in flags
        assert "--xla_tensor_size_threshold=500000000" not in flags
        tf_memsafe.disable()
        assert not any(f.startswith("--xla_tensor_") for f in os.environ["XLA_FLAGS"].split())

    def test_the_users_own_threshold_wins(self, known, restore_env):
        known(*self.EXLA_PROBES, *xla_flags.exla_flags_for(10**9))
        os.environ["XLA_FLAGS"] += " --xla_tensor_size_threshold=7"
        tf_memsafe.enable("1GB")
        flags = os.environ["XLA_FLAGS"].split()
        assert [f for f in flags if f.startswith("--xla_tensor_size_threshold")] == ["--xla_tensor_size_threshold=7"]
        tf_memsafe.disable()
        assert "--xla_tensor_size_threshold=7" in os.environ["XLA_FLAGS"].split()

    def test_stock_tensorflow_has_no_exla_and_enable_sets_no_flag(self, restore_env):
        before = os.environ["XLA_FLAGS"]
        assert not xla_flags.exla_available()
        tf_memsafe.enable("1GB")
        assert os.environ["XLA_FLAGS"] == before


@pytest.mark.slow
def test_an_invalid_flag_never_reaches_the_process(validated):
    """Without validation this child would die at its compile; with it, it gets an error and goes on.
    The child reads the validation cache the ``validated`` fixture's real children wrote (as a later
    process of the same build would), so it starts no probe of its own."""
    code = f"""
        import tensorflow as tf, tf_memsafe
        from tf_memsafe import xla_flags
        try:
            xla_flags.set_flags([{UNKNOWN!r}])
        except xla_flags.InvalidFlagError as e:
            print("REFUSED", e)
        print("RESULT", float(tf.function(lambda a: a + 1.0, jit_compile=True)(tf.ones([2]))[0]))
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_MEMSAFE_CACHE_DIR=str(validated[2]))
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"REFUSED XLA would abort the process on {UNKNOWN}" in out.stdout
    assert "RESULT 2.0" in out.stdout


def test_dump_all_compiles_reports_each_program_and_cleans_up(restore_env):
    import tensorflow as tf

    before = xla_flags.user_value()
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        tf.function(lambda a: a * 3.0 + 1.0, jit_compile=True)(tf.ones([256]))
        reports = xla_flags.memory_reports(folder)
    assert len(reports) == 1 and reports[0][0].startswith("a_inference_") and reports[0][1] >= 2 * 256 * 4
    assert os.environ["XLA_FLAGS"] == " ".join(filter(None, [xla_flags.RESET_FLAG, xla_flags.DUMP_DEFAULTS, before]))
    assert not os.path.exists(folder)


def _dead_pid() -> str:
    """The id of a process that has ended (a child run to print it)."""
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()


class TestDumpRoots:
    """XLA:CPU dumps every kernel's IR and object file beside the report a measurement reads: the
    private directories go to a RAM-backed directory where it has room, else to the temp dir."""

    def test_a_measurement_dumps_into_the_ram_backed_directory_and_deletes_its_own(self, tmp_path, monkeypatch,
                                                                                   restore_env):
        import tensorflow as tf

        ram = tmp_path / "ram"
        ram.mkdir()
        monkeypatch.setattr(xla_flags, "_RAM_ROOT", str(ram))
        assert xla_flags.dump_roots()[0] == str(ram)
        with xla_flags.dump_for_one_compile(fast_codegen=True) as folder:
            assert os.path.dirname(folder) == str(ram)
            tf.function(lambda a: a * 7.0 - 1.0, jit_compile=True).experimental_get_compiler_ir(
                tf.TensorSpec([96]))(stage="optimized_hlo")
            assert any(n.endswith("memory-usage-report.txt") for n in os.listdir(folder))
        assert os.listdir(ram) == []

    def test_a_whole_run_dumps_on_disk_unless_asked_to_keep_it_in_memory(self, tmp_path, monkeypatch, restore_env):
        """The command line dumps every compile of the script until it ends: on disk, not in the memory
        the script's programs are fitted to; a block of a few compiles (a test's run) may ask for memory."""
        ram = tmp_path / "ram"
        ram.mkdir()
        monkeypatch.setattr(xla_flags, "_RAM_ROOT", str(ram))
        with xla_flags.dump_all_compiles() as folder:
            assert os.path.dirname(folder) == tempfile.gettempdir()
        with xla_flags.dump_all_compiles(in_memory=True) as folder:
            assert os.path.dirname(folder) == str(ram)
        assert os.listdir(ram) == []

    @pytest.mark.parametrize("room", ["missing", "full"])
    def test_without_room_in_memory_the_temp_dir_is_used(self, room, tmp_path, monkeypatch):
        ram = tmp_path / "ram"
        if room == "full":
            ram.mkdir()
            monkeypatch.setattr(xla_flags, "_RAM_ROOT_MIN_FREE", 1 << 62)
        monkeypatch.setattr(xla_flags, "_RAM_ROOT", str(ram))
        assert xla_flags.dump_roots() == [tempfile.gettempdir()]

    def test_stale_directories_are_removed_from_every_root(self, tmp_path, monkeypatch):
        ram, temp = tmp_path / "ram", tmp_path / "temp"
        dead = _dead_pid()
        for root in (ram, temp):
            (root / f"tf_memsafe_xla_dump_{dead}_abc").mkdir(parents=True)
        monkeypatch.setattr(xla_flags, "_RAM_ROOT", str(ram))
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        folder = xla_flags._dump_dir("xla")
        try:
            assert os.listdir(ram) == [os.path.basename(folder)] and os.listdir(temp) == []
        finally:
            os.rmdir(folder)


def test_dump_all_compiles_uses_and_keeps_the_users_directory(tmp_path, restore_env):
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={tmp_path}"
    with xla_flags.dump_all_compiles() as folder:
        assert folder == str(tmp_path)
    assert tmp_path.exists()


def test_dump_directories_of_dead_processes_are_removed(tmp_path):
    """A process killed while measuring leaves its dump directory; the next one removes it (by the
    pid in its name), and never one of a process still running."""
    dead = _dead_pid()
    stale = tmp_path / f"tf_memsafe_run_dump_{dead}_abc"
    live = tmp_path / f"tf_memsafe_xla_dump_{os.getpid()}_def"
    other = tmp_path / "someone_elses_dir"
    for d in (stale, live, other):
        d.mkdir()
    assert xla_flags.remove_stale_dumps(str(tmp_path)) == 1
    assert not stale.exists() and live.exists() and other.exists()


class TestXlaSplitsTheValue:
    """``parse_flags`` splits ``XLA_FLAGS`` as XLA's ``ParseArgvFromString`` does; XLA itself is the oracle.

    Separators are spaces, tabs and newlines; a value runs to the next of them (``=``, ``.*`` and an
    apostrophe included) unless it opens with a quote; reading stops at a word without ``-``.
    """

    TRICKY = ('--xla_q1="a \\"b\\" c" --xla_q2=\'x y\\z\' \t--xla_e=b=c --xla_r=.* --xla_it=it\'s --xla_b\n'
              '--xla_end=1 stop --xla_after=1')
    READ = ['--xla_q1=a "b" c', "--xla_q2=x y\\z", "--xla_e=b=c", "--xla_r=.*", "--xla_it=it's", "--xla_b",
            "--xla_end=1"]

    def test_each_flag_as_xla_reads_it_and_as_written(self):
        parsed = xla_flags.parse_flags(self.TRICKY)
        assert [f.argv for f in parsed.flags] == self.READ
        assert [f.text for f in parsed.flags][:2] == ['--xla_q1="a \\"b\\" c"', "--xla_q2='x y\\z'"]
        assert all(self.TRICKY[f.start:f.end] == f.text for f in parsed.flags)
        assert parsed.ignored == "stop --xla_after=1"
        assert (parsed.flags[2].name, parsed.flags[2].value, parsed.flags[5].value) == ("--xla_e", "b=c", None)

    def test_shell_quoting_stops_xla_at_once(self):
        """What tf_memsafe used to write (shlex.join): XLA reads no flag of it."""
        written = "--xla_flags_reset=true '--xla_dump_hlo_pass_re=.*' --xla_dump_to=/d"
        assert [f.text for f in xla_flags.parse_flags(written).flags] == ["--xla_flags_reset=true"]

    def test_xla_reads_the_same_flags(self):
        """XLA's own parser, asked in a child (its VLOG lists the argv it built; the unknown names then
        stop the child, as they would any process)."""
        env = dict(os.environ, XLA_FLAGS=self.TRICKY, TF_CPP_VMODULE="parse_flags_from_env=1", TF_CPP_MIN_LOG_LEVEL="0")
        out = subprocess.run([sys.executable, "-c", xla_flags._PROBE], env=env, capture_output=True, text=True,
                             timeout=240)
        listed = re.findall(r"\] +argv\[(\d+)\] = (.*)$", out.stderr, re.MULTILINE)
        last = max(i for i, (index, _) in enumerate(listed) if index == "0")
        assert [value for _, value in listed[last + 1:]] == self.READ

    @given(st.text(alphabet=st.characters(exclude_characters="\0")))
    def test_format_flag_is_read_back_exactly(self, value):
        written = xla_flags.format_flag("--xla_dump_to", value)
        parsed = xla_flags.parse_flags(written)
        assert [(f.text, f.argv) for f in parsed.flags] == [(written, f"--xla_dump_to={value}")]


USER_VALUES = [
    "--xla_dump_hlo_pass_re=.* --xla_dump_to=/tmp/dumps",
    '--xla_dump_to="/tmp/my dumps"  --xla_dump_hlo_module_re=lambda|x=y\t--xla_cpu_enable_fast_math=false',
    "--xla_dump_to='/tmp/it is' --xla_dump_hlo_pass_re=it's.*",
    "",
]


class TestTheUsersValueIsKeptByteForByte:
    @pytest.mark.parametrize("value", USER_VALUES)
    def test_import_puts_only_the_reset_flag_in_front(self, value, monkeypatch):
        monkeypatch.setenv("XLA_FLAGS", value)
        assert xla_flags.ensure_reset_flag()
        assert os.environ["XLA_FLAGS"] == (f"{xla_flags.RESET_FLAG} {value}" if value else xla_flags.RESET_FLAG)
        assert xla_flags.user_value() == value
        assert not xla_flags.ensure_reset_flag()       # once only
        assert xla_flags.user_value() == value

    def test_a_flags_file_is_read_as_xla_would(self, tmp_path, monkeypatch):
        """A value without a leading ``-`` names a file of flags: its text takes the value's place."""
        path = tmp_path / "xla flags.txt"
        path.write_text(USER_VALUES[1] + "\n")
        monkeypatch.setenv("XLA_FLAGS", str(path))
        assert xla_flags.ensure_reset_flag()
        assert xla_flags.user_value() == USER_VALUES[1] + "\n"
        monkeypatch.setenv("XLA_FLAGS", str(tmp_path / "missing"))
        assert not xla_flags.ensure_reset_flag()       # left for XLA to report, as without tf_memsafe
        assert os.environ["XLA_FLAGS"] == str(tmp_path / "missing")

    @pytest.mark.parametrize("value", USER_VALUES)
    def test_a_measurement_block_puts_its_dump_flags_after_the_users_and_restores_them(self, value, monkeypatch):
        monkeypatch.setenv("XLA_FLAGS", f"{xla_flags.RESET_FLAG} {value}")
        with xla_flags.dump_for_one_compile() as folder:
            inside = xla_flags.parse_flags(os.environ["XLA_FLAGS"])
            ours = xla_flags._split_ours(os.environ["XLA_FLAGS"])[0]
        read = [f.argv for f in inside.flags]
        users = [f.argv for f in xla_flags.parse_flags(value).flags]
        assert read[0] == xla_flags.RESET_FLAG and read[3:3 + len(users)] == users
        # XLA's defaults for what a measurement may change, unless the user's
        assert read[1:3] == ["--xla_backend_optimization_level=3", "--xla_cpu_use_fusion_emitters=true"]
        assert ours == " ".join([xla_flags.RESET_FLAG, *read[1:3]])      # not the user's
        # Last wins in XLA: the measurement's directory, text dumps and no filter of the user's.
        last = {f.name: f.value for f in inside.flags}
        assert last["--xla_dump_to"] == folder and last["--xla_dump_hlo_module_re"] == ""
        assert last["--xla_dump_hlo_pass_re"] == "" and last["--xla_dump_hlo_as_text"] == "true"
        # After: XLA keeps what it read last, so the defaults come back in front of the user's value.
        assert os.environ["XLA_FLAGS"] == " ".join(filter(None, [xla_flags.RESET_FLAG, xla_flags.DUMP_DEFAULTS,
                                                                 value]))
        assert xla_flags.user_value() == value
        with xla_flags.dump_for_one_compile():
            pass
        assert xla_flags.user_value() == value          # a second measurement changes nothing more

    def test_fast_codegen_wins_inside_the_block_and_the_default_or_the_users_level_after(self, monkeypatch):
        for value, after in (("--xla_cpu_enable_fast_math=false", "3"), ("--xla_backend_optimization_level=2", "2")):
            monkeypatch.setenv("XLA_FLAGS", f"{xla_flags.RESET_FLAG} {value}")
            with xla_flags.dump_for_one_compile(fast_codegen=True):
                inside = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
            assert inside["--xla_backend_optimization_level"] == "0"
            last = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
            assert last["--xla_backend_optimization_level"] == after and xla_flags.user_value() == value
            # A block without it names XLA's default (XLA would keep the 0 it read last) or the user's.
            with xla_flags.dump_for_one_compile():
                plain = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
            assert plain["--xla_backend_optimization_level"] == after

    def test_sizing_only_turns_the_fusion_emitters_off_inside_the_block_and_xlas_default_or_the_users_after(
            self, monkeypatch):
        for value, after in (("--xla_cpu_enable_fast_math=false", "true"), ("--xla_cpu_use_fusion_emitters=false",
                                                                           "false")):
            monkeypatch.setenv("XLA_FLAGS", f"{xla_flags.RESET_FLAG} {value}")
            with xla_flags.dump_for_one_compile(fast_codegen=True, sizing_only=True):
                inside = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
            assert inside["--xla_cpu_use_fusion_emitters"] == "false"
            assert inside["--xla_backend_optimization_level"] == "0"
            last = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
            assert last["--xla_cpu_use_fusion_emitters"] == after and xla_flags.user_value() == value
            # A block without it names XLA's default (XLA would keep what it read last) or the user's.
            for kw in ({}, {"fast_codegen": True}):
                with xla_flags.dump_for_one_compile(**kw):
                    plain = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
                assert plain["--xla_cpu_use_fusion_emitters"] == after
            with xla_flags.dump_all_compiles(in_memory=True):
                run = {f.name: f.value for f in xla_flags.parse_flags(os.environ["XLA_FLAGS"]).flags}
            assert run["--xla_cpu_use_fusion_emitters"] == after and xla_flags.user_value() == value

    def test_set_and_unset_edit_the_text_only_where_xla_reads(self, known, monkeypatch):
        known("--xla_cpu_use_thunk_runtime=false")
        monkeypatch.setattr(xla_flags, "_ours", set())
        value = '--xla_dump_to="/tmp/my dumps"  --xla_dump_hlo_pass_re=.* stop-word --xla_ignored=1'
        monkeypatch.setenv("XLA_FLAGS", f"{xla_flags.RESET_FLAG} {value}")
        assert xla_flags.set_flags(["--xla_cpu_use_thunk_runtime=false"]) == ["--xla_cpu_use_thunk_runtime=false"]
        assert xla_flags.user_value() == value.replace(".* ", ".* --xla_cpu_use_thunk_runtime=false ")
        xla_flags.unset_flags(["--xla_cpu_use_thunk_runtime"])
        assert xla_flags.user_value() == value
