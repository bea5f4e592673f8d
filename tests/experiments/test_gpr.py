"""Smoke run of experiments/gpr.py at its --quick sizes: GPflow GPR's predictions and a solve with many
right-hand sides within a limit 8x below their naive figures, equal to the unsplit programs."""

import json

import pytest

from experiments import gpr


@pytest.mark.heavy
def test_quick_run_splits_predictions_and_solves_within_an_eighth(tmp_path):
    """``heavy`` (30-40 s, left out of the default run).  GPR's predictions over a large test set and
    solves split within a limit, equal to the unsplit programs, are checked by
    tests/integration/test_sgpr.py and tests/grappler_ext/test_blocked_linalg.py."""
    assert gpr.main(["--quick", "--out", str(tmp_path), "--workloads", "predict", "solve"]) == 0
    data = json.loads((tmp_path / "gpr.json").read_text())
    rows = {r["workload"]: r for r in data["rows"]}
    assert set(rows) == {"predict", "solve"}
    for r in rows.values():
        assert r["kind"] == "check" and r["status"] == "rewritten"
        assert r["limit_bytes"] == r["naive_bytes"] // 8
        assert r["within_limit"] and r["tfms_bytes"] <= r["limit_bytes"], r
        assert r["max_rel_diff"] <= 1e-10, r
        assert r["naive_s"] > 0 and r["tfms_s"] > 0, r       # both timed where both run
