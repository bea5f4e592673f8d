"""Smoke run of experiments/bench_rewrites.py at its --quick sizes (nothing timed is asserted)."""

import csv
import json

from experiments import bench_rewrites


def test_quick_run_writes_csv_json_and_plot(tmp_path):
    code = bench_rewrites.main(["--quick", "--out", str(tmp_path), "--repeats", "1", "--run-limit", "200MB",
                                "--workloads", "knn_d64", "sgpr_naive_kernel"])
    assert code == 0
    with open(tmp_path / "bench_rewrites.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["workload"], r["config"]): r for r in rows}
    assert {w for w, _ in by} == {"knn_d64", "sgpr_naive_kernel"}
    # d = 64: the naive [2000, 2000, 64] program (1 GB) is over the run limit; rewritten it is not.
    assert by["knn_d64", "off"]["seconds"] == "" and int(by["knn_d64", "off"]["footprint_bytes"]) > 10**9
    assert int(by["knn_d64", "all"]["footprint_bytes"]) < 50 * 2**20 and by["knn_d64", "all"]["seconds"] != ""
    assert int(by["sgpr_naive_kernel", "only:pairwise_distance"]["rewrites"]) == 2
    # No rewrite raised XLA's figure: every firing row is at most the program as written (issue 29).
    for (workload, config), r in by.items():
        assert int(r["limit_bytes"]) == int(by[workload, "off"]["footprint_bytes"]) // 2
        if int(r["rewrites"]):
            assert r["raised"] == "False"
            assert int(r["footprint_bytes"]) <= int(by[workload, "off"]["footprint_bytes"]), (workload, config)
    assert json.loads((tmp_path / "bench_rewrites.json").read_text())["rows"]
    assert (tmp_path / "bench_rewrites.png").stat().st_size > 10_000
