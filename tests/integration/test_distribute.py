"""tf.distribute (issue 31): under ``MirroredStrategy`` on two logical CPU devices, each replica's jit
step is rewritten when it is traced, and the limit holds for each replica's program by XLA's figure;
the summed loss and gradient equal the run without tf_memsafe.  ``enable`` works outside and inside
``strategy.scope()``.  The step runs in a process of its own (``mirrored_step.py`` says why)."""

from __future__ import annotations

import numpy as np

from tests.child import json_from_module


def test_each_replicas_step_is_split_within_the_limit():
    got = json_from_module("tests.integration.mirrored_step")
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
