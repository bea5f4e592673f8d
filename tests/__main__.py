"""The whole suite, as README and CI run it: ``python -m tests [pytest options]``.

It runs pytest once per group of test folders, each in fresh processes (two pytest-xdist workers,
setup.cfg), one group after the other, and fails when any group does.  Why not one ``python -m
pytest``: TensorFlow keeps every program XLA:CPU compiled and ran for the life of the process (its
code in three memory mappings, its module and buffers in memory), and nothing in TensorFlow's API
releases them.  One process running the whole suite reached Linux's 65530 mappings
(``vm.max_map_count``) and XLA then crashed (SIGSEGV) in its next compile; two workers sharing it
reached 24 GiB between them.  A group is a few hundred tests, far from either.

Options after ``python -m tests`` go to every group's pytest (``-x``, ``-k``, ``-n 0``); a test
path runs just that path, in one pytest, as ``python -m pytest`` would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Each group: the folders it runs, and the folders under them left to a later group.
# (Each group costs about 25 s beside its tests: two workers starting TensorFlow, and the last test's
# tail; the experiments' smoke runs, 45 tests, ride with the passes'.)
GROUPS: list[tuple[list[str], list[str]]] = [
    (["tests/grappler_ext/splitter"], []),
    (["tests/grappler_ext", "tests/experiments"], ["tests/grappler_ext/splitter"]),
    (["tests/integration", "tests/tf_memsafe"], []),
]


def _covers_the_suite() -> list[str]:
    """The folders with tests that no group runs (a folder added without a group would be skipped)."""
    run = {os.path.normpath(p) for paths, _ in GROUPS for p in paths}
    missing = []
    for name in sorted(os.listdir(HERE)):
        path = os.path.join("tests", name)
        if os.path.isdir(os.path.join(HERE, name)) and not name.startswith(("_", ".")) and path not in run:
            if any(f.startswith("test_") and f.endswith(".py") for _, _, files in os.walk(os.path.join(HERE, name))
                   for f in files):
                missing.append(path)
    return missing


def main(argv: list[str]) -> int:
    root = os.path.dirname(HERE)
    if any(os.path.exists(os.path.join(root, a.split("::")[0])) for a in argv if not a.startswith("-")):
        return subprocess.call([sys.executable, "-m", "pytest", *argv], cwd=root)
    missing = _covers_the_suite()
    if missing:
        print(f"tests/__main__.py: no group runs {', '.join(missing)}: add them to GROUPS", file=sys.stderr)
        return 2
    failed, lines = [], []
    for paths, ignored in GROUPS:
        start = time.perf_counter()
        command = [sys.executable, "-m", "pytest", *paths, *[f"--ignore={p}" for p in ignored], *argv]
        print(f"\n=== {' '.join(command[1:])}", flush=True)
        code = subprocess.call(command, cwd=root)
        lines.append(f"{' '.join(paths)}: exit {code} in {time.perf_counter() - start:.0f} s")
        # pytest's 5, no test ran: a failure for the whole suite, not where options chose the tests (-k)
        if code != 0 and not (code == 5 and argv):
            failed.append(" ".join(paths))
    print("\n=== the suite, by group\n" + "\n".join(lines))
    if failed:
        print(f"FAILED: {'; '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
