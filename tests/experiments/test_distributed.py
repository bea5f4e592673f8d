"""Smoke run of experiments/distributed.py at its --quick size (nothing timed is asserted)."""

import json

from experiments import distributed, report


def test_quick_run_keeps_every_layout_pair_within_the_bound(tmp_path):
    assert distributed.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "distributed.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = results["relayout"]
    assert results["quick"] and len(rows) == 42 + 6          # every pair of distinct layouts
    assert {(r["source"], r["target"]) for r in rows} >= {("(x, y)", "(y, x)"), ("(x)", "(-)")}
    for r in rows:
        assert r["equal"], r
        assert r["peak_over_bound"] <= 1.25 and r["plan_peak_over_bound"] <= 1.0, r
    assert (tmp_path / "distributed.png").exists() and (tmp_path / "distributed.csv").exists()
    assert any("| 256x512 | (x, y) | (y, x) |" in line for line in report.distributed_lines(results))
