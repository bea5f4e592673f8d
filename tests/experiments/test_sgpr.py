"""Smoke run of experiments/sgpr.py at its --quick sizes, and its data generator and loader.

The quick run (SquaredExponential, N 2000 and 4000, M 50 and 100, 3 MB limit) takes about a minute
on 2 cores; nothing timed is asserted.
"""

import csv
import dataclasses
import json

import numpy as np
import pytest

import tf_memsafe
from experiments import sgpr

# The columns issue 9 asks for, by their CSV names.
REQUIRED = {"kernel", "n", "m", "limit_bytes", "naive_bytes", "naive_source", "tf_memsafe_bytes",
            "tf_memsafe_within_limit", "tf_memsafe_s", "naive_s", "nit", "elbo", "rmse", "nlpd", "naive_elbo",
            "naive_rmse", "naive_nlpd", "elbo_rel_err", "rmse_rel_err", "nlpd_err", "check", "same_params_check"}


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.mark.heavy
def test_quick_run_fits_the_limit_and_equals_the_naive_program(tmp_path):
    """``heavy`` (56 s, left out of the default run: ``python -m tests -m heavy`` runs it).  SGPR's
    loss and gradients split within the limit and equal to the naive program's, its predictions
    split, and L-BFGS through the split program to the naive ELBO, are checked by
    tests/integration/test_sgpr.py (the loss with the tape inside and outside, the predictions,
    Scipy's training for 3 iterations and to convergence); this run is measured by
    ``python -m experiments.sgpr``, and this module's other tests run its code on small sizes."""
    # (one M: the quick run's M = 100 as well took the suite two minutes more)
    assert sgpr.main(["--quick", "--inducing", "50", "--out", str(tmp_path)]) == 0
    fields, rows = read_csv(tmp_path / "sgpr.csv")
    assert fields == [f.name for f in dataclasses.fields(sgpr.Row)] and REQUIRED <= set(fields)
    assert {(r["kernel"], r["n"], r["m"]) for r in rows} == {("se", n, "50") for n in ("2000", "4000")}
    for r in rows:
        assert r["skipped"] == "" and r["naive_skipped"] == "", r
        limit = int(r["limit_bytes"])
        # The limit bites: the program as written (XLA's figure, compiled only) is over it, tf_memsafe's within.
        assert r["naive_source"] == "measured" and int(r["naive_bytes"]) > limit, r
        assert r["tf_memsafe_within_limit"] == "True" and int(r["tf_memsafe_bytes"]) <= limit, r
        assert r["status"] == "rewritten" and "splitter" in r["plan"], r
        assert r["predict_within_limit"] == "True" and int(r["predict_bytes"]) <= limit, r
        assert float(r["tf_memsafe_s"]) > 0 and float(r["naive_s"]) > 0
        # The same loss and gradients as the naive program, at the first evaluation.
        assert float(r["loss_rel_err"]) <= 1e-8 and float(r["grad_rel_err"]) <= 1e-6, r
        assert r["check"] == "pass", r
        if r["n"] == "2000":   # --quick trains at N <= 2000
            assert r["trained"] == "True" and 0 < int(r["nit"]) <= 10 and r["nit"] == r["naive_nit"], r
            elbo, naive_elbo = float(r["elbo"]), float(r["naive_elbo"])
            assert abs(elbo - naive_elbo) <= 1e-8 * abs(naive_elbo), r
            assert abs(float(r["rmse"]) - float(r["naive_rmse"])) <= 1e-6 * float(r["naive_rmse"]), r
            assert abs(float(r["nlpd"]) - float(r["naive_nlpd"])) <= 1e-6 * max(1.0, abs(float(r["naive_nlpd"])))
            assert 0 < float(r["rmse"]) < 1    # better than predicting the (standardised) mean
            # The naive programs at tf_memsafe's trained parameters: the same loss, gradient and scores.
            assert r["same_params_check"] == "pass" and float(r["same_params_loss_rel_err"]) <= 1e-8, r
        else:
            assert r["trained"] == "False" and r["nit"] == "" and r["elbo"] == "", r
            assert r["same_params_check"] == "" and r["same_params_loss_rel_err"] == "", r
    data = json.loads((tmp_path / "sgpr.json").read_text())
    assert len(data["rows"]) == len(rows) and data["tolerances"] == sgpr.TOLERANCES
    assert {(x["m"], x["naive_largest_n_fits"], x["tf_memsafe_largest_n_fits"]) for x in data["reach"]} == {
        (50, None, 4000)}
    assert (tmp_path / "sgpr.png").stat().st_size > 10_000


