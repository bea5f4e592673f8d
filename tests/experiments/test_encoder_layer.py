"""Smoke run of experiments/encoder_layer.py at its --quick sizes (L = 512, one layer, a quarter of each
naive figure): ``fit`` on ``.batch(4)`` (the batch unknown in the step) within its limit, losses
equal to the fit as written, nothing said; the summary's table reads the row.  (The forward and the
step: ``tests/integration/test_encoder_layer.py``.)"""

import json

import pytest

from experiments import encoder_layer, report


@pytest.mark.heavy
def test_quick_run_fits_the_fit_within_its_limit(tmp_path):
    """``heavy`` (40-60 s, left out of the default run).  The layer's ``fit`` within a sixteenth of its
    step, losses equal, nothing said, is checked by tests/integration/test_encoder_layer.py."""
    assert encoder_layer.main(["--quick", "--out", str(tmp_path), "--keras", "keras3", "--programs", "fit"]) == 0
    data = json.loads((tmp_path / "encoder_layer.json").read_text())
    (row,) = data["rows"]
    assert row["program"] == "fit" and data["ratio"] == 4
    assert row["naive_bytes"] >= 4 * row["limit_bytes"] >= 4 * row["tfms_bytes"], row
    assert row["within_limit"] and row["loops"] >= 1 and not row["warned"], row
    assert row["max_rel_diff"] < 1e-4, row
    assert (tmp_path / "encoder_layer.png").exists()
    lines = report.encoder_layer_lines(data)
    assert any(line.startswith("| keras3 | fit | 1 | 512 |") for line in lines), lines
