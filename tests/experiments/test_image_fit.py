"""Smoke run of experiments/image_fit.py at its --quick size (nothing timed is asserted; heavy: about 40 s
beside other tests, and the suite is near CI's 30 minutes; the claim it measures, a loop along a batch of
run-time size grown by XLA's figures and run at that chunk, is checked in
tests/grappler_ext/splitter/test_dynamic.py, and a Keras fit on such batches split within its limit in
tests/integration/test_dynamic_batches.py)."""

import json

import pytest

from experiments import image_fit, report


@pytest.mark.heavy
def test_quick_run_is_split_within_the_limit_with_the_naive_losses(tmp_path):
    # (Keras 3 alone, no dropout: the losses are the naive fit's)
    image_fit.main(["--quick", "--keras", "keras3", "--out", str(tmp_path)])
    with open(tmp_path / "image_fit.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = results["rows"]
    assert results["quick"] and results["fraction"] == image_fit.FRACTION and results["dropout"] == 0.0
    assert [(r["keras"], r["method"]) for r in rows] == [("keras3", "naive"), ("keras3", "tf_memsafe")]
    naive, split = rows
    assert not naive["within_limit"] and naive["chunk"] == 0, naive
    assert split["within_limit"] and split["chunk"] >= 1 and split["loss_rel_diff"] < 1e-5, split
    assert split["limit_bytes"] == int(naive["xla_bytes"] * image_fit.FRACTION)
    assert any("| keras3 | tf_memsafe |" in line for line in report.image_fit_lines(results))
