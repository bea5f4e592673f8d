"""Shared test set-up: quiet TensorFlow, verifier always on, tf_memsafe off between tests."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's CPU allocator keeps statistics (tf.config.experimental.get_memory_info: the allocator
# peaks the DTensor, relayout and peak_memory tests read) only as a BFC allocator, TensorFlow's default
# where oneDNN is on (CPUs with AVX-512), not on an AVX2-only CPU ("Allocator stats not available").
# Set before TensorFlow starts; the tests' subprocesses inherit it.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import pytest  # noqa: E402

import tf_memsafe  # noqa: E402
from tf_memsafe import hook  # noqa: E402


@pytest.fixture(autouse=True)
def _tf_memsafe_clean_state():
    """Every test starts disabled, with the verifier on, and leaves nothing behind."""
    tf_memsafe.disable()
    hook.clear_reports()
    with tf_memsafe.options(verify=True):
        yield
    tf_memsafe.disable()
    hook.clear_reports()


# XLA:CPU keeps every program it compiled and ran for the life of the process, three memory mappings
# each (code, constants, data); Linux refuses more than vm.max_map_count (65530 by default) and XLA then
# crashes (SIGSEGV) in its next compile.  One process running the whole suite passed that limit, so
# README's command runs it in two pytest-xdist workers (setup.cfg); this says so before it happens again.
_MAPS_CHECKED_EVERY = 25
_MAPS_WARNED_AT = 0.8
_tests_seen = 0


def _mappings() -> tuple[int, int] | None:
    """(this process's memory mappings, the most Linux allows), or ``None`` where /proc says neither."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as most:
            return maps.read().count(b"\n"), int(most.read())
    except (OSError, ValueError):
        return None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    global _tests_seen
    _tests_seen += 1
    if _tests_seen % _MAPS_CHECKED_EVERY or (counts := _mappings()) is None:
        return
    used, most = counts
    if used > _MAPS_WARNED_AT * most:
        item.warn(pytest.PytestWarning(
            f"this test process holds {used} memory mappings of the {most} Linux allows (vm.max_map_count): "
            "XLA:CPU keeps 3 for every program compiled in it and crashes at the limit. Run the suite in more "
            "pytest-xdist workers (-n in setup.cfg's addopts) or split it."))
