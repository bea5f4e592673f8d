"""Smoke run of experiments/bench_rewrites.py at its --quick sizes (nothing timed is asserted)."""

import csv
import json

import pytest

from experiments import bench_rewrites


@pytest.mark.heavy
def test_quick_run_writes_csv_json_and_plot(tmp_path):
    """``heavy`` (about a minute, left out of the default run).  Each rewrite's firing, exactness and
    figure no larger than as written are checked by its own tests under tests/grappler_ext/."""
    code = bench_rewrites.main(["--quick", "--out", str(tmp_path), "--repeats", "1", "--run-limit", "200MB",
                                "--workloads", "knn_d64", "sgpr_naive_kernel", "chain_fits", "sum_fits"])
    assert code == 0
    with open(tmp_path / "bench_rewrites.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["workload"], r["config"]): r for r in rows}
    assert {w for w, _ in by} == {"knn_d64", "sgpr_naive_kernel", "chain_fits", "sum_fits"}
    # d = 64: the naive [2000, 2000, 64] program (1 GB) is over the run limit; rewritten it is not.
    assert by["knn_d64", "off"]["seconds"] == "" and int(by["knn_d64", "off"]["footprint_bytes"]) > 10**9
    assert int(by["knn_d64", "all"]["footprint_bytes"]) < 50 * 2**20 and by["knn_d64", "all"]["seconds"] != ""
    assert int(by["sgpr_naive_kernel", "only:pairwise_distance"]["rewrites"]) == 2
    # No rewrite raised XLA's figure: every firing row is at most the program as written (issue 29).
    # Within its limit, only the FLOP-cutting reorder fires; the memory rewrite of sum(A B) does not.
    assert int(by["chain_fits", "only:matrix_chain"]["rewrites"]) == 1 and int(by["chain_fits", "all"]["rewrites"]) == 1
    assert all(int(by["sum_fits", c]["rewrites"]) == 0 for _, c in by if _ == "sum_fits")
    assert by["sum_fits", "all"]["footprint_bytes"] == by["sum_fits", "off"]["footprint_bytes"]
    for (workload, config), r in by.items():
        factor = 2 if workload.endswith("_fits") else 0.5
        assert int(r["limit_bytes"]) == int(int(by[workload, "off"]["footprint_bytes"]) * factor)
        if int(r["rewrites"]):
            assert r["raised"] == "False"
            assert int(r["footprint_bytes"]) <= int(by[workload, "off"]["footprint_bytes"]), (workload, config)
    assert json.loads((tmp_path / "bench_rewrites.json").read_text())["rows"]
    assert (tmp_path / "bench_rewrites.png").stat().st_size > 10_000
