"""A test's program run in a process of its own (TensorFlow splits the CPU into logical devices only
before its runtime starts): its last line of output, read as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def json_from_module(module: str, *args: str, timeout: float = 600, env: dict | None = None):
    """``python -m module args...`` run from the repository's root, bounded by ``timeout``; its last
    line of standard output as JSON.  Fails the test with the end of its standard error if it fails."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, timeout=timeout, capture_output=True,
                          text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
