"""Smoke run of experiments/distributed.py at its --quick size (nothing timed is asserted): the relayout
of every layout pair, and the Transformer trained by two worker processes under
``MultiWorkerMirroredStrategy`` within a per-worker limit its naive step exceeds."""

import json

import numpy as np
import pytest

from experiments import distributed, report


@pytest.mark.heavy
def test_quick_run_keeps_every_layout_pair_within_the_bound(tmp_path):
    """``heavy`` (about two minutes, left out of the default run: ``python -m tests -m heavy`` runs it).
    Every layout pair's relayout (values, each device's program at its target shard, the allocator
    near the bound) is checked by tests/tf_memsafe/test_relayout.py, and a replica's step split within
    its limit under a distribution strategy by tests/integration/test_distribute.py; the two worker
    processes of ``MultiWorkerMirroredStrategy`` run only here."""
    assert distributed.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "distributed.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = results["relayout"]
    assert results["quick"] and len(rows) == len(distributed.QUICK_PAIRS)
    assert {(r["source"], r["target"]) for r in rows} >= {("(x, y)", "(y, x)"), ("(x)", "(-)")}
    for r in rows:
        assert r["equal"], r
        assert r["peak_over_bound"] <= 1.25 and r["plan_peak_over_bound"] <= 1.0, r
    assert (tmp_path / "distributed.png").exists() and (tmp_path / "distributed.csv").exists()
    assert any("| 256x512 | (x, y) | (y, x) |" in line for line in report.distributed_lines(results))
    # The multi-worker run: each worker's step program within the limit that one worker's naive step
    # exceeds; every step's loss equal across the workers and to the single process's on the global batch.
    cluster = results["multi_worker"]
    limit = cluster["limit_bytes"]
    assert cluster["single"]["per_worker_naive_bytes"] > limit
    assert len(cluster["workers"]) == 2
    for w in cluster["workers"]:
        assert w["replicas"] == 2 and w["programs"] and max(w["programs"]) <= limit, w
        assert "rewritten" in w["splitter"], w
        np.testing.assert_allclose(w["losses"], cluster["single"]["losses"], rtol=1e-5)
    assert any("two worker processes" in line for line in report.distributed_lines(results))