def test_a_data_file_caps_the_sizes_at_its_rows_and_the_callers_options_come_back(tmp_path):
    """--data: sizes beyond the file are replaced by the largest it holds (M > N: nothing is compiled)."""
    path = tmp_path / "table.npy"
    np.save(path, sgpr.road_network(1000, seed=3))
    tf_memsafe.enable("75%", strict=True)
    before = tf_memsafe.get_options()
    assert sgpr.main(["--data", str(path), "--sizes", "1e9", "--inducing", "5000", "--kernels", "matern32",
                      "--out", str(tmp_path)]) == 0
    assert tf_memsafe.is_enabled() and tf_memsafe.get_options() == before
    _, rows = read_csv(tmp_path / "sgpr.csv")
    assert [(r["kernel"], r["n"], r["n_test"], r["data"]) for r in rows] == [("matern32", "900", "100", "table.npy")]
    assert rows[0]["skipped"] == "M = 5000 > N = 900"


def test_road_network_is_seeded_and_shaped_like_3droad():
    table = sgpr.road_network(5000, seed=1)
    assert table.shape == (5000, 4) and table.dtype == np.float64
    np.testing.assert_array_equal(table, sgpr.road_network(5000, seed=1))
    assert not np.array_equal(table, sgpr.road_network(5000, seed=2))
    road_id, lon, lat, altitude = table.T
    assert len(np.unique(road_id)) <= sgpr.ROADS and np.all(road_id >= sgpr.FIRST_ID)
    assert sgpr.LON[0] - 0.01 < lon.min() and lon.max() < sgpr.LON[1] + 0.01
    assert sgpr.LAT[0] - 0.01 < lat.min() and lat.max() < sgpr.LAT[1] + 0.01
    assert np.all(np.isfinite(altitude)) and altitude.std() > 5 * sgpr.NOISE_M   # the signal dominates the noise
    assert sgpr.UCI_3DROAD_ROWS == 434_874 and sgpr.road_network.__defaults__ == (sgpr.UCI_3DROAD_ROWS, 0)


@pytest.mark.parametrize("form", ["csv_header", "csv_plain", "whitespace", "npy"])
def test_load_table_reads_csv_and_npy(tmp_path, form):
    table = np.random.default_rng(0).standard_normal((20, 4))
    if form == "npy":
        path = tmp_path / "t.npy"
        np.save(path, table)
    else:
        path = tmp_path / "t.csv"
        delimiter = " " if form == "whitespace" else ","
        header = "id,lon,lat,alt" if form == "csv_header" else ""
        np.savetxt(path, table, delimiter=delimiter, header=header, comments="", fmt="%.17g")
    np.testing.assert_array_equal(sgpr.load_table(str(path)), table)


def test_load_table_drops_rows_that_are_not_finite_and_rejects_a_single_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("1,2,3\n4,nan,6\n7,8,9\n")
    np.testing.assert_array_equal(sgpr.load_table(str(path)), [[1, 2, 3], [7, 8, 9]])
    np.save(tmp_path / "col.npy", np.arange(5.0))
    with pytest.raises(ValueError, match="inputs and a target"):
        sgpr.load_table(str(tmp_path / "col.npy"))


