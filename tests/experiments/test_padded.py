"""Smoke run of experiments/padded.py at its --quick size (nothing timed is asserted)."""

import json

import pytest

from experiments import padded, report


@pytest.mark.heavy
def test_quick_run_is_split_within_the_limit_with_the_naive_losses(tmp_path):
    """``heavy`` (about a minute, left out of the default run: ``python -m tests -m heavy`` runs it).
    The same model's ``fit`` on padded batches, split within its limit to the unsplit fit's losses, is
    checked by tests/integration/test_padded_batches.py; the summary's table from fabricated rows by
    tests/experiments/test_report.py; this run is measured by ``python -m experiments.padded``."""
    # (Keras 3 alone: tests/integration/test_padded_batches.py fits the model under both versions, tf_keras' heavy)
    padded.main(["--quick", "--keras", "keras3", "--out", str(tmp_path)])
    with open(tmp_path / "padded.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = results["rows"]
    assert results["quick"] and results["limit_bytes"] == padded.QUICK_LIMIT
    assert {(r["keras"], r["method"]) for r in rows} == {("keras3", m) for m in ("naive", "tf_memsafe")}
    for r in rows:
        if r["method"] == "naive":
            assert not r["within_limit"] and not r["split"], r
        else:
            assert r["within_limit"] and r["split"] and r["loss_rel_diff"] < 1e-5, r
    assert any("| keras3 | 256 | tf_memsafe |" in line for line in report.padded_lines(results))
