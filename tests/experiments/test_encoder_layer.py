"""Smoke run of experiments/encoder_layer.py at its --quick sizes (L = 512, one layer, a quarter of each
naive figure): the step and ``fit`` on ``.batch(4)`` (the batch unknown in the step) within their
limits, equal to the programs as written, nothing said; the summary's table reads the rows."""

import json

from experiments import encoder_layer, report


def test_quick_run_fits_the_step_and_the_fit_within_their_limits(tmp_path):
    assert encoder_layer.main(["--quick", "--out", str(tmp_path), "--keras", "keras3",
                               "--programs", "step", "fit"]) == 0
    data = json.loads((tmp_path / "encoder_layer.json").read_text())
    rows = {r["program"]: r for r in data["rows"]}
    assert set(rows) == {"step", "fit"} and data["ratio"] == 4
    for row in rows.values():
        assert row["naive_bytes"] >= 4 * row["limit_bytes"] >= 4 * row["tfms_bytes"], row
        assert row["within_limit"] and row["loops"] >= 1 and not row["warned"], row
        assert row["max_rel_diff"] < 1e-4, row
    assert (tmp_path / "encoder_layer.png").exists()
    lines = report.encoder_layer_lines(data)
    assert any(line.startswith("| keras3 | fit | 1 | 512 |") for line in lines), lines
