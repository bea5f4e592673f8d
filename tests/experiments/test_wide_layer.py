"""Smoke run of experiments/wide_layer.py at its --quick sizes: Adam's step over the limit as written,
within it rewritten, the kernel and both moments written in place, equal to the step as written."""

import json

from experiments import wide_layer


def test_quick_run_writes_the_kernel_and_its_moments_in_place(tmp_path):
    assert wide_layer.main(["--quick", "--out", str(tmp_path), "--keras", "keras3", "--optimizers", "adam",
                            "--repeats", "1"]) == 0
    data = json.loads((tmp_path / "wide_layer.json").read_text())
    (row,) = data["rows"]
    assert row["naive_bytes"] > row["limit_bytes"] >= row["tfms_bytes"], row
    assert row["within_limit"]
    assert len(row["written_into"].split(", ")) == 3 and "kernel" in row["written_into"], row
    assert row["max_rel_diff"] < 1e-5, row
    assert (tmp_path / "wide_layer.png").exists()