def test_prepare_splits_90_10_and_standardises_with_the_training_statistics():
    rng = np.random.default_rng(0)
    n_rows = 3000
    table = np.column_stack([np.arange(n_rows), rng.normal(5, 3, (n_rows, 2)), rng.normal(-2, 7, n_rows)])
    split = sgpr.prepare(table, 1800, seed=4)
    assert split.x_train.shape == (1800, 3) and split.y_train.shape == (1800, 1)
    assert split.x_test.shape == (200, 3) and split.y_test.shape == (200, 1)          # 10 % of 2000 rows
    np.testing.assert_allclose(split.x_train.mean(0), 0, atol=1e-12)
    np.testing.assert_allclose(split.x_train.std(0), 1, rtol=1e-12)
    assert abs(split.y_train.mean()) < 1e-12 and abs(split.y_train.std() - 1) < 1e-12
    # Undoing the training statistics gives back the original rows, test rows included, none in both sets.
    ids_train = np.rint(split.x_train[:, 0] * split.x_std[0] + split.x_mean[0]).astype(int)
    ids_test = np.rint(split.x_test[:, 0] * split.x_std[0] + split.x_mean[0]).astype(int)
    assert len(set(ids_train) | set(ids_test)) == 2000 and not set(ids_train) & set(ids_test)
    np.testing.assert_allclose(split.y_test[:, 0] * split.y_std + split.y_mean, table[ids_test, -1], rtol=1e-12)
    np.testing.assert_array_equal(sgpr.prepare(table, 1800, seed=4).x_test, split.x_test)   # seeded
    with pytest.raises(ValueError, match="from a table of 3000"):
        sgpr.prepare(table, 2800)


