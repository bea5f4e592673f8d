"""Smoke run of experiments/dynamic.py at its --quick sizes (nothing timed is asserted)."""

import json

from experiments import dynamic


def test_quick_run_is_exact_and_within_the_limit(tmp_path):
    dynamic.main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "dynamic.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = results["rows"]
    assert results["quick"] and results["limit_bytes"] == dynamic.QUICK_LIMIT
    keys = {(r["workload"], r["n"], r["method"]) for r in rows}
    for workload in ("kernel_matvec", "kernel_regression"):
        for n in dynamic.QUICK_SIZES:
            assert {(workload, n, "dynamic"), (workload, n, "static")} <= keys
    for r in rows:
        assert r["max_rel_diff"] < 1e-5, r
        if r["method"] != "naive":
            assert r["within_limit"], r
