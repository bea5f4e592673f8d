"""tf.distribute (issue 31): under ``MirroredStrategy`` on two logical CPU devices, each replica's jit
step is rewritten when it is traced, and the limit holds for each replica's program by XLA's figure;
the summed loss and gradient equal the run without tf_memsafe.  ``enable`` works outside and inside
``strategy.scope()``.  The step runs in a process of its own (``mirrored_step.py`` says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_replicas_step_is_split_within_the_limit():
    done = subprocess.run([sys.executable, "-m", "tests.integration.mirrored_step"], cwd=ROOT, timeout=600,
                          capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    limit, naive = got["limit"], got["naive"]
    assert len(naive["programs"]) == 2 and min(naive["programs"]) > 4 * limit, naive["programs"]
    assert naive["splitter"] == []
    for where in ("outside", "inside"):
        run = got[where]
        assert len(run["programs"]) == 2, (where, run["programs"])           # one per replica
        assert max(run["programs"]) <= limit, (where, run["programs"], limit)
        assert run["splitter"].count("rewritten") >= 2, (where, run["splitter"])   # each replica's trace
        np.testing.assert_allclose(run["loss"], naive["loss"], rtol=1e-10)
        np.testing.assert_allclose(run["grad"], naive["grad"], rtol=1e-9)
