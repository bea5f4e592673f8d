"""The XLA-flags companion: validation in a child process, user flags first, eXLA pass-through."""

import os
import shlex
import subprocess
import sys
import textwrap

import pytest

import tf_memsafe
from tf_memsafe import xla_flags

GOOD = "--xla_cpu_use_thunk_runtime=true"
UNKNOWN = "--xla_tf_memsafe_no_such_flag=1"
BAD_VALUE = "--xla_cpu_use_thunk_runtime=banana"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty in-memory and on-disk validation cache, private to the test."""
    monkeypatch.setenv("TF_MEMSAFE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(xla_flags, "_memory_cache", {})
    return tmp_path


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


def test_validation_names_each_rejected_flag_and_why(fresh_cache):
    """One batch with a good flag, an unknown name and a malformed value: each judged on its own."""
    found = xla_flags.validate([GOOD, UNKNOWN, BAD_VALUE])
    assert found[GOOD] is None
    assert found[UNKNOWN] == "unknown to this TensorFlow build's XLA"
    assert found[BAD_VALUE].startswith("rejected by XLA's flag parser")


def test_results_are_cached_in_memory_and_on_disk(fresh_cache, monkeypatch):
    assert xla_flags.validate([UNKNOWN])[UNKNOWN] is not None
    assert any(p.name.startswith("xla_flags-") for p in fresh_cache.iterdir())

    def no_child(flags):
        raise AssertionError(f"a cached flag was probed again: {flags}")

    monkeypatch.setattr(xla_flags, "_probe", no_child)
    monkeypatch.setattr(xla_flags, "_memory_cache", {})  # a new process: only the disk cache remains
    assert xla_flags.validate([UNKNOWN])[UNKNOWN] == "unknown to this TensorFlow build's XLA"


def test_a_rejected_flag_raises_before_anything_is_set(known, restore_env):
    xla_flags._memory_cache[UNKNOWN] = "unknown to this TensorFlow build's XLA"
    before = os.environ["XLA_FLAGS"]
    with pytest.raises(xla_flags.InvalidFlagError, match="no_such_flag.*nothing was set"):
        xla_flags.set_flags([GOOD, UNKNOWN])
    assert os.environ["XLA_FLAGS"] == before


@pytest.mark.parametrize("not_a_flag", ["xla_foo=1", "--tf_xla_auto_jit=2", "--xla_a=1 --xla_b=2"])
def test_strings_that_are_not_one_xla_flag_are_refused_without_a_child(not_a_flag):
    with pytest.raises(xla_flags.InvalidFlagError, match="not an XLA flag"):
        xla_flags.validate([not_a_flag])


def test_set_flags_keeps_the_users_values_and_unset_removes_only_ours(known, restore_env):
    known("--xla_cpu_enable_fast_math=true", "--xla_cpu_use_thunk_runtime=false")
    os.environ["XLA_FLAGS"] = shlex.join([xla_flags.RESET_FLAG, "--xla_cpu_enable_fast_math=false"])
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
def test_an_invalid_flag_never_reaches_the_process(tmp_path):
    """Without validation this child would die at its compile; with it, it gets an error and goes on."""
    code = f"""
        import tensorflow as tf, tf_memsafe
        from tf_memsafe import xla_flags
        try:
            xla_flags.set_flags([{UNKNOWN!r}])
        except xla_flags.InvalidFlagError as e:
            print("REFUSED", e)
        print("RESULT", float(tf.function(lambda a: a + 1.0, jit_compile=True)(tf.ones([2]))[0]))
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_MEMSAFE_CACHE_DIR=str(tmp_path))
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"REFUSED XLA would abort the process on {UNKNOWN}" in out.stdout
    assert "RESULT 2.0" in out.stdout


def test_dump_all_compiles_reports_each_program_and_cleans_up(restore_env):
    import tensorflow as tf

    before = os.environ["XLA_FLAGS"]
    with xla_flags.dump_all_compiles() as folder:
        tf.function(lambda a: a * 3.0 + 1.0, jit_compile=True)(tf.ones([256]))
        reports = xla_flags.memory_reports(folder)
    assert len(reports) == 1 and reports[0][0].startswith("a_inference_") and reports[0][1] >= 2 * 256 * 4
    assert os.environ["XLA_FLAGS"] == before
    assert not os.path.exists(folder)


def test_dump_all_compiles_uses_and_keeps_the_users_directory(tmp_path, restore_env):
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={tmp_path}"
    with xla_flags.dump_all_compiles() as folder:
        assert folder == str(tmp_path)
    assert tmp_path.exists()


def test_dump_directories_of_dead_processes_are_removed(tmp_path):
    """A process killed while measuring leaves its dump directory; the next one removes it (by the
    pid in its name), and never one of a process still running."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f"tf_memsafe_run_dump_{dead}_abc"
    live = tmp_path / f"tf_memsafe_xla_dump_{os.getpid()}_def"
    other = tmp_path / "someone_elses_dir"
    for d in (stale, live, other):
        d.mkdir()
    assert xla_flags.remove_stale_dumps(str(tmp_path)) == 1
    assert not stale.exists() and live.exists() and other.exists()