def test_a_test_set_of_a_given_size_and_predictions_too_large_to_run():
    """``--test-points``: T rows held out instead of N/9; a prediction program whose footprint
    (compiled only) is over --run-limit is not run, and the note names it."""
    import gpflow

    table = sgpr.road_network(3000, seed=1)
    assert sgpr.largest_train(3000, test_points=1000) == 2000
    split = sgpr.prepare(table, 500, seed=2, n_test=2500)
    assert split.x_train.shape == (500, 3) and split.x_test.shape == (2500, 3)
    with gpflow.config.as_context(gpflow.config.Config(float=np.float64)):
        model = sgpr.make_model(split, 20, "se")
        figure = tf_memsafe.memory_footprint(sgpr.predictors(model, split)[1], rewrite=False)
        settings = dict(repeats=1, train=True, train_max_n=500, maxiter=1, seed=0)
        assert sgpr.predictions_over(model, split, sgpr.Settings(10**9, figure * 2, **settings), False) == ""
        why = sgpr.predictions_over(model, split, sgpr.Settings(10**9, figure // 2, **settings), False)
        # tf_memsafe's side is held to --limit when --run-limit is smaller (set to skip the naive side).
        assert sgpr.predictions_over(model, split, sgpr.Settings(figure * 2, 1, **settings), True) == ""
        over = sgpr.predictions_over(model, split, sgpr.Settings(figure // 2, 1, **settings), True)
    assert why.startswith("predictions not run: `predict_") and "> --run-limit" in why, why
    assert over.startswith("predictions not run: `predict_") and "> --limit" in over, over


def test_a_training_budget_stops_lbfgs_and_says_so():
    """``--train-hours``: L-BFGS ends at the first iteration past the budget, not converged, and the
    note says why; without a budget it runs to its own end."""
    import gpflow

    split = sgpr.prepare(sgpr.road_network(400, seed=1), 300, seed=2)
    settings = dict(limit=10**9, run_limit=10**9, repeats=1, train=True, train_max_n=300, maxiter=20, seed=0)
    with gpflow.config.as_context(gpflow.config.Config(float=np.float64)):
        stopped = sgpr.run_side(split, "se", 10, sgpr.Settings(**settings, train_hours=0.0), train=True,
                                rewritten=False)
        free = sgpr.run_side(split, "se", 10, sgpr.Settings(**settings), train=True, rewritten=False)
    assert stopped.nit == 1 and stopped.converged is False and stopped.rmse is not None, stopped
    assert "L-BFGS stopped: the 0 h training budget ran out after 1 iterations" in stopped.note, stopped.note
    assert free.nit > 1 and "L-BFGS stopped" not in free.note, free.note


def test_sizes_and_checks():
    assert sgpr.held_out_rows(2000) == 222 and sgpr.held_out_rows(10**6) == 111_111
    assert sgpr.largest_train(1000) == 900 and sgpr.largest_train(sgpr.UCI_3DROAD_ROWS) == 391_387
    for rows in (10, 999, 434_874):
        n = sgpr.largest_train(rows)
        assert n + sgpr.held_out_rows(n) <= rows < n + 1 + sgpr.held_out_rows(n + 1)
    assert sgpr.check({"elbo": 1e-9, "rmse": None}) == "pass"
    assert sgpr.check({"elbo": 2e-8, "nlpd": 1e-7}) == "FAIL: elbo 2.0e-08 > 1e-08"


def test_table_and_plot_show_model_estimates_failures_and_skipped_points(tmp_path):
    common = dict(n_test=100, data="road_network", limit_bytes=10**9, tf_memsafe_within_limit=True,
                  predict_bytes=2 * 10**9, predict_within_limit=False, tf_memsafe_s=2.0)
    rows = [sgpr.Row(kernel="se", n=10**5, m=500, naive_bytes=2 * 10**9, naive_source="measured",
                     tf_memsafe_bytes=3 * 10**8, naive_s=2.0, check="FAIL: elbo 5.0e-06 > 1e-08",
                     same_params_check="pass", **common),
            sgpr.Row(kernel="se", n=10**6, m=500, naive_bytes=2 * 10**10, naive_source="model",
                     tf_memsafe_bytes=4 * 10**8, naive_skipped="memory: model footprint 18.6 GiB > --run-limit",
                     **common),
            sgpr.Row(kernel="se", n=100, m=500, n_test=11, data="road_network", limit_bytes=10**9,
                     skipped="M = 500 > N = 100")]
    text = sgpr.table(rows, 10**9)
    assert "FAIL: elbo 5.0e-06 > 1e-08; same parameters: pass" in text
    assert "model" in text.splitlines()[4] and "yes*" in text and "M = 500 > N = 100" in text
    assert "1 of 1" in text.splitlines()[-1]
    sgpr.plot(rows, str(tmp_path / "p.png"), 10**9, "title")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_resume_keeps_the_points_of_an_earlier_run_with_the_same_settings(tmp_path):
    """--resume: points already in sgpr.json are kept, failed ones measured again, and a file written
    with other settings is refused.  (M > N points: nothing is compiled.)"""
    quick = ["--quick", "--sizes", "2000", "--out", str(tmp_path)]
    assert sgpr.main(quick + ["--inducing", "5000", "6000"]) == 0
    stored = json.loads((tmp_path / "sgpr.json").read_text())
    kept, failed = stored["rows"]
    kept.update(m=50, skipped="", tf_memsafe_s=1.25)           # as if measured
    failed.update(skipped="tf_memsafe failed: RuntimeError: out of memory")
    (tmp_path / "sgpr.json").write_text(json.dumps(stored))
    assert sgpr.main(quick + ["--inducing", "50", "6000", "--resume"]) == 0
    data = json.loads((tmp_path / "sgpr.json").read_text())
    assert [(r["m"], r["tf_memsafe_s"], r["skipped"]) for r in data["rows"]] == [
        (50, 1.25, ""), (6000, None, "M = 6000 > N = 2000")]
    assert data["note"].startswith("1 of the 2 points were carried over")
    with pytest.raises(SystemExit):
        sgpr.main(quick + ["--inducing", "50", "--resume", "--limit", "4MB"])


def test_redo_measures_the_named_points_again_and_keeps_the_rest_and_the_remark(tmp_path):
    """--resume --redo: the points the run names are measured again, the others and the earlier
    run's --note kept.  (M > N points: nothing is compiled.)"""
    quick = ["--quick", "--sizes", "2000", "--out", str(tmp_path)]
    assert sgpr.main(quick + ["--inducing", "5000", "6000", "--note", "timings shared the CPU"]) == 0
    stored = json.loads((tmp_path / "sgpr.json").read_text())
    for row in stored["rows"]:
        row["tf_memsafe_s"] = 1.25                                 # as if measured
    (tmp_path / "sgpr.json").write_text(json.dumps(stored))
    assert sgpr.main(quick + ["--inducing", "6000", "--resume", "--redo"]) == 0
    data = json.loads((tmp_path / "sgpr.json").read_text())
    assert [(r["m"], r["tf_memsafe_s"]) for r in data["rows"]] == [(5000, 1.25), (6000, None)]
    assert data["note"] == ("1 of the 2 points were carried over from an earlier run with the same settings "
                            "(--resume); timings shared the CPU")
    with pytest.raises(SystemExit):
        sgpr.main(quick + ["--inducing", "6000", "--redo"])
