"""Smoke runs of experiments/knn.py at its --quick sizes: exact against NumPy (nothing timed is asserted)."""

import csv
import dataclasses
import json
import sys

import numpy as np
import pytest

from experiments import _methods, knn

# The columns issue 11 asks for, by their CSV names.
REQUIRED = {"method", "metric", "n", "queries", "d", "data", "queries_per_s", "footprint_bytes", "within_limit",
            "recall", "skipped"}


@pytest.fixture
def no_pykeops(monkeypatch):
    """As if pykeops were not installed (and fast even where it is: nothing is compiled)."""
    monkeypatch.setitem(sys.modules, "pykeops", None)
    _methods.reset_keops()
    yield
    _methods.reset_keops()


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.mark.heavy
def test_quick_run_is_exact_within_the_limit_and_records_a_missing_keops(tmp_path, no_pykeops):
    """``heavy`` (about 50 s; ``python -m tests -m heavy`` runs it): the script's run path, its CSV and
    a KeOps row left out with its reason by test_mnist_loader_and_run_on_mocked_files below; exact kNN
    within the limit by tests/grappler_ext/test_blocked_top_k.py and test_pairwise_distance.py; the
    reason recorded for a missing pykeops only here."""
    assert knn.main(["--quick", "--out", str(tmp_path)]) == 0
    fields, rows = read_csv(tmp_path / "knn.csv")
    assert fields == [f.name for f in dataclasses.fields(knn.Row)] and REQUIRED <= set(fields)
    assert {(r["metric"], r["d"], r["n"]) for r in rows} == {
        (metric, d, n) for metric in knn.METRICS for d in ("3", "40") for n in ("1000", "4000")}
    for r in rows:
        if r["method"] == "keops":
            # KeOps missing is a recorded reason, not a failure.
            assert r["skipped"].startswith("pykeops unavailable: ") and "Error" in r["skipped"], r
            assert r["queries_per_s"] == "" and r["recall"] == ""
            continue
        assert r["skipped"] == "", r
        # Every method finds the exact neighbours of all 300 queries (ties allowed).
        assert float(r["recall"]) == 1.0 and int(r["checked_queries"]) == 300, r
        assert float(r["queries_per_s"]) > 0
        if r["method"] in ("tf_memsafe", "hand"):
            assert r["within_limit"] == "True" and int(r["footprint_bytes"]) <= int(r["limit_bytes"]), r
    # The 2 MB limit bites: the naive programs are over it, and the splitter rewrote some of them.
    assert any(r["method"] == "naive" and r["within_limit"] == "False" for r in rows)
    assert any("splitter" in r["plan"] for r in rows if r["method"] == "tf_memsafe")
    data = json.loads((tmp_path / "knn.json").read_text())
    assert len(data["rows"]) == len(rows) and data["speed"] and data["reach"]
    assert (tmp_path / "knn.png").stat().st_size > 10_000


def test_mnist_is_skipped_with_a_reason_when_its_files_are_absent(tmp_path):
    points, queries, why = knn.load_mnist(10, data_dir=str(tmp_path))
    assert points is None and queries is None and why.startswith("mnist: no prepared files")
    assert knn.main(["--quick", "--data", "mnist", "--mnist-dir", str(tmp_path), "--out", str(tmp_path)]) == 0
    _, rows = read_csv(tmp_path / "knn.csv")
    assert [(r["method"], r["metric"], r["d"]) for r in rows] == [("all", m, "784") for m in knn.METRICS]
    assert all(r["skipped"] == why for r in rows)


def test_mnist_loader_and_run_on_mocked_files(tmp_path, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    monkeypatch.setattr(knn, "mnist_prepared", lambda builder: True)   # mock_data writes no files
    with tfds.testing.mock_data(num_examples=40):
        points, queries, why = knn.load_mnist(20)
        assert why == "" and points.shape == (40, 784) and queries.shape == (20, 784)
        assert points.dtype == np.float32 and 0.0 <= points.min() and points.max() <= 1.0
        assert knn.main(["--quick", "--data", "mnist", "--metrics", "l2", "--queries", "20", "--out", str(tmp_path),
                         "--methods", "naive", "tf_memsafe", "hand", "numpy"]) == 0
    _, rows = read_csv(tmp_path / "knn.csv")
    ran = [r for r in rows if r["method"] != "keops"]
    assert {(r["data"], r["d"], r["n"], r["queries"]) for r in ran} == {("mnist", "784", "40", "20")}
    assert all(r["skipped"] == "" and float(r["recall"]) == 1.0 for r in ran), ran
    assert next(r for r in rows if r["method"] == "keops")["skipped"] == "not selected (--methods)"


def test_recall_counts_ties_and_near_ties_as_found():
    p = np.array([[0.0], [1.0], [-1.0], [2.0], [5.0]], np.float32)   # 1.0 and -1.0 tie for second
    q = np.zeros((1, 1), np.float32)
    ref = knn.exact_knn("l2", q, p, 2)
    assert ref[0, 0] == 0 and ref[0, 1] in (1, 2)
    assert knn.recall("l2", q, p, np.array([[0, 2]]), ref)[0] == 1.0
    assert knn.recall("l2", q, p, np.array([[0, 1]]), ref)[0] == 1.0
    assert knn.recall("l2", q, p, np.array([[0, 3]]), ref)[0] == 0.5       # a farther point
    assert knn.recall("l2", q, p, np.array([[0, 0]]), ref)[0] == 0.5       # a repeated index counts once
    assert knn.recall("l2", q, p, np.array([[0, 7]]), ref)[0] == 0.5       # out of range


@pytest.mark.parametrize("metric", knn.METRICS)
def test_exact_knn_matches_a_direct_sort(metric):
    rng = np.random.default_rng(1)
    q, p = rng.random((7, 5), dtype=np.float32), rng.random((50, 5), dtype=np.float32)
    direct = knn.exact_distances(metric, q, np.broadcast_to(p, (7, 50, 5)))
    np.testing.assert_array_equal(knn.exact_knn(metric, q, p, 4), np.argsort(direct, axis=1)[:, :4])


def test_budget_skips_sizes_predicted_over_it():
    budget = _methods.Budget(10.0)
    key = ("hand", "l2", "uniform", 3)
    assert budget.reason(key, 10**4) == ""                   # nothing measured yet: run
    budget.record(key, 10**4, 2.0, "n = 1e4")
    assert budget.reason(key, 5 * 10**4) == ""               # 10 s predicted: within
    why = budget.reason(key, 10**5)
    assert why.startswith("time: predicted 20 s per call > --time-budget 10 s") and "2.00 s measured at n = 1e4" in why
    assert budget.reason(key, 10**6).startswith("time: predicted 200 s")
